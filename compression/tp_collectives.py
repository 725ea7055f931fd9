"""Compressed tensor-parallel collectives over a torch.distributed group (NCCL or gloo), and the
AUTO policy that picks, per collective, the tensor size from which compression is worth it.

Wire buffers are 1-D uint8 tensors from a row-capable codec (``TacoCodec``: ``encode(x, rows)``
puts row r of the flattened input in bytes ``[r * w, (r + 1) * w)`` with ``w = wire_nbytes(ceil(n /
rows))``), exchanged with ``all_to_all_rows`` (an all-gather of the peer's row between two ranks)
and ``all_gather_into_tensor``. Any tensor size works:
rows are zero-padded inside the codec, never copied here. Each collective is three kernel launches
and two NCCL calls at most, with no host synchronization:

- ``compressed_all_reduce``, two-shot (the paper's): phase 1: encode x as ``world`` rows, all-to-all
  (rank r receives everyone's row r). Middle: ``codec.reduce_encode`` sums the received rows
  (decoded in the rotated domain) and this rank's exact row, and encodes the sum, in one kernel.
  Phase 2: all-gather, decode. Every rank, the row's owner included, returns the decoded values, so
  all ranks end bit-identical.
- ``compressed_all_reduce``, one-shot: encode x, all-gather the wires, ``codec.decode_sum`` (every
  rank's decoded tensor summed in rank order, one kernel). With two ranks it sends exactly the
  two-shot's bytes, with two kernel launches and one NCCL call instead of three and two, and each
  contribution is quantized once (the two-shot re-quantizes the partial sums). With more ranks
  each sends its whole tensor to every other, (world - 1) / 2 times the two-shot's bytes. ``auto``
  (the default) takes one-shot for two ranks, two-shot otherwise.
- ``compressed_reduce_scatter``: along dim 0 like ``reduce_scatter_tensor``; phase 1, then
  ``codec.reduce_decode`` (the received rows decoded and added to the exact own row, one kernel).
- ``compressed_all_gather``: along dim 0 like ``all_gather_into_tensor``; every rank, the source
  included, returns decoded values, so the result is identical on all ranks.

The fused middle steps are optional codec methods (``TacoCodec`` has them); for any other
``TensorCodec`` the rows are decoded, summed in fp32 (the own row exact) and, for the all-reduce,
re-encoded with plain ``encode``/``decode`` (``_sum_rows``).

Results are new tensors (inputs are not modified). With ``async_op=True`` the communication is
started and a handle returned whose ``wait()`` finishes the work (the second phase and the decode)
and returns the result, so callers can overlap the first phase with compute. A group of size 1
(or an empty all-reduce / reduce-scatter input) returns the input unchanged.

AUTO policy: ``measure_min_bytes(codec, group)`` times every collective uncompressed and
compressed at a few sizes on the real group (device time of back-to-back calls by default: in
training the host enqueues ahead of the device, so the host's launch cost is hidden), takes the slowest rank's time (an all-reduce MAX, so
every rank decides the same) and returns per collective the smallest measured size from which
compression is faster at every larger measured size (``crossover``), or None where it never is.

Telemetry (``TELEMETRY.record(comm_class, raw, sent)``): ``sent`` is the size of the compressed
buffers this rank hands to collectives; ``raw`` what it would hand to the same collectives
uncompressed: n * itemsize for reduce-scatter and all-gather inputs. For the all-reduce both phases
of the two-shot count, raw = (n + ceil(n / world)) * itemsize against sent = (world + 1) * w, so
raw / sent is the codec's ratio rather than a figure inflated or deflated by the algorithm; the
one-shot hands its all-gather raw = n * itemsize against sent = wire_nbytes(n).
"""

import statistics

import torch
import torch.distributed as dist

from compression.telemetry import TELEMETRY
from compression.timing import call_seconds, default_device, queued_seconds
from compression.transport import all_to_all_rows

OPS = ("all_reduce", "all_gather", "reduce_scatter")
ALL_REDUCE_ALGORITHMS = ("auto", "one-shot", "two-shot")
PROBE_BYTES = tuple(4**k * 65536 for k in range(7))  # 64 KiB .. 256 MiB


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


def _exchange_rows(x: torch.Tensor, codec, group):
    """Phase 1: encode x as ``world`` rows and all-to-all them; (received row wires, async work). Chunk j
    of the result is rank j's row ``rank``; callers skip their own chunk."""
    send = codec.encode(x, rows=dist.get_world_size(group))
    recv = torch.empty_like(send)
    return recv, all_to_all_rows(recv, send, group=group, async_op=True)


