"""Read a Triton kernel's sm_90 machine code on a machine without a GPU: compile it for Hopper with Triton's own
toolchain (ptxas and cuobjdump ship with Triton), then print its shared memory, how many of its loads became
asynchronous copies (software pipelining), and per loop the instruction count by opcode — a step's instruction
budget is what bounds a streaming kernel once its bytes are in flight.

    PYTHONPATH=src python3 benchmarks/sass_offline.py fp8-weight [--bf16-widening] [--warps 4 --stages 3]
    PYTHONPATH=src python3 benchmarks/sass_offline.py decode [--w8] [--norm 0|1]

Two facts the JIT decides at run time must be given by hand: integer arguments equal to 1 (inner strides) are
compiled as the constant 1 — left as plain integers, loads are not vectorised and nothing is pipelined — and
pointers and integers divisible by 16 carry `tt.divisibility` 16. What this read found: the FP8 weight-only
kernel's K step spent 128 of 465 instructions widening e4m3 to bf16 (F2F), the reason it streamed at ~2 TB/s
(benchmarks/results/nvidia-h200/fp8-stream/); on the GPU, bf16 x scaled by a constant showed up here first as HMUL2
on x (the compiler rounding x to fp16 before scaling it).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget

from mlpfuse.kernels import decode_mlp, fp8_gemm

_TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def compile_sm90(fn, types: dict, consts: dict, warps: int, stages: int):
    """`fn` compiled for sm_90: `types` maps each runtime argument to its Triton type ("*bf16", "i32", ...),
    `consts` the constexprs (inner strides of 1 among them). Integers and pointers other than M and the floats are
    taken as divisible by 16, as the JIT specialises them for aligned tensors."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
            continue
        t = types[name]
        sig[name] = t
        if (t.startswith("*") or t == "i32") and name != "M":
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))


def loops(sass: str):
    """(start, end, instruction count, opcode histogram) of each backward branch's body in cuobjdump's SASS (the
    software-pipelined main loop first; later ones are peeled iterations or epilogue loops)."""
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in
           (re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line) for line in sass.splitlines()) if m]
    at = {a: i for i, (a, _) in enumerate(ins)}
    for i, (a, text) in enumerate(ins):
        m = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) in at:
            body = ins[at[int(m.group(1), 16)]:i + 1]
            ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", s).split()[0].split(".")[0] for _, s in body)
            yield body[0][0], a, len(body), ops


def report(compiled, tag: str) -> None:
    ttgir = compiled.asm["ttgir"]
    n_async = len(re.findall(r"async_copy_global_to_local|async_tma_copy", ttgir))
    print(f"{tag}: shared {compiled.metadata.shared} B, "
          f"async copies {n_async}, synchronous loads left {ttgir.count('tt.load ')}")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        sass = subprocess.run([os.path.join(_TOOLS, "cuobjdump"), "-sass", path], capture_output=True, text=True,
                              check=True).stdout
    for start, end, count, ops in loops(sass):
        if count > 8:
            print(f"  loop {start:#x}-{end:#x}: {count} instructions; "
                  + ", ".join(f"{k} {v}" for k, v in ops.most_common(14)))


def fp8_weight(a) -> None:
    k = fp8_gemm.mlpfuse_fp8_weight_gemm_kernel
    desc = "tensordesc<fp8e4nv[64, 128]>"
    types = dict(x="*bf16", w1=desc, s1="*fp32", w2=desc, s2="*fp32", b1="*bf16", b2="*bf16", out="*bf16",
                 part="*fp32", nw="*bf16", res="*bf16", w1p="*fp8e4nv", w2p="*fp8e4nv", eps="fp32", x_shift="fp32")
    types.update({n: "i32" for n in ("M", "N", "K", "K_PER", "s_xm", "s_w1", "s_s1", "s_w2", "s_s2", "s_om", "s_rm")})
    consts = dict(ACT=3, GATED=True, HAS_B1=False, HAS_B2=False, DOT_PREC="tf32", BLOCK_N=64, BLOCK_M=16,
                  SPLIT=False, NORM=a.norm, I64=False, F16=not a.bf16_widening, TMA=True, HAS_RES=False, PDL=a.pdl)
    report(compile_sm90(k, types, consts, a.warps, a.stages), "fp8 weight-only gate+up")


def decode(a) -> None:
    k = decode_mlp.mlpfuse_decode_mlp_kernel
    w = "*fp8e4nv" if a.w8 else "*bf16"
    types = {n: "*bf16" for n in k.arg_names if n.endswith("_ptr")}
    types.update(wg_ptr=w, wu_ptr=w, wd_ptr=w, acc_ptr="*fp32", part_ptr="*fp32", cnt_ptr="*i32", sg_ptr="*fp32",
                 su_ptr="*fp32", sd_ptr="*fp32", eps="fp32", x_shift="fp32")
    consts = dict(ACT=3, HAS_BG=False, HAS_BU=False, HAS_BD=False, MODE=3, DOT_PRECISION="tf32", BLOCK_M=16,
                  BLOCK_H=128, BLOCK_D=128, BLOCK_O=128, BLOCK_F=4096, FENCE=True, I64=False, NORM=a.norm, W8=a.w8,
                  HAS_RES=True, PDL=True, PF_LINES=2, PF_STEP=128 if a.w8 else 64,
                  stride_xd=1, stride_gd=1, stride_ud=1, stride_dh=1, stride_od=1)
    types.update({n: "i32" for n in k.arg_names if n not in types and n not in consts})
    report(compile_sm90(k, types, consts, a.warps, a.stages), "decode kernel" + (" (e4m3 weights)" if a.w8 else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kernel", choices=("fp8-weight", "decode"))
    ap.add_argument("--warps", type=int)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--norm", type=int, default=0, choices=(0, 1))
    ap.add_argument("--w8", action="store_true", help="decode: e4m3 weights")
    ap.add_argument("--pdl", action="store_true", help="fp8-weight: launched as a programmatic dependent")
    ap.add_argument("--bf16-widening", action="store_true", help="fp8-weight: widen e4m3 to bf16 (F16 off: the form before fp16 MMAs)")
    a = ap.parse_args()
    if a.warps is None:
        a.warps = 4 if a.kernel == "fp8-weight" else 8
    (fp8_weight if a.kernel == "fp8-weight" else decode)(a)


if __name__ == "__main__":
    main()
