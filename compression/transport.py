"""The all-to-all of equal row chunks that compressed reduce-scatters share (TACO's tensor-parallel
collectives, SDP4Bit's gradient reduce-scatter).

Between two ranks an all-to-all is an all-gather of the chunk the peer needs, and NCCL's ring
all-gather moves it faster than all-to-all's point-to-point sends: of the bf16 all-reduce's time, a
TACO wire took 0.49-0.54x as an all-gather vs 0.67-0.75x as an all-to-all on sockets, 0.57-0.60x vs
0.61-0.64x at ~25 GB/s (2x H200, ``benchmarks/nccl_transports.py``,
``results/collectives/nccl_transports.json``; on NVLink the all-to-all was faster from 64 MiB, where ``auto``
compresses nothing).
"""

import torch
import torch.distributed as dist


def all_to_all_rows(recv: torch.Tensor, send: torch.Tensor, group=None, async_op: bool = False):
    """Chunk j of ``recv`` becomes chunk ``rank`` of rank j's ``send`` (both contiguous, ``world`` equal
    chunks), except this rank's own chunk of ``recv``, which is left unspecified: callers use their
    own exact data there. Returns the work handle if ``async_op``."""
    world = dist.get_world_size(group)
    if world == 2:
        chunk = send.numel() // 2
        peer = 1 - dist.get_rank(group)
        mine = send.reshape(-1)[peer * chunk:(peer + 1) * chunk]
        return dist.all_gather_into_tensor(recv.view(-1), mine, group=group, async_op=async_op)
    return dist.all_to_all_single(recv, send, group=group, async_op=async_op)
