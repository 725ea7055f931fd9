"""All-gather of one bucket's parameter shards through a ShardCodec (variable-size payloads).

The bucket is a 1-D buffer split evenly over the group: rank r owns ``buffer[r*n:(r+1)*n]``. Before a
gather, the own slice holds this rank's NEW values and every other slice holds that rank's PREVIOUS
values (from the last gather); afterwards every slice holds the new values on every rank.

Wire scheme: (1) all_gather of a small message per rank: its payload size and the payload's fixed
header (``codec.header_nbytes``); (2) all_gather_into_tensor of the payloads zero-padded to the largest
size. Padding costs the imbalance between ranks but keeps one NCCL/gloo collective of equal-size chunks
(variable-size all-gather is not a single NCCL call; a send/recv ring would cost W-1 latencies). The
host must see the sizes, so ``start`` synchronises with the device once (``prepare_gathers`` once for
several buckets: their encodes are queued first, their messages exchanged together, and each bucket's
``transfer`` later needs no sync); a codec whose ``begin_encode``
leaves its payload size on the device (delta on GPUs) needs no sync of its own before that, and writes
its payload straight into the send buffer (``finish_encode``). The headers ride along so that no
decode reads its own header back from the device, and the decodes' kernels are queued while the
payload gather runs. ``GatherFusions`` codes several buckets of one storage as one shard (``Segments``):
one encode, one payload and collective, one decode per rank for all of them, whatever their number.

Sync-free gathers (``capacity_factor``, delta's ``--delta-capacity-factor``): once a gather's sizes are known,
the next one sends each rank's payload in a slot of ``capacity`` bytes (the largest last payload times the
factor), behind its size: no size exchange and no host sync before the transfer, so the host queues encode,
transfer and decode back to back. Each decoder skips a payload that outgrew its slot, and the host reads the
sizes once the decodes are queued (the gather's one sync, at its end); if any payload did not fit, every rank
gathers the bucket uncompressed on top (lossless: every own slice holds its new values), and the next slots
are sized from the sizes just read. Only encodes the codec calls ``sync_free`` (delta: not keyframes) go this way.
With ``cuda_graphs`` (``--delta-cuda-graphs``) a sync-free gather's whole device work (encode, slot, all-gather,
decode, the sizes' copy to the host) is captured once its inputs and capacity have been gathered ``GRAPH_WARMUP``
times eagerly, and replayed from then on (on a side stream, so that it overlaps as an async collective does): the
host then launches one graph instead of ~0.6 ms of Python and kernel launches. Its encode then starts at the
transfer rather than with the other buckets' in ``prepare_gathers``.

Integrity check (``integrity``, an ``IntegrityCheck``; codecs with an ``integrity`` hash: delta): each rank's size
message is its payload size, the 64-bit hash of what its encode coded, then the payload's header; a slot is the
payload's size, that hash, then the payload. After the decodes each receiver compares the hash of what it decoded
from each source with that source's, and the group agrees on the count of mismatches (an all-reduce, read at the
gather's one sync, or at a sync of its own after the size exchange); a gather with any is followed by the bucket's
uncompressed gather, as after a slot overflow, so every replica ends with the sent values; it is counted
(``integrity_mismatches``: mismatching payloads, on the ranks that decoded them), logged, and the
``max_mismatches``-th such gather stops with an error (docs/integrity.md).

Telemetry (class ``comm_class``): raw = this rank's shard bytes; sent = its padded payload plus the
size message (or its slot, plus the raw shard after an overflow), i.e. what it hands to the collectives. A
codec may declare extra integer stats with ``stat_names`` (a tuple) and fill ``last_stats`` (dict name -> int)
on every encode; they are declared at construction and added as counters ``<comm_class>/<name>``. Sync-free
gathers count ``slot_gathers`` and ``slot_overflows``, captured ones ``graph_captures``.
"""

import logging
import math
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
import torch.distributed as dist

from compression.codec import CastShard, EncodeStart, HostValues, Segments, ShardCodec, shard_of
from compression.collective_graphs import capturing, track_graphs
from compression.telemetry import TELEMETRY

logger = logging.getLogger(__name__)
SIZE_BYTES = 8
HASH_BYTES = 8  # the integrity hash of an encode (int64, 0 for a codec without one), after the size
ALIGN = 16  # payloads start 16-byte aligned in the gathered buffer: the decoders' vector loads stay aligned
SLOT_PREFIX = 16  # a slot: the payload's size (int64), its integrity hash (int64), then the payload (16-byte aligned)
SLOT_COUNTERS = ("slot_gathers", "slot_overflows")
SLOT_ROUND = 4096  # slot capacities are multiples of it
SLOT_SHRINK = 1.25  # a slot is resized down only once it exceeds the payloads' size x factor by this much
GRAPH_WARMUP = 2  # eager sync-free gathers of one input and capacity before their work is captured (cuda_graphs)


