"""Every environment variable kvd or its clients read is named in the README, where an operator
looks for it (``KVD_CONFIG``, which ``kvd serve --help`` names, was missing from it)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NAME = re.compile(r"KVD_[A-Z0-9_]+")


def variables_read() -> set[str]:
    """Every string constant of the code that is a whole ``KVD_*`` name: what ``os.environ`` is
    asked for, directly or through a named constant (``ENV_CACHE = "KVD_KERNEL_CACHE"``)."""
    found: set[str] = set()
    for package in ("kvd", "clients", "protocol"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value):
                    found.add(node.value)
    return found


def test_every_variable_read_is_in_the_readme() -> None:
    found = variables_read()
    # the scan sees the configuration's overrides, kvd serve's and the kernel's (else it proves nothing)
    assert {"KVD_CONFIG", "KVD_SOCKET", "KVD_PEER_PORT", "KVD_KERNEL_CACHE", "KVD_POOL_USE_FABRIC_MEMORY"} <= found
    readme = (ROOT / "README.md").read_text()
    # in code spans, alone or set: `KVD_KERNEL`, `KVD_COPY_ENGINE=0` (a prefix of a longer name is not it)
    assert {v for v in found if not re.search(rf"`{v}[`=]", readme)} == set()
