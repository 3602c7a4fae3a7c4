"""GPU time per module (profiling/modules.py): eager kernels by their module annotation, CUDA-graph replays through
a map of an eager run. Hand-built traces with known truth (which module launched which kernel), then a real capture
of a CPU model for the annotations themselves."""

import gzip
import json
import re

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

    def span(self, name, ts, dur, cat="user_annotation", args=None):
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur,
                            **({"args": args} if args else {})})

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
    return [modules.Entry(*e, i, None) for i, e in enumerate([
        ("norm_kernel", "model.layers.0", ""), ("gemm_up", "model.layers.0.mlp", "aten::mm"),
        ("gemm_down", "model.layers.0.mlp.down_proj", "aten::mm"), ("norm_kernel", "model.layers.1", ""),
        ("gemm_up", "model.layers.1.mlp", "aten::mm"), ("gemm_down", "model.layers.1.mlp.down_proj", "aten::mm")])]


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
    truth = dict(zip(range(6), (e.module for e in _map())))
    got = modules.attribute([names[i] for i in sorted(starts, key=starts.get)], _map())
    for i, m in zip(sorted(starts, key=starts.get), got):
        assert m is None or m.module == truth[i]
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
    assert [e[:3] for e in modules.read_map(str(path))] == [e[:3] for e in _map()]


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
         "kernels": [{"name": e.name, "module": e.module, "op": e.op} for e in _map()]}))
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


# ---- compiled graphs: fused kernels with no eager counterpart, between matched anchors ----

def _layer_map(layers):
    """An eager decoder's kernels per layer, in order: a norm in two kernels, attention's GEMMs and kernel, the
    MLP's GEMMs with its activation and product between them."""
    entries = []
    for i in range(layers):
        L = f"model.layers.{i}"
        entries += [("pow_k", f"{L}.input_layernorm", "aten::pow"), ("mul_k", f"{L}.input_layernorm", "aten::mul"),
                    ("gemm_q", f"{L}.self_attn.q_proj", "aten::mm"), ("attn", f"{L}.self_attn", "aten::sdpa"),
                    ("gemm_o", f"{L}.self_attn.o_proj", "aten::mm"), ("gemm_g", f"{L}.mlp.gate_proj", "aten::mm"),
                    ("gemm_u", f"{L}.mlp.up_proj", "aten::mm"), ("silu_k", f"{L}.mlp.act_fn", "aten::silu"),
                    ("mul_k", f"{L}.mlp", "aten::mul"), ("gemm_d", f"{L}.mlp.down_proj", "aten::mm")]
    return [modules.Entry(n, m, o, i, None) for i, (n, m, o) in enumerate(entries)]


def _compiled_layer(o_name="gemm_o"):
    """The same layer compiled: the norm fused into one kernel, silu and the product into another."""
    return ["fused_norm", "gemm_q", "attn", o_name, "gemm_g", "gemm_u", "fused_silu_mul", "gemm_d"]


def test_a_compiled_graph_s_fused_kernels_count_to_the_module_around_them_never_beyond():
    entries = _layer_map(2)
    replay = _compiled_layer() + _compiled_layer("gemm_o_other")  # layer 1's o_proj took another GEMM kernel
    hits = modules.attribute(replay, entries)
    got = [(h.how, h.module) if h else None for h in hits]
    assert got[0] is None  # layer 0's norm: before the first matched kernel, nothing holds it
    assert got[1] == (modules.MATCHED, "model.layers.0.self_attn.q_proj")
    assert got[6] == (modules.BETWEEN, "model.layers.0.mlp")  # between up_proj and down_proj of layer 0
    assert got[8] == (modules.BETWEEN, "model.layers")  # layer 1's norm: between layer 0's down and layer 1's q
    assert got[11] is None  # the other o_proj kernel: an anchor of the map (gemm_o) is missing around it
    assert got[14] == (modules.BETWEEN, "model.layers.1.mlp")
    b = Builder()
    _replay(b, 0, replay, 100)
    view = modules.module_view(b.trace(), entries)
    assert view["between"] == {"kernels": 3, "gpu_us": 12}
    assert _rows(view)["model.layers.0.mlp"] == (4, 16)  # gate, up, the fused kernel, down
    reasons = {u["reason"]: u["kernels"] for u in view["unattributed"]}
    assert reasons == {modules.UNMATCHED: 2}


def test_an_eager_replay_of_a_map_with_a_kernel_it_lacks_keeps_it_unattributed():
    """A kernel the map holds elsewhere is never 'between': only names the map lacks entirely are placed."""
    entries = _layer_map(1)
    replay = [e.name for e in entries]
    replay[7] = "gemm_q"  # a kernel of the map, in the wrong place
    hits = modules.attribute(replay, entries)
    assert hits[7] is None and all(h is not None for i, h in enumerate(hits) if i != 7)


