#!/usr/bin/env bash
# 1x H200, ~1 min: host time per source line of the delta codec's gather work (begin_encode, finish_encode,
# decode, and the kernels/delta.py wrappers they call), the device held busy by a sleep so that nothing waits for
# it; a line tracer (sys.settrace, ~1-2 us per line of its own) charges each line the time until the next one.
# Usage (device machine, repo root): bash scripts/gpu/delta_host_lines.sh
set -uo pipefail
source scripts/gpu/setup_device.sh || exit 1
python3 - <<'PY' 2>&1 | tee $RES/delta_host_lines.txt
import collections, linecache, sys, time, torch
from benchmarks.delta_wire_ratio import simulated_step
from compression.delta import DeltaCodec, DeltaConfig
previous, new = simulated_step(7_812_500, 1e-4, 20, device="cuda")
sender, receiver = DeltaCodec(DeltaConfig(256), 2, 0), DeltaCodec(DeltaConfig(256), 2, 1)
sender.encode(previous)
out = previous.clone()
FILES = ("compression/delta.py", "kernels/delta.py", "compression/codec.py")
spent, last = collections.Counter(), {}

def tracer(frame, event, arg):
    if not frame.f_code.co_filename.endswith(FILES):
        return None
    def local(frame, event, arg):
        now = time.perf_counter()
        key = id(frame)
        if key in last:
            spent[last[key][0]] += now - last[key][1]
        if event == "line":
            last[key] = ((frame.f_code.co_filename, frame.f_lineno), time.perf_counter())
        elif event == "return":
            last.pop(key, None)
        return local
    return local

def one_round(trace):
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of device time: nothing below waits for the device
    if trace:
        sys.settrace(tracer)
    start = sender.begin_encode(new)
    sys.settrace(None)
    nbytes = int(start.nbytes)  # sync (untraced)
    payload = torch.empty(nbytes + receiver.read_slack_bytes, dtype=torch.uint8, device="cuda")[:nbytes]
    torch.cuda._sleep(2_000_000_000)
    if trace:
        sys.settrace(tracer)
    sender.finish_encode(start, payload)
    sys.settrace(None)
    header = receiver.read_header(payload)  # sync (untraced)
    torch.cuda._sleep(2_000_000_000)
    t = time.perf_counter()
    if trace:
        sys.settrace(tracer)
    receiver.decode(0, payload, out, header)
    sys.settrace(None)
    return time.perf_counter() - t

for _ in range(3):
    one_round(False)
    sender._prev.copy_(previous.view(torch.int16)); out.copy_(previous)
untraced = []
for _ in range(5):
    untraced.append(one_round(False)); sender._prev.copy_(previous.view(torch.int16)); out.copy_(previous)
spent.clear()
for _ in range(10):
    one_round(True); sender._prev.copy_(previous.view(torch.int16)); out.copy_(previous)
torch.cuda.synchronize()
print(f"untraced decode host: min {min(untraced) * 1e6:.0f} us")
total = sum(spent.values()) / 10
print(f"traced host per round: {total * 1e6:.0f} us; lines (us per round):")
for (path, line), seconds in spent.most_common(30):
    print(f"{seconds / 10 * 1e6:8.1f}  {path.split('/work/')[-1]}:{line}  {linecache.getline(path, line).strip()[:110]}")
PY
