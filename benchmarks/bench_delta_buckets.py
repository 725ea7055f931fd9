"""The delta codec's work per parameter gather when a rank's shard is split into K buckets and W ranks send
payloads, on one GPU: each bucket coded alone (a codec per bucket) vs all coded as one (``DeltaCodec.fused`` over
``Segments``, what ``GatherFusions`` does in training), the W - 1 received payloads decoded in one launch per
kernel (``decode_gathered``, what ``ShardGather`` does) or one by one (the ``ShardCodec`` default).

Per gather a rank begins every encode, reads all payload sizes and headers in one sync (the gather's size
exchange), finishes the encodes and decodes the other ranks' payloads. The world is simulated on one device:
every rank's slices hold the same previous values and send this rank's payload (one device copy per encode
stands in for the all-gather), so the receiver (rank 1) decodes W - 1 real payloads. The shard (``--numel``
values) follows the simulated AdamW trajectory of ``benchmarks/delta_wire_ratio.py`` (step ``--steps`` ->
``--steps + 1``) and is split into K nearly equal buckets in one storage, as megatron-core's buckets lie in one
buffer (``--megatron-padding``: each bucket padded as megatron-core pads it, so its block tables are aligned as in
training; the exact split of 62.5M values into 8 buckets is not). Per mode, K and W: ``wall_ms``, the sequence with
device syncs around it (the host's launches count where they exceed the device's work); ``host_ms``, the host's
time with the device held busy (``queued_call_seconds``, before and after the size read); ``device_ms``, the device's
time for the same work without launch gaps. ``fused_slots``: the fused buckets' sync-free gather (``ShardGather``
with a capacity: each payload and its size into a slot of 1.25x the payload, no size read before the transfer, the
decodes skipping payloads that outgrew their slots on the device, the sizes read once at the end). Every gather's
result is checked bit for bit. ``--ops`` (CUDA) adds
each mode's device time per kernel and copy (``ops_us``) and that of the all-gather's stand-in (``stand_in_us``).

``--integrity`` (on by default, as in training): each encode's integrity hash travels beside its payload (the size
exchange's host copy, or the slot's prefix) and after the decodes the receiver compares it with each decode's
(``DeltaCodec.mismatched_sources``, the device part of ``ShardGather``'s check; the group's all-reduce of the count
is left out: one int64 over the network); the exchange path reads the count at a sync of its own, the slot path with
the sizes. ``compare``: each row without the check, then with it, and the check's cost (device time on over off).
``--max-registers``: each row again under these register caps of the encode and decode kernels (after the built-in
``kernels.delta.MAX_REGISTERS``).

    python benchmarks/bench_delta_buckets.py --buckets 1 8 32 --world 2 8 --out delta_buckets.json
    python benchmarks/bench_delta_buckets.py --buckets 1 --world 2 8 --modes fused fused_slots --integrity compare \
        --out delta_integrity_gather.json
"""

import argparse
import json
import math
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.delta_wire_ratio import simulated_step  # noqa: E402
from compression.codec import HostValues, Segments, ShardCodec, shard_of  # noqa: E402
from compression.delta import DeltaCodec, DeltaConfig  # noqa: E402
from compression.timing import call_seconds, device_op_seconds, queued_call_seconds  # noqa: E402
import kernels.delta as kernels  # noqa: E402
from benchmarks.bench_delta_kernels import register_caps, use_register_caps  # noqa: E402

MODES = ("alone", "fused", "fused_one_by_one", "fused_slots")
SLOT_FACTOR = 1.25  # fused_slots: slots of this many times the payload (the bytes the next gather would reserve)
RECEIVER = 1


