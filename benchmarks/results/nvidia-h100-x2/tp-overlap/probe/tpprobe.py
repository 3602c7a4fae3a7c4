"""TP forward probe, 2 GPUs, 16384x4096x14336 SwiGLU bf16: what bounds the 2-GPU step -- compute alone, the
all-reduce after the block, the down projection in 2/3/4/8 chunks (mlpfuse's form: 4, the last ~half), SM carveout
for the chunk GEMMs, the whole block in row chunks, NCCL settings -- against the full block on one GPU, all in the
same interleaved rounds. Each variant: CUDA events over REPS back-to-back steps, slowest rank, median of ROUNDS.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src \\
        FORMS=chunks,carveout PASSES=default,simple python3 tpprobe.py

FORMS (besides one-gpu, compute-only, serial, overlap4, overlap3): chunks (overlap2, overlap4-equal, overlap8),
carveout (overlap4-carve8/16, compute-carve16), rows (the whole block in 2/3/4/6 row chunks). PASSES, in order (each
adds its settings to the environment of the ones after it), one process group each -- default, simple (NCCL_PROTO=Simple), hiprio (a high-priority NCCL stream), conn1
(CUDA_DEVICE_MAX_CONNECTIONS=1), both (hiprio and conn1)."""
import os, sys, json, statistics
import torch, torch.distributed as dist, torch.multiprocessing as mp
sys.path.insert(0, "src")
M, D, H = 16384, 4096, 14336
REPS, ROUNDS = 10, int(os.environ.get("ROUNDS", "9"))
FORMS = set(filter(None, os.environ.get("FORMS", "").split(",")))
ORDER = ["one-gpu", "compute-only", "serial", "overlap2", "overlap4", "overlap4-equal", "overlap8", "overlap3",
         "overlap4-carve8", "overlap4-carve16", "compute-carve16", "rows2", "rows3", "rows4", "rows4-equal", "rows6"]
EXTRA = {"chunks": {"overlap2", "overlap4-equal", "overlap8"},
         "carveout": {"overlap4-carve8", "overlap4-carve16", "compute-carve16"},
         "rows": {"rows2", "rows3", "rows4", "rows4-equal", "rows6"}}
PASSES = {"default": {}, "simple": {"NCCL_PROTO": "Simple"}, "hiprio": {"HIPRIO": "1"},
          "conn1": {"HIPRIO": "0", "CUDA_DEVICE_MAX_CONNECTIONS": "1"},
          "both": {"HIPRIO": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}}


