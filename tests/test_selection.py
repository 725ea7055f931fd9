"""Benefit-driven shard selection with a synthetic comm model, the comm-model fit, the change meter,
and profile_comm on a real (gloo) group."""

import dataclasses

import pytest
import torch

from compression.ciera import CieraConfig
from compression.delta import DeltaConfig
from compression.selection import (SIZE_EXCHANGE_BYTES, BlockChangeMeter, CommModel, DeltaCostMeter, DeltaShardStats,
                                   ShardStats, cache_bytes, expected_payload_bytes,
                                   fit_comm_model, gain_seconds, measure_merge_seconds_per_byte, profile_comm,
                                   select_shards, selection_summary)
from dist_utils import run_on_ranks

SLOW_LINK = CommModel(latency_s=20e-6, seconds_per_byte=1 / 4e9)  # ~4 GB/s
MIB = 1 << 20


def _shard(key, numel, rate, mode="compare", merge_seconds_per_byte=0.0, world_size=2):
    return ShardStats(key=key, numel=numel, change_rate=rate, cache_bytes=cache_bytes(numel, 512, mode),
                      merge_seconds=merge_seconds_per_byte * 2 * numel, world_size=world_size)


def test_gain_formula_matches_the_paper():
    s = _shard("ln", 1 << 20, 0.25, merge_seconds_per_byte=1e-12, world_size=4)
    # bf16: S = 2 MiB, S_sm = 1 MiB, bitmap 2048 blocks / 8 = 256 B, tile table 2048 / 8 tiles * 4 B = 1 KiB,
    # S_e = 1 MiB, + 32 B header
    assert expected_payload_bytes(s) == MIB + 256 + 1024 + 0.25 * MIB + 32
    # T_decmp: each receiver merges the 3 other ranks' shards, after the payload sizes are exchanged
    want = (SLOW_LINK.time(2 * MIB) - SLOW_LINK.time(expected_payload_bytes(s)) - SLOW_LINK.time(SIZE_EXCHANGE_BYTES)
            - 3 * 1e-12 * 2 * MIB)
    assert gain_seconds(s, SLOW_LINK) == pytest.approx(want)
    fp16 = ShardStats("x", 1024, 0.0, 0, dtype=torch.float16)
    assert expected_payload_bytes(fp16) == 32 + 1 + 4 + 1024 * 11 / 8  # 2 blocks: one tile


