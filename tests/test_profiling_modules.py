"""GPU time per module (profiling/modules.py): eager kernels by their module annotation, CUDA-graph replays through
a map of an eager run. Hand-built traces with known truth (which module launched which kernel), then a real capture
of a CPU model for the annotations themselves."""

import gzip
import json

import pytest

from cli_run import assert_one_error_line, run_cli
from mlpfuse.errors import InputError
from mlpfuse.profiling import analyze, modules
from mlpfuse.profiling import trace as trace_mod

P = modules.PREFIX


class Builder:
    """Kineto-shaped events: annotations and launches on CPU thread 1, kernels on GPU streams."""

    def __init__(self):
        self.events, self.corr = [], 100

    def span(self, name, ts, dur, cat="user_annotation"):
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur})

    def launch(self, ts, kernels, api="cudaLaunchKernel"):
        """A runtime call at `ts` and its kernels [(name, gpu start, dur, stream)], all on one correlation id."""
        self.corr += 1
        self.events.append({"ph": "X", "cat": "cuda_runtime", "name": api, "pid": 1, "tid": 1, "ts": ts, "dur": 2,
                            "args": {"correlation": self.corr}})
        for name, start, dur, stream in kernels:
            self.events.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": start,
                                "dur": dur, "args": {"correlation": self.corr, "stream": stream}})

    def trace(self):
        return trace_mod.from_json({"traceEvents": self.events})


def _rows(view, key="rows"):
    return {r["module"]: (r["kernels"], r["gpu_us"]) for r in view[key]}


def _eager_layer(b, base, layer):
    """One layer: its mlp's up GEMM launched inside the mlp, its down GEMM inside down_proj, a norm kernel in the
    layer outside any child."""
    b.span(f"{P}model.layers.{layer}", base, 60)
    b.launch(base + 2, [("norm_kernel", 1000 + base, 3, 7)])
    b.span(f"{P}model.layers.{layer}.mlp", base + 10, 40)
    b.span("aten::mm", base + 11, 8, cat="cpu_op")
    b.launch(base + 12, [("gemm_up", 1004 + base, 10, 7)])
    b.span(f"{P}model.layers.{layer}.mlp.down_proj", base + 30, 10)
    b.span("aten::mm", base + 30.5, 8, cat="cpu_op")
    b.launch(base + 31, [("gemm_down", 1015 + base, 5, 7)])


def test_eager_kernels_belong_to_the_innermost_annotation_of_their_launch():
    b = Builder()
    b.span(f"{P}", 0, 500)
    b.span(f"{P}model", 1, 400)
    _eager_layer(b, 10, 0)
    _eager_layer(b, 100, 1)
    b.launch(450, [("outside", 2000, 4, 7)])  # launched in the root, outside `model`
    b.launch(600, [("stray", 2100, 6, 7)])  # launched outside every annotation
    view = modules.module_view(b.trace())
    rows = _rows(view)
    assert rows["model.layers.0.mlp.down_proj"] == (1, 5)
    assert rows["model.layers.0.mlp"] == (2, 15)
    assert rows["model.layers.1"] == (3, 18)
    assert rows["model"] == (6, 36)
    assert rows["(all modules)"] == (7, 40)
    assert _rows(view, "kinds")["model.layers.*.mlp"] == (4, 30)
    assert view["kernel_us"] == 46 and view["attributed_us"] == 40
    assert view["unattributed"] == [{"reason": modules.NO_ANNOTATION, "kernels": 1, "gpu_us": 6}]


def _map():
    return [("norm_kernel", "model.layers.0", ""), ("gemm_up", "model.layers.0.mlp", "aten::mm"),
            ("gemm_down", "model.layers.0.mlp.down_proj", "aten::mm"), ("norm_kernel", "model.layers.1", ""),
            ("gemm_up", "model.layers.1.mlp", "aten::mm"), ("gemm_down", "model.layers.1.mlp.down_proj", "aten::mm")]


