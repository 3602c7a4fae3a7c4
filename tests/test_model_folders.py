"""Model folders as untrusted input, through the real CLI (`patch --dry-run`, `bench --model`, `profile --model`):
every hostile folder gets exit 2 and one `mlpfuse: error:` line, soon and in little memory, and nothing in the folder
runs. The time limit is a generous subprocess timeout (the CI machine may be busy); memory is the child's peak."""

import json
import os
import subprocess
import sys

import pytest

from cli_run import assert_one_error_line, cli_env

pytest.importorskip("transformers")

TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 128, "max_position_embeddings": 64}
BENCH = ["--device", "cpu", "--rounds", "1", "--target-ms", "1", "--tokens", "1x8", "--variants", "eager",
         "--mode", "prefill"]
GIB = 2**30


def mlpfuse(*args, cwd, stdin: str = ""):
    """`python -m mlpfuse ARGS` with `stdin` as its input; (completed process, the child's peak memory in bytes)."""
    wrapper = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
               "sys.exit(r.returncode)")
    env = cli_env(XDG_CACHE_HOME=os.path.join(cwd, "cache"))
    proc = subprocess.run([sys.executable, "-c", wrapper, sys.executable, "-m", "mlpfuse", *map(str, args)],
                          cwd=cwd, env=env, input=stdin, capture_output=True, text=True, timeout=120)
    *err, peak = proc.stderr.rstrip("\n").split("\n")
    proc.stderr = "\n".join(err)
    return proc, int(peak) * 1024


