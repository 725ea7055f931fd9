#!/usr/bin/env bash
# GPU call (2x H200): GPU tests and codec benchmark of the TahQuant PP codec and the SDP4Bit DP codecs;
# TACO (int8) end to end on GPT-350M TP=2 at ~25 GB/s; TACO collectives on sockets (~4 GB/s); the
# param all-gather codecs (delta, SDP4Bit +- int8 gradients) end to end on GPT-350M DP=2 at ~25 GB/s.
# Usage (device machine, repo root): bash scripts/gpu/e2e_350m_and_new_codecs.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
save() { tar czf $OUT/results.tgz -C $RES .; }
timeout 120 python3 -m pytest -q -m gpu tests/test_pp_quant.py tests/test_sdp4bit.py 2>&1 | tail -4
timeout 90 python3 -m benchmarks.bench_pp_quant --out $RES/pp_quant.json 2>&1 | grep -v -i warn | tail -12; save
mb="--micro-batch-size 4 --global-batch-size 16 --log-dir $RES/logs"
timeout 150 python3 benchmarks/e2e_throughput.py --suite tp2_taco --model configs/gpt_350m.yaml --links p2p_off_25GBps $mb \
  --variants taco_int8 taco_int8_all --out $RES/e2e_tp2_taco_gpt_350m.json 2>&1 | grep -E "speedup|Error"; save
NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 timeout 120 torchrun --standalone --nproc-per-node 2 -m benchmarks.bench_tp_collectives \
  --format int8 --sizes-kib 1024,16384,32768,65536 --iters 10 --out $RES/taco_coll_queued_sockets.json 2>&1 \
  | grep -v -i warn | tee $RES/taco_coll_queued_sockets.log | tail -16; save
timeout 170 python3 benchmarks/e2e_throughput.py --suite dp2_param_gather --model configs/gpt_350m.yaml --links p2p_off_25GBps $mb \
  --variants delta sdp4bit sdp4bit_grad --out $RES/e2e_dp2_param_gather_gpt_350m.json 2>&1 | grep -E "speedup|Error"; save
