"""Diagnostic: why CIERA's compare-mode split kernel took ~2.2x the keyframe split (131 vs 59.5 us on
62.5M bf16 values, results/gpu/ciera_kernels_device_time.json) when it moves only 5 bytes per value to
the keyframe's 4.

Variants of ``kernels.ciera._split_blocks_kernel`` in compare mode, each checked bit for bit against the
production kernel (flags, sign+mantissa bytes, updated exponents) on the same AdamW step, timed by
device time only (PyTorch profiler). Session 6 measured them (results/gpu/ciera_split_variants.json:
barrier + every block 130 us, no barrier 311 us, changed blocks only without a barrier 76 us, keyframe
59 us) and the production kernel became the last of these:

- ``production``: the kernel as shipped (stores the exponents of changed blocks only, whose mask
  depends on the whole block's loads, so no barrier is needed);
- ``barrier_all_blocks``: the kernel before session 6 (a barrier between reading the previous
  exponents and overwriting them; every block's exponents stored);
- ``no_barrier``: every block stored without the barrier (safe only when no element is held by two
  threads; measured 2.4x slower than with it);
- ``keyframe``: the production kernel without the comparison, the bandwidth reference.

And the whole encode's kernels (the split, the prefix sum over blocks, the exponent gather) against one
fused kernel, ``_split_lookback``: each program takes a ticket (its place in start order), compares
its blocks, publishes its changed-block count, adds up its predecessors' counts by decoupled look-back
(a predecessor that has published its inclusive prefix ends the walk), and writes its changed blocks'
exponents straight into the payload at their slots, its bitmap byte, and the changed exponents into the
sender's cache: no second pass over the exponents. Checked byte for byte against the production path
(payload bitmap, sign+mantissa and exponent sections; cache). Traffic per value, all blocks changed:
read 2 + 1 (cache), write 1 (sign+mantissa) + 1 (payload exponents) + 1 (cache) = 6 bytes against a
copy's 4, so even at the copy's bandwidth compare mode reaches ~67% of copy when every block changes
(more at lower change rates). Session 6 timed it at 293 us against the production encode's 169 us with
a walk back of one predecessor per step; session 17 (results/gpu/session17/, LOOKBACK_VARIANTS below)
published counts with relaxed ordering, widened the walk's window, grew the tiles, re-read a tile after the
walk instead of holding it, bounded the kernel with the prefixes given (``oracle``: no walk), and tried
persistent programs over tiles of production-shaped sub-tiles (``_encode_tiles``), in compare and hash
mode: none beat the production encode (docs/ciera.md).

Only a diagnostic: the production kernel changes after a GPU run of this script shows a variant both
exact and faster.

    python benchmarks/diag_ciera_split.py --out $RES/ciera_split_variants.json   # CUDA
"""

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import kernels.ciera as K  # noqa: E402
from benchmarks.delta_wire_ratio import simulated_step  # noqa: E402
from compression.timing import device_op_seconds  # noqa: E402


@triton.jit
def _split_compare_variant(bits_ptr, exp_ptr, sm_ptr, flags_ptr, n, npad, nblocks,
                           B: tl.constexpr, BPP: tl.constexpr, BARRIER: tl.constexpr):
    rows = tl.program_id(0) * BPP + tl.arange(0, BPP)
    offs, exp = K._split_tile(bits_ptr, sm_ptr, rows, n, B)
    prev = tl.load(exp_ptr + offs, mask=offs < npad, other=0).to(tl.int32)
    changed = tl.max((exp != prev).to(tl.int32), axis=1)
    if BARRIER:
        tl.debug_barrier()
    tl.store(exp_ptr + offs, exp.to(tl.uint8), mask=offs < npad)  # every block's exponents
    tl.store(flags_ptr + rows, changed, mask=rows < nblocks)


