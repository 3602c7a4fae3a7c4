"""`mlpfuse patch --dry-run MODEL_DIR`, run as a subprocess on config.json files written here (no weights): what it
would swap at the real sizes, what it would leave and why, its time and memory on an 8B config, and bad input."""

import json
import os
import subprocess
import sys

import pytest

from cli_run import HANG_S

pytest.importorskip("transformers")

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")

LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
             "rms_norm_eps": 1e-5, "hidden_act": "silu", "bos_token_id": 128000, "eos_token_id": 128001,
             "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
OLMO2_7B = {"architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", "hidden_size": 4096,
            "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 32, "vocab_size": 100352, "max_position_embeddings": 4096}
MIXTRAL = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
           "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000}


def folder(tmp_path, config, name="model"):
    path = tmp_path / name
    path.mkdir()
    if config is not None:
        (path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return str(path)


def mlpfuse(*args):
    """The CLI in a child process; its CPU seconds and peak memory (ru_maxrss, KiB) measured by a wrapper."""
    wrapper = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
               "u = resource.getrusage(resource.RUSAGE_CHILDREN); "
               "print(u.ru_utime + u.ru_stime, u.ru_maxrss, file=sys.stderr); sys.exit(r.returncode)")
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", wrapper, sys.executable, "-m", "mlpfuse", *args],
                       capture_output=True, text=True, env=env, timeout=HANG_S)
    *err, usage = p.stderr.strip().splitlines()
    cpu, peak = usage.split()
    return p.returncode, p.stdout, "\n".join(err), float(cpu), int(peak) * 1024


def test_dry_run_on_an_8b_config_is_quick_and_allocates_no_weights(tmp_path):
    code, out, err, cpu, peak = mlpfuse("patch", "--dry-run", folder(tmp_path, LLAMA3_8B))
    assert code == 0 and err == "", err
    lines = out.splitlines()
    assert "llama (LlamaForCausalLM), 8.03 B parameters on the meta device" in lines[0]
    assert lines[1] == "would swap 32, leave 0"
    assert lines[2].split() == ["swapped", "model.layers.{0..31}.mlp", "LlamaMLP", "->", "gated", "(silu,", "by",
                                "name:", "gate=gate_proj", "up=up_proj", "down=down_proj),", "4096", "x", "14336",
                                "[32x]"]
    # No weights: the peak below says so. Time only catches work gone out of proportion (7.2 s on an idle 2-core
    # machine, mostly imports): the CLI's own CPU time, never wall time (that counts waiting for a core, which a
    # loaded machine stretched from 7 to 17 s), with a limit a ten times slower machine stays under.
    assert cpu < 120, f"{cpu:.1f} s of CPU"
    assert peak < 2 * 2**30, f"peak {peak / 2**30:.2f} GiB: the 8B model's weights are 16 GiB in bf16"


def test_dry_run_reads_structure_and_leaves_experts_with_their_real_shapes(tmp_path):
    code, out, err, _, _ = mlpfuse("patch", "--dry-run", folder(tmp_path, OLMO2_7B, "olmo2"), "--json")
    assert code == 0, err
    olmo = json.loads(out)
    assert {(s["layout"], s["matched"], s["activation"]) for s in olmo["swapped"]} == {("gated", "structure", "silu")}
    assert len(olmo["swapped"]) == 32 and olmo["left"] == []
    assert set(olmo["sizes"].values()) == {"4096 x 11008"}

    code, out, err, _, _ = mlpfuse("patch", "--dry-run", folder(tmp_path, MIXTRAL, "mixtral"))
    assert code == 0, err
    assert "would swap 0, leave 32" in out
    assert ("model.layers.{0..31}.mlp  MixtralSparseMoeBlock: a mixture of experts: grouped expert weights "
            "(experts.gate_up_proj [8, 28672, 4096], experts.down_proj [8, 4096, 14336])") in out


@pytest.mark.parametrize("config, expected", [
    (None, "is a folder without a config.json"),
    ("{not json", "config.json: not a JSON file"),
    ("[1, 2]", "config.json: expected a JSON object, got list"),
    ({"model_type": "no-such-model"}, "config.json: unknown model type 'no-such-model'"),
    ({"hidden_size": 64}, "config.json: unknown model type None"),
    ({"model_type": "llama", "hidden_size": "wide"}, "config.json: hidden_size: expected an integer from 0 to"),
    ({"model_type": "llama", "rms_norm_eps": "small"}, "config.json: transformers cannot build a llama config"),
    ({"model_type": "llama", "hidden_act": "no-such-act"},
     "config.json: transformers cannot build LlamaModel from it: KeyError: 'no-such-act'"),
])
def test_bad_model_folders_are_one_error_line(tmp_path, config, expected):
    code, out, err, _, _ = mlpfuse("patch", "--dry-run", folder(tmp_path, config))
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("mlpfuse: error: ") and expected in err, err


def test_bad_arguments_are_one_error_line(tmp_path):
    code, _, err, _, _ = mlpfuse("patch", str(tmp_path / "nowhere"), "--dry-run")
    assert code == 2 and err.startswith("mlpfuse: error: MODEL_DIR:") and "is not a folder" in err
    code, _, err, _, _ = mlpfuse("patch", folder(tmp_path, LLAMA3_8B))
    assert code == 2 and err == ("mlpfuse: error: patch: only --dry-run is available from the command line; "
                                 "patch a loaded model in Python with mlpfuse.patch(model)")
