"""``--param-gather-selection benefit``: which buckets' parameter gathers are compressed, measured on the real
shards of a run (the model of each bucket's gain: compression/selection.py), and the schedule of re-selections and
trials around them (compression/selection_schedule.py).

The first ``SELECTION_WARMUP_GATHERS`` gathers of each bucket group are uncompressed while each bucket is measured
(CIERA: block change rate; delta: payload, encode and decode time of the real shard); then the buckets whose
expected gain is positive are picked (CIERA: within ``--ciera-cache-budget-mb``), identically on every rank of a
group, and only those are compressed from then on: where compression would make the gather slower, the bucket keeps
megatron-core's plain all-gather. ``--param-gather-reselect-interval N``: every N iterations the buckets are measured
again (each keeping its gather meanwhile) and chosen again.

``--param-gather-trial-iters``: the per-bucket model can promise a gain that the iteration never sees (the gather
overlaps compute, or costs less inside the step than alone), so after each choice the training loop alternates plain
and compressed gathers and keeps compression only if iterations get faster. A plain gather during the trial calls
each codec's ``observe`` with the shard it sent (delta: its sender copy; CIERA: a keyframe next), so switching back
needs no extra state and both modes stay bit-exact. With ``--delta-cuda-graphs`` a trial times its iterations only
once the new codecs' gathers replay (``trial_skip_iterations``).
"""

import logging

import torch
import torch.distributed as dist

from compression.ciera import CieraCodec, CieraConfig
from compression.selection import (
    MERGE_PROBE_NUMEL, SELECTION_WARMUP_GATHERS, SELECTION_WINDOW_ITERATIONS, BlockChangeMeter, DeltaCostMeter,
    DeltaShardStats, ShardStats, cache_bytes, measure_merge_seconds_per_byte, profile_comm, select_shards,
    selection_summary,
)
from compression.selection_schedule import SelectionSchedule
from compression.shard_gather import GRAPH_WARMUP
from megatron.hooks.config import ParamGatherConfig
from megatron.hooks.bucket_shards import bucket_device, new_shard
from megatron.hooks.param_gather import PlainGather, compressed_bucket_groups
from megatron.hooks.trial import TRIAL_SKIP_ITERATIONS, CompressionTrial

logger = logging.getLogger(__name__)

_comm_models = {}  # process group -> all-gather latency/bandwidth model, profiled once per group