@triton.jit
def _publish_and_look_back(status_ptr, t, local, WINDOW: tl.constexpr, RELEASE: tl.constexpr):
    """Tile t's exclusive prefix of changed blocks by decoupled look-back. status[t] = count << 2 | 1 (this tile's
    changed blocks) or | 2 (changed blocks of tiles 0..t); 0 while unpublished. The walk reads WINDOW predecessors
    per step (one load each, no atomics: a published word is final for what it says, so a volatile read is enough)
    and stops at the nearest inclusive prefix before the nearest unpublished one. A status word carries its own data,
    so publishing needs no ordering with the program's other stores (RELEASE: session 7's release ordering, which
    waits for the program's earlier stores to drain before its successors can see its count)."""
    if RELEASE:
        tl.atomic_xchg(status_ptr + t, (local << 2) | tl.where(t == 0, 2, 1), sem="release")
    else:
        tl.atomic_xchg(status_ptr + t, (local << 2) | tl.where(t == 0, 2, 1), sem="relaxed")
    prefix = local * 0
    j = t - 1
    back = tl.arange(0, WINDOW)
    while j >= 0:
        k = j - back  # nearest first; before tile 0 reads as an inclusive prefix of 0
        s = tl.load(status_ptr + k, mask=k >= 0, other=2, volatile=True)
        flag = s & 3
        unpublished = tl.min(tl.where(flag == 0, back, WINDOW), axis=0)
        inclusive = tl.min(tl.where(flag == 2, back, WINDOW), axis=0)
        done = inclusive < unpublished
        limit = tl.where(done, inclusive + 1, unpublished)
        prefix += tl.sum(tl.where(back < limit, s >> 2, 0), axis=0)
        j = tl.where(done, -1, j - unpublished)  # nothing usable yet (unpublished == 0): read again
    if t > 0:
        tl.atomic_xchg(status_ptr + t, ((prefix + local) << 2) | 2, sem="relaxed")
    return prefix


@triton.jit
def _split_and_flag(bits_ptr, sm_ptr, cache_ptr, hashes_ptr, rows, n, npad, nblocks, B: tl.constexpr,
                    BPP: tl.constexpr, HASH: tl.constexpr):
    """The production split of blocks ``rows`` (sign+mantissa stored) and their changed flags against the sender
    state (previous exponents at cache_ptr, or block hashes at hashes_ptr, which are updated). Returns (offsets,
    exponents, flags); the cache is left as it was."""
    offs, exp = K._split_tile(bits_ptr, sm_ptr, rows, n, B)
    if HASH:
        changed = K._hash_blocks(hashes_ptr, rows, nblocks, exp, B, BPP, True)
    else:
        prev = tl.load(cache_ptr + offs, mask=offs < npad, other=0).to(tl.int32)
        changed = tl.max((exp != prev).to(tl.int32), axis=1)
    return offs, exp, changed * (rows < nblocks).to(tl.int32)


