"""Compressed (TACO) vs NCCL bf16 all-reduce, all-gather and reduce-scatter time (GPU, torchrun).

    torchrun --nproc-per-node 2 -m benchmarks.bench_tp_collectives --out tp_nvlink.json
    NCCL_P2P_DISABLE=1 torchrun --nproc-per-node 2 -m benchmarks.bench_tp_collectives --out tp_shm.json
    NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 torchrun ... --out tp_sockets.json

The link class is whatever the caller's NCCL environment selects; every NCCL_* variable is
recorded in the JSON. Per operation and size (bytes of the bf16 input each rank hands to the
collective): first a correctness check (compressed result within 5% relative L2 of the bf16
collective; all-reduce and all-gather results bit-identical on every rank), then the median time of
--iters calls after --warmup (CUDA events; the slowest rank's median; "synced": each call starts on
an idle device, so the host's launch cost counts), then "queued" times (``timing.queued_seconds``:
--iters back-to-back calls enqueued behind a sleep kernel, as in training where the host runs ahead:
``*_gpu_ms`` is device time per call, ``*_host_ms`` the host's cost per call; slowest rank).
``min_bytes`` per operation
is the smallest swept size from which the compressed collective is faster at every larger size
(``tp_collectives.crossover``; null: never faster); ``auto_min_bytes`` is what
``tp_collectives.measure_min_bytes``, the AUTO policy's start-up probe, picks on the same group.
``--cuda-graphs`` also times the compressed collectives replayed as CUDA graphs
(``compression.collective_graphs``, ``--tp-comm-cuda-graphs``) and checks them bit-identical to the eager
calls (``graphed_*`` columns). Exits non-zero if a check fails. ``--dry-run`` runs the same logic on
gloo CPU ranks, tiny sizes.
"""

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from compression.collective_graphs import CollectiveGraphs
from compression.taco import TacoCodec, TacoConfig
from compression.timing import queued_seconds
from compression.tp_collectives import OPS, compressed, crossover, measure_min_bytes, uncompressed


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="compressed vs bf16 TP collectives")
    p.add_argument("--out", required=True, help="JSON results path (written by rank 0)")
    p.add_argument("--sizes-kib", default="64,256,1024,4096,16384,65536,262144",
                   help="bf16 input bytes per rank, KiB (64 KiB .. 256 MiB)")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--format", default="e4m3")
    p.add_argument("--transform", default="ash")
    p.add_argument("--scaling", default="dual")
    p.add_argument("--all-reduce", default="auto", choices=["auto", "one-shot", "two-shot"],
                   help="compressed all-reduce algorithm (--taco-all-reduce)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--cuda-graphs", action="store_true", help="also time CUDA-graph replays of the compressed calls")
    p.add_argument("--dry-run", action="store_true", help="gloo CPU ranks, tiny sizes, 2 iterations")
    return p.parse_args(argv)


def _time_ms(fn, device, warmup, iters):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    slowest = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.item()


def _queued_ms(fn, device, iters):
    """(device ms, host ms) per call, back to back (``queued_seconds``), of the slowest rank."""
    fn()
    times = torch.tensor(queued_seconds(fn, device, iters, group=dist.group.WORLD), dtype=torch.float64,
                         device=device) * 1e3
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return times.tolist()


def _same_on_all_ranks(t, world) -> bool:
    bits = t.contiguous().view(torch.int16).to(torch.int64)
    fingerprint = torch.stack([bits.sum(), (bits * torch.arange(1, bits.numel() + 1, device=t.device)).sum()])
    everyone = [torch.empty_like(fingerprint) for _ in range(world)]
    dist.all_gather(everyone, fingerprint)
    return all(torch.equal(f, fingerprint) for f in everyone)


def check(op, x, codec, world, all_reduce) -> list:
    exact = uncompressed(op, x).float()
    got = compressed(op, x, codec, all_reduce_algorithm=all_reduce)
    problems = []
    rel = ((got.float().reshape(-1) - exact.reshape(-1)).norm() / exact.norm()).item()
    if not rel < 0.05:
        problems.append(f"{op}: relative error {rel:.4f}")
    if op != "reduce_scatter" and not _same_on_all_ranks(got, world):
        problems.append(f"{op}: results differ across ranks")
    return problems


def _input(nbytes, rank, device):
    g = torch.Generator(device=device).manual_seed(rank)
    numel = nbytes // 2
    x = torch.randn(numel, generator=g, device=device) * 0.02
    return x.to(torch.bfloat16)


def min_bytes(rows, op):
    """Smallest swept size from which compression wins at every larger size (None if never)."""
    mine = [r for r in rows if r["op"] == op]
    return crossover([r["bytes"] for r in mine], [r["nccl_ms"] for r in mine], [r["compressed_ms"] for r in mine])