def run(rank, world, tag, out):
    torch.cuda.set_device(rank)
    kw = {}
    if os.environ.get("HIPRIO") == "1":
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = True
        kw["pg_options"] = opts
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank), **kw)
    from mlpfuse import activations
    from mlpfuse.ops import reduce_overlap as ro, dispatch
    from mlpfuse.ops.gated_mlp import hidden
    act = activations.get("silu")
    g = torch.Generator(device="cuda").manual_seed(0)
    dt = torch.bfloat16
    x = torch.randn(M, D, device="cuda", dtype=dt, generator=g)
    wg = torch.randn(H, D, device="cuda", dtype=dt, generator=g) * D ** -0.5
    wu = torch.randn(H, D, device="cuda", dtype=dt, generator=g) * D ** -0.5
    wd = torch.randn(D, H, device="cuda", dtype=dt, generator=g) * H ** -0.5
    n = H // world
    sg, su, sd = (wg[rank * n:(rank + 1) * n].contiguous(), wu[rank * n:(rank + 1) * n].contiguous(),
                  wd[:, rank * n:(rank + 1) * n].contiguous())
    path = dispatch.gated_mlp_path("auto", x, n, False)
    path1 = dispatch.gated_mlp_path("auto", x, H, False)
    grp = dist.group.WORLD
    carve = getattr(torch._C, "_set_sm_carveout_experimental", None)

    def h_of():
        return hidden(x, sg, su, None, None, act, path, False)[0]

    def chunks(h, nchunk, carve_sms=None, equal=False):
        y = h.new_empty(M, D); wdt = sd.t(); pend = []
        m = h.shape[0]
        cuts = ro.bounds(m, nchunk) if not equal else [(i * m // nchunk, (i + 1) * m // nchunk) for i in range(nchunk)]
        for i, (a, b) in enumerate(cuts):
            if carve_sms is not None and i >= 1: carve(carve_sms)
            torch.mm(h[a:b], wdt, out=y[a:b])
            if carve_sms is not None and i >= 1: carve(None)
            pend.append(dist.all_reduce(y[a:b], group=grp, async_op=True))
        for w in pend: w.wait()
        return y

    def rowchunks(nchunk, half_last=True):
        y = x.new_empty(M, D); wdt = sd.t(); pend = []
        cuts = ro.bounds(M, nchunk) if half_last else [(i * M // nchunk, (i + 1) * M // nchunk) for i in range(nchunk)]
        for a, b in cuts:
            h = hidden(x[a:b], sg, su, None, None, act, path, False)[0]
            torch.mm(h, wdt, out=y[a:b])
            pend.append(dist.all_reduce(y[a:b], group=grp, async_op=True))
        for w in pend: w.wait()
        return y

    def one():
        if rank == 0:
            h = hidden(x, wg, wu, None, None, act, path1, False)[0]
            return h @ wd.t()
    def nocomm():
        return h_of() @ sd.t()
    def serial():
        y = h_of() @ sd.t(); dist.all_reduce(y, group=grp); return y
    every = {"one-gpu": one, "compute-only": nocomm, "serial": serial,
             "overlap2": lambda: chunks(h_of(), 2), "overlap4": lambda: chunks(h_of(), 4),
             "overlap4-equal": lambda: chunks(h_of(), 4, equal=True), "overlap8": lambda: chunks(h_of(), 8),
             "overlap3": lambda: chunks(h_of(), 3),
             "overlap4-carve8": lambda: chunks(h_of(), 4, 8), "overlap4-carve16": lambda: chunks(h_of(), 4, 16),
             "compute-carve16": lambda: (carve(16), h_of() @ sd.t(), carve(None)),
             "rows2": lambda: rowchunks(2), "rows3": lambda: rowchunks(3), "rows4": lambda: rowchunks(4),
             "rows4-equal": lambda: rowchunks(4, False), "rows6": lambda: rowchunks(6)}
    chosen = {"one-gpu", "compute-only", "serial", "overlap4", "overlap3"}
    for form in FORMS:
        chosen |= EXTRA[form]
    if carve is None:
        chosen -= EXTRA["carveout"]
    V = {k: every[k] for k in ORDER if k in chosen}
    with torch.no_grad():
        ref = one() if rank == 0 else None
        for k in ("serial", "overlap4", "overlap4-carve16", "rows4"):
            if k in V:
                y = V[k]()
                if rank == 0: print(tag, k, "rel err vs one-gpu", float((y.float() - ref.float()).norm() / ref.float().norm()), flush=True)
        for f in V.values():
            for _ in range(3): f()
        torch.cuda.synchronize()
        res = {k: [] for k in V}
        for r in range(ROUNDS):
            for k, f in V.items():
                dist.barrier(); torch.cuda.synchronize()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                for _ in range(REPS): f()
                e.record(); e.synchronize()
                t = torch.tensor([s.elapsed_time(e) / REPS], device="cuda", dtype=torch.float64)
                if k != "one-gpu": dist.all_reduce(t, op=dist.ReduceOp.MAX)
                res[k].append(float(t))
    if rank == 0:
        one_ms = statistics.median(res["one-gpu"])
        lines = []
        for k, v in res.items():
            med = statistics.median(v)
            lines.append(f"{tag:8s} {k:18s} {med:7.3f} ms  [{min(v):.3f}-{max(v):.3f}]  speed-up vs one-gpu {one_ms / med:.3f}")
        print("\n".join(lines), flush=True)
        json.dump(res, open(os.path.join(out, f"tpprobe-{tag}.json"), "w"))
    dist.destroy_process_group()


def launch(tag, env, out):
    os.environ.update(env)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ["MASTER_PORT"] = str(29500 + len(tag))
    mp.spawn(run, args=(2, tag, out), nprocs=2, join=True)


if __name__ == "__main__":
    out = os.environ.get("OUT", "/tmp")
    for tag in os.environ.get("PASSES", "default").split(","):
        launch(tag, PASSES[tag], out)