def folder(tmp_path, config, name="model") -> str:
    path = tmp_path / name
    path.mkdir()
    if config is not None:
        (path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return str(path)


def commands(path, out):
    """The three ways a model folder reaches mlpfuse."""
    return {"dry-run": ["patch", "--dry-run", path],
            "bench": ["bench", "--model", path, *BENCH, "--out", out / "bench"],
            "profile": ["profile", "--model", path, "--device", "cpu", "--out", out / "profile"]}


def refused(tmp_path, args, expected: str, stdin: str = "") -> str:
    proc, peak = mlpfuse(*args, cwd=tmp_path, stdin=stdin)
    line = assert_one_error_line(proc)
    assert expected in line, line
    assert peak < GIB, f"peak {peak / GIB:.2f} GiB"
    return line


# bench and profile read a folder through the same code (mlpfuse.bench.models): profile is run on a few of these.
@pytest.mark.parametrize("command", ["dry-run", "bench"])
@pytest.mark.parametrize("config, expected", [
    ("{not json", "config.json: not a JSON file (JSONDecodeError"),
    ('"a string"', "config.json: expected a JSON object, got str"),
    ("[" * 100_000 + "]" * 100_000, "config.json: not a JSON file (RecursionError"),
    ({**TINY_LLAMA, "hidden_size": "wide"}, "config.json: hidden_size: expected an integer from 0 to 1048576, "
                                            "got 'wide'"),
    ({**TINY_LLAMA, "model_type": "no-such-model"}, "config.json: unknown model type 'no-such-model'"),
    ('{"model_type": "llama", "rope_theta": ' + "9" * 4300 + "}",
     "config.json: an integer of 4300 digits, past the 64 bits"),
    ({**TINY_LLAMA, "num_hidden_layers": 10**9}, "config.json: num_hidden_layers: 1000000000, outside the 0 to 1024"),
    ({"model_type": "switch_transformers", "num_layers": 64, "num_decoder_layers": 64, "num_experts": 4096},
     "config.json: 128 layers x 4096 experts, more than the 131072 mlpfuse builds"),
], ids=["not-json", "a-string", "deep-nesting", "wide-not-int", "unknown-type", "huge-int", "1e9-layers",
        "too-many-experts"])  # short ids: pytest puts the id in PYTEST_CURRENT_TEST, which subprocesses inherit
def test_a_hostile_config_is_one_error_line(tmp_path, command, config, expected):
    path = folder(tmp_path, config)
    refused(tmp_path, commands(path, tmp_path)[command], expected)


@pytest.mark.parametrize("config, expected", [
    ("{not json", "config.json: not a JSON file (JSONDecodeError"),
    ({**TINY_LLAMA, "num_hidden_layers": 10**9}, "config.json: num_hidden_layers: 1000000000, outside the 0 to 1024"),
], ids=["not-json", "1e9-layers"])
def test_profile_refuses_a_hostile_config_too(tmp_path, config, expected):
    path = folder(tmp_path, config)
    refused(tmp_path, commands(path, tmp_path)["profile"], expected)


@pytest.mark.parametrize("command", ["dry-run", "bench"])
def test_a_sparse_2_gib_config_is_refused_before_it_is_read(tmp_path, command):
    path = folder(tmp_path, None)
    with open(os.path.join(path, "config.json"), "wb") as f:
        f.truncate(2 * GIB)  # holes: no disk and no time to make
    refused(tmp_path, commands(path, tmp_path)[command], "config.json: 2147483648 bytes, more than the 4 MiB")


@pytest.mark.parametrize("command", ["dry-run", "bench", "profile"])
def test_a_folder_s_code_never_runs_even_when_the_user_says_yes(tmp_path, command):
    marker = tmp_path / "ran"
    path = folder(tmp_path, {**TINY_LLAMA, "model_type": "x-custom",
                             "auto_map": {"AutoConfig": "configuration_x.XConfig"}})
    code = f"open({str(marker)!r}, 'w').write('configuration_x.py ran')\n"
    for name in ("configuration_x.py", "modeling_x.py", "__init__.py"):
        (tmp_path / "model" / name).write_text(code)
    refused(tmp_path, commands(path, tmp_path)[command], "mlpfuse does not run a model folder's code",
            stdin="y\n" * 100)
    assert not marker.exists()


@pytest.mark.parametrize("args, expected", [
    (["bench", "--model", "gpt2", *BENCH, "--layers", 1_000_000_000],
     "--layers: expected an integer from 1 to 1024, got 1000000000"),
    (["profile", "--model", "gpt2", "--device", "cpu", "--layers", 1_000_000_000],
     "--layers: expected an integer from 1 to 1024, got 1000000000"),
])
def test_a_billion_layers_on_the_command_line_are_refused_before_building(tmp_path, args, expected):
    refused(tmp_path, [*args, "--out", tmp_path / "out"], expected)


def test_a_billion_layers_asked_of_a_folder_are_refused_too(tmp_path):
    path = folder(tmp_path, TINY_LLAMA)
    refused(tmp_path, ["bench", "--model", path, *BENCH, "--layers", 10**9, "--out", tmp_path / "out"],
            "--layers: expected an integer from 1 to 1024, got 1000000000")


class _RunsACommand:
    """Unpickling this calls os.system: what a hostile pytorch_model.bin does."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_pickle_that_runs_code_is_refused_as_one_line(tmp_path):
    import torch

    marker = tmp_path / "ran"
    path = folder(tmp_path, TINY_LLAMA)
    torch.save({"model.embed_tokens.weight": _RunsACommand(marker)}, os.path.join(path, "pytorch_model.bin"))
    refused(tmp_path, ["bench", "--model", path, *BENCH, "--out", tmp_path / "out"],
            f"--model: the weights in {path} did not load: a pickle holding more than tensors, which "
            "torch.load(weights_only=True) refuses")
    assert not marker.exists()


def test_safetensors_weights_load(tmp_path):
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{k: v for k, v in TINY_LLAMA.items()
                                                                      if k not in ("architectures", "model_type")}))
    model.save_pretrained(tmp_path / "saved")
    assert (tmp_path / "saved" / "model.safetensors").exists()
    proc, _ = mlpfuse("bench", "--model", tmp_path / "saved", *BENCH, "--out", tmp_path / "out", "--json",
                      cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["meta"]["lab"]["weights"] == str(tmp_path / "saved")


def test_a_folder_name_with_escape_sequences_is_shown_escaped(tmp_path):
    name = "m\x1b]0;title\x07\x1b[31mred\u202e"
    path = folder(tmp_path, TINY_LLAMA, name)
    proc, _ = mlpfuse("bench", "--model", path, *BENCH, "--out", os.path.join(path, "out"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    escaped = "m\\x1b]0;title\\x07\\x1b[31mred\\u202e"
    assert f"{escaped} — prefill 1x8" in proc.stdout  # the table's title
    wrote = [line for line in proc.stderr.splitlines() if line.startswith("wrote ")]
    assert len(wrote) == 1 and f"{escaped}/out/results.json" in wrote[0], proc.stderr
    for text in (proc.stdout, proc.stderr):
        assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text

    proc, _ = mlpfuse("patch", "--dry-run", path, cwd=tmp_path)
    assert proc.returncode == 0 and escaped in proc.stdout and "\x1b" not in proc.stdout, proc.stderr


def test_a_config_json_that_is_no_regular_file_is_refused_without_reading(tmp_path):
    from mlpfuse.errors import InputError
    from mlpfuse.patching import folder as model_folder

    path = folder(tmp_path, None)
    os.mkfifo(os.path.join(path, "config.json"))  # opening it to read would wait for a writer forever
    with pytest.raises(InputError, match="config.json: not a regular file"):
        model_folder.read_config(path, "--model")


def test_bounds_hold_inside_sub_configs_and_per_layer_lists(tmp_path):
    from mlpfuse.errors import InputError
    from mlpfuse.patching import folder as model_folder

    nested = folder(tmp_path, {"model_type": "llava", "text_config": {"model_type": "llama", "vocab_size": 1 << 30}})
    with pytest.raises(InputError, match=r"text_config\.vocab_size: 1073741824, outside the 0 to 4194304"):
        model_folder.read_config(nested, "--model")
    lists = folder(tmp_path, {**TINY_LLAMA, "intermediate_size": [64, 1 << 40]}, "lists")
    with pytest.raises(InputError, match="intermediate_size: 1099511627776, outside the 0 to 1048576"):
        model_folder.read_config(lists, "--model")
    assert model_folder.read_config(folder(tmp_path, {**TINY_LLAMA, "intermediate_size": [64, 128]}, "ok"), "x")
