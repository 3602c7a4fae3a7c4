"""CLI commands and the walkthrough, the top layer: each module exposes `register(subparsers)` (listed in
mlpfuse.cli) and composes the library below it (profiling, bench, report, patching, workloads); nothing in the
library imports them. The allowed import directions: tests/test_layers.py."""
