"""Where a profiled training iteration waits: GPU idle gaps and host blocking calls of a PyTorch
profiler Chrome trace (``--profile --use-pytorch-profiler``, best with ``--pytorch-profiler-collect-callstack``).

A gap is a stretch with no kernel, copy or memset on any stream. Each gap is charged to the host code that
launched the work ending it (the innermost Python frames, or ops, around that launch): when the host issues
that launch after the gap began, the device waited for the host there. Host blocking calls (stream, event
and device synchronizations, synchronous copies) are listed with the code that made them.

    python benchmarks/trace_gaps.py trace_rank0.json [--min-gap-us 20] [--top 15]
"""

import argparse
import bisect
import collections
import json

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("cpu_op", "python_function", "user_annotation")
BLOCKING = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
            "cudaMemcpy")  # name prefixes; cudaMemcpyAsync blocks when the host side is pageable


class HostStacks:
    """The host events (ops, Python frames) enclosing a timestamp on a thread."""

    def __init__(self, events):
        self.by_tid = collections.defaultdict(list)
        for e in events:
            if e.get("cat") in HOST_CATS and "dur" in e:
                self.by_tid[e["tid"]].append(e)
        for evs in self.by_tid.values():
            evs.sort(key=lambda e: e["ts"])
        self.starts = {tid: [e["ts"] for e in evs] for tid, evs in self.by_tid.items()}
        self.longest = {tid: max((e["dur"] for e in evs), default=0) for tid, evs in self.by_tid.items()}

    def at(self, tid, ts, depth=3) -> str:
        evs, starts = self.by_tid.get(tid, []), self.starts.get(tid, [])
        hi = bisect.bisect_right(starts, ts)
        lo = bisect.bisect_left(starts, ts - self.longest.get(tid, 0))
        enclosing = [e for e in evs[lo:hi] if e["ts"] + e["dur"] >= ts]
        ours = [e for e in enclosing if e.get("cat") == "python_function" and _is_ours(e["name"])]
        chosen = ours[-depth:] if ours else enclosing[-depth:]
        return " > ".join(_short(e["name"]) for e in chosen) or "?"


def _is_ours(name: str) -> bool:
    return any(part in name for part in ("compression/", "kernels/", "megatron/hooks/", "megatron/training/",
                                         "megatron/core/"))


def _short(name: str) -> str:
    return name.split("site-packages/")[-1]


def _union(intervals):
    """Merged (start, end) of possibly overlapping intervals."""
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def analyze(trace: dict, min_gap_us: float, top: int) -> str:
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    device = [e for e in events if e.get("cat") in DEVICE_CATS]
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    if not device:
        return "no device activity in the trace"
    launch_of = {e["args"]["correlation"]: e for e in runtime if "correlation" in e.get("args", {})}
    stacks = HostStacks(events)
    t0 = min(e["ts"] for e in events)
    span = max(e["ts"] + e["dur"] for e in events) - t0
    busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in device])
    busy_us = sum(end - start for start, end in busy)
    lines = [f"trace span {span / 1e3:.2f} ms; device busy {busy_us / 1e3:.2f} ms (any stream), "
             f"idle {(span - busy_us) / 1e3:.2f} ms"]
    per_stream = collections.Counter()
    for e in device:
        per_stream[e["args"].get("stream", "?")] += e["dur"]
    nccl = sum(e["dur"] for e in device if "nccl" in e["name"].lower())
    lines.append("busy per stream (ms): " + ", ".join(f"{s}: {t / 1e3:.2f}" for s, t in per_stream.most_common())
                 + f"; NCCL kernels {nccl / 1e3:.2f} ms")

    # gaps, charged to the host code that launched the work ending them
    first_after = sorted(device, key=lambda e: e["ts"])
    starts = [e["ts"] for e in first_after]
    charged, host_late = collections.Counter(), collections.Counter()
    gaps = []
    for (_, gap_start), (gap_end, _) in zip(busy, busy[1:]):
        if gap_end - gap_start < min_gap_us:
            continue
        nxt = first_after[bisect.bisect_left(starts, gap_end)]
        launch = launch_of.get(nxt["args"].get("correlation"))
        where = stacks.at(launch["tid"], launch["ts"]) if launch else "?"
        late = launch is not None and launch["ts"] > gap_start
        charged[where] += gap_end - gap_start
        host_late[where] += late
        gaps.append((gap_end - gap_start, gap_start - t0, nxt["name"][:60], where, late))
    lines.append(f"\nidle gaps >= {min_gap_us:g} us: {len(gaps)}, {sum(g[0] for g in gaps) / 1e3:.2f} ms; by the host "
                 f"code launching the work after the gap (ms, gaps, of which launched after the gap began):")
    counts = collections.Counter(g[3] for g in gaps)
    for where, t in charged.most_common(top):
        lines.append(f"  {t / 1e3:8.2f}  {counts[where]:4d}  {host_late[where]:4d}  {where}")
    lines.append("\nlongest gaps (us, at ms, next device work, launched after the gap began, host code):")
    for dur, at, name, where, late in sorted(gaps, reverse=True)[:top]:
        lines.append(f"  {dur:9.0f}  {at / 1e3:8.2f}  {name:60s}  {'late' if late else '    '}  {where}")

    # host blocking calls
    blocking = [e for e in runtime if e["name"].startswith(BLOCKING)]
    by_where = collections.Counter()
    n_where = collections.Counter()
    for e in blocking:
        where = f"{e['name']} @ {stacks.at(e['tid'], e['ts'])}"
        by_where[where] += e["dur"]
        n_where[where] += 1
    lines.append(f"\nhost blocking calls: {len(blocking)}, {sum(e['dur'] for e in blocking) / 1e3:.2f} ms "
                 f"(ms, calls, where):")
    for where, t in by_where.most_common(top):
        lines.append(f"  {t / 1e3:8.2f}  {n_where[where]:4d}  {where}")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--min-gap-us", type=float, default=20.0)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    with open(args.trace) as f:
        print(analyze(json.load(f), args.min_gap_us, args.top))


if __name__ == "__main__":
    main()
