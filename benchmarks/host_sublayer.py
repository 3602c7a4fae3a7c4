"""Host µs per call of the MLP sublayer (post-attention RMSNorm + MLP) of a Llama-3-8B-shaped layer at decode sizes
(CUDA GPU, bf16, batch 1 and 8, one token).

    PYTHONPATH=src python3 benchmarks/host_sublayer.py        # host_layer.json under $OUT (default /tmp)

Variants: eager's modules; `mlpfuse.patch(fuse_norms=False)` (the norm eager, the MLP fused); `mlpfuse.patch` (the
norm handed to the MLP's decode kernels); and the MLP alone, eager and patched. Bursts of 8 calls started on an idle
GPU (a synchronize before each burst, none inside), so the time is what the host pays to issue them; median of 21
interleaved rounds, min-max; each variant's output error against eager's sublayer (bf16).
"""
import copy
import json
import os
import statistics
import time

import torch
import transformers

import mlpfuse
cfg = transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=1, num_attention_heads=32,
                               num_key_value_heads=8, vocab_size=1024)
torch.manual_seed(0)
base = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
nf = copy.deepcopy(base); mlpfuse.patch(nf, fuse_norms=False)
fu = copy.deepcopy(base); rep = mlpfuse.patch(fu)
print(rep.summary(), flush=True)
L = {n: m.model.layers[0] for n, m in (("eager", base), ("patched", nf), ("patched+norm", fu))}
def sub(layer):
    return lambda x: layer.mlp(layer.post_attention_layernorm(x))
def mlp_only(layer):
    return lambda x: layer.mlp(x)
res = {}
for batch in (1, 8):
    x = torch.randn(batch, 1, 4096, device="cuda", dtype=torch.bfloat16)
    fns = {f"{n} sublayer": sub(l) for n, l in L.items()}
    fns.update({"eager mlp only": mlp_only(L["eager"]), "patched mlp only": mlp_only(L["patched"])})
    with torch.no_grad():
        ref = fns["eager sublayer"](x).float()
        errs = {k: float((f(x).float() - ref).norm() / ref.norm()) for k, f in fns.items()}
        for f in fns.values():
            for _ in range(20): f(x)
        torch.cuda.synchronize()
        t = {k: [] for k in fns}
        for _ in range(21):
            for k, f in fns.items():
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(8): f(x)
                t[k].append((time.perf_counter() - t0) / 8 * 1e6)
            torch.cuda.synchronize()
    e = statistics.median(t["eager sublayer"]); em = statistics.median(t["eager mlp only"])
    for k, v in t.items():
        m = statistics.median(v)
        base_ = em if "mlp only" in k else e
        res[f"b{batch} {k}"] = (m, min(v), max(v), m / base_, errs[k])
        print(f"b{batch} {k:24s} host {m:6.1f} us [{min(v):.1f}-{max(v):.1f}]  {m / base_:.3f}x eager  "
              f"err {errs[k]:.2e}", flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "host_layer.json"), "w"), indent=1)
