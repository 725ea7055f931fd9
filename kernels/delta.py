"""Block kernels of the lossless delta codec (``compression/delta.py`` owns the wire format).

Values are 16-bit patterns (bf16 or fp16 viewed as int16). Each pattern ``u`` is mapped to an
ordered integer (negative floats reversed, so -0.0 and +0.0 are neighbours and float order is
integer order); the per-value delta ``d = o_new - o_old`` needs 17 bits and is zigzagged to
``z = 2|d| - (d < 0)``. A changed value (``z > 0``) carries ``v = z - 1`` (17 bits at most).
Per block of ``B`` values:

- ``code``: 0 if nothing changed, else ``width + 1``;
- ``bitmap``: ``B / 8`` bytes, bit ``i % 8`` of byte ``i // 8`` set if value ``i`` changed; the
  decoder gets the block's ``count`` of changed values by popcount;
- ``n_esc`` and the value stream: each changed value, in order, in a ``width``-bit slot; the slot
  value ``2**width - 1`` is an escape whose ``v`` follows the slots in an exception list of 17-bit
  entries (escapes in order). So ``count * width + 17 * n_esc`` bits, little-endian (bit ``k`` of
  the stream is bit ``k % 8`` of byte ``k // 8``), padded to whole bytes.

``width`` minimizes ``count * width + 17 * n_esc(width)`` over 1..17 (the smallest on ties; 17 never
escapes since ``v <= 131069``), and is 0 when every changed value has ``v = 0``. Deltas are
heavy-tailed (mostly +-1 ulp, but a weight crossing zero moves ~2**15), so a per-block maximum
width would let one outlier set the cost of the whole block; escapes cap that at 17 bits.

Three ops, each with a plain-PyTorch reference (CPU path and test oracle) and a Triton kernel used on
CUDA; both give identical bytes:

- ``analyze_blocks(prev, new, B)``: codes, counts, escapes, bitmaps, and each block's slot values
  and exception values compacted to the front of its row of two scratch tensors; copies ``new``
  into ``prev`` (fused, so the sender's state update costs no extra read).
- ``pack_values``: bit-packs the changed blocks' streams at byte offsets from a prefix sum.
- ``unpack_values``: applies the changed blocks' deltas to ``out`` (previous values) in place.
"""

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
    bitmaps: torch.Tensor  # uint8 [n_blocks, B // 8]


def stream_nbytes(counts, codes, n_esc):
    """Bytes of each block's value stream (int64), from its count, code and escapes."""
    width = (codes.to(torch.int64) - 1).clamp(min=0)
    return (counts.to(torch.int64) * width + MAX_WIDTH * n_esc.to(torch.int64) + 7) // 8


def _use_triton(t: torch.Tensor, triton_flag) -> bool:
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


def _choose_width(v, changed, counts):
    """Per block: the width of least ``count * width + 17 * n_esc`` (0 if all v are 0), and n_esc."""
    widths = torch.arange(1, MAX_WIDTH + 1, device=v.device)
    n_esc = torch.stack([(changed & (v >= (1 << w) - 1)).sum(1) for w in range(1, MAX_WIDTH + 1)], 1)
    best = (counts.unsqueeze(1).to(torch.int64) * widths + MAX_WIDTH * n_esc).argmin(1)
    trivial = torch.where(changed, v, 0).amax(1) == 0
    width = torch.where(trivial, 0, widths[best])
    return width.to(torch.int32), torch.where(trivial, 0, n_esc.gather(1, best.unsqueeze(1)).squeeze(1)).to(torch.int32)


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
    width, n_esc = _choose_width(v, changed, counts)
    codes = torch.where(counts > 0, width + 1, 0).to(torch.uint8)
    escape = _escape_code(width).unsqueeze(1)
    escaped = changed & (width.unsqueeze(1) > 0) & (v >= escape)
    slots = _compact(torch.minimum(v, escape), changed)
    prev.copy_(new)
    return BlockAnalysis(slots, _compact(v, escaped), codes, counts, n_esc, _pack_bits(changed))


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
    i = torch.arange(a.slots.shape[1], device=values.device)
    base = value_offsets.unsqueeze(1) * 8
    bits = torch.zeros(values.numel() * 8, dtype=torch.bool, device=values.device)
    _scatter_bits(bits, base + i * width, a.slots[changed_blocks], width, i < counts)
    _scatter_bits(bits, base + counts * width + i * MAX_WIDTH, a.exceptions[changed_blocks],
                  torch.full_like(width, MAX_WIDTH), i < n_esc)
    values.copy_(_pack_bits(bits))