def next_capacity(capacity, largest: int, factor: float) -> int:
    """The slot capacity after a gather whose largest payload was ``largest`` bytes: ``factor`` times it (rounded up to
    ``SLOT_ROUND``), kept while it stays between ``factor`` and ``factor * SLOT_SHRINK`` times ``largest``, so that
    small changes of the payload keep the slots (and a captured gather) as they are, and a payload that grows by less
    than ``factor`` per gather never outgrows its slot (resizing only on an overflow let GPT-125M's
    payloads, growing 1-5% per step in the lr warm-up, overflow every few steps)."""
    if capacity is None or largest * factor > capacity or largest * factor * SLOT_SHRINK < capacity:
        return _round_up(math.ceil(largest * factor), SLOT_ROUND)
    return capacity


def check_capacity_factor(factor: float) -> None:
    if factor and not factor >= 1.0:
        raise ValueError(f"--delta-capacity-factor must be 0 (exchange payload sizes first) or >= 1.0 (slots of "
                         f"that many times the last payloads), got {factor}")


@dataclass
class IntegrityCheck:
    """What the gathers of one run do on an integrity mismatch (``ShardGather``'s docstring), shared by all of them:
    each gather with one is re-gathered uncompressed, and the ``max_mismatches``-th stops the run. ``iteration``
    names the training iteration in the logs."""

    max_mismatches: int = 3
    iteration: Callable[[], Any] = lambda: None
    mismatches: int = 0  # gathers with a mismatch so far (every rank of a group counts the same ones)

    def __post_init__(self):
        if self.max_mismatches < 1:
            raise ValueError(f"--param-gather-integrity-max-mismatches must be >= 1, got {self.max_mismatches}")

    def failed(self, what: str) -> None:
        """A gather had a mismatch (``what``: which, already re-gathered): stop at the ``max_mismatches``-th."""
        self.mismatches += 1
        if self.mismatches >= self.max_mismatches:
            raise RuntimeError(
                f"{what}: {self.mismatches} parameter gathers decoded values other than their senders' "
                f"(--param-gather-integrity-max-mismatches {self.max_mismatches}); the parameters were re-gathered "
                f"uncompressed each time, but this many point at failing hardware (memory, link) or a codec bug: "
                f"check the devices, or train with --param-gather-compression none")


class PendingGather:
    """Handle of an asynchronous gather: ``wait()`` finishes the collective (``work``: its handle, or True for
    one ``finish`` waits for itself), then decodes."""

    def __init__(self, work, finish):
        self._work, self._finish = work, finish

    def wait(self) -> None:
        if self._work is not None:
            if self._work is not True:
                self._work.wait()
            self._work = None
            self._finish()


class _Slots:
    """A sync-free gather's buffers: this rank's send slot of ``width`` bytes, the receive buffer (every rank's slot,
    then the decoders' read slack), the sizes' view in it and their ``HostValues`` (made by the first gather)."""

    def __init__(self, width: int, world_size: int, read_slack: int, device):
        self.width = width
        self.send = torch.zeros(width, dtype=torch.uint8, device=device)
        self.recv = torch.zeros(width * world_size + read_slack, dtype=torch.uint8, device=device)
        self.rows = self.recv[:width * world_size]
        prefixes = self.rows.view(world_size, width)[:, :SLOT_PREFIX].view(torch.int64)
        self.sizes, self.hashes = prefixes[:, 0], prefixes[:, 1]
        # what the gather's sync reads: the sizes, then the group's count of integrity mismatches
        self.status = torch.zeros(world_size + 1, dtype=torch.int64, device=device)
        self.mismatched = None  # bool [world_size]: the sources whose decoded hash differed (integrity only)
        self.landed = None


@dataclass
class _SlotGraph:
    """A captured sync-free gather (``ShardGather`` with ``cuda_graphs``): what its replays need."""

    key: tuple  # (capacity, _input_key)
    graph: "torch.cuda.CUDAGraph"
    start: EncodeStart  # the captured encode's (its totals are refreshed by every replay)
    slots: _Slots  # its buffers; their sizes' HostValues are refreshed by every replay