def test_select_shards_ranks_by_gain_per_cache_byte_within_budget():
    def shards(merge):
        return [_shard(key, numel, rate, merge_seconds_per_byte=merge) for key, numel, rate in
                (("expert", 8 * MIB, 0.1), ("norm", MIB, 0.0), ("attn", 4 * MIB, 0.97), ("gate", 2 * MIB, 1.0),
                 ("embed", 16 * MIB, 0.5))]

    candidates = shards(2e-12)  # a 500 GB/s merge: enough to make the shards whose blocks nearly all change lose
    assert select_shards(candidates, SLOW_LINK, None) == {"expert", "norm", "embed"}
    assert select_shards(shards(0.0), SLOW_LINK, None) == {"expert", "norm", "embed", "attn"}  # the merge counts
    # "norm" has the best gain per cache byte; a budget of 9 MiB then fits "expert" (8 MiB) but not "embed"
    assert select_shards(candidates, SLOW_LINK, 9 * MIB) == {"norm", "expert"}
    assert select_shards(candidates, SLOW_LINK, MIB // 2) == set()
    # on a fast link with a costly merge nothing pays (the paper's Llama-4-Scout on NVLink)
    assert select_shards(shards(1e-11), CommModel(5e-6, 1 / 300e9), None) == set()
    line = selection_summary(candidates, {"norm", "expert"}, SLOW_LINK)
    assert line.startswith("ciera selection: 2/5 shards") and "MiB" in line and "measured block change rate" in line
    assert line.endswith("merge 500.00 GB/s")
    assert cache_bytes(1000, 512, "hash") == 2 * 16 and cache_bytes(1000, 512, "compare") == 1024


def test_fit_comm_model_recovers_a_line():
    sizes = [1 << 16, 1 << 20, 1 << 24]
    model = fit_comm_model(sizes, [SLOW_LINK.time(s) for s in sizes])
    assert model.latency_s == pytest.approx(SLOW_LINK.latency_s, rel=1e-6)
    assert model.seconds_per_byte == pytest.approx(SLOW_LINK.seconds_per_byte, rel=1e-9)


def test_block_change_meter():
    meter = BlockChangeMeter(block_size=64)
    assert meter.change_rate == 1.0
    x = torch.ones(256, dtype=torch.bfloat16)
    meter.update(x)
    meter.update(x)  # nothing changed
    y = x.clone()
    y[5] = 2.0  # exponent change in block 0 only
    meter.update(y)
    assert (meter.blocks_changed, meter.blocks_seen) == (1, 8)


def test_measure_merge_seconds_per_byte():
    rng = torch.get_rng_state()
    seconds = measure_merge_seconds_per_byte(CieraConfig(64), numel=4096, repeats=1)
    assert 0 < seconds < 1e-3
    assert torch.equal(torch.get_rng_state(), rng)  # training's random numbers (dropout) stay as they were


def _profile():
    model = profile_comm(None, sizes=(1 << 10, 1 << 14, 1 << 18), repeats=2)
    return model.latency_s, model.seconds_per_byte


@pytest.mark.slow
def test_profile_comm_agrees_on_all_ranks():
    a, b = run_on_ranks(_profile, 2)
    assert a == b  # bit-identical models -> identical selections
    assert min(a) >= 0 and max(a) > 0  # timings on a loaded CPU are too noisy to insist on a slope


def test_delta_gain_charges_codec_time_and_size_exchange():
    shard = DeltaShardStats("w", numel=4 * MIB, payload_bytes=MIB, encode_seconds=1e-3, decode_seconds=0.5e-3,
                            world_size=4)
    want = (SLOW_LINK.time(8 * MIB) - SLOW_LINK.time(MIB) - SLOW_LINK.time(SIZE_EXCHANGE_BYTES)
            - 1e-3 - 3 * 0.5e-3)
    assert gain_seconds(shard, SLOW_LINK) == pytest.approx(want)
    in_slots = dataclasses.replace(shard, size_exchange=False)  # --delta-capacity-factor: sizes ride in the slots
    assert gain_seconds(in_slots, SLOW_LINK) == pytest.approx(want + SLOW_LINK.time(SIZE_EXCHANGE_BYTES))
    # 8 MiB -> 1 MiB saves ~1.8 ms at 4 GB/s (less than the 2.5 ms of coding) and ~7.3 ms at 1 GB/s
    assert select_shards([shard], SLOW_LINK, None) == set()
    assert select_shards([shard], CommModel(20e-6, 1 / 1e9), None) == {"w"}
    assert select_shards([shard], CommModel(10e-6, 1 / 150e9), None) == set()  # NVLink-class
    assert select_shards([shard], CommModel(20e-6, 1 / 1e9), 1) == set()  # a budget binds delta too
    line = selection_summary([shard], {"w"}, SLOW_LINK)
    assert line.startswith("delta selection: 1/1 shards") and "+ 4.00 GB/s;" in line
    # what the warm-up measured: 8 MiB -> 1 MiB, coded at 8 MiB / 1 ms and decoded at 8 MiB / 0.5 ms
    assert line.endswith("measured wire ratio 8.00x, encode 8.4 GB/s, decode 16.8 GB/s (wall clock, later half of the warm-up)")
    assert "cache 8.0 MiB;" in line  # the sender's copy, 2 bytes per value
    fused = dataclasses.replace(shard, sender_copy=False)  # --delta-fused-cast keeps none
    assert fused.cache_bytes == 0 and "cache 0.0 MiB;" in selection_summary([fused], {"w"}, SLOW_LINK)
    flat = CommModel(60e-6, 0.0)  # the fit on a link too fast for the probed sizes
    assert "no per-byte cost measurable at the probed sizes;" in selection_summary([shard], set(), flat)


def test_delta_cost_meter_measures_the_real_payload():
    meter = DeltaCostMeter(DeltaConfig(block_size=256))
    assert meter.estimate() is None
    g = torch.Generator().manual_seed(0)
    weights = torch.randn(10_000, generator=g) * 0.02
    for _ in range(4):
        last_shard = weights.to(torch.bfloat16)
        meter.update(last_shard)
        weights = weights - 1e-4 * torch.randn(10_000, generator=g).sign() * weights.abs()
    payload, encode_s, decode_s = meter.estimate()
    assert len(meter.samples) == 3 and encode_s > 0 and decode_s > 0
    assert 0 < payload < 2 * 10_000 / 2  # a small relative step: well under half of the bf16 bytes
    # the decodes kept the meter's copy equal, bit for bit, to the last shard it was given
    assert torch.equal(meter.previous.view(torch.int16), last_shard.view(torch.int16))


def test_delta_cost_meter_times_the_fused_cast_encode():
    """Given the fp32 masters (--delta-fused-cast), the meter times the fused encode: the same payloads as from the
    rounded values, its own buffer holding them, no sender copy."""
    plain, cast = DeltaCostMeter(DeltaConfig(block_size=256)), DeltaCostMeter(DeltaConfig(block_size=256))
    g = torch.Generator().manual_seed(1)
    weights = torch.randn(10_000, generator=g) * 0.02
    for _ in range(4):
        plain.update(weights.to(torch.bfloat16))
        cast.update(weights.to(torch.bfloat16), weights.clone())
        weights = weights - 1e-4 * torch.randn(10_000, generator=g).sign() * weights.abs()
    assert [p[0] for p in cast.samples] == [p[0] for p in plain.samples] and len(cast.samples) == 3
    assert cast.sender._prev is None and torch.equal(cast.sender_buffer.view(torch.int16),
                                                     cast.previous.view(torch.int16))


def test_link_selection_benchmark_dry_run(tmp_path):
    """benchmarks/ciera_selection_links.py on CPU: the committed link timings fitted, change rates measured, and the
    merge charged: with it, a gain drops by exactly the merge time, and no link selects more shards than without."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "links.json"
    cmd = [sys.executable, os.path.join(root, "benchmarks", "ciera_selection_links.py"), "--dry-run", "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(r["lr"], r["link"]) for r in rows} == {(lr, link) for lr in (1e-4, 1e-5)
                                                     for link in ("nvlink", "p2p_off", "sockets")}
    for r in rows:
        assert 0 < r["block_change_rate"] <= 1 and r["merge_us"] > 0
        assert r["with_merge_gain_us"] == pytest.approx(r["without_merge_gain_us"] - r["merge_us"])
        assert r["with_merge_selected"] <= r["without_merge_selected"]
    sockets = {r["lr"]: r for r in rows if r["link"] == "sockets"}
    assert sockets[1e-5]["block_change_rate"] < sockets[1e-4]["block_change_rate"]  # fewer exponents change
    assert sockets[1e-5]["payload_us"] < sockets[1e-5]["raw_us"]
