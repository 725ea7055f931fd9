"""Compressed TP collectives on gloo CPU ranks: agreement across ranks, closeness to the uncompressed
collective, async handles, subgroups, size-1 groups and byte telemetry. One world per size."""

import pytest
import torch
import torch.distributed as dist

from compression.taco import TacoCodec, TacoConfig
from compression.telemetry import COMM_CLASSES, TELEMETRY
from compression.tp_collectives import (OPS, compressed_all_gather, compressed_all_reduce, compressed_reduce_scatter,
                                        crossover, emulated_all_gather, emulated_all_reduce, emulated_reduce_scatter)
from dist_utils import run_on_ranks

# 1 value, odd sizes, block-aligned rows; each with one dtype to keep the spawned worlds short
CASES = [((1,), torch.float32), ((8, 125), torch.bfloat16), ((12, 343), torch.float32), ((4, 3, 256), torch.bfloat16)]


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _local_input(shape, dtype, rank, seed):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape[0], *[1] * (len(shape) - 1), generator=g))
    return x.to(dtype)


def _bits(t: torch.Tensor) -> bytes:
    # plain bytes: tensors sent through the result queue would be shared memory of an exited process
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _check_world(world):
    """Runs on every rank; returns (errors, raw bytes of results that must agree on all ranks)."""
    rank = dist.get_rank()
    errors, shared = [], {}
    codec = TacoCodec(TacoConfig(block_size=64))
    total_error = {"one-shot": 0.0, "two-shot": 0.0}
    for i, (shape, dtype) in enumerate(CASES):
        key = f"{shape} {dtype}"
        x = _local_input(shape, dtype, rank, i)
        exact = x.float().clone()
        dist.all_reduce(exact)
        for algorithm in ("one-shot", "two-shot"):
            reduced = compressed_all_reduce(x, codec, algorithm=algorithm)
            shared[f"all_reduce {algorithm} {key}"] = _bits(reduced)
            error = _rel(reduced, exact)
            total_error[algorithm] += error
            if reduced.shape != x.shape or reduced.dtype != dtype or error > 0.05:
                errors.append(f"all_reduce {algorithm} {key}: error {error:.4f}")
            pending = compressed_all_reduce(x, codec, async_op=True, algorithm=algorithm)
            if not torch.equal(pending.wait(), reduced) or pending.wait() is not pending.wait():
                errors.append(f"async all_reduce {algorithm} {key} differs from the synchronous one")
        auto = compressed_all_reduce(x, codec)
        if not torch.equal(auto, compressed_all_reduce(x, codec, algorithm="one-shot" if world == 2 else "two-shot")):
            errors.append(f"all_reduce auto {key}: not one-shot at 2 ranks / two-shot above")

        if shape[0] % world == 0:
            shard = compressed_reduce_scatter(x, codec, async_op=True).wait()
            expected = exact.view(world, -1)[rank].view(shard.shape)
            if shard.shape[0] != shape[0] // world or _rel(shard, expected) > 0.05:
                errors.append(f"reduce_scatter {key}: error {_rel(shard, expected):.4f}")

        gathered = compressed_all_gather(x, codec)
        shared[f"all_gather {key}"] = _bits(gathered)
        own = codec.decode(codec.encode(x), x.numel(), dtype).view(x.shape)
        if gathered.shape[0] != world * shape[0] or not torch.equal(gathered.view(world, *shape)[rank], own):
            errors.append(f"all_gather {key}: own slice is not the decoded input")
    # One quantization per contribution instead of two: the one-shot is the more accurate.
    if not total_error["one-shot"] < total_error["two-shot"]:
        errors.append(f"one-shot all-reduce error {total_error['one-shot']:.4f} >= two-shot {total_error['two-shot']:.4f}")
    errors += _check_groups_and_telemetry(world, rank, codec)
    return errors, shared


