"""Benefit-driven selection of the shards worth compressing (``--param-gather-selection benefit``).

CIERA, the paper's per-iteration gain of compressing shard i (S bytes, of which S_e exponent and S_sm
sign+mantissa bytes, a bitmap of S_bm bytes, block change rate q):

    g = Comm(S) - Comm(S_sm + S_bm + q * S_e) - Comm(size exchange) - (world - 1) * T_merge(S)

Comm(bytes) is the all-gather time for that many bytes per rank, a latency + bytes/bandwidth line
fitted to timings on the real process group at start-up. Hashing and packing run off the critical
path in the paper's schedule and are left out; the receiver's merge of each of the other ranks' shards
(T_merge, ``measure_merge_seconds_per_byte`` x S, device time as the delta codec's is measured) is not,
nor is the all-gather of the payload sizes that a variable-size payload needs first. Shards with
g > 0 are ranked by g per byte of codec cache and taken greedily until ``--ciera-cache-budget-mb``
is spent; the rest are gathered uncompressed. The cache is the sender's change-detection state
(the receiver reads previous exponents from the resident parameter buffer, see compression/ciera.py).

Lossless delta code: the same comparison, with every term measured on the real shard during the
warm-up gathers (``DeltaCostMeter``: payload P, encode and decode time), since the payload depends on
how the values moved and the codec runs on the critical path of the gather:

    g = Comm(S) - Comm(P) - Comm(size exchange) - T_encode - (world - 1) * T_decode

(in slots, ``--delta-capacity-factor``, P is the slot's bytes and there is no size exchange).

Shards with g > 0 are compressed (no budget: the sender's previous shard is the codec's only memory).

Every rank must select the same shards: ``profile_comm`` reduces its timings with MAX over the group,
and the caller must average the measured change rates and payloads (and MAX-reduce the codec times)
over the group before calling ``select_shards``.
"""

import statistics
import time
from dataclasses import dataclass
from typing import Hashable, Optional

import torch
import torch.distributed as dist

from compression.timing import default_device, queued_call_seconds, queued_seconds, synchronize
from kernels.ciera import LAYOUTS, split_compare_reference, tile_blocks

HASH_BYTES_PER_BLOCK = 16
SELECTION_WARMUP_GATHERS = 8  # gathers of each bucket measured before each choice
# iterations from the start of measuring until the choice is in use: the measured gathers, the one that
# chooses, and one more (with --overlap-param-gather a round's gathers run in the next iteration's forward)
SELECTION_WINDOW_ITERATIONS = SELECTION_WARMUP_GATHERS + 2
HEADER_BYTES = 32
MERGE_PROBE_NUMEL = 1 << 22  # values of the payload CIERA's merge time is measured on (8 MiB of bf16)


@dataclass(frozen=True)
class CommModel:
    latency_s: float
    seconds_per_byte: float

    def time(self, nbytes: float) -> float:
        return self.latency_s + self.seconds_per_byte * nbytes


def fit_comm_model(sizes, seconds) -> CommModel:
    """Least-squares line through (bytes, seconds); both coefficients clamped at >= 0. Plain Python
    floats, so that identical inputs give identical bits on every rank (a LAPACK call need not)."""
    n = len(sizes)
    mean_x, mean_y = sum(sizes) / n, sum(seconds) / n
    var = sum((x - mean_x) ** 2 for x in sizes)
    cov = sum((x - mean_x) * (y - mean_y) for x, y in zip(sizes, seconds))
    slope = max(cov / var, 0.0) if var else 0.0
    return CommModel(max(mean_y - slope * mean_x, 0.0), slope)


def _time_all_gather(nbytes: int, group, device, repeats: int) -> float:
    world = dist.get_world_size(group)
    send = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    recv = torch.empty(nbytes * world, dtype=torch.uint8, device=device)
    dist.all_gather_into_tensor(recv, send, group=group)  # warm-up
    synchronize(device)
    start = time.perf_counter()  # back to back, as a bucket's gathers run
    for _ in range(repeats):
        dist.all_gather_into_tensor(recv, send, group=group)
    synchronize(device)
    return (time.perf_counter() - start) / repeats


