"""Assemble a report: verdicts first, then the diffs, then each variant in depth (trace link, timeline of one
step, CPU flamegraph, tables), then the bench lab's plots and tables.

Inputs are the analyses' public dictionaries (as `analyze --json` writes them) and the trace files; a variant
that failed, a trace that is gone or unreadable, a trace without GPU events: each still gets its place on the
page, saying what is missing.
"""

from __future__ import annotations

import datetime as _dt
import os
import re
import urllib.parse
from dataclasses import dataclass

from mlpfuse.errors import InputError
from mlpfuse.report import flame, modules, page, steps, tables, timeline
from mlpfuse.report.markup import esc, plural, us

# Bytes the page's parts may take together (the page stays under 5 MB with its fixed parts): each part that would
# pass it is replaced by a line saying it was left out. Pictures and tables are bounded each on their own; this
# bounds their number.
PAGE_BUDGET = 4_700_000


class Budget:
    def __init__(self, size: int = PAGE_BUDGET):
        self.left = size

    def take(self, part: str, what: str) -> str:
        size = len(part.encode("utf-8", "replace"))
        if size > self.left:
            return (f'<p class="missing">{esc(what, 300)} left out: the page reached its size limit '
                    f"({PAGE_BUDGET / 1e6:.1f} MB) with the parts above. Open the trace in Perfetto, or make a page "
                    "of this trace alone with <code>mlpfuse analyze TRACE --html FILE</code>.</p>")
        self.left -= size
        return part


@dataclass
class Variant:
    """One profiled variant: its analysis (dict), trace file, or the reason it has neither."""

    name: str
    analysis: dict | None = None
    trace_path: str | None = None
    trace: object | None = None  # a loaded mlpfuse.profiling.trace.Trace, to spare reading the file again
    error: str | None = None  # why the variant did not run
    about: str = ""  # the workload, in words
    no_trace: str = ""  # why there is no trace to draw from, when the caller knows better than "none kept"
    anchor: str = ""


@dataclass
class Bench:
    """A bench result as the bench lays it out (mlpfuse.bench.outputs.page_layout for a sweep)."""

    header: dict  # command, timestamp, versions, peaks, method, notes; {}: no header
    rows: list
    plots: list  # PNG paths
    columns: object  # rows -> [(heading, row -> text)]
    caption: object  # rows -> the case's heading


def _anchor(name: str, i: int) -> str:
    return f"v{i}-" + (re.sub(r"[^A-Za-z0-9_-]+", "-", name)[:40].strip("-") or "variant")


def trace_href(trace_path: str, report_path: str) -> str:
    """The trace's address relative to the report's folder (the two usually sit side by side)."""
    try:
        rel = os.path.relpath(os.path.abspath(trace_path), os.path.dirname(os.path.abspath(report_path)))
    except ValueError:  # another drive: an absolute file URL then
        return "file://" + urllib.parse.quote(os.path.abspath(trace_path).replace(os.sep, "/"))
    return urllib.parse.quote(rel.replace(os.sep, "/"))


def _load(v: Variant) -> tuple[object | None, str]:
    """The variant's trace, or why there is none to draw from."""
    if v.trace is not None:
        return v.trace, ""
    if not v.trace_path:
        return None, v.no_trace or "No trace file was kept for this variant, so there is no timeline or flamegraph."
    from mlpfuse.profiling.trace import load

    try:
        return load(v.trace_path), ""
    except InputError as exc:
        return None, f"The trace could not be read, so there is no timeline or flamegraph: {exc}"


def _trace_block(v: Variant, report_path: str) -> str:
    if not v.trace_path:
        return ""
    href = trace_href(v.trace_path, report_path)
    name = os.path.basename(v.trace_path)
    return (f'<p>Trace: <a href="{esc(href, None)}"><code>{esc(name, 200)}</code></a> — to explore it, open '
            '<a href="https://ui.perfetto.dev">ui.perfetto.dev</a>, choose <i>Open trace file</i> and pick this '
            "file (Perfetto reads .json.gz as it is and keeps the file in your browser). This page itself loads "
            "nothing from the network.</p>")