def _read_bits(padded, bitpos, width):
    """``width`` (<= 17) bits at stream bit ``bitpos``: a shift <= 7 plus 17 bits spans <= 3 bytes."""
    byte = (bitpos >> 3).clamp(min=0)
    word = padded[byte] | (padded[byte + 1] << 8) | (padded[byte + 2] << 16)
    return (word >> (bitpos & 7)) & _escape_code(width)


def unpack_values_reference(out, changed_blocks, codes, bitmaps, value_offsets, values, block_size) -> None:
    """Apply the changed blocks' deltas to ``out`` (int16 view holding the previous values)."""
    i = torch.arange(block_size, device=out.device)
    changed = ((bitmaps.to(torch.int32).repeat_interleave(8, 1) >> (i % 8)) & 1) == 1
    width = (codes[changed_blocks].to(torch.int64) - 1).unsqueeze(1)
    base = value_offsets.unsqueeze(1) * 8
    padded = torch.cat([values, values.new_zeros(3)]).to(torch.int64)
    slot = _read_bits(padded, base + (changed.cumsum(1) - 1) * width, width)
    escaped = changed & (width > 0) & (slot == _escape_code(width))
    exc_pos = base + changed.sum(1, keepdim=True) * width + (escaped.cumsum(1) - 1) * MAX_WIDTH
    z = torch.where(escaped, _read_bits(padded, exc_pos, torch.full_like(width, MAX_WIDTH)), slot) + 1
    d = (z >> 1) ^ -(z & 1)
    idx = changed_blocks.unsqueeze(1) * block_size + i
    keep = changed & (idx < out.numel())
    flat_idx = idx[keep]
    out[flat_idx] = from_ordered(to_ordered(out[flat_idx]) + d[keep].to(torch.int32))


