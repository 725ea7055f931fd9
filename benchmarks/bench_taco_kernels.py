"""Throughput of the fused TACO encode/decode kernels against a bf16 copy of the same tensor (GPU).

    python -m benchmarks.bench_taco_kernels --out taco_kernels.json        # from the repository root
    python -m benchmarks.bench_taco_kernels --dry-run --out /tmp/x.json    # CPU: logic only

For each size: checks the fused kernels against the torch reference on the same device (wire
bytes and decoded values bit-identical), then times with triton.testing.do_bench (median ms):
``x.clone()`` (bf16 copy), fused encode, fused decode and, up to --reference-max-mib, the unfused
torch reference. Bandwidth counts bytes read plus written; "vs copy" = codec bandwidth / copy
bandwidth (goal >= 0.70 from 16 MiB). do_bench times each call between events, so a call whose host
launch (~50 us for the encode's many arguments) outlasts its kernel is timed by its launch; the
"device" columns time the kernels alone (PyTorch profiler, L2 flushed before each call), which is
what the kernel goal is about and what a CUDA-graph replay (--tp-comm-cuda-graphs) pays. Exits non-zero if a
check fails.
"""

import argparse
import dataclasses
import json
import sys

import torch

from benchmarks.taco_codec_ablation import activation_like
from compression.taco import TacoCodec, TacoConfig
from compression.timing import cold_device_seconds, kernel_ms, queued_seconds
from kernels import taco as K

GOAL_FRACTION, GOAL_FROM_MIB = 0.70, 16


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="TACO kernel throughput vs a bf16 copy")
    p.add_argument("--out", required=True, help="JSON results path")
    p.add_argument("--sizes-mib", default="1,4,16,64,256", help="bf16 input sizes in MiB")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--format", default="e4m3")
    p.add_argument("--transform", default="ash")
    p.add_argument("--scaling", default="dual")
    p.add_argument("--reference-max-mib", type=float, default=64, help="time the torch reference up to this size")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, torch reference path, wall-clock timing")
    return p.parse_args(argv)


