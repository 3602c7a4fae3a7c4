#!/usr/bin/env bash
# Two GPUs: the copy-engine sum in the library — its test, multi_gpu.py (interleaved baseline), and the probe's forms.
set -u
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
export PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
O=/tmp/ce2; rm -rf $O; mkdir -p $O
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_pair_reduce.py > $O/test.log 2>&1; echo "test rc=$?"; tail -3 $O/test.log | cut -c1-300
timeout 200 python3 benchmarks/multi_gpu.py --gpus 2 --tokens 16384 --mode fwd,fwd+bwd --variants eager,mlpfuse,mlpfuse-serial --rounds 10 --out $O/multi-gpu > $O/multi-gpu.log 2>&1; echo "multi-gpu rc=$?"
OUT=$O timeout 150 python3 benchmarks/results/nvidia-h200-x2/tp-copy-engine/ceprobe.py > $O/ceprobe.log 2>&1; echo "ceprobe rc=$?"
tar -C $O -czf $OUT/ce2.tar.gz --exclude=traces . ; tar -C $O -czf $OUT/ce2-traces.tar.gz multi-gpu/traces 2>/dev/null
grep -E "^\| 16384" $O/multi-gpu/results.md | cut -c1-200
grep -vE "^\[W|FutureWarning|enable_symm" $O/ceprobe.log | tail -9
tail -5 $O/multi-gpu.log | cut -c1-200
