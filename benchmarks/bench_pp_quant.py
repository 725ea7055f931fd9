"""TahQuant pipeline-message codec: encode/decode time against a bf16 copy, wire ratio and SQNR (GPU).

    python -m benchmarks.bench_pp_quant --out pp_quant.json                # from the repository root
    python -m benchmarks.bench_pp_quant --dry-run --out /tmp/x.json        # CPU: logic only, tiny shapes

For each message shape [tokens, hidden] (tokens = seq x micro-batch) and codec setting: median ms of
``x.clone()`` (the bf16 copy megatron-core's own path costs at most), encode and decode with the
kernels (``kernels/tahquant.py``, the CUDA path) and with the torch reference (``*_reference_ms``),
both per call (``triton.testing.do_bench``: host included) and as device time of their kernels
(``*_device_us``, L2 flushed before each call: ``compression.timing.cold_device_seconds``), the wire ratio
vs bf16 and the SQNR in dB on activation-like data (heavy tails, 1% outlier channels, log-normal token
scales) and gradient-like data. The "plain" rows (no rotation, no 8-bit tokens) are the per-tile
baseline at the same bits. Both paths write the same bytes (checked here on every message).
"""

import argparse
import json
import math
import sys

import torch

from benchmarks.taco_codec_ablation import activation_like, gradient_like
from compression.pp_quant import TahQuantCodec, TahQuantConfig
from compression.timing import cold_device_seconds, device_op_seconds, kernel_ms
from kernels import tahquant as tahquant_kernels

SETTINGS = {  # name -> TahQuantConfig keywords
    "tahquant_b4_t64": dict(bits=4, tile_size=64, high_bit_fraction=0.125),
    "tahquant_b4_t128": dict(bits=4, tile_size=128, high_bit_fraction=0.125),
    "tahquant_b3_t64": dict(bits=3, tile_size=64, high_bit_fraction=0.125),
    "plain_b4_t64": dict(bits=4, tile_size=64, high_bit_fraction=0.0, rotate=False),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="TahQuant codec throughput and error")
    p.add_argument("--out", required=True, help="JSON results path")
    p.add_argument("--shapes", default="4096x4096,8192x4096,4096x8192", help="tokens x hidden, comma-separated")
    p.add_argument("--settings", nargs="+", choices=sorted(SETTINGS), default=list(SETTINGS))
    p.add_argument("--tile-values", type=int, default=None,
                   help="values per kernel program (kernels.tahquant.TILE_VALUES) for a launch sweep")
    p.add_argument("--num-warps", type=int, default=None, help="warps per kernel program (kernels.tahquant.NUM_WARPS)")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, wall-clock timing")
    return p.parse_args(argv)


def sqnr_db(x, y) -> float:
    x, y = x.double(), y.double()
    return 10 * math.log10(x.square().sum() / (x - y).square().sum())


def bench(tokens: int, hidden: int, name: str, device: str) -> dict:
    codec = TahQuantCodec(TahQuantConfig(**SETTINGS[name]), hidden)
    reference = TahQuantCodec(TahQuantConfig(**SETTINGS[name]), hidden, triton=False)
    row = dict(tokens=tokens, hidden=hidden, setting=name, **SETTINGS[name])
    for kind, make in (("activation", activation_like), ("gradient", gradient_like)):
        x = make(tokens=tokens, hidden=hidden).to(device, torch.bfloat16)
        wire = codec.encode(x)
        if not torch.equal(wire, reference.encode(x)):
            raise AssertionError(f"{name} {tokens}x{hidden}: the kernels' wire differs from the reference's")
        row[f"sqnr_db_{kind}"] = sqnr_db(x, codec.decode(wire, x.numel(), torch.bfloat16).view_as(x))
    row["ratio_vs_bf16"] = 2 * x.numel() / wire.numel()
    calls = dict(copy=lambda: x.clone(), encode=lambda: codec.encode(x),
                 decode=lambda: codec.decode(wire, x.numel(), torch.bfloat16),
                 encode_reference=lambda: reference.encode(x),
                 decode_reference=lambda: reference.decode(wire, x.numel(), torch.bfloat16))
    for call, fn in calls.items():
        row[f"{call}_ms"] = kernel_ms(fn, device)
        if device == "cuda":
            row[f"{call}_device_us"] = 1e6 * cold_device_seconds(fn, device)
            if not call.endswith("reference"):  # where the kernels' calls spend their device time
                row[f"{call}_ops_us"] = {op: 1e6 * t for op, t in device_op_seconds(fn, 5).items()}
    for call in ("encode", "decode"):
        row[f"{call}_vs_copy"] = row["copy_ms"] / row[f"{call}_ms"]  # fraction of copy speed: higher is faster
        if device == "cuda":
            row[f"{call}_device_vs_copy"] = row["copy_device_us"] / row[f"{call}_device_us"]
    return row


def main(argv=None):
    args = parse_args(argv)
    device = "cpu" if args.dry_run else "cuda"
    if args.tile_values:
        tahquant_kernels.TILE_VALUES = args.tile_values
    if args.num_warps:
        tahquant_kernels.NUM_WARPS = args.num_warps
    shapes = ["64x256"] if args.dry_run else args.shapes.split(",")
    rows = []
    print(f"{'tokens x hidden':>16} {'setting':>18} {'x bf16':>7} {'SQNR act':>9} {'SQNR grad':>9} "
          f"{'copy ms':>8} {'enc ms':>8} {'dec ms':>8} {'enc ref':>8} {'dec ref':>8} {'enc/copy':>8} {'dec/copy':>8}")
    for shape in shapes:
        tokens, hidden = (int(v) for v in shape.split("x"))
        for name in args.settings:
            r = bench(tokens, hidden, name, device)
            rows.append(r)
            print(f"{shape:>16} {name:>18} {r['ratio_vs_bf16']:>7.2f} {r['sqnr_db_activation']:>9.2f} "
                  f"{r['sqnr_db_gradient']:>9.2f} {r['copy_ms']:>8.3f} {r['encode_ms']:>8.3f} {r['decode_ms']:>8.3f} "
                  f"{r['encode_reference_ms']:>8.3f} {r['decode_reference_ms']:>8.3f} {r['encode_vs_copy']:>8.3f} "
                  f"{r['decode_vs_copy']:>8.3f}")
    env = dict(tile_values=tahquant_kernels.TILE_VALUES, num_warps=tahquant_kernels.NUM_WARPS, device=torch.cuda.get_device_name() if device == "cuda" else "cpu", torch=torch.__version__,
               command="python -m benchmarks.bench_pp_quant " + " ".join(sys.argv[1:] if argv is None else argv))
    if device == "cuda":
        import triton

        env["triton"] = triton.__version__
    with open(args.out, "w") as f:
        json.dump(dict(env=env, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
