"""The model lab (`mlpfuse bench --model`) and `mlpfuse profile --model` end to end on the CPU, tiny configs: exit
codes, the files written, every variant's status, the logits check against the fp32 run, and bad input as one line."""

import json
import statistics

import pytest
import torch

from mlpfuse.cli import main

transformers = pytest.importorskip("transformers")

FAST = ["--tiny", "--device", "cpu", "--rounds", "1", "--target-ms", "1"]


def run_lab(tmp_path, *flags):
    out = tmp_path / "lab"
    # --force: some tests run the lab twice and read the second run from the same folder
    code = main(["bench", *FAST, *flags, "--out", str(out), "--force"])
    data = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else None
    return code, data, out


def rows_by(data):
    return {(r["mode"], r["variant"]): r for r in data["rows"]}


def test_llama_every_mode(tmp_path, capsys):
    code, data, out = run_lab(tmp_path, "--model", "llama3-8b", "--mode", "prefill,decode,train",
                              "--variants", "eager,mlpfuse,liger", "--new-tokens", "3")
    assert code == 0
    rows = rows_by(data)
    assert len(data["rows"]) == 9
    meta = data["meta"]
    assert meta["lab"]["model"] == "llama3-8b (tiny)" and meta["lab"]["layers"] == 2 and meta["lab"]["dtype"] == "fp32"
    assert meta["transformers"] == transformers.__version__
    assert meta["command"].startswith("mlpfuse bench --model llama3-8b --tiny --tokens") is False  # no --tokens given
    assert "--model llama3-8b --tiny --mode prefill,decode,train" in meta["command"]
    for mode in ("prefill", "decode", "train"):
        eager, fused, liger = rows[(mode, "eager")], rows[(mode, "mlpfuse")], rows[(mode, "liger")]
        assert eager["status"] == fused["status"] == "ok", (eager["error"], fused["error"])
        assert liger["status"] == "skipped" and liger["error"].startswith("skipped: ")
        assert fused["patched"] == 2  # both layers' MLPs
        # fp32 on the torch backend: the patched model computes what the unpatched one does
        assert fused["rel_err"] < 1e-5 and eager["rel_err"] < 1e-5
        assert fused["vs_eager"] == pytest.approx(fused["time_ms"] / eager["time_ms"])
        assert eager["unit"] == ("ms/token" if mode == "decode" else "ms")
    for mode in ("prefill", "train"):
        assert rows[(mode, "eager")]["time_ms"] > 0 and rows[(mode, "mlpfuse")]["first_call_ms"] > 0
    md = (out / "results.md").read_text()
    assert md.count("### llama3-8b (tiny)") == 3 and "| mlpfuse * |" in md
    assert (out / "results.csv").read_text().splitlines()[0].startswith("model,layers,mode,batch,seq")
    page = (out / "report.html").read_text()  # the same tables as results.md, one per case
    assert page.count("<h4>llama3-8b (tiny)") == 3 and page.count('<table class="bench">') == 3
    assert "mlpfuse *" in page and "not readable" not in page
    stdout = capsys.readouterr().out
    assert "decode 1x16, 3 new tokens" in stdout


def test_compile_variants_and_a_masked_model(tmp_path):
    # aot_eager keeps compilation short on a CPU; the decode rows of the compile variants ran generate's compiled
    # decode step (the lab fails them otherwise).
    code, data, _ = run_lab(tmp_path, "--model", "gpt2", "--mode", "prefill,decode,train", "--new-tokens", "2",
                            "--variants", "eager,compile,mlpfuse,mlpfuse-compile", "--compile-backend", "aot_eager")
    assert code == 0
    rows = rows_by(data)
    for key, row in rows.items():
        assert row["status"] == "ok", (key, row["error"])
    assert rows[("decode", "mlpfuse-compile")]["vs_compile"] is not None
    assert rows[("prefill", "mlpfuse-compile")]["rel_err"] < 1e-5

    code, data, _ = run_lab(tmp_path, "--model", "bert-base", "--mode", "prefill,decode", "--variants",
                            "eager,mlpfuse", "--backend", "torch")
    assert code == 0
    rows = rows_by(data)
    # Two layers: the intermediate and the two post-norm output blocks of each.
    assert rows[("prefill", "mlpfuse")]["status"] == "ok" and rows[("prefill", "mlpfuse")]["patched"] == 6
    assert rows[("decode", "eager")]["error"] == "skipped: a masked LM does not generate"
    # On `auto` too (the erf GELU is never fused; the block runs eager's own ops with less Python per call).
    code, data, _ = run_lab(tmp_path, "--model", "bert-base", "--mode", "prefill", "--variants", "eager,mlpfuse")
    fused = rows_by(data)[("prefill", "mlpfuse")]
    assert fused["status"] == "ok" and fused["patched"] == 6 and fused["logits_vs_eager"] == 0


