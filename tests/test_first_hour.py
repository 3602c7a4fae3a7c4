"""What a new user meets in a first hour on a CPU machine: no Triton installed, a model folder from
`save_pretrained`, mlpfuse's own result files passed back to it, a stopped walkthrough, small input mistakes in the
CLI and the Python API, and output read on a terminal or through a pipe."""

import io
import json
import os
import signal
import subprocess
import sys
import warnings

import pytest
import torch

from cli_run import SRC, assert_one_error_line, cli_env, run_cli

# Run in a process where `import triton` fails, as on a machine where it is not installed.
NO_TRITON = "import sys; sys.modules['triton'] = None; "
CASES = ["linear-eager", "linear-compile", "linear-mlpfuse", "geglu-mlp-eager", "geglu-mlp-compile",
         "geglu-mlp-mlpfuse"]


def _python(code: str, *args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", NO_TRITON + code, *map(str, args)], capture_output=True, text=True,
                          env=cli_env(), timeout=600, **kwargs)


@pytest.fixture(scope="module")
def no_triton_walkthrough(tmp_path_factory):
    out = tmp_path_factory.mktemp("walkthrough") / "w"
    proc = _python("from mlpfuse.cli import main; sys.exit(main(sys.argv[1:]))", "walkthrough", "--device", "cpu",
                   "--rounds", "1", "--steps", "3", "--out", out)
    return out, proc


@pytest.mark.slow
def test_the_walkthrough_without_triton_runs_every_case_with_one_note(no_triton_walkthrough):
    pytest.importorskip("transformers")  # the last case, a model's layer, needs it (install.sh installs it)
    out, proc = no_triton_walkthrough
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Warning" not in proc.stderr
    assert "not run" not in proc.stdout
    assert proc.stdout.startswith("note: Triton is not installed, so backend='auto' runs mlpfuse's PyTorch path")
    assert proc.stdout.count("Triton is not installed") == 1
    summary = json.loads((out / "summary.json").read_text())
    assert sorted(summary["cases"]) == sorted(CASES) and summary["failed"] == {}
    assert any(key.endswith("eager -> mlpfuse.patch") for key in summary["diffs"])


def test_gated_mlp_without_triton_falls_back_to_torch_with_one_warning():
    code = """
import warnings, torch, mlpfuse
import torch.nn.functional as F
from mlpfuse.errors import InputError
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    m = mlpfuse.GatedMLP(8, 16)
    x = torch.randn(2, 8)
    y = m(x)
    m(x)
    mlpfuse.FusedLinear(8, 16, activation="gelu_tanh")(x)
eager = F.linear(F.gelu(F.linear(x, m.gate_proj.weight), approximate="tanh") * F.linear(x, m.up_proj.weight),
                 m.down_proj.weight)
torch.testing.assert_close(y, eager)
print(len(caught), caught[0].message)
try:
    mlpfuse.GatedMLP(8, 16, backend="triton")(x)
except InputError as exc:
    print("InputError:", exc)
"""
    proc = _python(code)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    warned, error = proc.stdout.splitlines()
    assert warned.startswith("1 mlpfuse: Triton is not installed, so backend='auto' runs mlpfuse's PyTorch path")
    assert error.startswith("InputError: backend: 'triton' cannot run this call: Triton is not installed (pip "
                            "install triton")


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("llama")
    transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=256).save_pretrained(folder)
    assert json.loads((folder / "config.json").read_text()).get("architectures") is None
    return folder


def test_profile_model_takes_a_save_pretrained_folder_and_writes_report_html(llama_folder, tmp_path):
    out = tmp_path / "o"
    proc = run_cli("profile", "--model", llama_folder, "--device", "cpu", "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    html = (out / "report.html").read_text()
    assert "model-eager" in html and "model-mlpfuse" in html and "eager -&gt; mlpfuse.patch" in html
    assert f"report: {out / 'report.html'}" in proc.stdout
    # its model-diff.json is no trace: analyze says what to pass instead
    line = assert_one_error_line(run_cli("analyze", out / "model-diff.json"))
    assert "profile --model's model-diff.json, not a trace: pass" in line and "model-eager.pt.trace.json.gz" in line


def test_a_config_without_architectures_gets_its_model_types_lm_class(llama_folder, tmp_path):
    transformers = pytest.importorskip("transformers")
    from mlpfuse.bench import models

    assert type(models.shape_only(str(llama_folder), layers=None, tiny=False)).__name__ == "LlamaForCausalLM"
    bert = tmp_path / "bert"
    transformers.BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                            vocab_size=128).save_pretrained(bert)
    assert type(models.shape_only(str(bert), layers=None, tiny=False)).__name__ == "BertForMaskedLM"


