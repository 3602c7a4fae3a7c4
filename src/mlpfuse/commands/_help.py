"""The commands' --help pages: prose wraps to the terminal's width (80 columns through a pipe), example commands
are kept whole so that each can be copied as it stands, and every page ends with examples that run as shown on a
CPU machine (tests/test_cli_help.py runs them all in one folder; those with a glob, last, read what the others
wrote).

In a description or epilog, lines that start at column 0 are prose, a blank line ends a paragraph, and an indented
line (an example) is kept as written, but for an example's `# comment`, which wraps.
"""

from __future__ import annotations

import argparse
import textwrap


class Formatter(argparse.RawDescriptionHelpFormatter):
    def _fill_text(self, text: str, width: int, indent: str) -> str:
        lines: list[str] = []
        paragraph: list[str] = []

        def end_paragraph():
            if paragraph:
                lines.extend(textwrap.wrap(" ".join(paragraph), width, initial_indent=indent,
                                           subsequent_indent=indent, break_on_hyphens=False))
                paragraph.clear()

        for line in textwrap.dedent(text).strip("\n").splitlines():
            if not line.strip():
                end_paragraph()
                lines.append("")
            elif line[0].isspace():
                end_paragraph()
                lead = indent + line[:len(line) - len(line.lstrip())]
                if line.lstrip().startswith("# "):  # an example's comment wraps; the command itself never does
                    lines.extend(textwrap.wrap(line.lstrip()[2:], width, initial_indent=lead + "# ",
                                               subsequent_indent=lead + "# "))
                else:
                    lines.append(indent + line.rstrip())
            else:
                paragraph.append(line.strip())
        end_paragraph()
        return "\n".join(lines)


def examples(*pairs: tuple[str, str]) -> str:
    """An epilog's examples: each command under a comment saying what it shows (a comment beside it would push
    the longer commands past an 80-column terminal)."""
    rows = [row for command, what in pairs for row in (f"  # {what}", f"  {command}")]
    return "\n".join(["examples:", *rows])


def add_parser(subparsers, name: str, *, help: str, description: str, epilog: str) -> argparse.ArgumentParser:
    """A subcommand's parser with this module's formatter."""
    return subparsers.add_parser(name, help=help, description=description, epilog=epilog, formatter_class=Formatter)
