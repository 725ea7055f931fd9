#!/usr/bin/env bash
# SDP4Bit's fused Triton kernels on one GPU: the GPU tests (TESTS, default SDP4Bit's and TahQuant's: kernels vs the
# CPU reference, bit for bit), the kernels' throughput against the PyTorch path and a bf16 copy
# (benchmarks/bench_sdp4bit_kernels.py: 4-bit weight differences with int8 bf16 gradients, with LAUNCHES of other
# program sizes, then 8-bit weight differences with int4 fp32 gradients), and two DP=2 GPT-125M trainings on the
# kernels (both ranks on the one GPU over gloo, every gather's replicas checked): the weight differences alone with
# session 34 call 9's flags and WEIGHT_ITERS (150; 0: none) iterations (its run took the PyTorch path), then
# GRAD_ITERS (40; 0: none) iterations with int8 gradients too.
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
timeout 300 python3 -m pytest -q --tb=line -p no:cacheprovider -m gpu ${TESTS:-tests/test_sdp4bit.py tests/test_pp_quant.py} \
  > $RES/gpu_tests.log 2>&1
grep -E "^FAILED|^ERROR|Error" $RES/gpu_tests.log | head -5; tail -1 $RES/gpu_tests.log
timeout 200 python3 benchmarks/bench_sdp4bit_kernels.py --launches "${LAUNCHES:-}" \
  --out $RES/sdp4bit_kernels_w4_g8bf16.json
timeout 120 python3 benchmarks/bench_sdp4bit_kernels.py --weight-bits 8 --grad-bits 4 --grad-dtype float32 \
  --out $RES/sdp4bit_kernels_w8_g4fp32.json
export RUNS=sdp4bit:1e-4
if [ "${WEIGHT_ITERS:-150}" != 0 ]; then
  ITERS=${WEIGHT_ITERS:-150} \
    EXTRA="--param-gather-selection all --param-gather-trial-iters 0 --param-gather-verify-interval 1" \
    timeout ${TRAIN_TIMEOUT:-150} bash scripts/gpu/wire_ratio_dp2_one_gpu.sh
  mkdir -p $RES/weights_only && mv $RES/dp2_one_gpu_* $RES/weights_only/
fi
if [ "${GRAD_ITERS:-40}" != 0 ]; then
  ITERS=${GRAD_ITERS:-40} EXTRA="--param-gather-verify-interval 1 --grad-reduce-compression hadamard-int8" \
    timeout ${TRAIN_TIMEOUT:-150} bash scripts/gpu/wire_ratio_dp2_one_gpu.sh
fi
