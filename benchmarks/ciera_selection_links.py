"""What CIERA's benefit selection (``--param-gather-selection benefit``) decides at each link class, now that it
charges the receivers' merge (the paper's T_decmp), with that merge measured on this device.

Inputs, each measured: the all-gather time per rank byte of each link class, a line fitted (``fit_comm_model``, as the
hook's ``profile_comm`` fits its own timings) to the rows of each link class in
``results/collectives/nccl_transports.json`` (two H200s, ``all_gather_wire``); the block change rate of the benchmark's
simulated AdamW trajectory at each ``--lrs`` (``BlockChangeMeter`` over ``--steps`` consecutive steps, as the warm-up
gathers measure it); and the seconds per byte of CIERA's decode of a payload whose blocks all changed, on this device
(``measure_merge_seconds_per_byte``, the hook's probe, at the hook's probe size). For ``--buckets`` shards of
``--numel`` values at DP = 2 it prints, per link and lr, the gain per gather with and without the merge term (both pay
the payload sizes' all-gather), and how many shards each would select.

    python benchmarks/ciera_selection_links.py --out ciera_selection_links.json
"""

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.delta_wire_ratio import simulated_adamw  # noqa: E402
from compression.ciera import CieraConfig  # noqa: E402
from compression.selection import (MERGE_PROBE_NUMEL, SIZE_EXCHANGE_BYTES, BlockChangeMeter, ShardStats,  # noqa: E402
                                   cache_bytes, expected_payload_bytes, fit_comm_model, gain_seconds,
                                   measure_merge_seconds_per_byte, select_shards)

LINKS = ("nvlink", "p2p_off", "sockets")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=int, default=22_000_000,
                   help="values per shard (default: GPT-350M's buckets at DP=2, ~44M parameters each)")
    p.add_argument("--buckets", type=int, default=8)
    p.add_argument("--lrs", default="1e-4,1e-5")
    p.add_argument("--steps", type=int, default=8, help="warm-up gathers whose block change rate is averaged")
    p.add_argument("--block-size", type=int, default=CieraConfig().block_size)
    p.add_argument("--links", default=os.path.join(ROOT, "results", "collectives", "nccl_transports.json"),
                   help="benchmarks/nccl_transports.py's output per link class (a JSON object keyed by link)")
    p.add_argument("--out", default=None)
    p.add_argument("--dry-run", action="store_true", help="CPU and a small shard: checks the script")
    return p.parse_args(argv)


def link_model(measured: dict):
    rows = measured["rows"]
    return fit_comm_model([r["wire_bytes"] for r in rows], [r["ms"]["all_gather_wire"] * 1e-3 for r in rows])


def change_rate(numel: int, lr: float, steps: int, block_size: int, device) -> float:
    """The mean block change rate over ``steps`` gathers of the simulated AdamW trajectory (after 10 steps)."""
    meter = BlockChangeMeter(block_size)
    for step, snapshot in enumerate(simulated_adamw(numel, lr, 10 + steps + 1, device=device)):
        if step >= 10:
            meter.update(snapshot)
    return meter.change_rate


def main(argv=None):
    args = parse_args(argv)
    device = torch.device("cpu" if args.dry_run else "cuda")
    numel = 1 << 16 if args.dry_run else args.numel
    config = CieraConfig(block_size=args.block_size)
    merge_per_byte = measure_merge_seconds_per_byte(config, numel=min(MERGE_PROBE_NUMEL, numel), device=device)
    print(f"merge: {1e-9 / merge_per_byte:.1f} GB/s of shard bytes on {device} "
          f"({merge_per_byte * 2 * numel * 1e3:.3f} ms per {numel}-value shard)")
    with open(args.links) as f:
        links = json.load(f)
    rows = []
    for lr in (float(x) for x in args.lrs.split(",")):
        rate = change_rate(min(numel, 1 << 22), lr, args.steps, args.block_size, device)
        for link in LINKS:
            comm = link_model(links[link])
            row = dict(lr=lr, link=link, block_change_rate=rate, comm_latency_us=comm.latency_s * 1e6,
                       comm_GBps=1e-9 / comm.seconds_per_byte if comm.seconds_per_byte else None)
            for name, merge in (("without_merge", 0.0), ("with_merge", merge_per_byte * 2 * numel)):
                shards = [ShardStats(key=i, numel=numel, change_rate=rate,
                                     cache_bytes=cache_bytes(numel, args.block_size, config.change_detect),
                                     block_size=args.block_size, merge_seconds=merge, world_size=2)
                          for i in range(args.buckets)]
                row[f"{name}_gain_us"] = gain_seconds(shards[0], comm) * 1e6
                row[f"{name}_selected"] = len(select_shards(shards, comm, None))
            row["raw_us"] = comm.time(2 * numel) * 1e6
            row["payload_us"] = comm.time(expected_payload_bytes(shards[0])) * 1e6
            row["size_exchange_us"] = comm.time(SIZE_EXCHANGE_BYTES) * 1e6
            row["merge_us"] = merge_per_byte * 2 * numel * 1e6
            rows.append(row)
    print(f"| lr | link | block change rate | raw gather us | payload gather us | size exchange us | merge us "
          f"| gain us per shard: without merge / with | shards chosen (of {args.buckets}): without / with |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['lr']:g} | {r['link']} | {r['block_change_rate']:.3f} | {r['raw_us']:.1f} | {r['payload_us']:.1f} "
              f"| {r['size_exchange_us']:.1f} | {r['merge_us']:.1f} "
              f"| {r['without_merge_gain_us']:+.1f} / {r['with_merge_gain_us']:+.1f} "
              f"| {r['without_merge_selected']} / {r['with_merge_selected']} |")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(command=" ".join(sys.argv), device=torch.cuda.get_device_name(0) if device.type == "cuda"
                           else "cpu", torch=torch.__version__, numel=numel, buckets=args.buckets,
                           merge_GBps=1e-9 / merge_per_byte, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
