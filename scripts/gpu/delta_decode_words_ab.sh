#!/usr/bin/env bash
# 2x H200, ~3 min, on branch delta-decode-words: the delta decoder reading bitmaps and value streams as
# 32-bit words (688 SASS instructions per 256-value block, was 968), A/B in one call: GPU tests, then the
# kernel benchmark and the ~25 GB/s parameter gather on this tree, then the same with the decoder of main
# (MAIN_PATCH: `git diff delta-decode-words main -- kernels/delta.py compression/delta.py
# compression/codec.py compression/shard_gather.py benchmarks/bench_delta_kernels.py
# benchmarks/bench_param_gather.py`). Merge the branch if its decode is faster.
# Usage (device machine, repo root): MAIN_PATCH=main.patch bash scripts/gpu/delta_decode_words_ab.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
timeout 150 python3 -m pytest -q -m gpu tests/test_delta.py 2>&1 | tail -2
both() {  # $1: tag
  timeout 120 python3 benchmarks/bench_delta_kernels.py --warps "" --out $RES/delta_kernels_$1.json 2>&1 | grep "device time only"
  NCCL_P2P_DISABLE=1 timeout 45 torchrun --standalone --nproc-per-node 2 benchmarks/bench_param_gather.py --codecs none delta \
    --out $RES/param_gather_delta_$1_p2p_off.json 2>&1 | grep -v -i warn | tail -3
}
echo "== words"; both decode_words
patch -p1 -s < ${MAIN_PATCH:?} || exit 1
echo "== bytes (main)"; both decode_bytes
