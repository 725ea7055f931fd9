"""Device time of the TACO collectives' fused kernel steps on one GPU, against a bf16 copy (GPU).

The compressed collectives (compression/tp_collectives.py) run three fused steps besides the plain encode and
decode: the one-shot all-reduce's ``decode_sum`` (the world's wires decoded and summed), the two-shot all-reduce's
``reduce_encode`` (own row + the received rows, re-encoded) and the reduce-scatter's ``reduce_decode`` (own row +
the received rows, decoded). Each is timed here on its own (PyTorch profiler, L2 flushed before each call) for
``--worlds`` ranks' worth of received rows, on a bf16 tensor of ``--mib`` MiB, after checking its bytes or values
against the reference on the same device. "vs copy" = bytes read + written per second over a bf16 copy's.

    python benchmarks/bench_taco_fused_steps.py --out taco_fused_steps.json
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.taco_codec_ablation import activation_like  # noqa: E402
from compression.timing import cold_device_seconds  # noqa: E402
from kernels import taco as K  # noqa: E402


def _same(a, b) -> bool:
    nan = a.isnan() if a.is_floating_point() else torch.zeros_like(a, dtype=torch.bool)
    return torch.equal(nan, b.isnan() if b.is_floating_point() else nan) and torch.equal(
        a[~nan].view(torch.uint8), b[~nan].view(torch.uint8))


def steps(x, world, block_size, fmt, transform):
    """{name: (fused call, reference call, bytes read + written)} for one rank (rank 1) of ``world``."""
    numel, rank = x.numel(), 1
    row = numel // world
    others = [x.roll(j * 4099) * (1.0 - 0.1 * j) for j in range(world)]
    row_wire = K.wire_nbytes(row, block_size)
    recv = torch.cat([K.taco_encode_reference(o, block_size, fmt, transform, "dual", world).view(world, -1)[rank]
                      for o in others])
    wires = torch.cat([K.taco_encode_reference(o, block_size, fmt, transform, "dual") for o in others])
    codec = (block_size, fmt, transform)
    return {
        "decode_sum": (lambda: K.taco_decode_sum_triton(wires, world, numel, x.dtype, *codec),
                       lambda: K.taco_decode_sum_reference(wires, world, numel, x.dtype, *codec),
                       wires.numel() + 2 * numel),
        "reduce_encode": (lambda: K.taco_reduce_encode_triton(x, recv, rank, world, *codec, "dual"),
                          lambda: K.taco_reduce_encode_reference(x, recv, rank, world, *codec, "dual"),
                          2 * row + world * row_wire),
        "reduce_decode": (lambda: K.taco_reduce_decode_triton(x, recv, rank, world, *codec),
                          lambda: K.taco_reduce_decode_reference(x, recv, rank, world, *codec),
                          4 * row + (world - 1) * row_wire),
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--mib", type=float, default=64)
    p.add_argument("--worlds", default="2,4,8")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--format", default="int8")
    p.add_argument("--transform", default="ash")
    args = p.parse_args(argv)
    numel = int(args.mib * 2**20) // 2 // 8192 * 8192  # divisible by every world and block size
    x = (activation_like(tokens=numel // 4096, hidden=4096).reshape(-1)[:numel]).to(torch.bfloat16).cuda()
    copy_us = 1e6 * cold_device_seconds(lambda: x.clone(), x.device)
    rows, problems = [], []
    for world in (int(w) for w in args.worlds.split(",")):
        for name, (fused, reference, nbytes) in steps(x, world, args.block_size, args.format, args.transform).items():
            if not _same(fused(), reference()):
                problems.append(f"{name} world {world}")
            us = 1e6 * cold_device_seconds(fused, x.device)
            vs_copy = nbytes / us / (4 * numel / copy_us)
            rows.append(dict(step=name, world=world, device_us=us, bytes=nbytes, vs_copy=vs_copy))
            print(f"{name:>14} world {world}: {us:8.1f} us, {vs_copy:.2f}x of copy bandwidth", flush=True)
    result = dict(mib=args.mib, numel=numel, format=args.format, block_size=args.block_size, copy_device_us=copy_us,
                  device=torch.cuda.get_device_name(), torch=torch.__version__, triton=K.triton.__version__,
                  rows=rows, problems=problems)
    print(f"copy {copy_us:.1f} us; problems: {problems or 'none'}")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    if problems:
        sys.exit(f"fused steps disagree with the reference: {problems}")


if __name__ == "__main__":
    main()