def _input(numel, device):
    hidden = 4096
    x = activation_like(tokens=1, hidden=hidden).to(device)  # a template row, tiled below
    x = x.repeat(-(-numel // hidden), 1).reshape(-1)[:numel]
    x = x * torch.linspace(0.5, 2.0, numel, device=device)  # vary the blocks
    x[: min(numel, 512)] = 0
    return x.to(torch.bfloat16).contiguous()


def verify(codec, x) -> list:
    """Fused vs reference on the same device: wire bytes and decoded values must be identical."""
    c = codec.config
    args = (c.block_size, c.format, c.transform)
    fused_wire = codec.encode(x)
    reference_wire = K.taco_encode_reference(x, *args, c.scaling)
    problems = []
    if not torch.equal(fused_wire, reference_wire):
        problems.append("wire bytes differ")
    fused = codec.decode(fused_wire, x.numel(), torch.float32)
    reference = K.taco_decode_reference(reference_wire, x.numel(), torch.float32, *args)
    same_nan = torch.equal(fused.isnan(), reference.isnan())
    if not same_nan or not torch.equal(fused.nan_to_num(0.0).view(torch.int32), reference.nan_to_num(0.0).view(torch.int32)):
        problems.append("decoded values differ")
    return problems


def bench_size(codec, mib, device, reference_max_mib):
    numel = int(mib * 2**20) // 2
    x = _input(numel, device)
    wire = codec.encode(x)
    problems = verify(codec, x)
    c = codec.config
    in_bytes, wire_bytes = numel * 2, wire.numel()
    copy_ms = kernel_ms(lambda: x.clone(), device)
    encode_ms = kernel_ms(lambda: codec.encode(x), device)
    decode_ms = kernel_ms(lambda: codec.decode(wire, numel, torch.bfloat16), device)
    row = dict(mib=mib, numel=numel, wire_bytes=wire_bytes, ratio_vs_bf16=in_bytes / wire_bytes,
               copy_ms=copy_ms, encode_ms=encode_ms, decode_ms=decode_ms, problems=problems,
               copy_gbps=2 * in_bytes / copy_ms / 1e6,
               encode_gbps=(in_bytes + wire_bytes) / encode_ms / 1e6,
               decode_gbps=(in_bytes + wire_bytes) / decode_ms / 1e6)
    for name, fn in (("copy", lambda: x.clone()), ("encode", lambda: codec.encode(x)),
                     ("decode", lambda: codec.decode(wire, numel, torch.bfloat16))):
        row[f"{name}_host_us"] = queued_seconds(fn, torch.device(device), 50)[1] * 1e6  # host cost per call
    row["encode_vs_copy"] = row["encode_gbps"] / row["copy_gbps"]
    row["decode_vs_copy"] = row["decode_gbps"] / row["copy_gbps"]
    if torch.device(device).type == "cuda":
        row.update(device_ratios(codec, x, wire))
    if mib <= reference_max_mib:
        args = (c.block_size, c.format, c.transform)
        row["reference_encode_ms"] = kernel_ms(lambda: K.taco_encode_reference(x, *args, c.scaling), device)
        row["reference_decode_ms"] = kernel_ms(lambda: K.taco_decode_reference(wire, numel, torch.bfloat16, *args), device)
    return row


def device_ratios(codec, x, wire) -> dict:
    """Device time (profiler, L2 flushed before each call) of a copy, the encode and the decode of ``x``, and
    the codec's traffic per second against the copy's."""
    in_bytes, row = 2 * x.numel(), {}
    for name, fn in (("copy", lambda: x.clone()), ("encode", lambda: codec.encode(x)),
                     ("decode", lambda: codec.decode(wire, x.numel(), torch.bfloat16))):
        row[f"{name}_device_ms"] = 1e3 * cold_device_seconds(fn, x.device)
    for name in ("encode", "decode"):
        row[f"{name}_vs_copy_device"] = ((in_bytes + wire.numel()) / row[f"{name}_device_ms"]
                                         / (2 * in_bytes / row["copy_device_ms"]))
    return row


def _print_table(rows):
    print(f"{'MiB':>6} {'copy GB/s':>10} {'enc GB/s':>9} {'enc/copy':>8} {'dec GB/s':>9} {'dec/copy':>8} "
          f"{'ref enc ms':>10} {'fused enc ms':>12} {'host us copy/enc/dec':>21} {'enc/dec vs copy, device':>24} "
          f"{'check':>6}")
    for r in rows:
        ref = f"{r['reference_encode_ms']:.3f}" if "reference_encode_ms" in r else "-"
        device = (f"{r['encode_vs_copy_device']:.2f}/{r['decode_vs_copy_device']:.2f}"
                  if "encode_vs_copy_device" in r else "-")
        print(f"{r['mib']:>6g} {r['copy_gbps']:>10.0f} {r['encode_gbps']:>9.0f} {r['encode_vs_copy']:>8.2f} "
              f"{r['decode_gbps']:>9.0f} {r['decode_vs_copy']:>8.2f} {ref:>10} {r['encode_ms']:>12.3f} "
              f"{r['copy_host_us']:>7.0f}/{r['encode_host_us']:.0f}/{r['decode_host_us']:.0f} "
              f"{device:>24} {'ok' if not r['problems'] else 'FAIL':>6}")


def main(argv=None):
    args = parse_args(argv)
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_taco_kernels needs CUDA (or --dry-run)")
    sizes = [1 / 64, 1 / 16] if args.dry_run else [float(s) for s in args.sizes_mib.split(",")]
    codec = TacoCodec(TacoConfig(args.block_size, args.format, args.transform, args.scaling))
    rows = [bench_size(codec, mib, device, args.reference_max_mib) for mib in sizes]
    _print_table(rows)
    goal = [r for r in rows if r["mib"] >= GOAL_FROM_MIB]
    met = all(min(r["encode_vs_copy"], r["decode_vs_copy"]) >= GOAL_FRACTION for r in goal) if goal else None
    met_device = (all(min(r["encode_vs_copy_device"], r["decode_vs_copy_device"]) >= GOAL_FRACTION for r in goal)
                  if goal and "encode_vs_copy_device" in goal[0] else None)
    print(f"goal: encode and decode >= {GOAL_FRACTION:.0%} of copy bandwidth from {GOAL_FROM_MIB} MiB: {met} "
          f"(per call), {met_device} (device time)")
    result = dict(config=dataclasses.asdict(codec.config), device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                  torch=torch.__version__, triton=getattr(K.triton, "__version__", None), dry_run=args.dry_run,
                  goal_met=met, goal_met_device=met_device, rows=rows)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    failed = [r["mib"] for r in rows if r["problems"]]
    if failed:
        sys.exit(f"fused kernels disagree with the reference at {failed} MiB")
    return result


if __name__ == "__main__":
    main()
