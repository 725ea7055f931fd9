"""CIERA: lossless cross-iteration exponent reuse for the parameter all-gather (arXiv 2609.04609).

Each rank splits its new bf16/fp16 shard into exponents and sign+mantissa, cuts it into blocks of
``block_size`` values and sends the exponents only of the blocks whose exponents changed since its
previous payload; sign+mantissa always travels. Change detection is either "compare" (the sender keeps
its previous exponents, 1 byte per value) or "hash" (the sender keeps the paper's 128-bit hash per
block: two independent SplitMix64-style 64-bit hashes, 16 bytes per block).

Receiver cache: the paper's ExpCache holds every other rank's exponents because ZeRO-3 frees gathered
parameters. Megatron's distributed optimizer keeps the whole parameter buffer resident, and the slice
that ``decode`` writes holds the source rank's previous values, so the previous exponents are read
from it and no extra receiver memory is needed.

Payload (uint8, little endian), format version 4: fixed-size sections first, the variable one last,
each section starting 16-byte aligned (zero padding) so that kernels write it with vector stores:
  header, 32 bytes:
    [0:2] magic b"CE" | [2] version | [3] flags (bit 0 keyframe, bit 1 exponents rANS-coded, bit 2 raw,
                                                 bit 3 the shard's last block changed)
    [4] log2(block_size) | [5] dtype (0 bf16, 1 fp16) | [6] log2(tile_blocks) | [7] zero
    [8:16] numel (i64) | [16:24] changed blocks (i64) | [24:32] exponent-section bytes (i64)
  bitmap: one bit per block (LSB first), ceil(nblocks / 8) bytes, zero-padded to a multiple of 16
  tile table: for each tile of tile_blocks blocks, the slot of its first changed block in the exponent
    section (i32; its changed blocks follow in block order), zero-padded to a multiple of 16
  sign+mantissa of all numel values, as a field of 1 + mant_bits (see pack_field; bf16: one byte per
    value), zero-padded to a multiple of 16
  exponents of the changed blocks in slot order (the tiles' runs in any order), as a field of exp_bits, or
    rANS-coded bytes (compression/ans.py) when that is smaller; the payload ends with this section. The
    shard's last block, if changed (flag bit 3), is left out of its tile's run and takes the last slot, with
    only its values' exponents (numel - (nblocks - 1) * block_size): no padding is sent
The tile table lets the CUDA encode place each tile's changed exponents in one pass, the tiles' runs in
the order their programs ran (kernels/ciera.py), so two encodes of the same shard may order them
differently; every order decodes to the same bits. The plain-PyTorch encode gives them in tile order.
A keyframe (first payload after construction or ``reset()``) marks every block changed. An empty
shard's payload is the header alone.
Raw payloads (version 4; ``compression/wire.py``): where the sections above would be larger than the raw values
(keyframes and dense encodes always, tiny shards, a last block mostly padding), the header (raw flag set, the
exponent-section field holding the values' 2 * numel bytes) is followed by the raw 16-bit values, so a payload
never exceeds raw + 32 bytes. The sender's state moves on as for a coded payload; a receiver needs none. The
length a header gives (``sec.exp + exp bytes``, or 32 + 2 * numel) is checked before any section is read.

CUDA path (bf16, block_size <= 8192, a 4-byte aligned shard): the codec keeps one payload buffer of the
largest size (every block changed) per shard size and returns a view of it, so a payload is valid only until the next
``encode`` of the same codec (compression/shard_gather.py copies it into its send buffer at once).
Encode: split kernel (sign+mantissa into the payload, exponents compared with and written over the
sender state, changed exponents into their slots, the tile table, changed flags and count), bitmap kernel;
the changed-block count (the payload size) reaches the host with the gather's size exchange
(``begin_encode``). Dense
encodes (raw exponents, keyframes and encodes after one where >= DENSE_MIN_CHANGED of the counted blocks
changed) mark every block changed: the split kernel writes the exponents straight into the payload's
exponent section, which in compare mode is the sender state itself, and the size is known on the host;
they count changed blocks on a sample (DENSE_SAMPLE_STRIDE), on both paths and in both modes.
Decode: one merge kernel reading the payload in place (the gather hands over the header; alone,
one sync reads it). Elsewhere (CPU, fp16, larger blocks) the same bytes come from plain PyTorch.
"""