def test_a_patch_that_swaps_nothing_is_timed_as_the_model_it_leaves(tmp_path):
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=128, n_positions=64,
                                  activation_function="mish")  # an activation mlpfuse does not fuse
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "m")
    out = tmp_path / "lab"
    code = main(["bench", "--model", str(tmp_path / "m"), "--device", "cpu", "--rounds", "1", "--target-ms", "1",
                 "--tokens", "1x8", "--variants", "eager,mlpfuse", "--out", str(out)])
    assert code == 0
    fused = rows_by(json.loads((out / "results.json").read_text()))[("prefill", "mlpfuse")]
    assert fused["status"] == "ok" and fused["patched"] == 0 and fused["time_ms"] > 0
    assert fused["error"].startswith("mlpfuse.patch swapped nothing, so this is the unpatched model: ")
    assert "unknown activation MishActivation" in fused["error"] and fused["logits_vs_eager"] == 0
    assert "ok (mlpfuse.patch swapped nothing" in (out / "results.md").read_text()


def test_bf16_error_is_measured_against_the_fp32_run(tmp_path):
    code, data, _ = run_lab(tmp_path, "--model", "gemma2-2b", "--dtype", "bf16", "--variants", "eager,mlpfuse",
                            "--tokens", "2x8")
    assert code == 0
    rows = rows_by(data)
    eager, fused = rows[("prefill", "eager")], rows[("prefill", "mlpfuse")]
    assert 1e-4 < eager["rel_err"] < 5e-2  # bf16 rounding, measured against fp32
    assert fused["rel_err"] < 5e-2 and fused["err_vs_eager"] == pytest.approx(fused["rel_err"] / eager["rel_err"])


def test_bf16_models_keep_the_rotary_frequencies_of_the_fp32_model():
    """The lab's bf16 models rotate late positions as the fp32 model does: their rotary cos/sin at position 4095
    match an fp64 computation to bf16 rounding (rounding the inverse frequencies to bf16, as `model.to(bf16)`
    does, puts the angle off by up to several radians there)."""
    from mlpfuse.bench import models

    built = models.build("llama3-8b", layers=1, tiny=True, device=torch.device("cpu"), dtype=torch.bfloat16)
    assert {p.dtype for p in built.model.parameters()} == {torch.bfloat16}
    rotary = built.model.model.rotary_emb
    pos = torch.tensor([[4095]])
    cos, sin = rotary(torch.zeros(1, 1, 1, dtype=torch.bfloat16), pos)
    cfg = built.model.config
    dim = cfg.hidden_size // cfg.num_attention_heads
    inv = 1.0 / cfg.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.cat([inv, inv]) * 4095
    assert (cos.double().flatten() - angles.cos()).abs().max() < 1e-2
    assert (sin.double().flatten() - angles.sin()).abs().max() < 1e-2


def test_a_local_model_folder(tmp_path):
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                                   vocab_size=128, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m")
    out = tmp_path / "lab"
    code = main(["bench", "--model", str(tmp_path / "m"), "--layers", "2", "--device", "cpu", "--rounds", "1",
                 "--target-ms", "1", "--tokens", "1x8", "--variants", "eager,mlpfuse", "--out", str(out)])
    assert code == 0
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["lab"]["weights"] == str(tmp_path / "m") and data["meta"]["lab"]["layers"] == 2
    assert [r["patched"] for r in data["rows"]] == [None, 2]


