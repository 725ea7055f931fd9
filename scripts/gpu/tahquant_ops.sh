# TahQuant kernels, one GPU: the GPU tests, then device time per op of encode and decode (4096x4096 and
# 8192x4096 bf16 messages, TahQuant's default and the plain per-tile setting). Results in $RES.
#   bash scripts/gpu/tahquant_ops.sh
set -uo pipefail
source scripts/gpu/setup_device.sh
python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_pp_quant.py 2>&1 | tail -1 | tee $RES/gpu_tests.txt
python3 -m benchmarks.bench_pp_quant --settings tahquant_b4_t64 plain_b4_t64 --shapes 4096x4096,8192x4096 \
  --out $RES/ops.json 2>&1 | grep -v Warn | tail -4
python3 - <<'PY'
import json
for r in json.load(open("/tmp/res/ops.json"))['rows']:
    for call in ('encode', 'decode'):
        ops = sorted(r[f'{call}_ops_us'].items(), key=lambda kv: -kv[1])
        print(r['tokens'], r['hidden'], r['setting'], call, round(r[f'{call}_device_us'], 1), 'vs copy',
              round(r[f'{call}_device_vs_copy'], 3), '|', ', '.join(f"{op[:28]} {us:.1f}" for op, us in ops[:5]))
PY