# ---- roofline and fusions from the ops' recorded inputs ----

BF16, F32 = "c10::BFloat16", "float"


def _op_kernel(b, ts, op, dims, types, kernel, start, dur, module=None, stream=7):
    """A CPU op with recorded inputs launching one kernel, optionally inside a module annotation."""
    if module is not None:
        b.span(P + module, ts, 10)
    b.span(op, ts + 1, 8, cat="cpu_op", args={"Input Dims": dims, "Input type": types})
    b.launch(ts + 2, [(kernel, start, dur, stream)])


def test_the_roofline_counts_bytes_and_flops_of_known_ops_and_rates_them_against_the_peaks():
    b = Builder()
    b.span(P, 0, 1000)
    _op_kernel(b, 10, "aten::mm", [[64, 128], [128, 256]], [BF16, BF16], "gemm", 100, 10, "m.a")
    _op_kernel(b, 30, "aten::mul", [[64, 256], [1, 256]], [BF16, BF16], "mul_k", 120, 2, "m.a")
    _op_kernel(b, 50, "aten::add_", [[64, 256], [64, 256], []], [F32, F32, "Scalar"], "add_k", 130, 4, "m.a")
    _op_kernel(b, 70, "aten::whatever", [[64, 256]], [BF16], "odd_k", 140, 5, "m.a")
    _op_kernel(b, 90, "aten::mul", [[-1, 256], [64]], [BF16, BF16], "bad_k", 150, 5, "m.a")  # hostile dims
    peaks = {"copy_gbps": 1000.0, "gemm_tflops": {"bf16": 100.0}}
    roof = modules.module_view(b.trace(), peaks=peaks)["roofline"]
    rows = {r["kernel"]: r for r in roof["rows"]}
    assert set(rows) == {"gemm", "mul_k", "add_k"}  # unknown op and unreadable dims: timed, not costed
    gemm_bytes = 2 * (64 * 128 + 128 * 256 + 64 * 256)
    assert rows["gemm"]["flops"] == 2 * 64 * 128 * 256 and rows["gemm"]["bytes"] == gemm_bytes
    assert rows["gemm"]["gbps"] == pytest.approx(gemm_bytes / 10e-6 / 1e9)
    assert rows["gemm"]["of_compute"] == pytest.approx(2 * 64 * 128 * 256 / 10e-6 / 1e12 / 100.0)
    assert rows["mul_k"]["bytes"] == 2 * (64 * 256 + 256 + 64 * 256)  # broadcast: the output is the larger shape
    assert rows["add_k"]["bytes"] == 4 * 3 * 64 * 256  # in place: both inputs read, the first written
    assert rows["add_k"]["of_bandwidth"] == pytest.approx(4 * 3 * 64 * 256 / 4e-6 / 1e9 / 1000.0)
    assert rows["add_k"]["of_compute"] is None  # elementwise: no compute roof
    assert roof["costed_share"] == pytest.approx(16 / 26)
    total = gemm_bytes + 2 * (64 * 256 + 256 + 64 * 256) + 4 * 3 * 64 * 256
    assert roof["bytes_per_step"] == total and roof["floor_us_per_step"] == pytest.approx(total / 1000.0 / 1e3)


def test_an_attention_call_s_flops_count_both_products():
    from mlpfuse.profiling import costs

    c = costs.cost("aten::_scaled_dot_product_flash_attention", [[2, 8, 16, 64], [2, 4, 32, 64], [2, 4, 32, 64], []],
                   [BF16, BF16, BF16, "Scalar"])
    assert c.flops == 2 * 2 * 8 * 16 * 32 * (64 + 64)
    assert c.bytes == 2 * (2 * 8 * 16 * 64 + 2 * 2 * 4 * 32 * 64 + 2 * 8 * 16 * 64)
    assert costs.cost("aten::mm", [[4, 5], [6, 7]], [BF16, BF16]) is None  # inner sizes disagree


