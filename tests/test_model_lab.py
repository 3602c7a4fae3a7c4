"""The model lab (`mlpfuse bench --model`) and `mlpfuse profile --model` end to end on the CPU, tiny configs: exit
codes, the files written, every variant's status, the logits check against the fp32 run, and bad input as one line."""

import json

import pytest
import torch

from mlpfuse.cli import main

transformers = pytest.importorskip("transformers")

FAST = ["--tiny", "--device", "cpu", "--rounds", "1", "--target-ms", "1"]


def run_lab(tmp_path, *flags):
    out = tmp_path / "lab"
    code = main(["bench", *FAST, *flags, "--out", str(out)])
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
    assert rows[("prefill", "mlpfuse")]["status"] == "ok" and rows[("prefill", "mlpfuse")]["patched"] == 2
    assert rows[("decode", "eager")]["error"] == "skipped: a masked LM does not generate"
    # On `auto` the erf-GELU intermediate layers are left as they are, and the row says why.
    code, data, _ = run_lab(tmp_path, "--model", "bert-base", "--mode", "prefill", "--variants", "eager,mlpfuse")
    fused = rows_by(data)[("prefill", "mlpfuse")]
    assert fused["status"] == "error" and "backend 'auto' keeps dense + gelu" in fused["error"]


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
    ([], "WORKLOAD: expected one of linear, geglu-mlp (or --model NAME)"),
    (["--model", "gpt2", "--tokens", "1x8,2x8"], "--tokens: expected one BATCHxSEQ shape"),
])
def test_profile_model_bad_input(flags, expected, tmp_path, capsys):
    assert main(["profile", *flags, "--device", "cpu", "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mlpfuse: error: " + expected), err