def split_sizes(numel: int, k: int) -> list:
    return [numel // k + (i < numel % k) for i in range(k)]


def megatron_shard_multiple(world: int) -> int:
    """What megatron-core's distributed optimizer rounds each rank's share of a bucket up to: it pads every bucket to a
    multiple of lcm(W, 128) values (so each rank's slice starts and ends on whole 16-byte rows)."""
    return math.lcm(world, 128) // world


class Buckets:
    """K buckets of a W-rank group in one storage, as rank 0 (the sender) and rank 1 (the receiver) hold them; with
    ``pad``, each rank's slice of a bucket rounded up to a multiple of it, the padding zeros that never change."""

    def __init__(self, previous: torch.Tensor, new: torch.Tensor, k: int, block_size: int, world: int, pad: int = 1,
                 integrity: bool = True):
        self.world, self.sizes, self.new = world, split_sizes(new.numel(), k), new
        shards = [-(-n // pad) * pad for n in self.sizes]  # each rank's slice of each bucket
        self.bucket_numels = [world * n for n in shards]
        self.storage = torch.zeros(sum(self.bucket_numels), dtype=new.dtype, device=new.device)
        self.buffers = list(self.storage.split(self.bucket_numels))
        self._fill(self.buffers, previous, range(world))  # every rank's previous values (what rank 0 keyframes)
        config = DeltaConfig(block_size)
        self.codecs = [DeltaCodec(config, world, 0, integrity=integrity) for _ in self.sizes]
        for codec, buffer in zip(self.codecs, self.buffers):
            codec.encode(shard_of(buffer, 0, world))
        self.received = self.storage.clone()
        self.received_buffers = list(self.received.split(self.bucket_numels))
        self._fill(self.received_buffers, new, [RECEIVER])  # the receiver's own slices hold what it sent
        self.received_state = self.received.clone()
        self.expected = self.storage.clone()
        self._fill(list(self.expected.split(self.bucket_numels)), new, range(world))
        self.segments, self.received_segments = Segments(self.buffers, world), Segments(self.received_buffers, world)
        self.fused = DeltaCodec.fused(self.codecs, self.segments)  # the codecs' copies are now views of its copy
        self.sender_state = self.fused._prev.clone()
        self.decoders = [DeltaCodec(config, world, RECEIVER, integrity=integrity) for _ in range(len(self.sizes) + 1)]
        self._fill(self.buffers, new, [0])

    def _fill(self, buffers: list, values: torch.Tensor, ranks) -> None:
        for buffer, part in zip(buffers, values.split(self.sizes)):
            for rank in ranks:
                shard_of(buffer, rank, self.world)[:part.numel()].copy_(part)

    def restore(self) -> None:
        """Sender copies and receiver buffers as before the timed gather."""
        self.fused._prev.copy_(self.sender_state)
        self.received.copy_(self.received_state)

    def units(self, mode: str) -> list:
        """(codec, what it encodes, decoder, where the payloads decode) per encode of one gather."""
        if mode == "alone":
            return list(zip(self.codecs, [shard_of(b, 0, self.world) for b in self.buffers], self.decoders,
                            self.received_buffers))
        return [(self.fused, self.segments.shard(0), self.decoders[-1], self.received_segments)]

    def check(self) -> None:
        if not torch.equal(self.received.view(torch.int16), self.expected.view(torch.int16)):
            raise AssertionError("decoded buckets differ from the senders'")


def begin(units: list) -> list:
    return [codec.begin_encode(shard) for codec, shard, _, _ in units]


def exchange(starts: list) -> tuple:
    """The size exchange's one host sync: every payload size, integrity hash (0 without) and header on the host."""
    device = starts[0].header.device
    as_tensor = lambda x: x.reshape(1) if torch.is_tensor(x) else torch.tensor([x]).to(device)  # noqa: E731
    fields = torch.cat([as_tensor(s.nbytes) for s in starts] + [as_tensor(s.hash if s.hash is not None else 0)
                                                                  for s in starts]).cpu().tolist()
    return fields[:len(starts)], [bytes(s.header.cpu().numpy().tobytes()) for s in starts], fields[len(starts):]


def finish_and_decode(units: list, world: int, starts: list, sizes: list, headers: list, hashes: list,
                      one_by_one: bool) -> list:
    """Finish the encodes, gather (the stand-in), decode; with the integrity check its comparison: the mismatch
    counts (int64 [1] each, on the device; none without the check)."""
    counts = []
    for (codec, _, decoder, target), start, size, header, sent in zip(units, starts, sizes, headers, hashes):
        stride = -(-size // 16) * 16
        gathered = torch.empty(world * stride + codec.read_slack_bytes, dtype=torch.uint8, device=start.header.device)
        rows = gathered[:world * stride].view(world, stride)
        codec.finish_encode(start, rows[0, :size])
        rows[1:] = rows[0]  # the all-gather's stand-in: every rank sent this payload
        decode = ShardCodec.decode_gathered if one_by_one else type(decoder).decode_gathered
        decode(decoder, target, gathered[:world * stride], stride, [size] * world, [header] * world, RECEIVER)
        if decoder.integrity:  # the hashes came with the sizes, on the host
            sent = torch.tensor([sent] * world, dtype=torch.int64).to(gathered.device, non_blocking=True)
            counts.append(decoder.mismatched_sources(sent, RECEIVER)[1])
    return counts


def slots_and_decode(units: list, world: int, starts: list, capacity: int, landed: list) -> list:
    """The sync-free gather's codec work (``ShardGather`` with a capacity): each payload, its size and integrity hash
    into a slot, the stand-in all-gather, ``decode_slots``, with the check its comparison, and the sizes (then the
    mismatch count) copied to the host without waiting (``HostValues``, one per unit kept in ``landed`` across calls,
    as ``ShardGather`` keeps its own)."""
    for i, ((codec, _, decoder, target), start) in enumerate(zip(units, starts)):
        width = 16 + -(-capacity // 16) * 16
        gathered = torch.empty(world * width + codec.read_slack_bytes, dtype=torch.uint8, device=start.header.device)
        rows = gathered[:world * width].view(world, width)
        codec.finish_encode_into_slot(start, rows[0, 16:16 + capacity], rows[0, :8].view(torch.int64))
        if decoder.integrity:
            rows[0, 8:16].view(torch.int64).copy_(start.hash)
        rows[1:] = rows[0]
        prefixes = rows[:, :16].view(torch.int64)
        sizes = prefixes[:, 0]
        decoder.decode_slots(target, gathered[16:], width, sizes, capacity, RECEIVER)
        status = sizes
        if decoder.integrity:
            count = decoder.mismatched_sources(prefixes[:, 1], RECEIVER, sizes, capacity)[1]
            status = torch.cat([sizes, count])
        if i < len(landed):
            landed[i].update(status)
        else:
            landed.append(HostValues(status))
    return landed


def no_mismatch(counts) -> None:
    """The integrity check's verdict, read on the host (the exchange path's sync of its own; the slot path's rides
    with the sizes): every decode gave its sender's hash."""
    if any(int(c) for c in counts):
        raise AssertionError("a decoded integrity hash differs from its sender's")


def measure(b: Buckets, mode: str, repeats: int, ops: bool = False) -> dict:
    units, device, payload = b.units(mode), b.storage.device, []
    one_by_one, slots = mode == "fused_one_by_one", mode == "fused_slots"
    capacity, landed = None, []
    if slots:  # the slots of a gather whose previous payload was this one
        b.restore()
        starts = begin(units)
        sizes, headers, hashes = exchange(starts)
        capacity = -(-math.ceil(SLOT_FACTOR * max(sizes)) // 4096) * 4096
        no_mismatch(finish_and_decode(units, b.world, starts, sizes, headers, hashes, False))

    def gather():
        starts = begin(units)
        if slots:
            status = [unit.get() for unit in slots_and_decode(units, b.world, starts, capacity, landed)]
            sizes = [s[0] for s in status]
            if max(sizes) > capacity:
                raise AssertionError(f"a payload of {max(sizes)} bytes outgrew its {capacity}-byte slot")
            no_mismatch(s[b.world] for s in status if len(s) > b.world)
        else:
            sizes, headers, hashes = exchange(starts)
            no_mismatch(finish_and_decode(units, b.world, starts, sizes, headers, hashes, one_by_one))
        payload[:] = sizes

    wall = call_seconds(gather, device, repeats, setup=b.restore, check=b.check)
    host = busy = float("inf")
    for _ in range(min(repeats, 5)):
        b.restore()
        started = []
        device1, host1 = queued_call_seconds(lambda: started.append(begin(units)), device, 0.02)
        if slots:  # no sync in between: one queued call of the rest
            device2, host2 = queued_call_seconds(
                lambda: slots_and_decode(units, b.world, started[0], capacity, landed), device, 0.02)
        else:
            sizes, headers, hashes = exchange(started[0])
            device2, host2 = queued_call_seconds(
                lambda: finish_and_decode(units, b.world, started[0], sizes, headers, hashes, one_by_one), device,
                0.02)
        b.check()
        host, busy = min(host, host1 + host2), min(busy, device1 + device2)
    result = dict(wall_ms=1e3 * min(wall), host_ms=1e3 * host, device_ms=1e3 * busy, payload_bytes=sum(payload),
                  ratio=2 * b.new.numel() / sum(payload))
    if ops:  # where the device time goes: each kernel's and copy's (the profiler's names)
        result["ops_us"] = {op: 1e6 * seconds for op, seconds in
                            device_op_seconds(gather, min(repeats, 5), setup=b.restore).items()}
        widths = [16 + -(-capacity // 16) * 16] * len(units) if slots else [-(-size // 16) * 16 for size in payload]
        result["stand_in_us"] = sum(stand_in_us(b.world, width, device, min(repeats, 5)) for width in widths)
    return result


def stand_in_us(world: int, width: int, device, repeats: int) -> float:
    """Device time of the all-gather's stand-in (the payload copied to the other rows) of one unit: not codec work,
    left out of the ops' sum where the integrity cost is compared."""
    rows = torch.zeros(world, width, dtype=torch.uint8, device=device)

    def copy():
        rows[1:] = rows[0]

    return 1e6 * sum(device_op_seconds(copy, repeats).values())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=62_500_000, help="values of the rank's shard, over all buckets")
    p.add_argument("--buckets", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--world", type=int, nargs="+", default=[2], help="ranks of the simulated group (>= 2)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--steps", type=int, default=20, help="AdamW steps before the timed one")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--device", default="cuda", help="cpu: the PyTorch reference path (a smoke test)")
    p.add_argument("--megatron-padding", action="store_true", help="pad the buckets as megatron-core does (each rank's "
                   "slice to a multiple of lcm(W, 128) / W values): aligned block tables, 16-byte loads. Without it "
                   "the buckets split the shard exactly (62.5M / 8 = 7,812,500 values each: unaligned)")
    p.add_argument("--ops", action="store_true", help="also each mode's device time per kernel and copy (profiler; "
                   "CUDA only), printed and stored as ops_us")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--max-registers", default="", type=register_caps,
                   help="comma list of encode:decode register caps to sweep after the built-in ones, e.g. 64:64,56:64 "
                   "(0: the compiler's choice)")
    p.add_argument("--integrity", default="on", choices=["on", "off", "compare"],
                   help="delta's integrity check (on in training by default), off, or compare (each row off, then on)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if min(args.world) < 2:
        p.error(f"--world must be >= 2 (a receiver and a sender), got {args.world}")
    if args.ops and args.device != "cuda":
        p.error("--ops times kernels with the CUDA profiler: drop it with --device cpu")
    previous, new = simulated_step(args.numel, args.lr, args.steps, device=args.device)
    rows, modes = [], [m for m in MODES if m in args.modes]
    checks = {"on": [True], "off": [False], "compare": [False, True]}[args.integrity]
    default_caps = dict(kernels.MAX_REGISTERS)
    for world, k, cap in ((w, k, c) for w in args.world for k in args.buckets for c in [None] + args.max_registers):
        pad = megatron_shard_multiple(world) if args.megatron_padding else 1
        use_register_caps(cap, default_caps)
        for check in checks:
            b = Buckets(previous, new, k, args.block_size, world, pad, integrity=check)
            row = dict(world=world, buckets=k, numel=args.numel, lr=args.lr, block_size=args.block_size,
                       shard_multiple=pad, aligned=b.segments.block_table(args.block_size)[4], integrity=check,
                       max_registers={kind: kernels._max_registers(kind, args.block_size)
                                      for kind in ("encode", "decode")})
            for mode in modes:
                row[mode] = measure(b, mode, args.repeats, args.ops)
            rows.append(row)
            registers = f", registers {row['max_registers']}" if args.max_registers else ""
            print(f"W={world}, {k} buckets{registers}, integrity {'on' if check else 'off'}: " + "; ".join(
                f"{mode} wall {row[mode]['wall_ms']:.3f} host {row[mode]['host_ms']:.3f} device "
                f"{row[mode]['device_ms']:.3f} ms" for mode in modes)
                + f"; ratio {row[modes[0]]['ratio']:.2f}x", flush=True)
            for mode in modes if args.ops else ():
                print(f"  {mode} device us per op: " + ", ".join(
                    f"{op[:40]} {us:.1f}" for op, us in row[mode]["ops_us"].items()), flush=True)
            del b
        if args.integrity == "compare":
            print_integrity_cost(rows[-2], rows[-1], modes)
    use_register_caps(None, default_caps)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(command=" ".join(sys.argv), torch=torch.__version__,
                       device=torch.cuda.get_device_name(0) if args.device == "cuda" else args.device,
                       rows=rows), f, indent=1)
    print("\n| W | buckets | registers (encode, decode) | integrity | "
          + " | ".join(f"{m} wall / host / device ms" for m in modes) + " |")
    print("|---|---|---|---|" + "---|" * len(modes))
    for r in rows:
        registers = ", ".join(str(r["max_registers"][kind]) for kind in ("encode", "decode"))
        print(f"| {r['world']} | {r['buckets']} | {registers} | {'on' if r['integrity'] else 'off'} | " + " | ".join(
            f"{r[m]['wall_ms']:.3f} / {r[m]['host_ms']:.3f} / {r[m]['device_ms']:.3f}" for m in modes) + " |")


def print_integrity_cost(off: dict, on: dict, modes: list) -> None:
    """The integrity check's cost per gather: device time (and, with ``--ops``, the sum of the codec ops' device
    times: every op of the gather but the all-gather's stand-in) with it over without."""
    for mode in modes:
        cost = dict(device_ratio=on[mode]["device_ms"] / off[mode]["device_ms"])
        text = f"device {off[mode]['device_ms'] * 1e3:.1f} -> {on[mode]['device_ms'] * 1e3:.1f} us " \
               f"({cost['device_ratio']:.4f})"
        if "ops_us" in on[mode]:  # the codec's ops: all but the all-gather's stand-in
            ops_off, ops_on = (sum(r[mode]["ops_us"].values()) - r[mode]["stand_in_us"] for r in (off, on))
            cost["ops_ratio"] = ops_on / ops_off
            text += f", codec ops {ops_off:.1f} -> {ops_on:.1f} us ({cost['ops_ratio']:.4f})"
        on[mode]["integrity_cost"] = cost
        print(f"integrity check cost, W={on['world']}, {on['buckets']} buckets, registers {on['max_registers']}, "
              f"{mode}: {text}", flush=True)


if __name__ == "__main__":
    main()