def _sum_rows(codec, x: torch.Tensor, recv: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Unfused middle step: this rank's exact row of ``x`` plus the other decoded rows, fp32 [row_len]."""
    row_len = -(-x.numel() // world)
    parts = codec.decode(recv, world * row_len, torch.float32, rows=world).view(world, row_len)
    own = x.reshape(-1)[rank * row_len:(rank + 1) * row_len]
    parts[rank] = 0
    parts[rank, :own.numel()] = own
    return sum_in_rank_order(parts)


def sum_in_rank_order(parts: torch.Tensor) -> torch.Tensor:
    """``parts[0] + parts[1] + ...`` in this order: the same bits whether one rank sums its rows or an
    emulated group sums every rank's at once (``torch.sum`` may order its additions by shape and device)."""
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total


def _reduce_encode(codec, x, recv, rank, world) -> torch.Tensor:
    if hasattr(codec, "reduce_encode"):
        return codec.reduce_encode(x, recv, rank, world)
    return codec.encode(_sum_rows(codec, x, recv, rank, world))


def _reduce_decode(codec, x, recv, rank, world) -> torch.Tensor:
    if hasattr(codec, "reduce_decode"):
        return codec.reduce_decode(x, recv, rank, world)
    return _sum_rows(codec, x, recv, rank, world).to(x.dtype)


def _decode_sum(codec, wires: torch.Tensor, world: int, numel: int, dtype) -> torch.Tensor:
    if hasattr(codec, "decode_sum"):
        return codec.decode_sum(wires, world, numel, dtype)
    if hasattr(codec, "decode_ranks"):
        parts = codec.decode_ranks(wires, world, numel, torch.float32).view(world, numel)
    else:
        parts = torch.stack([codec.decode(wire, numel, torch.float32) for wire in wires.view(world, -1)])
    return sum_in_rank_order(parts).to(dtype)


def one_shot(world: int, algorithm: str) -> bool:
    if algorithm not in ALL_REDUCE_ALGORITHMS:
        raise ValueError(f"--taco-all-reduce must be one of {'|'.join(ALL_REDUCE_ALGORITHMS)}, got {algorithm!r}")
    return algorithm == "one-shot" or (algorithm == "auto" and world == 2)


def compressed_all_reduce(x: torch.Tensor, codec, group=None, async_op=False, comm_class="tp", algorithm="auto"):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world == 1 or x.numel() == 0:
        return _done(x, async_op)
    n, itemsize = x.numel(), x.element_size()
    if one_shot(world, algorithm):
        send = codec.encode(x)
        gathered = torch.empty(world * send.numel(), dtype=torch.uint8, device=x.device)
        work = dist.all_gather_into_tensor(gathered, send, group=group, async_op=True)
        TELEMETRY.record(comm_class, n * itemsize, send.numel())
        handle = CollectiveHandle(work, lambda: _decode_sum(codec, gathered, world, n, x.dtype).view(x.shape))
        return handle if async_op else handle.wait()
    row_len = -(-n // world)
    row_wire = codec.wire_nbytes(row_len)
    recv, work = _exchange_rows(x, codec, group)
    TELEMETRY.record(comm_class, (n + row_len) * itemsize, (world + 1) * row_wire)

    def finish():
        gathered = torch.empty(world * row_wire, dtype=torch.uint8, device=x.device)
        dist.all_gather_into_tensor(gathered, _reduce_encode(codec, x, recv, rank, world), group=group)
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
    recv, work = _exchange_rows(x, codec, group)
    TELEMETRY.record(comm_class, x.numel() * x.element_size(), recv.numel())

    def finish():
        return _reduce_decode(codec, x, recv, rank, world).view(x.shape[0] // world, *x.shape[1:])

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


# ----------------------------------------------------------------------------------------------
# AUTO policy
# ----------------------------------------------------------------------------------------------


def uncompressed(op: str, x: torch.Tensor, group=None) -> torch.Tensor:
    """The stock collective ``op`` of ``x`` (flattened for all-gather and reduce-scatter)."""
    world = dist.get_world_size(group)
    if op == "all_reduce":
        out = x.clone()
        dist.all_reduce(out, group=group)
    elif op == "all_gather":
        out = x.new_empty(world * x.numel())
        dist.all_gather_into_tensor(out, x.reshape(-1), group=group)
    else:
        out = x.new_empty(x.numel() // world)
        dist.reduce_scatter_tensor(out, x.reshape(-1), group=group)
    return out


def compressed(op: str, x: torch.Tensor, codec, group=None, all_reduce_algorithm="auto") -> torch.Tensor:
    if op == "all_reduce":
        return compressed_all_reduce(x, codec, group=group, comm_class="tp", algorithm=all_reduce_algorithm)
    fn = {"all_gather": compressed_all_gather, "reduce_scatter": compressed_reduce_scatter}[op]
    return fn(x, codec, group=group, comm_class="tp")


def crossover(sizes, plain_ms, compressed_ms, margin=0.0):
    """Smallest of ``sizes`` from which compression is faster at every larger size, by at least the
    fraction ``margin`` of the uncompressed time (a guard against timing noise); None if never."""
    answer = None
    for size, plain, packed in sorted(zip(sizes, plain_ms, compressed_ms), reverse=True):
        if packed >= (1.0 - margin) * plain:
            break
        answer = size
    return answer


TIMINGS = ("queued", "synced")


def _time_ms(fn, device: torch.device, iters: int, timing: str, group) -> float:
    fn()  # warm-up: kernel compilation, communicator set-up
    if timing == "queued":
        return queued_seconds(fn, device, iters, group=group)[0] * 1e3
    return statistics.median(call_seconds(fn, device, iters)) * 1e3


def measure_min_bytes(codec, group=None, sizes=PROBE_BYTES, iters=5, device=None, margin=0.0,
                      timing="queued", all_reduce_algorithm="auto") -> dict:
    """Per collective in OPS, the bf16 input size in bytes from which ``codec`` compression is faster on
    ``group`` (None: never at the measured sizes; ``margin``: see ``crossover``). ``timing``: "queued"
    (default) compares device time per call of back-to-back calls, as in training where the host
    enqueues ahead of the device (``timing.queued_seconds``); "synced" the median of ``iters`` calls
    each bracketed by synchronization, which also charges the host's launch cost. Collective over
    ``group``: every rank must call it, and every rank returns the same answer. Meant for start-up:
    it ends with ``TELEMETRY.reset()`` so that the probes' bytes are not reported."""
    if timing not in TIMINGS:
        raise ValueError(f"timing must be one of {TIMINGS}, got {timing!r}")
    device = device if device is not None else default_device()
    world = dist.get_world_size(group)
    timings = torch.zeros(len(sizes), len(OPS), 2, dtype=torch.float64)
    for i, nbytes in enumerate(sizes):
        numel = max(world, nbytes // 2 // world * world)  # reduce-scatter needs world | numel
        x = (torch.randn(numel, generator=torch.Generator().manual_seed(i)) * 0.02).to(device, torch.bfloat16)
        for j, op in enumerate(OPS):
            timings[i, j, 0] = _time_ms(lambda: uncompressed(op, x, group), device, iters, timing, group)
            timings[i, j, 1] = _time_ms(lambda: compressed(op, x, codec, group, all_reduce_algorithm), device,
                                        iters, timing, group)
    TELEMETRY.reset()
    slowest = timings.to(device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    slowest = slowest.cpu()
    return {op: crossover(sizes, slowest[:, j, 0].tolist(), slowest[:, j, 1].tolist(), margin)
            for j, op in enumerate(OPS)}


# ----------------------------------------------------------------------------------------------
# Emulation: a group's collectives computed in one process
# ----------------------------------------------------------------------------------------------
# What each collective above returns when rank j of a group of ``len(parts)`` ranks contributes
# ``parts[j]``, computed in one process by the same codec calls in the same order: every rank's encode,
# each row owner's middle step (its own row exact, the others decoded) and the final decode. The
# results are bit-identical to the real collective's on every rank (``tests/test_tp_collectives.py``),
# so a TP=1 run can study the numerics of a TP=N run (``megatron/hooks/tp_emulation.py``).
# Telemetry records what one rank of the real group would hand to its collectives.


def _batched(codec, numel: int, rows: int) -> bool:
    """One codec call can code every rank's ``rows`` rows: the codec codes a group's tensors at once
    (``encode_ranks``) and each rank's tensor cuts into whole rows, so the ranks' rows lie back to back."""
    return hasattr(codec, "encode_ranks") and numel % rows == 0


def _stacked(parts) -> torch.Tensor:
    return parts if isinstance(parts, torch.Tensor) else torch.stack(list(parts))


def _rank_wires(parts, codec, rows: int) -> torch.Tensor:
    """Every rank's ``encode(part, rows)``, stacked: [world, rows, row wire bytes]."""
    world = len(parts)
    if _batched(codec, parts[0].numel(), rows):
        return codec.encode_ranks(_stacked(parts), rows).view(world, rows, -1)
    return torch.stack([codec.encode(part, rows=rows) for part in parts]).view(world, rows, -1)


def _own_rows(parts, world: int) -> torch.Tensor:
    """[world, row_len]: row r of rank r's part at r (what rank r adds exactly)."""
    rows = _stacked(parts).reshape(world, world, -1)
    ranks = torch.arange(world, device=rows.device)
    return rows[ranks, ranks]


def _summed_rows(codec, parts, wires: torch.Tensor) -> torch.Tensor:
    """Every row owner's ``_sum_rows`` at once, for codecs that decode a group's wires in one call
    (``decode_ranks``): fp32 [world, row_len], row r = rank r's own row r plus the other ranks' decoded rows r."""
    world = len(parts)
    row_len = parts[0].numel() // world
    decoded = codec.decode_ranks(wires.reshape(-1), world, world * row_len, torch.float32, rows=world)
    decoded = decoded.view(world, world, row_len)  # [source rank, row, values]
    ranks = torch.arange(world, device=decoded.device)
    decoded[ranks, ranks] = _own_rows(parts, world).float()
    return sum_in_rank_order(decoded)


def emulated_all_reduce(parts, codec, comm_class="tp", algorithm="auto") -> torch.Tensor:
    """``compressed_all_reduce`` of a group whose rank j holds ``parts[j]`` (a sequence of equal shapes, or
    one tensor [world, ...]): the tensor every rank returns."""
    world, x = len(parts), parts[0]
    if world == 1 or x.numel() == 0:
        return x
    n, itemsize = x.numel(), x.element_size()
    if one_shot(world, algorithm):
        wires = _rank_wires(parts, codec, 1).view(-1)
        TELEMETRY.record(comm_class, n * itemsize, wires.numel() // world)
        return _decode_sum(codec, wires, world, n, x.dtype).view(x.shape)
    row_len = -(-n // world)
    row_wire = codec.wire_nbytes(row_len)
    wires = _rank_wires(parts, codec, world)
    TELEMETRY.record(comm_class, (n + row_len) * itemsize, (world + 1) * row_wire)
    # rank r receives row r of every rank (chunk j from rank j), reduces and re-encodes it
    if _batched(codec, n, world) and hasattr(codec, "reduce_encode_rows"):
        reduced = codec.reduce_encode_rows(_own_rows(parts, world), wires)
    elif _batched(codec, n, world) and hasattr(codec, "decode_ranks"):
        reduced = codec.encode_ranks(_summed_rows(codec, parts, wires), 1)
    else:
        reduced = torch.cat([_reduce_encode(codec, parts[r], wires[:, r].reshape(-1), r, world)
                             for r in range(world)])
    return codec.decode(reduced, n, x.dtype, rows=world).view(x.shape)


def emulated_reduce_scatter(parts, codec, comm_class="tp") -> torch.Tensor:
    """``compressed_reduce_scatter`` of a group whose rank j holds ``parts[j]`` (as ``emulated_all_reduce``):
    every rank's result concatenated along dim 0 in rank order (the shape of one part)."""
    world, x = len(parts), parts[0]
    if x.dim() == 0 or x.shape[0] % world:
        raise ValueError(f"emulated_reduce_scatter needs dim 0 divisible by the group size {world}, "
                         f"got shape {tuple(x.shape)}")
    if world == 1 or x.numel() == 0:
        return x
    wires = _rank_wires(parts, codec, world)
    TELEMETRY.record(comm_class, x.numel() * x.element_size(), wires[0].numel())
    if _batched(codec, x.numel(), world) and hasattr(codec, "reduce_decode_rows"):
        return codec.reduce_decode_rows(_own_rows(parts, world), wires).view(x.shape)
    if _batched(codec, x.numel(), world) and hasattr(codec, "decode_ranks"):
        return _summed_rows(codec, parts, wires).to(x.dtype).view(x.shape)
    shard_shape = (x.shape[0] // world, *x.shape[1:])
    return torch.cat([_reduce_decode(codec, parts[r], wires[:, r].reshape(-1), r, world).view(shard_shape)
                      for r in range(world)])


def emulated_all_gather(shards, codec, comm_class="tp") -> torch.Tensor:
    """``compressed_all_gather`` of a group whose rank j holds ``shards[j]`` (as ``emulated_all_reduce``): the
    tensor every rank returns, the shards' decoded values concatenated along dim 0."""
    world, x = len(shards), shards[0]
    if world == 1:
        return x
    if x.numel() == 0:
        return x.new_empty((world * x.shape[0], *x.shape[1:]))
    wires = _rank_wires(shards, codec, 1).view(-1)
    TELEMETRY.record(comm_class, x.numel() * x.element_size(), wires.numel() // world)
    out_shape = (world * x.shape[0], *x.shape[1:]) if x.dim() else (world,)
    return codec.decode(wires, world * x.numel(), x.dtype, rows=world).view(out_shape)