def _check_groups_and_telemetry(world, rank, codec):
    errors = []
    singles = [dist.new_group([r]) for r in range(world)]
    x = _local_input((6, 100), torch.float32, rank, 9)
    if compressed_all_reduce(x, codec, group=singles[rank]) is not x:
        errors.append("a size-1 group must return the input unchanged")
    pairs = [dist.new_group([r, r + world // 2]) for r in range(world // 2)]
    pair = pairs[rank % (world // 2)]
    exact = x.clone()
    dist.all_reduce(exact, group=pair)
    if _rel(compressed_all_reduce(x, codec, group=pair), exact) > 0.05:
        errors.append("all_reduce over a subgroup is wrong")

    TELEMETRY.reset()
    n = 1000
    y = torch.randn(n, dtype=torch.bfloat16)
    compressed_all_reduce(y, codec, comm_class="tp", algorithm="two-shot")
    row = -(-n // world)
    want_raw, want_sent = (n + row) * 2, (world + 1) * codec.wire_nbytes(row)
    compressed_all_reduce(y, codec, comm_class="tp", algorithm="one-shot")
    want_raw, want_sent = want_raw + 2 * n, want_sent + codec.wire_nbytes(n)
    compressed_all_gather(y, codec, comm_class="pp")
    counters = TELEMETRY.counters()
    tp, pp = counters[0:2], counters[2 * COMM_CLASSES.index("pp"):][:2]
    if tp != [want_raw, want_sent] or pp != [2 * n, codec.wire_nbytes(n)]:
        errors.append(f"telemetry tp {tp} pp {pp}, expected tp {[want_raw, want_sent]}")
    TELEMETRY.reset()
    return errors


def _check_world_and_benchmark(world, bench_out):
    """World 2 also runs the collectives benchmark's logic (--dry-run) on the same ranks."""
    from benchmarks import bench_tp_collectives

    errors, shared = _check_world(world)
    result = bench_tp_collectives.run(bench_tp_collectives.parse_args(["--dry-run", "--out", bench_out]),
                                      torch.device("cpu"))
    errors += result["problems"]
    if len(result["rows"]) != 6 or set(result["min_bytes"]) != set(OPS):
        errors.append(f"benchmark dry run: unexpected result {result}")
    auto = result["auto_min_bytes"]  # measure_min_bytes per timing: one answer per op, the same on every rank
    if set(auto) != {"synced", "queued"} or any(
            set(per_op) != set(OPS) or any(v not in (None, 4096, 16384) for v in per_op.values())
            for per_op in auto.values()):
        errors.append(f"measure_min_bytes: unexpected {auto}")
    shared["auto_min_bytes"] = repr(sorted(auto.items())).encode()
    return errors, shared


def _run_and_compare(world, fn=_check_world, *args):
    results = run_on_ranks(fn, world, world, *args)
    for rank, (errors, _) in enumerate(results):
        assert errors == [], f"rank {rank}: {errors}"
    first = results[0][1]
    for rank, (_, shared) in enumerate(results[1:], start=1):
        for name, bits in first.items():
            assert shared[name] == bits, f"{name} differs on rank {rank}"


def test_crossover_is_the_smallest_size_from_which_compression_always_wins():
    sizes = [1, 2, 4, 8]
    assert crossover(sizes, [1, 1, 1, 1], [2, 0.5, 2, 0.5]) == 8  # a loss at 4 rules out 2
    assert crossover(sizes, [1, 1, 1, 1], [2, 0.5, 0.5, 0.5]) == 2
    assert crossover(sizes[::-1], [1, 1, 1, 1], [0.5, 0.5, 0.5, 2]) == 2  # order of sizes does not matter
    assert crossover(sizes, [1, 1, 1, 1], [0.5, 0.5, 0.5, 1]) is None  # a tie is no win
    assert crossover(sizes, [1, 1, 1, 1], [0.1] * 4) == 1
    assert crossover(sizes, [1, 1, 1, 1], [0.95, 0.85, 0.85, 0.85], margin=0.1) == 2


@pytest.mark.slow
def test_collectives_world_2(tmp_path):
    _run_and_compare(2, _check_world_and_benchmark, str(tmp_path / "bench.json"))
    assert (tmp_path / "bench.json").exists()


@pytest.mark.slow
def test_collectives_world_4():
    _run_and_compare(4)


# ---------------------------------------------------------------------------------------------------
# Emulation: a group's compressed collectives computed in one process give the real group's bits.

EMULATION_CODECS = [TacoConfig(block_size=64, format="int8"),
                    TacoConfig(block_size=64, format="e4m3", transform="ash", scaling="single"),
                    TacoConfig(block_size=32, format="e5m2", transform="none", scaling="single"),
                    TacoConfig(block_size=64, format="e4m3", transform="none", scaling="dual"),
                    "tahquant"]
EMULATION_CASES = [((8, 125), torch.bfloat16), ((12, 343), torch.float32)]
TAHQUANT_CASES = [((8, 2, 48), torch.bfloat16), ((4, 3, 48), torch.float32)]  # whole tokens per rank's row


def _emulation_codec(config):
    """A TACO codec, or TahQuant's 4-bit code (hidden size 48) as ``--tp-comm-compression tahquant`` builds it."""
    if config == "tahquant":
        from compression.pp_quant import TahQuantCodec, TahQuantConfig

        return TahQuantCodec(TahQuantConfig(tile_size=16, high_bit_fraction=0.25), 48)
    return TacoCodec(config)


def _emulation_cases(config):
    return TAHQUANT_CASES if config == "tahquant" else EMULATION_CASES


def _real_collectives():
    """On every rank of a world of 4: each codec's collectives over the whole world and over the pairs
    {0, 1} and {2, 3}, with this rank's input of each case; the results' bytes by name."""
    rank = dist.get_rank()
    groups = {4: None, 2: [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]}
    results = {}
    for c, config in enumerate(EMULATION_CODECS):
        codec = _emulation_codec(config)
        for i, (shape, dtype) in enumerate(_emulation_cases(config)):
            x = _local_input(shape, dtype, rank, 20 + i)
            for world, group in groups.items():
                for algorithm in ("one-shot", "two-shot"):
                    reduced = compressed_all_reduce(x, codec, group=group, algorithm=algorithm)
                    results[c, i, world, "all_reduce", algorithm] = _bits(reduced)
                results[c, i, world, "reduce_scatter"] = _bits(compressed_reduce_scatter(x, codec, group=group))
                results[c, i, world, "all_gather"] = _bits(compressed_all_gather(x, codec, group=group))
    return results


def _sqnr_db(got: torch.Tensor, exact: torch.Tensor) -> float:
    return (10 * torch.log10(exact.double().pow(2).sum() / (got.double() - exact.double()).pow(2).sum())).item()


@pytest.mark.slow
def test_emulated_collectives_are_the_real_ones_bit_for_bit():
    """``emulated_*`` of the N ranks' inputs equal, to the bit, what each rank of a real gloo group of N
    returns (N = 2 and 4, one-shot and two-shot all-reduce, reduce-scatter, all-gather, every format and
    scaling, odd sizes, and TahQuant's code through the generic decode-and-sum path), hence the same
    per-collective SQNR."""
    real = run_on_ranks(_real_collectives, 4)
    for c, config in enumerate(EMULATION_CODECS):
        codec = _emulation_codec(config)
        for i, (shape, dtype) in enumerate(_emulation_cases(config)):
            inputs = [_local_input(shape, dtype, rank, 20 + i) for rank in range(4)]
            for world in (2, 4):
                for first in range(0, 4, world):  # the group's ranks: first .. first + world - 1
                    ranks = range(first, first + world)
                    parts = [inputs[r] for r in ranks]
                    exact = torch.stack([p.float() for p in parts]).sum(dim=0)
                    for algorithm in ("one-shot", "two-shot"):
                        emulated = emulated_all_reduce(parts, codec, algorithm=algorithm)
                        for r in ranks:
                            got = real[r][c, i, world, "all_reduce", algorithm]
                            assert _bits(emulated) == got, (config, shape, world, algorithm, r)
                        sqnr = _sqnr_db(emulated, exact)
                        assert 10 < sqnr < 60, (config, shape, world, algorithm, sqnr)
                    emulated = emulated_reduce_scatter(parts, codec)
                    for local, r in enumerate(ranks):
                        assert _bits(emulated.chunk(world)[local]) == real[r][c, i, world, "reduce_scatter"], \
                            (config, shape, world, r)
                    emulated = emulated_all_gather(parts, codec)
                    for r in ranks:
                        assert _bits(emulated) == real[r][c, i, world, "all_gather"], (config, shape, world, r)
