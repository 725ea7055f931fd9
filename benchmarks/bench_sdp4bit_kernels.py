"""SDP4Bit codecs on one GPU: the fused Triton kernels against the PyTorch reference and a bf16 copy.

Weight differences (qWD, the param all-gather): a shard of ``--numel`` bf16 values moving by one step of the
simulated AdamW trajectory of ``benchmarks/delta_wire_ratio.py`` (lr ``--lr``); encode = the owner's payload and
new reconstruction from its new values, decode = one received payload applied to a receiver's values. Gradients
(the Hadamard reduce-scatter): a bucket of ``--numel`` values (``--grad-dtype``) over ``--world`` ranks; encode =
every rank's wire row, decode = this rank's shard from the other ranks' rows plus its own. Each call restarts
from the same state (untimed). ``*_device_GBps``: the data's 16-bit (qWD) or gradient bytes over the device
time of the call's kernels and copies (PyTorch profiler, no launch gaps); ``*_wall_GBps``: over the wall clock
with a device sync on both sides. The fused kernels' payloads and results are compared bit for bit with the
reference's run on the CPU (on CUDA torch divides by a Python scalar as a product with its reciprocal, which rounds
differently). ``--launches`` times the fused kernels again at other program sizes.

    python benchmarks/bench_sdp4bit_kernels.py --out sdp4bit_w4_g8bf16.json
"""

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import kernels.sdp4bit as kernels  # noqa: E402
from benchmarks.delta_wire_ratio import simulated_step  # noqa: E402
from compression.sdp4bit import (  # noqa: E402
    HadamardQuantConfig, Sdp4bitConfig, WeightDiffCodec, decode_sum, encode_rows,
)
from compression.timing import call_seconds, device_throughput  # noqa: E402

CUDA = torch.device("cuda")


def _rates(nbytes: int, calls: dict, repeats: int) -> dict:
    """Device and wall GB/s of each ``name: (fn, setup)``."""
    out = device_throughput(nbytes, calls, repeats)
    for name, (fn, setup) in calls.items():
        out[f"{name}_wall_GBps"] = nbytes / min(call_seconds(fn, CUDA, repeats, setup=setup)) / 1e9
    return out


def weight_diffs(args, paths=("reference", "fused")) -> dict:
    previous, new = simulated_step(args.numel, args.lr, args.steps, device="cuda")
    config = Sdp4bitConfig(args.group_size, args.weight_bits)
    codecs = {path: WeightDiffCodec(config, 2, 0, triton=path == "fused") for path in paths}
    # the oracle: the reference on the CPU (torch's CUDA division by a scalar multiplies by its reciprocal)
    cpu = WeightDiffCodec(config, 2, 0, triton=False)
    cpu.encode(previous.cpu())
    want = cpu.encode(new.cpu())
    payloads = {}
    for path, codec in codecs.items():
        codec.encode(previous.clone())  # keyframe: the reconstruction is ``previous``
        payloads[path] = codec.encode(new)
    payload, received = payloads["fused"], previous.clone()
    WeightDiffCodec(config, 2, 1).decode(0, payload, received)
    equal = dict(payload_equal=torch.equal(payload.cpu(), want),
                 result_equal=torch.equal(received.cpu().view(torch.int16), cpu._reconstructed.view(torch.int16)))
    out = torch.empty_like(previous)
    calls = {}
    for path, codec in codecs.items():
        def restore(codec=codec):
            codec.reset()
            codec.encode(previous)  # untimed keyframe: the reconstruction is ``previous`` again
        receiver = WeightDiffCodec(config, 2, 1, triton=path == "fused")
        calls[f"{path}_encode"] = (lambda codec=codec: codec.encode(new), restore)
        calls[f"{path}_decode"] = (lambda receiver=receiver, payload=payloads[path]: receiver.decode(0, payload, out),
                                   lambda: out.copy_(previous))
    calls["copy"] = (lambda: out.copy_(new), None)
    return dict(numel=args.numel, lr=args.lr, group_size=args.group_size, weight_bits=args.weight_bits,
                ratio=2 * args.numel / payload.numel(), **equal, **_rates(2 * args.numel, calls, args.repeats))


