"""GPU windows, busy and idle per step on hand-built traces whose answers are worked out by hand in each test."""

import pytest

from mlpfuse.errors import InputError
from mlpfuse.profiling import analyze


def X(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}


def trace(steps, kernels, extra=()):
    """steps: (name, start, end); kernels: (launch time, kernel start, kernel end[, stream]). Each kernel is
    launched by an op 'aten::mm' around its runtime call."""
    events = [X("user_annotation", name, a, b - a) for name, a, b in steps]
    for i, (launch, start, end, *stream) in enumerate(kernels):
        events.append(X("cpu_op", "aten::mm", launch - 1, 3))
        events.append(X("cuda_runtime", "cudaLaunchKernel", launch, 1, correlation=i + 1))
        events.append(X("kernel", f"k{i}", start, end - start, tid=stream[0] if stream else 7, correlation=i + 1))
    return {"traceEvents": events + list(extra)}


def table(data):
    return [(r["gpu_window_start_us"], r["gpu_window_end_us"], r["gpu_busy_us"], r["gpu_idle_us"])
            for r in data["step_table"]]


def test_cpu_a_step_ahead_queued_work_is_busy_not_idle():
    # 3 steps of 100 us on the CPU; each launches one 150 us kernel 10 us in. The GPU is the bottleneck: step 1's
    # kernel waits until step 0's ends at 170, step 2's until 320.
    data = analyze(trace([("ProfilerStep#0", 0, 100), ("ProfilerStep#1", 100, 200), ("ProfilerStep#2", 200, 300)],
                         [(10, 20, 170), (110, 170, 320), (210, 320, 470)])).to_dict()
    # windows: [CPU start 0, end of step 0's work 170], then from the previous window's end to each step's work end
    assert table(data) == [(0, 170, 150, 20), (170, 320, 150, 0), (320, 470, 150, 0)]
    assert [r["cpu_ahead_us"] for r in data["step_table"]] == [20, 70, 120]
    assert [r["launch_to_start_us"] for r in data["step_table"]] == [10, 60, 110]
    p = data["per_step"]
    assert p["gpu_idle_us"] == pytest.approx(20 / 3) and p["gpu_window_us"] == pytest.approx(470 / 3)
    assert p["cpu_ahead_steps"] == pytest.approx(60 / 100)
    assert data["verdict"]["kind"] == "compute-bound" and "launch overhead is hidden" in data["verdict"]["reason"]


def test_cpu_bound_steps_have_their_cpu_span_as_window():
    # each step: 10 us of GPU work 30 us in; the GPU waits for the CPU the rest of the time
    data = analyze(trace([("ProfilerStep#0", 0, 100), ("ProfilerStep#1", 100, 200)],
                         [(20, 30, 40), (120, 130, 140)])).to_dict()
    assert table(data) == [(0, 100, 10, 90), (100, 200, 10, 90)]
    assert data["verdict"]["kind"] == "overhead-bound"
    assert data["per_step"]["cpu_ahead_steps"] == pytest.approx(0.1)
    gaps = [(g["step"], g["start_us"], g["dur_us"], g["after"], g["before"]) for g in data["gpu_gaps"]]
    assert sorted(gaps) == [("ProfilerStep#0", 0, 30, "(trace start)", "k0"), ("ProfilerStep#0", 40, 60, "k0", "k1"),
                            ("ProfilerStep#1", 0, 30, "k0", "k1"), ("ProfilerStep#1", 40, 60, "k1", "(trace end)")]
    assert [g["dur_us"] for g in data["gpu_gaps"]] == [60, 60, 30, 30]  # largest first


def test_time_between_steps_belongs_to_no_window():
    data = analyze(trace([("ProfilerStep#0", 0, 100), ("ProfilerStep#1", 150, 250)],
                         [(10, 20, 30), (160, 170, 180)])).to_dict()
    assert table(data) == [(0, 100, 10, 90), (150, 250, 10, 90)]


