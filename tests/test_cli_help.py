"""Every ``agl`` command, subcommand and argument explains itself in ``--help``."""

from __future__ import annotations

import argparse

from agl_core.cli import _parser


def _missing_help(parser: argparse.ArgumentParser, path: list[str]) -> list[str]:
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helped = {choice.dest for choice in action._choices_actions if choice.help}
            for name, sub in action.choices.items():
                if name not in helped:
                    missing.append(" ".join([*path, name]) + " (the command itself)")
                missing += _missing_help(sub, [*path, name])
        elif not isinstance(action, argparse._HelpAction) and not action.help:
            missing.append(" ".join(path) + " " + ("/".join(action.option_strings) or action.dest))
    return missing


def test_every_command_and_argument_has_help():
    parser = _parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert {"train", "eval", "dev", "rollouts", "inspect", "import", "store", "gateway"} <= set(commands)
    assert _missing_help(parser, ["agl"]) == []


def test_an_argument_without_help_is_found():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    thing = sub.add_parser("thing", help="does a thing")
    thing.add_argument("--quiet", action="store_true")
    sub.add_parser("other")
    assert _missing_help(parser, ["x"]) == ["x thing --quiet", "x other (the command itself)"]
