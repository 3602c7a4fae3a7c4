#!/usr/bin/env bash
# The committed example reports and the issue-11 measurements in one GPU run:
#   [STEPS=walkthrough,model-lab,host-paths,memory,gpu-tests] bash benchmarks/gpu_examples.sh OUTDIR
# walkthrough → examples/walkthrough-h200, model lab (Llama-3-8B shape, 4 layers) → examples/model-lab-h200,
# then host_paths.py and train_anatomy.py --parts memory. Everything ends up in OUTDIR/examples.tar.gz.
set -u
cd "$(dirname "$0")/.."
OUT=${1:?usage: gpu_examples.sh OUTDIR}
E=$OUT/ex; mkdir -p "$E"
export PYTHONUNBUFFERED=1 COLUMNS=160 PYTHONPATH=src
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/mlpfuse-site .whl/*.whl \
        && export PYTHONPATH=$PYTHONPATH:/tmp/mlpfuse-site
fi
step() {  # name seconds command...
    local name=$1 secs=$2; shift 2
    local t0=$SECONDS
    timeout "$secs" "$@" > "$E/$name.log" 2>&1
    echo "$name rc=$? $((SECONDS - t0))s: $*" >> "$E/summary.txt"
}
STEPS=${STEPS:-walkthrough,model-lab,host-paths,memory}
for s in ${STEPS//,/ }; do
    case $s in
        walkthrough) step walkthrough 170 python3 -m mlpfuse walkthrough --out "$E/walkthrough-h200" ;;
        model-lab) step model-lab 170 python3 -m mlpfuse bench --model llama3-8b --layers 4 --tokens 1x2048 \
            --mode prefill,decode,train --variants eager,liger,mlpfuse --out "$E/model-lab-h200" ;;
        host-paths) step host-paths 50 python3 benchmarks/host_paths.py --out "$E/host-paths" ;;
        memory) step memory 50 python3 benchmarks/train_anatomy.py --parts memory --out "$E/memory" ;;
        gpu-tests) step gpu-tests 220 python3 -m pytest -q -p no:cacheprovider tests/test_ops.py tests/test_modules.py \
            tests/test_compile.py tests/test_kernels_plans.py ;;
    esac
done
tar -C "$OUT" -czf "$OUT/examples.tar.gz" ex
cat "$E/summary.txt"
for f in "$E"/*.log; do echo "--- $(basename "$f")"; tail -n 4 "$f"; done
head -c 3000 "$E/walkthrough-h200/summary.md" 2>/dev/null
head -c 3000 "$E/model-lab-h200/results.md" 2>/dev/null
grep -A45 "^| shape" "$E/host-paths.log" | head -45
tail -22 "$E/memory.log" 2>/dev/null
tail -c 2500 "$E/gpu-tests.log" 2>/dev/null
