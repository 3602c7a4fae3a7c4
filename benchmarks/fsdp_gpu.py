"""FSDP2 training of a Llama-3-8B-shaped model on several GPUs, unpatched and `mlpfuse.patch`ed (NCCL).

    PYTHONPATH=src python3 benchmarks/fsdp_gpu.py OUT [--gpus 4 --layers 8 --batch 4 --seq 2048 --rounds 5 --reps 3]
    PYTHONPATH=src python3 benchmarks/fsdp_gpu.py OUT --cpu-gloo          # smoke run: tiny model, CPU processes

One process per GPU, started here. Each builds the same model (seeded, random weights, bf16), patches a copy before
sharding (a model sharded before patching is refused by `patch`), turns on activation checkpointing (transformers'
`gradient_checkpointing_enable`, non-reentrant), shards every decoder layer and then the root with `fully_shard`,
and trains with AdamW on its own batches (`--batch` × `--seq` tokens per rank, labels = inputs).

Checks first: three steps of each on the same batches from the same weights — the loss (mean over ranks) and the
global gradient norm of each step, patched against unpatched (bf16 rounding apart, they must agree to a few %).
Then timing: the two take turns over `--rounds` rounds of `--reps` steps, CUDA events per rank and the slowest
rank's time per step, median and spread; the peak memory a step allocates (the largest rank's). OUT gets
results.json; the table is printed last.
"""

from __future__ import annotations

import os

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(NO_MULTICAST)  # NVLink multicast stays off here and in every worker

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402


def build(args, device):
    import torch
    import transformers

    if args.cpu_gloo:
        cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                       num_key_value_heads=2, num_hidden_layers=args.layers, vocab_size=256)
        dtype = torch.float32
    else:
        cfg = transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                       num_key_value_heads=8, num_hidden_layers=args.layers, vocab_size=128256)
        dtype = torch.bfloat16
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg).to(dtype)
    return model, cfg.vocab_size


def prepare(model, mesh):
    from torch.distributed.fsdp import fully_shard

    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def worker(rank, world, args, store, out):
    os.environ.update(NO_MULTICAST)
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import mlpfuse

    if args.cpu_gloo:
        device = torch.device("cpu")
        backend = "gloo"
    else:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        backend = "nccl"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    mesh = init_device_mesh(device.type, (world,))
    base, vocab = build(args, device)
    patched = copy.deepcopy(base)
    report = mlpfuse.patch(patched)
    models = {"eager": prepare(base, mesh), "mlpfuse": prepare(patched, mesh)}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-5) for k, m in models.items()}
    gen = torch.Generator().manual_seed(1000 + rank)
    batches = [torch.randint(0, vocab, (args.batch, args.seq), generator=gen).to(device) for _ in range(4)]

    def step(name, ids):
        m, opt = models[name], opts[name]
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 1e9)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach(), norm.detach()

    checks = {k: [] for k in models}
    for name in models:
        for ids in batches[:3]:
            loss, norm = step(name, ids)
            dist.all_reduce(loss)
            checks[name].append((float(loss) / world, float(norm)))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(name, reps):
        sync()
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        for i in range(reps):
            step(name, batches[i % len(batches)])
        if device.type == "cuda":
            end.record()
        sync()
        ms = start.elapsed_time(end) / reps if device.type == "cuda" else (time.perf_counter() - t0) * 1e3 / reps
        peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0
        both = torch.tensor([ms, peak], dtype=torch.float64, device=device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        return float(both[0]), float(both[1])

    for name in models:  # warm: allocator and autotuning settle
        timed(name, 1)
    rounds = {k: [] for k in models}
    peaks = {k: [] for k in models}
    for _ in range(args.rounds):
        for name in models:
            ms, mb = timed(name, args.reps)
            rounds[name].append(ms)
            peaks[name].append(mb)
    if rank == 0:
        result = {"world": world, "args": vars(args), "device": torch.cuda.get_device_name(device)
                  if device.type == "cuda" else "cpu", "torch": torch.__version__,
                  "patch": report.summary()[:1500], "checks": checks, "rounds_ms": rounds, "peak_mb": peaks}
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump(result, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--gpus", type=int)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--cpu-gloo", action="store_true")
    args = p.parse_args(argv)
    import torch
    import torch.multiprocessing as mp

    if args.cpu_gloo:
        args.seq, args.batch, args.layers = min(args.seq, 32), min(args.batch, 2), min(args.layers, 2)
    world = args.gpus or (2 if args.cpu_gloo else torch.cuda.device_count())
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(world, args, os.path.join(tmp, "store"), args.out), nprocs=world,
                           start_method="spawn")
    with open(os.path.join(args.out, "results.json")) as f:
        r = json.load(f)
    r["command"] = " ".join([os.path.basename(sys.executable)] + sys.argv)
    rows = {}
    for name, vals in r["rounds_ms"].items():
        rows[name] = {"ms": statistics.median(vals), "min": min(vals), "max": max(vals),
                      "peak_mb": statistics.median(r["peak_mb"][name])}
    r["summary"] = rows
    r["agreement"] = {"loss_rel": [abs(a[0] - b[0]) / abs(a[0]) for a, b in zip(r["checks"]["eager"],
                                                                            r["checks"]["mlpfuse"])],
                      "grad_norm_rel": [abs(a[1] - b[1]) / abs(a[1]) for a, b in zip(r["checks"]["eager"],
                                                                                   r["checks"]["mlpfuse"])]}
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(r, f, indent=1)
    e, m = rows["eager"], rows["mlpfuse"]
    print(r["patch"].splitlines()[0] if r["patch"] else "patch: nothing")
    print(f"{r['device']} x{world}, FSDP2 + activation checkpointing, {args.layers} layers, {args.batch}x{args.seq} "
          f"tokens per rank, {args.rounds} rounds of {args.reps} steps")
    for name, v in rows.items():
        print(f"  {name:8s} {v['ms']:9.1f} ms/step [{v['min']:.1f}-{v['max']:.1f}]  peak {v['peak_mb']:9.0f} MiB")
    print(f"  mlpfuse / eager: time {m['ms'] / e['ms']:.3f}x, peak memory "
          f"{(m['peak_mb'] / e['peak_mb']) if e['peak_mb'] else float('nan'):.3f}x")
    print(f"  checks (3 steps, same batches): loss {[round(c[0], 4) for c in r['checks']['eager']]} vs "
          f"{[round(c[0], 4) for c in r['checks']['mlpfuse']]}; rel. diff loss "
          f"{max(r['agreement']['loss_rel']):.2e}, grad norm {max(r['agreement']['grad_norm_rel']):.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
