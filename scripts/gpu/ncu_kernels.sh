#!/usr/bin/env bash
# Nsight Compute profiles of the codec kernels (ncu is on the lent H200 machine, /usr/local/cuda/bin):
# the delta encoder/decoder (issue 5: 7-12% of copy), the TACO encode/decode (issue 3: 0.57-0.68x of
# copy) and the CIERA split/merge (issue 4: 25-45%), one steady-state launch each after warm-up, full
# section set; the reports and their details pages as CSV land in $RES.
# Usage (device machine, repo root): bash scripts/gpu/ncu_kernels.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
source scripts/gpu/ncu_profile.sh
$NCU --version | tail -1
profile delta_encode "_encode_kernel|_gather_kernel" 4 4 python3 benchmarks/bench_delta_kernels.py --lrs 1e-4 --repeats 3 --out $RES/ncu_delta_bench.json
profile delta_decode "_decode_kernel" 2 1 python3 benchmarks/bench_delta_kernels.py --lrs 1e-4 --repeats 3 --out $RES/ncu_delta_bench.json
profile taco "_taco_encode_kernel|_taco_decode_kernel" 4 6 python3 benchmarks/bench_taco_kernels.py --sizes-mib 64 --format int8 --reference-max-mib 0 --out $RES/ncu_taco_bench.json
profile ciera "_split_blocks_kernel|_merge_kernel" 4 6 python3 benchmarks/bench_ciera_kernels.py --lrs 1e-4 --repeats 3 --out $RES/ncu_ciera_bench.json
