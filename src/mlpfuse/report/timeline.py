"""One step as an SVG timeline: CPU op rows per thread, the runtime calls, the GPU streams, and a line from each
launch to the kernel it queued (matched by correlation id).

No script: each shape carries its own `<title>` tooltip, and a dense step gets a wider picture that the page
scrolls sideways. Every GPU activity of the step is one `<rect>` with class `kernel`, `memset` or `memcpy` (and a
`data-correlation`), so a test can count them; other steps' work inside the window is class `other-step`.
"""

from __future__ import annotations

import math

from mlpfuse.profiling import kernel_names
from mlpfuse.profiling.analysis import is_launch
from mlpfuse.profiling.trace import KERNEL, MEMCPY, MEMSET, Event
from mlpfuse.report.markup import TITLE_CHARS, css_class, esc, plural, us
from mlpfuse.report.steps import MAX_DEPTH, StepEvents

LEFT = 150  # lane labels
ROW = 16
GAP = 10
AXIS = 28
MIN_WIDTH = 1100
MAX_WIDTH = 14000
PX_PER_EVENT = 6  # a dense step gets this much width per event on its busiest lane
CHAR_PX = 6.3  # width of a character at the label font size

_GPU_CLASS = {KERNEL: "kernel", MEMSET: "memset", MEMCPY: "memcpy"}


def _nice_step(span: float, target: int) -> float:
    """A tick spacing of 1, 2 or 5 times a power of ten giving about `target` ticks."""
    raw = span / max(target, 1)
    mag = 10.0 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1, 2, 5, 10) if raw <= m * mag * (1 + 1e-9))


def _label(name: str, width: float) -> str:
    chars = int((width - 4) / CHAR_PX)
    if chars < 3:
        return ""
    return esc(name, chars)


class _Canvas:
    def __init__(self, t0: float, t1: float, width: float):
        self.t0 = t0
        self.scale = (width - LEFT - 10) / max(t1 - t0, 1e-9)
        self.parts: list[str] = []

    def x(self, t: float) -> float:
        return LEFT + (t - self.t0) * self.scale

    def rect(self, e: Event, y: float, h: float, cls: str, title: str, label: str = "", extra: str = "") -> tuple:
        start = max(e.ts, self.t0)  # another step's work may have started before this step: cut at its start
        x = self.x(start)
        w = max((e.end - start) * self.scale, 1.0)
        text = _label(label, w) if label else ""
        self.parts.append(f'<rect class="{cls}" x="{x:.2f}" y="{y:.1f}" width="{w:.2f}" height="{h}"{extra}>'
                          f"<title>{title}</title></rect>")
        if text:
            self.parts.append(f'<text x="{x + 2:.2f}" y="{y + h - 4:.1f}">{text}</text>')
        return x, w


def _when(e: Event, t0: float) -> str:
    return f"{us(e.dur)} µs at +{us(e.ts - t0)} µs"