def test_the_dry_run_counts_parameters_in_a_human_unit(llama_folder):
    from mlpfuse.patching.dry_run import _count

    assert [_count(n) for n in (96, 20_540, 124_440_000, 8_030_000_000)] == ["96", "20.54 K", "124.44 M", "8.03 B"]
    proc = run_cli("patch", "--dry-run", llama_folder)
    assert proc.returncode == 0 and " K parameters on the meta device" in proc.stdout.splitlines()[0]


@pytest.mark.slow
def test_analyze_of_the_walkthroughs_summary_says_what_to_pass(no_triton_walkthrough):
    out, proc = no_triton_walkthrough
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = assert_one_error_line(run_cli("analyze", out / "summary.json"))
    assert "mlpfuse walkthrough's summary, not a trace: pass one of the traces beside it" in line
    assert f"{out / CASES[0]}.pt.trace.json.gz" in line or ".pt.trace.json.gz" in line


@pytest.mark.slow
def test_a_stopped_walkthrough_leaves_a_note_in_rounds_too(tmp_path):
    out = tmp_path / "w"
    # SIGINT back to its default in the child (as tests/test_cli_outputs.py does): a suite started in the background
    # by a shell without job control (`cmd &`, `nohup`) inherits SIGINT ignored, and the child would too.
    # Many rounds: the run is still going when the signal comes, however late a busy machine lets this test read.
    proc = subprocess.Popen([sys.executable, "-m", "mlpfuse", "walkthrough", "--device", "cpu", "--rounds", "200",
                             "--steps", "3", "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=cli_env(PYTHONUNBUFFERED=1),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = []
    try:
        for line in proc.stdout:  # stopped once the first case of the first round has its trace in rounds/
            seen.append(line)
            if ": step " in line:
                break
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, f"exit {proc.returncode}; stdout {''.join(seen)[-1500:]}{rest[-1500:]}; stderr {err[-3000:]}"
    assert (out / "INCOMPLETE.txt").exists()
    note = (out / "rounds" / "INCOMPLETE.txt").read_text()
    assert "the run did not finish and these traces are partial" in note
    assert any(name.endswith(".pt.trace.json.gz") for name in os.listdir(out / "rounds"))


@pytest.mark.parametrize("flag", ["--dim", "--hidden"])
def test_bench_sizes_suggest_widths_not_token_shapes(flag, tmp_path):
    line = assert_one_error_line(run_cli("bench", flag, "0", "--out", tmp_path / "o"))
    assert line == f"mlpfuse: error: {flag}: expected positive integers like 768 or 768,4096, got '0'"
    line = assert_one_error_line(run_cli("bench", "--tokens", "0", "--out", tmp_path / "o"))
    assert "like 512 or 4x2048" in line


def test_the_python_api_names_its_own_arguments():
    import mlpfuse
    from mlpfuse.errors import InputError

    with pytest.raises(InputError, match=r"^fn: expected a callable .* got str 'x'$"):
        mlpfuse.profile("x")
    with pytest.raises(InputError, match=r"^expect='bogus': expected KEY=VALUE"):
        mlpfuse.profile(lambda: None, expect=["bogus"])
    result = mlpfuse.profile(lambda: None, expect="cpu-ops=0")  # one string: one expectation
    assert [r.expectation for r in result.expectations] == ["cpu-ops=0"]


def test_piped_bench_lines_carry_no_padding(tmp_path):
    proc = run_cli("bench", "--tokens", "1", "--dim", "64", "--hidden", "128", "--variants", "eager,mlpfuse",
                   "--rounds", "1", "--no-profile", "--no-plots", "--out", tmp_path / "o")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert any(line.startswith("geglu 1x64x128") for line in lines)  # the table's title
    assert [line for line in lines if line != line.rstrip()] == []


def test_on_an_80_column_terminal_short_columns_stay_whole_and_names_are_cut_apart():
    from mlpfuse.profiling import analyze, render
    from rich.console import Console

    data = analyze(os.path.join(os.path.dirname(SRC), "tests", "fixtures", "traces",
                                "geglu_eager.json.gz")).to_dict()
    console = Console(file=io.StringIO(), width=80, color_system=None)
    console.print(render.analysis_tables(data, 80)[1])
    text = console.file.getvalue()
    assert max(map(len, text.splitlines())) <= 80
    rows = [line for line in text.splitlines() if line.startswith("│")]
    assert len(rows) == len(data["kernels"])
    for row, k in zip(rows, data["kernels"]):
        cells = [c.strip() for c in row.strip("│").split("│")]
        assert cells[1] == k["family"] and cells[4] == ", ".join(k["ops"])  # whole, never "elemen…"
        assert cells[0] == k["name"] or (len(cells[0]) >= 20 and "…" in cells[0])
    assert len({row.split("│")[1] for row in rows}) == len(rows)  # two kernels never read alike

