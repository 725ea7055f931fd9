"""Delta codec throughput on one GPU: encode and decode of a steady-state AdamW step vs a bf16 copy.

The shard is ``--numel`` bf16 values (default 62.5M, as in bench_param_gather.py) following the
simulated AdamW trajectory of ``benchmarks/delta_wire_ratio.py`` run on the GPU; the timed step is
``--steps`` -> ``--steps + 1``. Encode restarts from the same sender state and decode from the same
previous values every repeat (untimed), and every decode is checked bit for bit. Times are wall
clock with a device sync on both sides (the codec's own host syncs included); GB/s are shard bytes
(2 per value) per second; ``*_device_GBps`` count only the device's time in the call's kernels and
copies (PyTorch profiler; ``*_ops_us`` lists them), without launch gaps and host syncs. ``--warps``
sweeps the warps per block program of the codec kernels, ``--max-registers`` their register caps (with each warps
setting), ``--gather`` the tiles of the record gather and its copy width and warps. ``--integrity on|off|compare``:
with the integrity hash (``--param-gather-integrity-check``, docs/integrity.md; the default), without, or both (each
configuration twice, off then on, then the ratio of their codec times: the encode's and decode's device time, and
wall clock).
``*_host_us``: the host's time in each half of a gather's codec work (begin_encode, finish_encode, decode)
with the device held busy, i.e. what every compressed bucket costs the host whatever its size.

    python benchmarks/bench_delta_kernels.py --out results/kernels/delta.json
    python benchmarks/bench_delta_kernels.py --integrity compare --out results/kernels/delta_integrity.json
"""

import argparse
import json
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import kernels.delta as kernels  # noqa: E402
from benchmarks.delta_wire_ratio import simulated_step  # noqa: E402
from compression.delta import DeltaCodec, DeltaConfig  # noqa: E402
from compression.timing import call_seconds, device_throughput, queued_call_seconds  # noqa: E402


def measure(previous, new, block_size: int, repeats: int, integrity: bool = True) -> dict:
    nbytes = 2 * new.numel()
    sender, receiver = (DeltaCodec(DeltaConfig(block_size), 2, rank, integrity=integrity) for rank in (0, 1))
    sender.encode(previous)  # keyframe: sender state = previous
    state = sender._prev.clone()
    out = torch.empty_like(new)
    result = {}

    def reset_sender():
        sender._prev.copy_(state)

    def encode():
        result["payload"] = sender.encode(new)

    cuda = torch.device("cuda")
    enc = call_seconds(encode, cuda, repeats, setup=reset_sender)
    payload = result["payload"]
    # room after it, as the gather's receive buffer leaves (ShardCodec.read_slack_bytes)
    payload = torch.cat([payload, payload.new_zeros(receiver.read_slack_bytes)])[:payload.numel()]
    header = receiver.read_header(payload)  # the gather delivers it on the host
    dec = call_seconds(lambda: receiver.decode(0, payload, out, header), cuda, repeats,
                       setup=lambda: out.copy_(previous))
    if not torch.equal(out.view(torch.int16), new.view(torch.int16)):
        raise AssertionError("decode is not bit-exact")
    if integrity:
        reset_sender()
        sent = sender.begin_encode(new).hash  # of the payload just decoded
        if not torch.equal(receiver.decoded_hashes[0:1], sent):
            raise AssertionError("the decoded integrity hash differs from the encoded one")
    blocks = call_seconds(lambda: kernels.encode_blocks(sender._prev, new.view(torch.int16), block_size), cuda,
                          repeats, setup=reset_sender)
    copy = call_seconds(lambda: out.copy_(new), cuda, repeats)
    gbps = lambda s: nbytes / min(s) / 1e9  # noqa: E731
    device_ops = device_throughput(nbytes, dict(
        encode=(encode, reset_sender),
        decode=(lambda: receiver.decode(0, payload, out, header), lambda: out.copy_(previous)),
        copy=(lambda: out.copy_(new), None)))
    return dict(encode_GBps=gbps(enc), decode_GBps=gbps(dec), copy_GBps=gbps(copy), **host_us(
                    sender, receiver, new, payload, out, header, reset_sender, lambda: out.copy_(previous), repeats),
                encode_blocks_GBps=gbps(blocks), encode_ms=1e3 * min(enc),
                encode_median_ms=1e3 * statistics.median(enc),
                decode_ms=1e3 * min(dec), decode_median_ms=1e3 * statistics.median(dec),
                encode_blocks_ms=1e3 * min(blocks), copy_ms=1e3 * min(copy), ratio=nbytes / payload.numel(),
                unchanged=float((new.view(torch.int16) == previous.view(torch.int16)).float().mean()),
                stats=sender.last_stats, **device_ops)


