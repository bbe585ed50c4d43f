"""Every option of every ``kvd`` command and of ``kvctl`` says what it does, in plain text.

The parsers are walked, not the help output: a new option without ``help=`` fails here, and
so does a new command line whose parser is not listed below (the source is searched for
``ArgumentParser(``)."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import clients.kvctl
import kvd.bench.bounce_host
import kvd.bench.copy_engines
import kvd.bench.ipc
import kvd.bench.ipc_events
import kvd.bench.latency_ab
import kvd.bench.launch_cost
import kvd.bench.layouts
import kvd.bench.rawnixl
import kvd.bench.regroup
import kvd.bench.timeline
import kvd.bench.transfer
import kvd.bench.transfer_gpu
import kvd.bench.ucx_reconnect
import kvd.cli
import kvd.demo.connector
import kvd.demo.model.cli
import kvd.demo.pair

ROOT = Path(__file__).resolve().parent.parent

#: command line -> its parser (``kvd`` includes its subcommands: serve, demo, bench)
PARSERS: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "kvd": lambda: kvd.cli.build_parser()[0],
    "kvd demo": kvd.demo.pair.build_parser,
    "kvd demo --model": kvd.demo.model.cli.build_parser,
    "kvd bench ipc": kvd.bench.ipc.build_parser,
    "kvd bench regroup": kvd.bench.regroup.build_parser,
    "kvd bench transfer": kvd.bench.transfer.build_parser,
    "kvd bench transfer --device cuda": kvd.bench.transfer_gpu.build_parser,
    "kvd bench transfer --layout": kvd.bench.layouts.build_parser,
    "python -m kvd.bench.rawnixl": kvd.bench.rawnixl.build_parser,
    "python -m kvd.bench.copy_engines": kvd.bench.copy_engines.build_parser,
    "python -m kvd.bench.bounce_host": kvd.bench.bounce_host.build_parser,
    "python -m kvd.bench.latency_ab": kvd.bench.latency_ab.build_parser,
    "python -m kvd.bench.launch_cost": kvd.bench.launch_cost.build_parser,
    "python -m kvd.bench.timeline": kvd.bench.timeline.build_parser,
    "python -m kvd.bench.ipc_events": kvd.bench.ipc_events.build_parser,
    "python -m kvd.bench.ucx_reconnect": kvd.bench.ucx_reconnect.build_parser,
    "kvctl": clients.kvctl.build_parser,
    "python -m kvd.demo.connector": kvd.demo.connector.build_parser,
}
#: the modules those parsers come from
MODULES = {"kvd/cli.py", "kvd/demo/pair.py", "kvd/demo/model/cli.py", "kvd/bench/ipc.py", "kvd/bench/regroup.py",
           "kvd/bench/transfer.py", "kvd/bench/transfer_gpu.py", "kvd/bench/layouts.py", "kvd/bench/rawnixl.py", "clients/kvctl.py",
           "kvd/bench/copy_engines.py", "kvd/bench/bounce_host.py", "kvd/demo/connector.py",
           "kvd/bench/latency_ab.py", "kvd/bench/timeline.py", "kvd/bench/launch_cost.py", "kvd/bench/ipc_events.py",
           "kvd/bench/ucx_reconnect.py"}
#: reStructuredText that means nothing on a terminal
RST = re.compile(r"``|:(?:class|func|mod|meth|data|attr):`")


def _walk(name: str, parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _walk(f"{name} {sub_name}", sub)


def _all() -> list[tuple[str, argparse.ArgumentParser]]:
    return [pair for name, build in PARSERS.items() for pair in _walk(name, build())]


@pytest.mark.parametrize(("name", "parser"), _all(), ids=[name for name, _ in _all()])
def test_every_option_has_plain_help(name: str, parser: argparse.ArgumentParser) -> None:
    for text in (parser.description, parser.epilog, parser.usage):
        assert not RST.search(text or ""), (name, text)
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        what = "/".join(action.option_strings) or action.dest
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                assert choice.help and not RST.search(choice.help), (name, choice.dest)
            continue
        assert action.help and action.help != argparse.SUPPRESS, f"{name} {what} has no help"
        assert not RST.search(action.help), (name, what, action.help)
    assert not RST.search(parser.format_help()), name


@pytest.mark.parametrize(("name", "parser"), _all(), ids=[name for name, _ in _all()])
def test_every_option_with_a_value_states_its_default(name: str, parser: argparse.ArgumentParser) -> None:
    """What runs when an option is left out shows in --help: a ``--blocks`` whose help hides
    that 128 blocks (288 MiB) is what a bare ``kvd bench transfer`` moves surprises its user."""
    for action in parser._actions:
        takes_value = action.option_strings and action.nargs != 0  # not a flag (store_true, --help)
        if takes_value and action.default not in (None, "", argparse.SUPPRESS):
            assert "default" in (action.help or ""), f"{name} {'/'.join(action.option_strings)}: {action.help}"


def test_every_parser_in_the_source_is_checked() -> None:
    found = {str(p.relative_to(ROOT)) for d in ("kvd", "clients") for p in (ROOT / d).rglob("*.py")
             if "ArgumentParser(" in p.read_text()}
    assert found == MODULES, found ^ MODULES


def test_kvd_demo_help_is_plain_text() -> None:
    run = subprocess.run([sys.executable, "-m", "kvd", "demo", "--help"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("usage: kvd demo") and "``" not in run.stdout
    text = " ".join(run.stdout.split())  # argparse wraps to the terminal's width
    assert "--bounce-mb BOUNCE_MB bounce buffer of each daemon, in MiB" in text
    assert "--chunk-mb CHUNK_MB one NIXL write per chunk of this many MiB" in text
    assert "kvd demo --model --help" in run.stdout
