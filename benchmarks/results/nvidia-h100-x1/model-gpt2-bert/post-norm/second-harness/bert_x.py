"""Second harness for BERT-base prefill (eager vs mlpfuse.patch), independent of the model lab: host wall per
forward (perf_counter around bursts of 10 synced forwards) and triton.testing.do_bench per forward, 15 interleaved
rounds; plus host µs per call of one layer's output block (BertOutput vs the post-norm block), bursts of 200 calls."""
import copy, json, os, statistics, time, torch, transformers, mlpfuse
from triton.testing import do_bench
torch.manual_seed(0)
cfg = transformers.BertConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, vocab_size=30522, max_position_embeddings=512)
base = transformers.BertForMaskedLM(cfg).to("cuda", torch.bfloat16).eval()
pat = copy.deepcopy(base); rep = mlpfuse.patch(pat); print(rep.summary().splitlines()[0], flush=True)
res = {}
with torch.no_grad():
    for b in (1, 8):
        ids = torch.randint(0, 30522, (b, 128), device="cuda")
        fns = {"eager": lambda: base(input_ids=ids), "mlpfuse": lambda: pat(input_ids=ids)}
        assert torch.equal(fns["eager"]().logits, fns["mlpfuse"]().logits)
        for f in fns.values():
            for _ in range(20): f()
        wall = {k: [] for k in fns}; db = {k: [] for k in fns}
        for r in range(15):
            order = list(fns) if r % 2 == 0 else list(fns)[::-1]
            for k in order:
                torch.cuda.synchronize(); t0 = time.perf_counter()
                for _ in range(10): fns[k]()
                torch.cuda.synchronize(); wall[k].append((time.perf_counter() - t0) / 10 * 1e3)
                db[k].append(do_bench(fns[k], warmup=5, rep=40))
        for name, d in (("wall", wall), ("do_bench", db)):
            e, m = statistics.median(d["eager"]), statistics.median(d["mlpfuse"])
            per = statistics.median([a / c for a, c in zip(d["mlpfuse"], d["eager"])])
            sp = lambda v: (max(v) - min(v)) / statistics.median(v) * 100
            print(f"{b}x128 {name:8s} eager {e:.3f} ms (±{sp(d['eager']):.0f}%) mlpfuse {m:.3f} ms (±{sp(d['mlpfuse']):.0f}%) ratio {m/e:.3f} per-round {per:.3f}", flush=True)
            res[f"{b}x128 {name}"] = {"eager": d["eager"], "mlpfuse": d["mlpfuse"]}
    h = torch.randn(1, 128, 3072, device="cuda", dtype=torch.bfloat16); r_ = torch.randn(1, 128, 768, device="cuda", dtype=torch.bfloat16)
    blocks = {"BertOutput": base.bert.encoder.layer[0].output, "post-norm block": pat.bert.encoder.layer[0].output}
    hu = {k: [] for k in blocks}
    for r in range(15):
        for k, m in blocks.items():
            torch.cuda.synchronize(); t0 = time.perf_counter()
            for _ in range(200): m(h, r_)
            hu[k].append((time.perf_counter() - t0) / 200 * 1e6)
            torch.cuda.synchronize()
    for k, v in hu.items():
        print(f"host per call {k:16s} {statistics.median(v):.1f} us [{min(v):.1f}-{max(v):.1f}]", flush=True)
    res["block host us"] = hu
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "bert_x.json"), "w"))
