#!/usr/bin/env bash
# Two H100s only: shrinking chunks (the library now) against the previous chunking (MLPFUSE_PROBE_BOUNDS=half via
# .lab/geom/sitecustomize.py), alternating processes, forward; then the run with the library as it is.
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
if ! nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -q "H100"; then echo "NOT_H100: stopping"; exit 0; fi
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
O=/tmp/tp49; rm -rf $O; mkdir -p $O
one() { local name=$1; shift; env "$@" PYTHONPATH=.lab/geom:src timeout 100 python3 benchmarks/multi_gpu.py --gpus 2 --tokens 16384 --mode fwd --variants eager,mlpfuse --rounds 8 --no-profile --out $O/$name > $O/$name.log 2>&1; echo "== $name rc=$?"; grep -E "^\| 16384.*mlpfuse" $O/$name/results.md | cut -c1-100; }
for i in 1 2 3; do one shrink$i X=1; one half$i MLPFUSE_PROBE_BOUNDS=half; done
PYTHONPATH=src timeout 200 python3 benchmarks/multi_gpu.py --gpus 2 --tokens 16384 --mode fwd,fwd+bwd --variants eager,mlpfuse --rounds 10 --out $O/multi-gpu > $O/multi-gpu.log 2>&1; echo "== multi-gpu rc=$?"
grep -E "^\| 16384" $O/multi-gpu/results.md | cut -c1-200
tar -C $O -czf $OUT/tp49.tar.gz --exclude=traces .
