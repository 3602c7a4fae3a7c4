"""Guess first, then look: expectations about a profile, checked against its analysis.

Grammar (one expectation per string):
  kernels=N          GPU kernels per step (memsets and memcpys not counted)
  memsets=N          memsets per step;  memcpys=N  memcpys per step
  launches=N         launch API calls per step (cudaLaunchKernel, cuLaunchKernelEx, ...)
  cpu-ops=N          CPU ops per step
  FAMILY=N           kernels of a family per step (gemm, elementwise, triton_pointwise, ...; see kernel_names)
  op=NAME            the CPU op NAME ran in the steps;  no-op=NAME  it did not
  kernel~=TEXT       some kernel's name contains TEXT;  no-kernel~=TEXT  none does
Counts are per-step averages (finite, >= 0) and must match exactly.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Iterable

from mlpfuse.errors import InputError
from mlpfuse.profiling.kernel_names import FAMILIES

_COUNTS = {"kernels": "gpu_kernels", "memsets": "gpu_memsets", "memcpys": "gpu_memcpys", "launches": "launch_calls",
           "cpu-ops": "cpu_ops"}
_SYNTAX = re.compile(r"^\s*(?P<key>[A-Za-z_][\w-]*)\s*(?P<op>~=|=)\s*(?P<value>\S.*?)\s*$")


@dataclass(frozen=True)
class Expectation:
    text: str
    key: str
    op: str
    value: str


@dataclass(frozen=True)
class Result:
    expectation: str
    ok: bool
    actual: str

    @property
    def status(self) -> str:
        return "confirmed" if self.ok else "broken"

    def to_dict(self) -> dict:
        return {"expectation": self.expectation, "status": self.status, "actual": self.actual}


def parse(text: str, argument: str = "--expect") -> Expectation:
    """One expectation. `argument` is what the caller calls it in errors: `--expect` on the command line,
    `expect` from Python (mlpfuse.profile(..., expect=[...]))."""
    name = f"{argument} {text!r}" if argument.startswith("--") else f"{argument}={text!r}"
    if not isinstance(text, str):
        raise InputError(f"{argument}: expected a string like kernels=5, got {text!r}")
    m = _SYNTAX.match(text)
    if not m:
        raise InputError(f"{name}: expected KEY=VALUE or KEY~=TEXT (e.g. kernels=5, no-op=aten::add)")
    key, op, value = m.group("key"), m.group("op"), m.group("value")
    if op == "~=":
        if key not in ("kernel", "no-kernel"):
            raise InputError(f"{name}: '~=' works with kernel / no-kernel only")
    elif key in ("op", "no-op"):
        pass
    elif key in _COUNTS or key in FAMILIES:
        try:
            count = float(value)
        except ValueError:
            raise InputError(f"{name}: expected a number after '=', got {value!r}") from None
        if not 0 <= count < math.inf:  # NaN fails the comparison as well
            raise InputError(f"{name}: expected a finite count >= 0 after '=', got {value!r}")
    else:
        known = ", ".join([*_COUNTS, *FAMILIES, "op", "no-op", "kernel~", "no-kernel~"])
        raise InputError(f"{name}: unknown key {key!r}; expected one of {known}")
    return Expectation(text.strip(), key, op, value)


def check(analysis, expectations: Iterable[str], argument: str = "expectations") -> list[Result]:
    parsed = [parse(e, argument) for e in expectations]  # all parse errors before any result
    results = []
    per_step = analysis.per_step
    for e in parsed:
        if e.key in _COUNTS or e.key in FAMILIES:
            actual = per_step[_COUNTS[e.key]] if e.key in _COUNTS else per_step["families"].get(e.key, 0.0)
            ok = abs(actual - float(e.value)) < 1e-9
            results.append(Result(e.text, ok, f"{actual:g} per step"))
        elif e.key in ("op", "no-op"):
            row = analysis.op(e.value)
            present = row is not None
            actual = f"{row['per_step']:g} per step" if present else "absent"
            results.append(Result(e.text, present == (e.key == "op"), actual))
        else:
            hits = [k for k in analysis.kernel_names() if e.value in k]
            actual = ", ".join(hits[:3]) + (" ..." if len(hits) > 3 else "") if hits else "no such kernel"
            results.append(Result(e.text, bool(hits) == (e.key == "kernel"), actual))
    return results
