#!/usr/bin/env bash
# The GPU benchmark suites behind results/ (results/README.md lists which file each one writes).
#
#   bash scripts/gpu/suite.sh SUITE [SUITE ...]      (device machine, repository root)
#
#   kernels        1 GPU: every codec's kernels against a bf16 copy (device time): TACO, CIERA, delta (and its
#                  fused cast), SDP4Bit, TahQuant
#   collectives    2 GPUs: TACO's compressed collectives and NCCL's transports, then the parameter all-gather
#                  (plain NCCL bf16, delta, SDP4Bit; delta's sync-free gather as CUDA graphs) at the three link
#                  classes: NVLink, ~25 GB/s (NCCL_P2P_DISABLE=1), sockets (NCCL_SHM_DISABLE=1 as well)
#   e2e            2 GPUs: TACO at TP=2 (GPT-1.3B, with and without sequence parallelism; GPT-350M with CUDA graphs)
#                  and the exposed parameter gather at DP=2 (GPT-350M), each against the baseline of the same run
#   wire-ratio     1 GPU: GPT-125M at DP=2, both ranks on the one GPU over gloo (the bytes are the training's; the
#                  times mean nothing): delta at lr 1e-4 and 1e-5 (and with --delta-fused-cast), CIERA and SDP4Bit
#                  at 1e-4, every gather checked
#   convergence    1-2 GPUs: GPT-125M TACO ablations at TP=2 (scripts/convergence.py --preset gpu-125m)
#   tp8            1 GPU: the TACO paper's Table 1 at emulated TP=8 (scripts/convergence.py --preset gpu-125m-tp8),
#                  the runs VARIANTS (default baseline), JOBS at once: three baselines or two compressed runs fit a
#                  call; collect
#                  every run's metrics and logs in one folder, then `--reuse` there on any machine writes table1.md
#   compute        1 GPU: the compute path (benchmarks/compute_path.py): GPT-1.3B, GPT-350M and a Llama-style model
#                  with SDPA and the fused ops against megatron-core's local spec (stock), a profile of GPT-1.3B,
#                  and GPT-125M loss curves on real text
#   compatibility  1 GPU: every GPU test under the megatron-core wheel folder WHEELS (default .whl)
#
# Environment: WHEELS (megatron-core wheel folder, scripts/gpu/setup_device.sh), ITERS (wire-ratio iterations, 150),
# VARIANTS, JOBS, PRESET, CHECKPOINTS, EXIT_AFTER_MINS (tp8).
# Output goes to $RES (/tmp/res), which setup_device.sh archives into $OUT/results.tgz on exit.
set -uo pipefail
[ $# -ge 1 ] || { sed -n 2,28p "$0"; exit 2; }
source scripts/gpu/setup_device.sh || exit 1

link_env() {  # the NCCL environment of a link class
  case $1 in
    nvlink) echo "NCCL_DEBUG=WARN";;
    p2p_off) echo "NCCL_P2P_DISABLE=1";;
    sockets) echo "NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1";;
  esac
}
on_2_gpus() { env $(link_env $1) timeout 300 torchrun --standalone --nproc-per-node 2 "${@:2}"; }

merge_json() {  # OUT KEY=PART.json ...: the parts as one JSON object keyed by KEY (link class, mode), parts removed
  python3 - "$@" <<'PY'
import json, os, sys
parts = [arg.split("=", 1) for arg in sys.argv[2:]]
with open(sys.argv[1], "w") as f:
    json.dump({key: json.load(open(path)) for key, path in parts}, f, indent=1)
for _, path in parts:
    os.remove(path)
PY
}