def _pictures(v: Variant, trace, budget: Budget) -> str:
    data = v.analysis or {}
    spans = steps.step_spans(trace, data)
    if not spans:
        return '<p class="missing">The trace has no events to draw.</p>'
    chosen, why = steps.choose_step(spans, data)
    out = []

    def draw_timeline() -> str:
        view = steps.step_events(trace, spans, chosen, why)
        head = "<h3>Timeline of one step</h3>"
        if not trace.gpu:
            head += ('<p class="missing">No GPU events in this trace (a CPU run, or CUDA activity tracing was '
                     "off): the timeline shows the CPU side only.</p>")
        module_of = None
        if isinstance(data.get("modules"), dict):
            from mlpfuse.profiling.modules import kernel_modules
            module_of = kernel_modules(trace, data["modules"].get("map"))
        svg = timeline.timeline_svg(view, tables.decoded_by_name(data), module_of)
        return (head + page.legend(bool(trace.gpu), bool(trace.runtime)) + f'<figure><div class="scroll">{svg}</div>'
                f"<figcaption>{timeline.caption(view)}</figcaption></figure>")

    def draw_flame() -> str:
        tree = flame.build(trace, spans, chosen)
        svg, hidden = flame.icicle_svg(tree)
        note = (f" {plural(hidden, 'frame')} too narrow (under {flame.MIN_PX} px), too deep (past "
                f"{flame.MAX_ROWS} rows) or past the {flame.MAX_FRAMES:,} drawn are left out." if hidden else "")
        launchers = flame.top_launchers(tree)
        rows = [[esc(" › ".join(r["path"][-3:]), 300), us(r["gpu_us"]), us(r["cpu_us"]), f"{r['calls']:,.3g}"]
                for r in launchers]
        table = (tables.table(["launched from (last frames of the path)", "GPU µs /step", "CPU µs /step",
                               "calls /step"], rows, "launchers", numeric=(1, 2, 3)) if rows else "")
        return (f"<h3>CPU flamegraph</h3><figure><div class=\"scroll\">{svg}</div>"
                f"<figcaption>{flame.caption(tree)}{note}</figcaption></figure>"
                + (f"<h4>Where the GPU work was launched from</h4>{table}" if table else ""))

    for what, fn in (("the timeline", draw_timeline), ("the flamegraph", draw_flame)):
        out.append(budget.take(page.section(f"{v.name}: {what}", fn), f"{v.name}: {what}"))
    return "".join(out)


def _variant_section(v: Variant, report_path: str, budget: Budget) -> str:
    about = f' <span class="sub">{esc(v.about, 300)}</span>' if v.about else ""
    out = [f'<section id="{v.anchor}"><h2>{esc(v.name, 200)}{about}</h2>']
    if v.analysis is None:
        out.append(f'<p class="missing">Not run: {esc(v.error or "no analysis", 1000)}</p></section>')
        return "".join(out)
    data = v.analysis
    verdict = data.get("verdict") if isinstance(data.get("verdict"), dict) else {}
    out.append(f"<p>{tables.verdict_badge(verdict.get('kind'))} {esc(verdict.get('reason', ''), 800)}</p>")
    devices = data.get("devices") if isinstance(data.get("devices"), list) else []
    out.append(f'<p class="sub">Device: {esc(", ".join(map(str, devices)) or "no GPU recorded", 300)}</p>')
    out.append(tables.input_notes(data))
    out.append(_trace_block(v, report_path))
    trace, why = _load(v)
    if trace is None:
        out.append(f'<p class="missing">{esc(why, 1000)}</p>')
    else:
        out.append(_pictures(v, trace, budget))
    if isinstance(data.get("modules"), dict):
        out.append(budget.take(page.section(f"{v.name}: modules", lambda: modules.section(data["modules"])),
                               f"{v.name}: the module view"))
    out.append(budget.take(page.section(f"{v.name}: tables", lambda: (
        "<h3>Per step</h3>" + tables.per_step_table(data) + "<h3>GPU kernels</h3>" + tables.kernel_table(data)
        + "<h3>CPU ops</h3>" + tables.op_table(data) + tables.zero_kernel_table(data)
        + ("<h3>Largest GPU idle gaps</h3>" + tables.gaps_table(data) if data.get("gpu_gaps") else ""))),
        f"{v.name}: the tables"))
    out.append("</section>")
    return "".join(out)


def build_page(title: str, variants: list[Variant] = (), diffs: list[tuple[str, dict]] = (),
               bench: Bench | None = None, notes: list[str] = (), report_path: str = "report.html",
               sections: list[tuple[str, str]] = ()) -> str:
    """The whole page as a string. `diffs`: (title, diff dict) pairs; `notes`: lines shown under the title;
    `sections`: (heading, HTML the caller escaped) shown after the verdicts."""
    from mlpfuse.profiling.trace import no_gc

    with no_gc():  # traces read here hold millions of small objects, as in the analysis
        return _build_page(title, list(variants), diffs, bench, notes, report_path, sections)


