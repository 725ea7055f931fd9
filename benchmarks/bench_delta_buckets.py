"""The delta codec's work per parameter gather when a rank's shard is split into K buckets, on one GPU: each
bucket coded alone (a codec per bucket) vs all coded as one (``DeltaCodec.fused`` over ``Segments``, what
``GatherFusions`` does in training).

Per gather a rank begins every encode, reads all payload sizes and headers in one sync (the gather's size
exchange), finishes the encodes and decodes the other ranks' payloads. Here the world is 2 ranks simulated on one
device: the payload decoded is this rank's own, into a receiver's copy of the buckets, which is the same work.
The shard (``--numel`` values) follows the simulated AdamW trajectory of ``benchmarks/delta_wire_ratio.py``
(step ``--steps`` -> ``--steps + 1``) and is split into K nearly equal buckets in one storage, as
megatron-core's buckets lie in one buffer. Per mode and K: ``wall_ms``, the sequence with device syncs around it
(the host's launches count where they exceed the device's work); ``host_ms``, the host's time with the device
held busy (``queued_call_seconds``: before and after the size read); ``device_ms``, the device's time for the
same work without launch gaps. Every decode is checked bit for bit.

    python benchmarks/bench_delta_buckets.py --buckets 1 8 32 --out results/gpu/delta_buckets.json
"""

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.delta_wire_ratio import simulated_step  # noqa: E402
from compression.codec import Segments  # noqa: E402
from compression.delta import DeltaCodec, DeltaConfig  # noqa: E402
from compression.timing import call_seconds, queued_call_seconds  # noqa: E402

WORLD = 2


