"""mlpfuse.profile() removes the temporary trace folder it creates, unless asked to keep it; real CPU captures."""

import gzip
import json
import os
import tempfile

import pytest
import torch
from torch import nn

import mlpfuse
from mlpfuse.errors import InputError
from mlpfuse.profiling.capture import TEMP_PREFIX


@pytest.fixture
def temp_root(tmp_path, monkeypatch):
    """A private temporary folder for this test (other processes on the machine write to the shared one)."""
    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    assert tempfile.gettempdir() == str(root)
    return root


def _step():
    layer = nn.Linear(16, 8)
    x = torch.randn(4, 16)

    def step():
        with torch.no_grad():
            layer(x)

    return step


def _ours(root):
    return sorted(p.name for p in root.iterdir() if p.name.startswith(TEMP_PREFIX))


def test_profile_leaves_no_trace_folder_and_says_so(temp_root):
    for _ in range(2):
        a = mlpfuse.profile(_step(), label="fwd")
        assert a.trace_path is None and a.to_dict()["trace"] is None
        # The analysis was computed before the file went: it is complete without it.
        assert a.steps == 3 and a.op("aten::addmm")["per_step"] == 1
        assert "trace=None" in repr(a)
    assert _ours(temp_root) == []


def test_keep_trace_keeps_a_readable_trace(temp_root):
    a = mlpfuse.profile(_step(), label="fwd", keep_trace=True)
    assert os.path.dirname(a.trace_path).startswith(str(temp_root / TEMP_PREFIX))
    with gzip.open(a.trace_path, "rt") as fh:
        assert json.load(fh)["mlpfuse_label"] == "fwd"
    assert len(_ours(temp_root)) == 1
    assert mlpfuse.analyze(a.trace_path).to_dict()["per_step"] == a.per_step


def test_an_explicit_trace_path_is_kept_and_nothing_else_is_left(temp_root, tmp_path):
    path = tmp_path / "out" / "mine.pt.trace.json.gz"
    a = mlpfuse.profile(_step(), label="fwd", trace_path=str(path))
    assert a.trace_path == str(path) and path.is_file()
    assert sorted(p.name for p in path.parent.iterdir()) == ["mine.pt.trace.json.gz"]  # no temp file beside it
    assert _ours(temp_root) == []


def test_a_failing_step_leaves_nothing_behind(temp_root):
    def broken():
        raise ZeroDivisionError("in the user's step")

    for keep in (False, True):
        with pytest.raises(ZeroDivisionError):
            mlpfuse.profile(broken, label="fwd", keep_trace=keep)
    with pytest.raises(InputError, match="^steps: "):
        mlpfuse.profile(_step(), steps=0)
    assert _ours(temp_root) == []


def test_keep_trace_must_be_a_bool(temp_root):
    with pytest.raises(InputError, match="^keep_trace: expected True or False"):
        mlpfuse.profile(_step(), keep_trace="no")
    assert _ours(temp_root) == []