def test_all_gpu_activity_in_a_window_counts_whatever_step_launched_it():
    # step 0 launches a long kernel on stream 8 that runs through step 1's CPU span; step 1's own short kernel runs
    # beside it on stream 7. Step 1's window opens when step 0's work has drained (at 250).
    data = analyze(trace([("ProfilerStep#0", 0, 100), ("ProfilerStep#1", 100, 200), ("ProfilerStep#2", 200, 300)],
                         [(10, 20, 250, 8), (110, 120, 130), (210, 260, 270)])).to_dict()
    assert table(data) == [(0, 250, 230, 20), (250, 250, 0, 0), (250, 300, 10, 40)]
    rows = data["step_table"]
    assert [r["gpu_kernels"] for r in rows] == [1, 1, 1] and all(r["in_averages"] for r in rows)
    assert data["per_step"]["gpu_busy_us"] == pytest.approx(240 / 3)  # the union over the trace, shared out


def test_a_step_without_gpu_work_is_reported_and_left_out():
    data = analyze(trace([("ProfilerStep#0", 0, 100), ("ProfilerStep#1", 100, 200), ("ProfilerStep#2", 200, 300)],
                         [(10, 20, 60), (210, 220, 260)])).to_dict()
    assert data["steps"] == 2 and data["steps_found"] == 3 and data["step_names"] == ["ProfilerStep#0",
                                                                                       "ProfilerStep#2"]
    assert data["steps_left_out"] == [{"name": "ProfilerStep#1", "reason": "no GPU work while other steps have some"}]
    assert [r["in_averages"] for r in data["step_table"]] == [True, False, True]
    assert table(data)[1] == (100, 200, 0, 100)  # its own numbers stay in the step table
    assert data["per_step"]["gpu_kernels"] == 1 and data["per_step"]["gpu_idle_us"] == 60
    assert all(g["step"] != "ProfilerStep#1" for g in data["gpu_gaps"])


def test_a_cpu_only_trace_keeps_every_step():
    data = analyze(trace([("ProfilerStep#0", 0, 100), ("ProfilerStep#1", 100, 200)], [])).to_dict()
    assert data["steps"] == 2 and data["steps_left_out"] == [] and data["verdict"]["kind"] == "cpu-only"
    assert [r["gpu_idle_us"] for r in data["step_table"]] == [0, 0]


def test_whole_trace_window_is_the_gpu_span_and_labels_are_chosen_explicitly():
    events = trace([("## Call CompiledFxGraph abc ##", 0, 100), ("## Call CompiledFxGraph abc ##", 200, 300)],
                   [(10, 50, 80), (210, 250, 260)])
    whole = analyze(events).to_dict()
    assert whole["step_source_kind"] == "whole-trace" and whole["step_names"] == ["(whole trace)"]
    assert table(whole) == [(50, 260, 40, 170)]
    assert whole["per_step"]["cpu_ahead_us"] is None and whole["verdict"]["cpu_ahead_steps"] is None
    chosen = analyze(events, label="## Call CompiledFxGraph abc ##").to_dict()
    assert chosen["steps"] == 2 and chosen["step_source"] == "label '## Call CompiledFxGraph abc ##'"
    assert table(chosen) == [(0, 100, 30, 70), (200, 300, 10, 90)]


@pytest.mark.parametrize("kwargs, words", [
    ({"label": "nope"}, "no spans named 'nope'"),
    ({"steps_from": "sideways"}, "steps-from: expected one of"),
    ({"steps_from": "ProfilerStep"}, "no ProfilerStep#N spans"),
    ({"steps_from": "label"}, "--label"),
    ({"label": "x", "steps_from": "whole-trace"}, "conflicts"),
])
def test_bad_step_choices_are_one_error(kwargs, words):
    with pytest.raises(InputError, match=words.replace("(", r"\(").replace("#", "#")):
        analyze(trace([], [(10, 20, 30)]), **kwargs)