def host_us(sender, receiver, new, payload, out, header, reset_sender, reset_out, repeats: int) -> dict:
    """Host microseconds of each half of a gather's codec work, with the device held busy (``queued_call_seconds``)
    so no launch waits for it: what each compressed bucket costs the host, whatever its size."""
    cuda, best = torch.device("cuda"), {}

    def keep(name, call):
        _, host = queued_call_seconds(call, cuda, 0.01)
        best[name] = min(best.get(name, host), host)

    for _ in range(min(repeats, 5)):
        reset_sender()
        started = []
        keep("begin_encode_host_us", lambda: started.append(sender.begin_encode(new)))
        start = started[0]
        buffer = torch.empty(int(start.nbytes), dtype=torch.uint8, device=cuda)
        keep("finish_encode_host_us", lambda: sender.finish_encode(start, buffer))
        reset_out()
        keep("decode_host_us", lambda: receiver.decode(0, payload, out, header))
    return {name: 1e6 * seconds for name, seconds in best.items()}


def register_caps(text: str) -> list:
    """``--max-registers``: a comma list of ENCODE:DECODE register caps (0: the compiler's choice), each as
    {"encode": cap, "decode": cap}; a ValueError for a malformed pair (argparse names the flag)."""
    caps = []
    for pair in filter(None, text.split(",")):
        encode, decode = (int(c) or None for c in pair.split(":"))
        caps.append(dict(encode=encode, decode=decode))
    return caps