def timeline_svg(view: StepEvents, decoded: dict[str, str], module_of: dict | None = None) -> str:
    """`decoded`: kernel name -> a short decoded description for tooltips (from the analysis's kernel table).
    `module_of`: (ts, pid, tid, name) of a kernel -> its module path (profiling.modules.kernel_modules): each GPU
    stream then gets a thin row under it, each kernel's span coloured by its module kind (report.modules.colour)."""
    t0, t1 = view.span.ts, view.window_end
    busiest = max(len(view.gpu), len(view.runtime), sum(1 for _, d in view.ops if d == 0), 1)
    width = min(max(MIN_WIDTH, busiest * PX_PER_EVENT), MAX_WIDTH)
    cv = _Canvas(t0, t1, width)
    labels: list[str] = []
    y = AXIS + 6

    threads: dict = {}
    for e, d in view.ops:
        threads.setdefault((str(e.pid), str(e.tid)), []).append((e, d))
    runtime_by_thread: dict = {}
    for e in view.runtime:
        runtime_by_thread.setdefault((str(e.pid), str(e.tid)), []).append(e)
    launch_at: dict[int, tuple[float, float]] = {}  # correlation -> (x centre, bottom y) of its runtime call

    for key in list(threads) + [k for k in runtime_by_thread if k not in threads]:
        rows = threads.get(key, [])
        depth = max((d for _, d in rows), default=-1) + 1
        if depth:
            labels.append(f'<text class="lane" x="4" y="{y + 12:.1f}">CPU ops · thread {esc(key[1], 24)}</text>')
            for e, d in rows:
                cls = "op" if e.cat == "cpu_op" else "annotation"
                cv.rect(e, y + d * ROW, ROW - 2, cls, f"{esc(e.name, TITLE_CHARS)} — {_when(e, t0)}", e.name)
            y += depth * ROW + GAP
        calls = runtime_by_thread.get(key, [])
        if calls:
            labels.append(f'<text class="lane" x="4" y="{y + 12:.1f}">runtime · thread {esc(key[1], 24)}</text>')
            for e in calls:
                cls = "launch" if is_launch(e.name) else "runtime"
                corr = f' data-correlation="{e.correlation}"' if e.correlation is not None else ""
                x, w = cv.rect(e, y, ROW - 2, cls, f"{esc(e.name, TITLE_CHARS)} — {_when(e, t0)}"
                               + (f", correlation {e.correlation}" if e.correlation is not None else ""), e.name,
                               corr)
                if e.correlation is not None:
                    launch_at[e.correlation] = (x + w / 2, y + ROW - 2)
            y += ROW + GAP

    streams: dict = {}
    for e in view.gpu:
        streams.setdefault((str(e.pid), str(e.tid)), []).append(e)
    for e in view.gpu_other:
        streams.setdefault((str(e.pid), str(e.tid)), [])
    other_by_stream: dict = {}
    for e in view.gpu_other:
        other_by_stream.setdefault((str(e.pid), str(e.tid)), []).append(e)
    links: list[str] = []
    seen_kinds: dict[str, str] = {}
    for key, events in streams.items():
        labels.append(f'<text class="lane" x="4" y="{y + 14:.1f}">GPU {esc(key[0], 12)} · stream '
                      f'{esc(key[1], 12)}</text>')
        for e in other_by_stream.get(key, []):
            cv.rect(e, y, ROW + 4, "gpu other-step",
                    f"{esc(e.name, TITLE_CHARS)} — {_when(e, t0)}; launched by another step")
        for e in events:
            kind = _GPU_CLASS.get(e.cat, "kernel")
            family = kernel_names.family_of(e.name, e.cat)
            about = decoded.get(e.name, "")
            corr = f' data-correlation="{e.correlation}"' if e.correlation is not None else ""
            title = (f"{esc(e.name, TITLE_CHARS)} — {_when(e, t0)}; {esc(family)}"
                     + (f"; {esc(about, 100)}" if about else "")
                     + (f"; correlation {e.correlation}" if e.correlation is not None else ""))
            x, _ = cv.rect(e, y, ROW + 4, f"gpu {kind} fam-{css_class(family)}", title, _short(e.name), corr)
            if e.correlation is not None and e.correlation in launch_at:
                lx, ly = launch_at[e.correlation]
                links.append(f'<line class="link" data-correlation="{e.correlation}" x1="{lx:.2f}" y1="{ly:.1f}" '
                             f'x2="{x:.2f}" y2="{y:.1f}"/>')
        y += ROW + 4
        if module_of:
            y = _module_row(cv, events, module_of, y + 2, labels, t0, seen_kinds)
        y += GAP
    if seen_kinds:  # the colour key, wrapped to the picture's width
        x = LEFT
        for key, fill in sorted(seen_kinds.items()):
            step = 24 + CHAR_PX * min(len(key), 60)
            if x + step > width and x > LEFT:
                x, y = LEFT, y + ROW
            cv.parts.append(f'<rect class="module-key" x="{x:.1f}" y="{y:.1f}" width="10" height="10" '
                            f'style="fill:{fill}"/><text class="lane" x="{x + 14:.1f}" y="{y + 9:.1f}">'
                            f'{esc(key, 60)}</text>')
            x += step
        y += ROW
    height = y + 4

    axis = _axis(cv, t0, t1, width, height)
    step_end = cv.x(view.span.end)
    marks = (f'<line class="step-edge" x1="{LEFT}" y1="{AXIS}" x2="{LEFT}" y2="{height}"/>'
             f'<line class="step-edge" x1="{step_end:.2f}" y1="{AXIS}" x2="{step_end:.2f}" y2="{height}"/>')
    counts = view.totals
    n_kernels = sum(1 for e in view.gpu if e.cat == KERNEL)
    return (
        f'<svg class="timeline" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height:.0f}" '
        f'viewBox="0 0 {width} {height:.0f}" role="img" data-step="{esc(view.span.name, 200)}" '
        f'data-step-start-us="{view.span.ts!r}" data-step-end-us="{view.span.end!r}" '
        f'data-kernels="{n_kernels}" data-gpu-total="{counts.get("gpu", 0)}">'
        f"<title>Timeline of {esc(view.span.name, 200)}</title>"
        + axis + marks + "".join(links) + "".join(cv.parts) + "".join(labels) + "</svg>"
    )


