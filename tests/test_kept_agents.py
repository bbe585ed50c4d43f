"""The decisions of :class:`kvd.peer.kept_agents.KeptAgents` (sans-IO): which peer NIXL agents
stay loaded while their link is down, and which are forgotten. The daemons carrying them out
are tested in tests/test_peer_link_flap.py."""

from __future__ import annotations

import pytest

from kvd.peer.kept_agents import NEW_INSTANCE, OVER_LIMIT, Forget, KeptAgents


def test_the_same_instance_coming_back_finds_its_agent_loaded() -> None:
    k = KeptAgents()
    assert k.agent_of("gen") is None  # first link: nothing kept
    assert k.link_up("gen", "gen-1-a") == []
    assert k.link_down("gen", "gen-1-a") == []
    assert "gen" in k and k.agent_of("gen") == "gen-1-a"  # its return finds it loaded
    assert k.link_up("gen", "gen-1-a") == []
    assert len(k) == 0  # in use again: not kept while its link is up


def test_a_new_instance_forgets_the_kept_agent() -> None:
    k = KeptAgents()
    k.link_down("gen", "gen-1-a")
    assert k.agent_of("gen") != "gen-2-b"
    assert k.link_up("gen", "gen-2-b") == [Forget("gen", "gen-1-a", NEW_INSTANCE)]
    assert len(k) == 0


def test_beyond_the_limit_the_agent_kept_longest_is_forgotten() -> None:
    k = KeptAgents(limit=2)
    assert k.link_down("a", "a-1") == []
    assert k.link_down("b", "b-1") == []
    assert k.link_down("c", "c-1") == [Forget("a", "a-1", OVER_LIMIT)]
    assert k.agent_of("a") is None  # forgotten: loaded anew
    assert k.link_up("a", "a-1") == []
    assert [k.agent_of(n) for n in "abc"] == [None, "b-1", "c-1"]


def test_a_limit_of_zero_forgets_every_agent_at_once() -> None:
    k = KeptAgents(limit=0)
    assert k.link_down("gen", "gen-1-a") == [Forget("gen", "gen-1-a", OVER_LIMIT)]
    assert k.agent_of("gen") is None
    assert k.link_up("gen", "gen-1-a") == []


def test_an_agent_name_reloaded_for_another_node_is_no_longer_kept_for_the_first() -> None:
    k = KeptAgents()
    k.link_down("x", "shared")
    assert k.agent_of("y") is None
    assert k.link_up("y", "shared") == []  # loading it again for y replaces x's copy
    assert "x" not in k  # forgetting x's entry later must not remove y's agent


def test_a_second_link_down_with_another_agent_forgets_the_first() -> None:
    k = KeptAgents()
    k.link_down("gen", "gen-1-a")
    assert k.link_down("gen", "gen-2-b") == [Forget("gen", "gen-1-a", NEW_INSTANCE)]
    assert k.agent_of("gen") == "gen-2-b"


def test_a_negative_limit_is_refused() -> None:
    with pytest.raises(ValueError, match="limit"):
        KeptAgents(limit=-1)
