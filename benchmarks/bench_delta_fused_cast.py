"""The delta encode fused into the distributed optimizer's fp32 -> bf16 parameter copy (``--delta-fused-cast``), timed
against the encode with a sender copy (issue 5).

In training the new values come from the optimizer, which rounds its fp32 master weights into the bf16 parameter
buffer (megatron-core's ``_copy_main_params_to_model_params``): until it does, the buffer holds exactly the previous
values the encode needs. So with ``--delta-fused-cast`` the encode kernel reads the fp32 master weights, rounds them
itself and writes them into the buffer (``kernels.encode_blocks(..., cast_to=)``, ``compression.codec.CastShard``):
it replaces that copy and needs no sender copy, 8 bytes per value for copy and encode together against 6 + 6.

Checked first: the fused path's payload equals the sender-copy path's byte for byte, and the buffer it leaves equals
torch's ``copy_`` of the master weights bit for bit, also on fp32 values that round to ties, subnormals, infinities and
NaNs. Device time (PyTorch profiler) of: a bf16 copy of the shard (the yardstick), the optimizer's cast
(``param.copy_(master)``), the encode with a sender copy and its kernel, and the fused encode (``encode`` of a
``CastShard``) and its kernel. The encode's cost is what it adds to the cast: ``encode``, and ``fused - cast``.
    python benchmarks/bench_delta_fused_cast.py --out delta_fused_cast.json
    TRITON_INTERPRET=1 python benchmarks/bench_delta_fused_cast.py --check-only   # CPU: the payload check only
"""

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import kernels.delta as kernels  # noqa: E402
from benchmarks.delta_wire_ratio import simulated_step  # noqa: E402
from compression.codec import CastShard  # noqa: E402
from compression.delta import DeltaCodec, DeltaConfig  # noqa: E402
from compression.timing import device_throughput  # noqa: E402

