"""Diagnostic: where the host's time goes in a delta gather's codec work (one GPU).

``bench_delta_kernels.py`` reports the host's microseconds per half of a gather's codec work (``begin_encode``,
``finish_encode``, ``decode``) with the device held busy; on fast links that host time, not the kernels, sets the
gather's time (docs/delta.md). This profiles the same calls with cProfile, the device again held busy so that no
call waits for it, and prints per call the wall time without the profiler and the functions with the most own time
under it (the profiler inflates Python-heavy calls; compare shares, not totals).

    python benchmarks/diag_delta_host.py --out results/gpu/sessionN/delta_host.json
"""

import argparse
import cProfile
import json
import os
import pstats
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.delta_wire_ratio import simulated_step  # noqa: E402
from compression.delta import DeltaCodec, DeltaConfig  # noqa: E402
from compression.timing import queued_call_seconds  # noqa: E402


def profile(call, setup, repeats: int, top: int) -> dict:
    """Best host microseconds of ``call`` over ``repeats`` (device busy; ``setup`` before each, not timed), then its
    cProfile over as many calls."""
    cuda, best = torch.device("cuda"), float("inf")
    for _ in range(repeats):
        setup()
        best = min(best, queued_call_seconds(call, cuda, 0.01)[1])
    profiler = cProfile.Profile()
    for _ in range(repeats):
        setup()
        torch.cuda.synchronize()
        torch.cuda._sleep(10_000_000)  # device work ahead of the call's launches (~5 ms)
        profiler.enable()
        call()
        profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler)
    rows = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:top]  # by own time
    functions = [dict(function=f"{os.path.basename(f)}:{line}({name})", calls=calls // repeats,
                      own_us=1e6 * own / repeats, cumulative_us=1e6 * cumulative / repeats)
                 for (f, line, name), (_, calls, own, cumulative, _) in rows]
    return dict(host_us=1e6 * best, profiled_us=1e6 * stats.total_tt / repeats, functions=functions)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=62_500_000)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    previous, new = simulated_step(args.numel, args.lr, 20, device="cuda")
    sender, receiver = DeltaCodec(DeltaConfig(), 2, 0), DeltaCodec(DeltaConfig(), 2, 1)
    sender.encode(previous)
    state = sender._prev.clone()
    out = previous.clone()
    payload = sender.encode(new)
    padded = torch.cat([payload, payload.new_zeros(receiver.read_slack_bytes)])[:payload.numel()]
    header = receiver.read_header(padded)
    started = []

    def reset_sender():
        started.clear()
        sender._prev.copy_(state)

    def begin():
        started.append(sender.begin_encode(new))

    def begun():
        reset_sender()
        begin()
        started.append(int(started[0].nbytes))  # the size, as the gather's size exchange reads it

    def finish():
        start, size = started
        sender.finish_encode(start, torch.empty(size, dtype=torch.uint8, device="cuda"))

    result = {}
    def decode():
        receiver.decode(0, padded, out, header)

    for name, call, setup in (("begin_encode", begin, reset_sender), ("finish_encode", finish, begun),
                              ("decode", decode, lambda: out.copy_(previous))):
        result[name] = profile(call, setup, args.repeats, args.top)
        print(f"{name}: {result[name]['host_us']:.0f} us host (profiled {result[name]['profiled_us']:.0f} us)")
        for row in result[name]["functions"]:
            print(f"  {row['own_us']:8.1f} own {row['cumulative_us']:8.1f} cum  x{row['calls']:<3} {row['function']}")
    with open(args.out, "w") as f:
        json.dump(dict(command=" ".join(sys.argv), device=torch.cuda.get_device_name(0), torch=torch.__version__,
                       **result), f, indent=1)


if __name__ == "__main__":
    main()
