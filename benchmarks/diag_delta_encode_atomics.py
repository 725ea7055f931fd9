"""Diagnostic: what the delta encode kernel's atomic ORs cost (one GPU, timing only).

The encode kernel packs each row's slots and exceptions into its block's stream with relaxed atomic ORs (per row of 8
values and section two on the 32-bit path, three on the 64-bit one, words that get no bits skipped: at most ~31M for
62.5M values), each a read-modify-write in the L2. Fewer instructions moved the encode kernel little (docs/delta.md,
session 26), so this times three builds of ``kernels/delta.py`` on the benchmark's AdamW step: production; the atomic
ORs replaced by plain stores to the same words (wrong streams: only the L2's atomic work removed); and no stream
writes at all (the packing and its atomics removed). Each variant is the module's source with those lines changed,
imported from a temporary file; all three code the same per-block fields (checked first; ``--check-only`` on the CPU
with TRITON_INTERPRET=1, ``tests/test_delta.py``). Device time of the encode kernel (PyTorch profiler, best of
``--repeats``), against a bf16 copy.

    python benchmarks/diag_delta_encode_atomics.py --out results/gpu/sessionN/delta_encode_atomics.json
"""

import argparse
import importlib.util
import json
import os
import re
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.delta_wire_ratio import simulated_step  # noqa: E402
from compression.timing import device_op_seconds  # noqa: E402

SOURCE = os.path.join(ROOT, "kernels", "delta.py")
ATOMIC = re.compile(r"tl\.atomic_or\(([^,]+), ([^,]+), mask=([^)]*?), sem=\"relaxed\"\)")


def variants() -> dict:
    """name -> source of kernels/delta.py: production, atomics as stores, no stream packing."""
    source = open(SOURCE).read()
    stores = ATOMIC.sub(r"tl.store(\1, \2, mask=\3)", source)
    if stores == source:
        raise RuntimeError(f"no relaxed atomic_or found in {SOURCE}: update this diagnostic's pattern")
    packing = re.compile(r"^(\s+)(_or_rows|_or_bits)\(", re.M)
    unpacked = packing.sub(r"\1pass  # \2(", source)
    # the calls span two lines: comment their continuation lines out as well
    unpacked = re.sub(r"(pass  # _or_rows\([^\n]*\n)(\s+)(\(row_both)", r"\1\2# \3", unpacked)
    return {"production": source, "stores": stores, "no_packing": unpacked}


def load(name: str, source: str, folder: str):
    path = os.path.join(folder, f"delta_{name}.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(f"delta_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # Triton reads the kernels' source from this file
    return module


def check(modules: dict, block_size: int) -> None:
    """Every variant codes the same per-block fields as production (codes, counts, escapes, widths, stream sizes),
    so the timings compare the same work but for the stream writes (CPU: run with TRITON_INTERPRET=1)."""
    previous, new = simulated_step(37 * block_size + 5, 1e-4, 3, device="cuda" if torch.cuda.is_available() else "cpu")
    results = {}
    for name, module in modules.items():
        prev = previous.view(torch.int16).clone()
        e = module.encode_blocks(prev, new.view(torch.int16), block_size)
        results[name] = (e.codes, e.counts, e.n_esc, e.exc_widths, e.nbytes)
        if not torch.equal(prev, new.view(torch.int16)):
            raise AssertionError(f"{name}: the sender copy was not updated")
    for name, fields in results.items():
        if not all(torch.equal(a, b) for a, b in zip(fields, results["production"])):
            raise AssertionError(f"{name} codes other per-block fields than production")
    print(f"variants agree on every per-block field: {', '.join(results)}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=62_500_000)
    p.add_argument("--steps", type=int, default=20, help="AdamW steps before the timed one (as bench_delta_kernels)")
    p.add_argument("--lrs", default="1e-4,1e-5")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out")
    p.add_argument("--check-only", action="store_true", help="only check the variants' per-block fields (CPU)")
    args = p.parse_args()
    if not args.check_only and not args.out:
        p.error("--out is required unless --check-only")
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        modules = {name: load(name, source, folder) for name, source in variants().items()}
        check(modules, args.block_size)
        if args.check_only:
            return
        for lr in map(float, args.lrs.split(",")):
            previous, new = simulated_step(args.numel, lr, args.steps, device="cuda")
            old_bits, new_bits = previous.view(torch.int16), new.view(torch.int16)
            prev = old_bits.clone()
            copy_out = torch.empty_like(new_bits)
            copy_us = 1e6 * sum(device_op_seconds(lambda: copy_out.copy_(new_bits), args.repeats).values())
            row = dict(lr=lr, numel=args.numel, copy_us=copy_us)
            for name, module in modules.items():
                out = module.empty_blocks(args.numel, args.block_size, prev.device)
                ops = device_op_seconds(lambda: module.encode_blocks(prev, new_bits, args.block_size, out=out),
                                        args.repeats, setup=lambda: prev.copy_(old_bits))
                row[f"{name}_us"] = 1e6 * sum(ops.values())
            rows.append(row)
            print(f"lr {lr:g}: copy {copy_us:.1f} us; encode kernel " + ", ".join(
                f"{name} {row[f'{name}_us']:.1f} us ({100 * copy_us / row[f'{name}_us']:.1f}% of copy)"
                for name in modules), flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(command=" ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
                       device=torch.cuda.get_device_name(0), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
