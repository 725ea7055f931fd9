"""ShardGather over gloo: many steps of optimizer-like updates of each rank's own shard, sync and async,
CIERA (compare/raw and hash/ans), delta (also on three values per rank) and a lossy codec whose header
delivery is checked; buffers bit-identical on all ranks and equal to an uncompressed gather; telemetry;
verify() catching a corrupted slice. On 2 GPUs (NCCL, the Triton kernels): several buckets prepared with one
size exchange and transferred asynchronously, every transfer queued before the first decode."""

import importlib.util
import json
import os

import pytest
import torch
import torch.distributed as dist

from compression.ciera import CieraCodec, CieraConfig
from compression.codec import ShardCodec
from compression.collective_graphs import release_all_graphs
from compression.delta import DeltaCodec, DeltaConfig
from compression.shard_gather import GatherFusions, ShardGather, prepare_gathers
from compression.telemetry import COMM_CLASSES, TELEMETRY
from dist_utils import run_on_ranks

SHARD = 1500  # per-rank values: not a multiple of the block
STEPS = 6
SPECIAL = [0x7FC1, 0xFF81, 0x7F81, 0x7F80, 0xFF80, 0x8000, 0x0001, 0x807F]  # NaNs, +-Inf, -0.0, subnormals


class _TruncatingCodec(ShardCodec):
    """Lossy test codec: drops the 4 low mantissa bits; the sender must decode its own payload too.
    Declares a 6-byte header (not a multiple of the size word) and checks the one the gather delivers."""

    name, lossless, header_nbytes = "truncate", False, 6

    def encode(self, shard):
        return (shard.view(torch.int16) & ~0xF).view(torch.uint8).clone()

    def decode(self, src_rank, payload, out, header=None):
        assert header == self.read_header(payload), (header, payload[:6])
        out.view(torch.int16).copy_(payload.view(torch.int16))

    def reset(self):
        pass


def _full_gather(t):
    out = torch.empty(t.numel() * dist.get_world_size(), dtype=t.dtype)
    dist.all_gather_into_tensor(out, t.contiguous())
    return out


def _bits(x):
    return x.view(torch.int16)


