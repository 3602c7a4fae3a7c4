"""The walkthrough's rounds: what each case measured in each round, the median and min–max over rounds, and the
verdict sentences, all made from those numbers.

One profiled run per variant decides nothing on a shared host (the same command gave mlpfuse's geglu-mlp step
0.58x eager's on one GPU and 1.39x on another), so every case is profiled once per round, the cases interleaved
in a carry-over-balanced order (commands/walkthrough.py `round_order`: each variant first once in three rounds, and
eager and mlpfuse each after a different variant in the other two): a clock ramp or a busy neighbour then touches
every variant alike, and neither compared variant always runs right after the same other one. A
figure's value is its median over rounds; its min–max says how far a single run can be trusted.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from mlpfuse.profiling.analysis import NA, gpu_measured

# (key in the analysis' per_step, heading, needs GPU activity to mean anything)
FIGURES = (
    ("step_us", "step µs", False),
    ("gpu_busy_us", "GPU busy µs", True),
    ("cpu_ahead_us", "GPU starts µs after the step", True),
    ("gpu_kernels", "kernels/step", True),
    ("launch_calls", "launches/step", True),
)
GPU_ONLY = {key for key, _, gpu in FIGURES if gpu}
FUSED = "mlpfuse"


@dataclass
class Spread:
    """One figure over rounds: its median and the range the rounds covered, from the recorded samples."""

    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def low(self) -> float:
        return min(self.samples)

    @property
    def high(self) -> float:
        return max(self.samples)

    def overlaps(self, other: "Spread") -> bool:
        return self.low <= other.high and other.low <= self.high

    def text(self, digits: int = 1) -> str:
        """`326.8 (312.0–341.2)`: the median, then the range when the rounds differed."""
        med = f"{self.median:.{digits}f}"
        if self.low == self.high:
            return med
        return f"{med} ({self.low:.{digits}f}–{self.high:.{digits}f})"


@dataclass
class Rounds:
    """Per case, its analyses in round order; `order` is (round, case) as they ran."""

    workloads: dict[str, tuple[str, str]]  # case -> (workload, variant)
    runs: dict[str, list] = field(default_factory=dict)
    order: list[tuple[int, str]] = field(default_factory=list)

    def add(self, round_index: int, case: str, analysis) -> None:
        self.runs.setdefault(case, []).append(analysis)
        self.order.append((round_index, case))

    def drop(self, case: str) -> None:
        self.runs.pop(case, None)

    @property
    def count(self) -> int:
        return max((len(v) for v in self.runs.values()), default=0)

    def gpu(self, case: str) -> bool:
        """Whether the case's steps held GPU activity (a CPU run has no GPU window, busy time or launches)."""
        return any(gpu_measured(a.to_dict())[0] for a in self.runs[case])

    def spread(self, case: str, key: str) -> Spread | None:
        if key in GPU_ONLY and not self.gpu(case):
            return None
        values = [a.per_step.get(key) for a in self.runs[case]]
        values = [float(v) for v in values if v is not None]
        return Spread(tuple(values)) if values else None

    def median_round(self, case: str) -> int:
        """The round whose step time is the median (the lower middle one for an even count): its trace and tables
        stand for the case."""
        steps = [a.per_step["step_us"] for a in self.runs[case]]
        ranked = sorted(range(len(steps)), key=lambda i: steps[i])
        return ranked[(len(ranked) - 1) // 2]

    def representative(self, case: str):
        return self.runs[case][self.median_round(case)]

    def to_dict(self) -> dict:
        out = {"rounds": self.count, "order": [[r, c] for r, c in self.order], "cases": {}}
        for case in self.runs:
            figures = {}
            for key, _, _ in FIGURES:
                s = self.spread(case, key)
                figures[key] = None if s is None else {"samples": list(s.samples), "median": s.median, "min": s.low,
                                                       "max": s.high}
            out["cases"][case] = {"median_round": self.median_round(case), "figures": figures}
        return out


def cells(rounds: Rounds, case: str) -> list[str]:
    """The figures of one case as table cells, in FIGURES order ("n/a" where the run cannot measure it)."""
    out = []
    for key, _, _ in FIGURES:
        s = rounds.spread(case, key)
        out.append(NA if s is None else s.text(0 if key in ("gpu_kernels", "launch_calls") else 1))
    return out


def _op_growth(slow, fast) -> tuple[str, float] | None:
    """The CPU op whose self time per step grew most from `fast`'s median round to `slow`'s."""

    def self_us(analysis) -> dict[str, float]:
        data = analysis.to_dict()
        n = data.get("steps") or 1
        return {o["name"]: o["cpu_self_us"] / n for o in data.get("ops", [])}

    a, b = self_us(slow), self_us(fast)
    grown = {name: a.get(name, 0.0) - b.get(name, 0.0) for name in set(a) | set(b)}
    name = max(grown, key=grown.get, default=None)
    return (name, grown[name]) if name is not None and grown[name] > 0 else None


def _why(rounds: Rounds, slow: str, fast: str, fast_variant: str) -> str:
    """Which part of the step grew, from the medians: the wait before the GPU starts, GPU busy time, the rest."""
    step = rounds.spread(slow, "step_us").median - rounds.spread(fast, "step_us").median
    parts = []
    if rounds.gpu(slow) and rounds.gpu(fast):
        busy_s, busy_f = rounds.spread(slow, "gpu_busy_us"), rounds.spread(fast, "gpu_busy_us")
        start_s, start_f = rounds.spread(slow, "cpu_ahead_us"), rounds.spread(fast, "cpu_ahead_us")
        d_busy = busy_s.median - busy_f.median
        d_start = start_s.median - start_f.median if start_s and start_f else None
        pieces = {"GPU busy time": d_busy}
        if d_start is not None:
            pieces["the wait before the GPU starts"] = d_start
        pieces["GPU idle after it starts"] = step - sum(pieces.values())
        main = max(pieces, key=pieces.get)
        parts.append(f"of the {step:.1f} µs more, most is {main} (+{pieces[main]:.1f} µs)")
        if d_start is not None:
            parts.append(f"its GPU work started {start_s.median:.1f} µs after the step's CPU start, "
                         f"{fast_variant}'s {start_f.median:.1f}")
        parts.append(f"GPU busy {busy_s.median:.1f} µs against {busy_f.median:.1f}")
    else:
        parts.append(f"on a CPU the step is its ops' own time ({step:.1f} µs more)")
    grown = _op_growth(rounds.representative(slow), rounds.representative(fast))
    if grown is not None:
        parts.append(f"the CPU op that grew most is `{grown[0]}` (+{grown[1]:.1f} µs self time per step)")
    return "; ".join(parts)


def verdicts(rounds: Rounds) -> list[str]:
    """One sentence per workload: is mlpfuse's step the shortest (median over rounds), and if not, why not."""
    by_workload: dict[str, dict[str, str]] = {}
    for case, (workload, variant) in rounds.workloads.items():
        if case in rounds.runs:
            by_workload.setdefault(workload, {})[variant] = case
    out = []
    n = rounds.count
    for workload, cases in by_workload.items():
        if FUSED not in cases or len(cases) < 2:
            continue
        steps = {v: rounds.spread(c, "step_us") for v, c in cases.items()}
        fused = steps[FUSED]
        others = {v: s for v, s in steps.items() if v != FUSED}
        best = min(others, key=lambda v: others[v].median)
        against = ", ".join(f"{v}'s {s.median:.1f} ({fused.median / s.median:.2f}× its time)"
                            for v, s in others.items())
        head = f"{workload}: mlpfuse's step, {fused.median:.1f} µs (median of {n} round{'s' * (n != 1)}),"
        if fused.median < others[best].median:
            text = f"{head} is the shortest, against {against}."
        else:
            text = (f"{head} is not the shortest: {best}'s is {others[best].median:.1f} µs "
                    f"({fused.median / others[best].median:.2f}× its time). Why: "
                    f"{_why(rounds, cases[FUSED], cases[best], best)}.")
        if n > 1 and fused.overlaps(others[best]):
            text += (f" The rounds overlap (mlpfuse {fused.low:.1f}–{fused.high:.1f} µs, {best} "
                     f"{others[best].low:.1f}–{others[best].high:.1f}): this run does not settle which is faster.")
        out.append(text)
    return out


def markdown_table(rounds: Rounds, described: dict[str, str] | None = None) -> list[str]:
    """The rounds as a Markdown table: median (min–max) per figure, n/a where the run cannot measure it."""
    heads = ["case"] + (["workload"] if described else []) + [h for _, h, _ in FIGURES] + ["verdict"]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for case in rounds.runs:
        verdict = rounds.representative(case).verdict["kind"]
        about = [described[case]] if described else []
        lines.append("| " + " | ".join([case, *about, *cells(rounds, case), verdict]) + " |")
    return lines


def readme_table(rounds: Rounds, device_name: str, command: str, versions: str) -> str:
    """readme-table.md: the table and verdicts the README shows, as this run measured them, with what ran it."""
    n = rounds.count
    lines = [f"Median of {n} interleaved round{'s' * (n != 1)} (min–max in brackets), {device_name}, {versions} — "
             f"`{command}`:", ""]
    lines += markdown_table(rounds) + [""]
    lines += [f"- {v}" for v in verdicts(rounds)]
    return "\n".join(lines) + "\n"
