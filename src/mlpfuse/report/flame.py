"""CPU time as an icicle: the op tree of the steps (Python frames too, when the trace was captured with
`with_stack=True`), frames with the same call path merged, each as wide as its CPU time per step, with the GPU
time of the work it launched (directly or through anything under it).

Nesting is by time on each thread: an event inside a longer one that started earlier is its child, as in the
analysis. The tree is built from a bounded number of events: on a large trace a run of whole steps around the
drawn one, and the page says which.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from itertools import chain

import numpy as np

from mlpfuse.profiling.analysis import is_launch
from mlpfuse.profiling.trace import ANNOTATION, CPU_OP, PYTHON, RUNTIME, Trace, event_field
from mlpfuse.report.markup import TITLE_CHARS, esc, plural, us
from mlpfuse.report.steps import Span

MAX_EVENTS = 60_000  # events the tree is built from
MAX_FRAMES = 4000  # frames drawn
MAX_ROWS = 40
WIDTH = 1200
ROW = 18
MIN_PX = 0.4  # narrower frames are not drawn (counted on the page)
CHAR_PX = 6.3

_TS, _DUR, _CORR = event_field("ts"), event_field("dur"), event_field("correlation")
_KIND_CLASS = {CPU_OP: "op", ANNOTATION: "annotation", PYTHON: "py", RUNTIME: "runtime"}


@dataclass
class Tree:
    names: list[str] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    parent: list[int] = field(default_factory=list)
    total: list[float] = field(default_factory=list)  # inclusive CPU us over the sampled steps
    calls: list[int] = field(default_factory=list)
    gpu: list[float] = field(default_factory=list)  # GPU us of the work launched under the frame
    children: list[list[int]] = field(default_factory=list)
    steps: list[Span] = field(default_factory=list)  # the steps it was built from
    of_steps: int = 0  # steps in the trace
    cut_at: float | None = None  # set when even one step had too many events: events from here on left out
    events: int = 0
    has_python: bool = False

    def add(self, name: str, kind: str, parent: int) -> int:
        self.names.append(name)
        self.kinds.append(kind)
        self.parent.append(parent)
        self.total.append(0.0)
        self.calls.append(0)
        self.gpu.append(0.0)
        self.children.append([])
        if parent >= 0:
            self.children[parent].append(len(self.names) - 1)
        return len(self.names) - 1


def _sample(spans: list[Span], chosen: int, starts: np.ndarray) -> tuple[list[Span], float | None]:
    """Whole steps around the chosen one while their events fit the budget; else the chosen step's first
    MAX_EVENTS events (the time at which it is cut is returned)."""
    lo_idx = np.searchsorted(starts, [s.ts for s in spans], side="left")
    hi_idx = np.searchsorted(starts, [s.end for s in spans], side="right")
    count = (hi_idx - lo_idx).tolist()
    if count[chosen] > MAX_EVENTS:
        return [spans[chosen]], float(starts[lo_idx[chosen] + MAX_EVENTS])
    a = b = chosen
    used = count[chosen]
    while True:
        grew = False
        for nxt in (b + 1, a - 1):
            if 0 <= nxt < len(spans) and used + count[nxt] <= MAX_EVENTS:
                used += count[nxt]
                a, b = min(a, nxt), max(b, nxt)
                grew = True
        if not grew:
            return spans[a:b + 1], None


def build(trace: Trace, spans: list[Span], chosen: int) -> Tree:
    events = list(chain(trace.annotations, trace.cpu_ops, trace.python, trace.runtime))
    ts = np.fromiter(map(_TS, events), np.float64, len(events))
    order = np.argsort(ts, kind="stable")
    starts = ts[order]
    steps, cut_at = _sample(spans, chosen, starts)
    step_names = {s.name for s in spans}
    tree = Tree(steps=steps, of_steps=len(spans), cut_at=cut_at, has_python=bool(trace.python))
    root = tree.add(f"{len(steps)} steps" if len(steps) > 1 else steps[0].name, "root", -1)
    tree.total[root] = sum(s.dur for s in steps) if cut_at is None else cut_at - steps[0].ts
    tree.calls[root] = len(steps)

    gpu_by_corr: dict[int, float] = {}
    for corr, dur in zip(map(_CORR, trace.gpu), map(_DUR, trace.gpu)):
        if corr is not None:
            gpu_by_corr[corr] = gpu_by_corr.get(corr, 0.0) + dur

    # Events starting inside a sampled step, clipped to it, grouped by thread; the step spans are the root.
    bounds = [(s.ts, s.end if cut_at is None else cut_at) for s in steps]
    bound_starts = [lo for lo, _ in bounds]
    first, last = bounds[0][0], bounds[-1][1]
    by_thread: dict[tuple[str, str], list] = {}
    window = order[np.searchsorted(starts, first, side="left"):np.searchsorted(starts, last, side="left")]
    for e in map(events.__getitem__, window.tolist()):
        if not (e.name in step_names and e.cat in (ANNOTATION, CPU_OP)):
            lo, hi = bounds[bisect.bisect_right(bound_starts, e.ts) - 1]
            if e.ts < hi:
                by_thread.setdefault((str(e.pid), str(e.tid)), []).append((e.ts, -min(e.end, hi), e))
    tree.events = sum(map(len, by_thread.values()))
    index: dict[tuple[int, str, str], int] = {}
    for thread, picked in by_thread.items():
        picked.sort(key=lambda p: p[:2])
        base = root if len(by_thread) == 1 else tree.add(f"thread {thread[1]}", "thread", root)
        stack, stack_end = [base], [float("inf")]
        for ts, neg_end, e in picked:
            end = -neg_end
            while stack_end[-1] < end - 1e-6:  # a parent holds all of its child, as in the analysis
                stack.pop()
                stack_end.pop()
            parent = stack[-1]
            key = (parent, e.name, e.cat)
            node = index.get(key)
            if node is None:
                node = index[key] = tree.add(e.name, e.cat, parent)
            tree.total[node] += end - ts
            tree.calls[node] += 1
            if e.cat == RUNTIME:
                if e.correlation is not None:
                    tree.gpu[node] += gpu_by_corr.get(e.correlation, 0.0)
            else:
                stack.append(node)
                stack_end.append(end)
        if base != root:
            tree.total[base] = sum(tree.total[c] for c in tree.children[base])
            tree.calls[base] = 1
    # GPU time so far sits on the runtime calls; a frame's is that of everything under it. A parent is always
    # made before its children, so one pass from the last frame back adds each into its parent.
    for node in range(len(tree.names) - 1, 0, -1):
        tree.gpu[tree.parent[node]] += tree.gpu[node]
    return tree


def icicle_svg(tree: Tree) -> tuple[str, int]:
    """The SVG, and how many frames were too narrow (or too deep) to draw."""
    per = max(len(tree.steps), 1)
    parts: list[str] = []
    hidden = 0
    drawn = 0
    rows = 0
    # Breadth-first, each frame laid inside its parent; a parent whose children overlap in time (threads,
    # clipped spans) scales them to fit.
    level = [(0, 0.0, float(WIDTH))]
    depth = 0
    while level and depth < MAX_ROWS:
        nxt = []
        for node, x, w in level:
            if drawn >= MAX_FRAMES:
                hidden += 1
                continue
            drawn += 1
            parts.append(_frame(tree, node, x, depth * ROW, w, per))
            kids = tree.children[node]
            if not kids:
                continue
            room = max(tree.total[node], sum(tree.total[k] for k in kids), 1e-12)
            cx = x
            for k in kids:
                kw = w * tree.total[k] / room
                if kw >= MIN_PX:
                    nxt.append((k, cx, kw))
                else:
                    hidden += _size(tree, k)
                cx += kw
        rows = depth + 1
        level = nxt
        depth += 1
    hidden += sum(_size(tree, n) for n, _, _ in level)
    height = rows * ROW + 2
    svg = (f'<svg class="flame" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {height}" '
           f'width="{WIDTH}" height="{height}" role="img" data-frames="{drawn}">'
           f"<title>CPU time by call path</title>{''.join(parts)}</svg>")
    return svg, hidden


def _size(tree: Tree, node: int) -> int:
    n, todo = 0, [node]
    while todo:
        k = todo.pop()
        n += 1
        todo.extend(tree.children[k])
    return n


def _frame(tree: Tree, node: int, x: float, y: float, w: float, per: int) -> str:
    name, kind = tree.names[node], tree.kinds[node]
    cpu, gpu, calls = tree.total[node] / per, tree.gpu[node] / per, tree.calls[node] / per
    own = (tree.total[node] - sum(tree.total[c] for c in tree.children[node])) / per
    cls = {"root": "root", "thread": "thread"}.get(kind) or _KIND_CLASS.get(kind, "op")
    if kind == RUNTIME and is_launch(name):
        cls = "launch"
    if gpu > 0:
        cls += " launched"
    title = (f"{esc(name, TITLE_CHARS)} — CPU {us(cpu)} µs per step (self {us(max(own, 0.0))})"
             + (f", {calls:,.3g} calls" if kind not in ("root", "thread") else "")
             + (f"; launched {us(gpu)} µs of GPU work" if gpu > 0 else ""))
    label = name + (f" · GPU {us(gpu)} µs" if gpu > 0 else "")
    chars = int((w - 6) / CHAR_PX)
    text = f'<text x="{x + 3:.2f}" y="{y + ROW - 6:.1f}">{esc(label, chars)}</text>' if chars >= 3 else ""
    strip = (f'<rect class="gpu-strip" x="{x:.2f}" y="{y + ROW - 4:.1f}" width="{max(w - 0.5, 0.1):.2f}" '
             f'height="3"/>' if gpu > 0 else "")
    return (f'<rect class="frame {cls}" x="{x:.2f}" y="{y:.1f}" width="{max(w - 0.5, 0.1):.2f}" '
            f'height="{ROW - 1}"><title>{title}</title></rect>{strip}{text}')


def caption(tree: Tree) -> str:
    steps = tree.steps
    what = ("CPU ops, annotations, runtime calls and Python frames" if tree.has_python
            else "CPU ops, annotations and runtime calls (no Python frames: capture with with_stack=True to "
                 "see them)")
    if tree.cut_at is not None:
        scope = (f"the first {tree.events:,} events of {esc(steps[0].name, 200)} (its first "
                 f"{us(tree.cut_at - steps[0].ts)} of {us(steps[0].dur)} µs; the step has more events than "
                 f"the {MAX_EVENTS:,} the picture is built from)")
    elif len(steps) == tree.of_steps:
        scope = f"all {plural(len(steps), 'step')}, averaged per step"
    else:
        scope = (f"{len(steps):,} of {tree.of_steps:,} steps ({esc(steps[0].name, 80)} to "
                 f"{esc(steps[-1].name, 80)}, the whole steps around the drawn one that fit a budget of "
                 f"{MAX_EVENTS:,} events), averaged per step")
    return (f"{what}, from {scope}. Width is CPU time; a frame holds what ran inside it on the same thread. "
            "Frames with a blue strip launched GPU work: the tooltip and label give its GPU time.")


def top_launchers(tree: Tree, n: int = 12) -> list[dict]:
    """Frames that launched the most GPU time themselves (deepest non-runtime frame above each launch)."""
    per = max(len(tree.steps), 1)
    rows = []
    for node, gpu in enumerate(tree.gpu):
        if gpu <= 0 or tree.kinds[node] in ("root", "thread", RUNTIME):
            continue
        below = sum(tree.gpu[c] for c in tree.children[node] if tree.kinds[c] != RUNTIME)
        own = gpu - below
        if own > 1e-9:
            path = []
            k = node
            while k > 0:
                if tree.kinds[k] != "thread":
                    path.append(tree.names[k])
                k = tree.parent[k]
            rows.append({"path": list(reversed(path)), "gpu_us": own / per, "cpu_us": tree.total[node] / per,
                         "calls": tree.calls[node] / per})
    return sorted(rows, key=lambda r: -r["gpu_us"])[:n]
