"""The two codec interfaces every compressor in this project implements.

``TensorCodec``: stateless and usually lossy, wire size fixed by the element count (TACO and its
ablations for tensor-parallel collectives; low-bit pipeline activations). Every rank that decodes the
same wire bytes gets the same values, which is what keeps tensor-parallel replicas consistent.

``ShardCodec``: stateful, for the distributed optimizer's parameter all-gather (CIERA, lossless delta).
Each data-parallel rank encodes its own new shard against what it sent last time; every rank decodes
every rank's payload into that rank's slice of the parameter buffer, which still holds the previous
values. Payload sizes vary. After ``reset()`` the next payload is a keyframe that needs no state.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch


def check_block_size(flag: str, value, low: int, high: int) -> None:
    """Every codec's block size is a power of two in [low, high]; the error names the flag."""
    if not (isinstance(value, int) and low <= value <= high and value & (value - 1) == 0):
        raise ValueError(f"{flag} must be a power of two in {low}..{high}, got {value!r}")


class TensorCodec(ABC):
    """Fixed-size wire format: ``encode`` of n elements always returns ``wire_nbytes(n, rows)`` bytes.

    ``rows`` splits the flattened input into that many equal rows (the last ones zero-padded), each
    encoded into its own contiguous ``wire_nbytes(ceil(n / rows))`` bytes: row r's slice is what a
    compressed all-to-all sends to rank r, with no copy."""

    name: str = "codec"

    @abstractmethod
    def wire_nbytes(self, numel: int, rows: int = 1) -> int:
        """Bytes on the wire for ``numel`` input elements (payload plus per-block scales)."""

    @abstractmethod
    def encode(self, x: torch.Tensor, rows: int = 1) -> torch.Tensor:
        """Flatten and compress ``x`` (any size; padding is internal) into a 1-D uint8 tensor."""

    @abstractmethod
    def decode(self, wire: torch.Tensor, numel: int, dtype: torch.dtype, rows: int = 1) -> torch.Tensor:
        """Inverse of ``encode``: a 1-D tensor of ``numel`` elements of ``dtype``."""


def bytes_to_device(raw: bytes, device) -> torch.Tensor:
    """uint8 tensor of ``raw`` on ``device``, without waiting for the device (a plain ``.to`` of pageable
    memory synchronises the stream, i.e. waits for every kernel queued before it)."""
    host = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    if torch.device(device).type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class HostValues:
    """Integers computed on the device, copied to the host without waiting: ``get()`` returns them once
    the copy has landed, at no cost after any sync that followed (e.g. a gather's size exchange).
    ``update`` reuses the pinned buffer and event for new values of the same shape (after ``get``)."""

    def __init__(self, values: torch.Tensor):
        self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=values.is_cuda)
        self._event = torch.cuda.Event() if values.is_cuda else None
        self.update(values)

    def update(self, values: torch.Tensor) -> "HostValues":
        self.device_values = values
        self._host.copy_(values, non_blocking=True)
        if self._event is not None:
            self._event.record()
        return self

    def get(self, synced: bool = False) -> list:
        """``synced``: the caller has already waited for the copy (e.g. a CUDA graph that made it: its own event
        record belongs to the capture)."""
        if self._event is not None and not synced:
            self._event.synchronize()
        return self._host.tolist()


@dataclass
class EncodeStart:
    """The first half of a ``ShardCodec`` encode (``begin_encode``)."""

    nbytes: Union[int, torch.Tensor]
    """Payload size: an int, or an int64 [1] tensor on the payload's device not yet read by the host."""
    header: torch.Tensor
    """uint8, on the payload's device: the payload's first ``min(header_nbytes, size)`` bytes."""
    state: Any
    """Whatever ``finish_encode`` needs."""
    hash: Optional[torch.Tensor] = None
    """int64 [1] on the payload's device: the integrity hash of what the encode coded (the codec's ``integrity``),
    which the decoder's must equal; None: the codec has no integrity check."""


