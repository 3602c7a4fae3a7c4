#!/usr/bin/env bash
# One GPU run: the steps named on the command line, in order, each under its own time limit, then one archive
# of everything they wrote and a short summary printed last.
#   bash benchmarks/gpu_run.sh OUTDIR STEP[:SECONDS] ...
# Steps: numerics, int64 (tensors past 2**31 elements; ~80 GB), tests, gpu-tests (the files whose path changes on
#        CUDA), plan-tests, walkthrough, model-lab, model-prefill-32, model-decode-32, model-gpt2, model-bert,
#        bench-blog, bench-linear, bench-large, bench-large-train, bench-train-mid, bench-decode, bench-small,
#        bench-sweep, bench-sweep-small, bench-sweep-small-large, bench-sweep-mid, bench-sweep-mid-large,
#        bench-sweep-train, bench-sweep-large, bench-sweep-large-train, kernels, tune-mid-m, tune-small-m,
#        tune-linear, tune-blog, tune-llama, host-paths, host-paths-train, cuda-backend, decode-kernels,
#        decode-shapes (the CUDA decode kernels' launch shapes, benchmarks/decode_shapes.cu; needs nvcc and sm_90),
#        multi-gpu, multi-gpu-sp (every visible GPU, tensor parallel; NCCL with NVLink multicast off),
#        tune-decode, model-decode-step, model-prefill-compile, model-train-compile, model-generate-compile (the
#        compiled and graph-replayed rows of the model lab, 32 layers; training 4), model-generate-eager (plain
#        generate, batch 1 and 8; ~300 s on an H100 host), layer-sweep-DxH-MODE (one layer
#        size, MODE fwd or fwd+bwd: 64-16384 tokens, GeGLU and SwiGLU, every peer, the GEMMs-alone floor and mlpfuse in a
#        CUDA graph beside eager in one), fp8-tests, fp8-tune, fp8-block, fp8-graphs, fp8-bench, fp8-decode-step,
#        residual-tests, decode-step-ab (the residual add in the decode kernels' epilogue and programmatic dependent
#        launch: their tests on the GPU, and the 32-layer decode step with each switched off in the same run),
#        fp8-prefill, fp8-lm, fp8-stream, fp8-stream-unroll, fp8-ws, fp8-accuracy (FP8: the GPU tests, the tile
#        sweeps, the block in eager / graphs / the bench's harness with the peers (torchao from .whl/), the 32-layer
#        decode step and prefill, the trained-model perplexity, the weight-only kernel's streaming probes, the
#        warp-specialized GEMM against the Triton kernel and cuBLAS, the output error against the rowwise recipe over
#        64–16384 tokens and 4 layers), fp8-train (FP8 training's tests and the 4-layer train step),
#        fp8-train-probe (one FP8 block's forward + backward kernel by kernel, bf16 and torchao beside it),
#        fp8-train-lm (the stdlib model trained in bf16, mlpfuse bf16 / save-fp8 / FP8 and torchao float8),
#        fp8-train-lm-split (the same with mlpfuse FP8 on its kernels and on the reference path, bf16 and torchao),
#        fp8-train-bisect (mlpfuse FP8 training with each half of the step on the kernels or the reference path, and
#        the kernels' outputs against the reference path's on the same inputs while the model trains),
#        fp8-train-recipes (the recipe against a rowwise one with power-of-two scales and against itself with
#        power-of-two scales, each from two seeds),
#        train-share (the MLPs' share of a train step, torchao beside it),
#        graph-profile-fp8 (the decode step's MLP rows in bf16 and FP8, as bytes against the copy rate),
#        attention-tests, decode-linear-probe, attention-ab (the attention's projections on the decode kernel: their
#        GPU tests, the kernel against cuBLAS, the 32-layer decode step with and without them).
#        benchmarks/README.md says what each answers and where its latest result is.
# Liger is used when importable; wheels in .whl/ are installed to a private target first (no network needed).
set -u
cd "$(dirname "$0")/.."
OUT=${1:?usage: gpu_run.sh OUTDIR STEP...}; shift
W=$OUT/work; mkdir -p "$W"
export PYTHONUNBUFFERED=1 COLUMNS=160 PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
# NVLink multicast stays off for every process of every step (benchmarks/multi_gpu.py also sets it itself).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/mlpfuse-site .whl/*.whl \
        && export PYTHONPATH=$PYTHONPATH:/tmp/mlpfuse-site
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$W/gpu.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" >> "$W/gpu.txt" 2>&1
SUMMARY=$W/summary.txt; : > "$SUMMARY"

