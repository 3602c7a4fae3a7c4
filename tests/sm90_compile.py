"""Compiling kernels for Hopper (sm_90a) on any machine, no GPU: Triton lowers them and its own ptxas reports the
registers and spills. Run in a subprocess without TRITON_INTERPRET (the interpreter's stand-ins for Triton functions
cannot be compiled); `run(body)` executes `body` there with `compile_sm90` defined, and returns what it printed
last, as JSON."""

import json
import os
import subprocess
import sys

import pytest

_HELPER = r'''
import json, os, re, subprocess, sys, tempfile
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource
from triton.runtime.jit import mangle_type


def compile_sm90(kernel, args, consts, **options):
    """kernel compiled for sm_90a: {"spills": bytes spilled (stores + loads), "regs", "ptx", "smem"}."""
    sig = {name: mangle_type(v) for name, v in args.items()} | {name: "constexpr" for name in consts}
    if getattr(kernel, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as source
    else:
        source = ASTSource
    kern = triton.compile(source(kernel, sig, consts), target=GPUTarget("cuda", 90, 32), options=options)
    ptx = kern.asm["ptx"]
    d = tempfile.mkdtemp()
    path = os.path.join(d, "k.ptx")
    with open(path, "w") as f:
        f.write(ptx)
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    info = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", path, "-o", path + ".o"], capture_output=True,
                          text=True, check=True).stderr
    spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", info))
    regs = max(int(x) for x in re.findall(r"Used (\d+) registers", info))
    return dict(spills=spills, regs=regs, ptx=ptx, smem=kern.metadata.shared)
'''


def run(body: str, *argv: str):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = os.path.join(os.path.dirname(__file__), "..", "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, "-c", _HELPER + body, *argv], env=env, capture_output=True, text=True,
                         timeout=900)
    if out.returncode != 0 and "No module named 'triton.experimental.gluon" in out.stderr:
        pytest.skip("this Triton has no Gluon")
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
