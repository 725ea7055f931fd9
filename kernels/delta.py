"""Block kernels of the lossless delta codec (``compression/delta.py`` owns the wire format).

Values are 16-bit patterns (bf16 or fp16 viewed as int16). Each pattern ``u`` is mapped to an
ordered integer (negative floats reversed, so -0.0 and +0.0 are neighbours and float order is
integer order); the per-value delta ``d = o_new - o_old`` needs 17 bits and is zigzagged to
``z = 2|d| - (d < 0)``. A changed value (``z > 0``) carries ``v = z - 1`` (17 bits at most).
Per block of ``B`` values:

- ``code``: 0 if nothing changed, else ``width + 1``, plus ``SPARSE`` (0x80) where the bitmap is sparse;
- ``bitmap``: bit ``i % 8`` of byte ``i // 8`` set if value ``i`` changed, in one of two forms, whichever is
  smaller (flat on ties): flat, ``B / 8`` bytes; or sparse, a bit per row of 8 values (``flag_bytes(B)`` bytes,
  set where the row's byte is not 0) followed by the bytes of those rows only. The decoder gets the block's
  ``count`` of changed values by popcount;
- ``exc_width``: the bit length of the block's largest ``v`` (0..17);
- the value stream: each changed value, in order, in a ``width``-bit slot; the slot
  value ``2**width - 1`` is an escape whose ``v`` follows the slots in an exception list of
  ``exc_width``-bit entries (escapes in order). So ``count * width + exc_width * n_esc`` bits (``n_esc``
  escapes), little-endian (bit ``k`` of the stream is bit ``k % 8`` of byte ``k // 8``), padded to whole bytes.

A changed block's record is its bitmap followed by its value stream. Where each record starts: blocks form
groups of ``group_blocks(B)``, and each group's region holds its changed blocks' record starts relative to the
group's first record (u16: a group's records span less than 64 KiB), their exc_widths, then their records; a u32
entry per group says where its region starts. So a decoder finds any block's record from its group's entry and the
group's codes, with no pass over the whole payload first.

``width`` minimizes ``count * width + exc_width * n_esc(width)`` over 1..7 and 17 (the smallest on
ties; 17 never escapes since ``v <= 131069``), and is 0 when every changed value has ``v = 0``. Width 1
spends ``exc_width + 1`` bits on an escaped value, what an escape-free width would, so widths 8..16 win
only in blocks whose values mostly need 8 bits or more but fewer than their largest: never in the
AdamW steps measured (optimal widths 1-5, ``docs/delta.md``), and leaving them out lets the kernel count
the 8 candidates' escapes in one packed word per row. Deltas
are heavy-tailed (mostly +-1 ulp, but a weight crossing zero moves ~2**15), so a per-block maximum
width would let one outlier set the cost of the whole block; escapes cap that at ``exc_width``
bits, which is 17 only in the few blocks that hold such an outlier (version 1 of the format spent
17 bits on every escape: 12% more bytes at lr 1e-4, ``docs/delta.md``).

Two implementations give identical bytes (``tests/test_delta.py`` checks it):

- PyTorch references (the CPU path and the test oracle): ``analyze_blocks_reference`` (codes,
  counts, escapes, bitmaps, slot and exception values compacted per block; copies ``new`` into
  ``prev``), ``pack_records_reference`` (the changed blocks' bitmaps and bit-packed streams at byte offsets
  from a prefix sum) and ``unpack_records_reference`` (applies the deltas to ``out`` in place).
- Triton kernels (the CUDA path, one host sync per encode): ``encode_blocks`` codes every block's record into
  its own fixed-size row, updates ``prev`` in the same pass and sums record bytes, changed values and changed
  blocks per tile of 32 blocks (atomics); ``scan_tiles`` turns the tiles' sums into the payload size, the totals and
  where each span of 16 tiles starts (one small program); ``gather_records`` moves the changed blocks' records into
  the payload's group regions at those starts plus a scan within each tile and writes the group entries;
  ``decode_blocks`` decodes in place, one launch for every payload of a gather.
"""

import struct
from dataclasses import dataclass, replace

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the references run everywhere
    triton = None

MAX_WIDTH = 17  # bits of v = z - 1 < 2**17; also the width of an exception entry
NARROW_WIDTHS = 7  # the widths 1..7 and 17 are the candidates (module docstring)
MAX_GROUP_BLOCKS = 32  # blocks per group (module docstring) at B <= 512; a decode program reads its group's codes
SPARSE = 0x80  # code bit of a block whose bitmap is sparse: row flags, then the non-empty rows' bytes
TILE_FIELD = 24  # bits of each of a tile's sums in the encoder's packed tile sums (_tile_fields)
SPAN_TILES = 16  # tiles per entry of the scan over a shard's tiles (_scan_tiles_kernel)


