#!/usr/bin/env bash
# Two GPUs (any Hopper): the TP run with the library as it is (shrinking chunks), and the 2-GPU pair test.
nvidia-smi --query-gpu=name --format=csv,noheader | head -2
export PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
O=/tmp/tp50; rm -rf $O; mkdir -p $O
timeout 250 python3 benchmarks/multi_gpu.py --gpus 2 --tokens 16384 --mode fwd,fwd+bwd --variants eager,mlpfuse --rounds 10 --out $O/multi-gpu > $O/multi-gpu.log 2>&1; echo "== multi-gpu rc=$?"
grep -E "^\| 16384" $O/multi-gpu/results.md | cut -c1-200
tar -C $O -czf $OUT/tp50.tar.gz --exclude=traces .
