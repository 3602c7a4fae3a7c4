import sys, torch
sys.path.insert(0, "src")
from mlpfuse.ops import fp8_train as T
from torch.profiler import profile, ProfilerActivity
m, d, h = 4096, 4096, 14336
dev = "cuda"
x = torch.randn(m, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
ws = [(torch.randn(*s, device=dev) * 0.02).to(torch.bfloat16).requires_grad_() for s in ((h, d), (h, d), (d, h))]
dy = torch.randn(m, d, device=dev, dtype=torch.bfloat16)
def step():
    y = T.fp8_gated_mlp_train(x, *ws, activation="silu", backend="triton")
    y.backward(dy)
def bf16():
    y = torch.nn.functional.linear(torch.nn.functional.silu(torch.nn.functional.linear(x, ws[0])) * torch.nn.functional.linear(x, ws[1]), ws[2])
    y.backward(dy)
for f in (step, bf16):
    for _ in range(3): f()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
    e0.record()
    for _ in range(10): f()
    e1.record(); torch.cuda.synchronize()
    print(f.__name__, "ms/step", e0.elapsed_time(e1) / 10)
with profile(activities=[ProfilerActivity.CUDA]) as p:
    step(); torch.cuda.synchronize()
print(p.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
