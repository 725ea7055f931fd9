"""Block kernels of the lossless delta codec (``compression/delta.py`` owns the wire format).

Values are 16-bit patterns (bf16 or fp16 viewed as int16). Each pattern ``u`` is mapped to an
ordered integer (negative floats reversed, so -0.0 and +0.0 are neighbours and float order is
integer order); the per-value delta ``d = o_new - o_old`` needs 17 bits and is zigzagged to
``z = 2|d| - (d < 0)``. A changed value (``z > 0``) carries ``v = z - 1`` (17 bits at most).
Per block of ``B`` values:

- ``code``: 0 if nothing changed, else ``width + 1``;
- ``bitmap``: ``B / 8`` bytes, bit ``i % 8`` of byte ``i // 8`` set if value ``i`` changed; the
  decoder gets the block's ``count`` of changed values by popcount;
- ``exc_width``: the bit length of the block's largest ``v`` (0..17);
- ``n_esc`` and the value stream: each changed value, in order, in a ``width``-bit slot; the slot
  value ``2**width - 1`` is an escape whose ``v`` follows the slots in an exception list of
  ``exc_width``-bit entries (escapes in order). So ``count * width + exc_width * n_esc`` bits,
  little-endian (bit ``k`` of the stream is bit ``k % 8`` of byte ``k // 8``), padded to whole bytes.

``width`` minimizes ``count * width + exc_width * n_esc(width)`` over 1..17 (the smallest on ties;
17 never escapes since ``v <= 131069``), and is 0 when every changed value has ``v = 0``. Deltas
are heavy-tailed (mostly +-1 ulp, but a weight crossing zero moves ~2**15), so a per-block maximum
width would let one outlier set the cost of the whole block; escapes cap that at ``exc_width``
bits, which is 17 only in the few blocks that hold such an outlier (version 1 of the format spent
17 bits on every escape: 12% more bytes at lr 1e-4, ``docs/delta.md``).

Two implementations give identical bytes (``tests/test_delta.py`` checks it):

- PyTorch references (the CPU path and the test oracle): ``analyze_blocks_reference`` (codes,
  counts, escapes, bitmaps, slot and exception values compacted per block; copies ``new`` into
  ``prev``), ``pack_values_reference`` (bit-packs the changed blocks' streams at byte offsets from a
  prefix sum) and ``unpack_values_reference`` (applies the deltas to ``out`` in place).
- Triton kernels (the CUDA path, one host sync per encode and per decode): ``encode_blocks`` codes
  every block into its own fixed-size row and updates ``prev`` in the same pass; ``gather_records``
  moves the changed rows into the payload at offsets from prefix sums; ``stream_sizes`` and
  ``decode_blocks`` decode in place.
"""

import struct
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the references run everywhere
    triton = None

MAX_WIDTH = 17  # bits of v = z - 1 < 2**17; also the width of an exception entry
WORD_READ_SLACK = 3  # decode_blocks reads the value streams as 32-bit words: up to 3 bytes past their end


@dataclass
class BlockAnalysis:
    slots: torch.Tensor  # int32 [n_blocks, B]: row b starts with its changed values' slot values
    exceptions: torch.Tensor  # int32 [n_blocks, B]: row b starts with its escaped values' v
    codes: torch.Tensor  # uint8 [n_blocks]: 0 = unchanged, else width + 1
    counts: torch.Tensor  # int32 [n_blocks]: changed values per block
    n_esc: torch.Tensor  # int32 [n_blocks]: escaped values per block
    exc_widths: torch.Tensor  # uint8 [n_blocks]: bits per exception entry
    bitmaps: torch.Tensor  # uint8 [n_blocks, B // 8]


def stream_nbytes(counts, codes, n_esc, exc_widths):
    """Bytes of each block's value stream (int64), from its count, code, escapes and exception width."""
    width = (codes.to(torch.int64) - 1).clamp(min=0)
    return (counts.to(torch.int64) * width + exc_widths.to(torch.int64) * n_esc.to(torch.int64) + 7) // 8


