"""What a re-capture of a graphed sync-free gather (``--delta-cuda-graphs``) costs the iterations around it.

A captured gather is captured again whenever its slot capacity changes (payloads shrinking as the learning rate
decays: 8 times in session 40's 40-iteration runs). Each step here stands in for a training iteration on each rank:
- the optimizer: AdamW on this rank's fp32 shard (``bench_param_gather.Trajectory``) written into its bf16 slices of
  ``--buckets`` buckets in one storage, as megatron-core's buffer holds them;
- the forward and backward's working set: ``--working-set-mib`` MiB in ``--working-set-tensors`` tensors allocated,
  written and freed, which the caching allocator keeps between iterations unless something empties it;
- the gather of the buckets, coded as one (``GatherFusions``) in slots and replayed as a CUDA graph.
Every ``--recapture-every`` steps the slot capacity changes by one ``SLOT_ROUND`` (up, then down again), as a
payload's growth or shrinking changes it: new slots, two eager gathers, then a capture. Per step: host wall time of
each phase (the device synchronized around each), whether the gather was captured or replayed, the reserved memory;
every gather is checked bit for bit against an uncompressed one (outside the timed phases). Summary: each phase's
median over the steps that captured, the steps right after them and the steady steps (replays), and how much longer
the capture steps and the steps after them took than the steady median.

    torchrun --nproc-per-node 1 benchmarks/bench_graph_capture.py --out results/gpu/sessionN/graph_capture.json

On one GPU the all-gather is NCCL's over a world of one: the capture's host and allocator costs, not the link's.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.bench_param_gather import Trajectory, _check_bits  # noqa: E402
from compression.collective_graphs import release_all_graphs  # noqa: E402
from compression.delta import DeltaCodec, DeltaConfig  # noqa: E402
from compression.shard_gather import GRAPH_WARMUP, SLOT_ROUND, GatherFusions, ShardGather, prepare_gathers  # noqa: E402
from compression.telemetry import TELEMETRY  # noqa: E402

PHASES = ("optimizer_s", "working_set_s", "gather_s")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=180_000_000, help="values per rank over all buckets (GPT-350M's "
                                                                   "355M parameters at DP=2)")
    p.add_argument("--buckets", type=int, default=8)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--recapture-every", type=int, default=8,
                   help="change the slot capacity every this many steps (>= 4: two eager gathers, the capture, a "
                        "replay)")
    p.add_argument("--working-set-mib", type=int, default=8192)
    p.add_argument("--working-set-tensors", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--optimizer-warmup", type=int, default=10, help="AdamW steps before the first gather")
    p.add_argument("--delta-block-size", type=int, default=256)
    p.add_argument("--delta-capacity-factor", type=float, default=1.25)
    p.add_argument("--out", required=True, help="JSON results (written by rank 0)")
    args = p.parse_args(argv)
    if args.recapture_every < GRAPH_WARMUP + 2:
        p.error(f"--recapture-every must be >= {GRAPH_WARMUP + 2} (eager gathers, the capture, a replay), "
                f"got {args.recapture_every}")
    return args


def _timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _working_set(mib: int, tensors: int, device) -> None:
    """Allocate, write and free ``mib`` MiB in ``tensors`` tensors (a forward's activations, a backward's grads)."""
    live = [torch.empty((mib << 20) // tensors, dtype=torch.uint8, device=device) for _ in range(tensors)]
    for t in live:
        t.fill_(1)


def _captures() -> int:
    counters = TELEMETRY.extra_counters()
    return counters.get("dp_param_gather/graph_captures", 0)


def run(args) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device())
    n, k = args.numel // world, args.buckets
    if n % k:
        raise ValueError(f"--buckets {k} must divide the values per rank ({n})")
    m = n // k
    traj = Trajectory(n, args.lr, args.optimizer_warmup, rank, device)
    buffers = list(torch.empty(k * m * world, dtype=torch.bfloat16, device=device).split(m * world))
    own = [b[rank * m:(rank + 1) * m] for b in buffers]
    for b, values in zip(buffers, traj.bf16().split(m)):
        dist.all_gather_into_tensor(b, values)
    gathers = [ShardGather(DeltaCodec(DeltaConfig(args.delta_block_size), world, rank), None,
                           capacity_factor=args.delta_capacity_factor, cuda_graphs=True) for _ in range(k)]
    fusions, steps, fused, since_capture, changes = GatherFusions(), [], None, 0, 0
    TELEMETRY.reset()

    def optimizer():
        for o, values in zip(own, traj.step().split(m)):
            o.copy_(values)

    def gather():
        nonlocal fused
        prepared = prepare_gathers(gathers, buffers, fusions)
        handles = [g.transfer(b, p, async_op=True) for g, b, p in zip(gathers, buffers, prepared)]
        for handle in handles:
            if handle is not None:
                handle.wait()
        fused = prepared[0].fused.gather if prepared[0].fused is not None else None  # none at the keyframes

    for step in range(args.steps):
        row = dict(step=step, new_capacity=since_capture == args.recapture_every)
        if row["new_capacity"]:  # the captured gather is not replayed again
            fused.capacity += SLOT_ROUND * (1 if changes % 2 == 0 else -1)
            since_capture, changes = 0, changes + 1
        row["optimizer_s"] = _timed(optimizer)
        row["working_set_s"] = _timed(lambda: _working_set(args.working_set_mib, args.working_set_tensors, device))
        captures, before = _captures(), fused
        replays = fused.graph_replays if fused is not None else 0
        dist.barrier()
        row["gather_s"] = _timed(gather)
        row["captured"] = _captures() > captures
        row["replayed"] = (not row["captured"] and fused is not None and fused is before
                           and fused.graph_replays > replays)
        since_capture = 1 if row["captured"] else since_capture + (since_capture > 0)  # steps since the capture
        row["reserved_bytes"] = torch.cuda.memory_reserved()
        for b, o in zip(buffers, own):
            _check_bits(b, o, "delta-slots-graphs", step)
        steps.append(row)
    release_all_graphs()
    return dict(world_size=world, device=torch.cuda.get_device_name(device), torch=torch.__version__,
                args={key: value for key, value in vars(args).items() if key != "out"}, steps=steps,
                summary=summarize(steps))


def summarize(steps: list) -> dict:
    """Medians per phase over the capture steps, the steps right after them and the steady ones (replays, not right
    after a capture); the excess of a capture step and of the step after it over the steady steps' median total."""
    captured = [i for i, s in enumerate(steps) if s["captured"]]
    after = [i + 1 for i in captured if i + 1 < len(steps)]
    steady = [i for i, s in enumerate(steps) if s["replayed"] and i not in after]
    total = [sum(s[p] for p in PHASES) for s in steps]

    def medians(rows):
        return {p: statistics.median(steps[i][p] for i in rows) * 1e3 for p in PHASES} if rows else None

    base = statistics.median(total[i] for i in steady) if steady else None
    return dict(captures=len(captured), capture_ms=medians(captured), after_capture_ms=medians(after),
                steady_ms=medians(steady), steady_steps=steady,
                capture_step_excess_ms=[(total[i] - base) * 1e3 for i in captured] if base else None,
                after_capture_excess_ms=[(total[i] - base) * 1e3 for i in after] if base else None)


def main(argv=None):
    args = parse_args(argv)
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    try:
        report = run(args)
        if dist.get_rank() == 0:
            s = report["summary"]
            for name in ("capture_ms", "after_capture_ms", "steady_ms"):
                print(name, {p: round(v, 2) for p, v in (s[name] or {}).items()})
            print("capture step excess ms", [round(v, 1) for v in s["capture_step_excess_ms"] or []])
            print("after-capture step excess ms", [round(v, 1) for v in s["after_capture_excess_ms"] or []])
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
