"""CIERA bit-field kernels: split 16-bit floats into exponent and sign+mantissa, detect which blocks'
exponents changed, write the changed blocks' exponents into a payload, and merge them back.

Bit layouts (a value's bits read as an unsigned 16-bit word):
  bf16: sign 15 | exponent 14..7 (8 bits) | mantissa 6..0 (7 bits)  -> sign+mantissa fits one byte
  fp16: sign 15 | exponent 14..10 (5 bits) | mantissa 9..0 (10 bits) -> sign+mantissa needs 11 bits
sign+mantissa is ``sign << mant_bits | mantissa``. Splitting and merging only move bits, so every
value (NaN payloads, +-Inf, -0.0, subnormals) survives exactly.

Where a payload puts the changed blocks' exponents: blocks are grouped in tiles of ``tile_blocks``
blocks, and each tile's changed blocks take consecutive slots (in block order) from its tile's first
slot, which the payload's tile table holds. The slots of different tiles may come in any order: the
encoding kernel takes each tile's first slot with one atomic add, so no pass over the blocks has to
wait for the counts of the blocks before it (a prefix sum, then a gather of the exponents into their
slots, cost the encode a second pass over the changed exponents: docs/ciera.md).

The plain-PyTorch ``*_reference`` functions are the CPU path and the test oracle (compression/ciera.py
assembles its payload from them; they give the tiles their slots in order). For bf16 on CUDA the codec
instead runs fused Triton kernels that read and write the payload sections in place (see
compression/ciera.py for the layout):
  encode: ``split_blocks`` (sign+mantissa into the payload, exponents compared with the sender state,
          changed exponents into their slots and into the state, each tile's first slot, a changed flag
          per block and the changed-block count), ``finish_split`` (the flags as the payload's bitmap, the
          header and the payload size from the count);
  decode: ``merge_payload`` (one kernel: bitmap and tile table -> slots, merge into the output).
A program handles one tile, a [tile_blocks, block_size] block of about ``TILE_VALUES`` values, more than
the ``NUM_WARPS`` warps' threads, so every value belongs to exactly one thread. The split reads the values
in pairs (32-bit words: two values' bytes formed at once, half the integer work of one by one), so the fused
path takes 4-byte aligned shards (``use_triton``).
"""

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path is used
    triton = None


@dataclass(frozen=True)
class FloatLayout:
    exp_bits: int
    mant_bits: int

    @property
    def sm_bits(self) -> int:
        return 1 + self.mant_bits

    @property
    def sm_dtype(self) -> torch.dtype:
        return torch.uint8 if self.sm_bits <= 8 else torch.int16


LAYOUTS = {torch.bfloat16: FloatLayout(8, 7), torch.float16: FloatLayout(5, 10)}
MAX_TRITON_BLOCK = 8192
TILE_VALUES = 4096  # values per program (several blocks); >= 32 * NUM_WARPS
NUM_WARPS = 8
PACK_TILE = 1024  # bitmap bytes per program of the bitmap packing kernel


def _words(bits: torch.Tensor) -> torch.Tensor:
    """int16 bit patterns as non-negative int32 words."""
    return bits.to(torch.int32) & 0xFFFF