def _build_page(title, variants, diffs, bench, notes, report_path, sections=()) -> str:
    for i, v in enumerate(variants):
        v.anchor = _anchor(v.name, i)
    stamp = _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    body = [f"<header><h1>{esc(title, 300)}</h1>",
            f'<p class="sub">mlpfuse report, written {esc(stamp, 60)}. One self-contained file: it loads nothing '
            "and runs no script.</p>"]
    body += [f"<p>{esc(n, 2000)}</p>" for n in notes]
    extra = [(f"s{i}", heading, html) for i, (heading, html) in enumerate(sections)]
    links = ([('verdicts', 'Verdicts')] if variants else []) + [(a, t) for a, t, _ in extra] \
        + ([('diffs', 'Diffs')] if diffs else []) \
        + [(v.anchor, v.name) for v in variants] + ([('bench', 'Bench')] if bench else [])
    body.append("<nav>" + "".join(f'<a href="#{a}">{esc(t, 80)}</a>' for a, t in links) + "</nav></header>")
    if variants:
        body.append('<section id="verdicts"><h2>Verdicts</h2>'
                    + page.section("the verdict table", lambda: tables.verdict_table(variants))
                    + '<p class="note">Per step, averaged over the profiled steps. GPU busy is the time the GPU '
                    "ran any kernel, memset or memcpy in the step's GPU window; host µs is the step's wall time "
                    "on the CPU; in launch calls, the CPU time spent inside the launch calls.</p></section>")
    body += [f'<section id="{a}"><h2>{esc(t, 200)}</h2>{html}</section>' for a, t, html in extra]
    budget = Budget()
    if diffs:
        body.append('<section id="diffs"><h2>Diffs</h2>')
        for t, d in diffs:
            body.append(f"<h3>{esc(t, 300)}</h3>" + budget.take(
                page.section(f"diff {t}", lambda d=d: tables.diff_tables(d)), f"diff {t}"))
        body.append("</section>")
    for v in variants:
        body.append(page.section(f"variant {v.name}", lambda v=v: _variant_section(v, report_path, budget)))
    if bench is not None:
        from mlpfuse.report.bench import bench_section

        body.append('<section id="bench"><h2>Bench</h2>' + budget.take(
            page.section("the bench tables", lambda: bench_section(bench.header, bench.rows, bench.plots, bench.columns,
                                                                     bench.caption)),
            "the bench plots and tables") + "</section>")
    if not variants and not diffs and bench is None:
        body.append('<p class="missing">Nothing to report: no variant, diff or bench result was given.</p>')
    body.append('<footer>Names from traces are shown as text, escaped; long names are cut on the page (the '
                "analysis JSON keeps them whole). Timelines draw one step; flamegraphs average whole steps, and "
                "say when they use only some of them.</footer>")
    return page.document(title, "".join(body))


def check_target(path: str | os.PathLike, what: str = "--html") -> str:
    """The path, if a page can be written there (checked before a long analysis, not after)."""
    try:
        path = os.fspath(path)
        folder = os.path.dirname(os.path.abspath(path))
        if not path or os.path.isdir(path):
            raise InputError(f"{what}: {path!r} is a folder or empty; expected a file name such as report.html")
        if not os.path.isdir(folder):
            raise InputError(f"{what}: folder {folder} does not exist")
    except (TypeError, ValueError) as exc:
        if isinstance(exc, InputError):
            raise
        raise InputError(f"{what}: not a usable file name ({exc})") from None
    return path


def write(path: str | os.PathLike, title: str, variants: list[Variant] = (), diffs: list[tuple[str, dict]] = (),
          bench: Bench | None = None, notes: list[str] = (), what: str = "--html",
          sections: list[tuple[str, str]] = ()) -> str:
    """Build the page and write it atomically to `path`; a path that cannot be written is one InputError."""
    from mlpfuse._io import atomic_write_text

    path = check_target(path, what)
    html = build_page(title, variants, diffs, bench, notes, report_path=path, sections=sections)
    try:
        atomic_write_text(path, html)
    except OSError as exc:
        raise InputError(f"{what}: cannot write {path} ({exc.strerror or exc})") from None
    return path
