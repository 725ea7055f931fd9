#!/usr/bin/env bash
# GPU call 2 (2x H200): lossless param-gather kernels and gathers, the delta/CIERA wire ratio over a
# real GPT-125M training on text, and the uncompressed GPT-350M / 1.3B baselines of issue 2.
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
python3 -m pytest -q -m gpu tests/test_ciera.py tests/test_delta.py 2>&1 | tail -6
for link in nvlink p2p_off sockets; do
  case $link in nvlink) env="";; p2p_off) env="NCCL_P2P_DISABLE=1";; sockets) env="NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1";; esac
  env $env torchrun --standalone --nproc-per-node 2 benchmarks/bench_param_gather.py --out $RES/param_gather_$link.json 2>&1 | grep -v -i warn | tail -12
done
# Wire ratio of the parameter all-gather over real training (DP=2, AdamW 0.9/0.95, wd 0.1, warmup 20).
for codec in delta ciera; do for lr in 1e-4 1e-5; do
  [ $codec = ciera ] && [ $lr = 1e-5 ] && continue
  torchrun --standalone --nproc-per-node 2 pretrain_gpt.py --config configs/gpt_125m.yaml --micro-batch-size 8 \
    --global-batch-size 16 --train-iters 200 --lr $lr --min-lr $lr --lr-decay-style constant --lr-warmup-iters 20 \
    --eval-interval 100000 --log-interval 50 --param-gather-compression $codec \
    --metrics-file $RES/wire_${codec}_lr$lr.jsonl 2>&1 | grep -E "iteration +(50|200)/|Error|error" | tail -4
done; done
for model in gpt_350m gpt_1.3b; do for suite in baseline_tp1 baseline_tp2; do
  python3 benchmarks/e2e_throughput.py --suite $suite --model configs/$model.yaml --links nvlink \
    --micro-batch-size 4 --global-batch-size 16 --out $RES/${suite}_$model.json 2>&1 | tail -2
done; done