def profile_comm(group=None, sizes=(1 << 16, 1 << 20, 1 << 23), device=None, repeats: int = 5) -> CommModel:
    """Time all_gather_into_tensor of each per-rank size on ``group``; every rank gets the same model."""
    device = torch.device(device) if device is not None else default_device()
    seconds = torch.tensor([_time_all_gather(s, group, device, repeats) for s in sizes],
                           dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=group)
    return fit_comm_model(list(sizes), seconds.tolist())


@dataclass(frozen=True)
class ShardStats:
    """One candidate shard (per-rank slice of a bucket): ``change_rate`` is the mean fraction of its
    blocks with a changed exponent per iteration; ``cache_bytes`` what compressing it costs in memory."""

    key: Hashable
    numel: int
    change_rate: float
    cache_bytes: int
    block_size: int = 512
    dtype: torch.dtype = torch.bfloat16
    merge_seconds: float = 0.0  # the receiver's decode of one payload; every receiver decodes world_size - 1
    world_size: int = 2


def cache_bytes(numel: int, block_size: int, change_detect: str) -> int:
    """Sender state of CieraCodec: previous exponents ("compare") or a 128-bit hash per block ("hash")."""
    nblocks = -(-numel // block_size)
    return nblocks * block_size if change_detect == "compare" else nblocks * HASH_BYTES_PER_BLOCK


def expected_payload_bytes(s: ShardStats) -> float:
    """S_sm + S_bm + q * S_e (+ the fixed header and the tile table), raw exponent coding; at most the raw values
    behind the header (the codec sends those where they are smaller)."""
    layout = LAYOUTS[s.dtype]
    nblocks = -(-s.numel // s.block_size)
    sm = s.numel * layout.sm_bits / 8
    exponents = nblocks * s.block_size * layout.exp_bits / 8
    table = 4 * -(-nblocks // tile_blocks(s.block_size))
    coded = HEADER_BYTES + -(-nblocks // 8) + table + sm + s.change_rate * exponents
    return min(coded, HEADER_BYTES + s.numel * (layout.sm_bits + layout.exp_bits) / 8)


@dataclass(frozen=True)
class DeltaShardStats:
    """One candidate shard for the delta codec, with what coding it cost in the warm-up gathers."""

    key: Hashable
    numel: int
    payload_bytes: float
    encode_seconds: float
    decode_seconds: float  # of one payload; every receiver decodes world_size - 1 of them
    world_size: int
    sender_copy: bool = True  # False with --delta-fused-cast: the encode codes against the buffer itself
    size_exchange: bool = True  # False in slots (--delta-capacity-factor): the sizes go with the payloads

    @property
    def cache_bytes(self) -> int:
        return 2 * self.numel if self.sender_copy else 0  # the sender's copy of what it sent last


SIZE_EXCHANGE_BYTES = 8  # ShardGather's all-gather of payload sizes before a variable-size gather


def gain_seconds(s, comm: CommModel) -> float:
    """Expected seconds saved per gather by compressing shard ``s`` (ShardStats or DeltaShardStats)."""
    raw = s.numel * 2
    if isinstance(s, DeltaShardStats):
        exchange = comm.time(SIZE_EXCHANGE_BYTES) if s.size_exchange else 0.0
        return (comm.time(raw) - comm.time(s.payload_bytes) - exchange - s.encode_seconds
                - (s.world_size - 1) * s.decode_seconds)
    return (comm.time(raw) - comm.time(expected_payload_bytes(s)) - comm.time(SIZE_EXCHANGE_BYTES)
            - (s.world_size - 1) * s.merge_seconds)


def select_shards(candidates, comm: CommModel, cache_budget_bytes: Optional[int]) -> set:
    """Keys of the shards to compress: positive gain, best gain per cache byte first, within budget
    (None: unlimited). Ties break by key order so every rank picks the same set."""
    scored = [(gain_seconds(s, comm), s) for s in candidates]
    scored = [(g, s) for g, s in scored if g > 0]
    scored.sort(key=lambda gs: (-gs[0] / max(gs[1].cache_bytes, 1), str(gs[1].key)))
    selected, used = set(), 0
    for _, s in scored:
        if cache_budget_bytes is None or used + s.cache_bytes <= cache_budget_bytes:
            selected.add(s.key)
            used += s.cache_bytes
    return selected


def selection_summary(candidates, selected: set, comm: CommModel) -> str:
    """One readable log line."""
    chosen = [s for s in candidates if s.key in selected]
    total_bytes = sum(s.numel * 2 for s in candidates) or 1
    gain = sum(gain_seconds(s, comm) for s in chosen)
    cache = sum(s.cache_bytes for s in chosen)
    codec = "delta" if any(isinstance(s, DeltaShardStats) for s in candidates) else "ciera"
    return (f"{codec} selection: {len(chosen)}/{len(candidates)} shards "
            f"({100 * sum(s.numel * 2 for s in chosen) / total_bytes:.1f}% of bytes), "
            f"expected gain {gain * 1e3:.3f} ms/iteration, cache {cache / 2**20:.1f} MiB; "
            f"comm model {comm.latency_s * 1e6:.1f} us + {_bandwidth(comm)}; measured {_measured(candidates)}")


def _measured(candidates) -> str:
    """What the warm-up gathers measured over all candidate shards, so a choice can be read off the log."""
    raw = sum(s.numel * 2 for s in candidates)
    if not raw:
        return "nothing (empty shards)"
    if all(isinstance(s, DeltaShardStats) for s in candidates):
        payload = sum(s.payload_bytes for s in candidates)
        encode, decode = sum(s.encode_seconds for s in candidates), sum(s.decode_seconds for s in candidates)
        speed = lambda seconds: f"{raw / seconds / 1e9:.1f} GB/s" if seconds > 0 else "unmeasured"  # noqa: E731
        clock = "device time" if torch.cuda.is_available() else "wall clock"
        return (f"wire ratio {raw / max(payload, 1):.2f}x, encode {speed(encode)}, decode {speed(decode)} "
                f"({clock}, later half of the warm-up)")
    rate = sum(s.change_rate * s.numel for s in candidates) / sum(s.numel for s in candidates)
    merge = sum(s.merge_seconds for s in candidates)
    return f"block change rate {rate:.3f}, merge " + (f"{raw / merge / 1e9:.2f} GB/s" if merge > 0 else "unmeasured")


def _bandwidth(comm: CommModel) -> str:
    if comm.seconds_per_byte <= 0:  # the fit's slope is clamped at 0 when time does not grow with size
        return "no per-byte cost measurable at the probed sizes"
    return f"{1e-9 / comm.seconds_per_byte:.2f} GB/s"


def measure_merge_seconds_per_byte(config, numel: int = 1 << 22, dtype=torch.bfloat16, device=None,
                                   repeats: int = 3) -> float:
    """Seconds per shard byte of CieraCodec.decode of a payload whose blocks all changed (the worst
    case) on ``device``: on CUDA the device time of its kernels, its header already on the host, as in a
    gather (which reads all headers in its one sync) and as ``DeltaCostMeter`` times the delta decode. The
    wall time of a lone decode, header read included, is ~90 us of sync and launches at the probe's 8 MiB
    (1x H200), which scaled by bytes charged a 44 MB shard 475 us for a merge whose kernels run at ~1.9 TB/s
    (docs/ciera.md), ~25 us.
    Timings differ between ranks: MAX-reduce the result before selecting."""
    from compression.ciera import CieraCodec  # selection stays importable without the codec's deps

    device = torch.device(device) if device is not None else torch.device("cpu")
    # its own generator: drawing from the default one would change training's random numbers (dropout)
    generator = torch.Generator(device).manual_seed(0)
    shard = (torch.randn(numel, device=device, generator=generator) * 0.02).to(dtype)
    sender, receiver = CieraCodec(config, 2, 0), CieraCodec(config, 2, 1)
    out = torch.empty_like(shard)
    payload = sender.encode(shard)  # a keyframe: every block carries its exponents
    header = receiver.read_header(payload)
    seconds, _ = queued_seconds(lambda: receiver.decode(0, payload, out, header), device, repeats)
    return seconds / (numel * shard.element_size())


class BlockChangeMeter:
    """Measures a shard's block change rate over successive iterations (the K warm-up iterations)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._prev = None
        self.blocks_changed = 0
        self.blocks_seen = 0

    def update(self, shard: torch.Tensor) -> None:
        layout = LAYOUTS[shard.dtype]
        bits = shard.reshape(-1).view(torch.int16)
        exp, _, changed = split_compare_reference(bits, self._prev, self.block_size, layout)
        if changed is not None:
            self.blocks_changed += int(changed.sum())
            self.blocks_seen += changed.numel()
        self._prev = exp

    @property
    def change_rate(self) -> float:
        """1.0 until two snapshots were seen (an unmeasured shard is assumed to change)."""
        return self.blocks_changed / self.blocks_seen if self.blocks_seen else 1.0


class DeltaCostMeter:
    """What the delta codec would cost on one shard, measured during the warm-up gathers by coding the real
    shard against its value at the previous gather: payload bytes, encode and decode seconds (the decode
    also brings the meter's copy of the previous shard up to date). On CUDA the codec times are the device
    time of its kernels, each half queued behind a sleep so that no launch gap or host sync counts: in a
    device-bound iteration the host queues them ahead of the device, and where it cannot (a host-bound
    model) the trial (megatron/hooks/trial.py) is what catches it. Timing each call between
    synchronizations (the first version) charged the host's launches and syncs too: 50-85 GB/s on an H200
    against the kernels' ~400-600 GB/s (measured on an H200). On the CPU: wall clock."""

    def __init__(self, config):
        from compression.delta import DeltaCodec  # selection stays importable without the codec's deps

        self.sender, self.receiver = DeltaCodec(config, 2, 0), DeltaCodec(config, 2, 1)
        self.previous = None  # the receiver's copy of the shard at the last gather
        self.sender_buffer = None  # with fp32 masters (--delta-fused-cast): the sender's values, cast into
        self.samples = []  # (payload bytes, encode seconds, decode seconds) per gather
        self._host_seconds = 0.05  # the host's time for one half, to size the sleep ahead of it

    def update(self, shard: torch.Tensor, master: torch.Tensor = None) -> None:
        """``shard``: the new values. ``master`` (--delta-fused-cast): the fp32 values they are rounded from, and the
        encode timed is the fused one, rounding them into the meter's copy of the previous values (no sender copy)."""
        from compression.codec import CastShard

        if master is not None and self.sender_buffer is None:  # a codec of CastShards, with its own buffer
            self.sender, self.previous = type(self.sender)(self.sender.config, 2, 0, cast=True), None
        if self.previous is None:  # a keyframe: the sender now holds the shard
            self.previous = shard.clone()
            if master is None:
                self.sender.encode(shard)
            else:
                self.sender_buffer = shard.clone()
                self.sender.encode(CastShard(self.sender_buffer, master))
            return
        new = shard if master is None else CastShard(self.sender_buffer, master)
        start = None

        def begin():
            nonlocal start
            start = self.sender.begin_encode(new)

        encode_s = self._seconds(begin, shard.device)
        slack = self.receiver.read_slack_bytes  # room after the payload, as a gather's receive buffer has
        nbytes = int(start.nbytes)  # the one host read of the size
        payload = torch.empty(nbytes + slack, dtype=torch.uint8, device=shard.device)[:nbytes]
        self.sender.finish_encode(start, payload)
        header = self.receiver.read_header(payload)
        decode_s = self._seconds(lambda: self.receiver.decode(0, payload, self.previous, header), shard.device)
        self.samples.append((payload.numel(), encode_s, decode_s))

    def _seconds(self, call, device: torch.device) -> float:
        seconds, host = queued_call_seconds(call, device, self._host_seconds)
        self._host_seconds = min(host, 0.05)  # (the first call's kernel compilation is no launch cost)
        return seconds

    def estimate(self) -> Optional[tuple]:
        """Median (payload bytes, encode seconds, decode seconds) over the later half of the measured gathers
        (at least the last one): payloads shrink as a run's first steps pass (GPT-350M: wire ratio 2.1x at
        iteration 5, 3.1x at 20, 7.4x at 40, 11.8x from 58 on), and the first call compiles the kernels.
        None before two updates."""
        if not self.samples:
            return None
        recent = self.samples[len(self.samples) // 2:]
        return tuple(statistics.median(column) for column in zip(*recent))