def _module_row(cv: _Canvas, events: list[Event], module_of: dict, y: float, labels: list[str], t0: float,
                seen: dict[str, str]) -> float:
    """A thin row of the stream's kernels coloured by module kind; returns the y below it."""
    from mlpfuse.report.modules import colour, colour_key

    labels.append(f'<text class="lane" x="4" y="{y + 8:.1f}">module</text>')
    for e in events:
        key = colour_key(module_of.get((e.ts, e.pid, e.tid, e.name)))
        if key is None:
            continue
        fill = seen.setdefault(key, colour(key))
        cv.rect(e, y, 8, "module", f"{esc(key, TITLE_CHARS)} — {esc(e.name, 200)}, {_when(e, t0)}", "",
                f' style="fill:{fill}"')
    return y + 10


def _short(name: str) -> str:
    from mlpfuse.profiling.render import short

    return short(name, 90)


def _axis(cv: _Canvas, t0: float, t1: float, width: float, height: float) -> str:
    span = max(t1 - t0, 1e-9)
    step = _nice_step(span, max(int((width - LEFT) / 110), 2))
    parts = [f'<line class="axis" x1="{LEFT}" y1="{AXIS}" x2="{width - 10}" y2="{AXIS}"/>']
    k = 0
    while k * step <= span + 1e-9 and k < 400:
        x = cv.x(t0 + k * step)
        parts.append(f'<line class="tick" x1="{x:.2f}" y1="{AXIS - 4}" x2="{x:.2f}" y2="{height}"/>'
                     f'<text class="tick" x="{x + 2:.2f}" y="{AXIS - 8}">{_tick(k * step)}</text>')
        k += 1
    parts.append(f'<text class="tick" x="4" y="{AXIS - 8}">µs from step start</text>')
    return "".join(parts)


def _tick(v: float) -> str:
    return f"{v:,.0f}" if v >= 10 or v == 0 else f"{v:.3g}"


def caption(view: StepEvents) -> str:
    """What the picture shows and what it leaves out, in one paragraph."""
    t = view.totals
    n = lambda kind: sum(1 for e in view.gpu if e.cat == kind)  # noqa: E731
    parts = [f"{esc(view.span.name, 200)} ({view.why}): {us(view.span.dur)} µs of host time, "
             f"{plural(n(KERNEL), 'kernel')}, {plural(n(MEMSET), 'memset')}, {plural(n(MEMCPY), 'memcpy')}, "
             f"{plural(sum(1 for e in view.runtime if is_launch(e.name)), 'launch call')}. "
             "Lines join each launch to the GPU work it queued (same correlation id); grey GPU boxes are work "
             "launched by another step."]
    left = []
    if t.get("gpu", 0) > len(view.gpu):
        left.append(f"the first {len(view.gpu):,} of {t['gpu']:,} GPU activities")
    if t.get("runtime", 0) > len(view.runtime):
        left.append(f"the first {len(view.runtime):,} of {t['runtime']:,} runtime calls")
    drawn_ops = len(view.ops)
    if t.get("ops", 0) > drawn_ops:
        deep = t.get("ops_too_deep", 0)
        left.append(f"{drawn_ops:,} of {t['ops']:,} CPU ops"
                    + (f" ({deep:,} nested deeper than {MAX_DEPTH} levels)" if deep else ""))
    if left:
        parts.append(" Drawn: " + "; ".join(left) + " (by start time); the tables count every one.")
    return "".join(parts)
