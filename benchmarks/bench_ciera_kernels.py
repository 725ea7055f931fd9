"""CIERA codec throughput on one GPU: encode and decode vs a bf16 copy of the same shard.

The shard is ``--numel`` bf16 values (default 62.5M, as in bench_param_gather.py). Cases: a keyframe
(every block changed) and, per ``--lrs``, a steady AdamW step ``--steps`` -> ``--steps + 1`` of the
simulated trajectory of benchmarks/delta_wire_ratio.py, so that the changed-block fraction is
realistic. Encode restarts from the same sender state and decode from the same previous values every
repeat (untimed), and every decode is checked bit for bit. Times are wall clock with a device sync on
both sides (the codec's own host sync included); GB/s are shard bytes (2 per value) per second. On
CUDA, ``*_device_GBps`` count only the device's time in the call's kernels and copies (PyTorch
profiler; ``*_ops_us`` lists them), i.e. without launch gaps and host syncs: the kernels' own speed.
``--tiles`` and ``--warps`` sweep the values per program and warps per program of the fused kernels.
``--dry-run`` checks the script on the CPU (plain-PyTorch path, small shard).

    python benchmarks/bench_ciera_kernels.py --out ciera_compare.json
"""

import argparse
import itertools
import json
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import kernels.ciera as kernels  # noqa: E402
from benchmarks.delta_wire_ratio import simulated_step  # noqa: E402
from compression.ciera import CieraCodec, CieraConfig  # noqa: E402
from compression.timing import call_seconds, device_throughput  # noqa: E402


def measure(previous, new, keyframe: bool, config: CieraConfig, repeats: int) -> dict:
    """Encode of ``new`` (after ``previous``, or as a keyframe) and its decode over ``previous``."""
    device = new.device
    sender, receiver = CieraCodec(config, 2, 0), CieraCodec(config, 2, 1)
    out = previous.clone()
    receiver.decode(0, sender.encode(previous), out)  # both sides now hold ``previous``
    state = None if keyframe else sender._prev.clone()
    result = {}

    def restore_sender():
        if keyframe:
            sender.reset()
        else:
            sender._prev.copy_(state)

    def encode():
        result["payload"] = sender.encode(new)

    def check_decode():
        if not torch.equal(out.view(torch.int16), new.view(torch.int16)):
            raise AssertionError("CIERA decode is not bit-exact")

    enc = call_seconds(encode, device, repeats, setup=restore_sender)
    payload = result["payload"].clone()  # the codec's buffer is reused by the next encode
    header = receiver.read_header(payload)  # the gather delivers it on the host
    dec = call_seconds(lambda: receiver.decode(0, payload, out, header), device, repeats,
                       setup=lambda: out.copy_(previous), check=check_decode)
    copy = call_seconds(lambda: out.copy_(new), device, repeats)
    nbytes = 2 * new.numel()
    gbps = lambda s: nbytes / min(s) / 1e9  # noqa: E731
    stats = sender.last_stats
    device_ops = {}
    if device.type == "cuda":
        device_ops = device_throughput(nbytes, dict(
            encode=(encode, restore_sender),
            decode=(lambda: receiver.decode(0, payload, out, header), lambda: out.copy_(previous)),
            copy=(lambda: out.copy_(new), None)))
    return dict(encode_GBps=gbps(enc), decode_GBps=gbps(dec), copy_GBps=gbps(copy), **device_ops,
                encode_ms=1e3 * min(enc), encode_median_ms=1e3 * statistics.median(enc),
                decode_ms=1e3 * min(dec), decode_median_ms=1e3 * statistics.median(dec), copy_ms=1e3 * min(copy),
                ratio=nbytes / payload.numel(), payload_bytes=payload.numel(),
                changed_fraction=stats["blocks_changed"] / stats["blocks_total"], stats=stats)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=62_500_000)
    p.add_argument("--lrs", default="1e-4,1e-5")
    p.add_argument("--steps", type=int, default=20, help="AdamW steps before the timed one")
    p.add_argument("--block-size", type=int, default=512)
    p.add_argument("--change-detect", default="compare", choices=("compare", "hash"))
    p.add_argument("--exponent-coder", default="raw", choices=("raw", "ans"))
    p.add_argument("--tiles", default="", help="comma list of values per program to sweep (default: built-in)")
    p.add_argument("--warps", default="", help="comma list of warps per program to sweep (default: built-in)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--dry-run", action="store_true", help="CPU check: plain-PyTorch path, 50k values, 3 steps")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.dry_run:
        args.numel, args.steps, args.repeats = 50_000, 3, 2
    elif not torch.cuda.is_available():
        p.error("needs a CUDA device (or --dry-run)")
    return args