@dataclass
class CastShard:
    """A shard whose new values are still fp32 (the distributed optimizer's master weights): ``source`` rounded to
    ``target``'s dtype is the new shard, and ``target`` (the shard in the parameter buffer, or a ``SegmentedShard`` of
    several buckets' with one source per bucket) still holds what every rank received last. A codec writes the
    rounded values into ``target`` (exactly ``copy_`` of the source) and codes them; delta does both in one pass
    against ``target``'s old values (no sender copy)."""

    target: Any  # a 1-D tensor, or a SegmentedShard
    source: Any  # fp32: a tensor of the target's shape, or a tuple of one per part of a SegmentedShard

    def __post_init__(self):
        for part, source in self._pairs():
            if source.dtype != torch.float32 or source.shape != part.shape:
                raise ValueError(f"CastShard needs an fp32 source of its target's shape {tuple(part.shape)}, got "
                                 f"{source.dtype} {tuple(source.shape)}")

    def _pairs(self) -> list:
        if isinstance(self.target, SegmentedShard):
            if len(self.source) != len(self.target.parts):
                raise ValueError(f"CastShard of {len(self.target.parts)} segments needs as many sources, got "
                                 f"{len(self.source)}")
            return list(zip(self.target.parts, self.source))
        return [(self.target, self.source)]

    @property
    def dtype(self):
        return self.target.dtype

    @property
    def device(self):
        return self.target.device

    def numel(self) -> int:
        return self.target.numel()

    def element_size(self) -> int:
        return self.target.element_size()

    def cast(self):
        """The rounding alone (what the optimizer's copy would have done): ``target``, now holding the new values."""
        for part, source in self._pairs():
            part.copy_(source)
        return self.target


class ShardCodec(ABC):
    """Variable-size, stateful codec of one bucket's parameter shards (one instance per bucket)."""

    name: str = "shard-codec"
    lossless: bool = True
    stat_names: tuple = ()
    """Names of the integer statistics of the last ``encode`` in ``last_stats`` (e.g. blocks_changed),
    which the gather adds to the byte telemetry as ``dp_param_gather/<name>``."""
    last_stats: dict = {}
    read_slack_bytes: int = 0
    """Bytes past a payload's end that ``decode`` may read (and never uses): the gather leaves that much
    room after its receive buffer, and a payload without it is copied into one that has it."""
    header_nbytes: int = 0
    """Length of the fixed header every payload starts with (0: none). The gather sends these bytes
    with the payload sizes, which the host reads anyway, and hands them to ``decode`` as ``header``:
    the decode then needs no device-to-host read of its own (a sync that would stall the stream)."""

    @abstractmethod
    def encode(self, shard: torch.Tensor) -> torch.Tensor:
        """Encode this rank's new shard; returns a 1-D uint8 payload (a keyframe after ``reset``)."""

    def begin_encode(self, shard: torch.Tensor) -> EncodeStart:
        """An encode in two halves, so that a gather can send the payload sizes before the host knows them
        (one host sync for both instead of one each): this half may leave the size on the device, and
        ``finish_encode`` then writes the payload into a buffer of that size. The default is the whole
        ``encode`` here, the payload kept for ``finish_encode`` to copy (of a ``CastShard``: its cast first)."""
        payload = self.encode(shard.cast() if isinstance(shard, CastShard) else shard)
        return EncodeStart(payload.numel(), payload[:self.header_nbytes], payload)

    def finish_encode(self, start: EncodeStart, out: torch.Tensor) -> None:
        """Write the payload begun by ``begin_encode`` into ``out`` (uint8, exactly its size)."""
        out.copy_(start.state)

    @abstractmethod
    def decode(self, src_rank: int, payload: torch.Tensor, out: torch.Tensor, header: bytes = None) -> None:
        """Write ``src_rank``'s new shard into ``out`` in place; ``out`` holds that rank's previous
        shard (from the last gather) unless the payload is a keyframe. ``header``: the payload's first
        ``header_nbytes`` bytes on the host, if the caller has them (else they are read from ``payload``)."""

    def decode_gathered(self, target, gathered: torch.Tensor, stride: int, sizes: list, headers: list,
                        skip: int) -> None:
        """Decode every rank's payload in ``gathered`` (rank r's ``sizes[r]`` bytes at ``r * stride``, its header
        ``headers[r]``) but rank ``skip``'s (-1: none) into rank r's slice of ``target`` (a bucket split evenly
        over the group, or ``Segments``). The default decodes them one by one; a codec may batch them."""
        for src, (size, header) in enumerate(zip(sizes, headers)):
            if src != skip:
                self.decode(src, gathered[src * stride:src * stride + size], shard_of(target, src, len(sizes)), header)

    def sync_free(self, start: EncodeStart) -> bool:
        """Whether this encode may go out in a slot of a fixed capacity before the host knows its size
        (``ShardGather``'s sync-free gather): every rank must answer alike (no keyframes). Not by default."""
        return False

    def finish_encode_into_slot(self, start: EncodeStart, slot: torch.Tensor, size: torch.Tensor) -> None:
        """Write the payload's size into ``size`` (int64 [1]) and, if it fits, the payload into ``slot`` (uint8 of
        the capacity); a payload larger than the slot writes only its size. The default reads the size on the host."""
        nbytes = int(start.nbytes)
        size.fill_(nbytes)
        if nbytes <= slot.numel():
            self.finish_encode(start, slot[:nbytes])

    def sync_free_input(self, shard) -> bool:
        """Whether ``begin_encode(shard)`` would give a ``sync_free`` encode whose work is all on the device (no host
        value read), so that a gather may capture the encode with its transfer and decode as one CUDA graph. Not by
        default."""
        return False

    def encode_stats(self, start: EncodeStart, synced: bool = False) -> None:
        """Fill ``last_stats`` of an encode finished into a slot, once its size has reached the host (``synced``: as
        ``HostValues.get``)."""

    def decode_slots(self, target, gathered: torch.Tensor, stride: int, sizes: torch.Tensor, capacity: int,
                     skip: int) -> None:
        """``decode_gathered`` of slots: rank r's payload at ``r * stride`` of ``gathered``, its size ``sizes[r]``
        (int64 on ``gathered``'s device); payloads larger than ``capacity`` were not sent and are not decoded. The
        default reads the sizes on the host (a sync) and decodes one by one."""
        for src, size in enumerate(sizes.cpu().tolist()):
            if src != skip and size <= capacity:
                self.decode(src, gathered[src * stride:src * stride + size], shard_of(target, src, len(sizes)))

    def can_fuse(self, numel: int) -> bool:
        """Whether this codec, coding a ``numel``-value shard, can now join others of its class coded as one shard
        (``fused``; compression/shard_gather.py's GatherFusions). Not by default."""
        return False

    @classmethod
    def fused(cls, codecs: list, segments: "Segments") -> "ShardCodec":
        """One codec coding ``segments`` (the buckets of ``codecs``, in order) as one shard, sharing their state."""
        raise NotImplementedError(f"{cls.__name__} codes one bucket at a time")

    def read_header(self, payload: torch.Tensor) -> bytes:
        """The payload's first ``header_nbytes`` bytes on the host (a device-to-host read: a sync)."""
        return payload[:self.header_nbytes].cpu().numpy().tobytes()

    @abstractmethod
    def reset(self) -> None:
        """Forget all state (after checkpoint load or anything that rewrites parameters)."""

    def observe(self, shard: torch.Tensor) -> None:
        """This rank's new shard went out uncompressed (every rank's buffer now holds it): bring the
        sender state up to date so that the next ``encode`` codes against it. The default forgets the
        state, so the next payload is a keyframe (call it on every rank together, like ``reset``)."""
        self.reset()


