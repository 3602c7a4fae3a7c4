"""How long `mlpfuse analyze TRACE --html FILE` takes on a trace of 1,000,000 events, and how large the page is.

Uses the trace of analyze_1m_events.py (142 ProfilerSteps of 1000 launches each), written as .json.gz, and
times: the whole command's work (read, analyse, page, write) and the page alone (trace and analysis in hand),
median of --repeat runs.

    python benchmarks/report_1m_events.py [--events 1000000] [--repeat 3]

Measured result (command, machine, date): benchmarks/README-profiler.md.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from analyze_1m_events import make_trace  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)

    from mlpfuse.profiling.analysis import analyze
    from mlpfuse.profiling.trace import load
    from mlpfuse.report import Variant, analyze_to_html, build_page

    folder = tempfile.mkdtemp(prefix="mlpfuse-bench-")
    path = os.path.join(folder, "trace.json.gz")
    with gzip.open(path, "wt", compresslevel=6) as fh:
        json.dump(make_trace(args.events), fh)
    page = os.path.join(folder, "report.html")
    print(f"{args.events} events, {os.path.getsize(path) / 1e6:.0f} MB gz; {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f} (other work slows the numbers)")

    whole, alone = [], []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        analyze_to_html(path, page)
        whole.append(time.perf_counter() - t0)
    trace = load(path)
    data = analyze(trace).to_dict()
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        html = build_page("1m", [Variant("1m", data, trace_path=path, trace=trace)], report_path=page)
        alone.append(time.perf_counter() - t0)
    size = os.path.getsize(page)
    assert size == len(html.encode()) or abs(size - len(html.encode())) < 200  # the stamp's minute may differ
    for what, times in (("analyze --html, end to end", whole), ("the page alone", alone)):
        print(f"{what:28s} median {statistics.median(times):.2f} s (min {min(times):.2f}, max {max(times):.2f}, "
              f"{args.repeat} runs)")
    print(f"report.html: {size / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