def read_slack_bytes(block_size: int) -> int:
    """Bytes ``decode_blocks`` may read past a payload: each record's first B / 8 bytes (whichever its bitmap's form),
    and the value streams as 32-bit words (up to 3 bytes past their end)."""
    return max(3, block_size // 8)


def flag_bytes(block_size: int) -> int:
    """Bytes of a sparse bitmap's row flags: a bit per row of 8 values."""
    return -(-block_size // 64)


def record_max_nbytes(block_size: int) -> int:
    """The longest record of a block: a flat bitmap and 17 bits per value."""
    return block_size // 8 + -(-MAX_WIDTH * block_size // 8)


def group_blocks(block_size: int) -> int:
    """Blocks per group: the largest power of two <= MAX_GROUP_BLOCKS whose records, all but the last of at most
    ``record_max_nbytes(B)`` bytes, start within a u16 of the group's first (32 at B <= 512, 4 at B = 8192); at most
    the gather's tile (``_tile_blocks``), so a tile holds whole groups."""
    longest = record_max_nbytes(block_size)
    g = MAX_GROUP_BLOCKS
    while (g - 1) * longest > 0xFFFF:
        g //= 2
    return g


@dataclass
class BlockAnalysis:
    slots: torch.Tensor  # int32 [n_blocks, B]: row b starts with its changed values' slot values
    exceptions: torch.Tensor  # int32 [n_blocks, B]: row b starts with its escaped values' v
    codes: torch.Tensor  # uint8 [n_blocks]: 0 = unchanged, else width + 1 (| SPARSE)
    counts: torch.Tensor  # int32 [n_blocks]: changed values per block
    n_esc: torch.Tensor  # int32 [n_blocks]: escaped values per block
    exc_widths: torch.Tensor  # uint8 [n_blocks]: bits per exception entry
    bitmaps: torch.Tensor  # uint8 [n_blocks, B // 8]: flat
    record_bitmaps: torch.Tensor  # uint8 [n_blocks, B // 8]: the bitmap as the record holds it, then zeros
    bitmap_nbytes: torch.Tensor  # int64 [n_blocks]: bytes of the record's bitmap (of changed blocks)


def width_of(codes):
    """The slot width of each changed block's code (int64)."""
    return (codes.to(torch.int64) & ~SPARSE) - 1


def stream_nbytes(counts, codes, n_esc, exc_widths):
    """Bytes of each block's value stream (int64), from its count, code, escapes and exception width."""
    width = width_of(codes).clamp(min=0)
    return (counts.to(torch.int64) * width + exc_widths.to(torch.int64) * n_esc.to(torch.int64) + 7) // 8


# --- integrity hash --------------------------------------------------------------------------
#
# A gather's integrity check (compression/delta.py) compares the hash of the change a sender coded with the hash of
# the change each receiver decoded. With ``o`` and ``n`` a value's ordered value (``to_ordered``) before and after,
# value i (= 8 r + j: row r, lane j) of block b of B values adds to its block's sum
#
#     S_b = sum_i ((n - o) * (o + n + L_j) * (2 r + 1) K_ROW)    mod 2^32,   L_j = ((2 j + 1) K_LANE mod 2^15) 2^17 + 1
#     H   = sum_b S_b * ((2 b + 1) K_BLOCK mod 2^64)             mod 2^64
#
# (K_* odd). Unchanged values add 0, so encoder and decoder sum over the blocks they touch anyway, in any order (atomic
# adds); per value it costs the kernels an add of three and a multiply-add. The term (n - o)(o + n + L_j) = n^2 - o^2
# + L_j (n - o) makes a value that ends wrong change the hash whichever side went wrong: a receiver that applies the
# right change d to an old value that drifted by e (from the sender's copy) changes the term by 2 d e, a wrong change
# d' (ending at n') by (d' - d)(n + n' + L_j). With n, n' < 2^16 and L_j = 1 mod 2^17, n + n' + L_j is no multiple of
# 2^17, so neither product has 32 factors of 2: one wrong value always changes H. The lane offsets tell the lanes of a
# row apart; several wrong values in one block escape with odds of about 2**-32, in several blocks about 2**-64. A
# keyframe's hash is its values' against zeros.

HASH_LANE, HASH_ROW = 0x4F1B, 0x85EBCA77  # odd multipliers: lane offsets (15 bits), rows (32 bits)
HASH_BLOCK = 0x9E3779B97F4A7C15  # odd 64-bit
# Blocks add their terms of H into HASH_SLOTS partial sums, block b into slot b % HASH_SLOTS: neighbouring blocks,
# which run at the same time, hit different addresses, and the sum over the slots is one short load.
HASH_SLOTS = 64
_MASK32 = 0xFFFFFFFF


def _as_int64(x: int) -> int:
    """A 64-bit pattern as a signed int64 (torch's wrapping arithmetic gives the same bits as uint64's)."""
    return x - 2**64 if x >= 2**63 else x


def hash_of_changes(old_ordered, new_ordered, positions: torch.Tensor, numel: int, block_size: int) -> torch.Tensor:
    """H (int64 [1]) of values at ``positions`` (int64) of a shard of ``numel`` values moving from ``old_ordered`` to
    ``new_ordered`` (ordered values, any int dtype)."""
    old, new = old_ordered.to(torch.int64), new_ordered.to(torch.int64)
    i, b = positions % block_size, positions // block_size
    lane_offset = ((2 * (i % 8) + 1) * HASH_LANE % 2**15) * 2**17 + 1
    terms = ((new - old) * (old + new + lane_offset)) & _MASK32
    row_weight = (2 * (i // 8) + 1) * HASH_ROW & _MASK32
    n_blocks = -(-numel // block_size)
    sums = torch.zeros(n_blocks, dtype=torch.int64, device=positions.device)
    sums.index_add_(0, b, (terms * row_weight) & _MASK32)  # (products wrap: their low 32 bits are exact)
    block_weight = (2 * torch.arange(n_blocks, device=positions.device) + 1) * _as_int64(HASH_BLOCK)
    return ((sums & _MASK32) * block_weight).sum().reshape(1)


def change_hash_reference(old: torch.Tensor, new: torch.Tensor, block_size: int) -> torch.Tensor:
    """H (int64 [1]) of the change from ``old`` to ``new`` (int16 patterns of a whole shard); ``old`` None: a
    keyframe's, against zeros."""
    positions = torch.arange(new.numel(), device=new.device)
    old_ordered = torch.zeros_like(positions) if old is None else to_ordered(old)
    return hash_of_changes(old_ordered, to_ordered(new), positions, new.numel(), block_size)


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
    """Per block: the width of least ``count * width + exc_width * n_esc`` among 1..NARROW_WIDTHS and 17 (which
    never escapes), the smallest on ties (0 if all v are 0), its n_esc and ``exc_width``."""
    exc_width = _bit_length(torch.where(changed, v, 0).amax(1))
    widths = torch.tensor([*range(1, NARROW_WIDTHS + 1), MAX_WIDTH], device=v.device)
    n_esc = torch.stack([(changed & (v >= (1 << w) - 1)).sum(1) for w in widths.tolist()], 1)
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
    bitmaps = _pack_bits(changed)
    sparse, record_bitmaps, bitmap_nbytes = _record_bitmaps(bitmaps, block_size)
    codes = torch.where(counts > 0, codes | torch.where(sparse, SPARSE, 0).to(torch.uint8), 0)
    return BlockAnalysis(slots, _compact(v, escaped), codes, counts, n_esc, exc_width.to(torch.uint8), bitmaps,
                         record_bitmaps, bitmap_nbytes)


def _record_bitmaps(bitmaps: torch.Tensor, block_size: int) -> tuple:
    """Per block: whether its sparse bitmap is smaller than the flat one, the bitmap in its record's form (uint8
    [n_blocks, B / 8], zeros after it) and its bytes."""
    rows, flags = block_size // 8, flag_bytes(block_size)
    nonempty = bitmaps != 0
    flag_bits = torch.nn.functional.pad(nonempty.to(torch.int32), (0, 8 * flags - rows))
    sparse_form = torch.cat([_pack_bits(flag_bits), _compact(bitmaps, nonempty)], 1)[:, :rows]
    sparse_nbytes = flags + nonempty.sum(1)
    sparse = sparse_nbytes < rows
    return (sparse, torch.where(sparse.unsqueeze(1), sparse_form, bitmaps),
            torch.where(sparse, sparse_nbytes, rows).to(torch.int64))


def _read_bitmaps(padded: torch.Tensor, record_offsets, codes, block_size: int) -> tuple:
    """Inverse of ``_record_bitmaps`` for the records at ``record_offsets`` of ``padded`` (int64 bytes, at least
    B / 8 readable past the last record): the flat bitmaps (bool [n, B]) and the bitmaps' bytes."""
    rows, flags = block_size // 8, flag_bytes(block_size)
    raw = padded[record_offsets.unsqueeze(1) + torch.arange(rows, device=padded.device)]
    row = torch.arange(rows, device=padded.device)
    flag = ((raw[:, row // 8] >> (row % 8)) & 1) == 1
    rank = flag.cumsum(1) - 1
    sparse_bytes = torch.where(flag, raw.gather(1, (flags + rank).clamp(0, rows - 1)), 0)
    sparse = (codes.to(torch.int64) & SPARSE) != 0
    bitmaps = torch.where(sparse.unsqueeze(1), sparse_bytes, raw)
    nbytes = torch.where(sparse, flags + flag.sum(1), rows)
    i = torch.arange(block_size, device=padded.device)
    return ((bitmaps.repeat_interleave(8, 1) >> (i % 8)) & 1) == 1, nbytes


def _scatter_bits(bits, start, values, width, present) -> None:
    """bits[start + k] = bit k of each present value, for k < width."""
    k = torch.arange(MAX_WIDTH, device=bits.device)
    on = present.unsqueeze(-1) & (k < width.unsqueeze(-1)) & (((values.unsqueeze(-1) >> k) & 1) == 1)
    bits[(start.unsqueeze(-1) + k)[on]] = True


def pack_records_reference(a: BlockAnalysis, changed_blocks, record_offsets, values: torch.Tensor) -> None:
    """Write each changed block's record (bitmap, value stream) at its byte offset in ``values`` (uint8, rewritten
    here)."""
    width = width_of(a.codes[changed_blocks]).unsqueeze(1)
    counts = a.counts[changed_blocks].to(torch.int64).unsqueeze(1)
    n_esc = a.n_esc[changed_blocks].to(torch.int64).unsqueeze(1)
    exc_width = a.exc_widths[changed_blocks].to(torch.int64).unsqueeze(1)
    i = torch.arange(a.slots.shape[1], device=values.device)
    bitmap_nbytes = a.bitmap_nbytes[changed_blocks].unsqueeze(1)
    base = (record_offsets.unsqueeze(1) + bitmap_nbytes) * 8
    bits = torch.zeros(values.numel() * 8, dtype=torch.bool, device=values.device)
    _scatter_bits(bits, base + i * width, a.slots[changed_blocks], width, i < counts)
    _scatter_bits(bits, base + counts * width + i * exc_width, a.exceptions[changed_blocks], exc_width, i < n_esc)
    values.copy_(_pack_bits(bits))
    k = torch.arange(a.record_bitmaps.shape[1], device=values.device)
    in_bitmap = k < bitmap_nbytes
    values[(record_offsets.unsqueeze(1) + k)[in_bitmap]] = a.record_bitmaps[changed_blocks][in_bitmap]


def _read_bits(padded, bitpos, width):
    """``width`` (<= 17) bits at stream bit ``bitpos``: a shift <= 7 plus 17 bits spans <= 3 bytes."""
    byte = (bitpos >> 3).clamp(min=0)
    word = padded[byte] | (padded[byte + 1] << 8) | (padded[byte + 2] << 16)
    return (word >> (bitpos & 7)) & _escape_code(width)


def unpack_records_reference(out, changed_blocks, codes, exc_widths, record_offsets, values,
                             block_size) -> torch.Tensor:
    """Apply the deltas of the changed blocks' records (at ``record_offsets`` of ``values``) to ``out`` (int16 view
    holding the previous values); returns the hash of the change (``hash_of_changes``, int64 [1])."""
    i = torch.arange(block_size, device=out.device)
    padded = torch.cat([values, values.new_zeros(block_size // 8 + 3)]).to(torch.int64)
    changed, bitmap_nbytes = _read_bitmaps(padded, record_offsets, codes[changed_blocks], block_size)
    width = width_of(codes[changed_blocks]).unsqueeze(1)
    exc_width = exc_widths.to(torch.int64).unsqueeze(1)
    base = (record_offsets + bitmap_nbytes).unsqueeze(1) * 8
    slot = _read_bits(padded, base + (changed.cumsum(1) - 1) * width, width)
    escaped = changed & (width > 0) & (slot == _escape_code(width))
    exc_pos = base + changed.sum(1, keepdim=True) * width + (escaped.cumsum(1) - 1) * exc_width
    z = torch.where(escaped, _read_bits(padded, exc_pos, exc_width), slot) + 1
    d = (z >> 1) ^ -(z & 1)
    idx = changed_blocks.unsqueeze(1) * block_size + i
    keep = changed & (idx < out.numel())
    flat_idx = idx[keep]
    old_ordered = to_ordered(out[flat_idx])
    new_ordered = old_ordered + d[keep].to(torch.int32)
    out[flat_idx] = from_ordered(new_ordered)
    return hash_of_changes(old_ordered, new_ordered, flat_idx, out.numel(), block_size)


# --- Triton kernels ----------------------------------------------------------------------------
#
# The CUDA path needs one host sync per encode (the payload size; the decode's headers come with it):
#   encode: _encode_kernel (every block: code, counts, and its record, bitmap then value stream, into
#           the block's fixed-size row of ``records``; updates ``prev``; adds its sizes to its tile's sums)
#           -> _scan_tiles_kernel (each span's start, the totals, the payload size) -> size sync
#           -> _gather_kernel (codes, group entries, and each group's region: offsets, exc_widths and records of
#           its changed blocks, from its span's start plus its earlier tiles and a scan within the tile, the
#           records as whole 32-bit words but for their first and last).
#   decode: _decode_kernel (each block finds its record through its group's entry).
# _gather_kernel takes a tile of blocks per program (one block each was latency bound: a few live
# bytes per program). The others run one program per block of B values as
# rows of 8, a row per thread (two from B = 512: _num_warps): below B = 256 several threads hold
# each row, and one thread's in-place store could overtake another's load of the same value (the
# first Triton version, with two threads per value, failed on CUDA that way), so a barrier separates
# the last read of an updated buffer from the write to it; the atomic ORs are idempotent.

if triton is not None:
    _NARROW_WIDTHS = tl.constexpr(NARROW_WIDTHS)
    _MAX_WIDTH = tl.constexpr(MAX_WIDTH)
    _NO_ESCAPE = tl.constexpr(1 << MAX_WIDTH)  # above every v
    _SPARSE = tl.constexpr(SPARSE)
    _TILE_FIELD = tl.constexpr(TILE_FIELD)
    _TILE_BLOCKS_AT = tl.constexpr(2 * TILE_FIELD)  # bit of a tile's changed blocks in its sums
    _TILE_MASK = tl.constexpr((1 << TILE_FIELD) - 1)
    _HASH_LANE = tl.constexpr(HASH_LANE)
    _HASH_ROW = tl.constexpr(HASH_ROW)
    _HASH_BLOCK = tl.constexpr(HASH_BLOCK)
    _HASH_SLOTS = tl.constexpr(HASH_SLOTS)

    @triton.jit
    def _ordered(s):
        """``to_ordered`` of int16 patterns sign-extended to int32: s + 0x8000 for s >= 0, ~s (0xFFFF - u) below."""
        return s ^ ((s >> 15) | 0x8000)

    @triton.jit
    def _from_ordered(o):
        """Inverse of ``_ordered`` (0 <= o < 2**16), as int16."""
        return (o ^ (((o >> 15) - 1) | 0x8000)).to(tl.int16)

    @triton.jit
    def _block_hash(old_ordered, new_ordered, d, b, r, j):
        """The block's term of H (int64; module section "integrity hash") from its values [rows, 8] moving by ``d``
        from ``old_ordered`` to ``new_ordered`` (int32), row index ``r`` [rows], lane ``j`` [1, 8] (constants per
        register), block ``b``: per value an add of three and a multiply-add, per row a multiply by its weight."""
        # in uint32 throughout: the products, sums and the shift wrap mod 2^32
        lane_offset = ((((2 * j.to(tl.uint32) + 1) * _HASH_LANE) & 0x7FFF) << 17) | 1  # L_j: a constant per register
        both = old_ordered.to(tl.uint32, bitcast=True) + new_ordered.to(tl.uint32, bitcast=True)
        terms = d.to(tl.uint32, bitcast=True) * (both + lane_offset)
        block_sum = tl.sum(tl.sum(terms, axis=1) * ((2 * r.to(tl.uint32) + 1) * _HASH_ROW), axis=0)
        weight = (2 * b.to(tl.uint64) + 1) * _HASH_BLOCK
        return (block_sum.to(tl.uint64) * weight).to(tl.int64, bitcast=True)

    @triton.jit
    def _add_once(ptr, value, r, mask):
        """``*ptr += value`` (a scalar, where ``mask``) by one thread, that of row 0 (``r``: the row index [rows]). The
        address varies with the row, so ptxas does not compile it as a uniform atomic: that takes a warp-aggregated
        branch (lane id, vote, popcount and a multiply before the add) on the program's critical path."""
        tl.atomic_add(ptr + r, value + r * 0, mask=mask & (r == 0), sem="relaxed")

    @triton.jit
    def _bit_lengths(x):
        """Bits of each 0 <= x < 2**24 (0 for 0): the exponent field of x as an exact fp32."""
        return tl.where(x > 0, (x.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 126, 0)

    @triton.jit
    def _best_width(z):
        """``_choose_width`` of the block ``z`` [rows, 8] (a row per thread): width, n_esc, count and exc_width.
        ``n_esc(w)`` counts the values with ``v >= 2**w - 1``, i.e. ``z >= 2**w``, i.e. bit length > w. Each
        value sets nibble w of a word for w < min(bit length, 8); a row's sum holds its 8 counts (<= 8 each),
        spread to 16-bit fields for the sum over rows: four block reductions give n_esc(0..7), n_esc(0)
        being the count of changed values."""
        exc_width = _bit_lengths(tl.maximum(tl.max(tl.max(z, axis=1), axis=0) - 1, 0))
        # The shift 32 - 4 * min(L, 8) from the fp32 exponent e of min(z, 255) (L = e - 126 for z > 0) as
        # 536 - 4 * e, capped at 31 (z = 0: e = 0, and 0x11111111 >> 31 = 0): three integer operations per value
        # fewer than bit lengths and selects (the kernel is bound by them).
        e = tl.minimum(z, 255).to(tl.float32).to(tl.int32, bitcast=True) >> 23
        nibbles = tl.sum(0x11111111 >> tl.minimum(536 - 4 * e, 31), axis=1)
        pairs = (tl.sum(nibbles & 0x000F000F, axis=0), tl.sum((nibbles >> 4) & 0x000F000F, axis=0),
                 tl.sum((nibbles >> 8) & 0x000F000F, axis=0), tl.sum((nibbles >> 12) & 0x000F000F, axis=0))
        count = pairs[0] & 0xFFFF  # pairs[k]: n_esc(k) | n_esc(k + 4) << 16
        width, n_esc = count * 0 + 1, pairs[1] & 0xFFFF
        best = count + exc_width * n_esc
        for w in tl.static_range(2, _NARROW_WIDTHS + 1):
            n = (pairs[w % 4] >> (16 * (w // 4))) & 0xFFFF
            cost = count * w + exc_width * n
            better = cost < best
            width, best, n_esc = tl.where(better, w, width), tl.where(better, cost, best), tl.where(better, n, n_esc)
        better = count * _MAX_WIDTH < best  # 17 bits never escape
        width, n_esc = tl.where(better, _MAX_WIDTH, width), tl.where(better, 0, n_esc)
        trivial = exc_width == 0
        return tl.where(trivial, 0, width), tl.where(trivial, 0, n_esc), count, exc_width

    @triton.jit
    def _or_bits(stream_ptr, value, slots, width, first_bit):
        """OR each value (< 2**17) of rows [rows, 8] into the 32-bit stream words, value k of row r at bit ``bitpos =
        first_bit[r] + slots[r, k] * width``: its shifted 64-bit window spans word ``bitpos >> 5`` and possibly the
        next; absent values are 0 and send nothing (their bit positions are never used). Relaxed atomics (the L2
        combines them)."""
        bitpos = first_bit[:, None] + slots * width
        word = stream_ptr + (bitpos >> 5)
        placed = value.to(tl.int64) << (bitpos & 31)
        lo, hi = placed.to(tl.int32), (placed >> 32).to(tl.int32)
        tl.atomic_or(word, lo, mask=lo != 0, sem="relaxed")
        tl.atomic_or(word + 1, hi, mask=hi != 0, sem="relaxed")

    @triton.jit
    def _or_rows(stream_ptr, values, slots, width, first_bit, row_bits):
        """OR each row of ``values`` [rows, 8] (< 2**width each; 0 where absent) into the 32-bit stream words,
        value k of row r at bit ``first_bit[r] + slots[r, k] * width``, where each row's ``row_bits`` span at most
        64: they are summed into one word in the row's thread (disjoint bits, so the sum is an OR) and go out as
        atomic ORs of its window: three per row instead of one or two per value, and few lanes on one word. Where
        every row holds at most 32 bits (widths up to 4 always; most blocks of the steady state), in 32-bit
        arithmetic and two atomics: the kernel is bound by its integer operations, and a variable 64-bit shift
        and sum cost several times a 32-bit one."""
        word = stream_ptr + (first_bit >> 5)
        if tl.max(row_bits, axis=0) <= 32:
            # & 31: absent values (0) may sit at bit 32 or beyond, which a 32-bit shift may not reach
            row = tl.sum(values << ((slots * width) & 31), axis=1).to(tl.uint32, bitcast=True)
            offset = (first_bit & 31).to(tl.uint32)
            low = (row << offset).to(tl.int32, bitcast=True)
            high = tl.where(offset > 0, row >> (32 - offset), 0).to(tl.int32, bitcast=True)
            tl.atomic_or(word, low, mask=low != 0, sem="relaxed")
            tl.atomic_or(word + 1, high, mask=high != 0, sem="relaxed")
        else:
            shift = tl.minimum(slots * width, 63).to(tl.uint64)  # absent values (0) may sit at bit 64
            row64 = tl.sum(values.to(tl.uint64) << shift, axis=1)
            offset64 = (first_bit & 31).to(tl.uint64)
            low64 = row64 << offset64
            top = tl.where(offset64 > 0, row64 >> (64 - offset64), 0)
            parts = (low64.to(tl.int32), (low64 >> 32).to(tl.int32), top.to(tl.int32))
            for k in tl.static_range(3):
                tl.atomic_or(word + k, parts[k], mask=parts[k] != 0, sem="relaxed")

    @triton.jit
    def _block_values(b, i, numel, start_ptr, stride_ptr, valid_ptr, shard_rank, BLOCK: tl.constexpr,
                      SEGMENTED: tl.constexpr, ALIGNED: tl.constexpr):
        """Where value ``i`` of block ``b`` lies in the shard's data and whether it exists: at ``b * BLOCK + i`` of a
        plain shard of ``numel`` values, or (``SEGMENTED``) of rank ``shard_rank``'s slices through the block table
        (``Segments.block_table``)."""
        if SEGMENTED:
            first = tl.load(start_ptr + b) + shard_rank * tl.load(stride_ptr + b)
            valid = tl.load(valid_ptr + b)
            if ALIGNED:  # whole 16-byte rows: the loads and stores stay vectorized
                first = tl.multiple_of(first, 8)
                valid = tl.multiple_of(valid, 8)
            return first + i, i < valid
        idx = b * BLOCK + i
        return idx, idx < numel

    @triton.jit(do_not_specialize=["shard_rank"])
    def _encode_kernel(prev_ptr, new_ptr, numel, start_ptr, stride_ptr, valid_ptr, shard_rank, codes_ptr,
                       counts_ptr, n_esc_ptr, exc_widths_ptr, nbytes_ptr, records_ptr, tile_sums_ptr,
                       hash_slots_ptr, BLOCK: tl.constexpr, RECORD_WORDS: tl.constexpr, TILE: tl.constexpr,
                       SEGMENTED: tl.constexpr,
                       ALIGNED: tl.constexpr,
                       CAST: tl.constexpr, FP16: tl.constexpr, src_start_ptr, SOURCE_TABLE: tl.constexpr,
                       FIELD: tl.constexpr, WIDE_SCAN: tl.constexpr, FLAG_BYTES: tl.constexpr,
                       FLAG_WORDS: tl.constexpr, HASH: tl.constexpr):
        # the block as rows of 8 values, a row per thread (or two; 16-byte loads; ranks, bitmap bytes and the
        # packing of a row stay in its thread, only per-row totals cross threads). ``prev`` is contiguous
        # (segments: padded to whole blocks), the new values plain or segmented (_block_values). The scans carry
        # changed values, escapes and (across rows) non-empty rows as fields of one integer (_launch_shape).
        ROWS: tl.constexpr = BLOCK // 8
        MASK: tl.constexpr = (1 << FIELD) - 1
        b = tl.program_id(0).to(tl.int64)
        r = tl.arange(0, ROWS)
        j = tl.arange(0, 8)[None, :]
        i = r[:, None] * 8 + j
        at, inside = _block_values(b, i, numel, start_ptr, stride_ptr, valid_ptr, shard_rank, BLOCK, SEGMENTED, ALIGNED)
        idx = b * BLOCK + i
        if SOURCE_TABLE:  # segments of fp32 sources (their own table), coded against the buffer they are cast into
            src = tl.load(src_start_ptr + b)
            if ALIGNED:
                src = tl.multiple_of(src, 8)
            new16 = tl.load(new_ptr + src + i, mask=inside, other=0)
            idx = at
        else:
            new16 = tl.load(new_ptr + at, mask=inside, other=0)
        if CAST:  # fp32 master weights, rounded to nearest even as torch's copy_ does
            if FP16:
                new16 = new16.to(tl.float16).to(tl.int16, bitcast=True)
            else:
                new16 = new16.to(tl.bfloat16).to(tl.int16, bitcast=True)
        old = tl.load(prev_ptr + idx, mask=inside, other=0)
        old_ordered = _ordered(old.to(tl.int32))
        new_ordered = _ordered(new16.to(tl.int32))
        d = new_ordered - old_ordered
        if HASH:  # the integrity hash of the block's change, into its slot (HASH_SLOTS): here, so that the old values
            # need no registers past this point (an unchanged block's hash is 0: no atomic)
            block_hash = _block_hash(old_ordered, new_ordered, d, b, r, j)
            _add_once(hash_slots_ptr + (b & (_HASH_SLOTS - 1)), block_hash, r, block_hash != 0)
        z = (d << 1) ^ (d >> 31)
        changed = z != 0
        v = z - 1
        width, n_esc, count, exc_width = _best_width(z)
        escape = (1 << width) - 1
        # unchanged values have v = -1, and width 0 escapes nothing: a bound above every v there
        escaped = v >= tl.where(width > 0, escape, _NO_ESCAPE)
        both = changed.to(tl.int32) | (escaped.to(tl.int32) << FIELD)  # changed and escaped counts
        if WIDE_SCAN:
            both = both.to(tl.int64)
        in_row = tl.cumsum(both, axis=1) - both  # exclusive ranks within the row
        row_both = tl.sum(both, axis=1)
        row_byte = tl.sum(changed.to(tl.int32) << j, axis=1)  # the row's bitmap byte
        nonempty = row_byte != 0
        row_all = row_both + (nonempty.to(row_both.dtype) << (2 * FIELD))
        row_start = tl.cumsum(row_all, axis=0) - row_all  # exclusive ranks of the rows' first values, and rows
        slot_rank, esc_rank = (in_row & MASK).to(tl.int32), (in_row >> FIELD).to(tl.int32)
        row_count, row_esc = (row_both & MASK).to(tl.int32), (row_both >> FIELD).to(tl.int32)
        first_slot, first_esc = (row_start & MASK).to(tl.int32), ((row_start >> FIELD) & MASK).to(tl.int32)
        nbits = count * width + exc_width * n_esc
        # the record as the payload holds it, from its row's first word: the bitmap, flat or sparse (row flags, then
        # the non-empty rows' bytes), whichever is smaller, then the value stream (so the gather copies whole words)
        record = records_ptr + b * RECORD_WORDS
        bitmap_nbytes = tl.minimum(FLAG_BYTES + tl.sum(nonempty.to(tl.int32), axis=0), ROWS)
        flat = bitmap_nbytes == ROWS
        bitmap_at = tl.where(flat, r, FLAG_BYTES + (row_start >> (2 * FIELD)).to(tl.int32))
        stream_bit = 8 * bitmap_nbytes
        exc_start = stream_bit + count * width
        # the record's live words are zeroed here, and the bitmap and values OR their bits in after the barrier:
        # whole rows of 8 words (a mask constant along a row keeps the 16-byte stores), within _record_words(B) <= B
        live_rows = r[:, None] * 256 < stream_bit + nbits
        tl.store(record + i, tl.zeros([ROWS, 8], dtype=tl.int32), mask=live_rows & (j < 8))
        tl.debug_barrier()  # every thread has read prev before it is overwritten, and the zeros are stored
        tl.store(prev_ptr + idx, new16, mask=inside & nonempty[:, None])  # a row with no change holds its values
        tl.atomic_or(record + (bitmap_at >> 2), row_byte << (8 * (bitmap_at & 3)), mask=nonempty, sem="relaxed")
        if bitmap_nbytes < ROWS:  # the row flags as 32-bit words (FLAG_BYTES of them live)
            flag_bits = tl.reshape(nonempty.to(tl.int32) << (r % 32), [FLAG_WORDS, ROWS // FLAG_WORDS])
            flag_words = tl.sum(flag_bits, axis=1)
            tl.atomic_or(record + tl.arange(0, FLAG_WORDS), flag_words, mask=flag_words != 0, sem="relaxed")
        slot = tl.maximum(tl.minimum(v, escape), 0)  # 0 where unchanged (v = -1)
        exception = v * escaped.to(tl.int32)  # v where escaped, else 0
        row_bits = tl.maximum(row_count * width, row_esc * exc_width)
        if tl.max(row_bits, axis=0) <= 64:  # narrow widths: every block of the steady state
            _or_rows(record, slot, slot_rank, width, stream_bit + first_slot * width, row_count * width)
            _or_rows(record, exception, esc_rank, exc_width, exc_start + first_esc * exc_width, row_esc * exc_width)
        else:
            _or_bits(record, slot, slot_rank, width, stream_bit + first_slot * width)
            _or_bits(record, exception, esc_rank, exc_width, exc_start + first_esc * exc_width)
        tl.store(codes_ptr + b, tl.where(count > 0, (width + 1) | tl.where(flat, 0, _SPARSE), 0).to(tl.uint8))
        tl.store(counts_ptr + b, count)
        tl.store(n_esc_ptr + b, n_esc)
        tl.store(exc_widths_ptr + b, exc_width.to(tl.uint8))
        nbytes = tl.where(count > 0, bitmap_nbytes + (nbits + 7) // 8, 0).to(tl.int64)
        tl.store(nbytes_ptr + b, nbytes)
        # the tile's sums (_scan_tiles_kernel): one relaxed atomic per changed block, 32 blocks to an address
        changed_block = count > 0
        _add_once(tile_sums_ptr + b // TILE, _tile_fields(nbytes, count.to(tl.int64), changed_block.to(tl.int64)), r,
                  changed_block)

    @triton.jit
    def _tile_fields(nbytes, values, blocks):
        """A tile's (or span's) record bytes, changed values and changed blocks as fields of one int64 (TILE_FIELD bits
        each, the blocks above: ``_launch_shape`` checks that a span's sums fit, so fields of tiles add up)."""
        return nbytes | (values << _TILE_FIELD) | (blocks << _TILE_BLOCKS_AT)

    @triton.jit
    def _record_start(fields):
        """Changed blocks and record bytes of tile fields as one int64 for a prefix sum over a shard: the bytes in its
        low 32 bits (a shard's records stay below 4 GiB: compression/delta.py's _check_numel), the blocks above."""
        return (fields & _TILE_MASK) | ((fields >> _TILE_BLOCKS_AT) << 32)

    @triton.jit
    def _scan_tiles_kernel(tile_sums_ptr, n_tiles, span_starts_ptr, totals_ptr, header_ptr, regions_at, raw_nbytes,
                           flags, raw_flag, hash_slots_ptr, hash_ptr, SPAN: tl.constexpr, CHUNK: tl.constexpr,
                           HEADER_BYTES: tl.constexpr, HASH: tl.constexpr):
        """One program: per span of SPAN tiles, the changed blocks and record bytes before it (``span_starts``, as
        ``_record_start``: one scan of CHUNK spans per pass, each span's tiles summed in its thread), the totals
        (changed blocks, changed values, record bytes, the payload size: the delta's ``regions_at + 3 * changed
        blocks + record bytes`` (2 + 1 bytes of offset and exc_width per changed block), or ``raw_nbytes`` where
        that is smaller, and the delta's size) and the fields of the two headers at ``header_ptr`` (the payload's,
        then the delta's): flags (``raw_flag`` added for a raw payload), n_changed and nbytes; with ``HASH``, the
        encoder's integrity hash slots summed at ``hash_ptr``."""
        c = tl.arange(0, CHUNK)
        start = n_tiles * 0
        before, values = start.to(tl.int64), start.to(tl.int64)
        while start * SPAN < n_tiles:
            span = start + c
            t = span[:, None] * SPAN + tl.arange(0, SPAN)[None, :]
            fields = tl.sum(tl.load(tile_sums_ptr + t, mask=t < n_tiles, other=0), axis=1)
            x = _record_start(fields)
            tl.store(span_starts_ptr + span, before + tl.cumsum(x, axis=0) - x, mask=span * SPAN < n_tiles)
            before += tl.sum(x, axis=0)
            values += tl.sum((fields >> _TILE_FIELD) & _TILE_MASK, axis=0)
            start += CHUNK
        blocks, nbytes = before >> 32, before & 0xFFFFFFFF
        delta = regions_at + 3 * blocks + nbytes
        raw = delta > raw_nbytes
        size = tl.where(raw, raw_nbytes, delta)
        tl.store(totals_ptr, blocks)
        tl.store(totals_ptr + 1, values)
        tl.store(totals_ptr + 2, nbytes)
        tl.store(totals_ptr + 3, size)
        tl.store(totals_ptr + 4, delta)
        if HASH:
            tl.store(hash_ptr, tl.sum(tl.load(hash_slots_ptr + tl.arange(0, _HASH_SLOTS)), axis=0))
        # the payload's header, then the delta's (their layout: compression/delta.py)
        one, every, at = tl.zeros([1], tl.int64), tl.full([1], True, tl.int1), header_ptr + tl.arange(0, 1)
        _store_le(at + 5, tl.where(raw, flags | raw_flag, flags) + one, 1, every)
        _store_le(at + 12, blocks + one, 4, every)
        _store_le(at + 24, size + one, 8, every)
        _store_le(at + HEADER_BYTES + 5, flags + one, 1, every)
        _store_le(at + HEADER_BYTES + 12, blocks + one, 4, every)
        _store_le(at + HEADER_BYTES + 24, delta + one, 8, every)

    @triton.jit
    def _store_le(ptr, value, NBYTES: tl.constexpr, mask):
        """The low NBYTES bytes of each int64 ``value`` at ``ptr``, little-endian, bytewise (payloads may start
        at any byte)."""
        k = tl.arange(0, NBYTES)[None, :]
        tl.store(ptr[:, None] + k, ((value[:, None] >> (8 * k)) & 0xFF).to(tl.uint8), mask=mask[:, None] & (k < NBYTES))

    @triton.jit
    def _load_le(ptr, NBYTES: tl.constexpr, ALIGNED: tl.constexpr = False):
        """Inverse of ``_store_le`` for one value (int64; scalar loads, which a reduction over a tensor of the
        bytes would spread across the warp). ``ALIGNED``: ``ptr`` is a multiple of NBYTES (2 or 4), read as one
        word (the GPU is little-endian)."""
        if ALIGNED:
            word = tl.uint32 if NBYTES == 4 else tl.uint16
            return tl.load(ptr.to(tl.pointer_type(word))).to(tl.int64)
        value = tl.load(ptr).to(tl.uint32)
        for k in tl.static_range(1, NBYTES):
            value |= tl.load(ptr + k).to(tl.uint32) << (8 * k)
        return value.to(tl.int64)

    @triton.jit
    def _record_word(rows, t, lead, RECORD_WORDS: tl.constexpr, mask):
        """Word ``t`` of each record's span in the payload, whose first word holds ``lead`` bytes before the record:
        the record's bytes 4t - lead .. 4t - lead + 3, from its words t - 1 and t (``rows``: the records' int32
        rows; bytes past a record are junk, which the caller does not store)."""
        cur = tl.load(rows + t, mask=mask & (t < RECORD_WORDS), other=0).to(tl.uint32, bitcast=True)
        prev = tl.load(rows + t - 1, mask=mask & (t > 0) & (lead > 0), other=0).to(tl.uint32, bitcast=True)
        shift = (8 * lead).to(tl.uint32)
        return ((cur << shift) | tl.where(lead > 0, prev >> (32 - shift), 0)).to(tl.int32, bitcast=True)

    @triton.jit(do_not_specialize=["header0", "header1", "header2", "header3", "groups_at", "regions_at", "payload_misalign",
                                   "capacity"])
    def _gather_kernel(records_ptr, codes_ptr, exc_widths_ptr, nbytes_ptr, tile_sums_ptr, span_starts_ptr, n_blocks,
                       payload_ptr, payload_misalign, header0, header1, header2, header3, groups_at, regions_at,
                       header_ptr, totals_ptr, capacity,
                       GROUP: tl.constexpr, HEADER_BYTES: tl.constexpr, RECORD_WORDS: tl.constexpr,
                       TILE: tl.constexpr, SPAN: tl.constexpr, CHUNK: tl.constexpr, SLOT: tl.constexpr):
        # SLOT: the delta goes into a slot of ``capacity`` bytes before the host knows its size (a sync-free
        # gather): its header comes from the device (``header_ptr``, its fields written by _scan_tiles_kernel), and
        # a delta larger than the slot (totals[4]) writes nothing
        pid = tl.program_id(0)
        fits = True
        if SLOT:
            fits = tl.load(totals_ptr + 4) <= capacity
        t = tl.arange(0, 32)  # program 0: the header (four little-endian int64 words) and the pad bytes
        if SLOT:
            header = tl.load(header_ptr + t, mask=t < HEADER_BYTES, other=0)
        else:
            word = tl.where(t < 8, header0.to(tl.int64), tl.where(t < 16, header1.to(tl.int64), tl.where(
                t < 24, header2.to(tl.int64), header3.to(tl.int64))))
            header = ((word >> (8 * (t % 8))) & 0xFF).to(tl.uint8)
        tl.store(payload_ptr + t, header, mask=(t < HEADER_BYTES) & (pid == 0) & fits)
        pad_at = HEADER_BYTES + n_blocks
        tl.store(payload_ptr + pad_at + t, tl.zeros([32], dtype=tl.uint8),
                 mask=(pad_at + t < groups_at) & (pid == 0) & fits)
        b = pid.to(tl.int64) * TILE + tl.arange(0, TILE)
        inside = (b < n_blocks) & fits
        code = tl.load(codes_ptr + b, mask=inside, other=0)
        tl.store(payload_ptr + HEADER_BYTES + b, code, mask=inside)
        changed = code != 0
        nbytes = tl.load(nbytes_ptr + b, mask=changed, other=0)
        # the changed blocks and record bytes before each block: its span's start (_scan_tiles_kernel), the sums of
        # the span's earlier tiles, then a scan within the tile (unchanged blocks: 0 bytes)
        k = tl.arange(0, SPAN)
        earlier = tl.load(tile_sums_ptr + pid - pid % SPAN + k, mask=k < pid % SPAN, other=0)
        tile_start = tl.load(span_starts_ptr + pid // SPAN) + _record_start(tl.sum(earlier, axis=0))
        rank_end = (tile_start >> 32) + tl.cumsum(changed.to(tl.int64), axis=0)
        stream_at = (tile_start & 0xFFFFFFFF) + tl.cumsum(nbytes, axis=0) - nbytes
        # the block's group (GROUP divides TILE): its region starts after the offsets, exc_widths and records of the
        # groups before it, and holds the group's n offsets, n exc_widths and records
        i = tl.arange(0, TILE)
        first_of_group = i - i % GROUP
        group_rank = tl.gather(rank_end - changed.to(tl.int64), first_of_group, 0)  # changed blocks before the group
        group_stream = tl.gather(stream_at, first_of_group, 0)
        n_group = tl.gather(rank_end, first_of_group + GROUP - 1, 0) - group_rank
        region = 3 * group_rank + group_stream
        first = inside & (b % GROUP == 0)
        _store_le(payload_ptr + groups_at + 4 * (b // GROUP), region, 4, first)
        in_group = rank_end - 1 - group_rank
        region_ptr = payload_ptr + regions_at + region
        _store_le(region_ptr + 2 * in_group, stream_at - group_stream, 2, changed)
        tl.store(region_ptr + 2 * n_group + in_group, tl.load(exc_widths_ptr + b, mask=changed), mask=changed)
        # the record (bitmap and stream, contiguous from its row's first word) as the 32-bit words of the payload it
        # spans: whole words stored as words, the partial first and last ones bytewise (their other bytes belong to
        # the neighbours); CHUNK words per block and pass up to the tile's longest record
        at = regions_at + region + 3 * n_group + stream_at - group_stream
        lead = ((payload_misalign + at) & 3).to(tl.int32)  # the record's offset in its first word
        span = payload_ptr + at - lead  # a 4-byte boundary
        words = span.to(tl.pointer_type(tl.int32))
        end = lead + nbytes.to(tl.int32)  # the record's end within its span
        n_words = tl.where(changed, (end + 3) >> 2, 0)
        rows = records_ptr + b[:, None] * RECORD_WORDS
        c = tl.arange(0, CHUNK)[None, :]
        longest = tl.max(n_words, axis=0)  # 0 in a tile of unchanged blocks
        chunk = longest * 0
        while chunk * CHUNK < longest:
            w = chunk * CHUNK + c
            live = w < n_words[:, None]
            whole = live & (4 * w >= lead[:, None]) & (4 * w + 4 <= end[:, None])
            tl.store(words[:, None] + w, _record_word(rows, w, lead[:, None], RECORD_WORDS, live), mask=whole)
            chunk += 1
        k = tl.arange(0, 4)[None, :]
        for edge in tl.static_range(2):  # the first and the last word (the same one for a short record)
            w = tl.where(edge == 0, 0, n_words - 1)[:, None]
            value = _record_word(rows, w, lead[:, None], RECORD_WORDS, changed[:, None])
            byte = 4 * w + k
            whole = (4 * w >= lead[:, None]) & (4 * w + 4 <= end[:, None])  # stored in the loop
            mine = changed[:, None] & ~whole & (byte >= lead[:, None]) & (byte < end[:, None])
            tl.store(span[:, None] + byte, ((value >> (8 * k)) & 0xFF).to(tl.uint8), mask=mine)

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

    @triton.jit
    def _read_rows(words_ptr, first_bit, slots, width, row_bits):
        """Inverse of ``_or_rows``: value k of row r (< 2**width) from bit ``first_bit[r] + slots[r, k] * width``
        of the 32-bit little-endian words at ``words_ptr``, where each row's ``row_bits`` span at most 64:
        the row's bits come from at most three word loads (the last one holds a live bit, so reads end at
        most 3 bytes past the section) and every value is shifted out of them in the row's thread; in 32-bit
        arithmetic where every row holds at most 32 bits (as ``_or_rows``)."""
        at = words_ptr + (first_bit >> 5)
        offset = first_bit & 31
        w0 = tl.load(at, mask=row_bits > 0, other=0).to(tl.uint32, bitcast=True)
        w1 = tl.load(at + 1, mask=offset + row_bits > 32, other=0).to(tl.uint32, bitcast=True)
        if tl.max(row_bits, axis=0) <= 32:
            shift = offset.to(tl.uint32)
            row = (w0 >> shift) | tl.where(shift > 0, w1 << (32 - shift), 0)
            values = row[:, None] >> ((slots * width) & 31).to(tl.uint32)  # absent values may sit at bit 32
            values = values.to(tl.int32, bitcast=True)
        else:
            w2 = tl.load(at + 2, mask=offset + row_bits > 64, other=0).to(tl.uint32, bitcast=True).to(tl.uint64)
            shift64 = offset.to(tl.uint64)
            row64 = ((w0.to(tl.uint64) | (w1.to(tl.uint64) << 32)) >> shift64) | tl.where(shift64 > 0,
                                                                                          w2 << (64 - shift64), 0)
            values = (row64[:, None] >> tl.minimum(slots * width, 63).to(tl.uint64)).to(tl.int32)
        return values & ((1 << width) - 1)

    @triton.jit(do_not_specialize=["base_misalign", "src_base", "skip_rank", "capacity"])
    def _decode_kernel(out_ptr, numel, start_ptr, stride_ptr, valid_ptr, payload_ptr, payload_stride, base_misalign,
                       codes_at, groups_at, regions_at, src_base, skip_rank, n_blocks, sizes_ptr, sizes_stride,
                       capacity, hashes_ptr, BLOCK: tl.constexpr, GROUP: tl.constexpr,
                       SEGMENTED: tl.constexpr, ALIGNED: tl.constexpr, WORDS: tl.constexpr, FLAG_BYTES: tl.constexpr,
                       SLOT: tl.constexpr, HASH: tl.constexpr):
        # rows of 8 values, a row per thread, as in _encode_kernel. program_id(1) picks the source rank: src_base
        # and up, ``skip_rank`` skipped; its payload is row src - src_base, at that many payload_strides. The
        # records are read as 32-bit words from the 4-byte boundary at or before the payload row, ``records_lead``
        # bytes earlier (``base_misalign``: payload_ptr % 4). ``WORDS``: every row starts 4-byte aligned (gathers
        # align them), so the group entries are read as whole words. ``SLOT``: payloads in slots of ``capacity`` bytes
        # (a sync-free gather), row k's size at ``sizes_ptr[k * sizes_stride]``: one larger than its slot is skipped.
        # ``HASH``: each block's integrity hash (of the change it applies) is added to row k's slot of it
        # (HASH_SLOTS) at ``hashes_ptr + k * HASH_SLOTS``
        ROWS: tl.constexpr = BLOCK // 8
        b = tl.program_id(0).to(tl.int64)
        src = tl.program_id(1) + src_base
        src += ((skip_rank >= 0) & (src >= skip_rank)).to(tl.int32)
        row = (src - src_base).to(tl.int64)
        payload = payload_ptr + row * payload_stride
        code = tl.load(payload + codes_at + b).to(tl.int32)
        if SLOT:
            code = tl.where(tl.load(sizes_ptr + row * sizes_stride) <= capacity, code, 0)
        if code != 0:
            width = (code & ~_SPARSE) - 1
            # the block's group: its region (from the group's entry) holds the offsets, exc_widths and records of its
            # n_group changed blocks; the block's rank in it from the codes of the group's earlier blocks
            in_group = (b % GROUP).to(tl.int32)
            k = tl.arange(0, GROUP)
            group_changed = tl.load(payload + codes_at + (b - in_group) + k, mask=b - in_group + k < n_blocks,
                                    other=0) != 0
            rank = tl.sum((group_changed & (k < in_group)).to(tl.int32), axis=0)
            n_group = tl.sum(group_changed.to(tl.int32), axis=0)
            region = regions_at + _load_le(payload + groups_at + 4 * (b // GROUP), 4, WORDS)
            r = tl.arange(0, ROWS)
            j = tl.arange(0, 8)[None, :]
            idx, inside = _block_values(b, r[:, None] * 8 + j, numel, start_ptr, stride_ptr, valid_ptr, src, BLOCK,
                                        SEGMENTED, ALIGNED)
            old = tl.load(out_ptr + idx, mask=inside, other=0)
            # a zero computed from out (LLVM folds it after Triton has chosen layouts) gives every [rows, 8]
            # tensor the row-per-thread layout of out's 16-byte loads; from the bitmap bytes alone Triton
            # spreads a row over 8 threads and its in-row scans shuffle
            zero = (old.to(tl.int32) & 0xFFFF) >> 16
            # the record's byte in the payload, counted from the 4-byte boundary at or before the payload's start
            # (``WORDS``: the payload row starts at one)
            if WORDS:
                records_lead = row * 0
            else:
                records_lead = (base_misalign + row * payload_stride) & 3
            record_at = region + 3 * n_group + _load_le(payload + region + 2 * rank, 2) + records_lead
            records = payload - records_lead
            # the record's first B / 8 bytes hold either bitmap (a sparse one is smaller), so one load serves both
            # and the sparse one is picked out of it across the warp, not by loads that wait on each other
            bitmap = tl.load(records + record_at + r).to(tl.int32)
            if code >= _SPARSE:  # row flags, then the non-empty rows' bytes
                flag = (tl.gather(bitmap, r // 8, 0) >> (r % 8)) & 1
                at = tl.minimum(FLAG_BYTES + tl.cumsum(flag, axis=0) - flag, ROWS - 1)
                bitmap = tl.gather(bitmap, at, 0) * flag
                bitmap_nbytes = FLAG_BYTES + tl.sum(flag, axis=0)
            else:
                bitmap_nbytes = code * 0 + ROWS
            changed = ((bitmap[:, None] >> (j + zero)) & 1) != 0
            c = changed.to(tl.int32)
            in_row = tl.cumsum(c, axis=1) - c
            row_count = tl.sum(c, axis=1)
            row_start = tl.cumsum(row_count, axis=0) - row_count
            exc_width = tl.load(payload + region + 2 * n_group + rank).to(tl.int32)
            # the value stream follows the bitmap
            stream_words = records.to(tl.pointer_type(tl.int32)) + (record_at >> 2)
            base = ((record_at & 3).to(tl.int32) + bitmap_nbytes) * 8
            if tl.max(row_count, axis=0) * width <= 64:
                slot = _read_rows(stream_words, base + row_start * width, in_row, width, row_count * width)
            else:
                slot = _load_bits(stream_words, base + (row_start[:, None] + in_row) * width, width, changed)
            escaped = changed & (slot == tl.where(width > 0, (1 << width) - 1, -1))  # width 0 never escapes
            e = escaped.to(tl.int32)
            in_esc = tl.cumsum(e, axis=1) - e
            row_esc = tl.sum(e, axis=1)
            exc_at = base + tl.sum(row_count, axis=0) * width + (tl.cumsum(row_esc, axis=0) - row_esc) * exc_width
            if tl.max(row_esc, axis=0) * exc_width <= 64:
                exception = _read_rows(stream_words, exc_at, in_esc, exc_width, row_esc * exc_width)
            else:
                exception = _load_bits(stream_words, exc_at[:, None] + in_esc * exc_width, exc_width, escaped)
            z = tl.where(escaped, exception, slot) + 1
            # masked by a product, not a select: no predicate per value lives across the stream reads
            d = ((z >> 1) ^ -(z & 1)) * c
            old_ordered = _ordered(old.to(tl.int32))
            new_ordered = old_ordered + d
            new = _from_ordered(new_ordered)
            if HASH:
                block_hash = _block_hash(old_ordered, new_ordered, d, b, r, j)
            tl.debug_barrier()  # every thread has read out before it is overwritten
            tl.store(out_ptr + idx, new, mask=inside)
            if HASH:  # into source row's slot b % HASH_SLOTS, as the encoder's: after the store, which need not wait.
                # The row's offset in int32 and added on its own: with the int64 row (live since the payload's address)
                # ptxas moves the program's scalars off its uniform datapath onto the vector pipes, and spills one
                # (tests/test_register_caps.py)
                _add_once(hashes_ptr + (src - src_base) * _HASH_SLOTS + (b.to(tl.int32) & (_HASH_SLOTS - 1)),
                          block_hash, r, r == 0)

    @triton.jit
    def _take_hash_sums_kernel(slots_ptr, out_ptr):
        # program k: row k of the decode kernel's hash slots, summed into out[k] and zeroed for the next decode
        at = slots_ptr + tl.program_id(0) * _HASH_SLOTS + tl.arange(0, _HASH_SLOTS)
        tl.store(out_ptr + tl.program_id(0), tl.sum(tl.load(at), axis=0))
        tl.store(at, tl.zeros([_HASH_SLOTS], dtype=tl.int64))

    @triton.jit(do_not_specialize=["rank", "capacity"])
    def _check_hash_sums_kernel(sums_ptr, slots_ptr, sent_ptr, sent_stride, sizes_ptr, sizes_stride, capacity, rank,
                                mismatched_ptr, count_ptr, rows: tl.constexpr, ROWS: tl.constexpr,
                                SLOTS: tl.constexpr, SIZES: tl.constexpr):
        # one program, ROWS of the ``rows`` sources at a time (a compile per group size): ``check_hash_sums``
        count = tl.zeros([ROWS], dtype=tl.int64)
        for first in range(0, rows, ROWS):
            k = first + tl.arange(0, ROWS)
            live = k < rows
            if SLOTS:
                at = slots_ptr + k[:, None] * _HASH_SLOTS + tl.arange(0, _HASH_SLOTS)[None, :]
                sums = tl.sum(tl.load(at, mask=live[:, None], other=0), axis=1)
                tl.store(sums_ptr + k, sums, mask=live)
                tl.store(at, tl.zeros([ROWS, _HASH_SLOTS], dtype=tl.int64), mask=live[:, None])
            else:
                sums = tl.load(sums_ptr + k, mask=live, other=0)
            bad = live & (k != rank) & (sums != tl.load(sent_ptr + k * sent_stride, mask=live, other=0))
            if SIZES:  # only the payloads that fit their slots were decoded
                bad &= tl.load(sizes_ptr + k * sizes_stride, mask=live, other=0) <= capacity
            tl.store(mismatched_ptr + k, bad.to(tl.int8), mask=live)
            count += bad.to(tl.int64)
        tl.store(count_ptr, tl.sum(count, axis=0))


def check_hash_sums_reference(sums, sent, rank: int, slots=None, sizes=None, capacity: int = 0) -> tuple:
    """The integrity comparison after a gather's decodes (``check_hash_sums``) in PyTorch."""
    if slots is not None:
        sums.copy_(slots.sum(1))
        slots.zero_()
    mismatched = sums != sent
    if sizes is not None:
        mismatched &= sizes <= capacity
    mismatched.narrow(0, rank, 1).fill_(False)
    return mismatched, mismatched.sum().reshape(1)


def check_hash_sums(sums, sent, rank: int, slots=None, sizes=None, capacity: int = 0) -> tuple:
    """Triton, after a gather's decodes, in one launch: the sources (bool [rows]) whose decoded integrity hash
    (``sums``, int64 [rows]) differs from the one they ``sent`` (int64 [rows], any stride), but for ``rank``, whose
    own slice was not decoded, and with ``sizes`` (int64 [rows], any stride) but for those larger than ``capacity``
    (not decoded: a sync-free gather's slots), and their count (int64 [1]). ``slots`` (the decode kernel's partial
    sums, ``decode_blocks``'s ``hashes``): summed into ``sums`` first, and zeroed for the next decode. No host sync."""
    rows = sums.numel()
    if sums.dtype != torch.int64 or not sums.is_contiguous() or sent.dtype != torch.int64 or sent.shape != sums.shape:
        raise ValueError(f"check_hash_sums: sums (contiguous) and sent must be int64 [{rows}], got {sums.dtype} "
                         f"{tuple(sums.shape)} and {sent.dtype} {tuple(sent.shape)}")
    if sizes is not None and (sizes.dtype != torch.int64 or sizes.shape != sums.shape):
        raise ValueError(f"check_hash_sums: sizes must be int64 [{rows}], got {sizes.dtype} {tuple(sizes.shape)}")
    if slots is not None:
        _check_hash_slots("check_hash_sums", slots, rows)
    mismatched = torch.empty(rows, dtype=torch.bool, device=sums.device)
    count = torch.empty(1, dtype=torch.int64, device=sums.device)
    _check_hash_sums_kernel[(1,)](sums, sums if slots is None else slots, sent, sent.stride(0),
                                  sent if sizes is None else sizes, 0 if sizes is None else sizes.stride(0), capacity,
                                  rank, mismatched.view(torch.int8), count, rows=rows, ROWS=16, SLOTS=slots is not None,
                                  SIZES=sizes is not None, num_warps=4)
    return mismatched, count


def take_hash_sums(hashes: torch.Tensor, out: torch.Tensor) -> None:
    """Triton, after ``decode_blocks``: each row's hash (the sum of its ``hashes`` slots) into ``out`` (int64 [rows],
    contiguous), and ``hashes`` zeroed for the next decode: one launch where a ``sum`` and a ``zero_`` were two."""
    if out.dtype != torch.int64 or not out.is_contiguous() or out.numel() != hashes.shape[0]:
        raise ValueError(f"take_hash_sums: out must be contiguous int64 [{hashes.shape[0]}], got {out.dtype} "
                         f"{tuple(out.shape)}")
    _check_hash_slots("take_hash_sums", hashes, hashes.shape[0])
    _take_hash_sums_kernel[(hashes.shape[0],)](hashes, out, num_warps=1)


def _check_hash_slots(name: str, hashes: torch.Tensor, rows: int) -> None:
    if hashes.dtype != torch.int64 or not hashes.is_contiguous() or tuple(hashes.shape) != (rows, HASH_SLOTS):
        raise ValueError(f"{name}: hashes must be contiguous int64 [{rows}, {HASH_SLOTS}] (HASH_SLOTS), "
                         f"got {hashes.dtype} {tuple(hashes.shape)}")


# Register caps (PTX .maxnreg) of the block kernels by rows of 8 values per thread, None: the compiler's choice.
# A one-warp program runs at most 32 per SM, at most 65536 / (32 * registers) with more than 64 registers: at a row
# per thread no cap above 64 pays for the programs it costs. 56 rather than 64: under 64 the hashed encoder (the
# integrity check, on by default) loses ptxas's uniform datapath for the block-wide scalars of its width choice, which
# then load the vector pipes that bound the kernel (Nsight Compute: math-pipe throttle) and spill; under 56 it keeps
# it. Hash cost on an H100 at B = 256, plain shard: 1.028-1.031x the unhashed codec device time at 56 / 56,
# 1.069-1.070x at 64 / 64; the plain encoder as fast under either, the plain decoder 1-3 us (<1%) slower under 56
# (results/kernels/delta_integrity*.json). At two rows per thread (B = 512 and 1024) 80 was as fast as 64 or faster
# than 64 and the compiler's choice (B = 512: 96-128 registers), the encoder's spills all on its per-value path.
# Applied up to CAPPED_MAX_BLOCK values per block: larger blocks spill heavily under them (benchmarks/sass_count.py,
# tests/test_register_caps.py).
MAX_REGISTERS = {("encode", 1): 56, ("decode", 1): 56, ("encode", 2): 80, ("decode", 2): 80}
CAPPED_MAX_BLOCK = 1024


def _rows_per_thread(block_size: int) -> int:
    return max(1, block_size // (256 * _num_warps(block_size)))


def _max_registers(kernel: str, block_size: int):
    return MAX_REGISTERS[kernel, min(2, _rows_per_thread(block_size))] if block_size <= CAPPED_MAX_BLOCK else None


def _launch_shape(kernel: str, block_size: int) -> dict:
    """The block-size constexprs of the encode or decode kernel. The encoder's scans carry changed values and
    escapes (up to B: FIELD bits each) and non-empty rows (up to B / 8) as fields of one integer: an int32 up to
    B = 1024, an int64 above (WIDE_SCAN)."""
    if kernel == "encode":
        field, tile = block_size.bit_length(), _tile_blocks(block_size)
        # a span's sums (_tile_fields): its record bytes and changed values, each below 2**TILE_FIELD
        assert SPAN_TILES * tile * max(record_max_nbytes(block_size), block_size) < 2**TILE_FIELD, block_size
        return dict(BLOCK=block_size, RECORD_WORDS=_record_words(block_size), TILE=tile, FIELD=field,
                    WIDE_SCAN=2 * field + (block_size // 8).bit_length() > 31, FLAG_BYTES=flag_bytes(block_size),
                    FLAG_WORDS=max(1, block_size // 256))
    return dict(BLOCK=block_size, GROUP=group_blocks(block_size), FLAG_BYTES=flag_bytes(block_size))


def _num_warps(block_size: int) -> int:
    """Warps per block program: two rows of 8 values per thread from B = 512 (B = 512-2048: 1.10-1.17x the encode
    and 1.07-1.35x the decode device throughput of a row per thread on an H200), one
    below (B >= 32 * num_warps: no value held by two threads)."""
    return max(1, min(8, block_size // 512))


def _tile_blocks(block_size: int) -> int:
    """Blocks per program of the gather kernel (any B: its passes copy CHUNK words of each record; 10^4 blocks
    still make 313 programs), and per sum of the encoder's tile sums (a power of two)."""
    return 32


def _gather_launch(block_size: int) -> tuple:
    """(CHUNK, num_warps) of the gather kernel: record words copied per block and pass, 4 per thread of 4 warps. At
    B = 256 the gather took 34 / 24 us (lr 1e-4 / 1e-5) against 43 / 40 with 32 words and 83 / 79 with 64, whose
    passes mask off more lanes past each record's end, and 8 words or 64 blocks per program took 34-36 / 20-25 us; at
    B = 512 31 / 16 us against 31 / 24 with 16 blocks of 32 words (H200)."""
    return 16, 4


def _record_words(block_size: int) -> int:
    """32-bit words of a block's record row: its longest record (``record_max_nbytes``) rounded up to whole rows of
    8 words (zeroed by row)."""
    return -(-record_max_nbytes(block_size) // 32) * 8


@dataclass
class EncodedBlocks:
    """Per-block results of ``encode_blocks``; ``records`` row b: the block's record as the payload holds it (its
    bitmap, then its value stream; ``nbytes`` live bytes, then junk). Per tile of ``_tile_blocks(B)`` blocks the
    encoder's sums, per span of SPAN_TILES tiles ``scan_tiles``'s starts; ``totals``: ``scan_tiles``'s."""

    codes: torch.Tensor  # uint8 [n_blocks]
    counts: torch.Tensor  # int32 [n_blocks]
    n_esc: torch.Tensor  # int32 [n_blocks]
    exc_widths: torch.Tensor  # uint8 [n_blocks]
    nbytes: torch.Tensor  # int64 [n_blocks]: record bytes (bitmap and value stream)
    tile_sums: torch.Tensor  # int64 [n_tiles]: record bytes, changed values and changed blocks (_tile_fields)
    span_starts: torch.Tensor  # int64 [n_spans]: changed blocks (high 32 bits) and record bytes before the span
    totals: torch.Tensor  # int64 [5]: changed blocks, changed values, record bytes, payload size, delta size
    records: torch.Tensor  # int32 [n_blocks, 8 * ceil(18 B / 256)]
    # with the integrity hash (None without): the blocks' hashes summed into HASH_SLOTS slots (after ``tile_sums`` in
    # one tensor, zeroed together), and ``scan_tiles``'s sum of them, the shard's hash
    hash_slots: torch.Tensor = None  # int64 [HASH_SLOTS]
    hash: torch.Tensor = None  # int64 [1]


def empty_blocks(numel: int, block_size: int, device, reuse: EncodedBlocks = None, hash: bool = False) -> EncodedBlocks:
    """Uninitialized ``encode_blocks`` outputs for a shard of ``numel`` values: the per-block fields of
    ``reuse`` if it has this shape (no allocations), the records (1.13x the shard at B=256) always new. ``hash``:
    with the integrity hash's fields."""
    n_blocks, n_tiles = -(-numel // block_size), -(-numel // (block_size * _tile_blocks(block_size)))
    records = torch.empty(n_blocks, _record_words(block_size), dtype=torch.int32, device=device)
    if (reuse is not None and reuse.codes.numel() == n_blocks and reuse.tile_sums.numel() == n_tiles
            and reuse.codes.device == records.device and (reuse.hash is not None) == hash):
        return replace(reuse, records=records)
    def per_block(dtype):
        return torch.empty(n_blocks, dtype=dtype, device=device)

    tiles = torch.empty(n_tiles + HASH_SLOTS * hash, dtype=torch.int64, device=device)
    totals = torch.empty(5 + hash, dtype=torch.int64, device=device)
    return EncodedBlocks(codes=per_block(torch.uint8), counts=per_block(torch.int32), n_esc=per_block(torch.int32),
                         exc_widths=per_block(torch.uint8), nbytes=per_block(torch.int64), tile_sums=tiles[:n_tiles],
                         span_starts=torch.empty(-(-n_tiles // SPAN_TILES), dtype=torch.int64, device=device),
                         totals=totals[:5], records=records, hash_slots=tiles[n_tiles:] if hash else None,
                         hash=totals[5:] if hash else None)


def _table_args(data: torch.Tensor, table) -> tuple:
    """The kernels' block-table arguments: ``table`` is ``Segments.block_table`` (base, start, stride, valid,
    aligned) with ``data`` its base as int16, or None for a plain shard (``data`` itself; the pointers unused)."""
    if table is None:
        return (data, data, data), dict(SEGMENTED=False, ALIGNED=False)
    _, start, stride, valid, aligned = table
    return (start, stride, valid), dict(SEGMENTED=True, ALIGNED=aligned)


def encode_blocks(prev: torch.Tensor, new: torch.Tensor, block_size: int, out: EncodedBlocks = None,
                  table=None, rank: int = 0, cast_to: torch.dtype = None, source_table=None) -> EncodedBlocks:
    """Triton: code every block of ``new`` (int16) against ``prev``, which is overwritten with ``new``; into
    ``out`` (from ``empty_blocks`` for this shape) if given. Segmented (``table``: ``Segments.block_table``):
    ``new`` is the table's base (int16) and rank ``rank``'s slices are coded, ``prev`` holds them padded.
    ``cast_to`` (bf16 or fp16): ``new`` is fp32 and rounded to that dtype in the kernel, so that ``prev`` (e.g. the
    parameter buffer's shard) ends holding exactly what ``prev.copy_(new)`` of that dtype would write. With ``table``,
    ``cast_to`` and ``source_table`` (``Segments.source_table`` of the segments' fp32 sources): ``new`` is the sources'
    base, ``prev`` the table's base (int16: the buffers, coded against and cast into). ``scan_tiles`` comes next."""
    e = out if out is not None else empty_blocks(prev.numel(), block_size, prev.device)
    n_blocks = e.records.shape[0]
    pointers, flags = _table_args(prev if source_table is not None else new, table)
    src_start = new
    if source_table is not None:
        if table is None or cast_to is None:
            raise ValueError("encode_blocks: a source_table needs a block table and cast_to")
        src_start, flags["ALIGNED"] = source_table[1], flags["ALIGNED"] and source_table[2]
    if n_blocks:
        hashed = e.hash_slots is not None
        # hash_slots follow tile_sums in one tensor (empty_blocks): one launch zeroes both
        e.tile_sums.as_strided((e.tile_sums.numel() + (e.hash_slots.numel() if hashed else 0),), (1,)).zero_()
        _encode_kernel[(n_blocks,)](prev, new, prev.numel(), *pointers, rank, e.codes, e.counts, e.n_esc,
                                    e.exc_widths, e.nbytes, e.records, e.tile_sums,
                                    e.hash_slots if hashed else e.tile_sums, HASH=hashed,
                                    **_launch_shape("encode", block_size),
                                    num_warps=_num_warps(block_size),
                                    maxnreg=_max_registers("encode", block_size), CAST=cast_to is not None,
                                    FP16=cast_to == torch.float16, src_start_ptr=src_start,
                                    SOURCE_TABLE=source_table is not None, **flags)
    return e


def scan_tiles(e: EncodedBlocks, headers: torch.Tensor, regions_at: int, raw_nbytes: int, flags: int, raw_flag: int,
               max_chunk: int = 512) -> None:
    """Triton, after ``encode_blocks``: ``e.span_starts`` and ``e.totals`` from the encoder's tile sums (one program,
    ``max_chunk`` spans per pass; ``regions_at``: where the groups' regions start, so that the delta's size is
    ``regions_at + 3 * changed blocks + record bytes``; the payload's is ``raw_nbytes`` where that is smaller); into
    ``headers`` (uint8 [2, 32] on the device: the payload's header, then the delta's) their flags (``flags``, plus
    ``raw_flag`` for a raw payload), n_changed and nbytes; the shard's integrity hash (of its change, whichever the
    payload) into ``e.hash`` if it has one."""
    chunk = min(max_chunk, max(16, triton.next_power_of_2(e.span_starts.numel())))
    hashed = e.hash is not None
    _scan_tiles_kernel[(1,)](e.tile_sums, e.tile_sums.numel(), e.span_starts, e.totals, headers, regions_at,
                             raw_nbytes, flags, raw_flag, e.hash_slots if hashed else e.tile_sums,
                             e.hash if hashed else e.totals, SPAN=SPAN_TILES, CHUNK=chunk,
                             HEADER_BYTES=headers.numel() // 2, HASH=hashed,
                             num_warps=8)


def gather_records(e: EncodedBlocks, payload, header, groups_at: int, regions_at: int, block_size: int,
                   capacity: int = None) -> None:
    """Triton: write ``header`` (32 bytes), the pad bytes, the codes, the group entries from ``groups_at``, and each
    group's region from ``regions_at`` (its changed blocks' record offsets, exc_widths and records: bitmap, stream)
    into ``payload`` (uint8), after ``scan_tiles``. ``header``: bytes, or (with ``capacity``) the uint8 device header
    ``scan_tiles`` completed (the delta's); with ``capacity``, a delta (``e.totals[4]`` bytes) larger than it writes
    nothing."""
    n_blocks = e.codes.numel()
    slot = capacity is not None
    if slot != torch.is_tensor(header):
        raise ValueError("gather_records takes a device header with a capacity, host bytes without one")
    if not n_blocks:  # an empty shard: the payload is the header
        if slot:
            raise ValueError("gather_records: an empty shard has no slot path (its payload is its header)")
        payload.copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        return
    tile, (chunk, warps), group = _tile_blocks(block_size), _gather_launch(block_size), group_blocks(block_size)
    if tile % group:
        raise ValueError(f"gather_records: a tile of {tile} blocks must hold whole groups of {group}")
    host_header = (0, 0, 0, 0) if slot else struct.unpack("<4q", header)
    _gather_kernel[(triton.cdiv(n_blocks, tile),)](
        e.records, e.codes, e.exc_widths, e.nbytes, e.tile_sums, e.span_starts, n_blocks, payload,
        payload.data_ptr() % 4, *host_header, groups_at, regions_at, header if slot else payload, e.totals,
        capacity if slot else 0, GROUP=group, HEADER_BYTES=header.numel() if slot else len(header),
        RECORD_WORDS=e.records.shape[1], TILE=tile, SPAN=SPAN_TILES, CHUNK=chunk, SLOT=slot, num_warps=warps)


@dataclass
class Payloads:
    """Delta payloads for the decode kernel: ``rows`` of them, row k at ``base[k * stride:]`` (uint8; one payload, or
    every rank's in a gather's receive buffer), each of ``n_blocks`` blocks. Their sections, from compression/delta.py's
    wire format: the codes at byte ``codes_at``, the group entries from ``groups_at`` and the groups' regions from
    ``regions_at`` (both depend only on the shard's size).
    The last row needs ``read_slack_bytes(B)`` readable bytes after its payload."""

    base: torch.Tensor
    rows: int
    stride: int
    n_blocks: int
    codes_at: int
    groups_at: int
    regions_at: int


def decode_blocks(out, payloads: Payloads, block_size: int, table=None, src_base: int = 0,
                  skip_rank: int = -1, slots: tuple = None, hashes: torch.Tensor = None) -> None:
    """Triton: apply the deltas of payload rows to ``out`` (int16 view of the previous values): row k is source rank
    ``src_base + k``, and every row but ``skip_rank``'s (-1: none) is decoded, all in one launch. Plain (``table``
    None): ``out`` is the source's shard (one row); segmented, as in ``encode_blocks``: ``out`` is the table's base
    and each source's slices are decoded. ``slots``: (sizes, capacity), the rows are slots of ``capacity`` bytes and
    row k's payload size is ``sizes[k]`` (int64, a strided view): rows whose payload is larger are not decoded.
    ``hashes``: int64 [rows, HASH_SLOTS], zeroed: each row's integrity hash of the change it applies, in
    partial sums (``take_hash_sums``: the rows' hashes)."""
    pointers, flags = _table_args(out, table)
    p = payloads
    sources = p.rows - (0 <= skip_rank - src_base < p.rows)
    sizes, capacity = slots if slots is not None else (p.base, 0)
    if slots is not None and (sizes.dtype != torch.int64 or sizes.numel() != p.rows):
        raise ValueError(f"decode_blocks: slots need an int64 size per row ({p.rows}), got {sizes.dtype} "
                         f"[{sizes.numel()}]")
    if hashes is not None:
        _check_hash_slots("decode_blocks", hashes, p.rows)
    if p.n_blocks and sources:
        misalign = p.base.data_ptr() % 4
        _decode_kernel[(p.n_blocks, sources)](out, out.numel(), *pointers, p.base, p.stride, misalign,
                                              p.codes_at, p.groups_at, p.regions_at, src_base, skip_rank,
                                              p.n_blocks, sizes, sizes.stride(0) if slots is not None else 0,
                                              capacity, hashes if hashes is not None else sizes,
                                              **_launch_shape("decode", block_size), HASH=hashes is not None,
                                              WORDS=misalign == 0 and p.stride % 4 == 0,
                                              num_warps=_num_warps(block_size),
                                              maxnreg=_max_registers("decode", block_size), SLOT=slots is not None,
                                              **flags)
