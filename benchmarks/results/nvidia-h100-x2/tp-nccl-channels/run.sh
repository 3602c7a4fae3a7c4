#!/usr/bin/env bash
# Two H100s only: the TP forward under NCCL channel caps and geometric chunks (multi_gpu.py fwd, 8 rounds each).
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
if ! nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -q "H100"; then echo "NOT_H100: stopping"; exit 0; fi
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
O=/tmp/tp48; rm -rf $O; mkdir -p $O
one() { local name=$1; shift; env "$@" PYTHONPATH=.lab/geom:src  # .lab/geom holds sitecustomize.py (this folder) timeout 100 python3 benchmarks/multi_gpu.py --gpus 2 --tokens 16384 --mode fwd --variants eager,mlpfuse --rounds 8 --no-profile --out $O/$name > $O/$name.log 2>&1; echo "== $name rc=$?"; grep -E "^\| 16384" $O/$name/results.md | cut -c1-120; }
one default X=1
one ch8 NCCL_MAX_NCHANNELS=8
one ch16 NCCL_MAX_NCHANNELS=16
one geom MLPFUSE_PROBE_BOUNDS=geom
one geom-ch8 MLPFUSE_PROBE_BOUNDS=geom NCCL_MAX_NCHANNELS=8
one default2 X=1
tar -C $O -czf $OUT/tp48.tar.gz --exclude=traces .