def _replay(b, ts, names, gpu_start, stream_of=lambda i: 7):
    b.launch(ts, [(n, gpu_start + 10 * i, 4, stream_of(i)) for i, n in enumerate(names)], api="cudaGraphLaunch")


def test_a_replay_twice_per_step_is_attributed_through_the_map_with_its_bubbles():
    b = Builder()
    names = [e[0] for e in _map()]
    _replay(b, 0, names, 100)
    _replay(b, 5, names, 300)
    view = modules.module_view(b.trace(), _map())
    rows = _rows(view)
    assert view["replays"] == 2 and view["attributed_share"] == 1.0
    assert rows["model.layers.1.mlp"] == (4, 16) and rows["model.layers.0.mlp.down_proj"] == (2, 8)
    assert view["replay_idle_us"] == 2 * 5 * 6  # 6 µs between consecutive kernels (10 apart, 4 long), 5 gaps


def test_kernels_the_map_does_not_hold_are_listed_never_guessed():
    b = Builder()
    names = [e[0] for e in _map()]
    _replay(b, 0, names[:2] + ["surprise_kernel"] + names[3:], 100)  # one kernel differs (a conditional node)
    _replay(b, 5, names[:4] + names[5:], 300)  # one kernel missing in this replay
    view = modules.module_view(b.trace(), _map())
    rows = _rows(view)
    assert rows["model.layers.0.mlp.down_proj"] == (1, 4)  # only the second replay's
    assert rows["model.layers.1.mlp"] == (3, 12)  # its up GEMM in the first replay only, its down_proj in both
    assert rows["model.layers.1.mlp.down_proj"] == (2, 8)
    assert view["unattributed"] == [{"reason": modules.UNMATCHED, "kernels": 1, "gpu_us": 4}]


def test_two_streams_out_of_map_order_lose_a_match_rather_than_attribute_wrongly():
    b = Builder()
    names = [e[0] for e in _map()]
    # gemm_down of layer 0 runs on a second stream and starts before gemm_up of layer 0
    starts = {0: 100, 1: 130, 2: 112, 3: 140, 4: 150, 5: 160}
    b.launch(0, [(n, starts[i], 4, 7 if i != 2 else 8) for i, n in enumerate(names)], api="cudaGraphLaunch")
    view = modules.module_view(b.trace(), _map())
    truth = dict(zip(range(6), (e[1] for e in _map())))
    got = modules.attribute([names[i] for i in sorted(starts, key=starts.get)], _map())
    for i, m in zip(sorted(starts, key=starts.get), got):
        assert m is None or m[0] == truth[i]
    assert view["unattributed"][0]["kernels"] == 2  # the two that swapped places: left out, not guessed
    assert view["attributed_us"] == 4 * 4


def test_a_map_of_another_graph_attributes_nothing_and_says_so():
    b = Builder()
    _replay(b, 0, ["k_a", "k_b", "k_c"], 100)
    view = modules.module_view(b.trace(), _map())
    assert view["attributed_us"] == 0 and view["unattributed"][0]["reason"] == modules.UNMATCHED
    view = modules.module_view(b.trace())
    assert view["unattributed"][0]["reason"] == modules.NO_MAP


def test_a_map_written_from_an_eager_trace_attributes_its_replay(tmp_path):
    b = Builder()
    b.span(f"{P}", 0, 500)
    _eager_layer(b, 10, 0)
    _eager_layer(b, 100, 1)
    path = tmp_path / "step.map.json"
    assert modules.write_map(b.trace(), str(path)) == 6
    assert modules.read_map(str(path)) == [(n, m, o) for n, m, o in _map()]


