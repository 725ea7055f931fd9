#!/usr/bin/env bash
# 1x H200, ~3 min: what a compressed bucket costs the host (session 11): bench_delta_kernels.py's host columns for
# one bucket of a GPT-350M-like split (7.8M values) and for 62.5M values; a cProfile of 20 queued encode + decode
# rounds (where the host time goes: Triton's launcher or torch ops); and the DeltaCostMeter's queued device timing.
# Usage (device machine, repo root): bash scripts/gpu/delta_host_cost.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
for numel in 7812500 62500000; do
  python3 benchmarks/bench_delta_kernels.py --numel $numel --lrs 1e-4 --repeats 5 --out $RES/delta_host_$numel.json \
    2>&1 | grep "host us"
done
python3 - <<'PY' > $RES/delta_host_cprofile.txt 2>&1
import cProfile, pstats, torch
from benchmarks.delta_wire_ratio import simulated_step
from compression.delta import DeltaCodec, DeltaConfig
previous, new = simulated_step(7_812_500, 1e-4, 20, device="cuda")
sender, receiver = DeltaCodec(DeltaConfig(256), 2, 0), DeltaCodec(DeltaConfig(256), 2, 1)
sender.encode(previous)
out = previous.clone()
def rounds(n):
    for _ in range(n):
        start = sender.begin_encode(new)
        buffer = torch.empty(int(start.nbytes) + receiver.read_slack_bytes, dtype=torch.uint8, device="cuda")
        payload = buffer[:int(start.nbytes)]
        sender.finish_encode(start, payload)
        receiver.decode(0, payload, out, receiver.read_header(payload))
rounds(3)
torch.cuda.synchronize()
profile = cProfile.Profile()
profile.enable()
rounds(20)
profile.disable()
pstats.Stats(profile).sort_stats("tottime").print_stats(30)
PY
head -60 $RES/delta_host_cprofile.txt | tail -45
python3 - <<'PY'
import torch
from compression.delta import DeltaConfig
from compression.selection import DeltaCostMeter
meter, w = DeltaCostMeter(DeltaConfig(block_size=256)), torch.randn(1 << 24, device="cuda") * 0.02
for _ in range(6):
    meter.update(w.to(torch.bfloat16))
    w -= 1e-4 * torch.randn_like(w).sign() * w.abs()
payload, encode_s, decode_s = meter.estimate()
print(f"meter: ratio {2 * w.numel() / payload:.2f}x, encode {2 * w.numel() / encode_s / 1e9:.0f} GB/s, "
      f"decode {2 * w.numel() / decode_s / 1e9:.0f} GB/s (queued device time)")
PY
