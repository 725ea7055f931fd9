"""Compressed tensor-parallel collectives over a torch.distributed group (NCCL or gloo).

Wire buffers are 1-D uint8 tensors from a row-capable codec (``TacoCodec``: ``encode(x, rows)``
puts row r of the flattened input in bytes ``[r * w, (r + 1) * w)`` with ``w = wire_nbytes(ceil(n /
rows))``), exchanged with ``all_to_all_single`` and ``all_gather_into_tensor``. Any tensor size works:
rows are zero-padded inside the codec, never copied here.

- ``compressed_all_reduce``: two-shot. Phase 1: encode x as ``world`` rows, all-to-all (rank r
  receives everyone's row r), sum in fp32 (the own row taken uncompressed). Phase 2: encode the
  reduced row, all-gather, decode. Every rank, the row's owner included, returns the decoded
  values, so all ranks end bit-identical.
- ``compressed_reduce_scatter``: along dim 0 like ``reduce_scatter_tensor``; phase 1 only.
- ``compressed_all_gather``: along dim 0 like ``all_gather_into_tensor``; every rank, the source
  included, returns decoded values, so the result is identical on all ranks.

Results are new tensors (inputs are not modified). With ``async_op=True`` the communication is
started and a handle returned whose ``wait()`` finishes the work (the second phase and the decode)
and returns the result, so callers can overlap the first phase with compute. A group of size 1
(or an empty all-reduce / reduce-scatter input) returns the input unchanged.

Telemetry (``TELEMETRY.record(comm_class, raw, sent)``): ``sent`` is the size of the compressed
buffers this rank hands to collectives; ``raw`` what it would hand to the same collectives
uncompressed: n * itemsize for reduce-scatter and all-gather inputs. For the all-reduce both phases
of the two-shot count, raw = (n + ceil(n / world)) * itemsize against sent = (world + 1) * w, so
raw / sent is the codec's ratio rather than a figure inflated or deflated by the algorithm.
"""

import torch
import torch.distributed as dist

from compression.telemetry import TELEMETRY


class CollectiveHandle:
    """Returned with ``async_op=True``: ``wait()`` waits for the communication, runs ``finish`` once
    and returns its result (later calls return the same tensor)."""

    def __init__(self, work, finish):
        self._work, self._finish, self._result = work, finish, None

    def wait(self) -> torch.Tensor:
        if self._result is None:
            if self._work is not None:
                self._work.wait()
            self._result = self._finish()
        return self._result


def _done(result: torch.Tensor, async_op: bool):
    handle = CollectiveHandle(None, lambda: result)
    return handle if async_op else result


def _sum_rows(parts: torch.Tensor, own: torch.Tensor, rank: int) -> torch.Tensor:
    """Sum the decoded rows [world, L] in fp32, with this rank's row replaced by its exact values."""
    parts[rank, :own.numel()] = own.reshape(-1)
    parts[rank, own.numel():] = 0
    return parts.sum(dim=0)


def compressed_all_reduce(x: torch.Tensor, codec, group=None, async_op=False, comm_class="tp"):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world == 1 or x.numel() == 0:
        return _done(x, async_op)
    n, itemsize = x.numel(), x.element_size()
    row_len = -(-n // world)
    row_wire = codec.wire_nbytes(row_len)
    send = codec.encode(x, rows=world)
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)
    TELEMETRY.record(comm_class, (n + row_len) * itemsize, (world + 1) * row_wire)

    def finish():
        flat = x.reshape(-1)
        parts = codec.decode(recv, world * row_len, torch.float32, rows=world).view(world, row_len)
        reduced = _sum_rows(parts, flat[rank * row_len:(rank + 1) * row_len].float(), rank)
        gathered = torch.empty(world * row_wire, dtype=torch.uint8, device=x.device)
        dist.all_gather_into_tensor(gathered, codec.encode(reduced), group=group)
        return codec.decode(gathered, n, x.dtype, rows=world).view(x.shape)

    handle = CollectiveHandle(work, finish)
    return handle if async_op else handle.wait()


def compressed_reduce_scatter(x: torch.Tensor, codec, group=None, async_op=False, comm_class="tp"):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if x.dim() == 0 or x.shape[0] % world:
        raise ValueError(f"compressed_reduce_scatter needs dim 0 divisible by the group size {world}, "
                         f"got shape {tuple(x.shape)}")
    if world == 1 or x.numel() == 0:
        return _done(x, async_op)
    row_len = x.numel() // world
    send = codec.encode(x, rows=world)
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)
    TELEMETRY.record(comm_class, x.numel() * x.element_size(), send.numel())

    def finish():
        parts = codec.decode(recv, world * row_len, torch.float32, rows=world).view(world, row_len)
        own = x.reshape(world, row_len)[rank].float()
        reduced = _sum_rows(parts, own, rank)
        return reduced.to(x.dtype).view(x.shape[0] // world, *x.shape[1:])

    handle = CollectiveHandle(work, finish)
    return handle if async_op else handle.wait()


def compressed_all_gather(x: torch.Tensor, codec, group=None, async_op=False, comm_class="tp"):
    world = dist.get_world_size(group)
    if world == 1:
        return _done(x, async_op)
    if x.numel() == 0:
        return _done(x.new_empty((world * x.shape[0], *x.shape[1:])), async_op)
    send = codec.encode(x)
    gathered = torch.empty(world * send.numel(), dtype=torch.uint8, device=x.device)
    work = dist.all_gather_into_tensor(gathered, send, group=group, async_op=True)
    TELEMETRY.record(comm_class, x.numel() * x.element_size(), send.numel())
    out_shape = (world * x.shape[0], *x.shape[1:]) if x.dim() else (world,)

    def finish():
        return codec.decode(gathered, world * x.numel(), x.dtype, rows=world).view(out_shape)

    handle = CollectiveHandle(work, finish)
    return handle if async_op else handle.wait()