def use_triton(t: torch.Tensor, triton_flag) -> bool:
    """``triton_flag``: None picks Triton on CUDA tensors and the PyTorch reference elsewhere."""
    if triton_flag is None:
        return t.is_cuda and triton is not None
    if triton_flag and triton is None:
        raise RuntimeError("Triton is not installed; pass triton=None to use the PyTorch reference")
    return triton_flag


# --- plain-PyTorch reference -------------------------------------------------------------------

def to_ordered(u16: torch.Tensor) -> torch.Tensor:
    """int16 bit patterns -> int32 in 0..65535, monotone in the float value."""
    u = u16.to(torch.int32) & 0xFFFF
    return torch.where(u >= 0x8000, 0xFFFF - u, u + 0x8000)


def from_ordered(o: torch.Tensor) -> torch.Tensor:
    u = torch.where(o >= 0x8000, o - 0x8000, 0xFFFF - o)
    return torch.where(u >= 0x8000, u - 0x10000, u).to(torch.int16)


def _blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """int16 [numel] -> ordered int32 [n_blocks, B], zero-padded (pads never change)."""
    n_blocks = -(-x.numel() // block_size)
    padded = torch.zeros(n_blocks * block_size, dtype=torch.int32, device=x.device)
    padded[: x.numel()] = to_ordered(x)
    return padded.view(n_blocks, block_size)


def _escape_code(width: torch.Tensor) -> torch.Tensor:
    return (torch.ones_like(width) << width) - 1


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """bool [..., 8k] -> uint8 [..., k], little-endian bit order."""
    weights = 1 << torch.arange(8, device=bits.device, dtype=torch.int32)
    return (bits.view(*bits.shape[:-1], bits.shape[-1] // 8, 8).to(torch.int32) * weights).sum(-1).to(torch.uint8)


def _bit_length(x: torch.Tensor) -> torch.Tensor:
    """Bits of each non-negative x < 2**17 (0 for 0)."""
    return sum((x >= (1 << k)).to(torch.int32) for k in range(MAX_WIDTH))


def _choose_width(v, changed, counts):
    """Per block: the width of least ``count * width + exc_width * n_esc`` (0 if all v are 0), n_esc
    and ``exc_width``."""
    widths = torch.arange(1, MAX_WIDTH + 1, device=v.device)
    exc_width = _bit_length(torch.where(changed, v, 0).amax(1))
    n_esc = torch.stack([(changed & (v >= (1 << w) - 1)).sum(1) for w in range(1, MAX_WIDTH + 1)], 1)
    best = (counts.unsqueeze(1).to(torch.int64) * widths + exc_width.unsqueeze(1) * n_esc).argmin(1)
    trivial = exc_width == 0
    width = torch.where(trivial, 0, widths[best])
    n_esc = torch.where(trivial, 0, n_esc.gather(1, best.unsqueeze(1)).squeeze(1))
    return width.to(torch.int32), n_esc.to(torch.int32), exc_width


def _compact(values, keep):
    """Row-wise stream compaction: kept values to the front of each row, zeros after."""
    out = torch.zeros_like(values)
    rows = torch.arange(values.shape[0], device=values.device).unsqueeze(1).expand_as(values)
    out[rows[keep], (keep.cumsum(1) - 1)[keep]] = values[keep]
    return out


def analyze_blocks_reference(prev: torch.Tensor, new: torch.Tensor, block_size: int) -> BlockAnalysis:
    d = _blocks(new, block_size) - _blocks(prev, block_size)
    z = (d << 1) ^ (d >> 31)
    changed = z != 0
    v = z - 1
    counts = changed.sum(1, dtype=torch.int32)
    width, n_esc, exc_width = _choose_width(v, changed, counts)
    codes = torch.where(counts > 0, width + 1, 0).to(torch.uint8)
    escape = _escape_code(width).unsqueeze(1)
    escaped = changed & (width.unsqueeze(1) > 0) & (v >= escape)
    slots = _compact(torch.minimum(v, escape), changed)
    prev.copy_(new)
    return BlockAnalysis(slots, _compact(v, escaped), codes, counts, n_esc, exc_width.to(torch.uint8),
                         _pack_bits(changed))


def _scatter_bits(bits, start, values, width, present) -> None:
    """bits[start + k] = bit k of each present value, for k < width."""
    k = torch.arange(MAX_WIDTH, device=bits.device)
    on = present.unsqueeze(-1) & (k < width.unsqueeze(-1)) & (((values.unsqueeze(-1) >> k) & 1) == 1)
    bits[(start.unsqueeze(-1) + k)[on]] = True


def pack_values_reference(a: BlockAnalysis, changed_blocks, value_offsets, values: torch.Tensor) -> None:
    """Write each changed block's stream at its byte offset in ``values`` (uint8, rewritten here)."""
    width = (a.codes[changed_blocks].to(torch.int64) - 1).unsqueeze(1)
    counts = a.counts[changed_blocks].to(torch.int64).unsqueeze(1)
    n_esc = a.n_esc[changed_blocks].to(torch.int64).unsqueeze(1)
    exc_width = a.exc_widths[changed_blocks].to(torch.int64).unsqueeze(1)
    i = torch.arange(a.slots.shape[1], device=values.device)
    base = value_offsets.unsqueeze(1) * 8
    bits = torch.zeros(values.numel() * 8, dtype=torch.bool, device=values.device)
    _scatter_bits(bits, base + i * width, a.slots[changed_blocks], width, i < counts)
    _scatter_bits(bits, base + counts * width + i * exc_width, a.exceptions[changed_blocks], exc_width, i < n_esc)
    values.copy_(_pack_bits(bits))


def _read_bits(padded, bitpos, width):
    """``width`` (<= 17) bits at stream bit ``bitpos``: a shift <= 7 plus 17 bits spans <= 3 bytes."""
    byte = (bitpos >> 3).clamp(min=0)
    word = padded[byte] | (padded[byte + 1] << 8) | (padded[byte + 2] << 16)
    return (word >> (bitpos & 7)) & _escape_code(width)


def unpack_values_reference(out, changed_blocks, codes, exc_widths, bitmaps, value_offsets, values,
                            block_size) -> None:
    """Apply the changed blocks' deltas to ``out`` (int16 view holding the previous values)."""
    i = torch.arange(block_size, device=out.device)
    changed = ((bitmaps.to(torch.int32).repeat_interleave(8, 1) >> (i % 8)) & 1) == 1
    width = (codes[changed_blocks].to(torch.int64) - 1).unsqueeze(1)
    exc_width = exc_widths.to(torch.int64).unsqueeze(1)
    base = value_offsets.unsqueeze(1) * 8
    padded = torch.cat([values, values.new_zeros(3)]).to(torch.int64)
    slot = _read_bits(padded, base + (changed.cumsum(1) - 1) * width, width)
    escaped = changed & (width > 0) & (slot == _escape_code(width))
    exc_pos = base + changed.sum(1, keepdim=True) * width + (escaped.cumsum(1) - 1) * exc_width
    z = torch.where(escaped, _read_bits(padded, exc_pos, exc_width), slot) + 1
    d = (z >> 1) ^ -(z & 1)
    idx = changed_blocks.unsqueeze(1) * block_size + i
    keep = changed & (idx < out.numel())
    flat_idx = idx[keep]
    out[flat_idx] = from_ordered(to_ordered(out[flat_idx]) + d[keep].to(torch.int32))


# --- Triton kernels ----------------------------------------------------------------------------
#
# The CUDA path needs one host sync per encode (the payload size) and one per decode (the header):
#   encode: _encode_kernel (every block: code, counts, bitmap and value stream into the block's
#           fixed-size row of ``records``; updates ``prev``) -> prefix sums (torch) -> size sync ->
#           _gather_kernel (codes, n_esc, bitmaps and streams of changed blocks into the payload).
#   decode: header sync -> _stream_sizes_kernel (popcounts) -> prefix sum -> _decode_kernel.
# _gather_kernel and _stream_sizes_kernel take a tile of blocks per program (one block each was
# latency bound: a few live bytes per program). The others run one program per block of B values
# with B >= 32 * num_warps lanes: with fewer lanes than threads
# (B = 64 under Triton's default 4 warps) two threads hold each value, and one thread's in-place
# store can overtake the other's load of the same value. A barrier also separates the last read of
# an updated buffer from the write to it.

if triton is not None:

    @triton.jit
    def _ordered(u):
        return tl.where(u >= 0x8000, 0xFFFF - u, u + 0x8000)

    @triton.jit
    def _bit_lengths(x):
        """Bits of each 0 <= x < 2**24 (0 for 0): the exponent field of x as an exact fp32."""
        return tl.where(x > 0, (x.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 126, 0)

    @triton.jit
    def _best_width(z):
        """Width of least ``count * width + exc_width * n_esc(width)`` over 1..17, the smallest on ties (0
        if every z <= 1), its n_esc, count and exc_width (bits of the largest v). ``n_esc(w)`` counts the
        values with ``v >= 2**w - 1``, i.e. ``z >= 2**w``, i.e. bit length > w: all of them come from one
        histogram of bit lengths (warp ballots), not a block reduction per candidate width."""
        exc_width = _bit_lengths(tl.max(tl.maximum(z - 1, 0), axis=0))
        hist = tl.histogram(_bit_lengths(z), 32)
        w = tl.arange(0, 32)
        n_esc = z.shape[0] - tl.cumsum(hist, axis=0)  # [w]: values with bit length > w
        count = tl.sum(tl.where(w == 0, n_esc, 0), axis=0)
        cost = tl.where((w >= 1) & (w <= 17), count * w + exc_width * n_esc, 1 << 30)
        width = tl.argmin(cost, axis=0, tie_break_left=True)
        best_esc = tl.sum(tl.where(w == width, n_esc, 0), axis=0)
        trivial = tl.sum(tl.where(w == 1, n_esc, 0), axis=0) == 0
        return tl.where(trivial, 0, width), tl.where(trivial, 0, best_esc), count, exc_width

    @triton.jit
    def _or_bits(stream_ptr, value, bitpos, present):
        """OR each present value (< 2**17) into the 32-bit stream words at bit ``bitpos``: its shifted 64-bit
        window spans word ``bitpos >> 5`` and possibly the next. Relaxed atomics (the L2 combines them): no
        scan to give each word one writer, and lanes whose bits are all zero (v = 0: a third of the changed
        values) issue nothing."""
        word = stream_ptr + (bitpos >> 5)
        placed = value.to(tl.int64) << (bitpos & 31)
        lo, hi = placed.to(tl.int32), (placed >> 32).to(tl.int32)
        tl.atomic_or(word, lo, mask=present & (lo != 0), sem="relaxed")
        tl.atomic_or(word + 1, hi, mask=present & (hi != 0), sem="relaxed")

    @triton.jit
    def _encode_kernel(prev_ptr, new_ptr, numel, codes_ptr, counts_ptr, n_esc_ptr, exc_widths_ptr, nbytes_ptr,
                       records_ptr, BLOCK: tl.constexpr, RECORD_WORDS: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, BLOCK)
        idx = b * BLOCK + i
        inside = idx < numel
        new16 = tl.load(new_ptr + idx, mask=inside, other=0)
        old = tl.load(prev_ptr + idx, mask=inside, other=0)
        d = _ordered(new16.to(tl.int32) & 0xFFFF) - _ordered(old.to(tl.int32) & 0xFFFF)
        z = (d << 1) ^ (d >> 31)
        changed = z != 0
        v = z - 1
        width, n_esc, count, exc_width = _best_width(z)
        escape = (1 << width) - 1
        escaped = changed & (width > 0) & (v >= escape)
        ranks = tl.cumsum(changed.to(tl.int32) | (escaped.to(tl.int32) << 16), axis=0)  # both < 2**14
        exc_start = count * width
        nbits = exc_start + exc_width * n_esc
        record = records_ptr + b * RECORD_WORDS
        bitmap = tl.sum(tl.reshape(changed.to(tl.int32), (BLOCK // 32, 32)) << tl.arange(0, 32)[None, :], axis=1)
        tl.store(record + tl.arange(0, BLOCK // 32), bitmap)
        # the stream's live words are zeroed here and every value ORs its bits in after the barrier
        stream = record + BLOCK // 32
        tl.store(stream + i, tl.zeros([BLOCK], dtype=tl.int32), mask=i < (nbits + 31) // 32)  # ceil(17 B / 32) < B
        tl.debug_barrier()  # every thread has read prev before it is overwritten, and the zeros are stored
        tl.store(prev_ptr + idx, new16, mask=inside)
        slot_at = ((ranks & 0xFFFF) - 1) * width  # inclusive ranks
        _or_bits(stream, tl.minimum(v, escape), slot_at, changed)
        _or_bits(stream, v, exc_start + ((ranks >> 16) - 1) * exc_width, escaped)
        tl.store(codes_ptr + b, tl.where(count > 0, width + 1, 0).to(tl.uint8))
        tl.store(counts_ptr + b, count)
        tl.store(n_esc_ptr + b, n_esc)
        tl.store(exc_widths_ptr + b, exc_width.to(tl.uint8))
        tl.store(nbytes_ptr + b, (nbits + 7) // 8)

    @triton.jit(do_not_specialize=["header0", "header1", "header2", "n_esc_at", "exc_widths_at", "bitmaps_at",
                                   "values_at"])
    def _gather_kernel(records_ptr, codes_ptr, n_esc_ptr, exc_widths_ptr, nbytes_ptr, rank_end_ptr, stream_end_ptr,
                       n_blocks, payload_ptr, header0, header1, header2, n_esc_at, exc_widths_at, bitmaps_at, values_at,
                       BLOCK: tl.constexpr, HEADER_BYTES: tl.constexpr, RECORD_BYTES: tl.constexpr,
                       TILE: tl.constexpr, CHUNK: tl.constexpr):
        pid = tl.program_id(0)
        t = tl.arange(0, 32)  # program 0: the header (three little-endian int64 words) and the pad byte
        word = tl.where(t < 8, header0.to(tl.int64), tl.where(t < 16, header1.to(tl.int64), header2.to(tl.int64)))
        tl.store(payload_ptr + t, ((word >> (8 * (t % 8))) & 0xFF).to(tl.uint8), mask=(t < HEADER_BYTES) & (pid == 0))
        pad_at = HEADER_BYTES + n_blocks
        tl.store(payload_ptr + pad_at + t, tl.zeros([32], dtype=tl.uint8), mask=(pad_at + t < n_esc_at) & (pid == 0))
        b = pid.to(tl.int64) * TILE + tl.arange(0, TILE)
        inside = b < n_blocks
        code = tl.load(codes_ptr + b, mask=inside, other=0)
        tl.store(payload_ptr + HEADER_BYTES + b, code, mask=inside)
        changed = code != 0
        rank = tl.load(rank_end_ptr + b, mask=changed, other=1) - 1
        n_esc = tl.load(n_esc_ptr + b, mask=changed, other=0)
        two = tl.arange(0, 2)[None, :]
        tl.store(payload_ptr + n_esc_at + 2 * rank[:, None] + two, ((n_esc[:, None] >> (8 * two)) & 0xFF).to(tl.uint8),
                 mask=changed[:, None] & (two < 2))
        tl.store(payload_ptr + exc_widths_at + rank, tl.load(exc_widths_ptr + b, mask=changed), mask=changed)
        record = records_ptr + b[:, None] * RECORD_BYTES
        j = tl.arange(0, BLOCK // 8)[None, :]
        bitmap_mask = changed[:, None] & (j < BLOCK // 8)
        tl.store(payload_ptr + bitmaps_at + rank[:, None] * (BLOCK // 8) + j, tl.load(record + j, mask=bitmap_mask),
                 mask=bitmap_mask)
        # only the live bytes of each stream: CHUNK-byte columns up to the tile's longest stream (a
        # fixed 17 B / 8-byte row per block left ~90% of the lanes masked off)
        nbytes = tl.load(nbytes_ptr + b, mask=changed, other=0)
        start = payload_ptr + values_at + tl.load(stream_end_ptr + b, mask=changed, other=0) - nbytes
        stream = record + BLOCK // 8
        s = tl.arange(0, CHUNK)[None, :]
        longest = tl.max(nbytes, axis=0)  # 0 in a tile of unchanged blocks
        chunk = longest * 0
        while chunk * CHUNK < longest:
            at = chunk * CHUNK + s
            # whole chunks of a live row (within the record) are loaded: vectorized, unlike per-byte masks
            row = (chunk * CHUNK < nbytes[:, None]) & (at < RECORD_BYTES - BLOCK // 8)
            live = at < nbytes[:, None]
            tl.store(start[:, None] + at, tl.load(stream + at, mask=row), mask=live)
            chunk += 1

    @triton.jit
    def _read_n_esc(n_esc_ptr, rank, changed):
        lo = tl.load(n_esc_ptr + 2 * rank, mask=changed, other=0).to(tl.int32)
        return lo | (tl.load(n_esc_ptr + 2 * rank + 1, mask=changed, other=0).to(tl.int32) << 8)

    @triton.jit
    def _popcount_bytes(x):
        """Set bits of each 0 <= x < 256 (int32), SWAR: no libdevice, so the interpreter runs it too."""
        x = x - ((x >> 1) & 0x55)
        x = (x & 0x33) + ((x >> 2) & 0x33)
        return (x + (x >> 4)) & 0x0F

    @triton.jit
    def _stream_sizes_kernel(codes_ptr, rank_end_ptr, n_esc_ptr, exc_widths_ptr, bitmaps_ptr, nbytes_ptr, n_blocks,
                             BLOCK: tl.constexpr, TILE: tl.constexpr):
        # the bitmaps of a tile's changed blocks are contiguous: one coalesced [TILE, B / 8] byte load
        # (one block per program, one byte per lane, used 3 of 32 bytes per sector)
        b = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
        inside = b < n_blocks
        code = tl.load(codes_ptr + b, mask=inside, other=0).to(tl.int32)
        changed = code != 0
        rank = tl.load(rank_end_ptr + b, mask=changed, other=1) - 1
        j = tl.arange(0, BLOCK // 8)[None, :]
        bitmap = tl.load(bitmaps_ptr + rank[:, None] * (BLOCK // 8) + j, mask=changed[:, None] & (j < BLOCK // 8),
                         other=0)
        count = tl.sum(_popcount_bytes(bitmap.to(tl.int32)), axis=1)
        exc_width = tl.load(exc_widths_ptr + rank, mask=changed, other=0).to(tl.int32)
        nbits = count * tl.maximum(code - 1, 0) + exc_width * _read_n_esc(n_esc_ptr, rank, changed)
        tl.store(nbytes_ptr + b, (nbits + 7) // 8, mask=inside)

    @triton.jit
    def _load_bits(words_ptr, bitpos, width, mask):
        """``width`` (<= 17) bits at ``bitpos`` of the 32-bit little-endian words at ``words_ptr`` (one
        load, or two where they straddle a word: one or two 32-bit loads where bytes took three). The
        second word may extend up to 3 bytes past the section's last byte; those bits are never used."""
        wi = bitpos >> 5
        sh = bitpos & 31
        lo = tl.load(words_ptr + wi, mask=mask, other=0).to(tl.uint32, bitcast=True).to(tl.uint64)
        hi = tl.load(words_ptr + wi + 1, mask=mask & (sh + width > 32), other=0).to(tl.uint32, bitcast=True)
        window = lo | (hi.to(tl.uint64) << 32)
        return (window >> sh.to(tl.uint64)).to(tl.int32) & ((1 << width) - 1)

    @triton.jit(do_not_specialize=["bitmaps_lead", "values_lead"])
    def _decode_kernel(out_ptr, numel, codes_ptr, rank_end_ptr, stream_end_ptr, nbytes_ptr, exc_widths_ptr,
                       bitmaps_ptr, bitmaps_lead, values_ptr, values_lead, BLOCK: tl.constexpr):
        # the bitmaps and value streams are read as 32-bit words from the 4-byte boundary at or before
        # their first byte, ``*_lead`` bytes earlier (the payload's previous section)
        bitmap_words = (bitmaps_ptr - bitmaps_lead).to(tl.pointer_type(tl.int32))
        value_words = (values_ptr - values_lead).to(tl.pointer_type(tl.int32))
        b = tl.program_id(0).to(tl.int64)
        code = tl.load(codes_ptr + b).to(tl.int32)
        width = tl.maximum(code - 1, 0)
        rank = tl.load(rank_end_ptr + b) - 1
        i = tl.arange(0, BLOCK)
        # per block: a 64-bit word address once, 32-bit bit offsets from it per value
        bitmap_at = bitmaps_lead + rank * (BLOCK // 8)
        changed = _load_bits(bitmap_words + (bitmap_at >> 2), (bitmap_at & 3).to(tl.int32) * 8 + i, 1,
                             (code != 0) & (i < BLOCK)) != 0
        exc_width = tl.load(exc_widths_ptr + rank, mask=code != 0, other=0).to(tl.int32)
        stream_at = tl.load(stream_end_ptr + b) - tl.load(nbytes_ptr + b) + values_lead
        stream_words = value_words + (stream_at >> 2)
        base = (stream_at & 3).to(tl.int32) * 8
        ranks = tl.cumsum(changed.to(tl.int32), axis=0) - 1
        slot = _load_bits(stream_words, base + tl.maximum(ranks, 0) * width, width, changed)
        escaped = changed & (width > 0) & (slot == (1 << width) - 1)
        esc_rank = tl.cumsum(escaped.to(tl.int32), axis=0) - 1
        exc_pos = base + tl.sum(changed.to(tl.int32), axis=0) * width + tl.maximum(esc_rank, 0) * exc_width
        z = tl.where(escaped, _load_bits(stream_words, exc_pos, exc_width, escaped), slot) + 1
        d = (z >> 1) ^ -(z & 1)
        idx = b * BLOCK + tl.arange(0, BLOCK)
        keep = changed & (idx < numel)
        o = _ordered(tl.load(out_ptr + idx, mask=keep, other=0).to(tl.int32) & 0xFFFF) + d
        u = tl.where(o >= 0x8000, o - 0x8000, 0xFFFF - o)
        tl.debug_barrier()  # every thread has read out before it is overwritten
        tl.store(out_ptr + idx, tl.where(u >= 0x8000, u - 0x10000, u).to(tl.int16), mask=keep)


# Register caps (PTX .maxnreg) of the block kernels, None: the compiler's choice. A one-warp program
# runs at most 32 per SM, at most 65536 / (32 * registers) with more than 64 registers: the encoder's 122
# allowed 16, 80 allow 25 (+10-12% device throughput, a few spilled registers), the decoder's 70 28, 64 32
# (+2-6%) on the H200 (session 8, benchmarks/bench_delta_kernels.py --max-registers). Applied up to
# CAPPED_MAX_BLOCK values per block: larger blocks spill heavily under them (benchmarks/sass_count.py).
MAX_REGISTERS = {"encode": 80, "decode": 64}
CAPPED_MAX_BLOCK = 1024


def _max_registers(kernel: str, block_size: int):
    return MAX_REGISTERS[kernel] if block_size <= CAPPED_MAX_BLOCK else None


def _num_warps(block_size: int) -> int:
    return max(1, min(8, block_size // 256))  # B >= 32 * num_warps: no value held by two threads


def _tile_blocks(block_size: int) -> int:
    """Blocks per program of the gather and stream-size kernels: 1024 bitmap bytes (fewer for B < 256),
    8 per thread of 4 warps (16 needed 141 registers); 10^4 blocks of 256 still make 313 programs."""
    return max(1, min(32, 1024 // (block_size // 8)))


def _stream_words(block_size: int) -> int:
    return -(-block_size * MAX_WIDTH // 32)


@dataclass
class EncodedBlocks:
    """Per-block results of ``encode_blocks``; ``records`` row b: bitmap, then the value stream."""

    codes: torch.Tensor  # uint8 [n_blocks]
    counts: torch.Tensor  # int32 [n_blocks]
    n_esc: torch.Tensor  # int32 [n_blocks]
    exc_widths: torch.Tensor  # uint8 [n_blocks]
    nbytes: torch.Tensor  # int32 [n_blocks]: value stream bytes
    records: torch.Tensor  # int32 [n_blocks, B / 32 + ceil(17 B / 32)]


def encode_blocks(prev: torch.Tensor, new: torch.Tensor, block_size: int) -> EncodedBlocks:
    """Triton: code every block of ``new`` (int16) against ``prev``, which is overwritten with ``new``."""
    n_blocks = -(-new.numel() // block_size)
    dev = new.device
    record_words = block_size // 32 + _stream_words(block_size)
    e = EncodedBlocks(
        codes=torch.empty(n_blocks, dtype=torch.uint8, device=dev),
        counts=torch.empty(n_blocks, dtype=torch.int32, device=dev),
        n_esc=torch.empty(n_blocks, dtype=torch.int32, device=dev),
        exc_widths=torch.empty(n_blocks, dtype=torch.uint8, device=dev),
        nbytes=torch.empty(n_blocks, dtype=torch.int32, device=dev),
        records=torch.empty(n_blocks, record_words, dtype=torch.int32, device=dev),
    )
    if n_blocks:
        _encode_kernel[(n_blocks,)](prev, new, new.numel(), e.codes, e.counts, e.n_esc, e.exc_widths, e.nbytes,
                                    e.records,
                                    BLOCK=block_size, RECORD_WORDS=record_words, num_warps=_num_warps(block_size),
                                    maxnreg=_max_registers("encode", block_size))
    return e


def gather_records(e: EncodedBlocks, rank_end, stream_end, payload, header: bytes, n_esc_at, exc_widths_at,
                   bitmaps_at, values_at, block_size: int) -> None:
    """Triton: write ``header`` (24 bytes), the pad byte, the codes, and n_esc, exc_width, bitmap and stream of each
    changed block into ``payload`` (uint8) at the given section offsets; ``rank_end``/``stream_end``
    are inclusive prefix sums over blocks of (code != 0) and ``nbytes``."""
    n_blocks = e.codes.numel()
    if not n_blocks:  # an empty shard: the payload is the header
        payload.copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        return
    tile = _tile_blocks(block_size)
    _gather_kernel[(triton.cdiv(n_blocks, tile),)](
        e.records.view(torch.uint8), e.codes, e.n_esc, e.exc_widths, e.nbytes, rank_end, stream_end, n_blocks, payload,
        *struct.unpack("<3q", header), n_esc_at, exc_widths_at, bitmaps_at, values_at,
        BLOCK=block_size, HEADER_BYTES=len(header), RECORD_BYTES=4 * e.records.shape[1], TILE=tile,
        CHUNK=max(32, block_size // 8), num_warps=4)  # TILE * CHUNK = 1024 stream bytes per pass


def stream_sizes(codes, rank_end, n_esc_bytes, exc_widths, bitmaps, block_size: int) -> torch.Tensor:
    """Triton: value stream bytes of every block (0 if unchanged), from the payload's sections."""
    nbytes = torch.empty(codes.numel(), dtype=torch.int32, device=codes.device)
    n_blocks, tile = codes.numel(), _tile_blocks(block_size)
    if n_blocks:
        _stream_sizes_kernel[(triton.cdiv(n_blocks, tile),)](codes, rank_end, n_esc_bytes, exc_widths, bitmaps, nbytes,
                                                             n_blocks, BLOCK=block_size, TILE=tile, num_warps=4)
    return nbytes


def decode_blocks(out, codes, rank_end, stream_end, nbytes, exc_widths, bitmaps, values, block_size: int) -> None:
    """Triton: apply every changed block's delta to ``out`` (int16 view of the previous values). ``bitmaps``
    and ``values`` are sections of one payload after its header, so the 4-byte boundary before each is
    inside the payload; ``values`` ends the payload and needs WORD_READ_SLACK readable bytes after it."""
    if codes.numel():
        _decode_kernel[(codes.numel(),)](out, out.numel(), codes, rank_end, stream_end, nbytes, exc_widths,
                                         bitmaps, bitmaps.data_ptr() % 4, values, values.data_ptr() % 4,
                                         BLOCK=block_size, num_warps=_num_warps(block_size),
                                         maxnreg=_max_registers("decode", block_size))
