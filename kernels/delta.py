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
- the value stream: each changed value, in order, in a ``width``-bit slot (``ceil(count * width / 8)``
  bytes); the slot value ``2**width - 1`` is an escape whose ``v`` follows, from the next byte
  boundary, in an exception list of ``exc_width``-bit entries (escapes in order). Little-endian bit
  order (bit ``k`` of a section is bit ``k % 8`` of its byte ``k // 8``).

``width`` minimizes the stream's bytes ``ceil(count * width / 8) + ceil(exc_width * n_esc(width) / 8)``
over 1..17 (the smallest on ties; 17 never escapes since ``v <= 131069``), and is 0 when every
changed value has ``v = 0``. Deltas are heavy-tailed (mostly +-1 ulp, but a weight crossing zero
moves ~2**15), so a per-block maximum width would let one outlier set the cost of the whole block;
escapes cap that at ``exc_width`` bits, which is 17 only in the few blocks that hold such an
outlier. The exception list starts on a byte (format version 3; version 2 packed it right after the
last slot bit) so that both sections are runs of 8-value rows of ``width`` bytes each: the GPU
encoder packs a row in registers, with no scan across the block.

Two implementations give identical bytes (``tests/test_delta.py`` checks it):

- PyTorch references (the CPU path and the test oracle): ``analyze_blocks_reference`` (codes,
  counts, escapes, bitmaps, slot and exception values compacted per block; copies ``new`` into
  ``prev``), ``pack_values_reference`` (bit-packs the changed blocks' streams at byte offsets from a
  prefix sum) and ``unpack_values_reference`` (applies the deltas to ``out`` in place).
- Triton kernels (the CUDA path, one host sync per encode and per decode): ``encode_blocks`` codes
  every block into its own fixed-size row and updates ``prev`` in the same pass; ``gather_records``
  moves the changed rows into the payload at offsets from prefix sums; ``decode_blocks`` decodes in
  place.
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


@dataclass
class BlockAnalysis:
    slots: torch.Tensor  # int32 [n_blocks, B]: row b starts with its changed values' slot values
    exceptions: torch.Tensor  # int32 [n_blocks, B]: row b starts with its escaped values' v
    codes: torch.Tensor  # uint8 [n_blocks]: 0 = unchanged, else width + 1
    counts: torch.Tensor  # int32 [n_blocks]: changed values per block
    n_esc: torch.Tensor  # int32 [n_blocks]: escaped values per block
    exc_widths: torch.Tensor  # uint8 [n_blocks]: bits per exception entry
    bitmaps: torch.Tensor  # uint8 [n_blocks, B // 8]


def _section_nbytes(n, width):
    return (n * width + 7) // 8


def stream_nbytes(counts, codes, n_esc, exc_widths):
    """Bytes of each block's value stream (int64), from its count, code, escapes and exception width."""
    width = (codes.to(torch.int64) - 1).clamp(min=0)
    return (_section_nbytes(counts.to(torch.int64), width)
            + _section_nbytes(n_esc.to(torch.int64), exc_widths.to(torch.int64)))


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
    """Per block: the width of fewest stream bytes (0 if all v are 0), its n_esc and ``exc_width``."""
    widths = torch.arange(1, MAX_WIDTH + 1, device=v.device)
    exc_width = _bit_length(torch.where(changed, v, 0).amax(1))
    n_esc = torch.stack([(changed & (v >= (1 << w) - 1)).sum(1) for w in range(1, MAX_WIDTH + 1)], 1)
    nbytes = _section_nbytes(counts.unsqueeze(1).to(torch.int64), widths) + _section_nbytes(
        n_esc, exc_width.unsqueeze(1))
    best = nbytes.argmin(1)  # the first (smallest) width on ties
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
    exc_base = base + 8 * _section_nbytes(counts, width)
    _scatter_bits(bits, exc_base + i * exc_width, a.exceptions[changed_blocks], exc_width, i < n_esc)
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
    exc_base = base + 8 * _section_nbytes(changed.sum(1, keepdim=True), width)
    exc_pos = exc_base + (escaped.cumsum(1) - 1) * exc_width
    z = torch.where(escaped, _read_bits(padded, exc_pos, exc_width), slot) + 1
    d = (z >> 1) ^ -(z & 1)
    idx = changed_blocks.unsqueeze(1) * block_size + i
    keep = changed & (idx < out.numel())
    flat_idx = idx[keep]
    out[flat_idx] = from_ordered(to_ordered(out[flat_idx]) + d[keep].to(torch.int32))


# --- Triton kernels ----------------------------------------------------------------------------
#
# The CUDA path needs one host sync per encode (the payload size) and one per decode (the header):
#   encode: _encode_kernel (code, counts, bitmap and value stream of every block into the block's
#           fixed-size row of ``records``; updates ``prev``) -> prefix sums (torch) -> size sync ->
#           _gather_kernel (codes, stream sizes, exception widths, bitmaps and streams of the changed
#           blocks into the payload).
#   decode: header sync -> prefix sums (torch) -> _decode_kernel.
# Encode and decode work on tiles of NB blocks (NB * B = TILE values, 4 warps) for occupancy; the
# encoder is persistent (a grid of a few programs per SM looping over tiles) so that its compaction
# scratch is per program, not per block. Bit packing without a scan: the changed values (and the
# escapes) are compacted by rank into the program's scratch, and after a barrier each 8-value row
# of a section, ``width`` bytes, is assembled in int64 registers (one word when width <= 8, else
# three: 8 x 17 bits <= 192) and stored at a 24-byte stride in the block's record (6 B + B / 8
# bytes, 3x the shard); the gather cuts every row to its ``width`` bytes while it copies the stream
# into the payload (its work is proportional to the payload). Barriers also separate the last read
# of an updated buffer (``prev``, ``out``) from the write to it.

TILE = 2048


if triton is not None:

    @triton.jit
    def _ordered(u):
        return tl.where(u >= 0x8000, 0xFFFF - u, u + 0x8000)

    @triton.jit
    def _bits_of(x):
        """Bits of 0 <= x < 2**24 (0 for 0), from the float32 exponent."""
        return tl.where(x > 0, (x.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 126, 0)

    @triton.jit
    def _bin(h0, h1, h2, h3, h4, k: tl.constexpr):
        """Count of bit length ``k`` from the histogram packed 4 x 16 bits per int64 word."""
        if k // 4 == 0:
            word = h0
        elif k // 4 == 1:
            word = h1
        elif k // 4 == 2:
            word = h2
        elif k // 4 == 3:
            word = h3
        else:
            word = h4
        return ((word >> (16 * (k % 4))) & 0xFFFF).to(tl.int32)

    @triton.jit
    def _section_bytes(n, width):
        return (n * width + 7) // 8

    @triton.jit
    def _best_width(z):
        """Per block (rows of z): the width of fewest stream bytes (0 if every z <= 1), its n_esc, the
        count of changed values and exc_width (bits of the largest v). ``n_esc(w)`` counts the values
        with ``v >= 2**w - 1``, i.e. ``z >= 2**w``, i.e. of bit length above w: every count comes from
        one histogram of bit lengths (0..17) in five packed reductions."""
        length = _bits_of(z)
        one = tl.full(z.shape, 1, tl.int64) << (16 * (length % 4)).to(tl.int64)
        group = length // 4
        h0 = tl.sum(tl.where(group == 0, one, 0), axis=1)
        h1 = tl.sum(tl.where(group == 1, one, 0), axis=1)
        h2 = tl.sum(tl.where(group == 2, one, 0), axis=1)
        h3 = tl.sum(tl.where(group == 3, one, 0), axis=1)
        h4 = tl.sum(tl.where(group == 4, one, 0), axis=1)
        exc_width = _bits_of(tl.maximum(tl.max(z, axis=1) - 1, 0))
        count = _bin(h0, h1, h2, h3, h4, 1)
        for k in tl.static_range(2, 18):
            count += _bin(h0, h1, h2, h3, h4, k)
        n_esc = count * 0  # values of bit length > w, for w from 17 down
        best_width, best_esc, best_cost = n_esc + 17, n_esc, _section_bytes(count, 17)
        for w in tl.static_range(16, 0, -1):
            n_esc += _bin(h0, h1, h2, h3, h4, w + 1)
            cost = _section_bytes(count, w) + _section_bytes(n_esc, exc_width)
            cheaper = cost <= best_cost  # widths descending: the smallest width on ties
            best_width = tl.where(cheaper, w, best_width)
            best_esc = tl.where(cheaper, n_esc, best_esc)
            best_cost = tl.minimum(cost, best_cost)
        trivial = exc_width == 0
        return tl.where(trivial, 0, best_width), tl.where(trivial, 0, best_esc), count, exc_width

    @triton.jit
    def _shifted(x, s):
        """x << s for s >= 0, x >> -s for s < 0 (|s| < 64); x is a non-negative int64."""
        return tl.where(s >= 0, x << tl.minimum(tl.maximum(s, 0), 63), x >> tl.minimum(tl.maximum(-s, 0), 63))

    @triton.jit
    def _word(x, start, offset, width):
        """Bits of the 64-bit word at row bit ``start`` contributed by x placed at ``offset``."""
        hit = (offset < start + 64) & (offset + width > start)
        return tl.where(hit, _shifted(x, offset - start), 0)

    @triton.jit
    def _pack_rows(src, n, width, rows_ptr, ROWS: tl.constexpr):
        """Bit-pack ``n`` (per block) compacted values of ``width`` bits (<= 17) from ``src`` (int32,
        [NB, 1, 1] pointers): row r of 8 values (8 * width <= 136 bits) goes to the three int64 words
        at ``rows_ptr`` ([NB, 1] int64 pointers) + 3 r, to be cut to ``width`` bytes by the gather."""
        row = tl.arange(0, ROWS)[None, :, None]
        col = tl.arange(0, 8)[None, None, :]
        j = row * 8 + col
        x = tl.load(src + j, mask=j < n[:, None, None], other=0).to(tl.int64)
        w = width[:, None, None].to(tl.int64)
        offset = col * w
        dst = rows_ptr + 3 * tl.arange(0, ROWS)[None, :]
        live = (tl.arange(0, ROWS)[None, :] * 8 < n[:, None])
        if tl.max(width, axis=0) <= 8:  # the common case: a row fits one word
            tl.store(dst, tl.sum(x << offset, axis=2), mask=live)
        else:
            tl.store(dst, tl.sum(_word(x, 0, offset, w), axis=2), mask=live)
            tl.store(dst + 1, tl.sum(_word(x, 64, offset, w), axis=2), mask=live)
            tl.store(dst + 2, tl.sum(_word(x, 128, offset, w), axis=2), mask=live)

    @triton.jit
    def _encode_kernel(prev_ptr, new_ptr, numel, n_blocks, tiles_per_program, codes_ptr, counts_ptr, exc_widths_ptr, nbytes_ptr,
                       records_ptr, scratch_ptr, BLOCK: tl.constexpr, NB: tl.constexpr, RECORD_BYTES: tl.constexpr):
        pid = tl.program_id(0)
        r = tl.arange(0, NB)
        i = tl.arange(0, BLOCK)
        rows = tl.arange(0, BLOCK // 8)
        slots = scratch_ptr + pid.to(tl.int64) * (NB * 2 * BLOCK) + r * (2 * BLOCK)  # [NB] compaction rows
        step = 0
        while step < tiles_per_program:  # a while loop: the interpreter cannot range() over a runtime bound
            blk = (pid + step * tl.num_programs(0)).to(tl.int64) * NB + r  # past the last tile: no live block
            live = blk < n_blocks
            idx = blk[:, None] * BLOCK + i[None, :]
            inside = idx < numel
            new16 = tl.load(new_ptr + idx, mask=inside, other=0)
            old = tl.load(prev_ptr + idx, mask=inside, other=0)
            d = _ordered(new16.to(tl.int32) & 0xFFFF) - _ordered(old.to(tl.int32) & 0xFFFF)
            z = (d << 1) ^ (d >> 31)
            changed = z != 0
            v = z - 1
            width, n_esc, count, exc_width = _best_width(z)
            escape = ((1 << width) - 1)[:, None]
            escaped = changed & (width[:, None] > 0) & (v >= escape)
            ranks = tl.cumsum(changed.to(tl.int32) | (escaped.to(tl.int32) << 16), axis=1)  # both < 2**14
            tl.store(slots[:, None] + (ranks & 0xFFFF) - 1, tl.minimum(v, escape), mask=changed)
            tl.store(slots[:, None] + BLOCK + (ranks >> 16) - 1, v, mask=escaped)
            record = records_ptr + blk * RECORD_BYTES
            bitmap = tl.sum(tl.reshape(changed.to(tl.int32), (NB, BLOCK // 8, 8)) << tl.arange(0, 8)[None, None, :],
                            axis=2)
            tl.store(record[:, None] + 48 * (BLOCK // 8) + rows[None, :], bitmap.to(tl.uint8), mask=live[:, None])
            tl.debug_barrier()  # prev read and the compacted values visible to every thread
            tl.store(prev_ptr + idx, new16, mask=inside)
            slot_bytes = _section_bytes(count, width)
            rows64 = record.to(tl.pointer_type(tl.int64), bitcast=True)[:, None]
            _pack_rows(slots[:, None, None], tl.where(live, count, 0), width, rows64, BLOCK // 8)
            if tl.max(n_esc, axis=0) > 0:
                _pack_rows(slots[:, None, None] + BLOCK, tl.where(live, n_esc, 0), exc_width, rows64 + 3 * (BLOCK // 8),
                           BLOCK // 8)
            tl.store(codes_ptr + blk, tl.where(count > 0, width + 1, 0).to(tl.uint8), mask=live)
            tl.store(counts_ptr + blk, count, mask=live)
            tl.store(exc_widths_ptr + blk, exc_width.to(tl.uint8), mask=live)
            tl.store(nbytes_ptr + blk, slot_bytes + _section_bytes(n_esc, exc_width), mask=live)
            tl.debug_barrier()  # the scratch is read before the next tile overwrites it
            step += 1

    @triton.jit(do_not_specialize=["header0", "header1", "header2", "sizes_at", "exc_widths_at", "bitmaps_at",
                                   "values_at"])
    def _gather_kernel(records_ptr, codes_ptr, counts_ptr, exc_widths_ptr, nbytes_ptr, rank_end_ptr, stream_end_ptr,
                       n_blocks, payload_ptr, header0, header1, header2, sizes_at, exc_widths_at, bitmaps_at, values_at,
                       BLOCK: tl.constexpr, HEADER_BYTES: tl.constexpr, RECORD_BYTES: tl.constexpr,
                       CHUNK: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        t = tl.arange(0, 32)  # program 0: the header (three little-endian int64 words) and the pad byte
        word = tl.where(t < 8, header0.to(tl.int64), tl.where(t < 16, header1.to(tl.int64), header2.to(tl.int64)))
        tl.store(payload_ptr + t, ((word >> (8 * (t % 8))) & 0xFF).to(tl.uint8), mask=(t < HEADER_BYTES) & (b == 0))
        pad_at = HEADER_BYTES + n_blocks
        tl.store(payload_ptr + pad_at + t, tl.zeros([32], dtype=tl.uint8), mask=(pad_at + t < sizes_at) & (b == 0))
        code = tl.load(codes_ptr + b)
        tl.store(payload_ptr + HEADER_BYTES + b, code)
        if code != 0:
            rank = tl.load(rank_end_ptr + b) - 1
            nbytes = tl.load(nbytes_ptr + b)
            two = tl.arange(0, 2)
            tl.store(payload_ptr + sizes_at + 2 * rank + two, ((nbytes >> (8 * two)) & 0xFF).to(tl.uint8))
            exc_width = tl.load(exc_widths_ptr + b).to(tl.int32)
            tl.store(payload_ptr + exc_widths_at + rank, exc_width.to(tl.uint8))
            record = records_ptr + b * RECORD_BYTES
            c = tl.arange(0, CHUNK)
            for start in tl.static_range(0, BLOCK // 8, CHUNK):
                m = start + c < BLOCK // 8
                bitmap = tl.load(record + 48 * (BLOCK // 8) + start + c, mask=m)
                tl.store(payload_ptr + bitmaps_at + rank * (BLOCK // 8) + start + c, bitmap, mask=m)
            # the rows (24 bytes each, see _pack_rows) cut to width bytes: the slots, then the exceptions
            width = code.to(tl.int32) - 1
            slot_bytes = (tl.load(counts_ptr + b) * width + 7) // 8
            dst = payload_ptr + values_at + tl.load(stream_end_ptr + b) - nbytes
            start = 0
            while start < nbytes:
                k = start + c
                in_slots = k < slot_bytes
                kk = tl.where(in_slots, k, k - slot_bytes)
                w = tl.maximum(tl.where(in_slots, width, exc_width), 1)
                src = record + tl.where(in_slots, 0, 24 * (BLOCK // 8)) + 24 * (kk // w) + kk % w
                m = k < nbytes
                tl.store(dst + k, tl.load(src, mask=m), mask=m)
                start += CHUNK

    @triton.jit
    def _load_bits(values_ptr, values_nbytes, bitpos, width, mask):
        pos = bitpos >> 3
        word = tl.zeros(bitpos.shape, dtype=tl.int32)
        for t in tl.static_range(3):  # a shift <= 7 plus 17 bits spans at most 3 bytes
            m = mask & (pos + t < values_nbytes)
            word = word | (tl.load(values_ptr + pos + t, mask=m, other=0).to(tl.int32) << (8 * t))
        return (word >> (bitpos & 7).to(tl.int32)) & ((1 << width) - 1)

    @triton.jit(do_not_specialize=["values_nbytes"])
    def _decode_kernel(out_ptr, numel, n_blocks, codes_ptr, rank_end_ptr, stream_end_ptr, sizes_ptr, exc_widths_ptr,
                       bitmaps_ptr, values_ptr, values_nbytes, BLOCK: tl.constexpr, NB: tl.constexpr):
        blk = tl.program_id(0).to(tl.int64) * NB + tl.arange(0, NB)
        code = tl.load(codes_ptr + blk, mask=blk < n_blocks, other=0).to(tl.int32)
        block_changed = code != 0
        width = tl.maximum(code - 1, 0)[:, None]
        rank = tl.load(rank_end_ptr + blk, mask=block_changed, other=1) - 1
        i = tl.arange(0, BLOCK)
        byte = tl.load(bitmaps_ptr + rank[:, None] * (BLOCK // 8) + i[None, :] // 8, mask=block_changed[:, None],
                       other=0)
        changed = ((byte.to(tl.int32) >> (i[None, :] % 8)) & 1) == 1
        exc_width = tl.load(exc_widths_ptr + rank, mask=block_changed, other=0).to(tl.int32)[:, None]
        base = (tl.load(stream_end_ptr + rank, mask=block_changed, other=0)
                - tl.load(sizes_ptr + rank, mask=block_changed, other=0)).to(tl.int64)[:, None] * 8
        ranks = tl.cumsum(changed.to(tl.int32), axis=1) - 1
        slot = _load_bits(values_ptr, values_nbytes, base + tl.maximum(ranks, 0) * width, width, changed)
        escaped = changed & (width > 0) & (slot == (1 << width) - 1)
        esc_rank = tl.cumsum(escaped.to(tl.int32), axis=1) - 1
        exc_base = base + 8 * _section_bytes(tl.sum(changed.to(tl.int32), axis=1)[:, None], width)
        exc = _load_bits(values_ptr, values_nbytes, exc_base + tl.maximum(esc_rank, 0) * exc_width, exc_width, escaped)
        z = tl.where(escaped, exc, slot) + 1
        d = (z >> 1) ^ -(z & 1)
        idx = blk[:, None] * BLOCK + i[None, :]
        keep = changed & (idx < numel)
        o = _ordered(tl.load(out_ptr + idx, mask=keep, other=0).to(tl.int32) & 0xFFFF) + d
        u = tl.where(o >= 0x8000, o - 0x8000, 0xFFFF - o)
        tl.debug_barrier()  # every thread has read out before it is overwritten
        tl.store(out_ptr + idx, tl.where(u >= 0x8000, u - 0x10000, u).to(tl.int16), mask=keep)


def _tile_blocks(block_size: int) -> int:
    return max(1, TILE // block_size)


def _num_warps(block_size: int) -> int:
    return max(4, min(8, block_size // 1024))


def _record_bytes(block_size: int) -> int:
    """Slot rows and exception rows (B / 8 rows of 24 bytes each), then the bitmap, padded to 8 bytes."""
    return 48 * (block_size // 8) + -(-block_size // 64) * 8


def _persistent_programs(device: torch.device, n_tiles: int) -> int:
    if device.type != "cuda":
        return min(n_tiles, 3)  # the interpreter: still several tiles per program
    return min(n_tiles, 8 * torch.cuda.get_device_properties(device).multi_processor_count)


@dataclass
class EncodedBlocks:
    """Per-block results of ``encode_blocks``; ``records`` row b: the packed rows and the bitmap."""

    codes: torch.Tensor  # uint8 [n_blocks]
    counts: torch.Tensor  # int32 [n_blocks]
    exc_widths: torch.Tensor  # uint8 [n_blocks]
    nbytes: torch.Tensor  # int32 [n_blocks]: value stream bytes
    records: torch.Tensor  # uint8 [n_blocks, 6 B + B / 8 (padded)]: see _record_bytes


def encode_blocks(prev: torch.Tensor, new: torch.Tensor, block_size: int) -> EncodedBlocks:
    """Triton: code every block of ``new`` (int16) against ``prev``, which is overwritten with ``new``."""
    n_blocks = -(-new.numel() // block_size)
    dev = new.device
    e = EncodedBlocks(
        codes=torch.empty(n_blocks, dtype=torch.uint8, device=dev),
        counts=torch.empty(n_blocks, dtype=torch.int32, device=dev),
        exc_widths=torch.empty(n_blocks, dtype=torch.uint8, device=dev),
        nbytes=torch.empty(n_blocks, dtype=torch.int32, device=dev),
        records=torch.empty(n_blocks, _record_bytes(block_size), dtype=torch.uint8, device=dev),
    )
    if n_blocks:
        nb = _tile_blocks(block_size)
        n_tiles = -(-n_blocks // nb)
        programs = _persistent_programs(dev, n_tiles)
        scratch = torch.empty(programs * nb * 2 * block_size, dtype=torch.int32, device=dev)
        _encode_kernel[(programs,)](prev, new, new.numel(), n_blocks, -(-n_tiles // programs), e.codes, e.counts, e.exc_widths,
                                    e.nbytes, e.records, scratch,
                                    BLOCK=block_size, NB=nb, RECORD_BYTES=e.records.shape[1],
                                    num_warps=_num_warps(block_size))
    return e


def gather_records(e: EncodedBlocks, rank_end, stream_end, payload, header: bytes, sizes_at, exc_widths_at,
                   bitmaps_at, values_at, block_size: int) -> None:
    """Triton: write ``header`` (24 bytes), the pad byte, the codes, and stream size, exc_width, bitmap
    and stream of each changed block into ``payload`` (uint8) at the given section offsets;
    ``rank_end``/``stream_end`` are inclusive prefix sums over blocks of (code != 0) and ``nbytes``."""
    n_blocks = e.codes.numel()
    if not n_blocks:  # an empty shard: the payload is the header
        payload.copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        return
    _gather_kernel[(n_blocks,)](e.records, e.codes, e.counts, e.exc_widths, e.nbytes, rank_end, stream_end, n_blocks, payload,
                                *struct.unpack("<3q", header), sizes_at, exc_widths_at, bitmaps_at, values_at,
                                BLOCK=block_size, HEADER_BYTES=len(header), RECORD_BYTES=e.records.shape[1],
                                CHUNK=128, num_warps=1)


def decode_blocks(out, codes, rank_end, stream_end, stream_sizes, exc_widths, bitmaps, values,
                  block_size: int) -> None:
    """Triton: apply every changed block's delta to ``out`` (int16 view of the previous values);
    ``stream_end``/``stream_sizes`` are per changed block."""
    n_blocks = codes.numel()
    if n_blocks:
        nb = _tile_blocks(block_size)
        _decode_kernel[(-(-n_blocks // nb),)](out, out.numel(), n_blocks, codes, rank_end, stream_end, stream_sizes,
                                              exc_widths, bitmaps, values, values.numel(), BLOCK=block_size, NB=nb,
                                              num_warps=_num_warps(block_size))
