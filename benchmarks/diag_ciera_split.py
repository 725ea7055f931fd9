"""Diagnostic: why CIERA's compare-mode split kernel takes ~2.2x the keyframe split (131 vs 59.5 us on
62.5M bf16 values, results/gpu/ciera_kernels_device_time.json) when it moves only 5 bytes per value to
the keyframe's 4.

Variants of ``kernels.ciera._split_blocks_kernel`` in compare mode, each checked bit for bit against the
production kernel (flags, sign+mantissa bytes, updated exponents) on the same AdamW step, timed by
device time only (PyTorch profiler):

- ``production``: the kernel as shipped (a barrier between reading the previous exponents and
  overwriting them; every block's exponents stored);
- ``no_barrier``: without the barrier. Safe only when no element is held by two threads (a tile of at
  least 32 x num_warps values, as every production launch has): each exponent is then loaded and
  stored by one thread in program order;
- ``no_barrier_changed_only``: also stores the exponents of changed blocks only (an unchanged block's
  new exponents equal the stored ones);
- ``keyframe``: the production kernel without the comparison, the bandwidth reference.

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
                           B: tl.constexpr, BPP: tl.constexpr, BARRIER: tl.constexpr, CHANGED_ONLY: tl.constexpr):
    rows = tl.program_id(0) * BPP + tl.arange(0, BPP)
    offs = rows.to(tl.int64)[:, None] * B + tl.arange(0, B)[None, :]
    in_shard = offs < n
    w = tl.load(bits_ptr + offs, mask=in_shard, other=0).to(tl.int32) & 0xFFFF
    exp = (w >> 7) & 0xFF
    tl.store(sm_ptr + offs, (((w >> 8) & 0x80) | (w & 0x7F)).to(tl.uint8), mask=in_shard)
    prev = tl.load(exp_ptr + offs, mask=offs < npad, other=0).to(tl.int32)
    changed = tl.max((exp != prev).to(tl.int32), axis=1)
    if BARRIER:
        tl.debug_barrier()
    store = offs < npad
    if CHANGED_ONLY:
        store = store & (changed[:, None] != 0)
    tl.store(exp_ptr + offs, exp.to(tl.uint8), mask=store)
    tl.store(flags_ptr + rows, changed, mask=rows < nblocks)


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
            "no_barrier": lambda: _split_compare_variant[grid](bits, exp, sm, flags, n, exp.numel(), nblocks, B=B,
                                                             BPP=bpp, BARRIER=False, CHANGED_ONLY=False,
                                                             num_warps=K.NUM_WARPS),
            "no_barrier_changed_only": lambda: _split_compare_variant[grid](
                bits, exp, sm, flags, n, exp.numel(), nblocks, B=B, BPP=bpp, BARRIER=False, CHANGED_ONLY=True,
                num_warps=K.NUM_WARPS),
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
        result["rows"].append(row)
        print(f"lr {lr:g}: changed blocks {row['changed_block_fraction']:.3f}; "
              + ", ".join(f"{k} {v:.1f} us{'' if row['exact'].get(k, True) else ' (NOT EXACT)'}"
                          for k, v in row["us"].items()), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