def shard_of(target, rank: int, world_size: int):
    """Rank ``rank``'s shard of a gather's ``target``: its slice of a 1-D bucket split evenly over ``world_size``
    ranks, or its ``SegmentedShard`` of ``Segments``."""
    if isinstance(target, Segments):
        return target.shard(rank)
    n = target.numel() // world_size
    return target[rank * n:(rank + 1) * n]


class Segments:
    """The shards of several buckets coded as ONE shard (one encode, one payload, one decode per source).

    Each of ``buffers`` (1-D, one dtype, all in one storage) is split evenly over ``world_size`` ranks like a
    ``ShardGather`` bucket. Rank r's shard of the whole is its slice of every buffer, in order, each padded
    with zeros to whole blocks: ``padded_numel(B)`` values whose block b lies in one bucket only. A codec
    addresses the slices through ``block_table(B)`` (where each block starts in the storage) on the GPU, or
    copies them into one padded tensor (``SegmentedShard.padded``) elsewhere. The pads never change, so
    a lossless codec sends nothing for them."""

    def __init__(self, buffers, world_size: int):
        buffers = tuple(buffers)
        if not buffers or any(b.dim() != 1 or b.numel() % world_size for b in buffers):
            raise ValueError(f"Segments needs 1-D buffers whose numels are divisible by the group size {world_size}")
        storage = buffers[0].untyped_storage().data_ptr()
        if any(b.dtype != buffers[0].dtype or b.untyped_storage().data_ptr() != storage for b in buffers):
            raise ValueError("Segments needs buffers of one dtype in one storage")
        self.buffers, self.world_size = buffers, world_size
        self.numels = tuple(b.numel() // world_size for b in buffers)  # values of each bucket's shard
        self.dtype, self.device = buffers[0].dtype, buffers[0].device
        self._tables = {}
        self._source_tables = {}

    def shard(self, rank: int) -> "SegmentedShard":
        return SegmentedShard(self, rank)

    def padded_numel(self, block_size: int) -> int:
        return sum(-(-n // block_size) * block_size for n in self.numels)

    def padded_offsets(self, block_size: int) -> list:
        """Where each bucket's slice starts in a rank's padded shard."""
        offsets, at = [], 0
        for n in self.numels:
            offsets.append(at)
            at += -(-n // block_size) * block_size
        return offsets

    def block_table(self, block_size: int) -> tuple:
        """``(base, start, stride, valid, aligned)``: block b of rank r's padded shard is the ``valid[b]`` values
        at ``base[start[b] + r * stride[b]:]`` (``base``: the buffer that starts first; int64 ``start``/
        ``stride``, int32 ``valid``, on the device, made once per block size); ``aligned``: every block starts
        on a multiple of 8 values and holds a multiple of 8 (so 16-byte vector accesses are valid)."""
        if block_size not in self._tables:
            base = min(self.buffers, key=lambda b: b.data_ptr())
            starts, strides, valids = [], [], []
            for buffer, n in zip(self.buffers, self.numels):
                offset = (buffer.data_ptr() - base.data_ptr()) // buffer.element_size()
                first = torch.arange(0, n, block_size, dtype=torch.int64)
                starts.append(offset + first)
                strides.append(torch.full_like(first, n))
                valids.append((n - first).clamp(max=block_size).to(torch.int32))
            start, stride, valid = (torch.cat(t).to(self.device) for t in (starts, strides, valids))
            aligned = all((b.data_ptr() - base.data_ptr()) // b.element_size() % 8 == 0 and n % 8 == 0
                          for b, n in zip(self.buffers, self.numels))
            self._tables[block_size] = (base, start, stride, valid, aligned)
        return self._tables[block_size]


    def source_table(self, sources, block_size: int) -> tuple:
        """``(base, start, aligned)`` of fp32 ``sources``, one per bucket holding a rank's values of its shard
        (``CastShard``): block b's values are at ``base[start[b]:]`` (int64 ``start`` on the device, made once per
        set of sources); ``aligned``: every block starts on a multiple of 8 values."""
        key = (block_size,) + tuple(s.data_ptr() for s in sources)
        if key not in self._source_tables:
            base = min(sources, key=lambda s: s.data_ptr())
            offsets = [(s.data_ptr() - base.data_ptr()) // s.element_size() for s in sources]
            start = torch.cat([offset + torch.arange(0, n, block_size, dtype=torch.int64)
                               for offset, n in zip(offsets, self.numels)]).to(self.device)
            self._source_tables = {key: (base, start, all(o % 8 == 0 for o in offsets))}  # one set in use at a time
        return self._source_tables[key]


class SegmentedShard:
    """Rank ``rank``'s shard of ``Segments``: what a codec that supports segments takes instead of a tensor."""

    def __init__(self, segments: Segments, rank: int):
        self.segments, self.rank = segments, rank
        self.dtype, self.device, self.is_cuda = segments.dtype, segments.device, segments.device.type == "cuda"

    @property
    def parts(self) -> list:
        return [b[self.rank * n:(self.rank + 1) * n] for b, n in zip(self.segments.buffers, self.segments.numels)]

    def numel(self) -> int:
        return sum(self.segments.numels)

    def element_size(self) -> int:
        return self.segments.buffers[0].element_size()

    def padded(self, block_size: int) -> torch.Tensor:
        """A contiguous copy of the parts, each zero-padded to whole blocks."""
        out = torch.zeros(self.segments.padded_numel(block_size), dtype=self.dtype, device=self.device)
        for part, at in zip(self.parts, self.segments.padded_offsets(block_size)):
            out[at:at + part.numel()] = part
        return out

    def write_padded(self, padded: torch.Tensor, block_size: int) -> None:
        """Inverse of ``padded``: the parts from a padded copy (pads ignored)."""
        for part, at in zip(self.parts, self.segments.padded_offsets(block_size)):
            part.copy_(padded[at:at + part.numel()])
