"""CLI commands: each module exposes `register(subparsers)` (listed in mlpfuse.cli). Commands call into the
library (patching, profiling, bench); nothing in the library imports them."""
