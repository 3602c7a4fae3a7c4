"""Every option and argument of every subcommand explains itself in --help."""

import argparse

from mlpfuse.cli import build_parser


def _actions(parser, path):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _actions(sub, path + [name])
        elif not isinstance(action, argparse._HelpAction):
            yield " ".join(path), action


def test_every_option_has_help_text():
    missing = [f"{cmd}: {'/'.join(a.option_strings) or a.dest}" for cmd, a in _actions(build_parser(), ["mlpfuse"])
               if not a.help or a.help == argparse.SUPPRESS]
    assert missing == []


def test_the_analyze_help_names_the_step_sources(capsys):
    try:
        build_parser().parse_args(["analyze", "--help"])
    except SystemExit as exc:
        assert exc.code == 0
    out = capsys.readouterr().out
    assert "--steps-from" in out and "whole-trace" in out and "--label" in out