def int_list(text: str, default: int) -> list:
    return [int(x) for x in text.split(",") if x] or [default]


def print_table(rows: list) -> None:
    print("\n| case | tile | warps | changed blocks | ratio | encode GB/s | decode GB/s | copy GB/s | "
          "encode/copy | decode/copy |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['tile']} | {r['warps']} | {r['changed_fraction']:.1%} | {r['ratio']:.3f}x | "
              f"{r['encode_GBps']:.0f} | {r['decode_GBps']:.0f} | {r['copy_GBps']:.0f} | "
              f"{r['encode_GBps'] / r['copy_GBps']:.0%} | {r['decode_GBps'] / r['copy_GBps']:.0%} |")
    device_rows = [r for r in rows if "copy_device_GBps" in r]
    if device_rows:
        print("\nDevice time only (kernels and copies of one call, no launch gaps or host syncs):")
        print("| case | encode GB/s | decode GB/s | copy GB/s | encode/copy | decode/copy |")
        print("|---|---|---|---|---|---|")
        for r in device_rows:
            print(f"| {r['case']} | {r['encode_device_GBps']:.0f} | {r['decode_device_GBps']:.0f} | "
                  f"{r['copy_device_GBps']:.0f} | {r['encode_device_GBps'] / r['copy_device_GBps']:.0%} | "
                  f"{r['decode_device_GBps'] / r['copy_device_GBps']:.0%} |")


def main():
    args = parse_args()
    device = torch.device("cpu" if args.dry_run else "cuda")
    config = CieraConfig(args.block_size, args.change_detect, args.exponent_coder)
    lrs = [float(x) for x in args.lrs.split(",")]
    cases = [("keyframe", *simulated_step(args.numel, lrs[0], args.steps, device), True)]
    cases += [(f"lr {lr:g}", *simulated_step(args.numel, lr, args.steps, device), False) for lr in lrs]
    default_tile, default_warps = kernels.TILE_VALUES, kernels.NUM_WARPS
    rows = []
    for (name, previous, new, keyframe), tile, warps in itertools.product(
            cases, int_list(args.tiles, default_tile), int_list(args.warps, default_warps)):
        kernels.TILE_VALUES, kernels.NUM_WARPS = tile, warps
        row = dict(case=name, tile=tile, warps=warps, block_size=args.block_size, numel=args.numel,
                   change_detect=args.change_detect, exponent_coder=args.exponent_coder,
                   **measure(previous, new, keyframe, config, args.repeats))
        rows.append(row)
        print(f"{name} tile {tile} warps {warps}: encode {row['encode_GBps']:.0f} GB/s ({row['encode_ms']:.3f} ms), "
              f"decode {row['decode_GBps']:.0f} GB/s ({row['decode_ms']:.3f} ms), copy {row['copy_GBps']:.0f} GB/s, "
              f"ratio {row['ratio']:.3f}x, changed blocks {row['changed_fraction']:.1%}", flush=True)
    kernels.TILE_VALUES, kernels.NUM_WARPS = default_tile, default_warps
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(command=" ".join(sys.argv), device=torch.cuda.get_device_name(0) if device.type == "cuda"
                       else "cpu", torch=torch.__version__, triton=getattr(kernels.triton, "__version__", None),
                       rows=rows), f, indent=1)
    print_table(rows)


if __name__ == "__main__":
    main()
