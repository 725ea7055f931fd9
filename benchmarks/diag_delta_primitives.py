"""Diagnostic: device time of the building blocks of the delta encode kernel (format 2) on one GPU.

Each kernel below does a prefix of the encoder's work on the same steady-state AdamW step as
bench_delta_kernels.py (62.5M bf16 values, lr 1e-4), so the differences between rows show what each
step costs: stage0 loads old and new, computes z and writes the sender copy (the floor); stage1 adds
the width search; stage2 the rank scan and the bitmap; stage3 one of the encoder's two packing passes
(per-value atomic ORs since session 5; results/gpu/delta_primitives.json timed the segmented OR scan
it replaced); stage4 the same words as stage3 packed per row of 8 values with atomic ORs at the row
boundaries (benchmarks/sass_count.py: more instructions than either). ``hist`` replaces the width search by a bit-length histogram, ``rowpack`` is a
value-order fixed-width row packing with an escape scatter (a layout not in the format), ``2d_*``
runs tiles of several blocks per program. Results: results/gpu/delta_primitives.json (read with
docs/delta.md).

    python benchmarks/diag_delta_primitives.py   # writes $RES/delta_primitives.json (default /tmp)
"""
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kernels.delta as K  # noqa: E402
from benchmarks.delta_wire_ratio import simulated_step  # noqa: E402
from compression.delta import DeltaCodec, DeltaConfig  # noqa: E402
from compression.timing import call_seconds  # noqa: E402

@triton.jit
def _zs(prev_ptr, new_ptr, idx, inside):
    new16 = tl.load(new_ptr + idx, mask=inside, other=0)
    old = tl.load(prev_ptr + idx, mask=inside, other=0)
    d = K._ordered(new16.to(tl.int32) & 0xFFFF) - K._ordered(old.to(tl.int32) & 0xFFFF)
    return new16, (d << 1) ^ (d >> 31)

@triton.jit
def _block_zs(prev_ptr, new_ptr, numel, BLOCK: tl.constexpr):
    """This program's block: its index, element offsets and mask, the new values and their z."""
    b = tl.program_id(0).to(tl.int64)
    idx = b * BLOCK + tl.arange(0, BLOCK)
    inside = idx < numel
    new16, z = _zs(prev_ptr, new_ptr, idx, inside)
    return b, idx, inside, new16, z

@triton.jit
def _placed64(v, s):
    """v (< 2**17, int64) shifted by s bits (left if s >= 0, right if s < 0); 0 when out of a 64-bit word."""
    left = tl.where((s >= 0) & (s < 64), v << tl.maximum(s, 0), 0)
    return left | tl.where((s < 0) & (s > -64), v >> tl.maximum(-s, 0), 0)