def _input_key(x, buffer) -> tuple:
    """What a captured gather reads and writes, by address: the encode's input (a shard, a ``CastShard`` and its
    fp32 sources, a ``SegmentedShard``) and the target buffer(s)."""
    if isinstance(x, CastShard):
        sources = x.source if isinstance(x.source, tuple) else (x.source,)
        return ("cast", _input_key(x.target, buffer)) + tuple((s.data_ptr(), s.numel()) for s in sources)
    parts = x.parts if hasattr(x, "parts") else [x]
    buffers = buffer.buffers if isinstance(buffer, Segments) else (buffer,)
    return (tuple((p.data_ptr(), p.numel(), p.dtype) for p in parts),
            tuple((b.data_ptr(), b.numel()) for b in buffers))


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class ShardGather:
    def __init__(self, codec: ShardCodec, group=None, comm_class: str = "dp_param_gather",
                 capacity_factor: float = 0.0, cuda_graphs: bool = False, integrity: IntegrityCheck = None,
                 name: str = "bucket"):
        check_capacity_factor(capacity_factor)
        # the integrity check, where the codec hashes (docstring); ``name`` says which bucket(s) in its logs
        self.integrity = integrity if getattr(codec, "integrity", False) else None
        self.name = name
        if cuda_graphs and not capacity_factor:
            raise ValueError("--delta-cuda-graphs captures sync-free gathers: add --delta-capacity-factor (e.g. 1.25)")
        self.codec = codec
        self.cuda_graphs = cuda_graphs
        if cuda_graphs:
            track_graphs(self)
        self._graph = None  # the _SlotGraph of the current input and capacity
        # the CUDAGraph that one replaced (a new capacity), never replayed again: kept until the next capture has taken
        # its memory pool, so that re-captures reuse one pool's memory (a pool per capture would leave the old ones'
        # memory cached until the allocator runs short)
        self._retired = None
        # every capture's (and so replay's) stream: the allocator reuses a freed block on its own stream only, so a
        # re-capture on another stream could not reuse the pool's memory
        self._graph_stream = None
        self._graph_calls = (None, 0)  # (key, eager sync-free gathers of it) before a capture
        self.graph_replays = 0
        self.group = group
        self.comm_class = comm_class
        self.capacity_factor = capacity_factor
        self.capacity = None  # payload bytes of the next sync-free gather's slots (None: exchange the sizes)
        self._slots = None  # the _Slots of the current capacity
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._message_nbytes = SIZE_BYTES + HASH_BYTES + _round_up(codec.header_nbytes, SIZE_BYTES)
        self._stat_names = tuple(getattr(codec, "stat_names", ()))
        self._message = None  # the size exchange's send buffer (of prepare_gathers calls led by this gather)
        self.cast_from = None  # fp32 values of the next encode, rounded into the own slice by the codec (CastShard)
        for name in self._stat_names:
            TELEMETRY.declare_counter(f"{comm_class}/{name}")
        if capacity_factor:  # gathers sent in slots, and those of them after which a payload was sent again
            for name in SLOT_COUNTERS:
                TELEMETRY.declare_counter(f"{comm_class}/{name}")
        if cuda_graphs:  # each costs a synchronization and the capture (~1-2 ms): a new slot capacity means a new one
            TELEMETRY.declare_counter(f"{comm_class}/graph_captures")
        if self.integrity is not None:
            TELEMETRY.declare_counter(f"{comm_class}/integrity_mismatches")

    def _own_slice(self, buffer, rank: int):
        return shard_of(buffer, rank, self.world_size)

    def _check(self, buffer) -> None:
        if isinstance(buffer, Segments):
            return  # checked at construction
        if buffer.dim() != 1 or buffer.numel() % self.world_size:
            raise ValueError(f"ShardGather needs a 1-D bucket whose numel is divisible by the group size "
                             f"{self.world_size}, got shape {tuple(buffer.shape)}")

    def reset(self) -> None:
        """The next gather is a keyframe (call on every rank together)."""
        self.codec.reset()
        self.capacity = None
        self.release_graphs()

    def release_graphs(self) -> None:
        """Free the captured gather, if any (the next sync-free gathers run eagerly until captured again)."""
        graphs = [g for g in (self._graph and self._graph.graph, self._retired) if g is not None]
        if graphs:
            torch.cuda.synchronize()
            for graph in graphs:
                graph.reset()
        self._graph, self._retired, self._graph_calls = None, None, (None, 0)

    def _resize_slots(self, sizes: list, sync_free: bool) -> None:
        """After a gather whose payload ``sizes`` every rank read: the next gather's slot capacity (every rank
        computes the same), or None after a keyframe (its size says nothing of the next payloads)."""
        if not self.capacity_factor or not sync_free:
            self.capacity = None
            return
        self.capacity = next_capacity(self.capacity, max(sizes), self.capacity_factor)

    def observe(self, buffer: torch.Tensor) -> None:
        """This rank's slice of ``buffer`` went out uncompressed: code the next gather against it."""
        self.codec.observe(self._own_slice(buffer, self.rank))

    def _encode_input(self, buffer):
        """What the next encode codes: the own slice of ``buffer``, or a ``CastShard`` of it with ``cast_from``."""
        shard, source = self._own_slice(buffer, self.rank), self.cast_from
        self.cast_from = None
        return shard if source is None else CastShard(shard, source)

    def _write_message(self, start, message: torch.Tensor) -> None:
        """This rank's size message for one encode: its payload size, its integrity hash, then its header."""
        if isinstance(start.nbytes, int):
            message[:SIZE_BYTES].view(torch.int64).fill_(start.nbytes)
        else:
            message[:SIZE_BYTES].view(torch.int64).copy_(start.nbytes.reshape(1))
        self._write_hash(start, message[SIZE_BYTES:SIZE_BYTES + HASH_BYTES])
        at = SIZE_BYTES + HASH_BYTES
        message[at:at + start.header.numel()] = start.header

    def _write_hash(self, start, field: torch.Tensor) -> None:
        """The encode's integrity hash into the 8-byte ``field`` (0 without the check)."""
        if self.integrity is not None and start.hash is not None:
            field.view(torch.int64).copy_(start.hash)
        else:
            field.zero_()

    def _read_messages(self, rows) -> tuple:
        """Every rank's payload size, integrity hash and first ``codec.header_nbytes`` bytes from the gathered
        messages (a numpy array of one row per rank)."""
        def field(row, at):
            return int.from_bytes(row[at:at + SIZE_BYTES].tobytes(), "little", signed=True)

        sizes = [field(row, 0) for row in rows]
        hashes = [field(row, SIZE_BYTES) for row in rows]
        n, at = self.codec.header_nbytes, SIZE_BYTES + HASH_BYTES
        return sizes, [row[at:at + min(n, size)].tobytes() for row, size in zip(rows, sizes)], hashes

    def _record(self, shard: torch.Tensor, sent_bytes: int) -> None:
        TELEMETRY.record(self.comm_class, shard.numel() * shard.element_size(), sent_bytes)
        stats = getattr(self.codec, "last_stats", {})
        for name in self._stat_names:
            TELEMETRY.add_counter(f"{self.comm_class}/{name}", stats.get(name, 0))

    def start(self, buffer: torch.Tensor, async_op: bool = False):
        """Gather ``buffer`` in place; returns a handle with ``wait()`` if ``async_op``, else None."""
        return self.transfer(buffer, prepare_gathers([self], [buffer])[0], async_op)

    def transfer(self, buffer, prepared: "PreparedGather", async_op: bool = False):
        """Finish a prepared encode into the send buffer, all-gather the padded payloads and decode them (at
        ``wait()`` if ``async_op``): no host sync. ``buffer`` must be the one ``prepare_gathers`` encoded. A
        bucket fused with others goes with the first of them to be transferred (the handle is shared)."""
        if prepared.fused is not None:
            return prepared.fused.run(async_op)
        if prepared.capacity is not None:
            return self._transfer_slots(buffer, prepared, async_op)
        shard = self._own_slice(buffer, self.rank)
        sizes, headers = prepared.sizes, prepared.headers
        width, size = _round_up(max(sizes), ALIGN), sizes[self.rank]
        send = torch.empty(width, dtype=torch.uint8, device=buffer.device)
        self.codec.finish_encode(prepared.start, send[:size])
        send[size:] = 0  # the padding (receivers ignore it) is not left uninitialized
        recv = torch.empty(width * self.world_size + self.codec.read_slack_bytes, dtype=torch.uint8,
                           device=buffer.device)[:width * self.world_size]
        self._record(shard, width + self._message_nbytes)
        work = dist.all_gather_into_tensor(recv, send, group=self.group, async_op=async_op)

        def finish():  # a lossless codec's own slice already holds what it sent
            self.codec.decode_gathered(buffer, recv, width, sizes, headers, self.rank if self.codec.lossless else -1)
            if self.integrity is not None:
                sent = torch.tensor(prepared.hashes, dtype=torch.int64).to(buffer.device, non_blocking=True)
                mismatched, count = self._mismatches(sent)
                count = int(count.item())  # the check's sync
                if count:
                    self._integrity_failed(buffer, mismatched, count)

        if async_op:
            return PendingGather(work, finish)
        finish()
        return None

    def _transfer_slots(self, buffer, prepared: "PreparedGather", async_op: bool):
        """``transfer`` of a sync-free gather: the payload (and its size) into this rank's slot, the slots
        all-gathered, every payload that fit decoded; then the one sync, reading the sizes (module docstring)."""
        if prepared.start is None:  # cuda_graphs: the encode was left to here
            return self._transfer_graphed(buffer, prepared, async_op)
        capacity = prepared.capacity
        slots = self._slots_of(capacity, buffer.device)
        work = self._send_slot(prepared.start, slots, capacity, async_op)

        def finish():
            self._decode_slots(buffer, slots, capacity)
            if slots.landed is None:
                slots.landed = HostValues(slots.status)
            else:
                slots.landed.update(slots.status)
            self._slots_landed(buffer, prepared.start, slots, slots.landed.get(), capacity)

        if async_op:
            return PendingGather(work, finish)
        finish()
        return None

    def _transfer_graphed(self, buffer, prepared: "PreparedGather", async_op: bool):
        """A sync-free gather with ``cuda_graphs``: eager for the first ``GRAPH_WARMUP`` gathers of its input and
        capacity (Triton compiles, NCCL sets up, the codec's tables and buffers are made), captured on the next,
        replayed from then on."""
        x, capacity = prepared.encode_input, prepared.capacity
        key = (capacity, _input_key(x, buffer))
        if self._graph is not None and self._graph.key != key:
            # never replayed again (the eager gathers below may replace the slot buffers it replays into)
            self._retired, self._graph = self._graph.graph, None
        if self._graph is None:
            calls = self._graph_calls[1] + 1 if self._graph_calls[0] == key else 1
            self._graph_calls = (key, calls)
            if calls <= GRAPH_WARMUP:
                start = self.codec.begin_encode(x)
                if not self.codec.sync_free(start):
                    raise RuntimeError(f"{type(self.codec).__name__}.sync_free_input promised a sync-free encode")
                return self._transfer_slots(buffer, replace(prepared, start=start), async_op)
            self._capture(key, buffer, x, capacity)
        graph = self._graph
        stream = self._graph_stream  # after the current stream's work
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            graph.graph.replay()
        self.graph_replays += 1
        done = torch.cuda.Event()
        done.record(stream)

        def finish():
            torch.cuda.current_stream().wait_event(done)
            done.synchronize()
            self._slots_landed(buffer, graph.start, graph.slots, graph.slots.landed.get(synced=True), capacity,
                               synced=True)

        if async_op:
            return PendingGather(True, finish)
        finish()
        return None

    def _capture(self, key, buffer, x, capacity: int) -> None:
        if x.device.type != "cuda":
            raise ValueError("--delta-cuda-graphs replays CUDA graphs and needs GPUs: drop the flag on CPU")
        if dist.get_backend(self.group) != "nccl":
            raise ValueError(f"--delta-cuda-graphs captures the all-gather and needs the NCCL backend, got "
                             f"{dist.get_backend(self.group)}: drop the flag")
        slots = self._slots_of(capacity, buffer.device)
        if slots.landed is None:  # pinned memory is made outside the capture
            slots.landed = HostValues(slots.status)
        if self._graph_stream is None or self._graph_stream.device != buffer.device:
            self._graph_stream = torch.cuda.Stream(buffer.device)
        graph, stream = torch.cuda.CUDAGraph(), self._graph_stream
        TELEMETRY.add_counter(f"{self.comm_class}/graph_captures", 1)
        pool = self._retired.pool() if self._retired is not None else None  # its memory is free for this capture
        with capturing(graph, pool, stream):
            start = self.codec.begin_encode(x)
            self._send_slot(start, slots, capacity, async_op=False)
            self._decode_slots(buffer, slots, capacity)
            slots.landed.update(slots.status)
        if self._retired is not None:  # the new graph holds the pool now
            self._retired.reset()
            self._retired = None
        self._graph = _SlotGraph(key, graph, start, slots)
        if self.rank == 0:
            logger.info("%s: sync-free gather of %d-byte slots captured as a CUDA graph", self.comm_class, capacity)

    def _slots_of(self, capacity: int, device) -> "_Slots":
        """The buffers of slots of ``capacity`` bytes, kept while the capacity stays (a gather's decodes and its
        sync end before the next one writes them)."""
        width = SLOT_PREFIX + _round_up(capacity, ALIGN)
        if self._slots is None or self._slots.width != width or self._slots.send.device != device:
            self._slots = _Slots(width, self.world_size, self.codec.read_slack_bytes, device)
        return self._slots

    def _send_slot(self, start: EncodeStart, slots: "_Slots", capacity: int, async_op: bool):
        """This rank's payload, size and integrity hash into its slot, then the all-gather of every rank's."""
        self.codec.finish_encode_into_slot(start, slots.send[SLOT_PREFIX:SLOT_PREFIX + capacity],
                                           slots.send[:SIZE_BYTES].view(torch.int64))
        self._write_hash(start, slots.send[SIZE_BYTES:SIZE_BYTES + HASH_BYTES])
        return dist.all_gather_into_tensor(slots.rows, slots.send, group=self.group, async_op=async_op)

    def _decode_slots(self, buffer, slots: "_Slots", capacity: int) -> None:
        """Decode the slots that fit; ``slots.status``: the sizes, then the group's count of integrity mismatches
        (device work only: a captured gather replays it)."""
        self.codec.decode_slots(buffer, slots.recv[SLOT_PREFIX:], slots.width, slots.sizes, capacity,
                                self.rank if self.codec.lossless else -1)
        slots.status[:self.world_size].copy_(slots.sizes)
        if self.integrity is not None:
            slots.mismatched, count = self._mismatches(slots.hashes, slots.sizes, capacity)
            slots.status[self.world_size:].copy_(count)

    def _mismatches(self, sent: torch.Tensor, sizes: torch.Tensor = None, capacity: int = 0) -> tuple:
        """After the decodes: the sources (bool [world size], on the device) whose decoded integrity hash differs from
        their ``sent`` one (with ``sizes``: of those that fit ``capacity``, the ones decoded), and the group's count of
        such payloads (int64 [1], all-reduced)."""
        mismatched, count = self.codec.mismatched_sources(sent, self.rank, sizes, capacity)
        dist.all_reduce(count, group=self.group)
        return mismatched, count

    def _integrity_failed(self, buffer, mismatched: torch.Tensor, count: int) -> None:
        """A gather whose decodes differed from what was sent somewhere in the group (``count`` payloads): gathered
        uncompressed (its bytes counted as sent), counted, logged; the policy may stop the run."""
        sources = mismatched.nonzero().view(-1).tolist()
        TELEMETRY.add_counter(f"{self.comm_class}/integrity_mismatches", len(sources))
        iteration = self.integrity.iteration()
        what = (f"{self.comm_class} {self.name}" + (f" at iteration {iteration}" if iteration is not None else "")
                + f" (gather {self.integrity.mismatches + 1} with a mismatch)")
        if sources:
            logger.warning("%s: rank %d decoded payload(s) of rank(s) %s to values other than their senders' "
                           "(integrity hash mismatch): gathering the bucket uncompressed", what, self.rank, sources)
        elif self.rank == 0:
            logger.warning("%s: %d payload(s) decoded elsewhere in the group to values other than their senders' "
                           "(integrity hash mismatch): gathering the bucket uncompressed", what, count)
        TELEMETRY.record(self.comm_class, 0, self._gather_uncompressed(buffer))
        self.integrity.failed(what)

    def _gather_uncompressed(self, buffer) -> int:
        """Every rank's own slice of ``buffer`` (which holds its new values) all-gathered as is; the bytes sent."""
        sent = 0
        for part in (buffer.buffers if isinstance(buffer, Segments) else (buffer,)):
            own = shard_of(part, self.rank, self.world_size)
            dist.all_gather_into_tensor(part, own.clone(), group=self.group)
            sent += own.numel() * own.element_size()
        return sent

    def _slots_landed(self, buffer, start: EncodeStart, slots: "_Slots", status: list, capacity: int,
                      synced: bool = False) -> None:
        """The end of a sync-free gather, its ``slots.status`` on the host: payloads that did not fit are sent again,
        every rank's shard uncompressed, and so are those whose decodes mismatched (integrity); telemetry; the next
        capacity."""
        shard = self._own_slice(buffer, self.rank)
        self.codec.encode_stats(start, synced)
        sent = slots.width
        sizes, mismatches = status[:self.world_size], status[self.world_size]
        outgrown = [rank for rank, size in enumerate(sizes) if size > capacity]
        if mismatches:
            self._integrity_failed(buffer, slots.mismatched, mismatches)
        elif outgrown:
            if self.rank == 0:
                logger.info("%s: payloads of ranks %s (%d bytes) outgrew their %d-byte slots: gathered uncompressed",
                            self.comm_class, outgrown, max(sizes), capacity)
            sent += self._gather_uncompressed(buffer)
        self._record(shard, sent)
        TELEMETRY.add_counter(f"{self.comm_class}/slot_gathers", 1)
        TELEMETRY.add_counter(f"{self.comm_class}/slot_overflows", int(bool(outgrown)))
        self._resize_slots(sizes, True)

    def verify(self, buffer: torch.Tensor) -> None:
        """Uncompressed all-gather of every rank's own slice, compared bit for bit with ``buffer``;
        raises RuntimeError naming the first differing rank and index."""
        self._check(buffer)
        shard = self._own_slice(buffer, self.rank).contiguous()
        reference = torch.empty_like(buffer)
        dist.all_gather_into_tensor(reference, shard, group=self.group)
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[buffer.element_size()]
        got, want = buffer.view(bits), reference.view(bits)
        bad = (got != want).nonzero()
        if bad.numel():
            index = int(bad[0])
            n = buffer.numel() // self.world_size
            raise RuntimeError(f"{self.comm_class} verify: bucket differs from an uncompressed gather at "
                               f"rank {index // n} slice index {index % n} (bucket index {index}): "
                               f"bits {int(got[index]):#x}, expected {int(want[index]):#x}")


