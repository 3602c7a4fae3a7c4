"""`mlpfuse` console script.

Each area owns its subcommands: a module listed in `_COMMAND_MODULES` exposes `register(subparsers)`, which adds
its parsers and sets `func` on them. Exit codes: 0 ok, 1 an expectation was broken, 2 bad input.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from mlpfuse.errors import InputError

_COMMAND_MODULES = (
    "mlpfuse.walkthrough",
    "mlpfuse.profiling.commands",
    "mlpfuse.bench.commands",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlpfuse",
        description="See where an nn.Linear / MLP block spends its time, kernel by kernel, and make it faster.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except InputError as exc:
        print(f"mlpfuse: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mlpfuse: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