def fused_encode(codec: DeltaCodec, param: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
    """Payload of ``master`` (fp32) rounded to bf16 against ``param`` (bf16, the previous values every rank holds),
    which ends holding the rounded values: the codec's ``CastShard`` path, as ``--delta-fused-cast`` runs it."""
    return codec.encode(CastShard(param, master))


def synced_codec(block_size: int, param: torch.Tensor) -> DeltaCodec:
    """A codec whose receivers hold ``param`` (after its keyframe): its next ``CastShard`` encode is a delta."""
    codec = DeltaCodec(DeltaConfig(block_size), 2, 0)
    codec.encode(CastShard(param, param.float()))  # the values round back to themselves (no NaNs here)
    return codec


def special_values(device) -> torch.Tensor:
    """fp32 values whose rounding to bf16 is easy to get wrong: ties to even both ways, the largest finite values
    and those that round to infinity, fp32 and bf16 subnormals, signed zeros, infinities and NaN payloads."""
    bits = [0x3F808000, 0x3F818000, 0x3F80C000, 0x3F807FFF, 0xBF808000, 0xBF818000,  # ties and near-ties
            0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0xFF7FFFFF, 0x00000001, 0x80000001, 0x00008000, 0x00018000,
            0x007FFFFF, 0x00800000, 0x00000000, 0x80000000, 0x7F800000, 0xFF800000,
            0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FBFFFFF, 0x7FFFFFFF, 0xFFFFFFFF]
    signed = [b - (1 << 32) if b >= 1 << 31 else b for b in bits]
    return torch.tensor(signed, dtype=torch.int32).view(torch.float32).repeat(64).to(device)


def rounding_mismatches(block_size: int) -> list:
    """(fp32 bits, torch's bf16 bits, the fused kernel's) of every special value the two round differently."""
    x = special_values("cuda")
    param = torch.zeros(x.numel(), dtype=torch.bfloat16, device="cuda")
    kernels.encode_blocks(param.view(torch.int16), x, block_size, cast_to=torch.bfloat16)
    want, got = x.bfloat16().view(torch.int16), param.view(torch.int16)
    differ = (want != got).nonzero().squeeze(1)[: len(x) // 64]
    return [(hex(int(x.view(torch.int32)[i]) & 0xFFFFFFFF), hex(int(want[i]) & 0xFFFF), hex(int(got[i]) & 0xFFFF))
            for i in differ.tolist()]


def check(previous: torch.Tensor, master: torch.Tensor, block_size: int) -> None:
    """The fused path against the production path (torch's cast, then the encode against a sender copy)."""
    new = master.bfloat16()
    sender = DeltaCodec(DeltaConfig(block_size), 2, 0)
    sender.encode(previous)  # keyframe: the sender copy holds the previous values
    expected = sender.encode(new)
    param = previous.clone()
    got = fused_encode(synced_codec(block_size, param), param, master)
    if not torch.equal(param.view(torch.int16), new.view(torch.int16)):
        raise AssertionError("the fused kernel's rounding differs from torch's cast")
    if not torch.equal(got, expected):
        raise AssertionError("the fused payload differs from the production payload")


def measure(lr: float, args) -> dict:
    previous, master = simulated_step(args.numel, lr, args.steps, device="cuda", new_dtype=torch.float32)
    new = master.bfloat16()
    check(previous, master, args.block_size)
    b = args.block_size
    sender = DeltaCodec(DeltaConfig(b), 2, 0)
    sender.encode(previous)
    state = sender._prev.clone()
    param, out = previous.clone(), torch.empty_like(new)
    codec = synced_codec(b, param)

    def reset_sender():
        sender._prev.copy_(state)

    def reset_param():
        param.copy_(previous)

    calls = dict(
        copy=(lambda: out.copy_(new), None),
        cast=(lambda: param.copy_(master), reset_param),
        encode=(lambda: sender.encode(new), reset_sender),
        encode_kernel=(lambda: kernels.encode_blocks(sender._prev, new.view(torch.int16), b), reset_sender),
        fused=(lambda: fused_encode(codec, param, master), reset_param),
        fused_kernel=(lambda: kernels.encode_blocks(param.view(torch.int16), master, b, cast_to=torch.bfloat16),
                      reset_param),
    )
    nbytes = 2 * new.numel()
    row = dict(lr=lr, numel=args.numel, unchanged=float((new.view(torch.int16) == previous.view(torch.int16))
                                                         .float().mean()))
    row.update(device_throughput(nbytes, calls, repeats=args.repeats))
    us = {name: sum(row[f"{name}_ops_us"].values()) for name in calls}
    row["device_us"] = us
    added = dict(production=us["encode"], fused=us["fused"] - us["cast"],
                 production_kernel=us["encode_kernel"], fused_kernel=us["fused_kernel"] - us["cast"])
    row["encode_added_us"] = added
    row["encode_of_copy"] = {name: us["copy"] / t for name, t in added.items()}
    print(f"lr {lr:g} ({row['unchanged']:.1%} unchanged), device us: "
          + ", ".join(f"{name} {t:.1f}" for name, t in us.items()), flush=True)
    print("  encode's cost over the cast, as a fraction of a bf16 copy: "
          + ", ".join(f"{name} {x:.1%}" for name, x in row["encode_of_copy"].items()), flush=True)
    return row


def check_only() -> None:
    """CPU (TRITON_INTERPRET=1): payloads and buffers against production's on fp32 master weights that are bf16 values
    already, since the interpreter rounds fp32 to bf16 by truncation (the rounding is checked on CUDA only)."""
    for lr, numel in ((1e-4, 3001), (1e-5, 2048)):
        previous, master = simulated_step(numel, lr, 3, new_dtype=torch.float32)
        check(previous, master.bfloat16().float(), 256)
    print("fused payloads and buffers equal production's")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=62_500_000)
    p.add_argument("--lrs", default="1e-4,1e-5")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out")
    p.add_argument("--check-only", action="store_true", help="the payload check on the CPU (TRITON_INTERPRET=1)")
    args = p.parse_args()
    if args.check_only:
        return check_only()
    mismatches = rounding_mismatches(args.block_size)  # reported, not fatal: the timing holds either way
    print("special values rounded as torch does" if not mismatches else
          f"special values rounded differently from torch (fp32, torch, fused): {mismatches}", flush=True)
    check(*simulated_step(100_003, 1e-4, 3, device="cuda", new_dtype=torch.float32), args.block_size)
    print("fused payload and buffer equal production's (odd size)", flush=True)
    rows = [measure(float(lr), args) for lr in args.lrs.split(",")]
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(command="python " + " ".join(sys.argv), device=torch.cuda.get_device_name(0),
                           torch=torch.__version__, rounding_mismatches=mismatches, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
