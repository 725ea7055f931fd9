# TahQuant's fused kernels on one GPU (kernels/tahquant.py): the GPU tests (bytes equal to the reference's),
# a launch sweep (values per program x warps) on two message shapes, then the benchmark at the chosen
# launch over every setting and shape. Results in $RES (comes back as results.tgz).
#   [SWEEP=0] bash scripts/gpu/tahquant_kernels.sh      (SWEEP=0: no launch sweep)
set -uo pipefail
source scripts/gpu/setup_device.sh
python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tail -5 | tee $RES/gpu_tests.txt
for values in $([ "${SWEEP:-1}" = 1 ] && echo ${SWEEP_VALUES:-1024 2048 4096 8192}); do
  for warps in ${SWEEP_WARPS:-4 8}; do
    echo "values per program $values, warps $warps"
    python3 -m benchmarks.bench_pp_quant --settings tahquant_b4_t64 --shapes 4096x4096,8192x8192 \
      --tile-values $values --num-warps $warps --out $RES/sweep_v${values}_w${warps}.json 2>&1 | tail -2
  done
done
python3 -m benchmarks.bench_pp_quant ${BENCH_ARGS:-} --out $RES/pp_quant_kernels.json 2>&1 | tee $RES/pp_quant_kernels.txt
