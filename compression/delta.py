"""Lossless delta codec of bf16/fp16 parameter shards for the distributed optimizer's all-gather.

Each data-parallel rank encodes its new shard against the shard it encoded last time (it keeps that
copy); every receiver still holds the source rank's previous slice in its parameter buffer and
applies the delta in place. Between optimizer steps most 16-bit values do not change at all and
the rest move by a few units in the last place, so the payload is a bitmap of changed values plus
a few bits per changed value (``kernels/delta.py`` describes the block code; ``docs/delta.md``
the measurements behind it). Bit-exact for every pattern: NaN payloads, +-Inf, -0.0, subnormals.

Wire format (one uint8 tensor, little-endian):

    header, 32 bytes: magic b"DLTA" | version u8 | flags u8 (bit 0 keyframe, bit 1 fp16, bit 2 raw) |
                      reserved u16 | block_size u32 | n_changed u32 | numel u64 | nbytes u64 (the whole payload's)
    keyframe, raw: the raw 16-bit values (numel * 2 bytes)
    delta:     codes u8[n_blocks] | 0-3 pad bytes to a multiple of 4 | group entries u32[ceil(n_blocks / G)] |
               the groups' regions, in group order, each: offsets u16[n] | exc_widths u8[n] | records
               (the group's n changed blocks in block order: per changed block its bitmap, then its value stream)

A raw payload is what the encoder sends where the delta would be larger than the raw values (incompressible
shards: random bits, NaN patterns): the payload never exceeds raw + 32 bytes (``compression/wire.py``). Unlike a
keyframe it is sent with the sender state kept (the next payload is a delta again). A decoder checks the
magic, version, block size, numel and dtype, and that the payload has ``nbytes`` bytes (a ``WireFormatError``).
``codes``/``exc_widths``/bitmaps/value streams are the per-block fields of ``kernels/delta.py``.

Integrity (``integrity``, on by default): every encode also yields a 64-bit hash of the change it coded
(``kernels.delta.change_hash_reference``; a keyframe's of its values), computed by the encode kernel; the payload does
not hold it: ``ShardGather`` sends it beside the payload (docs/integrity.md). Every decode leaves the hash of the change
it applied in ``decoded_hashes[src]``, computed by the decode kernel; a payload decoded as its sender coded it gives
the sender's hash.
A code's bit 7 says whether the block's bitmap is flat (B / 8 bytes) or sparse (row flags, then the non-empty rows'
bytes). A block's count of changed values is the popcount of its bitmap. Blocks form groups of
G = ``kernels.delta.group_blocks(block_size)`` (32 at B <= 512): a group's entry is where its region starts (from the
first region), and a changed block's ``offset`` is where its record starts relative to its group's first record; a
group's n is the number of its nonzero codes. So a decoder finds each block's record without a pass over the payload
first.
Version 6 (version 5 had a 24-byte header without nbytes and no raw payloads; version 4 had the offsets, then the
exc_widths of every changed block in sections of their own, and group entries of 64 blocks holding the changed blocks
and record bytes before the group; version 3 had flat bitmaps only, in a section of their own; version 2 sent each
block's escape count instead of its offset, and no groups: decoders summed stream sizes first; version 1 had no
``exc_widths``: every exception entry took 17 bits).
"""

import struct
from dataclasses import dataclass, replace

import torch

from compression.codec import (CastShard, EncodeStart, HostValues, Segments, SegmentedShard, ShardCodec, bytes_to_device,
                               check_block_size, shard_of)
from compression.wire import check_format, check_length, raw_nbytes
from kernels import delta as kernels
from kernels import use_triton
from kernels.delta import analyze_blocks_reference, pack_records_reference, stream_nbytes, unpack_records_reference

MAGIC = b"DLTA"
VERSION = 6
HEADER = struct.Struct("<4sBBHIIQQ")
FLAG_KEYFRAME = 1
FLAG_FP16 = 2
FLAG_RAW = 4  # the raw values, sent where the delta would be larger
DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class DeltaConfig:
    block_size: int = 256
    """Values per block (``--delta-block-size``): blocks with no change cost one byte."""

    def __post_init__(self):
        check_block_size("--delta-block-size", self.block_size, 32, 8192)


