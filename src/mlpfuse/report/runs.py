"""Reports for `analyze --html` and `diff --html`: each trace is read once and serves both the analysis and the
pictures."""

from __future__ import annotations

import os

from mlpfuse.report.build import Variant, check_target, write

_SAVED = ("made from a saved analysis (JSON), not a trace: pass the trace itself for the timeline and "
          "flamegraph")


def _name(path: str) -> str:
    base = os.path.basename(path)
    for ext in (".gz", ".json", ".trace", ".pt"):
        if base.endswith(ext) and len(base) > len(ext):
            base = base[: -len(ext)]
    return base or path


def load_variant(source: str | os.PathLike, label: str | None = None, max_bytes=None, name: str | None = None,
                 steps_from: str | None = None, graph_map: str | None = None):
    """(Analysis, Variant) for a trace file or a saved analysis JSON."""
    from mlpfuse.profiling.analysis import Analysis, analyze
    from mlpfuse.profiling.steps import AUTO
    from mlpfuse.profiling.trace import load_trace_or_json, no_gc

    path = os.fspath(source)
    with no_gc():
        loaded = load_trace_or_json(path, max_bytes)
        if isinstance(loaded, dict):
            result = Analysis.from_dict(loaded, path)
            return result, Variant(name or _name(path), result.to_dict(), no_trace=f"This page was {_SAVED}.")
        result = analyze(loaded, label=label, steps_from=steps_from or AUTO, graph_map=graph_map)
    return result, Variant(name or _name(path), result.to_dict(), trace_path=path, trace=loaded)


def analyze_to_html(source, html_path, label: str | None = None, max_bytes=None, steps_from: str | None = None,
                    graph_map: str | None = None):
    """Analyse one trace and write its page; returns the Analysis (the CLI prints it as usual)."""
    from mlpfuse.profiling.trace import no_gc

    check_target(html_path)
    # The page is built with the trace's million objects still alive: a collection then would walk them all.
    with no_gc():
        result, variant = load_variant(source, label, max_bytes, steps_from=steps_from, graph_map=graph_map)
        write(html_path, f"mlpfuse analysis: {variant.name}", [variant])
    return result


def diff_to_html(a, b, html_path, max_bytes=None):
    """Diff two traces (or saved analyses) and write the page: the diff, then each side in depth."""
    from mlpfuse.profiling.diff import diff
    from mlpfuse.profiling.trace import no_gc

    check_target(html_path)
    with no_gc():  # as in analyze_to_html
        an_a, va = load_variant(a, max_bytes=max_bytes)
        an_b, vb = load_variant(b, max_bytes=max_bytes)
        title = f"{va.name} → {vb.name}"
        va.name, vb.name = f"A: {va.name}", f"B: {vb.name}"
        result = diff(an_a, an_b)
        write(html_path, f"mlpfuse diff: {title}", [va, vb], diffs=[(f"A → B: {title}", result.to_dict())])
    return result
