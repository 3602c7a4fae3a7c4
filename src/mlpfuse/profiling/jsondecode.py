"""JSON text -> Python objects, through msgspec when it is installed (twice as fast on large traces), with the
standard library's `json.loads` deciding everything msgspec does not read exactly as it would.

msgspec agrees with `json.loads` on every document it accepts (tests/test_trace_json.py checks edge cases and
fuzzed documents), and refuses what `json` reads differently or not at all: NaN and Infinity, numbers beyond a
float's range, lone surrogates, a byte order mark, UTF-16/32, malformed UTF-8. What it refuses goes to `json`,
so the accepted documents, the results and every error stay those of the standard library. Nesting is the one
thing msgspec would accept further than `json` (whose limit is the interpreter's recursion depth): its decoder
here takes documents nested at most `FAST_DEPTH` containers deep, far deeper than any profiler trace, and leaves
deeper ones to `json`.

Running out of memory is the other difference: msgspec (0.22) crashes the process when an allocation fails
mid-document, where `json` raises MemoryError. Under a memory cap (`ulimit -v` / `-d`) msgspec therefore reads only
documents that fit with a wide margin, and `json` the rest.
"""

from __future__ import annotations

import functools
import json
import math
from typing import Any, Callable, Union

FAST_DEPTH = 9  # containers inside containers; Kineto traces reach 7 (an event's args holding lists of shapes)
PARSED_PER_BYTE = 8  # parsed objects take ~5.4x the JSON text they come from (a 130 MB events list); with a margin


@functools.cache
def _fast() -> Callable[[bytes], Any] | None:
    """msgspec's decoder of JSON values nested at most FAST_DEPTH deep, or None where msgspec is not installed."""
    try:
        import msgspec
    except ImportError:
        return None
    # A recursive alias would allow any depth; unrolled, the type ends at FAST_DEPTH. It doubles per level (list and
    # dict each hold the level below), which bounds FAST_DEPTH: this one takes ~20 ms to make.
    value = Union[None, bool, int, float, str]
    for _ in range(FAST_DEPTH):
        value = Union[None, bool, int, float, str, list[value], dict[str, value]]
    return msgspec.json.Decoder(value).decode


def room() -> float:
    """Bytes this process may still map under its address-space and data limits (RLIMIT_AS, RLIMIT_DATA); inf where
    neither is set, 0 where one is set but the process's usage cannot be read."""
    try:
        import resource
    except ImportError:  # no such limits to hit
        return math.inf
    limits = [resource.getrlimit(which)[0] for which in (resource.RLIMIT_AS, resource.RLIMIT_DATA)]
    if all(limit == resource.RLIM_INFINITY for limit in limits):
        return math.inf
    try:
        with open("/proc/self/statm") as fh:
            fields = fh.read().split()
    except OSError:
        return 0.0
    page = resource.getpagesize()
    used = (int(fields[0]) * page, int(fields[5]) * page)  # whole address space; data and stack
    return min(limit - u for limit, u in zip(limits, used) if limit != resource.RLIM_INFINITY)


def available() -> bool:
    """Whether the fast decoder is installed (msgspec)."""
    return _fast() is not None


def loads(raw: bytes, fast: bool = True) -> Any:
    """`json.loads(raw)`'s result or exception, faster where msgspec is installed; `fast=False`: json alone."""
    decode = _fast() if fast and len(raw) * PARSED_PER_BYTE < room() else None
    if decode is not None:
        try:
            return decode(raw)
        except MemoryError:  # json would need as much again: the caller says so
            raise
        except Exception:  # anything msgspec cannot read exactly as json does: json reads it, or says why not
            pass
    return json.loads(raw)