def gradients(args, paths=("reference", "fused")) -> dict:
    dtype = getattr(torch, args.grad_dtype)
    g = torch.Generator(device="cuda").manual_seed(0)
    full = (torch.randn(args.numel, device="cuda", generator=g) * 1e-3).to(dtype)
    world, rank = args.world, 0
    rows = full.view(world, -1)
    config = HadamardQuantConfig(args.grad_bits, args.grad_block_size)
    b, bits = config.block_size, config.bits
    # the oracle: the reference on the CPU
    wire = encode_rows(rows.cpu(), config)
    want = (decode_sum(wire, rank, rows.shape[1], config) + rows[rank].float().cpu()).to(dtype)
    wire = wire.cuda()
    fused_wire = torch.empty_like(wire)
    kernels.rotate_quantize_rows(rows, fused_wire, b, bits)
    shard = torch.empty_like(rows[rank])
    kernels.dequantize_sum_rows(wire, rank, rows[rank], shard, b, bits, False)
    equal = dict(wire_equal=torch.equal(fused_wire, wire),
                 result_equal=torch.equal(shard.cpu().view(torch.uint8), want.view(torch.uint8)))

    def reference_decode():
        shard.copy_(decode_sum(wire, rank, rows.shape[1], config) + rows[rank].float())

    calls = dict(
        reference_encode=(lambda: encode_rows(rows, config), None),
        fused_encode=(lambda: kernels.rotate_quantize_rows(rows, fused_wire, b, bits), None),
        reference_decode=(reference_decode, None),
        fused_decode=(lambda: kernels.dequantize_sum_rows(wire, rank, rows[rank], shard, b, bits, False), None),
        copy=(lambda: shard.copy_(rows[rank]), None))
    calls = {name: call for name, call in calls.items() if name == "copy" or name.split("_")[0] in paths}
    nbytes = full.numel() * full.element_size()
    rates = _rates(nbytes, {k: v for k, v in calls.items() if k.endswith("encode")}, args.repeats)
    # a decode reads W - 1 wire rows and writes one shard: its rate is per shard byte, as the copy's
    rates.update(_rates(nbytes // world, {k: v for k, v in calls.items() if not k.endswith("encode")}, args.repeats))
    return dict(numel=args.numel, grad_dtype=args.grad_dtype, world=world, bits=bits, block_size=b,
                ratio=nbytes / wire.numel(), **equal, **rates)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=62_500_000)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--steps", type=int, default=20, help="AdamW steps before the timed one")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--weight-bits", type=int, default=4, choices=[4, 8])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--grad-bits", type=int, default=8, choices=[4, 8])
    p.add_argument("--grad-block-size", type=int, default=128)
    p.add_argument("--grad-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--launches", default="", help="comma list of VALUESxWARPS (values and warps per program) to "
                   "time the fused kernels with (all four), after the default launches (kernels.sdp4bit.LAUNCH)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    results = dict(command=" ".join(sys.argv), device=torch.cuda.get_device_name(), torch=torch.__version__,
                   launch=" ".join(f"{part} {values}x{warps}" for part, (values, warps) in kernels.LAUNCH.items()),
                   weight_diffs=weight_diffs(args), gradients=gradients(args), launches=[])
    report(results, ("reference", "fused"))
    for launch in filter(None, args.launches.split(",")):
        kernels.LAUNCH = dict.fromkeys(kernels.LAUNCH, tuple(map(int, launch.split("x"))))
        results["launches"].append(dict(launch=launch, weight_diffs=weight_diffs(args, ("fused",)),
                                        gradients=gradients(args, ("fused",))))
        report(results["launches"][-1], ("fused",))
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


def report(results: dict, paths) -> None:
    for part in ("weight_diffs", "gradients"):
        r = results[part]
        copy = r["copy_device_GBps"]
        print(f"{results.get('launch', '')} {part}: ratio {r['ratio']:.2f}x, bits equal to the CPU reference "
              f"{[v for k, v in r.items() if k.endswith('_equal')]}; device GB/s (share of a copy's {copy:.0f}): "
              + ", ".join(f"{name} {r[f'{name}_device_GBps']:.0f} ({r[f'{name}_device_GBps'] / copy:.1%}; wall "
                          f"{r[f'{name}_wall_GBps']:.0f})"
                          for name in (f"{p}_{op}" for p in paths for op in ("encode", "decode"))), flush=True)


if __name__ == "__main__":
    main()
