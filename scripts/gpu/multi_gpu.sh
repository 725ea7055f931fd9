#!/usr/bin/env bash
# Issue 6, for the 4- and 8-GPU kinds (nvidia-h200-x4 / -x8): TACO at TP=4 and TP=8 on GPT-2.7B and
# GPT-6.7B with sequence parallelism off and on, and an OLMoE-shaped MoE at DP=8 (DP=4 on 4 GPUs; EP=2, so
# expert buckets gather over expert-DP=4, or 2) with param-gather compression none / ciera / delta; each against
# the uncompressed baseline in the same run, at NVLink and with NCCL_P2P_DISABLE=1. The MoE runs use
# --deterministic-mode: without it megatron-core's token scatter makes even two baseline runs differ
# (session 5), so loss bits could not be compared; checksums at iterations 11 and 22 (each hashes the
# parameters on the host).
# TACO variants: INT8 with the default `auto` (probe + trial), and the same with --tp-comm-cuda-graphs.
# Usage on the device: bash scripts/gpu/multi_gpu.sh (~60 min on 8 GPUs in all: split it over calls with
# MODELS="gpt_2.7b" TPS="4" SPS="none" LINKS="nvlink" MOE=0 and so on; "none" = no sequence parallelism).
# MBS (default 4): the micro-batch size (global batch 8 x MBS). At one 2048-token micro-batch the TP=4
# GPT-2.7B runs were host-bound (session 10: MFU 4%, single iterations varying 1.5-2.2 s), too noisy to time
# a compression against. RUN_TIMEOUT (default 300): seconds one training run may take before it is stopped and
# recorded as failed (the suite goes on).
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
links=${LINKS:-"nvlink p2p_off_25GBps"}
for model in ${MODELS:-gpt_2.7b gpt_6.7b}; do for tp in ${TPS:-4 8}; do for sp in ${SPS:-none _sp}; do
  [ $tp -le $ngpu ] || continue
  [ "$sp" = none ] && sp=""
  python3 benchmarks/e2e_throughput.py --suite tp${tp}${sp}_taco --model configs/$model.yaml --links $links \
    --variants taco_int8 taco_int8_auto_graphs --micro-batch-size ${MBS:-4} --global-batch-size $((8 * ${MBS:-4})) \
    --comm-profile --run-timeout ${RUN_TIMEOUT:-300} --log-dir $RES/logs \
    --out $RES/e2e_tp${tp}${sp}_taco_$model.json 2>&1 | grep -E "speedup|FAILED|Error"
  tar czf $OUT/results.tgz -C $RES .
done; done; done
if [ $ngpu -ge 4 ] && [ "${MOE:-1}" = 1 ]; then
  dp=$([ $ngpu -ge 8 ] && echo 8 || echo 4)
  python3 benchmarks/e2e_throughput.py --suite dp${dp}_moe_param_gather --model configs/olmoe_1b_7b.yaml --links $links \
    --variants ciera delta --expert-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 16 \
    --deterministic-mode --params-checksum-interval 11 --comm-profile --run-timeout ${RUN_TIMEOUT:-300} \
    --log-dir $RES/logs --out $RES/e2e_dp${dp}_moe_param_gather_olmoe.json 2>&1 | grep -E "speedup|FAILED|Error"
fi
