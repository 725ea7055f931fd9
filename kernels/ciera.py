"""CIERA bit-field kernels: split 16-bit floats into exponent and sign+mantissa, detect which blocks'
exponents changed, gather the changed blocks' exponents into a payload, and merge them back.

Bit layouts (a value's bits read as an unsigned 16-bit word):
  bf16: sign 15 | exponent 14..7 (8 bits) | mantissa 6..0 (7 bits)  -> sign+mantissa fits one byte
  fp16: sign 15 | exponent 14..10 (5 bits) | mantissa 9..0 (10 bits) -> sign+mantissa needs 11 bits
sign+mantissa is ``sign << mant_bits | mantissa``. Splitting and merging only move bits, so every
value (NaN payloads, +-Inf, -0.0, subnormals) survives exactly.

The plain-PyTorch ``*_reference`` functions are the CPU path and the test oracle (compression/ciera.py
assembles its payload from them). For bf16 on CUDA the codec instead runs three fused Triton kernels
that read and write the payload sections in place (see compression/ciera.py for the layout):
  encode: ``split_blocks`` (sign+mantissa into the payload, exponents into the sender state, a changed
          flag per block), a prefix sum of the flags, ``gather_exponents`` (bitmap bytes, and each
          changed block's exponents into its slot: rank among the changed blocks * block_size);
  decode: ``merge_payload`` (bitmap -> flags, prefix sum, then one merge kernel writing the output).
A program handles a [blocks_per_program, block_size] tile of about ``TILE_VALUES`` values, more than
the ``NUM_WARPS`` warps' threads, so every value belongs to exactly one thread.
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
UNPACK_TILE = 1024  # blocks per program of the bitmap unpacking kernel


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


def merge_blocks_reference(out_bits, changed, new_exp, sm, block_size: int, layout: FloatLayout):
    """New bit patterns for ``out_bits`` (int16, n values holding the previous values): exponents of
    changed blocks come from ``new_exp`` (uint8, the changed blocks in order, last one padded), the
    others from ``out_bits`` itself; sign+mantissa from ``sm`` (n values). Returns int16 [n]."""
    n = out_bits.numel()
    m = layout.mant_bits
    exp = torch.zeros(changed.numel() * block_size, dtype=torch.int32, device=out_bits.device)
    exp[:n] = (_words(out_bits) >> m) & ((1 << layout.exp_bits) - 1)
    exp = exp.view(-1, block_size)
    exp[changed] = new_exp.view(-1, block_size).to(torch.int32)
    s = sm[:n].to(torch.int32) & 0xFFFF
    w = ((s >> m) << 15) | (exp.view(-1)[:n] << m) | (s & ((1 << m) - 1))
    return w.to(torch.int16)


if triton is not None:

    @triton.jit
    def _split_tile(bits_ptr, sm_ptr, rows, n, B: tl.constexpr):
        """Blocks ``rows`` of the bf16 bits: sign+mantissa bytes stored to ``sm_ptr``; returns the element
        offsets [rows, B] and the exponents (int32)."""
        offs = rows.to(tl.int64)[:, None] * B + tl.arange(0, B)[None, :]
        in_shard = offs < n
        w = tl.load(bits_ptr + offs, mask=in_shard, other=0).to(tl.int32) & 0xFFFF
        tl.store(sm_ptr + offs, (((w >> 8) & 0x80) | (w & 0x7F)).to(tl.uint8), mask=in_shard)
        return offs, (w >> 7) & 0xFF

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
        """block_hashes of the tile's exponents (int32 [BPP, B]) into hashes_ptr [nblocks, 2] (the bytes of 8
        consecutive exponents make a little-endian word: a sum of disjoint bytes); if COMPARE, over the
        previous hashes there, returning 1 where a block's hash changed (else 1 everywhere)."""
        bytes8 = tl.reshape(exp, (BPP, B // 8, 8)).to(tl.int64)
        words = tl.sum(bytes8 << (8 * tl.arange(0, 8)).to(tl.int64)[None, None, :], axis=2)
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
    def _split_blocks_kernel(bits_ptr, exp_ptr, sm_ptr, flags_ptr, hashes_ptr, n, npad, nblocks,
                             B: tl.constexpr, BPP: tl.constexpr, COMPARE: tl.constexpr, HASH: tl.constexpr,
                             SAMPLE: tl.constexpr):
        rows = tl.program_id(0) * BPP + tl.arange(0, BPP)
        offs, exp = _split_tile(bits_ptr, sm_ptr, rows, n, B)
        store = offs < npad
        if HASH:
            changed = _hash_blocks(hashes_ptr, rows, nblocks, exp, B, BPP, COMPARE)
            tl.store(exp_ptr + offs, exp.to(tl.uint8), mask=store)
        elif COMPARE and SAMPLE > 1:
            # Only every SAMPLE-th block is compared (the others' flags are 0); the others are stored at
            # once, and only tiles holding a compared block wait for its comparison.
            sampled = (rows % SAMPLE) == 0
            tl.store(exp_ptr + offs, exp.to(tl.uint8), mask=store & ~sampled[:, None])
            changed = tl.zeros([BPP], tl.int32)
            first = tl.program_id(0) * BPP
            if (first + SAMPLE - 1) // SAMPLE * SAMPLE < first + BPP:
                prev = tl.load(exp_ptr + offs, mask=store & sampled[:, None], other=0).to(tl.int32)
                changed = tl.max(((exp != prev) & sampled[:, None]).to(tl.int32), axis=1)
                tl.store(exp_ptr + offs, exp.to(tl.uint8), mask=store & (sampled & (changed != 0))[:, None])
        elif COMPARE:
            prev = tl.load(exp_ptr + offs, mask=store, other=0).to(tl.int32)
            changed = tl.max((exp != prev).to(tl.int32), axis=1)
            # Only changed blocks are rewritten (the others' exponents are already stored): the store
            # then depends on its whole block's loads, so no barrier is needed, and it is 1.7x faster
            # than storing every block after a barrier (results/gpu/ciera_split_variants.json).
            tl.store(exp_ptr + offs, exp.to(tl.uint8), mask=store & (changed[:, None] != 0))
        else:
            changed = tl.full([BPP], 1, tl.int32)
            tl.store(exp_ptr + offs, exp.to(tl.uint8), mask=store)
        tl.store(flags_ptr + rows, changed, mask=rows < nblocks)

    @triton.jit
    def _gather_exponents_kernel(flags_ptr, ranks_ptr, exp_ptr, bitmap_ptr, out_exp_ptr, nblocks,
                                 B: tl.constexpr, BPP: tl.constexpr, BITMAP_BYTES: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BPP + tl.arange(0, BPP)
        row_ok = rows < nblocks
        changed = tl.load(flags_ptr + rows, mask=row_ok, other=0) != 0
        slot = tl.load(ranks_ptr + rows, mask=row_ok, other=1).to(tl.int64) - 1  # ranks: inclusive sum
        cols = tl.arange(0, B)[None, :]
        copy = changed[:, None] & (cols < B)
        exp = tl.load(exp_ptr + rows.to(tl.int64)[:, None] * B + cols, mask=copy)
        tl.store(out_exp_ptr + slot[:, None] * B + cols, exp, mask=copy)
        # The bitmap bytes whose first block is one of this program's (none if BPP < 8 and pid*BPP % 8).
        byte = (pid * BPP + 7) // 8 + tl.arange(0, BITMAP_BYTES)
        bit_rows = byte[:, None] * 8 + tl.arange(0, 8)[None, :]
        bits = tl.load(flags_ptr + bit_rows, mask=bit_rows < nblocks, other=0)
        value = tl.sum(bits << tl.arange(0, 8)[None, :], axis=1)
        tl.store(bitmap_ptr + byte, value.to(tl.uint8), mask=(byte * 8 < (pid + 1) * BPP) & (byte * 8 < nblocks))

    @triton.jit
    def _unpack_bits_kernel(bitmap_ptr, flags_ptr, nblocks, TILE: tl.constexpr):
        rows = tl.program_id(0) * TILE + tl.arange(0, TILE)
        ok = rows < nblocks
        byte = tl.load(bitmap_ptr + rows // 8, mask=ok, other=0).to(tl.int32)
        tl.store(flags_ptr + rows, (byte >> (rows % 8)) & 1, mask=ok)

    @triton.jit
    def _merge_kernel(out_ptr, bitmap_ptr, ranks_ptr, sm_ptr, exp_ptr, n, nblocks,
                      B: tl.constexpr, BPP: tl.constexpr):
        rows = tl.program_id(0) * BPP + tl.arange(0, BPP)
        row_ok = rows < nblocks
        byte = tl.load(bitmap_ptr + rows // 8, mask=row_ok, other=0).to(tl.int32)
        bit = ((byte >> (rows % 8)) & 1)[:, None]
        slot = tl.load(ranks_ptr + rows, mask=row_ok, other=1).to(tl.int64) - 1
        cols = tl.arange(0, B)[None, :]
        offs = rows.to(tl.int64)[:, None] * B + cols
        in_shard = offs < n
        new = tl.load(exp_ptr + slot[:, None] * B + cols, mask=(bit != 0) & in_shard, other=0).to(tl.int32)
        old = tl.load(out_ptr + offs, mask=(bit == 0) & in_shard, other=0).to(tl.int32)
        exp = tl.where(bit != 0, new, (old >> 7) & 0xFF)
        sm = tl.load(sm_ptr + offs, mask=in_shard, other=0).to(tl.int32)
        w = ((sm & 0x80) << 8) | (exp << 7) | (sm & 0x7F)
        tl.store(out_ptr + offs, w.to(tl.int16), mask=in_shard)


def use_triton(bits: torch.Tensor, block_size: int, layout: FloatLayout) -> bool:
    """Whether the fused kernels serve this (contiguous, non-empty) bf16 tensor on CUDA."""
    return (triton is not None and bits.is_cuda and layout == LAYOUTS[torch.bfloat16]
            and block_size <= MAX_TRITON_BLOCK and bits.numel() > 0 and bits.is_contiguous())


def _blocks_per_program(block_size: int) -> int:
    return max(1, TILE_VALUES // block_size)


def _grid(nblocks: int, block_size: int) -> tuple:
    return (triton.cdiv(nblocks, _blocks_per_program(block_size)),)


def split_blocks(bits, exp, compare: bool, sm_out, block_size: int, hashes=None, sample: int = 1) -> torch.Tensor:
    """bf16 ``bits`` (int16 [n]): sign+mantissa bytes into ``sm_out[:n]``, exponents into ``exp``
    (uint8 [nblocks * block_size], zero-padded). Without ``hashes``: after comparing them with the previous
    exponents that ``exp`` holds if ``compare`` (``split_compare_reference``); ``sample`` > 1 compares only
    the blocks ``b % sample == 0`` (the others' flags are 0), which saves reading the others' previous
    exponents. With ``hashes`` (int64 [nblocks, 2]): ``block_hashes`` of the new exponents go there, after
    comparing them with the previous ones it holds if ``compare``. Returns int32 [nblocks] flags: 1 where a
    block changed (all if not ``compare``)."""
    nblocks = exp.numel() // block_size
    flags = torch.empty(nblocks, dtype=torch.int32, device=bits.device)
    _split_blocks_kernel[_grid(nblocks, block_size)](
        bits, exp, sm_out, flags, flags if hashes is None else hashes, bits.numel(), exp.numel(), nblocks,
        B=block_size, BPP=_blocks_per_program(block_size), COMPARE=compare, HASH=hashes is not None,
        SAMPLE=sample, num_warps=NUM_WARPS)
    return flags


def gather_exponents(flags, ranks, exp, bitmap_out, exp_out, block_size: int) -> None:
    """Write the bitmap of ``flags`` (one bit per block, LSB first) into ``bitmap_out`` and copy the
    exponents of each changed block of ``exp`` to ``exp_out[slot * block_size:]``, slot = its rank
    among the changed blocks (``ranks``: inclusive prefix sum of ``flags``)."""
    nblocks = flags.numel()
    bpp = _blocks_per_program(block_size)
    _gather_exponents_kernel[_grid(nblocks, block_size)](
        flags, ranks, exp, bitmap_out, exp_out, nblocks, B=block_size, BPP=bpp,
        BITMAP_BYTES=max(1, bpp // 8), num_warps=NUM_WARPS)


def merge_payload(out_bits, bitmap, sm, exps, block_size: int) -> None:
    """Merge in place of ``out_bits`` (int16 [n], the previous bf16 values): blocks flagged in
    ``bitmap`` take their exponents from ``exps`` (the changed blocks in order), the others keep
    theirs; sign+mantissa from ``sm`` (uint8 [n]). Equals ``merge_blocks_reference``."""
    n = out_bits.numel()
    nblocks = -(-n // block_size)
    flags = torch.empty(nblocks, dtype=torch.int32, device=out_bits.device)
    _unpack_bits_kernel[(triton.cdiv(nblocks, UNPACK_TILE),)](bitmap, flags, nblocks, TILE=UNPACK_TILE)
    ranks = torch.cumsum(flags, 0, dtype=torch.int32)
    _merge_kernel[_grid(nblocks, block_size)](
        out_bits, bitmap, ranks, sm, exps, n, nblocks, B=block_size, BPP=_blocks_per_program(block_size),
        num_warps=NUM_WARPS)