@pytest.mark.parametrize("content, message", [
    (b"[1, 2", "MAP .*bad.map.json: truncated JSON"),
    (b'{"format": "other"}', "not an mlpfuse graph map"),
    (b'{"format": "mlpfuse-graph-map", "version": 9, "kernels": []}', "version 9"),
    (b'{"format": "mlpfuse-graph-map", "version": 1, "kernels": [{"name": 1, "module": "", "op": ""}]}',
     r"kernels\[0\]: expected name, module and op strings"),
    (b'{"format": "mlpfuse-graph-map", "version": 1, "kernels": {}}', "'kernels' must be a list"),
])
def test_a_bad_map_is_one_error_line(tmp_path, content, message):
    path = tmp_path / "bad.map.json"
    path.write_bytes(content)
    with pytest.raises(InputError, match=message):
        modules.read_map(str(path))


def _write_trace(tmp_path, b, name="step.pt.trace.json.gz"):
    path = tmp_path / name
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": b.events}, f)
    return path


def test_analyze_reads_the_map_beside_the_trace_and_the_cli_names_a_bad_one(tmp_path):
    b = Builder()
    _replay(b, 0, [e[0] for e in _map()], 100)
    path = _write_trace(tmp_path, b)
    assert analyze(str(path)).to_dict()["modules"]["attributed_share"] == 0  # no map yet: listed, not guessed
    (tmp_path / "step.pt.trace.map.json").write_text(json.dumps(
        {"format": modules.MAP_FORMAT, "version": 1,
         "kernels": [{"name": n, "module": m, "op": o} for n, m, o in _map()]}))
    data = analyze(str(path)).to_dict()
    assert data["modules"]["attributed_share"] == 1.0
    assert data["modules"]["map"].endswith("step.pt.trace.map.json")
    proc = run_cli("analyze", str(path))
    assert proc.returncode == 0 and "model.layers.*.mlp" in proc.stdout, proc.stdout
    saved = tmp_path / "a.json"
    saved.write_text(run_cli("analyze", str(path), "--json").stdout)
    assert analyze(str(saved)).to_dict()["modules"]["kinds"]  # a saved analysis with the view reads back
    (tmp_path / "bad.json").write_text("{}")
    line = assert_one_error_line(run_cli("analyze", str(path), "--map", str(tmp_path / "bad.json")))
    assert "not an mlpfuse graph map" in line


def test_a_trace_without_annotations_or_replays_keeps_its_analysis():
    b = Builder()
    b.launch(0, [("k", 10, 3, 7)])
    assert "modules" not in analyze(b.trace()).to_dict()


def test_profile_with_modules_annotates_every_submodule_by_path():
    torch = pytest.importorskip("torch")
    import mlpfuse

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(16, 4)))
    result = mlpfuse.profile(lambda: model(torch.ones(2, 8)), modules=model, keep_trace=True, steps=2, wait=0,
                             warmup=0, active=2)
    t = trace_mod.load(result.trace_path)
    spans = [a for a in t.annotations if a.name.startswith(P)]
    names = {a.name[len(P):] for a in spans}
    assert names == {"", "0", "1", "1.0", "1.1"}
    assert len(spans) == 2 * 5  # every module once per step
    inner = next(a for a in spans if a.name == P + "1.1")
    outer = next(a for a in spans if a.name == P + "1" and a.ts <= inner.ts)
    assert outer.ts <= inner.ts and inner.end <= outer.end
    assert not model[0]._forward_pre_hooks and not model[0]._forward_hooks  # removed afterwards


def test_profile_model_by_module_annotates_both_sides(tmp_path):
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "llama"
    transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=256).save_pretrained(folder)
    out = tmp_path / "o"
    proc = run_cli("profile", "--model", folder, "--device", "cpu", "--by-module", "--json", "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    for side in ("eager", "mlpfuse"):
        assert "modules" in data[side]
        t = trace_mod.load(out / f"model-{side}.pt.trace.json.gz")
        assert P + "model.layers.0.mlp" in {a.name for a in t.annotations}
    line = assert_one_error_line(run_cli("profile", "linear", "--by-module", "--out", tmp_path / "x"))
    assert line == "mlpfuse: error: --by-module: applies with --model only"
