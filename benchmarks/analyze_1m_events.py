"""How long `mlpfuse analyze` takes on a trace of 1,000,000 events.

Builds a Kineto-shaped trace (ProfilerStep spans; per launch: a CPU op with two metadata-only children, a runtime
launch call, the kernel on the GPU stream, and the two ac2g flow events that Kineto writes) with N events in total,
writes it as .json and .json.gz, then times load + analysis end to end (the work `mlpfuse analyze --json` does,
minus printing), median of --repeat runs.

    python benchmarks/analyze_1m_events.py [--events 1000000] [--repeat 3]

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

EVENTS_PER_LAUNCH = 7  # op, 2 child ops, runtime call, kernel, 2 flow events


def make_trace(n_events: int, launches_per_step: int = 1000) -> dict:
    events = []
    ts = 1000.0
    corr = 0
    n_launches = n_events // EVENTS_PER_LAUNCH
    n_steps = max(1, n_launches // launches_per_step)
    step_len = launches_per_step * 20.0
    for s in range(n_steps):
        events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{s}", "pid": 1, "tid": 1,
                       "ts": ts, "dur": step_len, "args": {"External id": corr}})
        t = ts + 1.0
        for i in range(launches_per_step):
            if len(events) + EVENTS_PER_LAUNCH > n_events:
                break
            corr += 1
            name = "aten::mm" if i % 3 == 0 else "aten::mul"
            kernel = ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT" if i % 3 == 0 else
                      "void at::native::vectorized_elementwise_kernel<8, at::native::BinaryFunctor<c10::BFloat16, "
                      "c10::BFloat16, c10::BFloat16, at::native::binary_internal::MulFunctor<float> >, "
                      "std::array<char*, 3ul> >(int, at::native::BinaryFunctor<c10::BFloat16, c10::BFloat16, "
                      "c10::BFloat16, at::native::binary_internal::MulFunctor<float> >, std::array<char*, 3ul>)")
            events.append({"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": 1, "ts": t, "dur": 15.0,
                           "args": {"External id": corr, "Input Dims": [[8192, 768], [768, 3072]]}})
            events.append({"ph": "X", "cat": "cpu_op", "name": "aten::t", "pid": 1, "tid": 1, "ts": t + 0.5,
                           "dur": 2.0, "args": {"External id": corr}})
            events.append({"ph": "X", "cat": "cpu_op", "name": "aten::as_strided", "pid": 1, "tid": 1,
                           "ts": t + 3.0, "dur": 1.0, "args": {"External id": corr}})
            events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                           "ts": t + 5.0, "dur": 5.0, "args": {"External id": corr, "correlation": corr}})
            events.append({"ph": "X", "cat": "kernel", "name": kernel, "pid": 0, "tid": 7, "ts": t + 12.0,
                           "dur": 6.0, "args": {"External id": corr, "correlation": corr, "stream": 7}})
            events.append({"ph": "s", "id": corr, "pid": 1, "tid": 1, "ts": t + 5.0, "cat": "ac2g", "name": "ac2g"})
            events.append({"ph": "f", "id": corr, "pid": 0, "tid": 7, "ts": t + 12.0, "cat": "ac2g",
                           "name": "ac2g", "bp": "e"})
            t += 20.0
        ts += step_len + 10.0
    while len(events) < n_events:  # pad with metadata events to the exact count
        events.append({"ph": "M", "name": "thread_name", "pid": 1, "tid": len(events), "args": {"name": "pad"}})
    return {"schemaVersion": 1, "traceEvents": events}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
    from mlpfuse.profiling.analysis import analyze

    folder = tempfile.mkdtemp(prefix="mlpfuse-bench-")
    trace = make_trace(args.events)
    n = len(trace["traceEvents"])
    plain = os.path.join(folder, "trace.json")
    gz = plain + ".gz"
    with open(plain, "w") as fh:
        json.dump(trace, fh)
    with gzip.open(gz, "wt", compresslevel=6) as fh:
        json.dump(trace, fh)
    del trace
    print(f"{n} events; {os.path.getsize(plain) / 1e6:.0f} MB json, {os.path.getsize(gz) / 1e6:.0f} MB gz; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} (other work slows the numbers)")
    for path in (plain, gz):
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            result = analyze(path)
            times.append(time.perf_counter() - t0)
        assert result.steps > 0 and result.per_step["gpu_kernels"] > 0
        print(f"{os.path.basename(path):14s} median {statistics.median(times):.2f} s "
              f"(min {min(times):.2f}, max {max(times):.2f}, {args.repeat} runs; "
              f"{result.steps} steps, {result.per_step['gpu_kernels']:g} kernels/step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