run_step() {  # name seconds command...
    local name=$1 secs=$2; shift 2
    local t0=$SECONDS
    timeout "$secs" "$@" > "$W/$name.log" 2>&1
    local rc=$?
    printf '%-14s rc=%-3s %4ss  %s\n' "$name" "$rc" "$((SECONDS - t0))" "$*" >> "$SUMMARY"
}

for spec in "$@"; do
    step=${spec%%:*}; secs=${spec#*:}; [ "$secs" = "$spec" ] && secs=300
    case $step in
        numerics) run_step numerics "$secs" python3 benchmarks/numerics_gpu.py --workers 12 --budget-s $((secs - 30)) --out "$W/numerics-h200.txt" ;;
        int64) run_step int64 "$secs" python3 benchmarks/numerics_gpu.py --int64 --out "$W/int64.json" ;;
        tests) run_step tests "$secs" python3 -m pytest -q -p no:cacheprovider tests ;;
        plan-tests) run_step plan-tests "$secs" python3 -m pytest -q -p no:cacheprovider tests/test_call_plan.py ;;
        gpu-tests) run_step gpu-tests "$secs" python3 -m pytest -q -p no:cacheprovider --durations=10 \
            tests/test_kernels_plans.py tests/test_kernels_decode.py tests/test_kernels_gemm.py \
            tests/test_kernels_int64.py tests/test_ops.py tests/test_modules.py tests/test_compile.py tests/test_call_plan.py \
            tests/test_module_repeats.py tests/test_graphs.py tests/test_compiled_inference.py ;;
        walkthrough) run_step walkthrough "$secs" python3 -m mlpfuse walkthrough --out "$W/walkthrough" ;;
        model-lab) run_step model-lab "$secs" python3 -m mlpfuse bench --model llama3-8b --layers 4 --tokens 1x2048 \
            --mode prefill,decode,train --variants eager,liger,mlpfuse --out "$W/model-lab" ;;
        model-prefill-32) run_step model-prefill-32 "$secs" python3 -m mlpfuse bench --model llama3-8b --tokens 1x8192 \
            --mode prefill --variants eager,mlpfuse --out "$W/model-prefill-32" ;;
        model-decode-32) run_step model-decode-32 "$secs" python3 -m mlpfuse bench --model llama3-8b --tokens 1x128 \
            --mode decode --variants eager,compile,mlpfuse,mlpfuse-compile --out "$W/model-decode-32" ;;
        model-gpt2) run_step model-gpt2 "$secs" python3 -m mlpfuse bench --model gpt2 --tokens 1x128,8x128 \
            --mode prefill,decode,train --variants eager,mlpfuse --out "$W/model-gpt2" ;;
        model-bert) run_step model-bert "$secs" python3 -m mlpfuse bench --model bert-base --tokens 1x128,8x128 \
            --mode prefill,train --variants eager,mlpfuse --out "$W/model-bert" ;;
        bench-blog) run_step bench-blog "$secs" python3 -m mlpfuse bench --preset blog --workload geglu --mode fwd,fwd+bwd --out "$W/bench-blog" ;;
        bench-linear) run_step bench-linear "$secs" python3 -m mlpfuse bench --workload linear --tokens 8192 --dim 768 --hidden 3072 --activation gelu_tanh --out "$W/bench-linear" ;;
        bench-large) run_step bench-large "$secs" python3 -m mlpfuse bench --preset llama-8b --workload geglu --mode fwd --out "$W/bench-large" ;;
        bench-large-train) run_step bench-large-train "$secs" python3 -m mlpfuse bench --preset llama-8b --workload geglu --mode fwd+bwd --out "$W/bench-large-train" ;;
        bench-train-mid) run_step bench-train-mid "$secs" python3 -m mlpfuse bench --tokens 16384,32768 --dim 768 --hidden 3072 --workload geglu --mode fwd+bwd --variants eager,eager-cudagraph,mlpfuse,mlpfuse-triton,mlpfuse-cudagraph --out "$W/bench-train-mid" ;;
        bench-decode) run_step bench-decode "$secs" python3 -m mlpfuse bench --preset decode --workload geglu --out "$W/bench-decode" ;;
        bench-small) run_step bench-small "$secs" python3 -m mlpfuse bench --preset small --workload geglu --out "$W/bench-small" ;;
        bench-sweep) run_step bench-sweep "$secs" python3 -m mlpfuse bench --tokens 64,512,1024,2048,4096,8192 --dim 768 --hidden 3072 --workload geglu,swiglu --mode fwd --variants eager,compile,liger,eager-cudagraph,mlpfuse --out "$W/bench-sweep" ;;
        bench-sweep-mid) run_step bench-sweep-mid "$secs" python3 -m mlpfuse bench --tokens 128,256,512,1024,2048 --dim 768 --hidden 3072 --workload geglu,swiglu --mode fwd --variants eager,compile,liger,eager-cudagraph,mlpfuse --out "$W/bench-sweep-mid" ;;
        bench-sweep-small-large) run_step bench-sweep-small-large "$secs" python3 -m mlpfuse bench --tokens 16,32,48,64,96 --dim 4096 --hidden 14336 --workload geglu,swiglu --mode fwd --variants eager,compile,liger,mlpfuse --out "$W/bench-sweep-small-large" ;;
        bench-sweep-small) run_step bench-sweep-small "$secs" python3 -m mlpfuse bench --tokens 64,96 --dim 768 --hidden 3072 --workload geglu,swiglu --mode fwd --variants eager,compile,liger,mlpfuse --out "$W/bench-sweep-small" ;;
        bench-sweep-mid-large) run_step bench-sweep-mid-large "$secs" python3 -m mlpfuse bench --tokens 128,256,512 --dim 4096 --hidden 14336 --workload geglu,swiglu --mode fwd --variants eager,compile,liger,mlpfuse --out "$W/bench-sweep-mid-large" ;;
        bench-sweep-train) run_step bench-sweep-train "$secs" python3 -m mlpfuse bench --tokens 64,512,1024,2048,4096,8192 --dim 768 --hidden 3072 --workload geglu,swiglu --mode fwd+bwd --variants eager,compile,liger,eager-cudagraph,mlpfuse --out "$W/bench-sweep-train" ;;
        kernels) run_step kernels "$secs" python3 benchmarks/tune_kernels.py --out "$W/kernels" ;;
        tune-mid-m) run_step tune-mid-m "$secs" python3 benchmarks/tune_mid_m.py --out "$W/tune-mid-m" ;;
        tune-small-m) run_step tune-small-m "$secs" python3 benchmarks/tune_mid_m.py --compile --out "$W/tune-small-m" \
            --shapes 16x4096x14336,24x4096x14336,32x4096x14336,48x4096x14336,64x4096x14336,80x4096x14336,96x4096x14336,128x4096x14336,64x768x3072,96x768x3072,128x768x3072 ;;
        tune-linear) run_step tune-linear "$secs" python3 benchmarks/tune_kernels.py --skip-numerics --only linear --out "$W" ;;
        tune-llama) run_step tune-llama "$secs" python3 benchmarks/tune_kernels.py --skip-numerics --only llama --out "$W" ;;
        tune-blog) run_step tune-blog "$secs" python3 benchmarks/tune_kernels.py --skip-numerics --only blog --out "$W" ;;
        host-paths) run_step host-paths "$secs" python3 benchmarks/host_paths.py --out "$W/host-paths" ;;
        host-paths-train) run_step host-paths-train "$secs" python3 benchmarks/host_paths.py --only train --out "$W/host-paths-train" ;;
        bench-sweep-large) run_step bench-sweep-large "$secs" python3 -m mlpfuse bench --tokens 64,512,1024,2048,4096,8192 --dim 4096 --hidden 14336 --workload geglu,swiglu --mode fwd --variants eager,compile,liger,mlpfuse --out "$W/bench-sweep-large" ;;
        bench-sweep-large-train) run_step bench-sweep-large-train "$secs" python3 -m mlpfuse bench --tokens 64,512,1024,2048,4096,8192 --dim 4096 --hidden 14336 --workload geglu,swiglu --mode fwd+bwd --variants eager,compile,liger,mlpfuse --out "$W/bench-sweep-large-train" ;;
        tune-decode) run_step tune-decode "$secs" python3 benchmarks/tune_decode.py --out "$W/tune-decode" ;;
        residual-tests) run_step residual-tests "$secs" python3 -m pytest -q -p no:cacheprovider -x \
            tests/test_residual_fusion.py tests/test_kernels_decode.py tests/test_norm_fusion.py tests/test_graphs.py ;;
        decode-step-ab) run_step decode-step-ab "$secs" python3 -m mlpfuse bench --model llama3-8b --mode decode-step \
            --tokens 1x128,8x128 --variants eager,mlpfuse,mlpfuse-noresidual,mlpfuse-nopdl,compile,mlpfuse-compile,mlpfuse-compile-nopdl,compile-pdl,mlpfuse-compile-pdl ${AB_VARIANTS:+--variants $AB_VARIANTS} \
            --rounds 5 --out "$W/model-decode-step-ab" ;;
        decode-block) run_step decode-block "$secs" python3 -m mlpfuse bench --tokens 1,2,4,8,16 --dim 4096 --hidden 14336 \
            --workload swiglu --mode fwd --variants eager,eager-cudagraph,compile,mlpfuse,mlpfuse-cudagraph --rounds 5 \
            --no-profile --no-plots --out "$W/bench-decode-block" ;;
        model-decode-step) run_step model-decode-step "$secs" python3 -m mlpfuse bench --model llama3-8b --mode decode-step \
            --tokens 1x128,8x128 --variants eager,mlpfuse,compile,mlpfuse-compile --rounds 5 --out "$W/model-decode-step" ;;
        model-prefill-compile) run_step model-prefill-compile "$secs" python3 -m mlpfuse bench --model llama3-8b --mode prefill \
            --tokens 1x8192 --variants eager,mlpfuse,compile,mlpfuse-compile --rounds 5 --out "$W/model-prefill-compile" ;;
        model-train-compile) run_step model-train-compile "$secs" python3 -m mlpfuse bench --model llama3-8b --layers 4 --mode train \
            --tokens 2x2048 --variants compile,mlpfuse-compile,mlpfuse-recompute-compile,compile-checkpoint --rounds 7 \
            --out "$W/model-train-compile" ;;
        model-generate-eager) run_step model-generate-eager "$secs" python3 -m mlpfuse bench --model llama3-8b --mode decode \
            --tokens 1x128,8x128 --new-tokens 24 --variants eager,mlpfuse --rounds 5 --out "$W/model-generate-eager" ;;
        model-generate-compile) run_step model-generate-compile "$secs" python3 -m mlpfuse bench --model llama3-8b --mode decode \
            --tokens 1x128,8x128 --new-tokens 32 --variants compile,mlpfuse-compile --rounds 5 --out "$W/model-generate-compile" ;;
        layer-sweep-*x*-*) shape=${step#layer-sweep-}; mode=${shape#*-}; shape=${shape%%-*}
            run_step "$step" "$secs" python3 -m mlpfuse bench --tokens 64,256,1024,4096,16384 --dim "${shape%x*}" \
                --hidden "${shape#*x}" --workload geglu,swiglu --mode "$mode" --rounds 5 --no-profile \
                --variants eager,compile,liger,eager-cudagraph,gemms-alone,mlpfuse,mlpfuse-cudagraph --out "$W/$step" ;;
        multi-gpu) run_step multi-gpu "$secs" python3 benchmarks/multi_gpu.py --out "$W/multi-gpu" ;;
        multi-gpu-sp) run_step multi-gpu-sp "$secs" python3 benchmarks/multi_gpu.py --sequence-parallel --out "$W/multi-gpu-sp" ;;
        cuda-backend) MLPFUSE_CACHE_DIR=$W/cache run_step cuda-backend "$secs" python3 benchmarks/cuda_backend_gpu.py --out "$W/cuda-backend.md" ;;
        decode-kernels) MLPFUSE_CACHE_DIR=/tmp/mlpfuse-cache run_step decode-kernels "$secs" python3 benchmarks/cuda_backend_gpu.py --only decode --out "$W/decode-kernels.md" ;;
        decode-shapes) run_step decode-shapes "$secs" bash -c "nvcc -std=c++17 -O3 -gencode=arch=compute_90,code=sm_90 -o '$W/decode_shapes' benchmarks/decode_shapes.cu && '$W/decode_shapes' 15" ;;
        fp8-tests) run_step fp8-tests "$secs" python3 -m pytest -q -p no:cacheprovider tests/test_fp8_kernels.py \
            tests/test_fp8_ws.py tests/test_fp8_modules.py tests/test_fp8_recipe.py tests/test_fp8_train.py \
            tests/test_fp8_train_kernels.py ;;
        fp8-train-probe) run_step fp8-train-probe "$secs" python3 benchmarks/fp8_train_probe.py --json "$W/fp8-train-probe.json" ;;
        fp8-accuracy) run_step fp8-accuracy "$secs" python3 benchmarks/fp8_accuracy.py --json "$W/fp8-accuracy.json" ;;
        fp8-ws) run_step fp8-ws "$secs" bash -c "python3 benchmarks/fp8_ws_probe.py --check && \
            python3 benchmarks/fp8_ws_probe.py --bench" ;;
        fp8-tune) run_step fp8-tune "$secs" python3 benchmarks/fp8_tune.py ;;
        fp8-block) run_step fp8-block "$secs" python3 benchmarks/fp8_gpu.py "$W/fp8-block" --decode 1,16,32,64 --rounds 5 ;;
        fp8-graphs) run_step fp8-graphs "$secs" bash -c "python3 benchmarks/fp8_decode_gpu.py '$W/fp8-graphs-decode' && \
            python3 benchmarks/fp8_decode_gpu.py '$W/fp8-graphs-prefill' --tokens 2048,8192" ;;
        fp8-bench) run_step fp8-bench "$secs" python3 -m mlpfuse bench --precision fp8 --tokens 1,16,8192 --dim 4096 \
            --hidden 14336 --workload swiglu --rounds 5 --no-profile --no-plots --out "$W/bench-fp8" ;;
        fp8-decode-step) run_step fp8-decode-step "$secs" python3 -m mlpfuse bench --model llama3-8b --mode decode-step \
            --tokens 1x128,8x128 --variants eager,mlpfuse,mlpfuse-fp8,torchao-fp8-compile --rounds 5 --out "$W/model-fp8-decode-step" ;;
        fp8-prefill) run_step fp8-prefill "$secs" python3 -m mlpfuse bench --model llama3-8b --mode prefill \
            --tokens 1x8192 --variants eager,mlpfuse,mlpfuse-fp8,torchao-fp8-compile --rounds 5 --out "$W/model-fp8-prefill" ;;
        fp8-lm) run_step fp8-lm "$secs" python3 benchmarks/stdlib_lm.py "$W/stdlib-lm" ;;
        fp8-train-lm) run_step fp8-train-lm "$secs" python3 benchmarks/stdlib_train.py "$W/stdlib-train" ;;
        fp8-train-lm-split) run_step fp8-train-lm-split "$secs" python3 benchmarks/stdlib_train.py \
            "$W/stdlib-train-split" --variants bf16,mlpfuse-fp8,mlpfuse-fp8-reference,torchao-fp8 ;;
        fp8-train-bisect) run_step fp8-train-bisect "$secs" python3 benchmarks/fp8_train_bisect.py "$W/fp8-train-bisect" ;;
        fp8-train-recipes) run_step fp8-train-recipes "$secs" python3 benchmarks/fp8_train_bisect.py \
            "$W/fp8-train-recipes" --splits bf16,abl-none,rowwise-all,pow2 --seeds 0,1 --compare-steps "" ;;
        fp8-stream) run_step fp8-stream "$secs" python3 benchmarks/fp8_stream_probe.py ;;
        fp8-stream-unroll) run_step fp8-stream-unroll "$secs" python3 benchmarks/fp8_stream_probe.py --unroll ;;
        fp8-train) run_step fp8-train "$secs" bash -c "python3 -m pytest -q -p no:cacheprovider \
            tests/test_fp8_train_kernels.py tests/test_fp8_train.py; python3 -m pytest -q -p no:cacheprovider \
            tests/test_model_lab.py -k torchao; python3 -m mlpfuse bench --model llama3-8b \
            --layers 4 --tokens 2x2048 --mode train --variants \
            eager,compile,mlpfuse,mlpfuse-save-fp8,mlpfuse-fp8,mlpfuse-fp8-compile,torchao-fp8-compile --rounds 3 \
            --out '$W/model-fp8-train'" ;;
        train-share) run_step train-share "$secs" python3 benchmarks/train_share.py --json "$W/train_share.json" ;;
        graph-profile-fp8) run_step graph-profile-fp8 "$secs" python3 benchmarks/graph_profile_gpu.py "$W/graph-profile" \
            --fp8 --skip-roofline --skip-compiled ;;
        attention-tests) run_step attention-tests "$secs" python3 -m pytest -q -p no:cacheprovider \
            tests/test_decode_projections.py tests/test_norm_fusion.py tests/test_residual_fusion.py tests/test_fp8_modules.py ;;
        decode-linear-probe) run_step decode-linear-probe "$secs" python3 benchmarks/decode_linear_probe.py ;;
        attention-ab) run_step attention-ab "$secs" python3 -m mlpfuse bench --model llama3-8b --mode decode-step \
            --tokens 1x128,8x128 --variants eager,mlpfuse,mlpfuse-noattn,mlpfuse-fp8,mlpfuse-fp8-noattn,compile,mlpfuse-compile,mlpfuse-compile-noattn,mlpfuse-fp8-compile \
            --rounds 3 --out "$W/attention-ab" ;;
        *) echo "unknown step $step" >> "$SUMMARY" ;;
    esac
done

tar -C "$OUT" -czf "$OUT/results.tar.gz" work
cp "$SUMMARY" "$OUT/summary.txt"
echo "=== tails ==="
for f in "$W"/*.log; do echo "--- $(basename "$f")"; tail -n 6 "$f"; done
for f in "$W"/bench-*/results.md "$W"/model-*/results.md "$W"/multi-gpu*/results.md; do [ -f "$f" ] && { echo "=== $f"; head -c 6000 "$f"; echo; }; done
echo "=== summary ==="; cat "$SUMMARY"