def test_runs_of_memory_bound_kernels_in_one_module_are_named_with_the_bytes_a_fusion_saves():
    b = Builder()
    b.span(P, 0, 2000)
    x = [[8, 4096]]
    norm = "model.layers.0.post_attention_layernorm"
    t = 10
    for i, (op, dims, types) in enumerate([("aten::pow", x + [[]], [F32, "Scalar"]), ("aten::mean", x, [F32]),
                                            ("aten::rsqrt", [[8, 1]], [F32]), ("aten::mul", x + [[8, 1]], [F32, F32])]):
        _op_kernel(b, t, op, dims, types, f"k{i}", 100 + 10 * i, 3, norm)
        t += 20
    _op_kernel(b, t, "aten::mm", [[8, 4096], [4096, 4096]], [BF16, BF16], "gemm", 200, 20, "model.layers.0.mlp")
    t += 20
    for i in range(2):  # two in a row: too short a run
        _op_kernel(b, t, "aten::mul", x + x, [F32, F32], f"short{i}", 300 + 10 * i, 3, "model.layers.0.mlp")
        t += 20
    for i in range(4):  # alternating modules: no run
        _op_kernel(b, t, "aten::add", x + x, [F32, F32], f"alt{i}", 400 + 10 * i, 3, f"model.layers.0.m{i % 2}")
        t += 20
    fusions = modules.module_view(b.trace())["fusions"]
    assert len(fusions) == 1
    f = fusions[0]
    moved = [4 * 8 * 4096 * 2, 4 * 8 * 4096, 4 * 8 * 2, 4 * (2 * 8 * 4096 + 8)]
    assert f["module"] == "model.layers.*.post_attention_layernorm" and f["kernels"] == 4 and f["runs"] == 1
    assert f["bytes"] == sum(moved) and f["bytes_saved"] == sum(moved) - max(moved)
    assert "mlpfuse.patch" in f["mlpfuse"] and f["gpu_us"] == 12
    assert "fused MLP block" in f["mlpfuse"]


def test_an_attentions_input_norm_is_named_with_the_projections_that_take_it():
    """The same run of norm kernels in an attention's input norm: the hint names the q, k, v projections' launch."""
    b = Builder()
    b.span(P, 0, 2000)
    x = [[8, 4096]]
    t = 10
    for i, (op, dims, types) in enumerate([("aten::pow", x + [[]], [F32, "Scalar"]), ("aten::mean", x, [F32]),
                                            ("aten::rsqrt", [[8, 1]], [F32]), ("aten::mul", x + [[8, 1]], [F32, F32])]):
        _op_kernel(b, t, op, dims, types, f"k{i}", 100 + 10 * i, 3, "model.layers.0.input_layernorm")
        t += 20
    (f,) = modules.module_view(b.trace())["fusions"]
    assert f["module"] == "model.layers.*.input_layernorm" and "q, k, v projections" in f["mlpfuse"]


def test_busy_time_is_the_union_of_kernels_on_two_streams():
    b = Builder()
    b.span(P + "m", 0, 100)
    b.launch(1, [("a", 100, 10, 7)])
    b.launch(2, [("b", 105, 10, 8)])  # overlaps a by 5 µs on another stream
    b.launch(3, [("c", 130, 5, 7)])
    view = modules.module_view(b.trace())
    assert view["kernel_us"] == 25 and view["busy_us"] == 20


def test_a_map_keeps_each_kernel_s_op_call_and_inputs_and_refuses_bad_ones(tmp_path):
    b = Builder()
    b.span(P, 0, 500)
    _op_kernel(b, 10, "aten::mm", [[64, 128], [128, 256]], [BF16, BF16], "gemm", 100, 10, "m.a")
    path = tmp_path / "m.map.json"
    modules.write_map(b.trace(), str(path))
    (e,) = modules.read_map(str(path))
    assert e.op == "aten::mm" and e.inputs == (((64, 128), (128, 256)), (BF16, BF16))
    data = json.loads(path.read_text())
    data["kernels"][0]["dims"] = [[64, "x"]]
    path.write_text(json.dumps(data))
    with pytest.raises(InputError, match=r"kernels\[0\]: 'dims' and 'types' must be lists"):
        modules.read_map(str(path))
    data["kernels"][0].update(dims=[[64, 128], [128, 256]], call=-3)
    path.write_text(json.dumps(data))
    with pytest.raises(InputError, match=r"kernels\[0\]: 'call' must be an integer"):
        modules.read_map(str(path))


@pytest.mark.parametrize("dims, types", [
    ([[1] * 9], [BF16]),  # more dimensions than a tensor has here
    ([[2 ** 60]], [BF16]),  # a size past any memory
    ([[[1, 2]]], ["TensorList"]),  # nested
    ([[4]], [BF16, BF16]),  # lengths differ
    ([[4]], ["x" * 100]),  # a dtype name far too long
    ("[4]", [BF16]),
])
def test_a_trace_s_recorded_inputs_are_kept_only_when_they_are_plausible(dims, types):
    b = Builder()
    b.span("aten::relu", 0, 5, cat="cpu_op", args={"Input Dims": dims, "Input type": types})
    t = b.trace()
    assert t.inputs_of(t.cpu_ops[0]) is None