@dataclass
class _Layout:
    """Byte offsets of the delta sections after the header: the group entries, then the groups' regions."""

    n_blocks: int
    groups: int
    regions: int

    @classmethod
    def of(cls, numel: int, block_size: int) -> "_Layout":
        n_blocks = -(-numel // block_size)
        groups = -(-(HEADER.size + n_blocks) // 4) * 4
        return cls(n_blocks, groups, groups + 4 * -(-n_blocks // kernels.group_blocks(block_size)))


def _check_dtype(dtype, what: str) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"DeltaCodec codes bf16/fp16 parameters, got {what} of {dtype}; use "
                         f"--param-gather-compression none (or bf16 params) for other dtypes")


def _check_numel(numel: int, block_size: int) -> None:
    """The wire format's group entries count region bytes in u32: a shard's regions (3 bytes per changed block and its
    record) must stay below 4 GiB."""
    if -(-numel // block_size) * (3 + kernels.record_max_nbytes(block_size)) >= 2**32:
        raise ValueError(f"DeltaCodec codes shards of fewer than ~1.8e9 values, got {numel}: use smaller buckets "
                         f"(--ddp-bucket-size) or more data-parallel ranks")


def _as_bits(t: torch.Tensor, what: str) -> torch.Tensor:
    _check_dtype(t.dtype, what)
    if not t.is_contiguous():
        raise ValueError(f"DeltaCodec needs a contiguous {what}")
    return t.view(-1).view(torch.int16)


def _bytes_after(t: torch.Tensor) -> int:
    """Bytes of ``t``'s storage after its last element."""
    storage = t.untyped_storage()
    return storage.data_ptr() + storage.nbytes() - (t.data_ptr() + t.numel() * t.element_size())


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, 0) - x


def _little_endian(x: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The non-negative int64 ``x`` as ``nbytes``-byte little-endian fields (uint8, flat)."""
    return ((x.reshape(-1, 1) >> (8 * torch.arange(nbytes, device=x.device))) & 0xFF).to(torch.uint8).view(-1)


def _from_little_endian(fields: torch.Tensor, nbytes: int) -> torch.Tensor:
    """Inverse of ``_little_endian`` (int64; ``fields`` may start at any byte)."""
    return (fields.to(torch.int64).view(-1, nbytes) << (8 * torch.arange(nbytes, device=fields.device))).sum(1)


def _group_changed(codes: torch.Tensor, group: int) -> torch.Tensor:
    """Changed flags of the blocks as [groups, G] (int64; the last group padded with unchanged blocks)."""
    n_groups = -(-codes.numel() // group)
    return torch.nn.functional.pad((codes != 0).to(torch.int64), (0, n_groups * group - codes.numel())).view(-1, group)


def _region_starts(per_group: torch.Tensor, block_bytes: torch.Tensor) -> tuple:
    """Each group's region start (bytes from the first region) and each block's record start within its group's
    records, from the changed flags by group (``_group_changed``) and every block's record bytes."""
    group = per_group.shape[1]
    record_at = _exclusive_cumsum(block_bytes)
    group_stream = record_at[::group]
    starts = 3 * _exclusive_cumsum(per_group.sum(1)) + group_stream
    return starts, record_at - group_stream.repeat_interleave(group)[:block_bytes.numel()]


def _region_places(per_group: torch.Tensor, changed: torch.Tensor, starts: torch.Tensor) -> tuple:
    """Per changed block (indices ``changed``), in bytes from the first region: where its offset is, where its
    exc_width is, and where its group's records start (``per_group``: the changed flags by group)."""
    in_group = (torch.cumsum(per_group, 1) - per_group).view(-1)[changed]
    g = changed // per_group.shape[1]
    base, n = starts[g], per_group.sum(1)[g]
    return base + 2 * in_group, base + 2 * n + in_group, base + 3 * n


@dataclass
class _CodedBlocks:
    """Between ``begin_encode`` and ``finish_encode`` on the Triton path: every block coded, sizes on the device."""

    blocks: kernels.EncodedBlocks  # with its spans' starts and the totals (kernels.scan_tiles)
    totals: HostValues  # changed blocks, changed values, record bytes, payload size, delta size
    fp16_flag: int
    numel: int
    headers: torch.Tensor  # uint8 [2 * HEADER.size] on the device: the payload's header, then the delta's (slots)
    new_bits: object  # () -> the shard's new int16 values as coded (for a raw payload)


class DeltaCodec(ShardCodec):
    name = "delta"
    lossless = True
    stat_names = ("blocks_total", "blocks_changed", "values_changed")  # telemetry counters
    header_nbytes = HEADER.size

    def __init__(self, config: DeltaConfig, world_size: int, rank: int, *, triton=None, cast: bool = False,
                 integrity: bool = True):
        self.config = config
        self.integrity = integrity  # hash each encode's and decode's change (module docstring)
        self._decoded_hashes = None  # int64 [world_size] with integrity: each source's hash of the last decodes
        self._hash_slots = {}  # (rows, device): the decode kernel's partial sums of them, zero between decodes
        # (slots, the rows of _decoded_hashes they sum into) of the last Triton decode: summed when read
        # (``decoded_hashes``), or by the gather's comparison in the same launch (``mismatched_sources``)
        self._unsummed = None
        self.read_slack_bytes = kernels.read_slack_bytes(config.block_size)  # room after a payload its decode reads
        self.world_size = world_size
        self.rank = rank
        self.triton = triton  # None: Triton on CUDA, the PyTorch reference elsewhere
        self.last_stats: dict = {}
        self._prev = None  # int16 copy of what this rank encoded last
        self._whole_hash = None  # the integrity hash of the last encode made whole (keyframe, reference)
        # reused by every encode of the Triton path (one encode in flight: begin_encode, then finish_encode)
        self._header_cache = None  # (key, device header) of _delta_header
        self._blocks = None  # kernels.EncodedBlocks of the last encode (its per-block fields are reused)
        self._totals = None  # HostValues of the totals
        self._members = []  # of a fused codec: (member codec, its view of this one's sender copy)
        self._buffer_segments = None  # the last bucket buffer decoded by decode_gathered, as Segments
        # CastShard encodes code against the parameter buffer itself and keep no sender copy: _casting once one ran
        # (or from the start with ``cast``: a codec of --delta-fused-cast, whose plain shards are keyframes that keep
        # no copy either), _synced the (numel, device) of the shard whose values in the buffer every rank holds
        self._casting = cast
        self._synced = None

    def reset(self) -> None:
        self._prev = None
        self._synced = None

    def cast_mode(self) -> None:
        """Code ``CastShard``s from now on, as if constructed with ``cast`` (a keyframe next; call on every rank)."""
        self.reset()
        self._casting = True

    @classmethod
    def fused(cls, codecs: list, segments: Segments) -> "DeltaCodec":
        """One codec that codes ``segments`` (the buckets of ``codecs``, in order) as one shard: one encode and
        one payload instead of one per bucket. It shares their state: their sender copies move into its own,
        back to back and padded to whole blocks, and become views of it, so each codes against the same values
        whichever of them (fused or alone) coded last. Every codec must hold a sender copy, or every one code
        ``CastShard``s against a buffer every rank holds (``can_fuse``): then the buffers are the shared state."""
        first = codecs[0]
        if len(codecs) != len(segments.numels) or not all(c.can_fuse(n) for c, n in zip(codecs, segments.numels)):
            raise ValueError("DeltaCodec.fused needs one codec per segment, each holding that segment's sender copy "
                             "or the buffer every rank holds")
        if any((c.config, c.world_size, c.rank, c.triton) != (first.config, first.world_size, first.rank, first.triton)
               for c in codecs):
            raise ValueError("DeltaCodec.fused needs codecs of one configuration, group and rank")
        fused = cls(first.config, first.world_size, first.rank, triton=first.triton, integrity=first.integrity)
        b = first.config.block_size
        if all(c._prev is None for c in codecs):  # CastShard codecs: the buffers every rank holds are the state
            fused._casting, fused._synced = True, (segments.padded_numel(b), str(segments.device))
            fused._members = [(codec, None) for codec in codecs]
            return fused
        if any(c._prev is None for c in codecs):
            raise ValueError("DeltaCodec.fused needs codecs that all hold sender copies or all code CastShards")
        fused._prev = torch.zeros(segments.padded_numel(b), dtype=torch.int16, device=segments.device)
        fused._members = []
        for codec, n, at in zip(codecs, segments.numels, segments.padded_offsets(b)):
            view = fused._prev[at:at + n]
            view.copy_(codec._prev)
            codec._prev = view
            fused._members.append((codec, view))
        return fused

    def can_fuse(self, numel: int) -> bool:
        """Whether this codec holds the sender copy of a ``numel``-value shard, or codes ``CastShard``s of one against
        the buffer every rank holds (no keyframe due either way)."""
        if self._prev is not None:
            return self._prev.numel() == numel
        return self._casting and self._synced is not None and self._synced[0] == numel

    def shares_state(self) -> bool:
        """For a ``fused`` codec: whether every member still codes against its view, or for ``CastShard`` codecs
        against the buffer (none was reset)."""
        if self._prev is None:
            return self._synced is not None and all(codec._synced is not None for codec, _ in self._members)
        return all(codec._prev is view for codec, view in self._members)

    def observe(self, shard: torch.Tensor) -> None:
        """The shard was gathered uncompressed: code the next one against it (no keyframe needed,
        receivers hold it in their buffers)."""
        bits = _as_bits(shard, "shard")
        if self._prev is not None and self._prev.numel() == bits.numel() and self._prev.device == bits.device:
            self._prev.copy_(bits)
        if self._casting:
            self._synced = (bits.numel(), str(bits.device))

    # --- encode --------------------------------------------------------------------------------

    def encode(self, shard: torch.Tensor) -> torch.Tensor:
        start = self.begin_encode(shard)
        if not isinstance(start.state, _CodedBlocks):
            return start.state
        payload = torch.empty(int(start.nbytes), dtype=torch.uint8, device=shard.device)  # a host sync
        self.finish_encode(start, payload)
        return payload

    def begin_encode(self, shard) -> EncodeStart:
        """On the Triton path every block is coded and the payload size (and n_changed in the header)
        left on the device; otherwise (keyframe, the reference, an empty shard) the whole encode. ``shard``: a
        tensor, or a ``SegmentedShard`` coded as its padded values (``Segments``)."""
        if isinstance(shard, CastShard) or self._casting:
            return self._begin_cast_encode(shard)
        b = self.config.block_size
        segmented = isinstance(shard, SegmentedShard)
        _check_dtype(shard.dtype, "shard")
        numel = shard.segments.padded_numel(b) if segmented else shard.numel()
        _check_numel(numel, b)
        fp16_flag = FLAG_FP16 if shard.dtype == torch.float16 else 0
        if self._keyframe_due(numel, shard.device) or not use_triton(shard, self.triton) or not numel:
            bits = _as_bits(shard.padded(b) if segmented else shard, "shard")
            payload = self._encode_whole(bits, fp16_flag)
            return EncodeStart(payload.numel(), payload[:HEADER.size], payload, self._whole_hash)
        self._blocks = kernels.empty_blocks(numel, b, shard.device, reuse=self._blocks, hash=self.integrity)
        if segmented:
            table = shard.segments.block_table(b)
            e = kernels.encode_blocks(self._prev, _as_bits(table[0], "shard"), b, out=self._blocks, table=table,
                                      rank=shard.rank)
        else:
            e = kernels.encode_blocks(self._prev, _as_bits(shard, "shard"), b, out=self._blocks)
        prev = self._prev  # holds the new values now
        return self._start_coded(e, fp16_flag, numel, shard.device, lambda: prev)

    def _begin_cast_encode(self, shard) -> EncodeStart:
        """``begin_encode`` of a ``CastShard``: the values in the parameter buffer are the previous ones every rank
        holds (after a keyframe or an observed plain gather), so the Triton path rounds the fp32 source into the
        buffer and codes it against the values it replaces in one kernel; no sender copy is kept. Segmented: the
        buckets' padded values, as ``begin_encode``. A plain shard (no cast pending: its values are in the buffer
        already, the old ones gone) is a keyframe."""
        cast = isinstance(shard, CastShard)
        b, target = self.config.block_size, shard.target if cast else shard
        segmented = isinstance(target, SegmentedShard)
        _check_dtype(target.dtype, "shard")
        fp16_flag = FLAG_FP16 if target.dtype == torch.float16 else 0
        numel = target.segments.padded_numel(b) if segmented else target.numel()
        _check_numel(numel, b)
        key = (numel, str(target.device))
        self._prev, self._casting = None, True  # the buffer is the state from now on
        for (member, _), n in zip(self._members, target.segments.numels if segmented else ()):
            # so are the members' buffers, which every rank holds after this gather
            member._prev, member._casting, member._synced = None, True, (n, str(target.device))

        def bits():
            return _as_bits(target.padded(b) if segmented else target, "shard")

        if not cast or self._synced != key or not numel:
            if cast:
                shard.cast()
            self._synced = key
            payload = self._keyframe(bits(), fp16_flag)
        elif not use_triton(target, self.triton):
            self._prev = bits().clone()  # the reference codes against a copy of the old values
            shard.cast()
            payload = self._encode_delta(bits(), fp16_flag)
            self._prev = None
        else:
            self._blocks = kernels.empty_blocks(numel, b, target.device, reuse=self._blocks, hash=self.integrity)
            if segmented:
                table = target.segments.block_table(b)
                sources = target.segments.source_table(shard.source, b)
                e = kernels.encode_blocks(_as_bits(table[0], "shard"), sources[0], b, out=self._blocks, table=table,
                                          rank=target.rank, cast_to=target.dtype, source_table=sources)
            else:
                e = kernels.encode_blocks(_as_bits(target, "shard"), shard.source, b, out=self._blocks,
                                          cast_to=target.dtype)
            return self._start_coded(e, fp16_flag, numel, target.device, bits)
        return EncodeStart(payload.numel(), payload[:HEADER.size], payload, self._whole_hash)

    def _start_coded(self, e: kernels.EncodedBlocks, fp16_flag: int, numel: int, device, new_bits) -> EncodeStart:
        """``begin_encode`` after the encode kernel: the payload's size and header on the device (one launch: the
        spans' starts, the totals, the choice of delta or raw and the headers' fields)."""
        headers = self._delta_header(fp16_flag, numel, device)
        # the delta's size: the regions' start, then 2 + 1 bytes of offset and exc_width per changed block and the
        # records; the payload's: the smaller of it and the raw one
        kernels.scan_tiles(e, headers, _Layout.of(numel, self.config.block_size).regions,
                           raw_nbytes(HEADER.size, numel), fp16_flag, FLAG_RAW)
        self._totals = HostValues(e.totals) if self._totals is None else self._totals.update(e.totals)
        return EncodeStart(e.totals[3:4], headers[:HEADER.size],
                           _CodedBlocks(e, self._totals, fp16_flag, numel, headers, new_bits), e.hash)

    def finish_encode(self, start: EncodeStart, out: torch.Tensor) -> None:
        if not isinstance(start.state, _CodedBlocks):
            return super().finish_encode(start, out)
        c, b = start.state, self.config.block_size
        n_changed, n_values, n_record_bytes, size, delta_size = c.totals.get()  # landed with the size waited for
        if out.numel() != size:
            raise ValueError(f"finish_encode needs a buffer of the payload's {size} bytes, got {out.numel()}")
        if size != delta_size:  # the raw values are smaller
            out[:HEADER.size].copy_(self._header(FLAG_RAW | c.fp16_flag, c.numel, n_changed, size, out.device))
            out[HEADER.size:].copy_(c.new_bits().view(torch.uint8))
        else:
            layout = _Layout.of(c.numel, b)
            kernels.gather_records(c.blocks, out, self._header_bytes(c.fp16_flag, c.numel, n_changed, size),
                                   layout.groups, layout.regions, b)
        self._release_records(c)
        self._record(size, c.numel, n_changed, n_values, False, raw=size != delta_size)

    def sync_free(self, start: EncodeStart) -> bool:
        """Every payload but a keyframe (whose size is the raw shard's, every rank's alike). On the Triton path a slot
        gets the delta even where the raw values would be smaller (the slot's capacity is what it costs, and the
        decode kernel reads deltas only); the reference's raw payloads go in slots as they are."""
        if isinstance(start.state, _CodedBlocks):
            return True
        return not self.last_stats.get("keyframe", True)  # the whole encode ran in begin_encode (raw or delta)

    def finish_encode_into_slot(self, start: EncodeStart, slot: torch.Tensor, size: torch.Tensor) -> None:
        """On the Triton path the size and payload go from the device into the slot, the header with the n_changed
        ``begin_encode`` left there: nothing waits for the host."""
        if not isinstance(start.state, _CodedBlocks):
            return super().finish_encode_into_slot(start, slot, size)
        c = start.state
        layout = _Layout.of(c.numel, self.config.block_size)
        size.copy_(c.blocks.totals[4:5])  # the delta's (its header is the second one)
        kernels.gather_records(c.blocks, slot, c.headers[HEADER.size:], layout.groups, layout.regions,
                               self.config.block_size, capacity=slot.numel())
        self._release_records(c)

    def sync_free_input(self, shard) -> bool:
        """The Triton path's delta encodes (``begin_encode``'s conditions for one: no keyframe due, not empty)."""
        cast = isinstance(shard, CastShard)
        target = shard.target if cast else shard
        b = self.config.block_size
        numel = target.segments.padded_numel(b) if isinstance(target, SegmentedShard) else target.numel()
        if not numel or not use_triton(target, self.triton) or target.dtype not in DTYPES:
            return False
        if cast or self._casting:
            return cast and self._synced == (numel, str(target.device))
        return not self._keyframe_due(numel, target.device)

    def encode_stats(self, start: EncodeStart, synced: bool = False) -> None:
        if isinstance(start.state, _CodedBlocks):
            n_changed, n_values, _, _, delta_size = start.state.totals.get(synced)
            self._record(delta_size, start.state.numel, n_changed, n_values, False)

    def _release_records(self, c: "_CodedBlocks") -> None:
        if self._blocks is c.blocks:  # the records go back to the allocator (stream-ordered after the gather)
            self._blocks = replace(c.blocks, records=None)

    def _keyframe_due(self, numel: int, device) -> bool:
        return self._prev is None or self._prev.numel() != numel or self._prev.device != device

    def _encode_whole(self, bits: torch.Tensor, fp16_flag: int) -> torch.Tensor:
        if self._keyframe_due(bits.numel(), bits.device):
            self._prev = bits.clone()
            return self._keyframe(bits, fp16_flag)
        return self._encode_delta(bits, fp16_flag)

    def _keyframe(self, bits: torch.Tensor, fp16_flag: int) -> torch.Tensor:
        self._whole_hash = (kernels.change_hash_reference(None, bits, self.config.block_size) if self.integrity
                            else None)
        payload = self._raw(FLAG_KEYFRAME | fp16_flag, bits, 0)
        self._record(payload.numel(), bits.numel(), -(-bits.numel() // self.config.block_size), bits.numel(), True)
        return payload

    def _raw(self, flags: int, bits: torch.Tensor, n_changed: int) -> torch.Tensor:
        """A keyframe or raw payload: the header, then ``bits``."""
        header = self._header(flags, bits.numel(), n_changed, raw_nbytes(HEADER.size, bits.numel()), bits.device)
        return torch.cat([header, bits.view(torch.uint8)])

    def _encode_delta(self, bits: torch.Tensor, fp16_flag: int) -> torch.Tensor:
        """The PyTorch reference (also for empty shards on CUDA)."""
        b = self.config.block_size
        self._whole_hash = kernels.change_hash_reference(self._prev, bits, b) if self.integrity else None
        a = analyze_blocks_reference(self._prev, bits, b)
        changed = torch.nonzero(a.codes).squeeze(1)
        record_bytes = a.bitmap_nbytes[changed] + stream_nbytes(a.counts[changed], a.codes[changed], a.n_esc[changed],
                                                                a.exc_widths[changed])
        n_values, n_record_bytes = int(a.counts.sum()), int(record_bytes.sum())
        layout = _Layout.of(bits.numel(), b)
        size = layout.regions + 3 * changed.numel() + n_record_bytes
        if size > raw_nbytes(HEADER.size, bits.numel()):  # the raw values are smaller
            payload = self._raw(FLAG_RAW | fp16_flag, bits, changed.numel())
            self._record(payload.numel(), bits.numel(), changed.numel(), n_values, False, raw=True)
            return payload
        payload = torch.zeros(size, dtype=torch.uint8, device=bits.device)
        payload[: HEADER.size] = self._header(fp16_flag, bits.numel(), changed.numel(), size, bits.device)
        payload[HEADER.size : HEADER.size + layout.n_blocks] = a.codes
        block_bytes = torch.zeros(layout.n_blocks, dtype=torch.int64, device=bits.device)
        block_bytes[changed] = record_bytes
        per_group = _group_changed(a.codes, kernels.group_blocks(b))
        starts, offsets = _region_starts(per_group, block_bytes)
        payload[layout.groups : layout.regions] = _little_endian(starts, 4)
        regions = payload[layout.regions :]
        offset_at, exc_width_at, records_at = _region_places(per_group, changed, starts)
        pack_records_reference(a, changed, records_at + offsets[changed], regions)  # rewrites every region byte
        regions[torch.stack([offset_at, offset_at + 1], 1).view(-1)] = _little_endian(offsets[changed], 2)
        regions[exc_width_at] = a.exc_widths[changed]
        self._record(payload.numel(), bits.numel(), changed.numel(), n_values, False)
        return payload

    def _header_bytes(self, flags: int, numel: int, n_changed: int, nbytes: int) -> bytes:
        return HEADER.pack(MAGIC, VERSION, flags, 0, self.config.block_size, n_changed, numel, nbytes)

    def _header(self, flags: int, numel: int, n_changed: int, nbytes: int, device) -> torch.Tensor:
        return bytes_to_device(self._header_bytes(flags, numel, n_changed, nbytes), device)

    def _delta_header(self, fp16_flag: int, numel: int, device) -> torch.Tensor:
        """The device headers of this codec's Triton-path payloads, made once per shape: the payload's, then the
        delta's (what a slot sends); ``begin_encode`` writes their flags, n_changed and nbytes (stream-ordered after
        the previous encode's readers, which copy them at once)."""
        key = (fp16_flag, numel, str(device))
        if self._header_cache is None or self._header_cache[0] != key:
            self._header_cache = (key, bytes_to_device(2 * self._header_bytes(fp16_flag, numel, 0, 0), device))
        return self._header_cache[1]

    def _record(self, payload_bytes, numel, blocks_changed, values_changed, keyframe, raw=False) -> None:
        self.last_stats = dict(
            keyframe=keyframe, raw=raw, blocks_total=-(-numel // self.config.block_size), blocks_changed=blocks_changed,
            values_changed=values_changed, raw_bytes=2 * numel, payload_bytes=payload_bytes,
        )

    # --- decode --------------------------------------------------------------------------------

    def decode(self, src_rank: int, payload: torch.Tensor, out, header: bytes = None) -> None:
        """``out``: a tensor, or ``src_rank``'s ``SegmentedShard`` (its padded values decoded)."""
        if not 0 <= src_rank < self.world_size:
            raise ValueError(f"src_rank {src_rank} outside the data-parallel group of size {self.world_size}")
        b = self.config.block_size
        _check_dtype(out.dtype, "output buffer")
        segmented = isinstance(out, SegmentedShard)
        numel = out.segments.padded_numel(b) if segmented else out.numel()
        flags = self._check_header(payload, out, numel, header, src_rank)
        hash_out = self._decoded(payload.device)[src_rank:src_rank + 1] if self.integrity else None
        if segmented and (flags & (FLAG_KEYFRAME | FLAG_RAW) or not use_triton(out, self.triton)):
            padded = out.padded(b)  # the reference (and a keyframe) decode a padded copy
            self._decode_bits(_as_bits(padded, "output buffer"), payload, flags, hash_out)
            out.write_padded(padded, b)
        elif segmented:
            table = out.segments.block_table(b)
            self._decode_bits(_as_bits(table[0], "output buffer"), payload, flags, hash_out, table, out.rank)
        else:
            self._decode_bits(_as_bits(out, "output buffer"), payload, flags, hash_out)

    @property
    def decoded_hashes(self):
        """int64 [world_size] with integrity (else None): each source's hash of the change its last decode applied."""
        self._take_hash_sums()
        return self._decoded_hashes

    def mismatched_sources(self, sent: torch.Tensor, rank: int, sizes: torch.Tensor = None, capacity: int = 0):
        """After a gather's decodes, on the device: the sources (bool [world_size]) whose decoded hash differs from the
        one they ``sent`` (int64 [world_size]), but for ``rank`` (not decoded), and with ``sizes``, for those larger
        than ``capacity`` (not decoded), and their count (int64 [1]); one launch on the Triton path (with the decode
        kernel's slots, summed on the way)."""
        slots = None
        if self._unsummed is not None and self._unsummed[1].numel() == self.world_size:
            slots, self._unsummed = self._unsummed[0], None
        else:
            self._take_hash_sums()
        check = kernels.check_hash_sums if use_triton(sent, self.triton) else kernels.check_hash_sums_reference
        return check(self._decoded(sent.device), sent, rank, slots, sizes, capacity)

    def _take_hash_sums(self) -> None:
        if self._unsummed is not None:
            kernels.take_hash_sums(*self._unsummed)
            self._unsummed = None

    def _decoded(self, device, zero: bool = False) -> torch.Tensor:
        """``_decoded_hashes`` on ``device`` (made once; ``zero``: zeroed first)."""
        self._take_hash_sums()
        if self._decoded_hashes is None or self._decoded_hashes.device != device:
            self._decoded_hashes = torch.zeros(self.world_size, dtype=torch.int64, device=device)
        elif zero:
            self._decoded_hashes.zero_()
        return self._decoded_hashes

    def _decode_hash_slots(self, rows: int, device):
        """The partial sums of ``rows`` payloads' decoded hashes (None without integrity): made zero once, and zeroed
        again when they are summed (``_unsummed``)."""
        if not self.integrity:
            return None
        self._take_hash_sums()  # the last decode's, before this one adds to the slots
        key = (rows, device)
        if key not in self._hash_slots:
            self._hash_slots[key] = torch.zeros(rows, kernels.HASH_SLOTS, dtype=torch.int64, device=device)
        return self._hash_slots[key]

    def _decode_bits(self, bits, payload, flags, hash_out, table=None, rank=0):
        """Decode into the int16 ``bits`` (with ``table``: rank ``rank``'s slices of the segments based there); the
        hash of the change applied into ``hash_out`` (int64 [1]; None without integrity)."""
        numel = bits.numel() if table is None else table[1].numel() * self.config.block_size
        if flags & (FLAG_KEYFRAME | FLAG_RAW):
            # a keyframe's hash is of its values; a raw payload's, like a delta's, of the change it makes
            old = bits.clone() if self.integrity and not flags & FLAG_KEYFRAME else None
            bits.view(torch.uint8).copy_(payload[HEADER.size : HEADER.size + 2 * numel])
            if hash_out is not None:
                hash_out.copy_(kernels.change_hash_reference(old, bits, self.config.block_size))
            return
        b = self.config.block_size
        layout = _Layout.of(numel, b)
        if use_triton(bits, self.triton):  # sections read as 32-bit words from any payload offset
            if _bytes_after(payload) < self.read_slack_bytes:
                payload = torch.cat([payload, payload.new_zeros(self.read_slack_bytes)])[:payload.numel()]
            hashes = self._decode_hash_slots(1, bits.device)
            kernels.decode_blocks(bits, self._payloads(payload, 1, 0, numel), b, table, rank, hashes=hashes)
            if hash_out is not None:
                self._unsummed = (hashes, hash_out)
            return
        codes = payload[HEADER.size : HEADER.size + layout.n_blocks]
        changed = torch.nonzero(codes).squeeze(1)
        starts = _from_little_endian(payload[layout.groups : layout.regions], 4)
        regions = payload[layout.regions :]
        per_group = _group_changed(codes, kernels.group_blocks(b))
        offset_at, exc_width_at, records_at = _region_places(per_group, changed, starts)
        offsets = _from_little_endian(regions[torch.stack([offset_at, offset_at + 1], 1).view(-1)], 2)
        decoded_hash = unpack_records_reference(bits, changed, codes, regions[exc_width_at], records_at + offsets,
                                                regions, b)
        if hash_out is not None:
            hash_out.copy_(decoded_hash)

    def decode_gathered(self, target, gathered, stride, sizes, headers, skip) -> None:
        """On the Triton path every source's payload in one launch of the decode kernel; one source of a bucket
        buffer (not ``Segments``) by the plain decoder, which reads no block table. Either way each source's
        hash goes to its own slot row, which the integrity check sums itself (no launch of their own). Keyframes
        and the reference: one by one."""
        b = self.config.block_size
        segments, numel = self._segments_of(target)
        sources = [src for src in range(len(sizes)) if src != skip]
        keyframe = any(self._check_header(gathered[src * stride:src * stride + sizes[src]], target, numel,
                                          headers[src], src) & (FLAG_KEYFRAME | FLAG_RAW) for src in sources)
        if (keyframe or not sources or not use_triton(gathered, self.triton)
                or _bytes_after(gathered[(len(sizes) - 1) * stride:][:sizes[-1]]) < self.read_slack_bytes):
            if self.integrity:
                self._decoded(gathered.device, zero=True)
            return super().decode_gathered(target, gathered, stride, sizes, headers, skip)
        hashes = self._decode_hash_slots(len(sizes), gathered.device)
        if len(sources) == 1 and not isinstance(target, Segments):
            src = sources[0]
            kernels.decode_blocks(_as_bits(shard_of(target, src, len(sizes)), "output buffer"),
                                  self._payloads(gathered[src * stride:], 1, 0, numel), b,
                                  hashes=None if hashes is None else hashes[src:src + 1])
        else:
            table = segments.block_table(b)
            kernels.decode_blocks(_as_bits(table[0], "output buffer"), self._payloads(gathered, len(sizes), stride,
                                                                                     numel), b, table, 0, skip,
                                  hashes=hashes)
        if hashes is not None:  # every row's, those not decoded 0
            self._unsummed = (hashes, self._decoded(gathered.device))

    def decode_slots(self, target, gathered, stride, sizes, capacity, skip) -> None:
        """On the Triton path every source's slot in one launch, skipping the payloads larger than ``capacity`` on
        the device (no header checks: slots follow a gather whose headers were checked, and carry no keyframes)."""
        if not use_triton(gathered, self.triton) or _bytes_after(gathered[(len(sizes) - 1) * stride:][:capacity]) < \
                self.read_slack_bytes:
            if self.integrity:
                self._decoded(gathered.device, zero=True)
            return super().decode_slots(target, gathered, stride, sizes, capacity, skip)
        segments, numel = self._segments_of(target)
        b = self.config.block_size
        table = segments.block_table(b)
        hashes = self._decode_hash_slots(len(sizes), gathered.device)
        kernels.decode_blocks(_as_bits(table[0], "output buffer"), self._payloads(gathered, len(sizes), stride, numel),
                              b, table, 0, skip, slots=(sizes, capacity), hashes=hashes)
        if hashes is not None:  # every row's, those not decoded 0
            self._unsummed = (hashes, self._decoded(gathered.device))

    def _segments_of(self, target) -> tuple:
        """``target`` (``Segments``, or a bucket buffer: its slices through a one-segment block table) and the
        values of a shard of it as coded."""
        b = self.config.block_size
        if isinstance(target, Segments):
            return target, target.padded_numel(b)
        if self._buffer_segments is None or self._buffer_segments.buffers[0] is not target:
            self._buffer_segments = Segments((target,), self.world_size)
        return self._buffer_segments, target.numel() // self.world_size

    def _payloads(self, base: torch.Tensor, rows: int, stride: int, numel: int) -> kernels.Payloads:
        layout = _Layout.of(numel, self.config.block_size)
        return kernels.Payloads(base, rows, stride, layout.n_blocks, HEADER.size, layout.groups, layout.regions)

    def _check_header(self, payload: torch.Tensor, out: torch.Tensor, numel: int, header, src_rank: int) -> int:
        """The payload's flags, once its header matches this codec, ``out`` and the payload's length."""
        source = f"from rank {src_rank}"
        if payload.dtype != torch.uint8 or payload.dim() != 1:
            raise ValueError(f"delta payload {source} must be a 1-D uint8 tensor, got {payload.dtype} "
                             f"{tuple(payload.shape)}")
        if payload.numel() < HEADER.size:
            check_length("delta", source, payload.numel(), HEADER.size, "less than its header's")
        if header is None:
            header = self.read_header(payload)
        magic, version, flags, _, block_size, n_changed, p_numel, nbytes = HEADER.unpack(header)
        check_format("delta", source, magic, version, MAGIC, VERSION)
        if block_size != self.config.block_size:
            raise ValueError(f"payload block size {block_size} != --delta-block-size {self.config.block_size}: "
                             f"every rank must use the same --delta-block-size")
        payload_dtype = torch.float16 if flags & FLAG_FP16 else torch.bfloat16
        if p_numel != numel or payload_dtype != out.dtype:
            raise ValueError(f"payload holds {p_numel} {payload_dtype} values, output buffer {numel} {out.dtype}")
        check_length("delta", source, payload.numel(), nbytes)
        if flags & (FLAG_KEYFRAME | FLAG_RAW):
            check_length("delta", source, nbytes, raw_nbytes(HEADER.size, numel), "(a raw one) holds values for")
        elif nbytes < _Layout.of(numel, block_size).regions + 3 * n_changed:
            check_length("delta", source, nbytes, _Layout.of(numel, block_size).regions + 3 * n_changed,
                         f"with {n_changed} changed blocks needs at least")
        return flags
