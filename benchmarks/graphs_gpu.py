"""The fused MLP under CUDA graphs and torch.compile, on a CUDA GPU.

    PYTHONPATH=src python3 benchmarks/graphs_gpu.py [--only capture,decode] [--layers 32] [--rounds 5] [--out DIR]
                                                    [--model llama3-8b] [--batches 1,8]

capture: each path of a bf16 GatedMLP (decode, split, gated GEMM, the CUDA backend) captured by hand and compiled
(plain and mode="reduce-overhead"): the path each call took, replay against eager, cudagraph skips and graph breaks
from torch._dynamo's counters. decode: one decode step of a Llama-3-8B-shaped model (or another --model
preset; random init, bf16, transformers' StaticCache, prompt 128; patched with the norm in front of each MLP handed to
the block, as `patch` does) replayed from a CUDA graph — eager, mlpfuse.patch, torch.compile(fullgraph=True) and
both — at batch 1 and 8, variants interleaved in --rounds rounds (median, min-max of CUDA-event time over 20
replays), beside triton.testing.do_bench of the same replay (a second harness). The cache's device-side token
count is put back to the prompt before each timed block, so every replay times the same step.
"""
import argparse, json, os, statistics, sys, time
import torch
import mlpfuse
from mlpfuse.ops import dispatch

dev = torch.device("cuda")
bf16 = torch.bfloat16


def spy():
    seen = []
    orig = dispatch.gated_mlp_path

    def rec(backend, x, hidden, grad):
        p = orig(backend, x, hidden, grad)
        seen.append(p)
        return p
    dispatch.gated_mlp_path = rec
    return seen, orig


def capture_checks(out):
    from torch._dynamo.utils import counters
    rows = []
    cases = [("decode-1", 1, 4096, 14336, "auto"), ("decode-16", 16, 4096, 14336, "auto"),
             ("split-48", 48, 4096, 14336, "auto"), ("gated-512", 512, 4096, 14336, "auto"),
             ("gated-256-small", 256, 768, 3072, "auto"), ("decode-small-8", 8, 768, 3072, "auto"),
             ("cuda-4", 4, 4096, 14336, "cuda"), ("cuda-64", 64, 768, 3072, "cuda")]
    for name, m_, d, h, backend in cases:
        row = {"case": name}
        try:
            torch.manual_seed(0)
            m = mlpfuse.GatedMLP(d, h, activation="silu", device=dev, dtype=bf16, backend=backend)
            x = torch.randn(m_, d, device=dev, dtype=bf16)
            x2 = torch.randn(m_, d, device=dev, dtype=bf16)
            seen, orig = spy()
            with torch.no_grad():
                ref = m(x); ref2 = m(x2)
                row["eager_path"] = seen[-1] if seen else "?"
                # manual capture
                sx = x.clone()
                s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    for _ in range(3):
                        m(sx)
                torch.cuda.current_stream().wait_stream(s)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    sy = m(sx)
                g.replay(); torch.cuda.synchronize()
                row["graph_equal_1"] = bool(torch.equal(sy, ref))
                sx.copy_(x2); g.replay(); torch.cuda.synchronize()
                row["graph_equal_2"] = bool(torch.equal(sy, ref2))
                row["graph_maxdiff"] = float((sy.float() - ref2.float()).abs().max())
                # compiled, plain and reduce-overhead
                for mode in (None, "reduce-overhead"):
                    torch._dynamo.reset(); counters.clear(); seen.clear()
                    cm = torch.compile(m, fullgraph=True, mode=mode)
                    for _ in range(3):
                        y = cm(x)
                    y = cm(x2).clone(); torch.cuda.synchronize()
                    key = "ro" if mode else "compiled"
                    row[f"{key}_paths"] = sorted(set(seen))
                    row[f"{key}_equal"] = bool(torch.equal(y, ref2))
                    row[f"{key}_maxdiff"] = float((y.float() - ref2.float()).abs().max())
                    row[f"{key}_cudagraph_skips"] = dict(counters["inductor"]).get("cudagraph_skips", 0)
                    row[f"{key}_graph_breaks"] = sum(counters["graph_break"].values())
            dispatch.gated_mlp_path = orig
        except Exception as e:  # report and go on
            dispatch.gated_mlp_path = orig if 'orig' in dir() else dispatch.gated_mlp_path
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def _step_fn(model, cache):
    def step(tok, pos):
        return model(input_ids=tok, past_key_values=cache, cache_position=pos, use_cache=True).logits
    return step


def _rewind(cache, prompt):
    # transformers' static cache counts the tokens it took on the device (cumulative_length); a replayed step
    # advances it each time: put it back at the prompt so every timed step is the same step.
    for layer in getattr(cache, "layers", []):
        n = getattr(layer, "cumulative_length", None)
        if isinstance(n, torch.Tensor):
            n.fill_(prompt)