def test_the_report_shows_the_module_tree_and_colours_the_timeline_by_module(tmp_path):
    b = Builder()
    b.span("ProfilerStep#1", 0, 900)
    b.span(P, 0, 900)
    _eager_layer(b, 10, 0)
    _op_kernel(b, 300, "aten::mm", [[8, 64], [64, 64]], [BF16, BF16], "gemm_x", 1200, 10, "model.layers.0.mlp")
    path = _write_trace(tmp_path, b)
    html = tmp_path / "r.html"
    proc = run_cli("analyze", str(path), "--html", str(html))
    assert proc.returncode == 0, proc.stderr
    page = html.read_text()
    assert page.count('<details class="module"') == len(analyze(str(path)).to_dict()["modules"]["kinds"])
    assert "<code>model.layers.*.mlp</code>" in page
    coloured = re.findall(r'<rect class="module" [^>]*style="fill:hsl\(', page)
    assert len(coloured) == 4  # one per kernel of the step
    assert "Roofline per call" in page


# ---- a real GPU trace: a 32-layer Llama-3-8B-shaped decode step replayed from CUDA graphs (H200) ----

REAL = __import__("pathlib").Path(__file__).parent / "data" / "graph-replay"


@pytest.mark.parametrize("trace, between", [("eager-graph.pt.trace.json.gz", False),
                                            ("compiled-graph.pt.trace.json.gz", True)])
def test_a_real_decode_step_replayed_from_a_graph_is_attributed_through_its_eager_map(trace, between):
    result = analyze(str(REAL / trace), graph_map=str(REAL / "eager.map.json.gz")).to_dict()
    view = result["modules"]
    assert view["attributed_share"] >= 0.98
    top = sum(r["gpu_us"] for r in view["rows"] if r["depth"] == 1)
    assert top + sum(u["gpu_us"] for u in view["unattributed"]) == pytest.approx(view["kernel_us"], rel=1e-9)
    kinds = {r["module"]: r for r in view["kinds"]}
    mlp = kinds["model.layers.*.mlp"]
    assert mlp["kernels"] / view["steps"] >= 32 * 3  # every layer's three GEMMs at least
    assert (view["between"]["kernels"] > 0) == between
    gemm = {r["module"]: r for r in view["roofline"]["rows"]}["model.layers.*.mlp.down_proj"]
    assert gemm["inputs"] == "1x14336 14336x4096" and gemm["kind"] == "gemm"
    assert gemm["bytes"] == 2 * (14336 + 14336 * 4096 + 4096)


@pytest.mark.parametrize("op, dims, types, flops, nbytes", [
    ("aten::addmm", [[256], [8, 64], [64, 256]], [BF16] * 3, 2 * 8 * 64 * 256, 2 * (256 + 8 * 64 + 64 * 256 + 8 * 256)),
    ("aten::bmm", [[4, 8, 16], [4, 16, 32]], [F32] * 2, 2 * 4 * 8 * 16 * 32, 4 * 4 * (8 * 16 + 16 * 32 + 8 * 32)),
    ("aten::fill_", [[8, 64], []], [BF16, "Scalar"], 0, 2 * 8 * 64),
    ("aten::_softmax", [[8, 64], [], []], [F32, "Scalar", "Scalar"], 8 * 64, 2 * 4 * 8 * 64),
    ("aten::native_layer_norm", [[8, 64], [], [64], [64], []], [BF16, "ScalarList", BF16, BF16, "Scalar"],
     5 * 8 * 64, 2 * (2 * 8 * 64 + 2 * 64)),
    ("aten::copy_", [[8, 64], [8, 64], []], [F32, BF16, "Scalar"], 0, 4 * 8 * 64 + 2 * 8 * 64),
])
def test_the_cost_of_each_op_kind_against_its_arithmetic(op, dims, types, flops, nbytes):
    from mlpfuse.profiling import costs

    c = costs.cost(op, dims, types)
    assert (c.flops, c.bytes) == (flops, nbytes)


def test_ops_the_costs_do_not_know_are_not_costed():
    from mlpfuse.profiling import costs

    assert costs.cost("aten::_to_copy", [[8, 64]], [BF16]) is None  # the output dtype is not recorded
    assert costs.cost("aten::add", [[8, 64], [7, 64]], [BF16, BF16]) is None  # shapes that do not broadcast
    assert costs.cost("aten::mul", [[8, 64]], ["c10::ComplexFloat"]) is None