@dataclass
class PreparedGather:
    """An encode whose payload sizes every rank knows: what ``ShardGather.transfer`` needs."""

    start: EncodeStart
    sizes: list  # payload bytes of each rank
    headers: list  # the first ``codec.header_nbytes`` bytes of each rank's payload
    hashes: list = None  # each rank's integrity hash (int64; 0 where none was sent)
    fused: "_FusedTransfer" = None  # set for a bucket coded with others (``start`` etc. are the fused encode's)
    capacity: int = None  # set for a sync-free gather (slots of that many bytes; ``sizes`` and ``headers`` None)
    encode_input: object = None  # of a sync-free gather whose encode is left to its transfer (``start`` None)


class _FusedTransfer:
    """The one transfer of several fused buckets: started by the first of them, shared by the rest."""

    def __init__(self, gather: ShardGather, segments: Segments, prepared: PreparedGather):
        self.gather, self.segments, self.prepared = gather, segments, prepared
        self.started, self.handle = False, None

    def run(self, async_op: bool):
        if not self.started:
            self.started = True
            self.handle = self.gather.transfer(self.segments, self.prepared, async_op)
        if async_op:
            return self.handle
        if self.handle is not None:  # a later bucket asks synchronously (e.g. a flush): decoded now
            self.handle.wait()
        return None


