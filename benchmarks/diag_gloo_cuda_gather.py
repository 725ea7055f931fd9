"""Which collectives of CUDA tensors torch's gloo backend survives (session 34; the reason for the
``--distributed-backend gloo`` check in ``megatron/training/arguments.py``).

megatron-core's distributed optimizer gathers a bucket group's parameters as ``all_gather_into_tensor`` calls inside
``_coalescing_manager``, and reduces its gradients the same way (``reduce_scatter_tensor`` with the distributed
optimizer, ``all_reduce`` without); the compressed gathers of this project (``megatron/hooks/param_gather.py``) issue
one ``all_gather_into_tensor`` per bucket. This runs the collective on two buffers both ways and checks the result:

    torchrun --nproc-per-node 2 benchmarks/diag_gloo_cuda_gather.py {plain,coalesced-sync,coalesced-async} \
        [{all_gather,reduce_scatter,all_reduce}]

Measured (torch 2.11.0+cu130, H200, both ranks on cuda:0; ``scripts/gpu/gloo_cuda_collectives.sh``, sessions 34 and
36, results/gpu/session36/gloo_cuda_collectives/): ``plain`` is correct for all three. Coalesced, ``reduce_scatter`` is
correct both ways; ``all_gather`` ends in a segmentation fault (in ``_coalescing_manager``'s exit when synchronous, in
the handle's ``wait`` when not); ``all_reduce`` raises ``ProcessGroupGloo::allreduce_coalesced: unsupported device
type cuda``. So with CUDA tensors gloo runs megatron-core's DP communication only with the distributed optimizer and a
compressed parameter gather. Without CUDA the tensors are on the CPU, where all modes of all three collectives are
correct (torch 2.13).
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _coalescing_manager

MODES = ("plain", "coalesced-sync", "coalesced-async")
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")


def issue(collective: str, buffer: torch.Tensor, rank: int, world: int, async_op: bool):
    """One collective on ``buffer`` ([world * n]; rank r's shard is row r of its [world, n] view)."""
    shard = buffer.view(world, -1)[rank]
    if collective == "all_gather":
        return dist.all_gather_into_tensor(buffer, shard, async_op=async_op)
    if collective == "reduce_scatter":
        return dist.reduce_scatter_tensor(shard, buffer, async_op=async_op)
    return dist.all_reduce(buffer, async_op=async_op)


def run(collective: str, buffers: list, mode: str, rank: int, world: int) -> None:
    if mode == "plain":
        for handle in [issue(collective, b, rank, world, async_op=True) for b in buffers]:
            handle.wait()
    elif mode == "coalesced-sync":
        with _coalescing_manager(async_ops=False):
            for b in buffers:
                issue(collective, b, rank, world, async_op=False)
    else:
        with _coalescing_manager(async_ops=True) as coalesced:
            for b in buffers:
                issue(collective, b, rank, world, async_op=True)
        coalesced.wait()


def inputs(collective: str, rank: int, world: int, device: str) -> list:
    """All-gather: each rank holds rank + 1 in its own shard, zeros elsewhere. Reductions: every value of rank r's
    buffers is r + 1, so every reduced value is world * (world + 1) / 2 (exact in bf16 for small worlds)."""
    buffers = list(torch.zeros(2, 1024 * world, dtype=torch.bfloat16, device=device))
    for b in buffers:
        (b.view(world, -1)[rank] if collective == "all_gather" else b).fill_(rank + 1)
    return buffers


def correct(collective: str, buffers: list, rank: int, world: int) -> bool:
    if collective == "all_gather":
        return all(bool((b.view(world, -1)[k] == k + 1).all()) for b in buffers for k in range(world))
    total = world * (world + 1) // 2
    reduced = [b.view(world, -1)[rank] if collective == "reduce_scatter" else b for b in buffers]
    return all(bool((r == total).all()) for r in reduced)


def main(mode: str, collective: str) -> None:
    if mode not in MODES:
        sys.exit(f"mode must be one of {MODES}, got {mode!r}")
    if collective not in COLLECTIVES:
        sys.exit(f"collective must be one of {COLLECTIVES}, got {collective!r}")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    buffers = inputs(collective, rank, world, device)
    run(collective, buffers, mode, rank, world)
    verdict = "correct" if correct(collective, buffers, rank, world) else "WRONG"
    print(f"{collective} {mode} on {device}: rank {rank} {verdict}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "plain", sys.argv[2] if len(sys.argv) > 2 else "all_gather")
