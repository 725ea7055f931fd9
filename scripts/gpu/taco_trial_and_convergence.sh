#!/usr/bin/env bash
# GPU call (2x H200): TACO end to end at TP=2 and ~25 GB/s with `auto` = start-up probe + in-loop trial
# (iterations 3-8 alternate uncompressed/compressed; timing starts at iteration 11), GPT-350M and
# GPT-1.3B; then the GPT-125M convergence run (TP=2, every TP tensor compressed) of baseline, TACO
# (the paper's E4M3) and INT8. Usage (device machine, repo root): bash scripts/gpu/taco_trial_and_convergence.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
save() { tar czf $OUT/results.tgz -C $RES .; }
mb="--micro-batch-size 4 --global-batch-size 16 --train-iters 16 --warmup 10 --log-dir $RES/logs --variants taco_int8"
for model in gpt_350m gpt_1.3b; do
  timeout 140 python3 benchmarks/e2e_throughput.py --suite tp2_taco --model configs/$model.yaml --links p2p_off_25GBps $mb \
    --out $RES/e2e_tp2_taco_trial_$model.json 2>&1 | grep -E "speedup|Error"; save
done
grep -h "compression trial" $RES/logs/*.log
timeout 330 python3 scripts/taco_convergence.py --preset gpu-125m --variants baseline taco int8 \
  --out-dir $RES/taco_convergence_gpu 2>&1 | grep -v -i warn | tail -8; save
