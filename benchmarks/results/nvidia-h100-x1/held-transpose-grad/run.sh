#!/usr/bin/env bash
# One GPU: the held weight.t() of FusedLinear on CUDA (bf16 bits vs nn.Linear), host per call (hostprobe C), the
# walkthrough x3; MODELS=1 adds BERT and GPT-2 prefill (11 rounds).
set -u
O=${O:-/tmp/r47}; rm -rf $O; mkdir -p $O/work; W=$O/work; export O
T0=$SECONDS
nvidia-smi --query-gpu=name,clocks.sm --format=csv > $W/gpu.txt
export PYTHONPATH=src PYTHONUNBUFFERED=1 COLUMNS=160
s() { local name=$1 secs=$2; shift 2; timeout $secs "$@" > $W/$name.log 2>&1; echo "$name rc=$? $((SECONDS-T0))s" >> $W/summary.txt; }
s tests 120 python3 -m pytest -q -x -p no:cacheprovider tests/test_held_transpose.py tests/test_modules.py
s bits 60 python3 - <<'PY'
import torch, torch.nn as nn, copy
from mlpfuse import FusedLinear
torch.manual_seed(0)
for bias in (True, False):
    ref = nn.Linear(768, 3072, bias=bias, device="cuda", dtype=torch.bfloat16)
    m = FusedLinear.from_module(copy.deepcopy(ref), backend="auto")
    for step in range(3):
        x = torch.randn(8192, 768, device="cuda", dtype=torch.bfloat16)
        yr, ym = ref(x), m(x)
        (yr.float() ** 2).mean().backward(); (ym.float() ** 2).mean().backward()
        ok = torch.equal(yr, ym) and all(torch.equal(p.grad, q.grad) for p, q in zip(ref.parameters(), m.parameters()))
        print("bias", bias, "step", step, "bitwise equal outputs and grads:", ok, "held:", m._plan.weight_t.held is not None)
        with torch.no_grad():
            for p, q in zip(ref.parameters(), m.parameters()):
                p.sub_(0.01 * p.grad); q.sub_(0.01 * q.grad); p.grad = None; q.grad = None
PY
OUT=$W/host SECTIONS=C HELD=0 ROUNDS=9 s hostprobe 90 python3 benchmarks/results/nvidia-h100-x1/host-held-transpose/hostprobe.py
for i in 1 2 3; do s walkthrough$i 60 python3 -m mlpfuse walkthrough --out $W/walkthrough-$i; done
if [ -n "${MODELS:-}" ]; then
s bert 70 python3 -m mlpfuse bench --model bert-base --tokens 1x128,8x128 --mode prefill --variants eager,mlpfuse --rounds 11 --out $W/bert
s gpt2 75 python3 -m mlpfuse bench --model gpt2 --tokens 1x128,8x128 --mode prefill --variants eager,mlpfuse --rounds 11 --out $W/gpt2
fi
tar -C $O -czf $OUT/$(basename $O).tar.gz --exclude='*.html' --exclude='speedup.png' --exclude='*.pt.trace.json.gz' work 2>/dev/null
cat $W/gpu.txt; cat $W/summary.txt | cut -c1-80
tail -2 $W/tests.log | cut -c1-200; cat $W/bits.log | tail -8
sed -n '/C: medians/,$p' $W/host/hostprobe.txt
for i in 1 2 3; do echo "== walkthrough $i"; grep -E "^\| (linear|geglu)" $W/walkthrough-$i/readme-table.md 2>/dev/null | cut -c1-110; done
for m in gpt2 bert; do [ -d $W/$m ] && { echo "== $m"; grep -E "^\| (eager|mlpfuse)|^### " $W/$m/results.md 2>/dev/null | cut -c1-170; }; done
true