def decode_step(out, layers, batches, rounds, reps, prompt=128, model_name="llama3-8b"):
    from transformers import StaticCache
    from mlpfuse.bench import model_lab, models
    import triton.testing
    built = models.build(model_name, layers=layers, tiny=False, device=dev, dtype=bf16)
    base = built.model.eval()
    pm = model_lab.twin(base)
    rep = mlpfuse.patch(pm)
    print(f"patched {len(rep.swapped)}, norms fused {len(rep.norms)}", flush=True)
    results = []
    for batch in batches:
        g = torch.Generator(device="cpu").manual_seed(0)
        ids = torch.randint(0, built.vocab, (batch, prompt), generator=g).to(dev)
        tok = torch.randint(0, built.vocab, (batch, 1), generator=g).to(dev)
        pos = torch.tensor([prompt], device=dev)
        runs, firsts = {}, {}
        for name, model, comp in (("eager", base, False), ("mlpfuse", pm, False), ("compile", base, True),
                                  ("mlpfuse+compile", pm, True)):
            torch._dynamo.reset()
            cache = StaticCache(config=model.config, max_cache_len=prompt + 256)
            with torch.no_grad():
                model(input_ids=ids, past_key_values=cache, use_cache=True,
                      cache_position=torch.arange(prompt, device=dev))
                fn = _step_fn(model, cache)
                if comp:
                    fn = torch.compile(fn, fullgraph=True)
                s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    for _ in range(3):
                        fn(tok, pos)
                torch.cuda.current_stream().wait_stream(s)
                _rewind(cache, prompt)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    logits = fn(tok, pos)
                _rewind(cache, prompt)
                graph.replay(); torch.cuda.synchronize()
                first = logits.float().clone()  # the step at the prompt's end: what every variant is checked on
                for _ in range(5):
                    graph.replay()
                torch.cuda.synchronize()
            print(f"captured b{batch} {name}", flush=True)
            runs[name] = (graph, logits, cache)
            firsts[name] = first
        ref = firsts["eager"]
        times = {n: [] for n in runs}
        for r in range(rounds):
            for n, (graph, _, cache) in runs.items():
                _rewind(cache, prompt)
                for _ in range(3):
                    graph.replay()
                e0 = torch.cuda.Event(enable_timing=True); e1 = torch.cuda.Event(enable_timing=True)
                e0.record()
                for _ in range(reps):
                    graph.replay()
                e1.record(); torch.cuda.synchronize()
                times[n].append(e0.elapsed_time(e1) / reps)
        dob = {}
        for n, (graph, _, cache) in runs.items():
            _rewind(cache, prompt)
            dob[n] = triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median")
        for n, (graph, logits, _) in runs.items():
            med = statistics.median(times[n])
            row = {"batch": batch, "variant": n, "ms_median": med, "ms_min": min(times[n]), "ms_max": max(times[n]),
                   "do_bench_ms": dob[n],
                   "rel_err_vs_eager": float((firsts[n] - ref).norm() / ref.norm())}
            results.append(row)
        for n in runs:
            base_n = "compile" if "compile" in n else "eager"
            r = next(x for x in results if x["batch"] == batch and x["variant"] == n)
            b = next(x for x in results if x["batch"] == batch and x["variant"] == base_n)
            r["ratio_vs_" + base_n] = r["ms_median"] / b["ms_median"]
            r["do_bench_ratio"] = r["do_bench_ms"] / b["do_bench_ms"]
            print(json.dumps(r), flush=True)
        del runs
        torch.cuda.empty_cache()
    return results


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--only", default="capture,decode")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--model", default="llama3-8b", help="a model lab preset (mlpfuse bench --model list)")
    ap.add_argument("--batches", default="1,8")
    a = ap.parse_args()
    res = {"device": torch.cuda.get_device_name(), "model": a.model, "layers": a.layers}
    if "capture" in a.only:
        res["capture"] = capture_checks(a.out)
    if "decode" in a.only:
        res["decode"] = decode_step(a.out, a.layers, tuple(int(b) for b in a.batches.split(",")), a.rounds, a.reps,
                                    model_name=a.model)
    with open(os.path.join(a.out, f"graphs-{a.model}.json"), "w") as f:
        json.dump(res, f, indent=1)
    print("\n== summary", res["device"])
    for r in res.get("capture", []):
        print({k: v for k, v in r.items() if k in ("case", "eager_path", "graph_equal_2", "compiled_paths", "compiled_equal", "ro_equal", "ro_cudagraph_skips", "ro_graph_breaks", "error")})
    for r in res.get("decode", []):
        print(f"b{r['batch']:<2} {r['variant']:<16} {r['ms_median']:.3f} ms [{r['ms_min']:.3f}-{r['ms_max']:.3f}] do_bench {r['do_bench_ms']:.3f}  ratio {[v for k, v in r.items() if k.startswith('ratio')]} dob-ratio {r['do_bench_ratio']:.3f} err {r['rel_err_vs_eager']:.2e}")
