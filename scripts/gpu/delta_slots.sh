#!/usr/bin/env bash
# Delta's sync-free gather (--delta-capacity-factor, session 38): each payload in a slot of 1.25x the last one, no
# size exchange before the transfer. The GPU tests (TESTS: the slot kernels against the reference, and on 2 GPUs the
# slot gathers over NCCL), then bench_delta_buckets.py (one gather's codec work on one GPU, 8 Megatron-padded buckets
# coded as one, WORLDS simulated ranks: fused with the size exchange vs fused_slots: wall, host and device ms, at LRS);
# on 2 GPUs also bench_param_gather.py (8 buckets fused: NCCL bf16, delta, delta-slots, and replayed as CUDA graphs;
# 20 steps, so that the graphs' median is their replays) at LINKS, and with E2E=1 the exposed gather end to end
# (GPT-350M DP=2 as session 15: baseline, delta on every bucket, in slots, and replayed as graphs) at E2E_LINKS;
# E2E_VARIANTS picks among those, E2E_FLAGS adds training flags (e.g. "--lr-decay-style constant": payloads that
# stay the size they reach, as in a long run, so that the graphs are not re-captured as the 40-iteration decay
# shrinks them; session 40). A graphed run's line also lists the iterations that captured, and its speedup between
# captures (session 41). E2E_VARIANTS=delta_slots_graphs: the graphed gather as the benefit selection and its trial
# choose it (the trial times replays since session 42; the run is 4 iterations longer for it).
# Usage (device machine, repo root):
#   [WORLDS="2 8"] [LRS=1e-4] [LINKS="nvlink p2p_off sockets"] [E2E=1 E2E_LINKS=... E2E_VARIANTS=... E2E_FLAGS=...]
#   bash scripts/gpu/delta_slots.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
timeout 300 python3 -m pytest -q --tb=line -p no:cacheprovider -m gpu \
  ${TESTS:-tests/test_delta.py tests/test_shard_gather.py tests/test_sdp4bit.py} > $RES/gpu_tests.log 2>&1
grep -E "^FAILED|^ERROR|Error" $RES/gpu_tests.log | head -5; tail -1 $RES/gpu_tests.log
for lr in ${LRS:-1e-4}; do
  timeout 300 python3 benchmarks/bench_delta_buckets.py --buckets 8 --world ${WORLDS:-2 8} --lr $lr --megatron-padding \
    --repeats 10 --out $RES/delta_slots_buckets_lr$lr.json 2>&1 | grep -E "^\||Error"
done
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  for link in ${LINKS:-nvlink p2p_off sockets}; do
    case $link in nvlink) env="";; p2p_off) env="NCCL_P2P_DISABLE=1";; sockets) env="NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1";; esac
    env $env timeout 120 torchrun --standalone --nproc-per-node 2 benchmarks/bench_param_gather.py \
      --codecs none delta delta-slots delta-slots-graphs --buckets 8 --fuse-buckets --steps 20 --repeats 3 \
      --out $RES/param_gather_slots_$link.json 2>&1 | grep -v -i warn | tail -5
  done
  if [ -n "${E2E:-}" ]; then
    timeout 540 python3 benchmarks/e2e_throughput.py --suite dp2_param_gather_ablation --model configs/gpt_350m.yaml \
      --links ${E2E_LINKS:-p2p_off_25GBps sockets_4GBps nvlink} --variants ${E2E_VARIANTS:-delta_all delta_all_slots delta_all_slots_graphs} --comm-profile ${E2E_FLAGS:-} \
      --micro-batch-size 4 --global-batch-size 8 --train-iters 40 --warmup 31 --run-timeout 150 --log-dir /tmp/slots_e2e \
      --out $RES/e2e_exposed_slots.json 2>&1 | grep -E "speedup|bound|captures|FAILED|Error"
    cp /tmp/slots_e2e/*.log /tmp/slots_e2e/*.jsonl $RES/ 2>/dev/null
  fi
fi
