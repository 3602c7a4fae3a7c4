"""benchmarks/ab_switch.py: a dispatch setting A/B'd in one bench run. Its refusals (one line, exit 2), that the
setting holds during the switched variant's steps and is restored after each, and a whole run on the CPU."""

import json

import pytest

from cli_run import benchmark_script
from mlpfuse.ops import dispatch


@pytest.fixture(scope="module")
def script():
    return benchmark_script("ab_switch")


@pytest.mark.parametrize("argv,words", [
    ([], "usage: ab_switch.py SETTING=VALUE NAME"),
    (["MERGED_DW_MAX_M=0", "twodw", "--tokens", "8"], "usage:"),
    (["NO_SUCH_SETTING=1", "x", "--"], "has no setting 'NO_SUCH_SETTING'"),
])
def test_bad_arguments_are_one_line(script, capsys, argv, words):
    assert script.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("ab_switch.py: error:") and words in err, err


def test_the_setting_holds_inside_the_switched_step_only(script):
    seen = []
    kept = dispatch.MERGED_DW_MAX_M
    step = script._switched(lambda problem: lambda: seen.append(dispatch.MERGED_DW_MAX_M), "MERGED_DW_MAX_M", 7)
    step(None)()
    assert seen == [7] and dispatch.MERGED_DW_MAX_M == kept

    def failing(problem):
        def step():
            raise RuntimeError("boom")
        return step

    with pytest.raises(RuntimeError):
        script._switched(failing, "MERGED_DW_MAX_M", 9)(None)()
    assert dispatch.MERGED_DW_MAX_M == kept


def test_a_run_times_both_modules_beside_the_peers(script, tmp_path):
    out = tmp_path / "ab"
    rc = script.main(["MERGED_DW_MAX_M=0", "twodw", "--", "--tokens", "8", "--dim", "16", "--hidden", "32",
                      "--workload", "geglu", "--mode", "fwd+bwd", "--rounds", "2", "--no-profile", "--out", str(out)])
    assert rc == 0
    rows = {r["variant"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    assert {"eager", "compile", "mlpfuse", "mlpfuse-twodw", "mlpfuse-twodw-cudagraph"} <= set(rows)
    for name in ("mlpfuse", "mlpfuse-twodw"):  # both checked against the fp64 reference, gradients included
        assert rows[name]["status"] == "ok" and rows[name]["errors"]["dx"] < rows[name]["tolerance"]
