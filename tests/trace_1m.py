"""A Kineto-shaped trace of any number of events, for the profiler's and the report's bounds on large traces.

ProfilerStep spans; per launch a CPU op with two metadata-only children, a runtime launch call, the kernel on the
GPU stream, and the two ac2g flow events Kineto writes. tests/test_report.py builds 1,000,000 of them in memory; to
time the product on it, write it out and run the command (benchmarks/README-profiler.md):

    python tests/trace_1m.py /tmp/1m.json.gz && time PYTHONPATH=src python -m mlpfuse analyze /tmp/1m.json.gz --json
"""

from __future__ import annotations

import gzip
import json
import sys

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



if __name__ == "__main__":
    with gzip.open(sys.argv[1], "wt", compresslevel=6) as fh:
        json.dump(make_trace(int(sys.argv[2]) if len(sys.argv) > 2 else 1_000_000), fh)