@pytest.mark.parametrize("flags, expected", [
    (["--model", "gpt5"],
     "--model: expected one of llama3-8b, gemma2-2b, qwen3-4b, olmo2-7b, gpt2, bert-base or a local"),
    (["--model", "gpt2", "--mode", "backward"], "--mode: unknown mode 'backward' for --model"),
    (["--model", "gpt2", "--variants", "eager,cudagraph"], "--variants: unknown variant 'cudagraph' for --model"),
    (["--model", "gpt2", "--tokens", "1x0"], "--tokens: expected BATCHxSEQ shapes"),
    (["--model", "gpt2", "--tokens", "1x600"], "--tokens: 600 positions but the model has 512 position embeddings"),
    (["--model", "gpt2", "--layers", "0"], "--layers: expected an integer >= 1, got 0"),
    (["--model", "gpt2", "--dtype", "bf16,fp32"], "--dtype: the model lab runs one dtype per run"),
    (["--model", "gpt2", "--preset", "blog"], "--preset: does not apply to the model lab (--model)"),
    (["--model", "gpt2", "--backend", "cudnn"], "backend: unknown backend 'cudnn'"),
    (["--tokens", "8", "--dim", "8", "--hidden", "8", "--layers", "2"], "--layers: applies to the model lab only"),
])
def test_bad_input_is_one_line(flags, expected, tmp_path, capsys):
    tiny = ["--tiny"] if "--model" in flags else []
    mode = ["--mode", "prefill,decode"] if "1x600" in flags else []
    assert main(["bench", *tiny, *mode, "--device", "cpu", *flags, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mlpfuse: error: " + expected), err


def test_decode_without_room_for_the_new_tokens_is_skipped_and_the_rest_runs(tmp_path):
    # A prompt that leaves no room for the new tokens: its decode case cannot run, its prefill case can.
    code, data, _ = run_lab(tmp_path, "--model", "gpt2", "--tokens", "1x500", "--mode", "prefill,decode",
                            "--variants", "eager,mlpfuse", "--new-tokens", "20")
    assert code == 0
    rows = rows_by(data)
    for v in ("eager", "mlpfuse"):
        assert rows[("prefill", v)]["status"] == "ok" and rows[("prefill", v)]["time_ms"] > 0
        skipped = rows[("decode", v)]
        assert skipped["status"] == "skipped" and skipped["time_ms"] is None
        assert skipped["error"].startswith("skipped: 521 positions (prompt + new tokens) but the model has 512")


def test_a_folder_without_config_is_refused(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["bench", "--model", str(tmp_path / "empty"), "--device", "cpu"]) == 2
    expected = f"mlpfuse: error: --model: {tmp_path / 'empty'} is a folder without a config.json"
    assert capsys.readouterr().err.strip() == expected


def test_profile_model_shows_the_layer_before_and_after(tmp_path, capsys):
    out = tmp_path / "p"
    assert main(["profile", "--model", "gpt2", "--device", "cpu", "--steps", "3", "--active", "1", "--out", str(out),
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data == json.loads((out / "model-diff.json").read_text())
    assert [s["source"] for s in data["patch"]["swapped"]] == ["GPT2MLP"]  # one layer
    added = {o["name"] for o in data["diff"]["ops_added"]}
    assert "mlpfuse::linear_act" in added  # GPT-2's c_fc + gelu_new as one op
    eager_ops = {o["name"] for o in data["eager"]["ops"]}
    assert {"aten::addmm", "aten::tanh", "aten::pow"} <= eager_ops  # Conv1D's addmm, gelu_new op by op
    fused_ops = {o["name"] for o in data["mlpfuse"]["ops"]}
    assert "aten::gelu" in fused_ops and "aten::pow" not in fused_ops
    assert (out / "model-eager.pt.trace.json.gz").exists() and (out / "model-mlpfuse.pt.trace.json.gz").exists()


@pytest.mark.parametrize("flags, expected", [
    (["linear", "--model", "gpt2"], "WORKLOAD: give a workload or --model, not both"),
    (["--model", "gpt2", "--dim", "8"], "--dim: does not apply with --model"),
    (["linear", "--tiny"], "--tiny: applies with --model only"),
    ([], "WORKLOAD: expected one of linear, geglu-mlp, geglu-mlp-fp8 (or --model NAME)"),
    (["--model", "gpt2", "--tokens", "1x8,2x8"], "--tokens: expected one BATCHxSEQ shape"),
])
def test_profile_model_bad_input(flags, expected, tmp_path, capsys):
    assert main(["profile", *flags, "--device", "cpu", "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mlpfuse: error: " + expected), err


# --- rounds, decode-step, logits_to_keep=1 beside full logits ------------------------------------------------------


@pytest.fixture
def one_thread():
    """CPU timings with one intra-op thread: on a loaded 2-core host, threads spinning for each other made a tiny
    step 200x slower (1 ms -> 230 ms)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def call_log(monkeypatch):
    """Which timing key each call of a prepared step was, in order: the real steps run, each call noted first."""
    from mlpfuse.bench import model_lab

    log = []
    real = model_lab.prepare

    def noting(*args, **kwargs):
        p = real(*args, **kwargs)

        def wrap(key, step):
            def call():
                log.append(key)
                return step()
            return call

        p.steps = {key: wrap(key, step) for key, step in p.steps.items()}
        return p

    monkeypatch.setattr(model_lab, "prepare", noting)
    return log


def collapsed(log):
    """Consecutive calls of one key as one entry: a round of a variant's repetitions becomes its key once."""
    return [k for i, k in enumerate(log) if i == 0 or log[i - 1] != k]


def assert_rounds_from_samples(row, rounds=5):
    samples = row["time_rounds_ms"]
    assert row["rounds"] == rounds and len(samples) == rounds
    med = statistics.median(samples)
    assert row["time_ms"] == pytest.approx(med)
    assert row["spread_pct"] == pytest.approx(abs(max(samples) - min(samples)) / abs(med) * 100)


def test_every_timing_is_interleaved_rounds_with_the_spread_of_its_samples(tmp_path, one_thread, call_log):
    code, data, out = run_lab(tmp_path, "--model", "llama3-8b", "--mode", "prefill,decode", "--rounds", "5",
                              "--tokens", "1x8,2x8", "--variants", "eager,mlpfuse", "--new-tokens", "2")
    assert code == 0
    for row in data["rows"]:
        assert row["status"] == "ok", row["error"]
        assert_rounds_from_samples(row)
        if row["mode"] == "prefill":  # logits_to_keep=1 beside every position's logits, each in its rounds
            full = row["full_logits_rounds_ms"]
            assert len(full) == 5 and row["full_logits_ms"] == pytest.approx(statistics.median(full))
            assert row["full_logits_spread_pct"] == pytest.approx((max(full) - min(full)) / statistics.median(full)
                                                                   * 100)
        else:  # generate: host wall ms/token; no GPU busy time on a CPU
            assert row["unit"] == "ms/token" and row["wall_ms"] == row["time_ms"] and row["gpu_busy_ms"] is None
        assert row["logits_vs_eager"] < 1e-5  # fp32, the torch path: the same function as eager
    # Beside the ratio of medians, each round's time over eager's in the same round: median, min and max.
    rows = rows_by(data)
    for (mode, variant), row in rows.items():
        if variant == "mlpfuse":
            mine, eager = row["time_rounds_ms"], rows[(mode, "eager")]["time_rounds_ms"]
            per_round = sorted(a / b for a, b in zip(mine, eager))
            assert len(per_round) == 5 and row["vs_eager_paired"] == pytest.approx(per_round[2])
            assert row["vs_eager_paired_range"] == pytest.approx([per_round[0], per_round[-1]])
    # Interleaved: in the timed part, the variants' keys take turns, 5 times over (A B A B ...), not A A A B B B
    runs = collapsed(call_log)
    for keys in (["eager", "eager|full", "mlpfuse", "mlpfuse|full"], ["eager|1", "eager|3", "mlpfuse|1", "mlpfuse|3"]):
        assert any(runs[i:i + 20] == keys * 5 for i in range(len(runs))), (keys, runs)
    md = (out / "results.md").read_text()
    decode_table = md.split("decode 1x8, 2 new tokens")[1].split("###")[0]
    assert "GPU busy ms/token" in decode_table and "| n/a |" in decode_table
    assert "full logits ms" in md.split("prefill 1x8")[1].split("###")[0]
    csv_head = (out / "results.csv").read_text().splitlines()[0].split(",")
    assert {"rounds", "gpu_busy_ms", "do_bench_ms", "full_logits_ms", "logits_vs_eager", "vs_eager_paired"} \
        <= set(csv_head)
    assert "vs eager per round (median, min–max)" in md


def test_decode_step_is_one_static_cache_step_for_every_variant(tmp_path, one_thread, call_log):
    code, data, out = run_lab(tmp_path, "--model", "llama3-8b", "--mode", "decode-step", "--tokens", "1x8,2x8",
                              "--rounds", "5",
                              "--variants", "eager,compile,liger,mlpfuse,mlpfuse-compile", "--compile-backend",
                              "aot_eager")
    assert code == 0
    rows = {(r["batch"], r["variant"]): r for r in data["rows"]}
    for batch in (1, 2):
        for v in ("eager", "compile", "mlpfuse", "mlpfuse-compile"):
            row = rows[(batch, v)]
            assert row["status"] == "ok", row["error"]
            assert row["unit"] == "ms" and row["do_bench_ms"] is None  # no CUDA graph, no do_bench on a CPU
            assert_rounds_from_samples(row)
            assert row["rel_err"] < 1e-5 and row["logits_vs_eager"] < 1e-5  # fp32: what eager computes
        assert rows[(batch, "liger")]["status"] == "skipped"
        assert rows[(batch, "mlpfuse")]["patched"] == rows[(batch, "mlpfuse-compile")]["patched"] == 2
    runs = collapsed(call_log)
    keys = ["eager", "compile", "mlpfuse", "mlpfuse-compile"]
    assert any(runs[i:i + 20] == keys * 5 for i in range(len(runs))), runs
    table = (out / "results.md").read_text().split("decode-step 2x8")[1]
    assert "do_bench ms" in table and "logits diff vs eager" in table and "| n/a |" in table


@pytest.mark.parametrize("name", ["llama3-8b", "gpt2", "gemma2-2b"])
def test_the_static_step_computes_the_next_token_s_logits_at_a_fixed_position(name, one_thread):
    """Oracle: the same model's forward on prompt + token without any cache. Called again, the step writes the
    same cache slot and returns the same logits."""
    from mlpfuse.bench import decode_step, models

    built = models.build(name, layers=None, tiny=True, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    ids, token = torch.randint(3, 500, (2, 12), generator=g), torch.randint(3, 500, (2, 1), generator=g)
    step = decode_step.inference(decode_step.StaticStep(built.model, ids, token))
    first, again = step(), step()
    with torch.no_grad():
        want = built.model(input_ids=torch.cat([ids, token], 1)).logits[:, -1:].double()
    assert torch.equal(first, again)
    assert ((first.double() - want).norm() / want.norm()).item() < 1e-5


def test_decode_step_refuses_a_masked_lm_and_a_prompt_without_room(tmp_path, one_thread):
    code, data, _ = run_lab(tmp_path, "--model", "bert-base", "--mode", "decode-step", "--variants", "eager")
    assert code == 0 and data["rows"][0]["error"] == "skipped: a masked LM does not generate"
    code, data, _ = run_lab(tmp_path, "--model", "gpt2", "--mode", "decode-step,prefill", "--tokens", "1x512",
                            "--variants", "eager")
    rows = rows_by(data)
    assert rows[("decode-step", "eager")]["status"] == "skipped" and rows[("prefill", "eager")]["status"] == "ok"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and do_bench need a GPU")
def test_decode_step_on_a_gpu_replays_a_graph_timed_by_two_harnesses(tmp_path):
    out = tmp_path / "lab"
    assert main(["bench", "--tiny", "--model", "llama3-8b", "--mode", "decode-step,decode", "--tokens", "1x16",
                 "--variants", "eager,mlpfuse,compile,mlpfuse-compile", "--new-tokens", "4", "--target-ms", "20",
                 "--out", str(out)]) == 0
    data = json.loads((out / "results.json").read_text())
    for row in data["rows"]:
        assert row["status"] == "ok", row["error"]
        assert_rounds_from_samples(row)
        if row["mode"] == "decode-step":
            bench = row["do_bench_rounds_ms"]
            assert len(bench) == 5 and row["do_bench_ms"] == pytest.approx(statistics.median(bench))
            assert 0.5 < row["do_bench_ms"] / row["time_ms"] < 2.0  # the two harnesses agree on the order
            assert row["logits_vs_eager"] < 2e-2  # bf16
        else:
            busy = row["gpu_busy_rounds_ms"]
            assert len(busy) == 5 and 0 < row["gpu_busy_ms"] == pytest.approx(statistics.median(busy))


def test_recompute_variants_train_with_equal_logits_and_compare_memory_with_compile(tmp_path):
    code, data, out = run_lab(tmp_path, "--model", "llama3-8b", "--mode", "train",
                              "--variants", "eager,compile,mlpfuse,mlpfuse-recompute,mlpfuse-recompute-compile",
                              "--compile-backend", "eager")
    assert code == 0
    rows = rows_by(data)
    for v in ("mlpfuse-recompute", "mlpfuse-recompute-compile"):
        row = rows[("train", v)]
        assert row["status"] == "ok", row["error"]
        assert row["patched"] == 2 and row["rel_err"] < 1e-5
        assert row["vs_compile"] == pytest.approx(row["time_ms"] / rows[("train", "compile")]["time_ms"])
        assert "mem_vs_compile" in row  # CUDA only: no peak memory on a CPU
    # Not in the default set: a plain run keeps the five variants it had.
    from mlpfuse.bench import model_lab

    assert model_lab.parse_variants(None) == list(model_lab.DEFAULT_VARIANTS)


def test_compile_checkpoint_trains_with_the_models_own_checkpointing(tmp_path, monkeypatch):
    """The peer recompute is measured against: transformers' gradient checkpointing on every decoder layer, then
    torch.compile. Its gradients are compile's; outside training it has nothing to change and says so."""
    from transformers import PreTrainedModel

    enabled = []
    real = PreTrainedModel.gradient_checkpointing_enable

    def spy(self, *a, **kw):
        real(self, *a, **kw)
        enabled.append(any(getattr(m, "gradient_checkpointing", False) is True for m in self.modules()))

    monkeypatch.setattr(PreTrainedModel, "gradient_checkpointing_enable", spy)
    code, data, out = run_lab(tmp_path, "--model", "llama3-8b", "--mode", "prefill,train",
                              "--variants", "compile,compile-checkpoint", "--compile-backend", "eager")
    assert code == 0
    rows = rows_by(data)
    row = rows[("train", "compile-checkpoint")]
    assert row["status"] == "ok", row["error"]
    assert enabled == [True]
    assert row["rel_err"] == pytest.approx(rows[("train", "compile")]["rel_err"], rel=1e-4)
    assert rows[("prefill", "compile-checkpoint")]["status"] == "skipped"
    assert "training only" in rows[("prefill", "compile-checkpoint")]["error"]


def test_a_replay_keeps_the_captured_step_alive():
    """A graph reads its step's tensors by address: the replay must hold the step (cache, token, positions), or the
    allocator reuses that memory and the replay reads garbage."""
    import gc
    import weakref

    from mlpfuse.bench.decode_step import Replay

    class Graph:
        replays = 0

        def replay(self):
            Graph.replays += 1

    class Step:
        pass

    step = Step()
    alive = weakref.ref(step)
    replay = Replay(Graph(), step)
    del step
    gc.collect()
    replay()
    assert alive() is not None and Graph.replays == 1
    del replay
    gc.collect()
    assert alive() is None


def test_precision_fp8_adds_the_fp8_patched_model_for_inference_and_training(tmp_path):
    """--precision fp8: the lab's FP8 rows are mlpfuse.patch(model, precision='fp8') (every MLP swapped, logits off
    fp32's by FP8's error, not bf16's), eager and compiled; in training the same patch trains every MLP GEMM in
    FP8 (its error FP8's too); the FP8 decode-kernel switches skip training with why."""
    code, data, out = run_lab(tmp_path, "--model", "llama3-8b", "--mode", "prefill,train", "--precision", "fp8",
                              "--variants", "eager,mlpfuse,mlpfuse-fp8,mlpfuse-fp8-compile", "--compile-backend",
                              "eager")
    assert code == 0
    rows = rows_by(data)
    for v in ("mlpfuse-fp8", "mlpfuse-fp8-compile"):
        pre, train = rows[("prefill", v)], rows[("train", v)]
        assert pre["status"] == "ok" and pre["patched"] == 2, pre["error"]
        assert 1e-4 < pre["rel_err"] < 0.12 and rows[("prefill", "mlpfuse")]["rel_err"] < 1e-5
        assert train["status"] == "ok" and train["patched"] == 2, train["error"]
        assert 1e-4 < train["rel_err"] < 0.12 and rows[("train", "mlpfuse")]["rel_err"] < 1e-5
    assert "--precision fp8" in data["meta"]["command"]
    code, data, _ = run_lab(tmp_path / "switch", "--model", "llama3-8b", "--mode", "train", "--variants",
                            "eager,mlpfuse-fp8-nonorm")
    assert code == 0 and "inference only" in rows_by(data)[("train", "mlpfuse-fp8-nonorm")]["error"]
    from mlpfuse.bench import model_lab

    assert model_lab.parse_variants(None, "fp8") == list(model_lab.FP8_VARIANTS)


def test_decode_step_rows_give_the_bytes_the_step_reads_and_its_floor(tmp_path):
    """decode-step: each row's bytes are every weight once (the input embedding table aside: one row of it is read)
    plus the whole static KV cache, counted here from the model's config; the floor is those bytes at the measured
    copy rate (meta), and the FP8 model reads fewer bytes (e4m3 MLP weights with their scales)."""
    code, data, out = run_lab(tmp_path, "--model", "llama3-8b", "--mode", "decode-step", "--tokens", "2x12",
                              "--variants", "eager,mlpfuse-fp8")
    assert code == 0
    rows = rows_by(data)
    eager, f8 = rows[("decode-step", "eager")], rows[("decode-step", "mlpfuse-fp8")]
    from mlpfuse.bench import models

    model = models.build("llama3-8b", layers=None, tiny=True, device=torch.device("cpu")).model
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = 2 * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * (12 + 1) * head_dim * 4  # K and V, fp32
    emb = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight.data_ptr() == emb.data_ptr()
    weights = sum(p.numel() * 4 for p in model.parameters() if tied or p is not emb)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert eager["floor_mb"] * 2**20 == weights + buffers + kv
    copy = data["meta"]["copy_gbps"]
    assert copy > 0 and eager["floor_ms"] == pytest.approx(eager["floor_mb"] * 2**20 / (copy * 1e9) * 1e3)
    assert eager["of_floor"] == pytest.approx(eager["floor_ms"] / eager["time_ms"])
    assert f8["floor_mb"] < eager["floor_mb"]
    assert "% of floor" in (out / "results.md").read_text()


def test_torchao_fp8_is_the_fp8_peer_row_and_says_why_it_cannot_run_here(tmp_path):
    """torchao-fp8-compile (in --precision fp8's default set) needs torchao and FP8 tensor cores: on this machine
    its row is skipped with the reason, the other rows unaffected."""
    from mlpfuse.bench import model_lab

    assert "torchao-fp8-compile" in model_lab.FP8_VARIANTS
    code, data, _ = run_lab(tmp_path, "--model", "llama3-8b", "--mode", "prefill,train", "--variants",
                            "eager,torchao-fp8-compile")
    assert code == 0
    rows = rows_by(data)
    for mode in ("prefill", "train"):
        row = rows[(mode, "torchao-fp8-compile")]
        assert row["status"] == "skipped", row
        assert "torchao not installed" in row["error"] or "FP8 tensor cores" in row["error"]
        assert rows[(mode, "eager")]["status"] == "ok"


def test_torchao_fp8_converts_the_mlp_projections_only(tmp_path):
    """The conversion is torchao's float8 training on each nn.Linear inside an `mlp` module, the weights the same
    tensors (shared with the other variants); a model without such a projection is one error line."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from mlpfuse.bench import model_lab
    from mlpfuse.errors import InputError

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=128))  # Conv1D, not nn.Linear
    with pytest.raises(InputError, match="no nn.Linear projection inside an `mlp` module"):
        model_lab.apply_torchao_fp8(gpt2, training=True)
    pytest.importorskip("torchao")
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2)).train()
    before = {n: m.weight for n, m in llama.named_modules() if isinstance(m, torch.nn.Linear)}
    model_lab.apply_torchao_fp8(llama, training=True)
    after = {n: m for n, m in llama.named_modules() if n in before}
    converted = {n for n, m in after.items() if type(m).__name__ == "Float8Linear"}
    assert converted == {n for n in before if ".mlp." in n} and len(converted) == 6
    assert all(after[n].weight is before[n] for n in before)
