"""Every path a completion can name is documented where a user looks for it: the README's
table, docs/events.md's ``transfer.done`` line and the ``Completion`` message itself."""

from __future__ import annotations

import inspect
from pathlib import Path as FsPath

from protocol import messages as m
from protocol.transfer_fsm import Path

ROOT = FsPath(__file__).resolve().parent.parent


def engine_paths() -> set[str]:
    """The path names a completion can carry: the transfer state machine's ``Path`` enum."""
    return {p.value for p in Path}


def test_engine_paths_are_the_known_ones() -> None:
    assert engine_paths() == {"local", "mapped", "direct", "bounce", "fragment"}
    # and every path module of kvd/transfer/paths/ is one of them
    modules = {p.stem for p in (ROOT / "kvd" / "transfer" / "paths").glob("*.py")} - {"__init__", "base"}
    assert modules == engine_paths()


def test_every_path_is_documented() -> None:
    paths = engine_paths()
    readme = (ROOT / "README.md").read_text()
    assert {p for p in paths if f"| `{p}` |" not in readme} == set(), "README's path table"
    events = (ROOT / "docs" / "events.md").read_text()
    path_row = next(line for line in events.splitlines() if line.startswith("| `path` |"))
    assert {p for p in paths if f"`{p}`" not in path_row} == set(), "docs/events.md, transfer.done path"
    completion = inspect.getsource(m.Completion)
    comment = next(line for line in completion.splitlines() if line.strip().startswith("path: str"))
    assert {p for p in paths if f'"{p}"' not in comment} == set(), "protocol.messages.Completion.path"
    guide = (ROOT / "docs" / "getting-started.md").read_text()
    assert {p for p in paths if f"`{p}`" not in guide} == set(), "docs/getting-started.md"


def test_every_transfer_state_is_explained_in_the_readme() -> None:
    """``kvctl transfers`` shows the state machine's state names (``dest_out``, ``aborting``, ...);
    an operator finds each one explained next to the command in the README."""
    from protocol.transfer_fsm import State

    readme = (ROOT / "README.md").read_text()
    start = readme.index("Its `state` column is the side's state:")
    legend = readme[start : readme.index("`kvctl peers`", start)]
    assert {s.value for s in State if f"`{s.value}`" not in legend} == set()