def split_compare_reference(bits, prev_exp, block_size: int, layout: FloatLayout):
    """Split ``bits`` (int16, n values) into exponents and sign+mantissa, both zero-padded to whole
    blocks, and flag the blocks whose exponents differ from ``prev_exp`` (None: no comparison).
    Returns (exp uint8 [npad], sm [npad] of layout.sm_dtype, changed bool [nblocks] or None)."""
    n = bits.numel()
    npad = -(-n // block_size) * block_size
    w = torch.zeros(npad, dtype=torch.int32, device=bits.device)
    w[:n] = _words(bits)
    m = layout.mant_bits
    exp = ((w >> m) & ((1 << layout.exp_bits) - 1)).to(torch.uint8)
    sm = (((w >> 15) << m) | (w & ((1 << m) - 1))).to(layout.sm_dtype)
    changed = None
    if prev_exp is not None:
        changed = (exp != prev_exp).view(-1, block_size).any(dim=1)
    return exp, sm, changed


# 128-bit block hash: two SplitMix64-style hashes with independent seeds (int64 arithmetic wraps).

def _i64(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


GAMMA = _i64(0x9E3779B97F4A7C15)
MIX1, MIX2 = _i64(0xBF58476D1CE4E5B9), _i64(0x94D049BB133111EB)
HASH_SEEDS = (_i64(0x243F6A8885A308D3), _i64(0x13198A2E03707344))


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch shifts int64 arithmetically)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64 finaliser."""
    z = (z ^ _shr(z, 30)) * MIX1
    z = (z ^ _shr(z, 27)) * MIX2
    return z ^ _shr(z, 31)


def block_hashes(exp: torch.Tensor, block_size: int) -> torch.Tensor:
    """int64 [nblocks, 2]: for each seed, mix64(seed ^ sum_j mix64(word_j ^ (seed + (j+1)*GAMMA))) over
    the block's exponent bytes read as 64-bit words (position-keyed, so moved bytes change the hash)."""
    words = exp.view(torch.int64).view(-1, block_size // 8)
    pos = torch.arange(1, block_size // 8 + 1, device=exp.device, dtype=torch.int64) * GAMMA
    out = [mix64(mix64(words ^ (pos + seed)).sum(1) ^ seed) for seed in HASH_SEEDS]
    return torch.stack(out, dim=1)


def tile_blocks(block_size: int) -> int:
    """Blocks per tile of the payloads this process encodes (one program of the fused kernels each)."""
    return max(1, TILE_VALUES // block_size)


def tile_slots_reference(changed, tile_blocks: int) -> torch.Tensor:
    """int32 [ntiles]: each tile's first slot when the tiles take their slots in order (the exclusive
    prefix sum of their changed-block counts)."""
    per_tile = torch.nn.functional.pad(changed.to(torch.int64), (0, -changed.numel() % tile_blocks))
    per_tile = per_tile.view(-1, tile_blocks).sum(1)
    return (torch.cumsum(per_tile, 0) - per_tile).to(torch.int32)


def block_slots_reference(changed, tile_slots, tile_blocks: int, n_changed: int) -> torch.Tensor:
    """int64 [nblocks]: each block's slot among the payload's ``n_changed`` changed blocks (meaningful where
    ``changed``): its tile's first slot plus the changed blocks before it in its tile; the shard's last block's is
    the last slot (its tile's run leaves it out)."""
    nblocks = changed.numel()
    flags = torch.nn.functional.pad(changed.to(torch.int64), (0, -nblocks % tile_blocks)).view(-1, tile_blocks)
    before = torch.cumsum(flags, 1) - flags
    slots = (tile_slots.to(torch.int64)[:, None] + before).view(-1)[:nblocks]
    if nblocks:
        slots[-1] = n_changed - 1
    return slots


def merge_blocks_reference(out_bits, changed, slots, new_exp, sm, block_size: int, layout: FloatLayout):
    """New bit patterns for ``out_bits`` (int16, n values holding the previous values): exponents of
    changed blocks come from ``new_exp`` (uint8, whole blocks, the last one padded), block b's from its
    slot ``slots[b]`` there; the others from ``out_bits`` itself; sign+mantissa from ``sm`` (n values).
    Returns int16 [n]."""
    n = out_bits.numel()
    m = layout.mant_bits
    exp = torch.zeros(changed.numel() * block_size, dtype=torch.int32, device=out_bits.device)
    exp[:n] = (_words(out_bits) >> m) & ((1 << layout.exp_bits) - 1)
    exp = exp.view(-1, block_size)
    sent = slots[changed]
    if sent.numel() and (int(sent.min()) < 0 or int(sent.max()) * block_size >= new_exp.numel()):
        raise RuntimeError(f"CIERA payload's tile table points past its {new_exp.numel() // block_size} "
                           "blocks of exponents")
    exp[changed] = new_exp.view(-1, block_size)[sent].to(torch.int32)
    s = sm[:n].to(torch.int32) & 0xFFFF
    w = ((s >> m) << 15) | (exp.view(-1)[:n] << m) | (s & ((1 << m) - 1))
    return w.to(torch.int16)


if triton is not None:

    @triton.jit
    def _split_tile(bits_ptr, sm_ptr, rows, n, B: tl.constexpr):
        """Blocks ``rows`` of the bf16 bits (4-byte aligned), two values per 32-bit word: sign+mantissa bytes
        stored to ``sm_ptr``; returns the offsets of the tile's pairs of values [rows, B / 2] (in 32-bit words
        of the values, 16-bit words of a byte section) and the exponent bytes of each pair as one 16-bit word
        (int32: the pair's first exponent in the low byte). Pairs halve the integer work per value. Loads and
        stores are bounded by whole pairs (``n // 2``, whose divisibility by 16 the compiler sees, so that they
        stay 16-byte vectors); an odd shard's last value is loaded and stored alone."""
        pairs = rows.to(tl.int64)[:, None] * (B // 2) + tl.arange(0, B // 2)[None, :]
        x = tl.load(bits_ptr.to(tl.pointer_type(tl.int32)) + pairs, mask=pairs < n // 2, other=0)
        if tl.program_id(0) == tl.num_programs(0) - 1:
            if n % 2 == 1:
                last = tl.load(bits_ptr + n - 1).to(tl.int32) & 0xFFFF
                tl.store(sm_ptr + n - 1, (((last >> 8) & 0x80) | (last & 0x7F)).to(tl.uint8))
                x = tl.where(pairs == n // 2, last, x)
        sm = ((x >> 8) & 0x00800080) | (x & 0x007F007F)  # sign+mantissa of each value in the low byte of its half
        exp = (x >> 7) & 0x00FF00FF
        tl.store(sm_ptr.to(tl.pointer_type(tl.int16)) + pairs, (sm | (sm >> 8)).to(tl.int16), mask=pairs < n // 2)
        return pairs, (exp | (exp >> 8)) & 0xFFFF

    _GAMMA, _MIX1, _MIX2 = tl.constexpr(GAMMA), tl.constexpr(MIX1), tl.constexpr(MIX2)
    _SEED0, _SEED1 = tl.constexpr(HASH_SEEDS[0]), tl.constexpr(HASH_SEEDS[1])

    @triton.jit
    def _shr64(z, k: tl.constexpr):
        return (z.to(tl.uint64, bitcast=True) >> k).to(tl.int64, bitcast=True)

    @triton.jit
    def _mix64(z):
        z = (z ^ _shr64(z, 30)) * _MIX1
        z = (z ^ _shr64(z, 27)) * _MIX2
        return z ^ _shr64(z, 31)

    @triton.jit
    def _block_hash(words, pos, seed):
        """block_hashes for one seed: words [BPP, B / 8] int64, pos [B / 8] = (j + 1) * GAMMA."""
        return _mix64(tl.sum(_mix64(words ^ (pos + seed)[None, :]), axis=1) ^ seed)

    @triton.jit
    def _hash_blocks(hashes_ptr, rows, nblocks, exp, B: tl.constexpr, BPP: tl.constexpr, COMPARE: tl.constexpr):
        """block_hashes of the tile's exponents (int32 [BPP, B / 2], a pair of exponent bytes each) into
        hashes_ptr [nblocks, 2] (the bytes of 8 consecutive exponents make a little-endian word: a sum of
        disjoint 16-bit pairs); if COMPARE, over the previous hashes there, returning 1 where a block's hash
        changed (else 1 everywhere)."""
        pairs4 = tl.reshape(exp, (BPP, B // 8, 4)).to(tl.int64)
        words = tl.sum(pairs4 << (16 * tl.arange(0, 4)).to(tl.int64)[None, None, :], axis=2)
        pos = (tl.arange(0, B // 8) + 1).to(tl.int64) * _GAMMA
        ok = rows < nblocks
        h0, h1 = _block_hash(words, pos, _SEED0), _block_hash(words, pos, _SEED1)
        changed = tl.full([BPP], 1, tl.int32)
        if COMPARE:  # each row's two words are loaded and stored by the same threads
            p0 = tl.load(hashes_ptr + 2 * rows, mask=ok, other=0)
            p1 = tl.load(hashes_ptr + 2 * rows + 1, mask=ok, other=0)
            changed = ((h0 != p0) | (h1 != p1)).to(tl.int32)
        tl.store(hashes_ptr + 2 * rows, h0, mask=ok)
        tl.store(hashes_ptr + 2 * rows + 1, h1, mask=ok)
        return changed

    @triton.jit
    def _split_blocks_kernel(bits_ptr, exp_ptr, sm_ptr, flags_ptr, hashes_ptr, slots_ptr, exp_out_ptr, count_ptr,
                             n, nblocks, B: tl.constexpr, BPP: tl.constexpr, COMPARE: tl.constexpr,
                             HASH: tl.constexpr, SAMPLE: tl.constexpr, COMPACT: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BPP + tl.arange(0, BPP)
        offs, exp = _split_tile(bits_ptr, sm_ptr, rows, n, B)  # offs: of 16-bit words (exponent pairs)
        store = (rows < nblocks)[:, None]
        exp_ptr = exp_ptr.to(tl.pointer_type(tl.int16))
        pairs = exp.to(tl.int16)
        if HASH:
            changed = _hash_blocks(hashes_ptr, rows, nblocks, exp, B, BPP, COMPARE)
            if SAMPLE > 1:  # every block's hash is kept, but only every SAMPLE-th is counted
                changed = tl.where((rows % SAMPLE) == 0, changed, 0)
            if not COMPACT:  # a dense encode: every block's exponents, in place of the payload's section
                tl.store(exp_ptr + offs, pairs, mask=store)
        elif COMPARE and SAMPLE > 1:
            # Only every SAMPLE-th block is compared (the others' flags are 0); the others are stored at
            # once, and only tiles holding a compared block wait for its comparison.
            sampled = (rows % SAMPLE) == 0
            tl.store(exp_ptr + offs, pairs, mask=store & ~sampled[:, None])
            changed = tl.zeros([BPP], tl.int32)
            first_row = pid * BPP
            if (first_row + SAMPLE - 1) // SAMPLE * SAMPLE < first_row + BPP:
                prev = tl.load(exp_ptr + offs, mask=store & sampled[:, None], other=0).to(tl.int32) & 0xFFFF
                changed = tl.max(((exp != prev) & sampled[:, None]).to(tl.int32), axis=1)
                tl.store(exp_ptr + offs, pairs, mask=store & (sampled & (changed != 0))[:, None])
        elif COMPARE:
            prev = tl.load(exp_ptr + offs, mask=store, other=0).to(tl.int32) & 0xFFFF
            changed = tl.max((exp != prev).to(tl.int32), axis=1)
            # Only changed blocks are rewritten (the others' exponents are already stored): the store
            # then depends on its whole block's loads, so no barrier is needed, and it is 1.7x faster
            # than storing every block after a barrier (H200).
            tl.store(exp_ptr + offs, pairs, mask=store & (changed[:, None] != 0))
        else:
            changed = tl.full([BPP], 1, tl.int32)
            tl.store(exp_ptr + offs, pairs, mask=store)
        changed = tl.where(rows < nblocks, changed, 0)
        tl.store(flags_ptr + rows, changed, mask=rows < nblocks)
        # One atomic per tile counts the changed blocks and, on a compact encode, gives the tile its slots:
        # the tiles' slot ranges come in the order their programs got there (the payload's tile table says
        # where each one starts), so no program waits for another. A compact encode leaves the shard's last block
        # out (it takes the last slot, trimmed to its values: _finish_split_kernel).
        take = changed
        if COMPACT:
            take = tl.where(rows == nblocks - 1, 0, changed)
        first = tl.atomic_add(count_ptr, tl.sum(take, axis=0), sem="relaxed")
        if COMPACT:
            tl.store(slots_ptr + pid, first)
            slot = (first + tl.cumsum(take, axis=0) - take).to(tl.int64)
            slot_pairs = slot[:, None] * (B // 2) + tl.arange(0, B // 2)[None, :]
            exp_out_ptr = exp_out_ptr.to(tl.pointer_type(tl.int16))
            tl.store(exp_out_ptr + slot_pairs, pairs, mask=store & (take[:, None] != 0))

    @triton.jit
    def _finish_split_kernel(flags_ptr, bitmap_ptr, count_ptr, template_ptr, header_ptr, sizes_ptr, nblocks, exp_at,
                             raw_nbytes, raw_flag, last_flag, bits_ptr, exp_out_ptr, n, B: tl.constexpr,
                             TILE: tl.constexpr, LAST_CHUNK: tl.constexpr):
        byte = tl.program_id(0) * TILE + tl.arange(0, TILE)
        rows = byte[:, None] * 8 + tl.arange(0, 8)[None, :]
        bits = tl.load(flags_ptr + rows, mask=rows < nblocks, other=0)
        value = tl.sum(bits << tl.arange(0, 8)[None, :], axis=1)
        tl.store(bitmap_ptr + byte, value.to(tl.uint8), mask=byte * 8 < nblocks)
        if tl.program_id(0) == 0:  # the header and the payload size, from the changed-block count
            others = tl.load(count_ptr).to(tl.int64)  # changed blocks but the last
            last = tl.load(flags_ptr + nblocks - 1).to(tl.int64)
            left = n - (nblocks - 1).to(tl.int64) * B  # the last block's values
            exp_bytes = others * B + last * left
            raw = exp_at + exp_bytes > raw_nbytes  # the raw values are smaller: they are sent instead
            tl.store(sizes_ptr, others + last)
            tl.store(sizes_ptr + 1, tl.where(raw, raw_nbytes, exp_at + exp_bytes))
            tl.store(sizes_ptr + 2, last)
            k = tl.arange(0, 32)
            # int64 at [16:24] and [24:32], little endian: the changed blocks, the exponent section's (or the raw
            # values') bytes
            field = tl.where(k < 24, others + last, tl.where(raw, raw_nbytes - 32, exp_bytes))
            counts = ((field >> (8 * (k % 8))) & 0xFF).to(tl.uint8)
            template = tl.load(template_ptr + k, mask=k < 16, other=0)
            flags = tl.where(raw, raw_flag, tl.where(last != 0, last_flag, 0))  # (a raw payload has no slots)
            template = tl.where(k == 3, template | flags, template)  # the flags byte
            tl.store(header_ptr + k, tl.where(k < 16, template, counts))
            if last != 0:  # the last block's exponents, its values' only, in the last slot
                for at in tl.static_range(0, B, LAST_CHUNK):
                    i = at + tl.arange(0, LAST_CHUNK)
                    x = tl.load(bits_ptr + (nblocks - 1).to(tl.int64) * B + i, mask=i < left, other=0)
                    exp = ((x.to(tl.int32) >> 7) & 0xFF).to(tl.uint8)
                    tl.store(exp_out_ptr + others * B + i, exp, mask=i < left)

    @triton.jit
    def _merge_kernel(out_ptr, bitmap_ptr, slots_ptr, sm_ptr, exp_ptr, n, nblocks, n_changed,
                      B: tl.constexpr, BPP: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BPP + tl.arange(0, BPP)
        row_ok = rows < nblocks
        byte = tl.load(bitmap_ptr + rows // 8, mask=row_ok, other=0).to(tl.int32)
        bit = (byte >> (rows % 8)) & 1
        # The tile's first slot, an int32 read as 4 bytes: a payload in a gather's buffer starts at any byte.
        k = tl.arange(0, 4)
        first = tl.sum(tl.load(slots_ptr + 4 * pid + k).to(tl.int32) << (8 * k), axis=0)
        slot = (first + tl.cumsum(bit, axis=0) - bit).to(tl.int64)
        slot = tl.where(rows == nblocks - 1, n_changed - 1, slot)  # the shard's last block: the last slot
        sent = (bit != 0) & (slot >= 0) & (slot < n_changed)  # a corrupt table reads nothing past the section
        cols = tl.arange(0, B)[None, :]
        offs = rows.to(tl.int64)[:, None] * B + cols
        in_shard = offs < n
        new = tl.load(exp_ptr + slot[:, None] * B + cols, mask=sent[:, None] & in_shard, other=0).to(tl.int32)
        old = tl.load(out_ptr + offs, mask=(bit == 0)[:, None] & in_shard, other=0).to(tl.int32)
        exp = tl.where(bit[:, None] != 0, new, (old >> 7) & 0xFF)
        sm = tl.load(sm_ptr + offs, mask=in_shard, other=0).to(tl.int32)
        w = ((sm & 0x80) << 8) | (exp << 7) | (sm & 0x7F)
        tl.store(out_ptr + offs, w.to(tl.int16), mask=in_shard)


def use_triton(bits: torch.Tensor, block_size: int, layout: FloatLayout) -> bool:
    """Whether the fused kernels serve this (contiguous, non-empty, 4-byte aligned: the split reads pairs of
    values) bf16 tensor on CUDA."""
    return (triton is not None and bits.is_cuda and layout == LAYOUTS[torch.bfloat16]
            and block_size <= MAX_TRITON_BLOCK and bits.numel() > 0 and bits.is_contiguous()
            and bits.data_ptr() % 4 == 0)


def split_blocks(bits, exp, compare: bool, sm_out, block_size: int, hashes=None, sample: int = 1,
                 compact=None) -> tuple:
    """bf16 ``bits`` (int16 [n]): sign+mantissa bytes into ``sm_out[:n]``, exponents into ``exp``
    (uint8 [nblocks * block_size], zero-padded). Without ``hashes``: after comparing them with the previous
    exponents that ``exp`` holds if ``compare`` (``split_compare_reference``), only the changed blocks' are
    rewritten there; ``sample`` > 1 compares only the blocks ``b % sample == 0`` (the others' flags are 0),
    which saves reading the others' previous exponents. With ``hashes`` (int64 [nblocks, 2]):
    ``block_hashes`` of the new exponents go there, after comparing them with the previous ones it holds if
    ``compare`` (with ``sample`` > 1, only the blocks ``b % sample == 0`` are flagged). ``compact`` =
    (exp_out uint8, tile_slots int32 [ntiles]): the changed blocks' exponents also go to their slots in
    ``exp_out`` (tiles of ``tile_blocks``, each tile's first slot into ``tile_slots``), and with ``hashes``
    only there (``exp`` is then unused). Returns (flags int32 [nblocks]: 1 where a block changed, all if not
    ``compare``; count int32 [1]: how many)."""
    nblocks = -(-bits.numel() // block_size)
    flags = torch.empty(nblocks, dtype=torch.int32, device=bits.device)
    count = torch.zeros(1, dtype=torch.int32, device=bits.device)
    exp_out, slots = compact if compact is not None else (flags, flags)  # (unused pointers where not compact)
    tiles = tile_blocks(block_size)
    _split_blocks_kernel[(triton.cdiv(nblocks, tiles),)](
        bits, flags if exp is None else exp, sm_out, flags, flags if hashes is None else hashes, slots, exp_out,
        count, bits.numel(), nblocks, B=block_size, BPP=tiles, COMPARE=compare,
        HASH=hashes is not None, SAMPLE=sample, COMPACT=compact is not None, num_warps=NUM_WARPS)
    return flags, count


def finish_split(flags, count, bitmap_out, template, header_out, sizes, exp_at: int, block_size: int,
                 raw_nbytes: int, raw_flag: int, last_flag: int, bits, exp_out) -> None:
    """After a compact ``split_blocks`` (``count``: the changed blocks but the shard's last): ``flags`` (int32
    [nblocks], 0 or 1) as bits, LSB first, into ``bitmap_out[:ceil(nblocks / 8)]``; the last block's exponents, if it
    changed, into the last slot of ``exp_out`` (its values' only: ``bits`` is the bf16 shard); and the payload's 32
    header bytes into ``header_out`` (``template``'s first 16, ``last_flag`` added to its flags if the last block
    changed, then the changed blocks and the exponent bytes as int64) and ``sizes`` (int64 [3]: the changed blocks,
    the payload's size ``exp_at + exponent bytes``, whether the last block changed). Where that size exceeds
    ``raw_nbytes`` (the 32-byte header and the raw values), the payload is the raw values: the size is
    ``raw_nbytes``, the header's flags get ``raw_flag`` and its last field ``raw_nbytes - 32``."""
    nblocks = flags.numel()
    _finish_split_kernel[(triton.cdiv(triton.cdiv(nblocks, 8), PACK_TILE),)](
        flags, bitmap_out, count, template, header_out, sizes, nblocks, exp_at, raw_nbytes, raw_flag, last_flag, bits,
        exp_out, bits.numel(), B=block_size, TILE=PACK_TILE, LAST_CHUNK=min(block_size, 1024))


def merge_payload(out_bits, bitmap, tile_slots, sm, exps, n_changed: int, block_size: int, tiles: int) -> None:
    """Merge in place of ``out_bits`` (int16 [n], the previous bf16 values): blocks flagged in ``bitmap``
    take their exponents from their slots in ``exps`` (``n_changed`` blocks; ``tile_slots``: the uint8
    bytes of each tile's first slot, int32, tiles of ``tiles`` blocks), the others keep theirs;
    sign+mantissa from ``sm`` (uint8 [n]). Equals ``merge_blocks_reference``."""
    n = out_bits.numel()
    nblocks = -(-n // block_size)
    _merge_kernel[(triton.cdiv(nblocks, tiles),)](
        out_bits, bitmap, tile_slots, sm, exps, n, nblocks, n_changed, B=block_size, BPP=tiles, num_warps=NUM_WARPS)
