"""`mlpfuse` console script.

Each command module (mlpfuse.commands, listed in `_COMMAND_MODULES`) exposes `register(subparsers)`, which adds
its parsers and sets `func` on them. Exit codes: 0 ok, 1 an expectation was broken, 2 bad input, 130 interrupted
(Ctrl-C), 141 the reader of stdout went away (a closed pipe), 143 stopped by SIGTERM.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

from mlpfuse.errors import InputError, Terminated, printable

_COMMAND_MODULES = (
    "mlpfuse.commands.walkthrough",
    "mlpfuse.commands.profile",
    "mlpfuse.commands.bench",
    "mlpfuse.commands.patch",
)


class _Parser(argparse.ArgumentParser):
    """Command-line mistakes end like every other bad input: one `mlpfuse: error:` line, exit code 2."""

    def error(self, message: str):
        self.exit(2, f"mlpfuse: error: {printable(message)} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from mlpfuse.commands._help import Formatter, examples

    parser = _Parser(
        prog="mlpfuse",
        description="See where an nn.Linear / MLP block spends its time, kernel by kernel, and make it faster.",
        epilog=examples(
            ("mlpfuse walkthrough", "start here: the whole story on this machine"),
            ("mlpfuse profile geglu-mlp --variant mlpfuse", "one workload's trace, tables and report.html"),
            ("mlpfuse bench --list", "what the benchmark can run"),
        ) + "\n\n`mlpfuse COMMAND --help` shows a command's options and more examples.",
        formatter_class=Formatter,
    )
    from mlpfuse import __version__

    parser.add_argument("--version", action="version", version=f"mlpfuse {__version__}",
                        help="print mlpfuse's version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # a bare `mlpfuse`: the commands there are, not just "arguments are required"
        parser.print_help(sys.stderr)
        return 2
    _tolerant_stdout()
    # torch's profiler (Kineto) logs two `USDT: ... profiler_start/stop` lines per capture straight to stderr; its
    # level 6 keeps them out of mlpfuse's output. KINETO_LOG_LEVEL=2 shows its warnings again.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    import warnings

    from mlpfuse._host import HostLoadWarning
    from mlpfuse._outputs import noted

    previous = _on_sigterm(_terminate)
    try:
        with noted(f"mlpfuse {args.command}"), warnings.catch_warnings():
            # Commands that time on the CPU say once that the machine is busy (a `mlpfuse: warning:` line); the
            # API's warning from each mlpfuse.profile() call inside them would repeat it in Python's format.
            warnings.simplefilter("ignore", HostLoadWarning)
            code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not as a message at interpreter exit
        return code
    except InputError as exc:
        return _fail(f"mlpfuse: error: {printable(exc)}", 2)
    except BrokenPipeError:
        return _closed_pipe()
    except Terminated:
        return _fail("mlpfuse: terminated", 143)
    except KeyboardInterrupt:
        return _fail("mlpfuse: interrupted", 130)
    finally:
        _on_sigterm(previous)


def _terminate(signum, frame):
    # Python's default for SIGTERM ends the process at once: no finally block runs, so temporary trace folders stay
    # and a partial --out says nothing. Raised as an exception, SIGTERM unwinds like Ctrl-C.
    raise Terminated()


def _on_sigterm(handler):
    """Install `handler` for SIGTERM; the one it replaces. Only the main thread may (main() called from another
    thread keeps the process's handler)."""
    if handler is None:
        return None
    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:
        return None


def _fail(line: str, code: int) -> int:
    try:
        print(line, file=sys.stderr)
    except BrokenPipeError:
        pass
    return code


def _tolerant_stdout() -> None:
    # A terminal or file whose encoding cannot show a character gets an escape, not a UnicodeEncodeError.
    reconfigure = getattr(sys.stdout, "reconfigure", None)
    if reconfigure is not None:
        try:
            reconfigure(errors="backslashreplace")
        except (ValueError, OSError):
            pass


def _closed_pipe() -> int:
    """The reader went away (`mlpfuse analyze t.json | head`): stop quietly with 141 (128 + SIGPIPE), the status
    of a tool the signal ends. Later writes, and the flush at interpreter exit, go to /dev/null."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout is no real file (captured): nothing to redirect
        pass
    return 141


if __name__ == "__main__":
    sys.exit(main())
