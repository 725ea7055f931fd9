"""Diagnostic: the host's cost of a sync-free delta gather's codec work, and what a CUDA graph would leave of it
(one GPU, 8 Megatron-padded buckets coded as one, a 2-rank world simulated as in ``bench_delta_buckets.py``).

1. Host microseconds per source line of the slot path (``begin_encode``, ``finish_encode_into_slot``,
   ``decode_slots`` and what they call), the device held busy by a sleep so that nothing waits for it (a line tracer:
   each line is charged the time until the next; ~1-2 us of its own per line).
2. Wall time of the whole codec work (encode, slot, stand-in all-gather, decode, sizes to the host) run eagerly
   against the same work captured once as a CUDA graph and replayed, both checked bit for bit after every call; the
   device time of the eager work for reference. A graph replays the kernels of its capture only: what the host does
   in Python per call (codec state, telemetry) would have to be done beside it.

    python benchmarks/diag_delta_slot_host.py --out results/gpu/sessionN/delta_slot_host.json
"""

import argparse
import collections
import json
import math
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.bench_delta_buckets import (SLOT_FACTOR, Buckets, begin, exchange, finish_and_decode,  # noqa: E402
                                            megatron_shard_multiple, slots_and_decode)
from benchmarks.delta_wire_ratio import simulated_step  # noqa: E402
from compression.timing import call_seconds, queued_call_seconds  # noqa: E402

TRACED = ("compression/delta.py", "kernels/delta.py", "compression/codec.py", "benchmarks/bench_delta_buckets.py")


def line_costs(work, setup, rounds: int) -> dict:
    """Host seconds per (file, line) of ``work()`` summed over ``rounds`` traced calls, the device kept busy."""
    spent, last = collections.Counter(), {}

    def tracer(frame, event, arg):
        if not frame.f_code.co_filename.endswith(TRACED):
            return None

        def local(frame, event, arg):
            now = time.perf_counter()
            key = id(frame)
            if key in last:
                spent[last[key][0]] += now - last[key][1]
            if event == "line":
                last[key] = ((os.path.relpath(frame.f_code.co_filename, ROOT), frame.f_lineno), time.perf_counter())
            elif event == "return":
                last.pop(key, None)
            return local
        return local

    for _ in range(rounds):
        setup()
        torch.cuda.synchronize()
        torch.cuda._sleep(1_000_000_000)
        sys.settrace(tracer)
        work()
        sys.settrace(None)
    return spent


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=62_500_000)
    p.add_argument("--buckets", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    device = torch.device("cuda")
    previous, new = simulated_step(args.numel, args.lr, 20, device="cuda")
    b = Buckets(previous, new, args.buckets, 256, 2, megatron_shard_multiple(2))
    units = b.units("fused")
    b.restore()
    starts = begin(units)
    sizes, headers = exchange(starts)
    capacity = -(-math.ceil(SLOT_FACTOR * max(sizes)) // 4096) * 4096
    finish_and_decode(units, 2, starts, sizes, headers, False)

    landed = []

    def work():
        return slots_and_decode(units, 2, begin(units), capacity, landed)

    def eager():
        for landed in work():
            landed.get()

    eager_s = call_seconds(eager, device, args.repeats, setup=b.restore, check=b.check)
    host_s = device_s = float("inf")
    for _ in range(5):
        b.restore()
        d, h = queued_call_seconds(work, device, 0.02)
        b.check()
        host_s, device_s = min(host_s, h), min(device_s, d)
    spent = line_costs(work, b.restore, args.repeats)
    untraced = []
    for _ in range(args.repeats):
        b.restore()
        torch.cuda.synchronize()
        torch.cuda._sleep(1_000_000_000)
        t = time.perf_counter()
        work()
        untraced.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    total = sum(spent.values()) / args.repeats
    lines = [dict(file=f, line=n, us=1e6 * s / args.repeats, text=open(os.path.join(ROOT, f)).read().splitlines()[n - 1]
                  .strip()) for (f, n), s in spent.most_common(args.top)]
    print(f"host per call: untraced {1e6 * min(untraced):.0f} us, traced {1e6 * total:.0f} us; top lines:")
    for row in lines:
        print(f"  {row['us']:7.1f} us  {row['file']}:{row['line']}  {row['text'][:90]}")

    graph_s, graph_error = None, None
    try:
        b.restore()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            work()  # warm-up on a side stream, as torch.cuda.graph's docs ask
        torch.cuda.current_stream().wait_stream(stream)
        b.restore()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            work()
        graph_s = call_seconds(graph.replay, device, args.repeats, setup=b.restore, check=b.check)
    except Exception as error:  # noqa: BLE001 - reported: what stops the capture is the finding
        graph_error = f"{type(error).__name__}: {error}"
    report = dict(command=" ".join(sys.argv), torch=torch.__version__, device=torch.cuda.get_device_name(0),
                  numel=args.numel, buckets=args.buckets, lr=args.lr, capacity=capacity, payload_bytes=max(sizes),
                  eager_wall_ms=1e3 * min(eager_s), eager_host_ms=1e3 * host_s, eager_device_ms=1e3 * device_s,
                  untraced_host_us=1e6 * min(untraced), traced_host_us=1e6 * total, top_lines=lines,
                  graph_wall_ms=1e3 * min(graph_s) if graph_s else None, graph_error=graph_error)
    print(f"eager: wall {report['eager_wall_ms']:.3f} ms, host {report['eager_host_ms']:.3f}, device "
          f"{report['eager_device_ms']:.3f}; graph replay: wall "
          + (f"{report['graph_wall_ms']:.3f} ms" if graph_s else f"failed ({graph_error})"))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