def _run_steps(gather, rank, world):
    """Returns the final buffer after STEPS gathers (a reset of every rank's codec at step 3)."""
    master = torch.randn(world * SHARD, generator=torch.Generator().manual_seed(7)) * 0.02
    buffer = master.to(torch.bfloat16)  # identical start on every rank, as after Megatron's init
    own = slice(rank * SHARD, (rank + 1) * SHARD)
    rng = torch.Generator().manual_seed(100 + rank)
    for step in range(STEPS):
        master[own] -= 1e-4 * torch.randn(SHARD, generator=rng).clamp(-1, 1)
        buffer[own] = master[own].to(torch.bfloat16)
        buffer[own][:len(SPECIAL)] = torch.tensor(SPECIAL, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
        expected = _full_gather(buffer[own])
        if step == 3:
            gather.reset()
        handle = gather.start(buffer, async_op=step % 2 == 1)
        if handle is not None:
            handle.wait()
        if gather.codec.lossless:
            assert torch.equal(_bits(buffer), _bits(expected)), step
            gather.verify(buffer)
        everyone = _full_gather(buffer).view(world, -1)
        assert all(torch.equal(_bits(everyone[0]), _bits(row)) for row in everyone), step
    return buffer


def _gather_world():
    rank, world = dist.get_rank(), dist.get_world_size()
    TELEMETRY.reset()
    codecs = [CieraCodec(CieraConfig(64), world, rank), CieraCodec(CieraConfig(64, "hash", "ans"), world, rank),
              _TruncatingCodec()]
    sent = []
    for codec in codecs:
        before = TELEMETRY.counters()
        buffer = _run_steps(ShardGather(codec, None), rank, world)
        after = TELEMETRY.counters()
        i = 2 * COMM_CLASSES.index("dp_param_gather")
        sent.append((after[i] - before[i], after[i + 1] - before[i + 1]))
    assert ((_bits(buffer) & 0xF) == 0).all()  # lossy codec: own slices were decoded (truncated) too
    stats = TELEMETRY.extra_counters()
    _run_steps(ShardGather(DeltaCodec(DeltaConfig(64), world, rank), None), rank, world)
    _tiny_gathers(rank, world)
    codecs[0].reset()  # the buffer below starts over: the codec must forget its previous shard
    gather = ShardGather(codecs[0], None)
    buffer = _run_steps(gather, rank, world)
    if rank == 0:
        buffer[SHARD + 5] = 1.0  # corrupt rank 1's slice on rank 0 only
    try:
        gather.verify(buffer)
        error = None
    except RuntimeError as e:
        error = str(e)
    return sent, stats, error


def _tiny_gathers(rank, world):
    """Three values per rank: payloads shorter than a block."""
    gather = ShardGather(DeltaCodec(DeltaConfig(32), world, rank), None)
    buffer = torch.zeros(3 * world, dtype=torch.bfloat16)
    for step in range(3):
        buffer[3 * rank:3 * rank + 3] = torch.tensor([step, -step, 0.5 * rank], dtype=torch.bfloat16)
        expected = _full_gather(buffer[3 * rank:3 * rank + 3])
        gather.start(buffer)
        assert torch.equal(_bits(buffer), _bits(expected)), step


def _check_world(world):
    results = run_on_ranks(_gather_world, world)
    nblocks = -(-SHARD // 64)
    for rank, (sent, stats, error) in enumerate(results):
        raw_bytes = STEPS * SHARD * 2
        assert [raw for raw, _ in sent] == [raw_bytes] * 3
        assert sent[0][1] < raw_bytes and sent[1][1] < raw_bytes  # CIERA saves bytes with small updates
        assert stats["dp_param_gather/blocks_total"] == 2 * STEPS * nblocks
        assert 0 < stats["dp_param_gather/blocks_changed"] < 2 * STEPS * nblocks
        if rank == 0:
            assert error is not None and "rank 1 slice index 5" in error
        else:
            assert error is None


@pytest.mark.slow
def test_shard_gather_world_2():
    _check_world(2)


@pytest.mark.slow
def test_shard_gather_world_4():
    _check_world(4)


def _bench_dry_run(out_path, profile_dir):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, "benchmarks", "bench_param_gather.py")
    spec = importlib.util.spec_from_file_location("bench_param_gather", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--dry-run", "--out", out_path, "--profile-dir", profile_dir])
    # several buckets gathered together (one size exchange, transfers before decodes), bit-checked per bucket
    bench.main(["--dry-run", "--out", out_path + ".buckets", "--buckets", "4", "--codecs", "none", "delta", "sdp4bit"])
    bench.main(["--dry-run", "--out", out_path + ".fused", "--buckets", "4", "--codecs", "delta", "delta-slots",
                "--fuse-buckets"])


@pytest.mark.slow
def test_bench_param_gather_dry_run(tmp_path):
    out = tmp_path / "pg.json"
    run_on_ranks(_bench_dry_run, 2, str(out), str(tmp_path / "profile"))  # raises if a gather is not bit-exact
    assert (tmp_path / "profile" / "delta_rank1.json").stat().st_size > 0  # one profiled gather per codec and rank
    assert "Self CPU" in (tmp_path / "profile" / "none_rank0.txt").read_text()
    report = json.loads(out.read_text())
    by_codec = {r["codec"]: r for r in report["results"]}
    assert set(by_codec) == {"none", "ciera", "delta", "sdp4bit"}
    assert 3.0 < by_codec["sdp4bit"]["wire_ratio"] < 4.0  # 4-bit codes + an fp32 scale per 128 values: 3.76x
    assert 0 < by_codec["sdp4bit"]["rel_l2_error"] < 1e-2 and by_codec["sdp4bit"]["decode_GBps"] > 0
    assert by_codec["none"]["wire_ratio"] == 1.0
    assert 0.9 < by_codec["ciera"]["wire_ratio"] <= 2.0  # exponent reuse saves at most the exponent byte
    assert by_codec["delta"]["wire_ratio"] > 1.0
    assert by_codec["ciera"]["encode_GBps"] > 0
    buckets = json.loads((tmp_path / "pg.json.buckets").read_text())
    assert buckets["buckets"] == 4 and [r["codec"] for r in buckets["results"]] == ["none", "delta", "sdp4bit"]
    assert buckets["results"][1]["wire_ratio"] > 1.0 and 0 < buckets["results"][2]["rel_l2_error"] < 1e-2
    fused = json.loads((tmp_path / "pg.json.fused").read_text())  # the buckets coded as one, bit-checked
    assert fused["fuse_buckets"] and fused["results"][0]["wire_ratio"] > 1.0
    # the sync-free gather's last step went in slots (4096-byte multiples: above these small payloads)
    slots = fused["results"][1]
    assert slots["codec"] == "delta-slots" and slots["steps"][-1]["sent_bytes"] % 4096 == 16


def _one_storage(sizes, world, device):
    """fp32 masters of ``world`` ranks' shards of buckets of ``sizes`` values per rank (the same on every rank), and
    the bf16 buckets as views of one storage, as megatron-core's buckets lie in one buffer."""
    masters = [torch.randn(n * world, device=device, generator=torch.Generator(device=device).manual_seed(7)) * 0.02
               for n in sizes]
    storage = torch.cat(masters).to(torch.bfloat16)
    return masters, list(storage.split([n * world for n in sizes]))


def _step(masters, buffers, sizes, rank, lr, rng, cast_into=None):
    """An optimizer-like step of this rank's shards; returns each bucket's uncompressed gather of the new values.
    The new bf16 values go into the buffers with special patterns at their start, or, with ``cast_into`` (a gather per
    bucket), stay fp32 masters for the gathers' encodes to round (``cast_from``: ``--delta-fused-cast``)."""
    expected = []
    for k, (n, master, buffer) in enumerate(zip(sizes, masters, buffers)):
        own = slice(rank * n, (rank + 1) * n)
        master[own] -= lr * torch.randn(n, device=master.device, generator=rng).clamp(-1, 1)
        if cast_into is not None:
            cast_into[k].cast_from = master[own]
            new = master[own].to(torch.bfloat16)
        else:
            buffer[own] = master[own].to(torch.bfloat16)
            special = torch.tensor(SPECIAL, dtype=torch.int32, device=master.device).to(torch.int16)
            buffer[own][:len(SPECIAL)] = special.view(torch.bfloat16)
            new = buffer[own].contiguous()
        reference = torch.empty_like(buffer)
        dist.all_gather_into_tensor(reference, new)
        expected.append(reference)
    return expected


def _gather_and_check(gathers, buffers, fusions, expected, step) -> list:
    """One round of prepared gathers (the first transfer sync, the others async, waited for), each bucket's bits
    checked against ``expected``; returns the ``PreparedGather``s."""
    prepared = prepare_gathers(gathers, buffers, fusions)
    handles = [g.transfer(b, p, async_op=i > 0) for i, (g, b, p) in enumerate(zip(gathers, buffers, prepared))]
    for handle in handles[1:]:
        if handle is not None:
            handle.wait()
    for buffer, reference in zip(buffers, expected):
        assert torch.equal(_bits(buffer), _bits(reference)), step
    return prepared


def _prepared_buckets():
    """Delta and CIERA on three buckets of odd sizes per rank (special values in each), prepared together and
    transferred async before any wait, for several steps; bits equal to an uncompressed gather. Delta also with
    the buckets in one storage and ``GatherFusions``: coded as one from the second step on (the first is each
    bucket's keyframe), with a bucket reset at step 3 (alone again for a step, then a new set), the first
    transfer sync and the others async. On the GPU under NCCL (the Triton kernels), else on the CPU."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    sizes = (1500, 70_001, 262_144)  # values per rank: below, across and a multiple of the blocks
    rng = torch.Generator(device=device).manual_seed(100 + rank)
    delta, ciera = lambda: DeltaCodec(DeltaConfig(256), world, rank), lambda: CieraCodec(CieraConfig(512), world, rank)
    for codec_of, fusions in ((delta, None), (ciera, None), (delta, GatherFusions())):
        masters, buffers = _one_storage(sizes, world, device)
        gathers = [ShardGather(codec_of(), None) for _ in sizes]
        for step in range(6):
            expected = _step(masters, buffers, sizes, rank, 1e-4, rng)
            if fusions is not None and step == 3:
                gathers[2].reset()
            prepared = prepare_gathers(gathers, buffers, fusions)
            handles = [g.transfer(b, p, async_op=i > 0) for i, (g, b, p) in enumerate(zip(gathers, buffers, prepared))]
            for handle, p in zip(handles[1:], prepared[1:]):
                assert (handle is None) == (p.fused is not None and prepared[0].fused is p.fused)  # went with bucket 0
                if handle is not None:
                    handle.wait()
            for buffer, reference in zip(buffers, expected):
                assert torch.equal(_bits(buffer), _bits(reference)), (type(gathers[0].codec).__name__, step)
            if fusions is not None:
                fused = [p.fused is not None for p in prepared]
                assert fused == ([False] * 3 if step == 0 else [True, True, False] if step == 3 else [True] * 3), step
                assert fusions.sets == ([] if step == 0 else [2] if step == 3 else [3]), (step, fusions.sets)
    return True


@pytest.mark.slow
def test_prepared_buckets():
    assert run_on_ranks(_prepared_buckets, 2) == [True, True]


@pytest.mark.gpu
def test_prepared_buckets_nccl_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    assert run_on_ranks(_prepared_buckets, 2, backend="nccl") == [True, True]


def _slot_gathers():
    """Sync-free gathers (``capacity_factor``): delta on three buckets of one storage coded as one set, updates
    growing 3x per step so that payloads outgrow slots sized by the last ones (each followed by the uncompressed
    gather), a bucket reset at step 5 (new sets follow, whose first gathers exchange sizes), the first transfer
    sync and the others async. Bits equal to an uncompressed gather at every step; which gathers
    went in slots, and the slot counters."""
    from compression import shard_gather

    shard_gather.SLOT_ROUND = 16  # slots as tight as the factor makes them (4096 would hold these payloads)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    TELEMETRY.reset()
    sizes = (1500, 70_001, 26_144)
    rng = torch.Generator(device=device).manual_seed(100 + rank)
    masters, buffers = _one_storage(sizes, world, device)
    gathers = [ShardGather(DeltaCodec(DeltaConfig(256), world, rank), None, capacity_factor=1.0) for _ in sizes]
    fusions, slotted = GatherFusions(), []
    for step in range(9):
        expected = _step(masters, buffers, sizes, rank, 1e-5 * 3 ** min(step, 4), rng)
        if step == 5:
            gathers[2].reset()
        prepared = _gather_and_check(gathers, buffers, fusions, expected, step)
        slotted.append([(p.fused.prepared if p.fused is not None else p).capacity is not None for p in prepared])
    counters = TELEMETRY.extra_counters()
    return slotted, counters["dp_param_gather/slot_gathers"], counters["dp_param_gather/slot_overflows"]


def _check_slot_gathers(results):
    for slotted, gathers, overflows in results:
        # keyframes, then the set's first gather exchange sizes; slots from the next. The reset at step 5 ends the
        # set: the reset bucket's keyframe and a new set of the other two, then a set of all three (each new set's
        # first gather exchanges sizes)
        assert slotted == [[False] * 3] * 2 + [[True] * 3] * 3 + [[False] * 3] * 2 + [[True] * 3] * 2, slotted
        assert gathers == 5 and 1 <= overflows < gathers, (gathers, overflows)
    assert len({str(r) for r in results}) == 1  # every rank took the same path


@pytest.mark.slow
def test_slot_gathers():
    _check_slot_gathers(run_on_ranks(_slot_gathers, 2))


@pytest.mark.gpu
def test_slot_gathers_nccl_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    _check_slot_gathers(run_on_ranks(_slot_gathers, 2, backend="nccl"))


def _graph_gathers(cast=False):
    """Sync-free gathers replayed as CUDA graphs (``cuda_graphs``; NCCL, one GPU per rank): three buckets coded as
    one with slots of twice the last payloads, so that the capacity holds and the gather is captured after its
    eager warm-up; the first transfer sync, the others async; a reset at step 8 (its graph released, the set
    formed again); from step 14 the fused gather's slot capacity changed every 4 steps (as a payload's growth or
    shrinking changes it), so that it is captured again. ``cast``: the new values are fp32 masters that each
    gather's encode rounds into the buffer (``CastShard``, ``--delta-fused-cast``). Bits equal to an uncompressed
    gather at every step; the replays counted, the captures, the allocator's cache, which a capture must not empty,
    and the reserved memory over the re-captures (each takes the memory pool of the graph it replaces)."""
    from compression import shard_gather

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    TELEMETRY.reset()
    sizes = (1500, 70_001, 26_144)
    rng = torch.Generator(device=device).manual_seed(100 + rank)
    masters, buffers = _one_storage(sizes, world, device)
    gathers = [ShardGather(DeltaCodec(DeltaConfig(256), world, rank, cast=cast), None, capacity_factor=2.0,
                           cuda_graphs=True) for _ in sizes]
    torch.empty(64 << 20, dtype=torch.uint8, device=device)  # freed at once: 64 MiB more in the allocator's cache
    cached = torch.cuda.memory_reserved()
    fusions, replays, reserved = GatherFusions(), [], []
    for step in range(30):
        expected = _step(masters, buffers, sizes, rank, 1e-4, rng, gathers if cast else None)
        if step == 8:
            gathers[0].reset()
        if step >= 14 and step % 4 == 2:
            fused.gather.capacity += shard_gather.SLOT_ROUND * (1 if step % 8 == 6 else -1)
        prepared = _gather_and_check(gathers, buffers, fusions, expected, step)
        fused = prepared[0].fused
        replays.append(fused.gather.graph_replays if fused is not None else None)
        if step >= 14 and step % 4 == 1:
            reserved.append(torch.cuda.memory_reserved())
    assert shard_gather.GRAPH_WARMUP == 2
    counters = TELEMETRY.extra_counters()
    # the driver's end: the gathers still live (as in training's model), their graphs released, then the groups
    # destroyed (a live graph holding NCCL kernels hangs destroy_process_group)
    release_all_graphs()
    assert fused.gather._graph is None and fused.gather._retired is None
    dist.destroy_process_group()
    return replays, counters["dp_param_gather/graph_captures"], cached, reserved


@pytest.mark.gpu
def test_graph_gathers_nccl():
    """On one GPU a world of one (the capture, replays and sizes; nothing to decode), on two the whole gather."""
    world = min(2, torch.cuda.device_count())
    for cast in (False, True):
        for replays, captures, cached, reserved in run_on_ranks(_graph_gathers, world, cast, backend="nccl"):
            # step 0 keyframes, 1 the set's exchange, 2-3 eager slots, 4 captured and replayed, 5-7 replays; after
            # the reset at step 8 new sets: 8 (two buckets) and 9 (all three) exchange, 10-11 eager, 12-13 replays;
            # a new capacity at steps 14, 18, 22 and 26: two eager gathers, then captured and replayed
            again = [2, 2, 3, 4, 4, 4, 5, 6, 6, 6, 7, 8, 8, 8, 9, 10]
            assert replays == [None, 0, 0, 0, 1, 2, 3, 4, None, 0, 0, 0, 1, 2] + again, (cast, replays)
            assert captures == 6, (cast, captures)
            assert min(reserved) >= cached >= 64 << 20, (cast, cached, reserved)  # the cache was not emptied
            assert reserved[1:] == reserved[:-1], (cast, reserved)


def test_next_capacity():
    from compression.shard_gather import SLOT_ROUND, next_capacity

    assert next_capacity(None, 100_000, 1.25) == 126_976  # 1.25x, rounded up to whole 4 KiB
    assert SLOT_ROUND == 4096
    assert next_capacity(126_976, 101_580, 1.25) == 126_976  # kept while it leaves the factor's headroom
    assert next_capacity(126_976, 101_581, 1.25) == 131_072  # a byte more: grown before any payload outgrows it
    assert next_capacity(126_976, 81_300, 1.25) == 126_976  # shrinks only below 1 / (1.25 x 1.25) of the slot
    assert next_capacity(126_976, 81_200, 1.25) == 102_400
    assert next_capacity(4096, 10, 1.0) == 4096


def test_cuda_graphs_need_slots():
    with pytest.raises(ValueError, match="--delta-cuda-graphs captures sync-free gathers: add --delta-capacity-factor"):
        ShardGather(DeltaCodec(DeltaConfig(256), 2, 0), None, cuda_graphs=True)
    with pytest.raises(ValueError, match="--delta-capacity-factor must be 0 .* or >= 1.0"):
        ShardGather(DeltaCodec(DeltaConfig(256), 2, 0), None, capacity_factor=0.8)
