#!/usr/bin/env bash
# Prepared for the next GPU session (2x H200, ~9 min): (1) CUDA exactness of the TACO one-shot
# all-reduce kernel (decode_sum) and of the delta codec; (2) one-shot vs two-shot compressed all-reduce
# vs NCCL at ~25 GB/s and NVLink; (3) TACO end to end at TP=2, ~25 GB/s, with `auto` (one-shot at TP=2,
# probe + in-loop trial), GPT-1.3B and GPT-350M; (4) the delta v2 parameter all-gather vs NCCL at the
# three link classes, beside SDP4Bit's 4-bit weight differences; (5) delta with the default benefit selection end to end, GPT-350M DP=2.
# Usage (device machine, repo root): bash scripts/gpu/one_shot_and_delta_gather.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
save() { tar czf $OUT/results.tgz -C $RES .; }
timeout 150 python3 -m pytest -q -m gpu tests/test_taco_kernels.py tests/test_delta.py 2>&1 | tail -4
for link in p2p_off nvlink; do
  env=""; [ $link = p2p_off ] && env="NCCL_P2P_DISABLE=1"
  for algorithm in one-shot two-shot; do
    env $env timeout 90 torchrun --standalone --nproc-per-node 2 -m benchmarks.bench_tp_collectives --format int8 \
      --all-reduce $algorithm --sizes-kib 4096,16384,32768,65536 --iters 10 \
      --out $RES/taco_coll_${algorithm}_$link.json 2>&1 | grep -E "all_reduce" ; save
  done
done
for model in gpt_1.3b gpt_350m; do
  timeout 140 python3 benchmarks/e2e_throughput.py --suite tp2_taco --model configs/$model.yaml --links p2p_off_25GBps \
    --micro-batch-size 4 --global-batch-size 16 --variants taco_int8 --log-dir $RES/logs_$model \
    --out $RES/e2e_tp2_taco_one_shot_$model.json 2>&1 | grep -E "speedup|Error"; save
done
for link in nvlink p2p_off sockets; do
  case $link in nvlink) env="";; p2p_off) env="NCCL_P2P_DISABLE=1";; sockets) env="NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1";; esac
  env $env timeout 100 torchrun --standalone --nproc-per-node 2 benchmarks/bench_param_gather.py --codecs none delta sdp4bit \
    --out $RES/param_gather_delta_v2_$link.json 2>&1 | grep -v -i warn | tail -6; save
done
timeout 150 python3 benchmarks/e2e_throughput.py --suite dp2_param_gather --model configs/gpt_350m.yaml \
  --links p2p_off_25GBps sockets_4GBps --variants delta --micro-batch-size 4 --global-batch-size 16 \
  --log-dir $RES/logs_dp2 --out $RES/e2e_dp2_delta_benefit_gpt_350m.json 2>&1 | grep -E "speedup|Error"; save
grep -h "selection\|compression trial" $RES/logs_*/*.log | sort | uniq -c | head
