"""Which all-gathers of CUDA tensors torch's gloo backend survives (session 34; the reason for the
``--distributed-backend gloo`` check in ``megatron/training/arguments.py``).

megatron-core's distributed optimizer gathers a bucket group's parameters as ``all_gather_into_tensor`` calls inside
``_coalescing_manager``; the compressed gathers of this project (``megatron/hooks/param_gather.py``) issue one
``all_gather_into_tensor`` per bucket. This gathers two buffers both ways and checks the result:

    torchrun --nproc-per-node 2 benchmarks/diag_gloo_cuda_gather.py {plain,coalesced-sync,coalesced-async}

Measured (torch 2.11.0+cu130, H200, both ranks on cuda:0): ``plain`` is correct; both coalesced modes end in a
segmentation fault (in ``_coalescing_manager``'s exit when synchronous, in the handle's ``wait`` when not). Without
CUDA the tensors are on the CPU, where all three are correct (torch 2.13).
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _coalescing_manager

MODES = ("plain", "coalesced-sync", "coalesced-async")


def gather(buffers: list, mode: str, rank: int, world: int) -> None:
    shards = [b.view(world, -1)[rank] for b in buffers]
    if mode == "plain":
        for handle in [dist.all_gather_into_tensor(b, s, async_op=True) for b, s in zip(buffers, shards)]:
            handle.wait()
    elif mode == "coalesced-sync":
        with _coalescing_manager(async_ops=False):
            for b, s in zip(buffers, shards):
                dist.all_gather_into_tensor(b, s)
    else:
        with _coalescing_manager(async_ops=True) as coalesced:
            for b, s in zip(buffers, shards):
                dist.all_gather_into_tensor(b, s, async_op=True)
        coalesced.wait()


def main(mode: str) -> None:
    if mode not in MODES:
        sys.exit(f"mode must be one of {MODES}, got {mode!r}")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    buffers = list(torch.zeros(2, 1024 * world, dtype=torch.bfloat16, device=device))
    for b in buffers:
        b.view(world, -1)[rank].fill_(rank + 1)
    gather(buffers, mode, rank, world)
    correct = all(bool((b.view(world, -1)[k] == k + 1).all()) for b in buffers for k in range(world))
    print(f"{mode} on {device}: rank {rank} {'correct' if correct else 'WRONG'}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "plain")
