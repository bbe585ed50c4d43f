"""The repository stands alone: no tracked file points to a document outside it or to an
issue tracker's numbers (a reader of a clone has neither), and every repository path a tracked
file names (``docs/….md``, ``kvd/….py``, ``systemd/…``) exists.

The patterns are written so that this file does not match them itself.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

FORBIDDEN = {
    "the design document outside the repository": re.compile(r"DESIGN\.md"),
    "a folder outside the repository": re.compile(r"shared\s+folder|/work/shar[e]d|shar[e]d/reference"),
    "an issue number": re.compile(r"\b[Ii]ssues?\s+#?\d"),
    "a '#<number>' reference": re.compile(r"#\d"),
}


#: A repository-relative path: a top-level folder of the repository, then a file name with one of
#: the extensions a reader would open. Not preceded by a path character, so that absolute paths
#: such as /etc/kvd/kvd.toml or /usr/share/doc/kvd/README.md are not taken for repository paths.
REPO_PATH = re.compile(
    r"(?<![\w/.-])(?:docs|systemd|kvd|protocol|clients|tests)/[\w./-]*\w"
    r"\.(?:md|txt|json|png|log|py|toml|service|sysusers)\b"
)


def tracked_files() -> list[Path]:
    """The files git tracks (a clone's content); every file but .git/ and venvs elsewhere."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
        ).stdout
        names = [n for n in out.decode().split("\0") if n]
    except (OSError, subprocess.CalledProcessError):  # an unpacked source tree, no git
        skip = {".git", ".venv", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache"}
        names = [
            str(p.relative_to(ROOT))
            for p in ROOT.rglob("*")
            if p.is_file() and not skip.intersection(p.relative_to(ROOT).parts)
        ]
    return [ROOT / n for n in names if (ROOT / n).is_file()]


def offending_lines() -> list[str]:
    found = []
    for path in tracked_files():
        data = path.read_bytes()
        if b"\0" in data:  # binary (the figures' PNG)
            continue
        for lineno, line in enumerate(data.decode(errors="replace").splitlines(), 1):
            for what, pattern in FORBIDDEN.items():
                if pattern.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{lineno}: {what}: {line.strip()}")
    return found


def dangling_paths() -> list[str]:
    found = []
    for path in tracked_files():
        data = path.read_bytes()
        if b"\0" in data:
            continue
        for lineno, line in enumerate(data.decode(errors="replace").splitlines(), 1):
            for name in REPO_PATH.findall(line):
                if not (ROOT / name).exists():
                    found.append(f"{path.relative_to(ROOT)}:{lineno}: {name} does not exist")
    return found


def test_tracked_files_are_found() -> None:
    names = {str(p.relative_to(ROOT)) for p in tracked_files()}
    assert {"README.md", "pyproject.toml", "systemd/kvd.service", "docs/events.md", "kvd/cli.py"} <= names


def test_no_reference_outside_the_repository() -> None:
    found = offending_lines()
    assert not found, "\n".join(found)


def test_every_repository_path_named_exists() -> None:
    """A renamed or never-written file leaves a reader at a dead end (the README once sent
    newcomers to a design document that is not in the repository)."""
    found = dangling_paths()
    assert not found, "\n".join(found)


def test_the_repository_path_pattern() -> None:
    assert REPO_PATH.findall("see `docs/getting-started.md` and kvd/regroup/plan.py.") == [
        "docs/getting-started.md", "kvd/regroup/plan.py"]
    assert REPO_PATH.findall("(`kvd serve --config /etc/kvd/kvd.toml`)") == []
    assert REPO_PATH.findall("Documentation=file:/usr/share/doc/kvd/README.md") == []
    assert REPO_PATH.findall("install -D systemd/kvd.service /etc/systemd/system/kvd.service") == [
        "systemd/kvd.service"]


def test_the_patterns_catch_what_they_must() -> None:
    """Self-check: each pattern matches the kind of reference it forbids, and not plain text."""
    design = "DESIGN" + ".md"
    samples = {
        f"see {design}, 'Pool memory policy'": "the design document outside the repository",
        "the design is in the project's shared" + " folder": "a folder outside the repository",
        "Issue" + " 7, kvctl": "an issue number",
        "(issue" + " 4's target)": "an issue number",
        "fixed in #" + "12": "a '#<number>' reference",
    }
    for text, what in samples.items():
        assert FORBIDDEN[what].search(text), text
    for plain in ["# a comment", "issues with tp_size", "[[peers]]", "kvd: error: ..."]:
        assert not any(p.search(plain) for p in FORBIDDEN.values()), plain