@triton.jit
def _store_bitmap_bytes(bitmap_ptr, changed, first_block, nblocks, BPP: tl.constexpr):
    """The bitmap bytes of BPP blocks from first_block (a multiple of 8), one bit per block, LSB first."""
    byte = tl.sum(tl.reshape(changed, (BPP // 8, 8)) << tl.arange(0, 8)[None, :], axis=1)
    first = first_block // 8 + tl.arange(0, BPP // 8)
    tl.store(bitmap_ptr + first, byte.to(tl.uint8), mask=first * 8 < nblocks)


@triton.jit
def _split_lookback(bits_ptr, cache_ptr, hashes_ptr, sm_ptr, bitmap_ptr, exp_out_ptr, status_ptr, ticket_ptr,
                    oracle_ptr, n, npad, nblocks, B: tl.constexpr, BPP: tl.constexpr, WINDOW: tl.constexpr,
                    HASH: tl.constexpr, RELEASE: tl.constexpr, RELOAD: tl.constexpr, ORACLE: tl.constexpr,
                    TICKETS: tl.constexpr):
    # Tickets in start order: every program waits only on programs that started before it, so none waits on a
    # program that cannot be scheduled; the walk is _publish_and_look_back's.
    # RELOAD: nothing of the tile is held in registers across the walk; the changed blocks' values are
    # read again after it (from L2: the tile was read a few microseconds before), so that a program
    # waiting on its predecessors holds few registers and more programs keep loads in flight.
    # ORACLE (a bound, not an encoder): the tiles' prefixes are read from oracle_ptr (computed beforehand),
    # no walk: what the kernel would cost if the look-back were free. TICKETS=False: t = program id.
    if TICKETS:
        t = tl.atomic_add(ticket_ptr, 1, sem="relaxed")
    else:
        t = tl.program_id(0)
    rows = t * BPP + tl.arange(0, BPP)
    offs, exp, changed = _split_and_flag(bits_ptr, sm_ptr, cache_ptr, hashes_ptr, rows, n, npad, nblocks, B, BPP,
                                         HASH)
    local = tl.sum(changed, axis=0)
    if ORACLE:
        prefix = tl.load(oracle_ptr + t)
    else:
        prefix = _publish_and_look_back(status_ptr, t, local, WINDOW, RELEASE)
    slot = (prefix + tl.cumsum(changed, axis=0) - changed).to(tl.int64)
    if RELOAD:
        # offsets within the tile, int32, from a scalar base: nothing [BPP, B]-shaped lives across the walk
        base = t.to(tl.int64) * (BPP * B)
        in_tile = tl.arange(0, BPP)[:, None] * B + tl.arange(0, B)[None, :]
        keep = (changed[:, None] != 0) & (base + in_tile < npad)
        w = tl.load(bits_ptr + base + in_tile, mask=keep & (base + in_tile < n), other=0).to(tl.int32) & 0xFFFF
        exp = (w >> 7) & 0xFF
        if not HASH:
            tl.store(cache_ptr + base + in_tile, exp.to(tl.uint8), mask=keep)
    else:
        keep = (changed[:, None] != 0) & (offs < npad)
        if not HASH:
            tl.store(cache_ptr + offs, exp.to(tl.uint8), mask=keep)
    tl.store(exp_out_ptr + slot[:, None] * B + tl.arange(0, B)[None, :], exp.to(tl.uint8), mask=keep)
    _store_bitmap_bytes(bitmap_ptr, changed, t * BPP, nblocks, BPP)


@triton.jit
def _encode_tiles(bits_ptr, cache_ptr, hashes_ptr, sm_ptr, bitmap_ptr, exp_out_ptr, flags_ptr, status_ptr, ticket_ptr,
                  n, npad, nblocks, ntiles, B: tl.constexpr, BPP: tl.constexpr, SUB: tl.constexpr,
                  WINDOW: tl.constexpr, HASH: tl.constexpr):
    # Persistent programs take tiles of SUB sub-tiles (BPP blocks each, the production split's shape) in
    # ticket order. Per tile: (A) the production split of each sub-tile (sign+mantissa into the payload,
    # changed flags to flags_ptr, bitmap bytes, and in compare mode the changed blocks' exponents into the
    # sender's cache), (B) the tile's changed-block count published and its prefix found by
    # _publish_and_look_back, (C) each sub-tile's changed exponents copied to their payload slots, read back from
    # L2 (the cache in compare mode, the values in hash mode), which the tile left there microseconds before.
    # Large tiles keep the walk short; sub-tiles keep the split's registers and shape.
    t = tl.atomic_add(ticket_ptr, 1, sem="relaxed")
    cols = tl.arange(0, B)[None, :]
    while t < ntiles:
        local = t * 0
        for i in range(SUB):
            rows = (t * SUB + i) * BPP + tl.arange(0, BPP)
            offs, exp, changed = _split_and_flag(bits_ptr, sm_ptr, cache_ptr, hashes_ptr, rows, n, npad, nblocks, B,
                                                 BPP, HASH)
            if not HASH:
                tl.store(cache_ptr + offs, exp.to(tl.uint8), mask=(offs < npad) & (changed[:, None] != 0))
            tl.store(flags_ptr + rows, changed, mask=rows < nblocks)
            _store_bitmap_bytes(bitmap_ptr, changed, (t * SUB + i) * BPP, nblocks, BPP)
            local += tl.sum(changed, axis=0)
        tl.debug_barrier()  # (C) reads flags and cache bytes that other threads of the program stored in (A)
        prefix = _publish_and_look_back(status_ptr, t, local, WINDOW, False)
        for i in range(SUB):
            rows = (t * SUB + i) * BPP + tl.arange(0, BPP)
            changed = tl.load(flags_ptr + rows, mask=rows < nblocks, other=0)
            slot = (prefix + tl.cumsum(changed, axis=0) - changed).to(tl.int64)
            prefix += tl.sum(changed, axis=0)
            offs = rows.to(tl.int64)[:, None] * B + cols
            keep = (changed[:, None] != 0) & (offs < npad)
            if HASH:
                w = tl.load(bits_ptr + offs, mask=keep & (offs < n), other=0).to(tl.int32) & 0xFFFF
                exp = ((w >> 7) & 0xFF).to(tl.uint8)
            else:
                exp = tl.load(cache_ptr + offs, mask=keep, other=0)
            tl.store(exp_out_ptr + slot[:, None] * B + cols, exp, mask=keep)
        t = tl.atomic_add(ticket_ptr, 1, sem="relaxed")


# Session 17 (results/gpu/session17/): call 1 release 317 -> relaxed 230 -> window 256 171 -> tile 8192 140 us at
# lr 1e-4 (production 116); call 2 with the tile re-read after the walk, tile 16384: 124 us (lr 1e-5: 115 vs 99).
# Call 3: larger tiles, program ids instead of tickets, and the oracle bound (no walk at all): at tile 16384
# the oracle 94-97 us (lr 1e-5) against the walk's 115, but larger tiles slow the split itself (oracle at 32768:
# 131 us). Call 4: _encode_tiles, persistent programs over tiles of SUB production-shaped sub-tiles.
LOOKBACK_VARIANTS = (
    dict(window=256, tile=16384, reload=True),
    dict(window=256, tile=16384, reload=True, oracle=True),
    dict(window=128, sub=4, programs_per_sm=8),
    dict(window=128, sub=8, programs_per_sm=8),
    dict(window=128, sub=16, programs_per_sm=8),
    dict(window=128, sub=8, programs_per_sm=4),
    dict(window=128, sub=8, programs_per_sm=16),
    dict(window=128, sub=8, programs_per_sm=8, warps=4),
)


def variant_name(mode, window=32, tile=None, release=False, reload=False, warps=None, oracle=False, tickets=True,
                 sub=0, programs_per_sm=0):
    if sub:
        return f"encode_tiles_{mode}_w{window}_sub{sub}_p{programs_per_sm}_nw{warps or K.NUM_WARPS}"
    return (f"encode_lookback_{mode}_w{window}_t{tile}_nw{warps or K.NUM_WARPS}{'_release' if release else ''}"
            f"{'_reload' if reload else ''}{'_oracle' if oracle else ''}{'' if tickets else '_pid'}")


def encode_paths(bits, state, payload, n, B, window=32, tile=None, hash_mode=False, release=False, reload=False,
                 warps=None, oracle=False, tickets=True, sub=0, programs_per_sm=0):
    """(production, fused, sections): callables that encode ``bits`` against ``state`` (previous exponents, or
    block hashes int64 [nblocks, 2] in hash mode) into ``payload``'s sections the way CieraCodec._split_fused
    does on a sparse encode (raw exponents), and return the changed-block count's tensor. ``tile``: values per
    program of the fused kernel (default kernels.ciera.TILE_VALUES)."""
    from compression.ciera import HEADER_BYTES, sections
    from kernels.ciera import LAYOUTS

    sec = sections(n, B, LAYOUTS[torch.bfloat16])
    nblocks = -(-n // B)
    bpp = max(1, (K.TILE_VALUES if sub else tile or K.TILE_VALUES) // B)
    if bpp % 8:
        raise ValueError(f"the fused variant writes whole bitmap bytes: needs >= 8 blocks per program, got "
                         f"{bpp} (tile {tile}, B={B})")
    nprog = -(-nblocks // bpp)
    scratch = torch.empty(nblocks * B, dtype=torch.uint8, device=bits.device) if hash_mode else None

    def production():
        exp = scratch if hash_mode else state
        flags = K.split_blocks(bits, exp, True, payload[sec.sm:], B, state if hash_mode else None)
        ranks = torch.cumsum(flags, 0, dtype=torch.int32)
        K.gather_exponents(flags, ranks, exp, payload[HEADER_BYTES:sec.sm], payload[sec.exp:], B)
        return ranks[-1]

    oracle_prefix = oracle_total = None
    if oracle:  # the tiles' exclusive prefixes, from the production path's flags on a copy of the state
        scratch_exp = torch.empty(nblocks * B, dtype=torch.uint8, device=bits.device)
        scratch_sm = torch.empty(n, dtype=torch.uint8, device=bits.device)
        if hash_mode:
            flags = K.split_blocks(bits, scratch_exp, True, scratch_sm, B, state.clone())
        else:
            flags = K.split_blocks(bits, scratch_exp.copy_(state), True, scratch_sm, B)
        per_tile = torch.nn.functional.pad(flags, (0, nprog * bpp - nblocks)).view(nprog, bpp).sum(1)
        oracle_prefix = (torch.cumsum(per_tile, 0) - per_tile).to(torch.int32)
        oracle_total = per_tile.sum()

    if sub:  # the persistent tiled kernel
        ntiles = -(-nprog // sub)
        flags = torch.empty(ntiles * sub * bpp, dtype=torch.int32, device=bits.device)
        grid = min(ntiles, programs_per_sm * torch.cuda.get_device_properties(bits.device).multi_processor_count
                   if bits.is_cuda else 2)

        def tiles():
            status = torch.zeros(ntiles + 1, dtype=torch.int32, device=bits.device)
            _encode_tiles[(grid,)](bits, state, state, payload[sec.sm:], payload[HEADER_BYTES:sec.sm], payload[sec.exp:],
                                   flags, status, status[ntiles:], n, nblocks * B, nblocks, ntiles, B=B, BPP=bpp,
                                   SUB=sub, WINDOW=window, HASH=hash_mode, num_warps=warps or K.NUM_WARPS)
            return status[ntiles - 1] >> 2

        return production, tiles, sec

    def fused():
        status = torch.zeros(nprog + 1, dtype=torch.int32, device=bits.device)  # [nprog] is the ticket counter
        _split_lookback[(nprog,)](bits, state, state, payload[sec.sm:], payload[HEADER_BYTES:sec.sm],
                                  payload[sec.exp:], status, status[nprog:], status if oracle_prefix is None
                                  else oracle_prefix, n, nblocks * B, nblocks, B=B, BPP=bpp, WINDOW=window,
                                  HASH=hash_mode, RELEASE=release, RELOAD=reload, ORACLE=oracle, TICKETS=tickets,
                                  num_warps=warps or K.NUM_WARPS)
        return (status[nprog - 1] >> 2) if oracle_prefix is None else oracle_total

    return production, fused, sec


def _start_state(old_bits, B, hash_mode):
    """The sender state after encoding ``old_bits``: its exponents, or (hash mode) its blocks' hashes."""
    n, device = old_bits.numel(), old_bits.device
    exp = torch.zeros(-(-n // B) * B, dtype=torch.uint8, device=device)
    hashes = torch.zeros(exp.numel() // B, 2, dtype=torch.int64, device=device) if hash_mode else None
    K.split_blocks(old_bits, exp, False, torch.empty(n, dtype=torch.uint8, device=device), B, hashes)
    return hashes if hash_mode else exp


def check_fused(previous, new, B, device, **variant):
    """Payload sections and sender state of the fused kernel (``variant``: encode_paths' keywords) equal the
    production path's (bits compared). Returns the changed-block count."""
    n = new.numel()
    bits, old_bits = new.view(torch.int16), previous.view(torch.int16)
    start = _start_state(old_bits, B, variant.get("hash_mode", False))
    outputs = []
    for which in (0, 1):
        state = start.clone()
        payload = torch.zeros(n * 2 + 4096, dtype=torch.uint8, device=device)
        *paths, sec = encode_paths(bits, state, payload, n, B, **variant)
        changed = int(paths[which]())
        outputs.append((changed, payload[:sec.exp + changed * B].clone(), state))
    (c0, p0, k0), (c1, p1, k1) = outputs
    assert c0 == c1, (c0, c1)
    assert torch.equal(p0, p1), int((p0 != p1).nonzero()[0])
    assert torch.equal(k0, k1)
    return c0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=62_500_000)
    p.add_argument("--block-size", type=int, default=512)
    p.add_argument("--lrs", default="1e-4,1e-5")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    n, B = args.numel, args.block_size
    nblocks = -(-n // B)
    bpp = K._blocks_per_program(B)
    grid = K._grid(nblocks, B)
    result = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(0), "numel": n, "block_size": B,
              "rows": []}
    for lr in map(float, args.lrs.split(",")):
        previous, new = simulated_step(n, lr, 20, device="cuda")
        bits, old_bits = new.view(torch.int16), previous.view(torch.int16)
        start_exp = torch.zeros(nblocks * B, dtype=torch.uint8, device="cuda")
        K.split_blocks(old_bits, start_exp, False, torch.empty(n, dtype=torch.uint8, device="cuda"), B)
        exp, sm = torch.empty_like(start_exp), torch.empty(n, dtype=torch.uint8, device="cuda")
        flags = torch.empty(nblocks, dtype=torch.int32, device="cuda")
        variants = {
            "production": lambda: flags.copy_(K.split_blocks(bits, exp, True, sm, B)),
            "barrier_all_blocks": lambda: _split_compare_variant[grid](
                bits, exp, sm, flags, n, exp.numel(), nblocks, B=B, BPP=bpp, BARRIER=True, num_warps=K.NUM_WARPS),
            "no_barrier": lambda: _split_compare_variant[grid](
                bits, exp, sm, flags, n, exp.numel(), nblocks, B=B, BPP=bpp, BARRIER=False, num_warps=K.NUM_WARPS),
            "keyframe": lambda: flags.copy_(K.split_blocks(bits, exp, False, sm, B)),
        }
        reset = lambda: exp.copy_(start_exp)  # noqa: E731
        reference = None
        row = {"lr": lr, "us": {}, "exact": {}}
        for name, fn in variants.items():
            reset()
            fn()
            torch.cuda.synchronize()
            got = (flags.clone(), sm.clone(), exp.clone())
            if reference is None:
                reference = got
            if name != "keyframe":
                row["exact"][name] = all(torch.equal(a, b) for a, b in zip(got, reference))
            ops = device_op_seconds(fn, args.repeats, setup=reset)
            row["us"][name] = 1e6 * sum(seconds for op, seconds in ops.items() if "split" in op)
        row["changed_block_fraction"] = float(reference[0].float().mean())
        # the whole encode's kernels: production (split, prefix sum, gather) vs the fused look-back kernel
        for hash_mode in (False, True):
            mode = "hash" if hash_mode else "compare"
            start_state = _start_state(old_bits, B, hash_mode)
            state = start_state.clone()
            payload = torch.zeros(n * 2 + 4096, dtype=torch.uint8, device="cuda")
            production = encode_paths(bits, state, payload, n, B, hash_mode=hash_mode)[0]
            timed = [(f"encode_production_{mode}", production)]
            for variant in LOOKBACK_VARIANTS:
                name = variant_name(mode, **variant)
                check_fused(previous, new, B, "cuda", hash_mode=hash_mode, **variant)
                row["exact"][name] = True  # check_fused raised otherwise
                timed.append((name, encode_paths(bits, state, payload, n, B, hash_mode=hash_mode, **variant)[1]))
            for name, fn in timed:
                ops = device_op_seconds(fn, args.repeats, setup=lambda: state.copy_(start_state))
                row["us"][name] = 1e6 * sum(ops.values())
                row.setdefault("ops_us", {})[name] = {op[:60]: 1e6 * sec for op, sec in ops.items()}
        dst = torch.empty_like(new)
        row["us"]["copy"] = 1e6 * sum(device_op_seconds(lambda: dst.copy_(new), args.repeats).values())
        row["vs_copy"] = {k: row["us"]["copy"] / v for k, v in row["us"].items() if k != "copy"}
        result["rows"].append(row)
        print(f"lr {lr:g}: changed blocks {row['changed_block_fraction']:.3f}; "
              + ", ".join(f"{k} {v:.1f} us{'' if row['exact'].get(k, True) else ' (NOT EXACT)'}"
                          for k, v in row["us"].items()), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