kernels() {
  local out=$RES/kernels; mkdir -p $out
  python3 -m benchmarks.bench_taco_kernels --format int8 --sizes-mib 16,64,256 --reference-max-mib 0 \
    --out $out/taco_int8.json
  for mode in compare hash; do
    python3 benchmarks/bench_ciera_kernels.py --change-detect $mode --repeats 8 --out $out/ciera_$mode.json
  done
  merge_json $out/ciera.json compare=$out/ciera_compare.json hash=$out/ciera_hash.json
  python3 benchmarks/bench_delta_kernels.py --repeats 10 --out $out/delta.json
  python3 benchmarks/bench_delta_fused_cast.py --out $out/delta_fused_cast.json
  python3 benchmarks/bench_sdp4bit_kernels.py --out $out/sdp4bit_w4_g8bf16.json
  python3 benchmarks/bench_sdp4bit_kernels.py --weight-bits 8 --grad-bits 4 --grad-dtype float32 \
    --out $out/sdp4bit_w8_g4fp32.json
  merge_json $out/sdp4bit.json w4_g8bf16=$out/sdp4bit_w4_g8bf16.json w8_g4fp32=$out/sdp4bit_w8_g4fp32.json
  python3 -m benchmarks.bench_pp_quant --out $out/tahquant.json
}

collectives() {
  local out=$RES/collectives; mkdir -p $out
  for link in nvlink p2p_off sockets; do
    on_2_gpus $link -m benchmarks.bench_tp_collectives --format int8 --cuda-graphs \
      --sizes-kib 1024,4096,16384,32768,65536,262144 --out $out/taco_int8_$link.json
    on_2_gpus $link benchmarks/nccl_transports.py --out $out/nccl_transports_$link.json
    on_2_gpus $link benchmarks/bench_param_gather.py --codecs none delta sdp4bit --buckets 8 --fuse-buckets --steps 6 \
      --repeats 3 --out $out/param_gather_$link.json
  done
  for name in taco_int8 nccl_transports param_gather; do
    merge_json $out/$name.json nvlink=$out/${name}_nvlink.json p2p_off=$out/${name}_p2p_off.json \
      sockets=$out/${name}_sockets.json
  done
  on_2_gpus nvlink benchmarks/bench_param_gather.py --codecs none delta-slots-graphs --buckets 8 --fuse-buckets \
    --steps 20 --repeats 3 --out $out/param_gather_sync_free_nvlink.json
}

e2e() {
  local out=$RES/e2e common="--links p2p_off_25GBps --micro-batch-size 4 --global-batch-size 16 --log-dir $RES/e2e/logs"
  mkdir -p $out
  python3 benchmarks/e2e_throughput.py --suite tp2_taco --model configs/gpt_1.3b.yaml $common --variants taco_int8 \
    --out $out/tp2_taco_gpt_1.3b_p2p_off.json
  python3 benchmarks/e2e_throughput.py --suite tp2_sp_taco --model configs/gpt_1.3b.yaml $common --variants taco_int8 \
    --out $out/tp2_sp_taco_gpt_1.3b_p2p_off.json
  python3 benchmarks/e2e_throughput.py --suite tp2_taco --model configs/gpt_350m.yaml $common \
    --variants taco_int8_auto_graphs --out $out/tp2_taco_gpt_350m_p2p_off.json
  python3 benchmarks/e2e_throughput.py --suite dp2_param_gather_ablation --model configs/gpt_350m.yaml \
    --links p2p_off_25GBps sockets_4GBps --variants delta_all delta --micro-batch-size 4 --global-batch-size 8 \
    --train-iters 50 --warmup 41 --param-gather-reselect-interval 25 --log-dir $RES/e2e/logs \
    --out $out/dp2_exposed_gather_gpt_350m.json
}

