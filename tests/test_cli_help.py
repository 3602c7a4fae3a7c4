"""Every option and argument of every subcommand explains itself in --help; every page has a description and
examples, wraps its prose to the terminal, and each example runs as shown."""

import argparse
import subprocess
import sys

import pytest

from cli_run import cli_env
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


def _pages():
    """(name, parser) of `mlpfuse` and of each subcommand."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [("mlpfuse", parser), *sub.choices.items()]


def _example_lines(text: str) -> list[str]:
    """The example commands of a help page: its indented `mlpfuse ...` and `python3 ...` lines."""
    return [line.strip() for line in text.splitlines()
            if line.startswith("  ") and line.strip().split(" ")[0] in ("mlpfuse", "python3")]


def test_every_command_has_a_description_and_two_to_four_examples():
    for name, p in _pages():
        assert p.description, name
        count = len(_example_lines(p.epilog or ""))
        assert 2 <= count <= 4 if name != "mlpfuse" else count >= 2, (name, count)


def test_help_prose_wraps_to_the_terminal_and_examples_stay_whole(monkeypatch):
    for columns in (80, 60):
        monkeypatch.setenv("COLUMNS", str(columns))
        for name, p in _pages():
            text = p.format_help()
            commands = _example_lines(text)
            for line in (p.epilog or "").splitlines():  # every example is printed whole, on one line
                if line.strip() and line.strip().split(" ")[0] in ("mlpfuse", "python3"):
                    assert line.strip() in commands, (name, line)
            prose = [p._get_formatter()._fill_text(t, columns - 2, "") for t in (p.description, p.epilog) if t]
            for line in "\n".join(prose).splitlines():
                if line.strip() not in commands:
                    assert len(line) <= columns, (name, columns, line)
            if columns == 80:  # through a pipe: every line of the page fits 80 columns
                assert max(map(len, text.splitlines())) <= 80, name


@pytest.mark.slow
def test_every_example_in_every_help_runs_as_shown(tmp_path):
    """Each example command, copied from the help page into a shell in one fresh folder, exits 0 on this CPU machine.
    Examples with a glob read what the others wrote (analyze and diff read profile's folders): they run last."""
    seen, commands = set(), []
    for _, p in _pages():
        for line in _example_lines(p.format_help()):
            if line not in seen:
                seen.add(line)
                commands.append(line)
    commands.sort(key=lambda line: "*" in line)  # stable: otherwise in the order the pages show them
    # `mlpfuse` and `python3` as the shell would find them after install.sh, with this checkout's sources
    prelude = f'mlpfuse() {{ "{sys.executable}" -m mlpfuse "$@"; }}; python3() {{ "{sys.executable}" "$@"; }}; '
    env = cli_env(XDG_CACHE_HOME=tmp_path / "cache", MLPFUSE_CACHE_DIR=tmp_path / "cache")
    work = tmp_path / "work"
    work.mkdir()
    failed = []
    for line in commands:
        proc = subprocess.run(["bash", "-c", prelude + line], cwd=work, env=env, capture_output=True, text=True,
                              timeout=600)
        print(f"exit {proc.returncode}: {line}")  # shown with -s
        if proc.returncode != 0 or "Traceback" in proc.stderr + proc.stdout:
            failed.append(f"{line} -> {proc.returncode}: {proc.stderr[-1500:]}")
    assert len(commands) >= 15 and not failed, "\n\n".join(failed)
