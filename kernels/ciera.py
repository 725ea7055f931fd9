"""CIERA bit-field kernels: split 16-bit floats into exponent and sign+mantissa, detect which blocks'
exponents changed, and merge them back.

Bit layouts (a value's bits read as an unsigned 16-bit word):
  bf16: sign 15 | exponent 14..7 (8 bits) | mantissa 6..0 (7 bits)  -> sign+mantissa fits one byte
  fp16: sign 15 | exponent 14..10 (5 bits) | mantissa 9..0 (10 bits) -> sign+mantissa needs 11 bits
sign+mantissa is ``sign << mant_bits | mantissa``. Splitting and merging only move bits, so every
value (NaN payloads, +-Inf, -0.0, subnormals) survives exactly.

``split_compare`` and ``merge_blocks`` dispatch to fused Triton kernels for bf16 on CUDA and to the
plain-PyTorch ``*_reference`` functions otherwise; the references are the CPU path and the test oracle.
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
    def _split_compare_bf16_kernel(bits_ptr, prev_ptr, exp_ptr, sm_ptr, changed_ptr, n,
                                   BLOCK: tl.constexpr, COMPARE: tl.constexpr):
        block = tl.program_id(0)
        offs = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        w = tl.load(bits_ptr + offs, mask=offs < n, other=0).to(tl.int32) & 0xFFFF
        exp = (w >> 7) & 0xFF
        sm = ((w >> 8) & 0x80) | (w & 0x7F)
        tl.store(exp_ptr + offs, exp.to(tl.uint8))
        tl.store(sm_ptr + offs, sm.to(tl.uint8))
        if COMPARE:
            prev = tl.load(prev_ptr + offs).to(tl.int32)
            diff = tl.max((exp != prev).to(tl.int32), axis=0)
            tl.store(changed_ptr + block, diff.to(tl.int8))

    @triton.jit
    def _merge_bf16_kernel(out_ptr, changed_ptr, slot_ptr, new_exp_ptr, sm_ptr, n, BLOCK: tl.constexpr):
        block = tl.program_id(0)
        offs = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        old = tl.load(out_ptr + offs, mask=mask, other=0).to(tl.int32) & 0xFFFF
        exp = (old >> 7) & 0xFF
        if tl.load(changed_ptr + block) != 0:
            slot = tl.load(slot_ptr + block).to(tl.int64)
            exp = tl.load(new_exp_ptr + slot * BLOCK + tl.arange(0, BLOCK)).to(tl.int32)
        sm = tl.load(sm_ptr + offs, mask=mask, other=0).to(tl.int32)
        w = ((sm & 0x80) << 8) | (exp << 7) | (sm & 0x7F)
        tl.store(out_ptr + offs, w.to(tl.int16), mask=mask)


def _use_triton(bits: torch.Tensor, block_size: int, layout: FloatLayout) -> bool:
    return (triton is not None and bits.is_cuda and layout == LAYOUTS[torch.bfloat16]
            and block_size <= MAX_TRITON_BLOCK)


def split_compare_triton(bits, prev_exp, block_size: int):
    """Fused bf16 split + per-block exponent comparison (same contract as the reference)."""
    n = bits.numel()
    nblocks = -(-n // block_size)
    exp = torch.empty(nblocks * block_size, dtype=torch.uint8, device=bits.device)
    sm = torch.empty_like(exp)
    changed = torch.empty(nblocks, dtype=torch.int8, device=bits.device)
    compare = prev_exp is not None
    if nblocks:
        _split_compare_bf16_kernel[(nblocks,)](bits, prev_exp if compare else exp, exp, sm, changed, n,
                                               BLOCK=block_size, COMPARE=compare)
    return exp, sm, changed.bool() if compare else None


def merge_blocks_triton(out_bits, changed, new_exp, sm, block_size: int):
    """Fused bf16 merge in place of ``out_bits`` (same result as the reference)."""
    nblocks = changed.numel()
    slots = torch.cumsum(changed.to(torch.int32), 0) - changed.to(torch.int32)
    if nblocks:
        _merge_bf16_kernel[(nblocks,)](out_bits, changed.to(torch.int8), slots, new_exp, sm,
                                       out_bits.numel(), BLOCK=block_size)
    return out_bits


def split_compare(bits, prev_exp, block_size: int, layout: FloatLayout):
    if _use_triton(bits, block_size, layout):
        return split_compare_triton(bits, prev_exp, block_size)
    return split_compare_reference(bits, prev_exp, block_size, layout)


def merge_blocks(out_bits, changed, new_exp, sm, block_size: int, layout: FloatLayout) -> None:
    """Write the merged values into ``out_bits`` in place."""
    if _use_triton(out_bits, block_size, layout) and out_bits.is_contiguous():
        merge_blocks_triton(out_bits, changed, new_exp, sm, block_size)
    else:
        out_bits.copy_(merge_blocks_reference(out_bits, changed, new_exp, sm, block_size, layout))