dp2_one_gpu() {  # NAME CODEC LR [flags]: GPT-125M at DP=2 with both ranks on cuda:0 over gloo
  local name=$1 codec=$2 lr=$3; shift 3
  local out=$RES/wire_ratio mbs port=$((29600 + RANDOM % 1000))
  mkdir -p $out
  # two ranks at micro-batch 8 hold ~40 GiB each: GPUs under 100 GiB take two micro-batches of 4 (same bytes)
  mbs=$(python3 -c "import torch; print(8 if torch.cuda.get_device_properties(0).total_memory >> 30 >= 100 else 4)")
  for rank in 0 1; do
    RANK=$rank WORLD_SIZE=2 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      python3 pretrain_gpt.py --config configs/gpt_125m.yaml --distributed-backend gloo --micro-batch-size $mbs \
      --global-batch-size 16 --train-iters ${ITERS:-150} --lr $lr --min-lr $lr --lr-decay-style constant \
      --lr-warmup-iters 20 --eval-interval 100000 --log-interval 10 --param-gather-compression $codec "$@" \
      --metrics-file $out/$name.jsonl > $out/$name.rank$rank.log 2>&1 &
  done
  wait
  python3 - $out/$name.jsonl <<'PY'
import json, sys
from compression.telemetry import PARAM_GATHER_CLASSES, raw_and_sent
rows = [json.loads(line) for line in open(sys.argv[1])]
raw, sent = map(sum, zip(*(raw_and_sent(r["comm"], PARAM_GATHER_CLASSES) for r in rows[len(rows) // 2:])))
print(f"{sys.argv[1]}: {len(rows)} iterations, steady-state wire ratio {raw / max(1, sent):.2f}x")
PY
}

wire-ratio() {
  local checked="--param-gather-selection all --param-gather-trial-iters 0 --param-gather-verify-interval 1"
  dp2_one_gpu gpt125m_dp2_delta_lr1e-4 delta 1e-4 $checked
  dp2_one_gpu gpt125m_dp2_delta_lr1e-5 delta 1e-5 $checked
  dp2_one_gpu gpt125m_dp2_delta_fused_cast_lr1e-4 delta 1e-4 $checked --delta-fused-cast
  dp2_one_gpu gpt125m_dp2_ciera_lr1e-4 ciera 1e-4 $checked
  dp2_one_gpu gpt125m_dp2_sdp4bit_lr1e-4 sdp4bit 1e-4 $checked  # lossy: every gather's replicas compared
}

convergence() {
  python3 scripts/convergence.py --family taco --preset gpu-125m --variants baseline taco naive_fp8 ds_only \
    hadamard_ds e5m2 int8 hadamard_int8 --taco-all-reduce two-shot --out-dir $RES/convergence/taco_gpu_125m
}

tp8() {  # the TACO paper's Table 1 at emulated TP=8 on one GPU: VARIANTS (default baseline) run in this call
  local preset="--family taco --preset ${PRESET:-gpu-125m-tp8} --train-only"
  if [ "${JOBS:-1}" -gt 1 ]; then  # concurrent runs must not build the corpus and dataset indexes at once
    python3 scripts/convergence.py $preset --variants baseline --exit-interval 1 --out-dir $RES/tp8_warm \
      > $RES/tp8_warm.log 2>&1
  fi
  # CHECKPOINTS: a run longer than one call stops after EXIT_AFTER_MINS minutes with a checkpoint there, and the same
  # command in the next call (the machine still warm: /tmp kept) continues it
  python3 scripts/convergence.py $preset --variants ${VARIANTS:-baseline} --jobs ${JOBS:-1} --out-dir $RES/convergence/tp8 \
    ${CHECKPOINTS:+--checkpoint-dir $CHECKPOINTS --exit-duration-in-mins ${EXIT_AFTER_MINS:-8.5}}
}

compute() {
  python3 benchmarks/compute_path.py --out $RES/compute_path/gpt_1.3b --models gpt_1.3b --profile gpt_1.3b \
    --variants stock unfused sdpa_unfused_wgrad sdpa sdpa_eager_elementwise --iters 12
  python3 benchmarks/compute_path.py --out $RES/compute_path/others --models gpt_350m llama_1.2b \
    --variants stock unfused sdpa --iters 12
  python3 benchmarks/compute_path.py --out $RES/compute_path/curves --curves 300
}

compatibility() {
  mkdir -p $RES/compatibility
  python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tail -3 | tee $RES/compatibility/gpu_tests.txt
}

for suite in "$@"; do
  case $suite in
    kernels|collectives|e2e|wire-ratio|convergence|tp8|compute|compatibility) echo "== $suite"; $suite;;
    *) echo "unknown suite '$suite': kernels, collectives, e2e, wire-ratio, convergence, tp8, compute or compatibility" >&2
       exit 2;;
  esac
done
