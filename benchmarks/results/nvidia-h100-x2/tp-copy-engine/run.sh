#!/usr/bin/env bash
# Two H100s only: the pair_reduce test, then multi_gpu.py with the copy-engine variant in the same rounds.
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
if ! nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -q "H100"; then echo "NOT_H100: stopping"; exit 0; fi
export PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
O=/tmp/tp47; rm -rf $O; mkdir -p $O
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_pair_reduce.py > $O/test.log 2>&1; echo "test rc=$?"; tail -2 $O/test.log
timeout 300 python3 benchmarks/multi_gpu.py --gpus 2 --tokens 16384 --mode fwd,fwd+bwd --variants eager,mlpfuse,mlpfuse-ce --rounds 10 --out $O/multi-gpu > $O/multi-gpu.log 2>&1; echo "multi-gpu rc=$?"
tar -C $O -czf $OUT/tp47.tar.gz --exclude=traces .
grep -E "^\| 16384" $O/multi-gpu/results.md | cut -c1-200