import struct
import warnings
from dataclasses import dataclass

import torch

from compression import ans
from compression.codec import CastShard, EncodeStart, HostValues, ShardCodec, bytes_to_device, check_block_size
from compression.wire import WireFormatError, check_format, check_length, raw_nbytes
from kernels import ciera as kernels
from kernels.ciera import LAYOUTS, block_hashes, merge_blocks_reference, split_compare_reference

MAGIC = b"CE"
VERSION = 4
HEADER = struct.Struct("<2sBBBBBxqqq")  # magic, version, flags, log2(block), dtype, log2(tile), numel,
# changed, exp bytes
HEADER_BYTES = HEADER.size
ALIGN = 16  # every section starts 16-byte aligned
FLAG_KEYFRAME, FLAG_ANS, FLAG_RAW, FLAG_LAST = 1, 2, 4, 8
# Encodes with raw exponents after one in which at least this fraction of the blocks changed send every
# block's exponents ("dense"): the payload's exponent section is then the sender's compare state, written
# in place by the split kernel, written once instead of twice (state and slot), with no bitmap kernel and no
# host sync for the size. It costs at most 1% of the exponent bytes.
DENSE_MIN_CHANGED = 0.99
# A dense encode counts changed blocks on every DENSE_SAMPLE_STRIDE-th block only (its payload does not
# depend on them; the count decides whether the next encode is dense and feeds the statistics, scaled to
# all blocks): in compare mode the split kernel then reads 1/16 of the previous exponents instead of all,
# so a dense encode moves ~4.06 bytes per value instead of 5 (a copy: 4).
DENSE_SAMPLE_STRIDE = 16
DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1}
MAX_TILE_VALUES = 1 << 16  # a decoder refuses larger tiles (a merge program handles one tile)


@dataclass(frozen=True)
class CieraConfig:
    block_size: int = 512
    change_detect: str = "compare"
    exponent_coder: str = "raw"

    def __post_init__(self):
        check_block_size("--ciera-block-size", self.block_size, 64, 65536)
        if self.change_detect not in ("hash", "compare"):
            raise ValueError(f"--ciera-change-detect must be 'hash' or 'compare', got {self.change_detect!r}")
        if self.exponent_coder not in ("raw", "ans"):
            raise ValueError(f"--ciera-exponent-coder must be 'raw' or 'ans', got {self.exponent_coder!r}")


# ---- bit fields: an n-bit field is its low byte (if n >= 8) plus one packed bit plane per other bit.

def _pack_planes(v: torch.Tensor, nplanes: int) -> torch.Tensor:
    pad = -v.numel() % 8
    v = torch.cat([v, v.new_zeros(pad)]) if pad else v
    shifts = torch.arange(nplanes, device=v.device, dtype=torch.int32)[:, None]
    bits = ((v[None, :] >> shifts) & 1).view(nplanes, -1, 8)
    weights = torch.tensor([1 << i for i in range(8)], device=v.device, dtype=torch.int32)
    return (bits * weights).sum(-1).to(torch.uint8).view(-1)


def _unpack_planes(buf: torch.Tensor, n: int, nplanes: int) -> torch.Tensor:
    shifts = torch.arange(8, device=buf.device, dtype=torch.int32)
    bits = (buf.to(torch.int32).view(nplanes, -1)[..., None] >> shifts) & 1
    bits = bits.view(nplanes, -1)[:, :n]
    planes = torch.arange(nplanes, device=buf.device, dtype=torch.int32)[:, None]
    return (bits << planes).sum(0, dtype=torch.int32)