class GatherFusions:
    """Which buckets are coded as one (codecs whose ``can_fuse`` says so: delta), kept across rounds: the
    buckets of one process group, storage, dtype and telemetry class whose codecs hold their state (no keyframe
    due) become one ``ShardGather`` over ``Segments``. Every compressed bucket alone costs the host ~1.4 ms of
    launches per gather (delta on an H200), a fused set about that once. A set
    whose member was reset or switched is replaced (its members code alone until they hold state again)."""

    def __init__(self):
        self._fused = {}  # tuple of member ShardGathers -> (fused ShardGather, Segments)

    @property
    def sets(self) -> list:
        """The number of buckets in each fused set kept."""
        return [len(key) for key in self._fused]

    def drop(self, gather: ShardGather) -> None:
        """Forget the fused set ``gather`` belongs to (it is being replaced): its state goes with it."""
        for key in [k for k in self._fused if gather in k]:
            self._fused.pop(key)[0].release_graphs()

    def plan(self, gathers: list, buffers: list, alone=()) -> list:
        """``gathers``/``buffers`` split into units: (gather, buffer, member indices) with one gather per unit,
        a fused one (buffer: its Segments) for two or more members, else the bucket's own (always for the
        gathers in ``alone``)."""
        sets = {}
        for i, (g, buffer) in enumerate(zip(gathers, buffers)):
            if g not in alone and g.codec.can_fuse(buffer.numel() // g.world_size):
                key = (buffer.untyped_storage().data_ptr(), buffer.dtype, buffer.device, g.comm_class,
                       g.cast_from is not None)
                sets.setdefault(key, []).append(i)
        fused_indices = {i for members in sets.values() if len(members) > 1 for i in members}
        units = [(g, b, [i]) for i, (g, b) in enumerate(zip(gathers, buffers)) if i not in fused_indices]
        for members in sets.values():
            if len(members) > 1:
                gather, segments = self._get([gathers[i] for i in members], [buffers[i] for i in members])
                if gathers[members[0]].cast_from is not None:  # CastShard members: one source per segment
                    gather.cast_from = tuple(gathers[i].cast_from for i in members)
                    for i in members:
                        gathers[i].cast_from = None
                units.append((gather, segments, members))
        return units

    def _get(self, gathers: list, buffers: list) -> tuple:
        key = tuple(gathers)
        entry = self._fused.get(key)
        if entry is not None and entry[0].codec.shares_state() and all(
                a is b for a, b in zip(entry[1].buffers, buffers)):
            return entry
        for other in [k for k in self._fused if set(k) & set(key)]:  # their views move to the new one
            self._fused.pop(other)[0].release_graphs()
        lead = gathers[0]
        segments = Segments(buffers, lead.world_size)
        codec = type(lead.codec).fused([g.codec for g in gathers], segments)
        entry = self._fused[key] = (ShardGather(codec, lead.group, lead.comm_class, lead.capacity_factor,
                                                lead.cuda_graphs, lead.integrity,
                                                "+".join(g.name for g in gathers)), segments)
        if lead.rank == 0:
            logger.info("%s: %d buckets coded as one (%d values per rank)", lead.comm_class, len(gathers),
                        sum(segments.numels))
        return entry


def prepare_gathers(gathers: list, buffers: list, fusions: GatherFusions = None, alone=()) -> list:
    """Encode each ``ShardGather``'s own slice of its buffer (all of one process group) and exchange all the
    payload sizes and headers in ONE all-gather, with one host sync; a gather alone would cost a sync each.
    With ``fusions``, buckets that can be are coded as one (``GatherFusions``; not those in ``alone``). Returns a
    ``PreparedGather`` per gather for its ``transfer``; every one must be transferred (an encode has moved its
    codec on)."""
    if not gathers:
        return []
    lead = gathers[0]
    if any(g.group is not lead.group for g in gathers):
        raise ValueError("prepare_gathers needs gathers of one process group")
    for g, buffer in zip(gathers, buffers):
        g._check(buffer)
    units = fusions.plan(gathers, buffers, alone) if fusions is not None else [
        (g, b, [i]) for i, (g, b) in enumerate(zip(gathers, buffers))]
    prepared = _exchange([g for g, _, _ in units], [b for _, b, _ in units])
    result = [None] * len(gathers)
    for (gather, buffer, members), ready in zip(units, prepared):
        if len(members) == 1:
            result[members[0]] = ready
        else:
            shared = _FusedTransfer(gather, buffer, ready)
            for i in members:
                result[i] = PreparedGather(ready.start, ready.sizes, ready.headers, ready.hashes, fused=shared)
    return result


def _exchange(gathers: list, buffers: list) -> list:
    """``prepare_gathers`` of units: begin each encode; the units whose slots are sized (sync-free) are ready, the
    others' size messages go in one all-gather, with one sync."""
    inputs = [g._encode_input(b) for g, b in zip(gathers, buffers)]
    deferred = [g.cuda_graphs and g.capacity is not None and g.codec.sync_free_input(x)
                for g, x in zip(gathers, inputs)]
    starts = [None if d else g.codec.begin_encode(x) for g, x, d in zip(gathers, inputs, deferred)]
    ready = [PreparedGather(None, None, None, capacity=g.capacity, encode_input=x) if d
             else PreparedGather(start, None, None, capacity=g.capacity)
             if g.capacity is not None and g.codec.sync_free(start) else None
             for g, x, d, start in zip(gathers, inputs, deferred, starts)]
    exchanged = [i for i, r in enumerate(ready) if r is None]
    if not exchanged:
        return ready
    lead = gathers[exchanged[0]]
    device = buffers[0].device
    offsets = [0]
    for i in exchanged:
        offsets.append(offsets[-1] + gathers[i]._message_nbytes)
    if lead._message is None or lead._message.numel() != offsets[-1] or lead._message.device != device:
        lead._message = torch.zeros(offsets[-1], dtype=torch.uint8, device=device)
    message = lead._message  # reused: the exchange below finishes before the next one writes it
    for i, a, b in zip(exchanged, offsets, offsets[1:]):
        gathers[i]._write_message(starts[i], message[a:b])
    table = torch.empty(lead.world_size * offsets[-1], dtype=torch.uint8, device=device)
    dist.all_gather_into_tensor(table, message, group=lead.group)
    table = table.view(lead.world_size, offsets[-1]).cpu().numpy()  # the one sync; parsed in numpy
    for i, a, b in zip(exchanged, offsets, offsets[1:]):
        g = gathers[i]
        ready[i] = PreparedGather(starts[i], *g._read_messages(table[:, a:b]))
        g._resize_slots(ready[i].sizes, g.codec.sync_free(starts[i]))
    return ready