def run(args, device):
    world, rank = dist.get_world_size(), dist.get_rank()
    codec = TacoCodec(TacoConfig(args.block_size, args.format, args.transform, args.scaling))
    sizes = [4096, 16384] if args.dry_run else [int(k) * 1024 for k in args.sizes_kib.split(",")]
    warmup, iters = (1, 2) if args.dry_run else (args.warmup, args.iters)
    rows, problems = [], []
    graphs = CollectiveGraphs() if args.cuda_graphs else None
    for nbytes in sizes:
        x = _input(nbytes - nbytes % (2 * world), rank, device)
        for op in OPS:
            problems += check(op, x, codec, world, args.all_reduce)
            nccl_ms = _time_ms(lambda: uncompressed(op, x), device, warmup, iters)
            compressed_ms = _time_ms(lambda: compressed(op, x, codec, all_reduce_algorithm=args.all_reduce), device,
                                     warmup, iters)
            nccl_gpu_ms, nccl_host_ms = _queued_ms(lambda: uncompressed(op, x), device, iters)
            taco_gpu_ms, taco_host_ms = _queued_ms(
                lambda: compressed(op, x, codec, all_reduce_algorithm=args.all_reduce), device, iters)
            rows.append(dict(op=op, bytes=x.numel() * 2, nccl_ms=nccl_ms, compressed_ms=compressed_ms,
                             speedup=nccl_ms / compressed_ms, nccl_gpu_ms=nccl_gpu_ms, nccl_host_ms=nccl_host_ms,
                             compressed_gpu_ms=taco_gpu_ms, compressed_host_ms=taco_host_ms,
                             queued_speedup=nccl_gpu_ms / taco_gpu_ms))
            if graphs is not None:
                problems += _time_graphed(rows[-1], graphs, op, x, codec, args, device, warmup, iters)
    result = dict(
        config=dataclasses.asdict(codec.config), world_size=world, device=str(device),
        gpu=torch.cuda.get_device_name() if device.type == "cuda" else None, torch=torch.__version__,
        nccl=".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None,
        env={k: v for k, v in os.environ.items() if k.startswith("NCCL_")}, dry_run=args.dry_run,
        min_bytes={op: min_bytes(rows, op) for op in OPS},
        all_reduce=args.all_reduce, cuda_graphs=args.cuda_graphs,
        auto_min_bytes={timing: measure_min_bytes(codec, sizes=sizes, iters=iters, device=device, timing=timing,
                                                  all_reduce_algorithm=args.all_reduce)
                        for timing in ("synced", "queued")},
        problems=problems, rows=rows)
    if rank == 0:
        _print_table(result)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


def _time_graphed(row, graphs, op, x, codec, args, device, warmup, iters) -> list:
    """Add the CUDA-graph replay's times to ``row``; a problem if a replay differs from the eager call."""
    key = (op, args.all_reduce)

    def collective(t):
        return compressed(op, t, codec, all_reduce_algorithm=args.all_reduce)

    eager = collective(x)
    for _ in range(graphs.warmup + 2):  # eager warm-up calls, the capture, a replay
        graphed = graphs.run(key, collective, x)
    row["graphed_ms"] = _time_ms(lambda: graphs.run(key, collective, x), device, warmup, iters)
    row["graphed_gpu_ms"], row["graphed_host_ms"] = _queued_ms(lambda: graphs.run(key, collective, x), device, iters)
    row["graphed_speedup"] = row["nccl_ms"] / row["graphed_ms"]
    row["graphed_queued_speedup"] = row["nccl_gpu_ms"] / row["graphed_gpu_ms"]
    same = torch.equal(graphed.view(torch.int16), eager.view(torch.int16))
    return [] if same else [f"{op} {x.numel() * 2} bytes: CUDA-graph replay differs from the eager call"]


def _print_table(result):
    print(f"world {result['world_size']}, NCCL env {result['env'] or '{}'}, codec {result['config']}")
    print(f"{'op':>15} {'bytes':>11} {'nccl ms':>9} {'taco ms':>9} {'speedup':>8} | queued: {'nccl gpu':>9} "
          f"{'taco gpu':>9} {'speedup':>8} {'nccl host':>9} {'taco host':>9}")
    for r in result["rows"]:
        print(f"{r['op']:>15} {r['bytes']:>11} {r['nccl_ms']:>9.3f} {r['compressed_ms']:>9.3f} {r['speedup']:>8.2f} | "
              f"{'':>7} {r['nccl_gpu_ms']:>9.3f} {r['compressed_gpu_ms']:>9.3f} {r['queued_speedup']:>8.2f} "
              f"{r['nccl_host_ms']:>9.3f} {r['compressed_host_ms']:>9.3f}")
    print(f"min_bytes (compression wins from here up): {result['min_bytes']}")
    print(f"auto_min_bytes (measure_min_bytes on this group): {result['auto_min_bytes']}")
    for r in result["rows"]:
        if "graphed_ms" in r:
            print(f"{r['op']:>15} {r['bytes']:>11} CUDA graph: {r['graphed_ms']:.3f} ms (speedup {r['graphed_speedup']:.2f}), "
                  f"queued gpu {r['graphed_gpu_ms']:.3f} ms (speedup {r['graphed_queued_speedup']:.2f}), "
                  f"host {r['graphed_host_ms']:.3f} ms")
    for p in result["problems"]:
        print("CHECK FAILED:", p)


def main(argv=None):
    args = parse_args(argv)
    use_cuda = not args.dry_run
    if use_cuda and not torch.cuda.is_available():
        sys.exit("bench_tp_collectives needs CUDA (or --dry-run)")
    if args.cuda_graphs and not use_cuda:
        sys.exit("--cuda-graphs needs CUDA (drop it with --dry-run)")
    dist.init_process_group("nccl" if use_cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    try:
        result = run(args, device)
    finally:
        dist.destroy_process_group()
    if result["problems"]:
        sys.exit(f"{len(result['problems'])} correctness check(s) failed")


if __name__ == "__main__":
    main()