def field_nbytes(n: int, nbits: int) -> int:
    planes = nbits - 8 if nbits >= 8 else nbits
    return (n if nbits >= 8 else 0) + planes * (-(-n // 8))


def pack_field(v: torch.Tensor, nbits: int) -> torch.Tensor:
    """n values of ``nbits`` bits (any integer dtype) -> field_nbytes(n, nbits) uint8."""
    if nbits == 8 and v.dtype == torch.uint8:
        return v  # already the wire form: no copy
    v = v.to(torch.int32) & ((1 << nbits) - 1)
    if nbits < 8:
        return _pack_planes(v, nbits)
    low = (v & 0xFF).to(torch.uint8)
    return torch.cat([low, _pack_planes(v >> 8, nbits - 8)]) if nbits > 8 else low


def unpack_field(buf: torch.Tensor, n: int, nbits: int) -> torch.Tensor:
    """Inverse of ``pack_field``: int32 [n], or for 8-bit fields the uint8 bytes themselves (a view)."""
    if nbits < 8:
        return _unpack_planes(buf, n, nbits)
    if nbits == 8:
        return buf[:n]
    return buf[:n].to(torch.int32) | (_unpack_planes(buf[n:], n, nbits - 8) << 8)


# ---- payload sections

def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _pad(section: torch.Tensor) -> torch.Tensor:
    pad = _aligned(section.numel()) - section.numel()
    return torch.cat([section, section.new_zeros(pad)]) if pad else section


@dataclass(frozen=True)
class Sections:
    """Byte offsets of a payload's sections (the bitmap starts at HEADER_BYTES); ``capacity`` is the
    payload size when every block changed and the exponents are raw."""

    table: int
    sm: int
    exp: int
    capacity: int
    ntiles: int


def sections(numel: int, block_size: int, layout, tiles: int) -> Sections:
    """The sections of a payload of ``numel`` values in blocks of ``block_size``, tiles of ``tiles`` blocks."""
    nblocks = -(-numel // block_size)
    ntiles = -(-nblocks // tiles)
    table = HEADER_BYTES + _aligned(field_nbytes(nblocks, 1))
    sm = table + _aligned(4 * ntiles)
    exp = sm + _aligned(field_nbytes(numel, layout.sm_bits))
    return Sections(table, sm, exp, exp + field_nbytes(nblocks * block_size, layout.exp_bits), ntiles)


def _layout(dtype: torch.dtype):
    if dtype not in LAYOUTS:
        raise ValueError(f"--param-gather-compression ciera needs bf16 or fp16 parameters, got {dtype}; "
                         "use --param-gather-compression none or delta for other dtypes")
    return LAYOUTS[dtype]


def exponent_count(n: int, block_size: int, n_changed: int, last_changed: bool) -> int:
    """Exponents a payload sends: a block's per changed block, the last block's only for its values."""
    return n_changed * block_size - (-n % block_size if last_changed else 0)


def _header(flags: int, block_size: int, dtype, numel: int, n_changed: int, exp_bytes: int) -> torch.Tensor:
    """The 32 header bytes of a payload this process encodes (its tiles: ``kernels.tile_blocks``), on the CPU."""
    packed = HEADER.pack(MAGIC, VERSION, flags, block_size.bit_length() - 1, DTYPE_CODES[dtype],
                         kernels.tile_blocks(block_size).bit_length() - 1, numel, n_changed, exp_bytes)
    return torch.frombuffer(bytearray(packed), dtype=torch.uint8)


# ---- the codec


@dataclass
class _SplitBlocks:
    """A fused encode between its kernels and its header (``CieraCodec._split_fused``)."""

    payload: torch.Tensor  # the codec's buffer: every section written, the header as for raw exponents
    sec: "Sections"
    nblocks: int
    size: object  # the payload's size with raw exponents: an int (dense), or an int64 [1] on the device
    n_changed: HostValues  # counted blocks whose exponents changed (or hashed as changed), on the way to the host
    # (sparse: then the size and whether the last block changed)
    counted: int  # blocks n_changed counts: all, or a sample on dense encodes
    dtype: torch.dtype
    keyframe: bool
    dense: bool  # every block's exponents sent, in place of the payload's exponent section
    bits: torch.Tensor  # the shard (int16), for a raw payload


class CieraCodec(ShardCodec):
    """One instance per bucket on every rank; encodes this rank's shard, decodes every rank's payload.
    ``last_stats`` holds the block counts of the last ``encode`` (see compression/shard_gather.py).
    On the CUDA path a returned payload is a view of the codec's buffer, valid until its next encode."""

    name = "ciera"
    lossless = True
    header_nbytes = HEADER_BYTES
    stat_names = ("blocks_total", "blocks_changed")

    def __init__(self, config: CieraConfig, world_size: int, rank: int):
        self.config = config
        self.world_size = world_size
        self.rank = rank
        self.last_stats = {}
        self._payload = None  # CUDA path's payload buffer: scratch, kept across reset()
        self._dense_sections = None  # CUDA path's (key, bitmap and tile table) of a dense payload
        self._device_headers = {}  # CUDA path's headers (or templates) known on the host, by their fields
        self.reset()

    def reset(self) -> None:
        self._prev = None  # previous exponents ("compare") or block hashes ("hash")
        self._numel = None
        self._dense_next = False  # the next encode sends every block's exponents (DENSE_MIN_CHANGED)
        self._synced = set()  # source ranks whose keyframe this rank has decoded

    def _hash_changed(self, hashes, keyframe: bool):
        """Hash mode: the blocks whose hash differs from the previous one (None on a keyframe)."""
        changed = None if keyframe else (hashes != self._prev).any(dim=1)
        self._prev = hashes
        return changed

    def _exponent_section(self, exp_changed, layout):
        raw = pack_field(exp_changed, layout.exp_bits)
        if self.config.exponent_coder == "ans" and exp_changed.numel():
            coded = ans.encode(exp_changed)
            if coded.numel() < raw.numel():
                return coded, FLAG_ANS
        return raw, 0

    def encode(self, shard: torch.Tensor) -> torch.Tensor:
        start = self.begin_encode(shard)
        if not isinstance(start.state, _SplitBlocks):
            return start.state
        return self._finish_fused(start.state)  # waits for the kernels

    def begin_encode(self, shard: torch.Tensor) -> EncodeStart:
        """On the fused path with raw exponents, the payload size and header stay on the device until
        ``finish_encode``; otherwise (the reference, ANS, which codes on the host) the whole encode."""
        if isinstance(shard, CastShard):
            shard = shard.cast()
        layout = _layout(shard.dtype)
        n = shard.numel()
        if self._prev is not None and n != self._numel:
            raise RuntimeError(f"CieraCodec encodes one bucket shard of fixed size: got {n} values after "
                               f"{self._numel}; call reset() on every rank first")
        self._numel = n
        bits = shard.reshape(-1).view(torch.int16)
        keyframe = self._prev is None
        dense = self._dense_next and not keyframe
        if not kernels.use_triton(bits, self.config.block_size, layout):
            if bits.is_cuda and bits.data_ptr() % 4 and keyframe:
                warnings.warn(f"CIERA's fused CUDA kernels read pairs of values: a shard at an odd element offset "
                              f"({bits.numel()} values) is coded by the PyTorch path (the same bytes, slower)")
            payload = self._encode_reference(bits, shard.dtype, layout, keyframe, dense)
        else:
            raw = self.config.exponent_coder == "raw"
            split = self._split_fused(bits, shard.dtype, layout, keyframe, dense or (keyframe and raw))
            if raw and split.dense:  # larger than the raw values: sent raw, a size the host knows
                header = self._device_header(FLAG_RAW | (FLAG_KEYFRAME if keyframe else 0), shard.dtype, n,
                                             split.nblocks, 2 * n)
                return EncodeStart(raw_nbytes(HEADER_BYTES, n), header, split)
            if raw:  # the kernels wrote the header and the size (the raw values' where those are smaller)
                return EncodeStart(split.size, split.payload[:HEADER_BYTES], split)
            payload = self._finish_fused(split)
        return EncodeStart(payload.numel(), payload[:HEADER_BYTES], payload)

    def finish_encode(self, start: EncodeStart, out: torch.Tensor) -> None:
        if not isinstance(start.state, _SplitBlocks):
            return super().finish_encode(start, out)
        # n_changed landed with the size the caller waited for (a dense payload's size needed no wait:
        # there _finish_fused waits for the split kernel's count)
        self._finish_fused(start.state, out)

    def _encode_reference(self, bits, dtype, layout, keyframe: bool, dense: bool) -> torch.Tensor:
        """Plain PyTorch: the CPU path and the oracle of the fused one."""
        B, n = self.config.block_size, bits.numel()
        compare = self.config.change_detect == "compare"
        exp, sm, changed = split_compare_reference(bits, self._prev if compare else None, B, layout)
        if compare:
            self._prev = exp
        else:
            changed = self._hash_changed(block_hashes(exp, B), keyframe)
        if keyframe:
            changed = torch.ones(exp.numel() // B, dtype=torch.bool, device=bits.device)
        counted = changed[::DENSE_SAMPLE_STRIDE] if dense else changed
        self._count_changed(keyframe, int(counted.sum()), counted.numel(), changed.numel())
        if dense:
            changed = torch.ones_like(changed)
        last = bool(changed.numel()) and bool(changed[-1])
        exp_changed = exp.view(-1, B)[changed].view(-1)
        n_changed = exp_changed.numel() // B
        exp_changed = exp_changed[:exponent_count(n, B, n_changed, last)]  # tile order: the last block comes last
        exp_section, coder_flag = self._exponent_section(exp_changed, layout)
        flags = coder_flag | (FLAG_KEYFRAME if keyframe else 0) | (FLAG_LAST if last else 0)
        sec = sections(n, B, layout, kernels.tile_blocks(B))
        if sec.exp + exp_section.numel() > raw_nbytes(HEADER_BYTES, n):  # the raw values are smaller
            return self._raw_payload(flags & FLAG_KEYFRAME, dtype, bits, n_changed)
        header = _header(flags, B, dtype, n, n_changed, exp_section.numel())
        table = kernels.tile_slots_reference(changed, kernels.tile_blocks(B))
        return torch.cat([header.to(bits.device), _pad(pack_field(changed, 1)), _pad(table.view(torch.uint8)),
                          _pad(pack_field(sm[:n], layout.sm_bits)), exp_section])

    def _raw_payload(self, flags: int, dtype, bits, n_sent: int, out=None) -> torch.Tensor:
        """The header (raw flag set) and the raw values, into ``out`` if given."""
        n = bits.numel()
        header = _header(flags | FLAG_RAW, self.config.block_size, dtype, n, n_sent, 2 * n)
        if out is None:
            return torch.cat([header.to(bits.device), bits.reshape(-1).view(torch.uint8)])
        out[:HEADER_BYTES].copy_(header.pin_memory() if out.is_cuda else header, non_blocking=True)
        out[HEADER_BYTES:].copy_(bits.reshape(-1).view(torch.uint8))
        return out

    def _count_changed(self, keyframe: bool, changed: int, counted: int, total: int) -> None:
        """Statistics of an encode (blocks whose exponents changed, even where all were sent: ``changed``
        of ``counted`` blocks, scaled to the ``total``) and the dense choice of the next one."""
        estimate = (changed * total + counted // 2) // counted if counted else 0
        self.last_stats = {"blocks_total": total, "blocks_changed": estimate}
        self._dense_next = (self.config.exponent_coder == "raw" and not keyframe
                            and changed >= DENSE_MIN_CHANGED * counted)

    @staticmethod
    def payload_buffer_bytes(shard: torch.Tensor, block_size: int) -> int:
        """Bytes of the payload buffer the codec keeps for ``shard`` (the CUDA path's; 0 elsewhere, where each
        payload is a fresh tensor)."""
        layout = _layout(shard.dtype)
        if not kernels.use_triton(shard.reshape(-1).view(torch.int16), block_size, layout):
            return 0
        return sections(shard.numel(), block_size, layout, kernels.tile_blocks(block_size)).capacity

    def _payload_buffer(self, capacity: int, device) -> torch.Tensor:
        if self._payload is None or self._payload.numel() != capacity or self._payload.device != device:
            self._payload = torch.zeros(capacity, dtype=torch.uint8, device=device)  # padding stays zero
        return self._payload

    def _split_fused(self, bits, dtype, layout, keyframe: bool, dense: bool) -> "_SplitBlocks":
        """bf16 on CUDA: the kernels write the sections in place of the payload buffer, and its header as for raw
        exponents.
        ``dense``: every block's exponents go straight into the payload's exponent section, which in
        compare mode is then the sender state itself (compared and rewritten in place); otherwise the
        changed blocks' exponents go to their slots there (and in compare mode into the sender state)."""
        B, n = self.config.block_size, bits.numel()
        sec = sections(n, B, layout, kernels.tile_blocks(B))
        payload = self._payload_buffer(sec.capacity, bits.device)
        npad = -(-n // B) * B
        in_payload = payload[sec.exp:sec.exp + npad]
        compare = self.config.change_detect == "compare"
        if compare:
            if keyframe and not dense:
                self._prev = torch.empty(npad, dtype=torch.uint8, device=bits.device)
            elif dense and not keyframe and self._prev.data_ptr() != in_payload.data_ptr():
                in_payload.copy_(self._prev)  # the state moves into the payload...
            elif not dense and self._prev.data_ptr() == in_payload.data_ptr():
                self._prev = self._prev.clone()  # ...and out of it: the changed exponents take their slots there
            if dense:
                self._prev = in_payload
            exp = self._prev
        else:
            exp = in_payload if dense else None  # sparse hash encodes keep no exponents
        if not compare and keyframe:
            self._prev = torch.empty(npad // B, 2, dtype=torch.int64, device=bits.device)
        sampled = dense and not keyframe
        compact = None if dense else (payload[sec.exp:], payload[sec.table:sec.sm].view(torch.int32))
        # hash mode: the kernel compares the blocks' hashes with the previous ones and writes them over them
        flags, n_changed = kernels.split_blocks(
            bits, exp, not keyframe, payload[sec.sm:], B, None if compare else self._prev,
            DENSE_SAMPLE_STRIDE if sampled else 1, compact)
        nblocks = flags.numel()
        flag = FLAG_KEYFRAME if keyframe else 0
        if dense:
            payload[HEADER_BYTES:sec.sm].copy_(self._dense_table(nblocks, sec, bits.device))
            payload[:HEADER_BYTES].copy_(self._device_header(flag, dtype, n, nblocks))
            size = sec.capacity
        else:
            sizes = torch.empty(3, dtype=torch.int64, device=bits.device)
            template = self._device_header(flag, dtype, n, 0)
            kernels.finish_split(flags, n_changed, payload[HEADER_BYTES:sec.table], template, payload[:HEADER_BYTES],
                                 sizes, sec.exp, B, raw_nbytes(HEADER_BYTES, n), FLAG_RAW, FLAG_LAST, bits,
                                 payload[sec.exp:])
            n_changed, size = sizes, sizes[1:2]
        counted = -(-nblocks // DENSE_SAMPLE_STRIDE) if sampled else nblocks
        return _SplitBlocks(payload, sec, nblocks, size, HostValues(n_changed), counted, dtype, keyframe, dense, bits)

    def _device_header(self, flags: int, dtype, n: int, n_sent: int, exp_bytes: int = None) -> torch.Tensor:
        """The header of a payload sending ``n_sent`` blocks' raw exponents (or ``exp_bytes`` bytes), on the device
        (kept: a codec needs a few; a sparse encode's kernel takes the first 16 bytes of ``n_sent`` = 0's and writes
        the rest)."""
        B = self.config.block_size
        exp_bytes = n_sent * B if exp_bytes is None else exp_bytes
        key = (flags, dtype, n, n_sent, exp_bytes, kernels.tile_blocks(B), self._payload.device)
        if key not in self._device_headers:
            header = _header(flags, B, dtype, n, n_sent, exp_bytes).numpy().tobytes()
            self._device_headers[key] = bytes_to_device(header, self._payload.device)
        return self._device_headers[key]

    def _dense_table(self, nblocks: int, sec: Sections, device) -> torch.Tensor:
        """The bitmap and tile-table sections with every block set and every tile at its own slots (kept: they
        are the same for every dense payload)."""
        tiles = kernels.tile_blocks(self.config.block_size)
        key = (nblocks, tiles, device)
        if self._dense_sections is None or self._dense_sections[0] != key:
            every = torch.ones(nblocks, dtype=torch.bool)
            table = kernels.tile_slots_reference(every, tiles)
            sections_ = torch.cat([_pad(pack_field(every.to(torch.int32), 1)), _pad(table.view(torch.uint8))])
            self._dense_sections = (key, sections_.to(device))
        return self._dense_sections[1]

    def _finish_fused(self, split: "_SplitBlocks", out: torch.Tensor = None) -> torch.Tensor:
        """The exponent section (ANS-coded if asked) and the header of a ``_split_fused`` payload, or the raw values
        where those are smaller (the choice the kernels made for raw exponents); into ``out`` if given."""
        B, n, layout, payload, sec = self.config.block_size, self._numel, _layout(split.dtype), split.payload, split.sec
        values = split.n_changed.get()
        changed = values[0]
        n_sent, last = (split.nblocks, True) if split.dense else (changed, bool(values[2]))
        raw = payload[sec.exp:sec.exp + exponent_count(n, B, n_sent, last)]
        exp_section, coder_flag = self._exponent_section(raw, layout)
        self._count_changed(split.keyframe, changed, split.counted, split.nblocks)
        if sec.exp + exp_section.numel() > raw_nbytes(HEADER_BYTES, n):
            return self._raw_payload(FLAG_KEYFRAME if split.keyframe else 0, split.dtype, split.bits, n_sent, out)
        if coder_flag:  # the header the kernels wrote is for raw exponents
            raw[:exp_section.numel()].copy_(exp_section)
            header = _header(coder_flag | (FLAG_KEYFRAME if split.keyframe else 0) | (FLAG_LAST if last else 0), B,
                             split.dtype, n, n_sent, exp_section.numel())
            payload[:HEADER_BYTES].copy_(header.pin_memory() if payload.is_cuda else header, non_blocking=True)
        if out is not None:
            out.copy_(payload[:sec.exp + exp_section.numel()])
        return payload[:sec.exp + exp_section.numel()]

    def _parse_header(self, src_rank: int, payload: torch.Tensor, out: torch.Tensor, header):
        """The header's fields, once it matches this codec and ``out``, and the payload has the length it gives."""
        source = f"from rank {src_rank}"
        if payload.numel() < HEADER_BYTES:
            check_length("CIERA", source, payload.numel(), HEADER_BYTES, "less than its header's")
        if header is None:
            header = self.read_header(payload)
        magic, version, flags, log2_block, dtype_code, log2_tile, numel, n_changed, exp_bytes = HEADER.unpack(header)
        check_format("CIERA", source, magic, version, MAGIC, VERSION)
        if 1 << log2_block != self.config.block_size or dtype_code != DTYPE_CODES[out.dtype] or numel != out.numel():
            raise WireFormatError(f"CIERA payload {source} (block 2^{log2_block}, dtype code {dtype_code}, numel "
                                  f"{numel}) does not match this rank's bucket slice (block {self.config.block_size}, "
                                  f"{out.dtype}, numel {out.numel()}): every rank must use the same "
                                  f"--ciera-block-size and buckets")
        if (1 << log2_tile) * self.config.block_size > MAX_TILE_VALUES:
            raise WireFormatError(f"CIERA payload {source} has tiles of 2^{log2_tile} blocks of "
                                  f"{self.config.block_size} values, more than {MAX_TILE_VALUES} values")
        if flags & FLAG_RAW:
            check_length("CIERA", source, exp_bytes, 2 * numel, "(a raw one) holds values for")
            check_length("CIERA", source, payload.numel(), raw_nbytes(HEADER_BYTES, numel))
        else:
            sec = sections(numel, self.config.block_size, _layout(out.dtype), 1 << log2_tile)
            check_length("CIERA", source, payload.numel(), sec.exp + exp_bytes)
        if not flags & (FLAG_KEYFRAME | FLAG_RAW) and src_rank not in self._synced:
            raise RuntimeError(f"CIERA delta payload from rank {src_rank} before any keyframe: "
                               "all ranks must reset() together")
        return flags, numel, n_changed, exp_bytes, 1 << log2_tile

    def decode(self, src_rank: int, payload: torch.Tensor, out: torch.Tensor, header: bytes = None) -> None:
        layout = _layout(out.dtype)
        flags, n, n_changed, exp_bytes, tiles = self._parse_header(src_rank, payload, out, header)
        B = self.config.block_size
        bits = out.view(torch.int16)
        if flags & FLAG_RAW:
            bits.view(torch.uint8).copy_(payload[HEADER_BYTES:])
            self._synced.add(src_rank)
            return
        sec = sections(n, B, layout, tiles)
        exp_section = payload[sec.exp:]
        count = exponent_count(n, B, n_changed, bool(flags & FLAG_LAST))
        exps = ans.decode(exp_section, count) if flags & FLAG_ANS else None
        if kernels.use_triton(bits, B, layout):
            exps = exp_section if exps is None else exps
            kernels.merge_payload(bits, payload[HEADER_BYTES:sec.table], payload[sec.table:sec.sm],
                                  payload[sec.sm:sec.exp], exps, n_changed, B, tiles)
        else:
            if exps is None:
                exps = unpack_field(exp_section, count, layout.exp_bits).to(torch.uint8)
            exps = torch.nn.functional.pad(exps, (0, n_changed * B - count))  # whole blocks for the merge
            self._merge_reference(payload, sec, tiles, exps, bits, layout, n_changed)
        self._synced.add(src_rank)

    def _merge_reference(self, payload, sec: Sections, tiles: int, exps, bits, layout, n_changed: int) -> None:
        B, n = self.config.block_size, bits.numel()
        nblocks = -(-n // B)
        changed = unpack_field(payload[HEADER_BYTES:HEADER_BYTES + field_nbytes(nblocks, 1)], nblocks, 1).bool()
        tile_slots = payload[sec.table:sec.table + 4 * sec.ntiles].clone().view(torch.int32)  # (aligned by the clone)
        slots = kernels.block_slots_reference(changed, tile_slots, tiles, n_changed)
        sm_field = payload[sec.sm:sec.sm + field_nbytes(n, layout.sm_bits)]
        sm = unpack_field(sm_field, n, layout.sm_bits).to(layout.sm_dtype)
        bits.copy_(merge_blocks_reference(bits, changed, slots, exps, sm, B, layout))