def split_sizes(numel: int, k: int) -> list:
    return [numel // k + (i < numel % k) for i in range(k)]


class Buckets:
    """K buckets of a 2-rank group in one storage; rank 0's slices hold the shard. ``sender`` codes them,
    ``receiver`` is another rank's copy of the same buckets."""

    def __init__(self, previous: torch.Tensor, new: torch.Tensor, k: int, block_size: int):
        self.sizes = split_sizes(new.numel(), k)
        self.storage = torch.zeros(WORLD * new.numel(), dtype=new.dtype, device=new.device)
        self.buffers = list(self.storage.split([WORLD * n for n in self.sizes]))
        self.own = [b[:n] for b, n in zip(self.buffers, self.sizes)]
        self.received = self.storage.clone()
        self.received_buffers = list(self.received.split([WORLD * n for n in self.sizes]))
        self.previous, self.new = previous, new
        config = DeltaConfig(block_size)
        self.codecs = [DeltaCodec(config, WORLD, 0) for _ in self.sizes]
        self.decoder = DeltaCodec(config, WORLD, 1)
        self._write_own(previous)
        for codec, own in zip(self.codecs, self.own):
            codec.encode(own)  # keyframes: the sender copies hold the previous values
        self.received.copy_(self.storage)
        self.received_state = self.received.clone()
        self.segments, self.received_segments = Segments(self.buffers, WORLD), Segments(self.received_buffers, WORLD)
        self.fused = DeltaCodec.fused(self.codecs, self.segments)  # the codecs' copies are now views of its copy
        self.sender_state = self.fused._prev.clone()
        self._write_own(new)

    def _write_own(self, values: torch.Tensor) -> None:
        for own, part in zip(self.own, values.split(self.sizes)):
            own.copy_(part)

    def restore(self) -> None:
        """Sender copies and receiver buffers as before the timed gather."""
        self.fused._prev.copy_(self.sender_state)
        self.received.copy_(self.received_state)

    def units(self, fused: bool) -> list:
        """(codec, what it encodes, where its payload decodes) per encode of one gather."""
        if fused:
            return [(self.fused, self.segments.shard(0), self.received_segments.shard(0))]
        return [(codec, own, received[:n]) for codec, own, received, n in
                zip(self.codecs, self.own, self.received_buffers, self.sizes)]

    def check(self) -> None:
        if not torch.equal(self.received.view(torch.int16), self.storage.view(torch.int16)):
            raise AssertionError("decoded buckets differ from the sender's")


def begin(units: list) -> list:
    return [codec.begin_encode(shard) for codec, shard, _ in units]


def exchange(starts: list) -> tuple:
    """The size exchange's one host sync: every payload size and header on the host."""
    sizes = torch.cat([s.nbytes.reshape(1) if torch.is_tensor(s.nbytes) else torch.tensor([s.nbytes]).to(
        s.header.device) for s in starts]).cpu().tolist()
    headers = [bytes(h.cpu().numpy().tobytes()) for h in (s.header for s in starts)]
    return sizes, headers


def finish_and_decode(units: list, decoder: DeltaCodec, starts: list, sizes: list, headers: list) -> None:
    for (codec, _, out), start, size, header in zip(units, starts, sizes, headers):
        # room after the payload for the decoder's word reads, as the gather's receive buffer leaves
        payload = torch.empty(size + codec.read_slack_bytes, dtype=torch.uint8, device=out.device)[:size]
        codec.finish_encode(start, payload)
        decoder.decode(0, payload, out, header)


def measure(b: Buckets, fused: bool, repeats: int) -> dict:
    units, device, payload = b.units(fused), b.storage.device, []

    def gather():
        starts = begin(units)
        sizes, headers = exchange(starts)
        finish_and_decode(units, b.decoder, starts, sizes, headers)
        payload[:] = sizes

    wall = call_seconds(gather, device, repeats, setup=b.restore, check=b.check)
    host = busy = float("inf")
    for _ in range(min(repeats, 5)):
        b.restore()
        started = []
        device1, host1 = queued_call_seconds(lambda: started.append(begin(units)), device, 0.02)
        sizes, headers = exchange(started[0])
        device2, host2 = queued_call_seconds(lambda: finish_and_decode(units, b.decoder, started[0], sizes, headers),
                                             device, 0.02)
        b.check()
        host, busy = min(host, host1 + host2), min(busy, device1 + device2)
    return dict(wall_ms=1e3 * min(wall), host_ms=1e3 * host, device_ms=1e3 * busy, payload_bytes=sum(payload),
                ratio=2 * b.new.numel() / sum(payload))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=62_500_000, help="values of the rank's shard, over all buckets")
    p.add_argument("--buckets", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--steps", type=int, default=20, help="AdamW steps before the timed one")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--device", default="cuda", help="cpu: the PyTorch reference path (a smoke test)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    previous, new = simulated_step(args.numel, args.lr, args.steps, device=args.device)
    rows = []
    for k in args.buckets:
        b = Buckets(previous, new, k, args.block_size)
        row = dict(buckets=k, numel=args.numel, lr=args.lr, block_size=args.block_size)
        for mode in ("alone", "fused"):
            row[mode] = measure(b, mode == "fused", args.repeats)
        rows.append(row)
        print(f"{k} buckets: " + "; ".join(f"{mode} wall {row[mode]['wall_ms']:.3f} ms host {row[mode]['host_ms']:.3f} "
                                          f"ms device {row[mode]['device_ms']:.3f} ms ratio {row[mode]['ratio']:.2f}x"
                                          for mode in ("alone", "fused")),
              flush=True)
        del b
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(command=" ".join(sys.argv), torch=torch.__version__,
                       device=torch.cuda.get_device_name(0) if args.device == "cuda" else args.device,
                       rows=rows), f, indent=1)
    print("\n| buckets | alone wall ms | fused wall ms | alone host ms | fused host ms | alone device ms | "
          "fused device ms |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        a, f = r["alone"], r["fused"]
        print(f"| {r['buckets']} | {a['wall_ms']:.3f} | {f['wall_ms']:.3f} | {a['host_ms']:.3f} | {f['host_ms']:.3f} | "
              f"{a['device_ms']:.3f} | {f['device_ms']:.3f} |")


if __name__ == "__main__":
    main()