# --- Triton kernels ----------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _ordered(u):
        return tl.where(u >= 0x8000, 0xFFFF - u, u + 0x8000)

    @triton.jit
    def _analyze_kernel(prev_ptr, new_ptr, numel, slots_ptr, exceptions_ptr, codes_ptr, counts_ptr, n_esc_ptr,
                        bitmaps_ptr, BLOCK: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, BLOCK)
        idx = b * BLOCK + i
        inside = idx < numel
        new16 = tl.load(new_ptr + idx, mask=inside, other=0)
        old = tl.load(prev_ptr + idx, mask=inside, other=0).to(tl.int32) & 0xFFFF
        tl.store(prev_ptr + idx, new16, mask=inside)
        d = _ordered(new16.to(tl.int32) & 0xFFFF) - _ordered(old)
        z = (d << 1) ^ (d >> 31)
        changed = z != 0
        v = z - 1
        count = tl.sum(changed.to(tl.int32), axis=0)
        best_width = count * 0
        best_cost = count * 0 + (1 << 30)
        for w in tl.static_range(1, 18):  # ascending with a strict <: the smallest width on ties
            cost = count * w + 17 * tl.sum((changed & (v >= (1 << w) - 1)).to(tl.int32), axis=0)
            best_width = tl.where(cost < best_cost, w, best_width)
            best_cost = tl.minimum(cost, best_cost)
        width = tl.where(tl.max(tl.where(changed, v, 0), axis=0) == 0, 0, best_width)
        escape = (1 << width) - 1
        escaped = changed & (width > 0) & (v >= escape)
        rank = tl.cumsum(changed.to(tl.int32), axis=0) - 1
        tl.store(slots_ptr + b * BLOCK + rank, tl.minimum(v, escape), mask=changed)
        esc_rank = tl.cumsum(escaped.to(tl.int32), axis=0) - 1
        tl.store(exceptions_ptr + b * BLOCK + esc_rank, v, mask=escaped)
        bits = tl.reshape(changed.to(tl.int32), (BLOCK // 8, 8)) << tl.arange(0, 8)[None, :]
        tl.store(bitmaps_ptr + b * (BLOCK // 8) + tl.arange(0, BLOCK // 8), tl.sum(bits, axis=1).to(tl.uint8))
        tl.store(codes_ptr + b, tl.where(count > 0, width + 1, 0).to(tl.uint8))
        tl.store(counts_ptr + b, count)
        tl.store(n_esc_ptr + b, tl.sum(escaped.to(tl.int32), axis=0))

    @triton.jit
    def _place(v, start, byte_start):
        """The bits of a value starting at stream bit ``start`` that land in the byte at ``byte_start``."""
        shift = start - byte_start
        return tl.where(shift >= 0, v << tl.maximum(shift, 0), v >> tl.maximum(-shift, 0)) & 0xFF

    @triton.jit
    def _pack_kernel(slots_ptr, exceptions_ptr, changed_ptr, codes_ptr, counts_ptr, n_esc_ptr, offsets_ptr,
                     values_ptr, BLOCK: tl.constexpr, MAX_BYTES: tl.constexpr):
        c = tl.program_id(0)
        b = tl.load(changed_ptr + c)
        width = tl.load(codes_ptr + b).to(tl.int32) - 1
        count = tl.load(counts_ptr + b)
        n_esc = tl.load(n_esc_ptr + b)
        exc_start = count * width
        nbytes = (exc_start + 17 * n_esc + 7) // 8
        j = tl.arange(0, MAX_BYTES)
        live = j < nbytes
        acc = tl.zeros([MAX_BYTES], dtype=tl.int32)
        first = (8 * j) // tl.maximum(width, 1)  # first slot overlapping byte j
        for k in tl.static_range(10):  # a byte overlaps at most 8 // width + 2 <= 10 slots
            s = first + k
            hit = live & (s < count) & (s * width < 8 * j + 8)
            v = tl.load(slots_ptr + b * BLOCK + s, mask=hit, other=0)
            acc = acc | tl.where(hit, _place(v, s * width, 8 * j), 0)
        first = tl.maximum(8 * j - exc_start, 0) // 17  # first exception overlapping byte j
        for k in tl.static_range(2):  # a byte overlaps at most 2 exceptions of 17 bits
            e = first + k
            start = exc_start + 17 * e
            hit = live & (e < n_esc) & (start < 8 * j + 8)
            v = tl.load(exceptions_ptr + b * BLOCK + e, mask=hit, other=0)
            acc = acc | tl.where(hit, _place(v, start, 8 * j), 0)
        offset = tl.load(offsets_ptr + c)
        tl.store(values_ptr + offset + j, acc.to(tl.uint8), mask=live)

    @triton.jit
    def _read_bits_kernel(values_ptr, values_nbytes, bitpos, width, mask):
        pos = bitpos >> 3
        word = tl.zeros(bitpos.shape, dtype=tl.int32)
        for t in tl.static_range(3):  # a shift <= 7 plus 17 bits spans at most 3 bytes
            m = mask & (pos + t < values_nbytes)
            word = word | (tl.load(values_ptr + pos + t, mask=m, other=0).to(tl.int32) << (8 * t))
        return (word >> (bitpos & 7)) & ((1 << width) - 1)

    @triton.jit
    def _unpack_kernel(out_ptr, numel, changed_ptr, codes_ptr, bitmaps_ptr, offsets_ptr, values_ptr,
                       values_nbytes, BLOCK: tl.constexpr):
        c = tl.program_id(0)
        b = tl.load(changed_ptr + c)
        width = tl.load(codes_ptr + b).to(tl.int32) - 1
        i = tl.arange(0, BLOCK)
        byte = tl.load(bitmaps_ptr + c * (BLOCK // 8) + i // 8).to(tl.int32)
        changed = ((byte >> (i % 8)) & 1) == 1
        base = tl.load(offsets_ptr + c) * 8
        rank = tl.cumsum(changed.to(tl.int32), axis=0) - 1
        slot = _read_bits_kernel(values_ptr, values_nbytes, base + tl.maximum(rank, 0) * width, width, changed)
        escaped = changed & (width > 0) & (slot == (1 << width) - 1)
        esc_rank = tl.cumsum(escaped.to(tl.int32), axis=0) - 1
        exc_pos = base + tl.sum(changed.to(tl.int32), axis=0) * width + tl.maximum(esc_rank, 0) * 17
        z = tl.where(escaped, _read_bits_kernel(values_ptr, values_nbytes, exc_pos, 17, escaped), slot) + 1
        d = (z >> 1) ^ -(z & 1)
        idx = b * BLOCK + i
        keep = changed & (idx < numel)
        o = _ordered(tl.load(out_ptr + idx, mask=keep, other=0).to(tl.int32) & 0xFFFF) + d
        u = tl.where(o >= 0x8000, o - 0x8000, 0xFFFF - o)
        tl.store(out_ptr + idx, tl.where(u >= 0x8000, u - 0x10000, u).to(tl.int16), mask=keep)


def _max_bytes(block_size: int) -> int:
    return triton.next_power_of_2(-(-block_size * MAX_WIDTH // 8))


# --- dispatch ----------------------------------------------------------------------------------

def analyze_blocks(prev: torch.Tensor, new: torch.Tensor, block_size: int, triton=None) -> BlockAnalysis:
    """``prev``/``new``: int16 views of equal numel; ``prev`` is overwritten with ``new``."""
    if not _use_triton(new, triton):
        return analyze_blocks_reference(prev, new, block_size)
    n_blocks = -(-new.numel() // block_size)
    dev = new.device
    a = BlockAnalysis(
        slots=torch.empty(n_blocks, block_size, dtype=torch.int32, device=dev),
        exceptions=torch.empty(n_blocks, block_size, dtype=torch.int32, device=dev),
        codes=torch.empty(n_blocks, dtype=torch.uint8, device=dev),
        counts=torch.empty(n_blocks, dtype=torch.int32, device=dev),
        n_esc=torch.empty(n_blocks, dtype=torch.int32, device=dev),
        bitmaps=torch.empty(n_blocks, block_size // 8, dtype=torch.uint8, device=dev),
    )
    if n_blocks:
        _analyze_kernel[(n_blocks,)](prev, new, new.numel(), a.slots, a.exceptions, a.codes, a.counts, a.n_esc,
                                     a.bitmaps, BLOCK=block_size)
    return a


def pack_values(a: BlockAnalysis, changed_blocks, value_offsets, values, triton=None) -> None:
    """``changed_blocks``: int64 block ids; ``value_offsets``: int64 byte offset of each in ``values``."""
    if not _use_triton(values, triton):
        return pack_values_reference(a, changed_blocks, value_offsets, values)
    if changed_blocks.numel():
        block_size = a.slots.shape[1]
        _pack_kernel[(changed_blocks.numel(),)](a.slots, a.exceptions, changed_blocks, a.codes, a.counts, a.n_esc,
                                                value_offsets, values, BLOCK=block_size,
                                                MAX_BYTES=_max_bytes(block_size))


def unpack_values(out, changed_blocks, codes, bitmaps, value_offsets, values, block_size, triton=None) -> None:
    """``out``: int16 view of the previous values; ``bitmaps``: uint8 [len(changed_blocks), B // 8]."""
    if not _use_triton(out, triton):
        return unpack_values_reference(out, changed_blocks, codes, bitmaps, value_offsets, values, block_size)
    if changed_blocks.numel():
        _unpack_kernel[(changed_blocks.numel(),)](out, out.numel(), changed_blocks, codes, bitmaps,
                                                  value_offsets, values, values.numel(), BLOCK=block_size)
