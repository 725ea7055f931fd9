"""Which NCCL transport moves a compressed TP wire fastest, relative to the bf16 all-reduce it replaces.

TACO's one-shot all-reduce at TP=2 all-gathers each rank's wire (~0.516x of the bf16 bytes at block 256)
and measured 0.63x of NCCL's bf16 all-reduce time at ~25 GB/s, above the wire ratio: part of that is
the all-gather's own efficiency. This benchmark times, in one run and on the same group, NCCL's bf16
all-reduce of N values and three ways of giving every rank every other rank's W-byte wire (W = the INT8
wire of N values): ``all_gather_into_tensor``, ``all_to_all_single`` (W per peer) and point-to-point
``batch_isend_irecv`` to every peer. Device time per call (CUDA events around a queue of calls, median
of the repeats), printed as ratios against the all-reduce.

    NCCL_P2P_DISABLE=1 torchrun --standalone --nproc-per-node 2 benchmarks/nccl_transports.py --out F
"""

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from kernels.taco import wire_nbytes  # noqa: E402


def device_ms(fn, repeats: int, calls: int = 5) -> float:
    """Median over ``repeats`` of the device time of ``calls`` queued calls, per call."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def transports(n: int, world: int, rank: int, device):
    """name -> zero-argument function issuing one collective."""
    wire = wire_nbytes(n, 256)
    x = torch.randn(n, device=device).bfloat16()
    send = torch.randint(0, 256, (wire,), dtype=torch.uint8, device=device)
    gathered = torch.empty(world * wire, dtype=torch.uint8, device=device)
    a2a_send = send.repeat(world)
    peers = [p for p in range(world) if p != rank]

    def p2p():
        ops = [dist.P2POp(dist.isend, send, p) for p in peers]
        ops += [dist.P2POp(dist.irecv, gathered[p * wire:(p + 1) * wire], p) for p in peers]
        for req in dist.batch_isend_irecv(ops):
            req.wait()

    return wire, {
        "all_reduce_bf16": lambda: dist.all_reduce(x),
        "all_gather_wire": lambda: dist.all_gather_into_tensor(gathered, send),
        "all_to_all_wire": lambda: dist.all_to_all_single(gathered, a2a_send),
        "p2p_wire": p2p,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mib", default="4,16,64,256", help="bf16 tensor sizes of the all-reduce")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda")
    rows = []
    for mib in (float(s) for s in args.sizes_mib.split(",")):
        n = int(mib * 2**20) // 2
        wire, fns = transports(n, world, rank, device)
        ms = {name: device_ms(fn, args.repeats) for name, fn in fns.items()}
        base = ms["all_reduce_bf16"]
        rows.append(dict(mib=mib, numel=n, wire_bytes=wire, wire_ratio=wire / (2 * n), ms=ms,
                         vs_all_reduce={k: v / base for k, v in ms.items()}))
        if rank == 0:
            print(f"{mib:6.0f} MiB  all-reduce {base:.3f} ms  " +
                  "  ".join(f"{k} {v / base:.3f}x" for k, v in ms.items() if k != "all_reduce_bf16"), flush=True)
    if rank == 0:
        env = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
        with open(args.out, "w") as f:
            json.dump(dict(world_size=world, device=torch.cuda.get_device_name(), torch=torch.__version__,
                           nccl=".".join(map(str, torch.cuda.nccl.version())), env=env, argv=sys.argv,
                           rows=rows), f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