class BenefitSelection:
    """``--param-gather-selection benefit``, shared by every bucket group of one install. The first
    ``SELECTION_WARMUP_GATHERS`` gathers of each bucket group go uncompressed while each bucket is
    measured (CIERA: its block change rate; delta: its payload and codec times, by coding the real
    shard); then the buckets to compress are picked, for all groups together (and again after each
    ``restart``). Process groups are decided in turn (dense first), CIERA's spending what is left of
    ``--ciera-cache-budget-mb``; a MIN over each group makes all of its ranks agree."""

    def __init__(self, bucket_groups: list, config: ParamGatherConfig):
        self.config = config
        self.method = config.method
        budget = config.ciera_cache_budget_mb if self.method == "ciera" else None
        self.budget_bytes = None if budget is None else budget * 2**20
        self.bucket_groups = bucket_groups
        self.rounds = 0  # choices made so far
        self.switched = False  # whether the last choice switched any of this rank's buckets
        self._new_round()

    def _new_meter(self):
        if self.method == "ciera":
            return BlockChangeMeter(self.config.ciera.block_size)
        return DeltaCostMeter(self.config.delta)

    def _new_round(self) -> None:
        self.meters = {bg: [self._new_meter() for _ in bg.buckets] for bg in self.bucket_groups}
        self.measured = {bg: 0 for bg in self.bucket_groups}

    @property
    def measuring(self) -> bool:
        return bool(self.meters)

    def restart(self) -> None:
        """Measure the next ``SELECTION_WARMUP_GATHERS`` gathers of every bucket group again, then choose
        again (``--param-gather-reselect-interval``); meanwhile every bucket keeps its current gather."""
        self._new_round()
        for bucket_group in self.bucket_groups:
            bucket_group.selection = self

    def before_gather(self, bucket_group) -> None:
        if self.measured[bucket_group] < SELECTION_WARMUP_GATHERS:
            for meter, bucket in zip(self.meters[bucket_group], bucket_group.buckets):
                if bucket_group.fused_cast:  # delta's: the meter times the encode the gathers will run
                    meter.update(new_shard(bucket_group, bucket), bucket.cast_masters.current())
                else:
                    meter.update(new_shard(bucket_group, bucket))
            self.measured[bucket_group] += 1
        else:
            self._select()

    def _select(self) -> None:
        by_group = {}
        for bucket_group in self.meters:
            group = bucket_group.intra_distributed_optimizer_instance_group
            by_group.setdefault(group, []).append(bucket_group)
        remaining, device = self.budget_bytes, bucket_device(next(iter(self.meters)))
        self.switched = False  # whether this choice switched any of this rank's buckets
        for group, bucket_groups in by_group.items():
            candidates = self._candidates(group, bucket_groups, device)
            if group not in _comm_models:
                _comm_models[group] = profile_comm(group)
            chosen = select_shards(candidates, _comm_models[group], remaining)
            chosen = _agreed(chosen, candidates, group, device)
            for candidate in candidates:
                group_index, bucket_index = candidate.key
                self.switched |= bucket_groups[group_index].select_bucket(bucket_index, candidate.key in chosen)
            if remaining is not None:
                remaining -= sum(c.cache_bytes for c in candidates if c.key in chosen)
            if group.rank() == 0:
                logger.info("%s%s", "" if not self.rounds else f"re-selection {self.rounds}: ",
                            selection_summary(candidates, chosen, _comm_models[group]))
        for bucket_group in self.meters:
            bucket_group.selection = None
        self.rounds += 1
        self.meters, self.measured = {}, {}  # the meters' codec state (delta: ~4 bytes per value) goes now

    def _candidates(self, group, bucket_groups: list, device) -> list:
        """Every bucket's shard, keyed (bucket group index, bucket index), with its measurements
        reduced over the group so that all ranks rank the same numbers."""
        if self.method == "delta":
            return self._delta_candidates(group, bucket_groups, device)
        rates = [m.change_rate for bg in bucket_groups for m in self.meters[bg]]
        rates = torch.tensor(rates, dtype=torch.float64, device=device)
        dist.all_reduce(rates, group=group)
        rates = iter((rates / group.size()).tolist())
        merge = self._merge_seconds_per_byte(group, bucket_groups, device)
        return [
            ShardStats(
                key=(group_index, bucket_index), numel=bucket.param_data.numel() // group.size(),
                change_rate=next(rates), cache_bytes=_bucket_cache_bytes(bucket, group.size(), self.config.ciera),
                block_size=self.config.ciera.block_size, dtype=bucket.param_data.dtype,
                merge_seconds=merge * 2 * (bucket.param_data.numel() // group.size()), world_size=group.size(),
            )
            for group_index, bg in enumerate(bucket_groups)
            for bucket_index, bucket in enumerate(bg.buckets)
        ]

    def _merge_seconds_per_byte(self, group, bucket_groups: list, device) -> float:
        """The paper's T_decmp per shard byte: CIERA's decode of a payload whose blocks all changed, as large as the
        largest shard (at most MERGE_PROBE_NUMEL values), on the slowest rank of ``group``."""
        buckets = [bucket for bg in bucket_groups for bucket in bg.buckets]
        numel = min(MERGE_PROBE_NUMEL, max(bucket.param_data.numel() // group.size() for bucket in buckets))
        seconds = measure_merge_seconds_per_byte(self.config.ciera, numel=max(numel, 1),
                                                 dtype=buckets[0].param_data.dtype, device=device)
        seconds = torch.tensor([seconds], dtype=torch.float64, device=device)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=group)
        return seconds.item()

    def _delta_candidates(self, group, bucket_groups: list, device) -> list:
        """Payload bytes averaged over the group (as sent: in slots with --delta-capacity-factor); encode and decode
        times of the slowest rank."""
        buckets = [(i, j, bucket, meter) for i, bg in enumerate(bucket_groups)
                   for j, (bucket, meter) in enumerate(zip(bg.buckets, self.meters[bg]))]
        # Unmeasured (fewer than two warm-up gathers): assume it would not shrink.
        measured = [meter.estimate() or (2 * bucket.param_data.numel() / group.size(), 0.0, 0.0)
                    for _, _, bucket, meter in buckets]
        payloads = torch.tensor([m[0] for m in measured], dtype=torch.float64, device=device)
        times = torch.tensor([m[1:] for m in measured], dtype=torch.float64, device=device)
        dist.all_reduce(payloads, group=group)
        dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
        # a sync-free gather (--delta-capacity-factor) sends its slot, about that many times the payload
        sent = max(1.0, self.config.delta_capacity_factor)
        payloads, times = (payloads * sent / group.size()).tolist(), times.tolist()
        return [
            DeltaShardStats(key=(i, j), numel=bucket.param_data.numel() // group.size(), payload_bytes=payloads[k],
                            encode_seconds=times[k][0], decode_seconds=times[k][1], world_size=group.size(),
                            sender_copy=not bucket_groups[i].fused_cast,
                            size_exchange=not self.config.delta_capacity_factor)
            for k, (i, j, bucket, _) in enumerate(buckets)
        ]


def _agreed(chosen: set, candidates: list, group, device) -> set:
    """The candidates chosen on every rank of ``group`` (normally all ranks already agree)."""
    flags = torch.tensor([c.key in chosen for c in candidates], dtype=torch.int32, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
    return {c.key for c, flag in zip(candidates, flags.tolist()) if flag}


def _bucket_cache_bytes(bucket, group_size: int, ciera: CieraConfig) -> int:
    """Persistent memory of compressing one rank's shard of ``bucket``: the sender's exponents (compare) or
    block hashes, plus on GPUs the codec's payload buffer (about the shard's own size)."""
    shard = bucket.param_data[:bucket.param_data.numel() // group_size]
    return (cache_bytes(shard.numel(), ciera.block_size, ciera.change_detect)
            + CieraCodec.payload_buffer_bytes(shard, ciera.block_size))


def build_selection_schedule(ddp_chunks: list, config: ParamGatherConfig, after_iters: int = 0):
    """The ``SelectionSchedule`` of ``apply_dp_compression``'s benefit selection, or None if there is no trial
    and no re-selection to run. The first trial starts no earlier than ``SELECTION_WINDOW_ITERATIONS``
    iterations from the start, nor before ``after_iters`` more (another trial's) have passed."""
    bucket_groups = compressed_bucket_groups(ddp_chunks)
    selection = bucket_groups[0].benefit if bucket_groups else None
    interval = config.reselect_interval
    if selection is None or not (config.trial_iters or interval) or not dist.is_initialized():
        return None
    device = bucket_device(bucket_groups[0])

    def set_compressing(compressing: bool, final: bool) -> None:
        for bucket_group in bucket_groups:
            bucket_group.set_compressing(compressing, final)

    def agree(*flags) -> tuple:  # every rank asks: a MAX over the world, since process groups choose apart
        flags = torch.tensor([int(flag) for flag in flags], device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return tuple(bool(flag) for flag in flags.tolist())

    def new_trial(skip: int):
        if not config.trial_iters:
            return None
        return CompressionTrial("parameter-gather compression", set_compressing, config.trial_iters,
                                flag="--param-gather-trial-iters", fallback="megatron-core's plain all-gather",
                                skip=skip)

    first_trial_after = max(SELECTION_WINDOW_ITERATIONS, TRIAL_SKIP_ITERATIONS + after_iters)
    def any_compressed() -> bool:
        return any(not isinstance(gather, PlainGather) for bg in bucket_groups for gather in bg.shard_gathers)

    return SelectionSchedule(selection, new_trial, interval, first_trial_after, agree, trial_skip_iterations(config),
                             any_compressed)


def trial_skip_iterations(config: ParamGatherConfig) -> int:
    """Iterations between a choice and the first its trial times. With ``--delta-cuda-graphs`` the rest of the run
    replays each gather as a CUDA graph, so the trial waits for the replays rather than timing the warm-up: a new
    codec's keyframe, its first delta (whose sizes set the slots' capacity), ``GRAPH_WARMUP`` eager gathers in slots
    and the capture, and one iteration more for ``--overlap-param-gather`` (a round's gathers run in the next
    iteration's forward)."""
    if config.method == "delta" and config.delta_cuda_graphs:
        return GRAPH_WARMUP + 4  # (always more than TRIAL_SKIP_ITERATIONS)
    return TRIAL_SKIP_ITERATIONS
