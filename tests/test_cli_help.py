"""Every command line explains itself: for each parser and sub-parser of `python -m backbone`,
`python -m worker`, `python -m relay`, `python -m ledger` and `kvasir`, --help shows the
defaults, every argument has a help text, and a component's --log-level takes only its
choices (`--log-level bogus` is a usage error, exit 2).

In process: the parsers are built as the commands build them, nothing is run."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Iterator

import pytest

from kvasir_rpc import LOG_LEVELS, HelpFormatter

# The module of each command, and whether it must have --log-level (a component's does).
COMMANDS = {
    "backbone.cli": True,
    "worker.__main__": True,
    "relay.__main__": True,
    "ledger.__main__": True,
    "kvasir.cli": False,
}


class _Built(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def _parser_of(module_name: str, monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """The module's ``build_parser()``; else the parser its ``main`` builds, caught as main
    asks it to parse (so main runs no further)."""
    module = importlib.import_module(module_name)
    build: Callable[[], argparse.ArgumentParser] | None = getattr(module, "build_parser", None)
    if build is not None:
        return build()

    def caught(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> object:
        raise _Built(self)

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", caught)
        m.setattr(argparse.ArgumentParser, "parse_known_args", caught)
        with pytest.raises(_Built) as built:
            module.main([])
    return built.value.parser


def _walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every (sub-command path, parser) under ``parser``, itself first."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, (*path, name))


def _leaves(parser: argparse.ArgumentParser) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    return [(path, p) for path, p in _walk(parser)
            if not any(isinstance(a, argparse._SubParsersAction) for a in p._actions)]


def _own_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, (argparse._HelpAction, argparse._VersionAction))
            and a.help != argparse.SUPPRESS]


def _shows_default(action: argparse.Action) -> bool:
    """Whether HelpFormatter prints this action's default (argparse leaves out a positional's)."""
    if action.default in (None, False, argparse.SUPPRESS) or isinstance(action, argparse._SubParsersAction):
        return False
    return bool(action.option_strings) or action.nargs in ("?", "*")


@pytest.mark.parametrize("module_name", sorted(COMMANDS))
def test_every_parser_shows_defaults_and_helps_every_argument(module_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    root = _parser_of(module_name, monkeypatch)
    problems: list[str] = []
    for path, parser in _walk(root):
        where = " ".join([root.prog, *path])
        if not issubclass(parser.formatter_class, HelpFormatter):  # type: ignore[arg-type]
            cls = parser.formatter_class
            problems.append(f"{where}: formatter_class is {cls.__module__}.{cls.__qualname__}, "  # type: ignore[attr-defined]
                            "not kvasir_rpc.HelpFormatter (no defaults in --help)")
        text = parser.format_help()
        for action in _own_actions(parser):
            name = "/".join(action.option_strings) or action.dest
            if isinstance(action, argparse._SubParsersAction):
                missing = [n for n, a in zip(action.choices, action._choices_actions) if not a.help]
                if missing:
                    problems.append(f"{where}: sub-commands without help: {', '.join(missing)}")
                continue
            if not (action.help or "").strip():
                problems.append(f"{where}: {name} has no help text")
            elif _shows_default(action) and "default" not in text.split(name, 1)[-1]:
                problems.append(f"{where}: {name}'s default {action.default!r} is not shown")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("module_name", sorted(COMMANDS))
def test_log_level_takes_only_its_choices(module_name: str, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    root = _parser_of(module_name, monkeypatch)
    problems: list[str] = []
    seen = 0
    for path, parser in _leaves(root):
        where = " ".join([root.prog, *path])
        level = next((a for a in parser._actions if "--log-level" in a.option_strings), None)
        if level is None:
            continue
        seen += 1
        if tuple(level.choices or ()) != LOG_LEVELS:
            problems.append(f"{where}: --log-level choices {level.choices!r}, not {LOG_LEVELS} "
                            "(use kvasir_rpc.add_log_level)")
        try:
            root.parse_args([*path, "--log-level", "bogus"])
            code: object = "no error"
        except SystemExit as exited:
            code = exited.code
        err = capsys.readouterr().err
        if code != 2 or "invalid choice: 'bogus'" not in err:
            problems.append(f"{where}: --log-level bogus gave {code}: {err.strip()[-200:]}")
    if COMMANDS[module_name] and not seen:
        problems.append(f"{root.prog}: no --log-level anywhere")
    assert not problems, "\n".join(problems)