def use_register_caps(cap, defaults: dict) -> None:
    """``kernels.MAX_REGISTERS`` under ``cap`` (one of ``register_caps``) at every rows-per-thread setting, or back to
    ``defaults`` (None)."""
    kernels.MAX_REGISTERS.update({key: cap[key[0]] for key in defaults} if cap else defaults)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=62_500_000)
    p.add_argument("--lrs", default="1e-4,1e-5")
    p.add_argument("--steps", type=int, default=20, help="AdamW steps before the timed one")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--warps", default="", help="comma list of warps per block program to sweep (default: built-in)")
    p.add_argument("--max-registers", default="", type=register_caps,
                   help="comma list of encode:decode register caps to sweep, "
                   "e.g. 96:64,80:64 (0: the compiler's choice)")
    p.add_argument("--gather", default="", help="comma list of TILExCHUNKxWARPS of the record gather to sweep (TILE "
                   "blocks per program, a multiple of the wire format's group, kernels.delta.group_blocks; CHUNK "
                   "stream words per block and pass)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--integrity", default="on", choices=["on", "off", "compare"],
                   help="the integrity hash in the kernels: on (the default in training), off, or compare (both)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rows = []
    default_warps, default_caps = kernels._num_warps, dict(kernels.MAX_REGISTERS)
    default_tile, default_gather = kernels._tile_blocks, kernels._gather_launch
    gathers = [tuple(map(int, item.split("x"))) for item in args.gather.split(",") if item]
    # every warps setting with every register cap (the built-in ones first), then the gather's launches
    configs = ([(warps, cap, None) for warps in [None] + [int(w) for w in args.warps.split(",") if w]
                for cap in [None] + args.max_registers]
               + [(None, None, g) for g in gathers])
    integrity = {"on": [True], "off": [False], "compare": [False, True]}[args.integrity]
    configs = [(*config, check) for config in configs for check in integrity]
    for lr in (float(x) for x in args.lrs.split(",")):
        previous, new = simulated_step(args.numel, lr, args.steps, device="cuda")
        for warps, cap, gather, check in configs:
            kernels._num_warps = default_warps if warps is None else (lambda block_size, w=warps: w)
            use_register_caps(cap, default_caps)
            kernels._tile_blocks = default_tile if gather is None else (lambda block_size, t=gather[0]: t)
            kernels._gather_launch = default_gather if gather is None else (lambda block_size, g=gather: g[1:])
            row = dict(lr=lr, warps=warps or default_warps(args.block_size),
                       max_registers={k: kernels._max_registers(k, args.block_size) for k in ("encode", "decode")},
                       gather=list(gather or (default_tile(args.block_size), *default_gather(args.block_size))),
                       block_size=args.block_size, numel=args.numel, integrity=check,
                       **measure(previous, new, args.block_size, args.repeats, check))
            rows.append(row)
            print(f"lr {lr:g} warps {row['warps']} registers {row['max_registers']} gather {row['gather']}: "
                  f"encode {row['encode_GBps']:.0f} GB/s ({row['encode_ms']:.3f} ms; "
                  f"blocks kernel {row['encode_blocks_ms']:.3f} ms), decode {row['decode_GBps']:.0f} GB/s "
                  f"({row['decode_ms']:.3f} ms), copy {row['copy_GBps']:.0f} GB/s, ratio {row['ratio']:.2f}x; "
                  f"device time only: encode {row['encode_device_GBps']:.0f}, decode {row['decode_device_GBps']:.0f}, "
                  f"copy {row['copy_device_GBps']:.0f} GB/s; host us: begin_encode {row['begin_encode_host_us']:.0f}, "
                  f"finish_encode {row['finish_encode_host_us']:.0f}, decode {row['decode_host_us']:.0f}; "
                  f"integrity {'on' if check else 'off'}", flush=True)
            if args.integrity == "compare" and check:
                print_integrity_cost(rows[-2], row)
        kernels._num_warps, kernels._tile_blocks, kernels._gather_launch = default_warps, default_tile, default_gather
        use_register_caps(None, default_caps)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(command=" ".join(sys.argv), device=torch.cuda.get_device_name(0), torch=torch.__version__,
                       rows=rows), f, indent=1)
    print("\n| lr | warps | gather (tile x chunk x warps) | unchanged | ratio | encode GB/s | decode GB/s | copy GB/s | "
          "encode/copy | decode/copy | device: encode/copy, decode/copy | gather kernel us | decode kernel us |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        device = r["encode_device_GBps"] / r["copy_device_GBps"], r["decode_device_GBps"] / r["copy_device_GBps"]
        print(f"| {r['lr']:g} | {r['warps']} | {'x'.join(map(str, r['gather']))} | {r['unchanged']:.1%} | "
              f"{r['ratio']:.2f}x | {r['encode_GBps']:.0f} | {r['decode_GBps']:.0f} | {r['copy_GBps']:.0f} | "
              f"{r['encode_GBps'] / r['copy_GBps']:.0%} | {r['decode_GBps'] / r['copy_GBps']:.0%} | "
              f"{device[0]:.1%}, {device[1]:.1%} | {r['encode_ops_us'].get('_gather_kernel', 0):.1f} | "
              f"{r['decode_ops_us'].get('_decode_kernel', 0):.1f} |")


def codec_device_us(row: dict) -> float:
    """A gather's codec time on the device: every kernel and copy of its encode and decode."""
    return sum(row["encode_ops_us"].values()) + sum(row["decode_ops_us"].values())


def print_integrity_cost(off: dict, on: dict) -> None:
    """The integrity check's cost: codec time with it over codec time without (device time, and wall clock)."""
    device = codec_device_us(on) / codec_device_us(off)
    wall = (on["encode_ms"] + on["decode_ms"]) / (off["encode_ms"] + off["decode_ms"])
    on["integrity_cost"] = dict(device_ratio=device, wall_ratio=wall)
    def kernel_us(row, half, kernel):
        return row[f"{half}_ops_us"].get(kernel, 0.0)

    print(f"integrity check cost at lr {on['lr']:g}, B = {on['block_size']}: codec device time "
          f"{codec_device_us(off):.1f} -> {codec_device_us(on):.1f} us (ratio {device:.4f}, goal <= 1.03); "
          f"encode + decode wall clock {off['encode_ms'] + off['decode_ms']:.3f} -> "
          f"{on['encode_ms'] + on['decode_ms']:.3f} ms (ratio {wall:.4f}); encode kernel "
          f"{kernel_us(off, 'encode', '_encode_kernel'):.1f} -> {kernel_us(on, 'encode', '_encode_kernel'):.1f} us, "
          f"decode kernel {kernel_us(off, 'decode', '_decode_kernel'):.1f} -> "
          f"{kernel_us(on, 'decode', '_decode_kernel'):.1f} us", flush=True)


if __name__ == "__main__":
    main()
