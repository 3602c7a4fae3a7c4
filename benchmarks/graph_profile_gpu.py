"""The profiler inside CUDA graphs, on one GPU: a Llama-3-8B-shaped decode step (random weights, bf16, static cache)
replayed from a graph — the eager step captured, the compiled step (fullgraph=True) captured, and mlpfuse's patched
step captured — each replay attributed to modules through the map of one eager run; then the roofline of five kernel
families at prefill size checked against triton.testing.do_bench of the same op with the same shapes.

    PYTHONPATH=src python3 benchmarks/graph_profile_gpu.py OUT [--layers 32 --batch 1 --prompt 128] [--fp8]
        [--skip-roofline] [--skip-compiled]

--fp8 adds a fourth case: the model patched with precision="fp8", its step captured. Each case's MLP row also reads
as bytes: the MLP's weight bytes (scales included) over its time per layer, against the copy rate measured by
mlpfuse's roofline (the floor the decode targets are stated against).

Checks printed last (the issue's targets): the share of each replay's kernel time attributed to a module path
(≥ 98 %); the depth-1 module rows plus the unattributed time against the replay's busy time (within 1 %); the MLP
rows per layer against the MLP block alone, captured in a graph of its own and timed by CUDA events over replays and
by do_bench (within 5 %); each roofline figure against do_bench's (within 5 %). OUT gets the traces, maps, analyses
(JSON), an HTML report per case and summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

import mlpfuse
from mlpfuse.bench import decode_step, roofline
from mlpfuse.report import build
from mlpfuse.profiling import costs
from mlpfuse.profiling import modules as modules_mod
from mlpfuse.profiling import profile as mf_profile
from mlpfuse.profiling import record_graph_map


def llama(layers: int, device="cuda"):
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                   num_key_value_heads=8, num_hidden_layers=layers, vocab_size=128256,
                                   max_position_embeddings=8192, torch_dtype=torch.bfloat16)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    return model


def time_replays(fn, n=50, rounds=7):
    """CUDA-event µs per call over `rounds` rounds of `n` calls: (median, min, max)."""
    vals = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            fn()
        b.record()
        torch.cuda.synchronize()
        vals.append(a.elapsed_time(b) * 1e3 / n)
    return statistics.median(vals), min(vals), max(vals)


def graph_case(name, out, model, step, map_model, layers):
    """Map from one eager run, capture, profile the replays; the module view and the checks."""
    eager = decode_step.inference(step)
    for _ in range(3):
        eager()
    map_path = os.path.join(out, f"{name}.map.json")
    n_map = record_graph_map(eager, map_model, map_path)
    return map_path, n_map


def check_view(name, view, layers, block_us):
    n = view["steps"]
    top = [r for r in view["rows"] if r["depth"] == 1]
    top_us = sum(r["gpu_us"] for r in top) + sum(u["gpu_us"] for u in view["unattributed"])
    mlp = next((r for r in view["kinds"] if r["module"] == "model.layers.*.mlp"), None)
    mlp_per_layer = mlp["gpu_us"] / n / layers if mlp else None
    return {
        "case": name, "attributed_share": view["attributed_share"],
        "kernel_us_per_step": view["kernel_us"] / n, "busy_us_per_step": view["busy_us"] / n,
        "depth1_plus_unattributed_vs_busy": top_us / view["busy_us"] if view["busy_us"] else None,
        "between_share": view["between"]["gpu_us"] / view["kernel_us"] if view["kernel_us"] else None,
        "mlp_us_per_layer": mlp_per_layer, "block_alone_us": block_us,
        "mlp_vs_block": mlp_per_layer / block_us if mlp_per_layer and block_us else None,
        "replay_idle_us_per_step": view["replay_idle_us"] / n,
        "fusions": [(f["module"], f["gpu_us"], f["mlpfuse"]) for f in view["fusions"][:5]],
    }


def block_alone(mlp, batch):
    """The MLP block by itself at the step's shape, captured in a graph of its own: (CUDA events µs, do_bench µs)."""
    from triton.testing import do_bench

    x = torch.randn(batch, 1, 4096, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        replay, _ = decode_step.capture(lambda: mlp(x), torch.device("cuda"))
    ev = time_replays(replay, n=100)[0]
    db = do_bench(replay, warmup=25, rep=200, return_mode="median") * 1e3
    return ev, db


FAMILIES = {  # op -> how to call it from its recorded inputs, and which row of that op to check
    "aten::mm": (lambda t: torch.mm(t[0], t[1]), lambda r: r["module"].endswith("mlp.gate_proj")),
    "aten::mul": (lambda t: torch.mul(t[0], t[1]), None),
    "aten::silu": (lambda t: torch.nn.functional.silu(t[0]), None),
    "aten::mean": (lambda t: t[0].mean(-1, keepdim=True), None),
    "aten::copy_": (lambda t: t[0].copy_(t[1]), None),
    "aten::_scaled_dot_product_flash_attention":
        (lambda t: torch.ops.aten._scaled_dot_product_flash_attention(t[0], t[1], t[2], 0.0, True), None),
    "aten::_scaled_dot_product_efficient_attention":
        (lambda t: torch.ops.aten._scaled_dot_product_efficient_attention(t[0], t[1], t[2], None, False, 0.0, True),
         None),
    "aten::_cudnn_attention_forward":
        (lambda t: torch.ops.aten._scaled_dot_product_cudnn_attention(t[0], t[1], t[2], None, False, 0.0, True),
         None),
}
ROUNDS = 5
DTYPES = {"c10::BFloat16": torch.bfloat16, "float": torch.float32, "c10::Half": torch.float16}


class _Op(torch.nn.Module):
    """One op on fixed tensors, as a module: profiled with modules= it gets a module view, hence roofline rows."""

    def __init__(self, fn, tensors, repeat: int = 10):
        super().__init__()
        self.fn, self.tensors, self.repeat = fn, tensors, repeat
        self.flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")  # as do_bench: a cold L2 each call

    def forward(self):
        for _ in range(self.repeat):  # back to back, as do_bench runs them: the same clocks under the same load
            self.flush.zero_()
            out = self.fn(self.tensors)
        return out


def _against_do_bench(op, fn, tensors, peaks, inputs=None):
    """`fn(tensors)` alone, profiled by mlpfuse (its roofline row for `op`) and timed by do_bench, in turn for ROUNDS
    rounds: the row of medians, or None where the profile has no row for `op`."""
    from triton.testing import do_bench

    alone = _Op(fn, tensors)
    mine, times = [], []
    with torch.no_grad():
        alone()
        for _ in range(ROUNDS):  # the two harnesses take turns: clocks that drift move both
            iso = mf_profile(alone, modules=alone, steps=5, wait=1, warmup=1, active=3, record_shapes=True)
            mine += [x for x in iso.to_dict()["modules"]["roofline"]["rows"]
                     if x["op"] == op and (inputs is None or x["inputs"] == inputs)][:1]
            times.append(do_bench(lambda: fn(tensors), warmup=5, rep=40, return_mode="median") * 1e-3)
    if len(mine) != ROUNDS:
        print(f"{op}: alone, no roofline row (inputs {inputs})")
        return None
    r = mine[0]
    ridge = peaks["gemm_tflops"]["bf16"] * 1e12 / (peaks["copy_gbps"] * 1e9)  # FLOP per byte where the roofs meet
    # a compute-bound call's figure is its FLOP rate, a memory-bound one's its bandwidth
    key = "tflops" if r["flops"] / r["bytes"] > ridge else "gbps"
    t = statistics.median(times)
    db = costs.roofline(costs.Cost(r["flops"], r["bytes"], r["kind"]), t, peaks, costs.DTYPE_KEYS.get(r["dtype"]))
    alone_rate = statistics.median(x[key] for x in mine)
    return {"op": op, "inputs": r["inputs"], "dtypes": r["dtypes"], "kind": r["kind"], "kernel_alone": r["kernel"][:100],
            "alone_us": statistics.median(x["us_per_call"] for x in mine), "do_bench_us": t * 1e6,
            "do_bench_us_rounds": [v * 1e6 for v in times], "alone_rounds": [x[key] for x in mine], "metric": key,
            "alone": alone_rate, "do_bench": db[key], "ratio": alone_rate / db[key]}


def roofline_check(out, peaks, tokens):
    """A 1-layer model's prefill, eager, annotated: per family the row with the most bytes (the MLP's gate GEMM for
    mm). Its op is then run alone on tensors of the recorded shapes and dtypes (_against_do_bench), the in-model
    figure beside (in the model a kernel meets the L2 its neighbour left: dirty lines to write back, or its input
    still there). Then the decode sizes' GEMM (one token through the head's weight) and attention (8 sequences, one
    query each, 8192 cached keys): memory-bound, so their figure is a bandwidth."""
    model = llama(1)
    ids = torch.randint(0, 128256, (1, tokens), device="cuda")
    with torch.no_grad():
        model(ids)
        res = mf_profile(lambda: model(ids), modules=model, steps=4, wait=1, warmup=1, active=2, record_shapes=True,
                         trace_path=os.path.join(out, "prefill.pt.trace.json.gz"))
    view = res.to_dict()["modules"]
    rows = []
    for op, (fn, pick) in FAMILIES.items():
        cands = [r for r in view["roofline"]["rows"] if r["op"] == op and (pick is None or pick(r))]
        if not cands:
            continue
        r = max(cands, key=lambda r: r["bytes"])
        shapes = [tuple(int(v) for v in s.split("x")) for s in r["inputs"].split(" ")]
        tensors = [torch.randn(s, device="cuda").to(DTYPES.get(t, torch.bfloat16))
                   for s, t in zip(shapes, r["dtypes"])]
        if op == "aten::mm":  # a Linear's weight is read transposed: the same layout picks the same kernel
            tensors[1] = tensors[1].t().contiguous().t()
        row = _against_do_bench(op, fn, tensors, peaks, r["inputs"])
        if row:
            key = row["metric"]
            row.update(case="prefill", module=r["module"], kernel=r["kernel"][:100], in_model_us=r["us_per_call"],
                       in_model=r[key], in_model_ratio=r[key] / row["do_bench"])
            rows.append(row)
    bf = torch.bfloat16
    # the head's GEMM of one token: 1 GB of weight, so do_bench's per-call overhead (a few µs) stays under 2 %
    w = torch.randn(128256, 4096, device="cuda", dtype=bf).t()
    decode = [("aten::mm", lambda t: torch.mm(t[0], t[1]), [torch.randn(1, 4096, device="cuda", dtype=bf), w])]
    q = torch.randn(8, 32, 1, 128, device="cuda", dtype=bf)
    kv = [torch.randn(8, 32, 8192, 128, device="cuda", dtype=bf) for _ in range(2)]
    decode.append((None, lambda t: torch.nn.functional.scaled_dot_product_attention(*t), [q, *kv]))
    for op, fn, tensors in decode:
        if op is None:  # whichever SDPA backend runs: find its op in a first profile
            probe = _Op(fn, tensors)
            with torch.no_grad():
                found = mf_profile(probe, modules=probe, steps=3, wait=0, warmup=1, active=2, record_shapes=True)
            op = next((x["op"] for x in found.to_dict()["modules"]["roofline"]["rows"] if x["kind"] == "attention"),
                      None)
            if op is None:
                print("decode attention: no costed attention op in its profile")
                continue
        row = _against_do_bench(op, fn, tensors, peaks)
        if row:
            row.update(case="decode", module="", kernel=row["kernel_alone"], in_model_us=None, in_model=None,
                       in_model_ratio=None)
            rows.append(row)
    return rows, view


def _mlp_bytes(mlp) -> int:
    """The bytes a decode call of this MLP must read: its parameters and buffers (FP8 values and their scales)."""
    return sum(t.numel() * t.element_size() for t in (*mlp.parameters(), *mlp.buffers()))


def graphs(a, model, ids, token, dev, run_case, summary):
    """The three captured steps, each profiled right after its capture (a patch later frees the weights that the
    earlier graphs read). The MLP block alone is timed in the same form as in the step."""
    mlp = model.model.layers[0].mlp
    eager_block = block_alone(mlp, a.batch)
    # 1. the eager step captured
    step = decode_step.StaticStep(model, ids, token)
    map_path, n_map = graph_case("eager", a.out, model, step, model, a.layers)
    replay, _ = decode_step.capture(decode_step.inference(step), dev)
    run_case("eager-graph", replay, map_path, n_map, *eager_block, _mlp_bytes(mlp))
    del replay
    # 2. the compiled step captured, attributed through the same eager map (compiled code drops module
    # annotations; its GEMMs and attention anchor the walk)
    if not a.skip_compiled:
        compiled_block = block_alone(torch.compile(mlp, fullgraph=True), a.batch)
        cstep = decode_step.StaticStep(model, ids, token)
        creplay, _ = decode_step.capture(decode_step.inference(torch.compile(cstep, fullgraph=True)), dev)
        run_case("compiled-graph", creplay, map_path, n_map, *compiled_block, _mlp_bytes(mlp))
        del creplay
    # 3. mlpfuse.patch'ed, its eager step captured, with a map of its own; 4. (--fp8) the same model patched in FP8
    # instead, the bf16 patch undone first
    for name, precision in (("mlpfuse", None), *((("mlpfuse-fp8", "fp8"),) if a.fp8 else ())):
        if precision is not None:
            mlpfuse.unpatch(model)
        summary[f"patch {name}"] = str(mlpfuse.patch(model, precision=precision))[:2000]
        pmlp = model.model.layers[0].mlp
        pblock = block_alone(pmlp, a.batch)
        pstep = decode_step.StaticStep(model, ids, token)
        pmap, pn = graph_case(name, a.out, model, pstep, model, a.layers)
        preplay, _ = decode_step.capture(decode_step.inference(pstep), dev)
        run_case(f"{name}-eager-graph", preplay, pmap, pn, *pblock, _mlp_bytes(pmlp))
        del preplay

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--skip-roofline", action="store_true")
    ap.add_argument("--prefill", type=int, default=16384, help="tokens of the roofline check's prefill")
    ap.add_argument("--skip-graphs", action="store_true")
    ap.add_argument("--skip-compiled", action="store_true", help="no compiled case (saves its compile time)")
    ap.add_argument("--fp8", action="store_true", help="also the step patched with precision='fp8'")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    dev = torch.device("cuda")
    peaks = roofline.load_peaks(dev, ["bf16"]).to_dict()
    summary = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "peaks": peaks,
               "command": " ".join([os.path.basename(sys.executable)] + sys.argv), "cases": []}
    roof_rows = []
    if not a.skip_roofline:
        roof_rows, _ = roofline_check(a.out, peaks, a.prefill)
        summary["roofline_vs_do_bench"] = roof_rows
        print("roofline:", json.dumps(roof_rows, indent=1), flush=True)

    model = llama(a.layers) if not a.skip_graphs else None
    ids = torch.randint(0, 128256, (a.batch, a.prompt), device="cuda")
    token = torch.randint(0, 128256, (a.batch, 1), device="cuda")

    def run_case(name, fn, map_path, n_map, bev, bdb, mlp_bytes):
        trace = os.path.join(a.out, f"{name}.pt.trace.json.gz")
        res = mf_profile(fn, steps=5, wait=1, warmup=1, active=3, graph_map=map_path, trace_path=trace,
                         record_shapes=False)
        data = res.to_dict()
        with open(os.path.join(a.out, f"{name}.analysis.json"), "w") as f:
            json.dump(data, f)
        build.write(os.path.join(a.out, f"{name}.html"), f"{name}: a {a.layers}-layer decode step replayed",
                    [build.Variant(name=name, analysis=data, trace_path=trace)])
        view = data["modules"]
        row = check_view(name, view, a.layers, bev)
        row.update(map_kernels=n_map, block_alone_do_bench_us=bdb, step_us=time_replays(fn, n=20)[0],
                   mlp_bytes=mlp_bytes)
        if row.get("mlp_us_per_layer"):  # the MLP row as a stream: its bytes over its time, against the copy rate
            row["mlp_gbps"] = mlp_bytes / row["mlp_us_per_layer"] / 1e3
            row["mlp_vs_copy"] = row["mlp_gbps"] / peaks["copy_gbps"] if peaks.get("copy_gbps") else None
        summary["cases"].append(row)
        print("\n".join(modules_mod.render(view)[:60]), flush=True)

    if a.skip_graphs:
        cases_done = False
    else:
        cases_done = True
        graphs(a, model, ids, token, dev, run_case, summary)
    summary["graphs_run"] = cases_done

    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    print(f"\n{summary['device']}, {a.layers} layers, batch {a.batch}, prompt {a.prompt}")
    print("case                  attributed  by-position  depth1+unattr/busy  MLP/layer us  block us (events|do_bench)"
          "  MLP/block  step us  MLP GB/s (of copy)")
    for r in summary["cases"]:
        print(f"{r['case']:<21} {r['attributed_share']:10.2%} {r['between_share'] or 0:11.2%} "
              f"{r['depth1_plus_unattributed_vs_busy'] or 0:18.4f} {r['mlp_us_per_layer'] or 0:13.1f} "
              f"{r['block_alone_us']:9.1f} | {r['block_alone_do_bench_us']:7.1f} {r['mlp_vs_block'] or 0:10.3f} "
              f"{r['step_us']:8.1f}  {r.get('mlp_gbps') or 0:6.0f} ({r.get('mlp_vs_copy') or 0:.0%})")
    print(f"copy rate (mlpfuse's roofline, read + write): {peaks.get('copy_gbps') or 0:.0f} GB/s")
    for r in roof_rows:
        in_model = (f" | in the model {r['in_model']:7.1f} ({r['in_model_ratio']:.3f}), same kernel: "
                    f"{r['kernel'] == r['kernel_alone']}" if r["in_model"] is not None else "")
        print(f"roofline {r['case']:<7} {r['op']:<32} {r['inputs'][:40]:<40} {r['metric']}: mlpfuse alone "
              f"{r['alone']:7.1f} do_bench {r['do_bench']:7.1f} ratio {r['ratio']:.3f}{in_model}")


if __name__ == "__main__":
    main()