@triton.jit
def _pack_rows(stream_ptr, changed, z, BLOCK: tl.constexpr):
    """Stage 3's slots (min(z, 7), width 3, compacted) into the zeroed ``stream_ptr``: each row of 8 values
    builds its bits in three 64-bit registers (a sum over the row: the bits are disjoint); rows share
    words only at their ends, so the words go out as atomic ORs."""
    c = tl.reshape(changed.to(tl.int32), (BLOCK // 8, 8))
    v = tl.reshape(tl.where(changed, tl.minimum(z, 7), 0), (BLOCK // 8, 8)).to(tl.int64)
    in_row = tl.cumsum(c, axis=1) - c  # exclusive rank within the row
    kr = tl.sum(c, axis=1)
    bit0 = (tl.cumsum(kr, axis=0) - kr) * 3  # the row's first slot bit
    word0 = bit0 >> 5
    off = ((bit0 & 31)[:, None] + in_row * 3).to(tl.int64)  # bit offset from the row's first word
    nwords = ((bit0 & 31) + kr * 3 + 31) >> 5
    for q in tl.static_range(3):
        word = tl.sum(_placed64(v, off - 64 * q), axis=1)
        lo, hi = word.to(tl.int32), (word >> 32).to(tl.int32)
        tl.atomic_or(stream_ptr + word0 + 2 * q, lo, mask=(2 * q < nwords) & (lo != 0))
        tl.atomic_or(stream_ptr + word0 + 2 * q + 1, hi, mask=(2 * q + 1 < nwords) & (hi != 0))

@triton.jit
def k_stage(prev_ptr, new_ptr, numel, out_ptr, scratch_ptr, BLOCK: tl.constexpr, STAGE: tl.constexpr):
    b, idx, inside, new16, z = _block_zs(prev_ptr, new_ptr, numel, BLOCK)
    acc = tl.sum(z, axis=0)
    if STAGE >= 1:  # width search
        width, n_esc, count, exc_width = K._best_width(z)
        acc += width + n_esc + count + exc_width
    if STAGE >= 2:  # ranks + bitmap
        changed = z != 0
        ranks = tl.cumsum(changed.to(tl.int32), axis=0)
        bitmap = tl.sum(tl.reshape(changed.to(tl.int32), (BLOCK // 32, 32)) << tl.arange(0, 32)[None, :], axis=1)
        tl.store(scratch_ptr + b * 64 + tl.arange(0, BLOCK // 32), bitmap)
        acc += tl.sum(ranks, axis=0)
    if STAGE == 3:  # one packing pass (slots of width 3, the encoder's atomic ORs)
        slot_at = (ranks - 1) * 3
        tl.store(scratch_ptr + b * 64 + 8 + tl.arange(0, 32), tl.zeros([32], dtype=tl.int32), mask=tl.arange(0, 32) < 24)
        tl.debug_barrier()
        K._or_bits(scratch_ptr + b * 64 + 8, tl.minimum(z, 7), slot_at, changed)
    if STAGE == 4:  # the same words as stage 3, packed per row of 8 values instead of by a scan
        _pack_rows(scratch_ptr + b * 64 + 32, changed, z, BLOCK)
    tl.debug_barrier()
    tl.store(prev_ptr + idx, new16, mask=inside)
    tl.store(out_ptr + b, acc)

@triton.jit
def k_hist(prev_ptr, new_ptr, numel, out_ptr, BLOCK: tl.constexpr):
    """bit-length histogram via float exponent, 5 packed int64 reductions"""
    b, idx, inside, new16, z = _block_zs(prev_ptr, new_ptr, numel, BLOCK)
    L = K._bit_lengths(z)  # 0..17
    one = tl.full(L.shape, 1, tl.int64) << ((L % 4) * 16).to(tl.int64)
    acc = tl.zeros([], dtype=tl.int64)
    for g in tl.static_range(5):
        acc += tl.sum(tl.where(L // 4 == g, one, 0), axis=0) * (g + 1)
    tl.debug_barrier()
    tl.store(prev_ptr + idx, new16, mask=inside)
    tl.store(out_ptr + b, acc.to(tl.int32))

@triton.jit
def k_rowpack(prev_ptr, new_ptr, numel, out_ptr, scratch_ptr, BLOCK: tl.constexpr, W: tl.constexpr):
    """value-order slots at fixed width W (pow2), packed per row of 8 values (thread-local); escapes scattered."""
    b, idx, inside, new16, z = _block_zs(prev_ptr, new_ptr, numel, BLOCK)
    esc = (1 << W) - 1
    slot = tl.minimum(z, esc)
    rows = tl.reshape(slot, (BLOCK // 8, 8))
    packed = tl.sum(rows << (tl.arange(0, 8) * W)[None, :], axis=1)
    tl.store(scratch_ptr + b * BLOCK + tl.arange(0, BLOCK // 8), packed)
    escaped = z >= esc
    r = tl.cumsum(escaped.to(tl.int32), axis=0) - 1
    tl.store(scratch_ptr.to(tl.pointer_type(tl.int16)) + b * 2 * BLOCK + BLOCK + r, z.to(tl.int16), mask=escaped)
    tl.debug_barrier()
    tl.store(prev_ptr + idx, new16, mask=inside)
    tl.store(out_ptr + b, tl.sum(escaped.to(tl.int32), axis=0))

@triton.jit
def k_stage2d(prev_ptr, new_ptr, numel, out_ptr, BLOCK: tl.constexpr, NB: tl.constexpr, STAGE: tl.constexpr):
    p = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, NB)
    i = tl.arange(0, BLOCK)
    idx = (p * NB + r)[:, None] * BLOCK + i[None, :]
    inside = idx < numel
    new16, z = _zs(prev_ptr, new_ptr, idx, inside)
    acc = tl.sum(z, axis=1)
    if STAGE >= 1:
        for w in tl.static_range(0, 18, 2):
            acc += tl.sum((z >= (1 << w)).to(tl.int32) | ((z >= (1 << (w + 1))).to(tl.int32) << 16), axis=1)
    if STAGE >= 2:
        acc += tl.sum(tl.cumsum((z != 0).to(tl.int32), axis=1), axis=1)
    tl.debug_barrier()
    tl.store(prev_ptr + idx, new16, mask=inside)
    tl.store(out_ptr + p * NB + r, acc)

def t(fn, reset, reps=20):
    """Best of ``reps`` synchronized calls, in ms, each after an untimed ``reset``."""
    return min(call_seconds(fn, torch.device("cuda"), reps, setup=reset)) * 1e3

def main():
    numel, B = 62_500_000, 256
    res = {}
    for lr in (1e-4,):
        previous, new = simulated_step(numel, lr, 20, device="cuda")
        prev16, new16 = previous.view(torch.int16), new.view(torch.int16)
        state = prev16.clone()
        work = prev16.clone()
        reset = lambda: work.copy_(state)
        nb = -(-numel // B)
        out = torch.empty(nb, dtype=torch.int32, device="cuda")
        scratch = torch.empty(nb * 2 * B, dtype=torch.int32, device="cuda")
        dst = torch.empty_like(new16)
        res["copy"] = t(lambda: dst.copy_(new16), lambda: None)
        for warps in (1, 2):
            for stage in range(5):  # stage 4 ORs into the scratch: zero it first (untimed)
                res[f"stage{stage}_w{warps}"] = t(lambda: k_stage[(nb,)](work, new16, numel, out, scratch, BLOCK=B, STAGE=stage, num_warps=warps),
                                                  reset if stage < 4 else lambda: (reset(), scratch.zero_()))
        res["hist_w1"] = t(lambda: k_hist[(nb,)](work, new16, numel, out, BLOCK=B, num_warps=1), reset)
        for W in (1, 2, 4):
            for warps in (1, 2):
                res[f"rowpack{W}_w{warps}"] = t(lambda: k_rowpack[(nb,)](work, new16, numel, out, scratch, BLOCK=B, W=W, num_warps=warps), reset)
        for NB, warps in ((4, 4), (8, 4), (8, 8), (16, 8)):
            for stage in range(3):
                res[f"2d_nb{NB}_w{warps}_s{stage}"] = t(lambda: k_stage2d[(-(-nb // NB),)](work, new16, numel, out, BLOCK=B, NB=NB, STAGE=stage, num_warps=warps), reset)
        res["encode_blocks"] = t(lambda: K.encode_blocks(work, new16, B), reset)
        codec = DeltaCodec(DeltaConfig(B), 2, 0); codec.encode(previous); st = codec._prev.clone()
        res["full_encode"] = t(lambda: codec.encode(new), lambda: codec._prev.copy_(st))
        codec._prev.copy_(st); payload = codec.encode(new)
        rx = DeltaCodec(DeltaConfig(B), 2, 1)
        o = previous.clone()
        res["full_decode"] = t(lambda: rx.decode(0, payload, o), lambda: o.copy_(previous))
        assert torch.equal(o.view(torch.int16), new16)
        for k, v in res.items():
            print(f"{k:24s} {v:7.3f} ms  {2*numel/v/1e6:7.0f} GB/s")
    json.dump(res, open(os.environ.get("RES", "/tmp") + "/delta_primitives.json", "w"), indent=1)

if __name__ == "__main__":
    main()
