"""docs/design.md draws the transfer state machine from the table itself."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from protocol.transfer_fsm import Role, mermaid

DOC = Path(__file__).resolve().parent.parent / "docs" / "design.md"


@pytest.mark.parametrize("role", list(Role))
def test_state_diagrams_match_the_table(role: Role) -> None:
    text = DOC.read_text()
    m = re.search(rf"<!-- mermaid:{role.value} -->\n```mermaid\n(.*?)```\n<!-- /mermaid:{role.value} -->", text, re.S)
    assert m is not None, f"no {role.value} diagram in docs/design.md"
    assert m.group(1) == mermaid(role), "docs/design.md is stale: regenerate with protocol.transfer_fsm.mermaid"
