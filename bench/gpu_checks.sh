#!/usr/bin/env bash
# Every check that needs a GPU, in one run (a lent GPU's time is short):
#   1. Triton kernels compiled for the GPU against their torch references, decode graphs
#      against eager steps, and the engine on CUDA against transformers (tests/);
#   2. bench/kernels.py: each kernel against its reference and the roofline;
#   3. bench/step_overhead.py on CUDA: the decode step eager and as CUDA graphs, fp32 and bf16;
#   4. bench/fp8_weights.py on CUDA: FP8 weights (the Triton FP8 GEMM) against bf16 ones;
#   5. bench/speculative.py on CUDA: n-gram speculation against plain decoding, at 1 and 8
#      requests with no batch limit (a GPU's default);
#   6. bench/async_scheduling.py on CUDA: a decode step and its host-visible share, async
#      scheduling against synchronous, fp32 and bf16 (the async tests run in step 1);
#   7. bench/realistic_model.py: Nemotron-H-8B- and Qwen3.5-4B-shaped models in bf16 (random
#      weights, no download): decode at 1/8/64/256 requests, 8k prefill and multi-turn TTFT,
#      each against the bandwidth or compute limit measured in the same run. Last: the
#      largest, so that everything before it has its results if the time runs out.
#
#   bash bench/gpu_checks.sh [results folder, default bench/results/gpu]
#
# Runs with the packages already installed (hybridserve importable); every step runs even if
# an earlier one fails, and the exit status says whether all passed.
set -uo pipefail
out=${1:-bench/results/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
status=0
step() {
    local name=$1
    shift
    echo "=== $name: $*"
    local start=$SECONDS
    "$@" 2>&1 | tee "$out/$name.log" || status=1
    echo "=== $name: exit ${PIPESTATUS[0]} in $((SECONDS - start)) s"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
# The session fixtures (tests/conftest.py) start Ray, which these tests do not use.
step tests python3 -m pytest --noconftest -p no:cacheprovider -q -rs --tb=short \
    tests/workers/runner/paths/test_cuda_graphs.py tests/kernels/triton tests/workers/test_parity.py \
    tests/kernels/test_fp8_linear.py tests/workers/core/test_async_scheduling.py \
    -k "not compiled"
step kernels python3 bench/kernels.py --output "$out/kernels.json"
for dtype in float32 bfloat16; do
    step "step_overhead_$dtype" python3 bench/step_overhead.py --device cuda --dtype "$dtype" \
        --modes eager graphs --running 1 8 32 256 --output "$out/step_overhead_$dtype.json"
done
step fp8_weights python3 bench/fp8_weights.py --device cuda --dtype bfloat16 \
    --output "$out/fp8_weights.json"
step speculative python3 bench/speculative.py --repeats 2 --output "$out/speculative.json"
for dtype in float32 bfloat16; do
    step "async_scheduling_$dtype" python3 bench/async_scheduling.py --device cuda \
        --dtype "$dtype" --repeats 2 --output "$out/async_scheduling_$dtype.json"
done
step realistic_model python3 bench/realistic_model.py --device cuda --dtype bfloat16 \
    --output "$out/realistic_model.json"
exit $status
