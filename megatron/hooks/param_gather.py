"""Compressed data-parallel communication of megatron-core's distributed optimizer: the parameter
all-gather (CIERA, lossless delta, lossy SDP4Bit qWD) and the gradient reduce-scatter (SDP4Bit's
Hadamard-quantized int8/int4).

After each optimizer step rank r has written its new 16-bit values into slice r of every bucket's
``param_data``; the stock ``_ParamAndGradBucketGroup.start_param_sync`` then all-gathers the bucket in
place. We swap the ``__class__`` of every bucket group to ``CompressedBucketGroup``, whose
``start_param_sync`` sends each bucket through its own gather: a ``ShardGather`` with one stateful
``ShardCodec`` per bucket, a ``WeightDiffGather`` (sdp4bit), or a plain all-gather for buckets that
compression would not pay for; and whose ``start_grad_sync`` reduce-scatters each bucket through
``quantized_reduce_scatter``. Each override hands over to megatron-core's own method when its flag is
off. Everything else of the bucket group (hooks, the next-bucket chain, ``finish_param_sync``,
``finish_grad_sync``) is megatron-core's own code, unchanged.

Invariants:
- Each bucket gathers over the group its bucket group already uses (the intra distributed-optimizer
  instance group: data-parallel for dense buckets, expert-data-parallel for expert buckets). Groups of
  one rank have nothing to send and keep the stock class.
- CIERA and delta are lossless, so training is bit-identical to the uncompressed run. sdp4bit is
  lossy: the model's 16-bit params are the reconstruction w_hat, identical on every replica.
- The first gather after install, and the first after ``reset_param_gather_state``, is a keyframe.
  Between keyframes the codecs rely on slice s of ``param_data`` holding rank s's previously gathered
  values, so anything that rewrites parameters (checkpoint load, broadcast) must reset them.
- Async (``--overlap-param-gather``): ``param_gather_handle.wait()`` waits and decodes into
  ``param_data``, so the stock ``finish_param_sync`` works as is. Sync: decoded before returning.
- The first bucket group of a model chunk to start in a round encodes the compressed buckets of the
  groups that start after it too and exchanges all their sizes at once (``_PreparedGathers``): one host
  sync per process group and round instead of one per bucket, with and without overlap. Delta buckets that
  hold their codec state are coded as one shard there (``GatherFusions``: one encode, payload, all-gather and
  decode per source for all of them, sharing one transfer; with overlap, the first bucket group goes alone).
- ``--param-gather-verify-interval N``: every N-th gather of a bucket group is checked bit for bit
  against an uncompressed all-gather (a RuntimeError on any difference); for the lossy sdp4bit, which
  has no uncompressed result to match, every rank must hold the same bits instead (a checksum).
- ``--param-gather-integrity-check`` (on by default; delta): every delta gather also carries a 64-bit hash of each
  sender's change, computed by the encode kernel, which each receiver compares with its decode's (computed by the
  decode kernel); a bucket whose decode differs anywhere in the group is gathered again uncompressed (bit-exact),
  counted (``<comm class>/integrity_mismatches``) and logged with its bucket and iteration, and the
  ``--param-gather-integrity-max-mismatches``-th such gather stops the run (compression/shard_gather.py,
  docs/integrity.md). ``--param-gather-keyframe-interval N``: every N-th gather of a bucket group goes uncompressed
  (as a trial's plain gather: the codecs observe it), so a receiver's slice that went wrong unseen is rewritten.
- Gradient reduce-scatter (``--grad-reduce-compression``): like the stock method, scale each bucket by
  its ``gradient_scaling_factor`` in place, then leave the SUM (AVG with ``average_in_collective``) of
  this rank's shard in its slice of ``grad_data``; the first-batch early return, the overlap (a
  ``.wait()``-able ``grad_reduce_handle``) and the sync path behave as the stock method.
  ``force_all_reduce`` falls back to the stock method; several distributed-optimizer instances are refused.
- ``--param-gather-selection benefit`` (the default; CIERA and delta): the first
  ``SELECTION_WARMUP_GATHERS`` gathers of each bucket group are uncompressed while each bucket is
  measured (CIERA: block change rate; delta: payload, encode and decode time of the real shard); then
  the buckets whose expected gain is positive are picked (CIERA: within ``--ciera-cache-budget-mb``;
  compression/selection.py), identically on every rank of a group, and only those are compressed from
  then on: where compression would make the gather slower, the bucket keeps megatron-core's plain
  all-gather. ``--param-gather-reselect-interval N``: every N iterations the buckets are measured again
  (each keeping its gather meanwhile) and chosen again. ``all`` compresses every bucket from the start.
- ``--delta-fused-cast`` (megatron/hooks/fused_cast.py): the optimizer leaves the fp32 -> 16-bit copy of delta
  buckets ``cast_pending``; ``_param_gathers`` hands it to the bucket's delta encode (``ShardGather.cast_from``), or
  does it first where the bucket is not compressed this time.
- ``--delta-capacity-factor F`` / ``--delta-cuda-graphs``: delta gathers that follow a gather with known sizes send
  their payloads in slots of F x the last sizes, with no size exchange before the transfer (their one sync at the
  end), and may be captured and replayed as CUDA graphs (compression/shard_gather.py); an overflowing payload is
  followed by the bucket's uncompressed gather, so training stays bit-identical.
- ``--param-gather-trial-iters`` (with ``benefit``): the per-bucket model can promise a gain that the
  iteration never sees (the gather overlaps compute, or costs less inside the step than alone), so
  after each choice the training loop (``SelectionSchedule``) alternates plain and compressed gathers
  and keeps compression only if iterations get faster. A plain gather during the trial calls each codec's
  ``observe`` with the shard it sent (delta: its sender copy; CIERA: a keyframe next), so switching
  back needs no extra state and both modes stay bit-exact. With ``--delta-cuda-graphs`` a trial times its
  iterations only once the new codecs' gathers replay (``trial_skip_iterations``).
"""

import logging

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel
from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

from compression.ciera import CieraCodec, CieraConfig
from compression.delta import DeltaCodec, DeltaConfig
from compression.selection import (
    MERGE_PROBE_NUMEL, SELECTION_WARMUP_GATHERS, SELECTION_WINDOW_ITERATIONS, BlockChangeMeter, DeltaCostMeter,
    DeltaShardStats, ShardStats, cache_bytes, measure_merge_seconds_per_byte, profile_comm, select_shards,
    selection_summary,
)
from compression.sdp4bit import (
    HadamardQuantConfig, Sdp4bitConfig, WeightDiffCodec, WeightDiffGather, quantized_reduce_scatter,
)
from compression.shard_gather import GRAPH_WARMUP, GatherFusions, IntegrityCheck, ShardGather, prepare_gathers
from compression.telemetry import TELEMETRY
from megatron.hooks.trial import TRIAL_SKIP_ITERATIONS, CompressionTrial

logger = logging.getLogger(__name__)

PARAM_GATHER_METHODS = ("none", "ciera", "delta", "sdp4bit")
GRAD_REDUCE_METHODS = ("none", "hadamard-int8", "hadamard-int4")
SELECTABLE_METHODS = ("ciera", "delta")  # lossless: --param-gather-selection applies; sdp4bit compresses all
_SIXTEEN_BIT_DTYPES = (torch.bfloat16, torch.float16)
_comm_models = {}  # process group -> all-gather latency/bandwidth model, profiled once per group


class _PlainGather:
    """The uncompressed in-place all-gather of one bucket (what megatron-core itself does)."""

    def __init__(self, group, comm_class: str):
        self.group = group
        self.comm_class = comm_class

    def start(self, buffer: torch.Tensor, async_op: bool):
        shard = buffer.view(self.group.size(), -1)[self.group.rank()]
        nbytes = shard.numel() * shard.element_size()
        TELEMETRY.record(self.comm_class, nbytes, nbytes)
        return dist.all_gather_into_tensor(buffer, shard, group=self.group, async_op=async_op)

    def verify(self, buffer: torch.Tensor) -> None:
        """Nothing to check: the bytes went uncompressed."""

    def reset(self) -> None:
        """No state."""

    def observe(self, buffer: torch.Tensor) -> None:
        """No state."""


class _DecodingHandle:
    """The async handle of one bucket group's collectives: ``wait()`` waits for (and thereby decodes)
    every bucket's collective, then runs ``on_complete``."""

    def __init__(self, handles: list, on_complete=lambda: None):
        self._handles = handles
        self._on_complete = on_complete

    def wait(self) -> None:
        for handle in self._handles:
            handle.wait()
        self._on_complete()


class _BenefitSelection:
    """``--param-gather-selection benefit``, shared by every bucket group of one install. The first
    ``SELECTION_WARMUP_GATHERS`` gathers of each bucket group go uncompressed while each bucket is
    measured (CIERA: its block change rate; delta: its payload and codec times, by coding the real
    shard); then the buckets to compress are picked, for all groups together (and again after each
    ``restart``). Process groups are decided in turn (dense first), CIERA's spending what is left of
    ``--ciera-cache-budget-mb``; a MIN over each group makes all of its ranks agree."""

    def __init__(self, bucket_groups: list, args):
        self.args = args
        self.method = args.param_gather_compression
        budget = args.ciera_cache_budget_mb if self.method == "ciera" else None
        self.budget_bytes = None if budget is None else budget * 2**20
        self.bucket_groups = bucket_groups
        self.rounds = 0  # choices made so far
        self.switched = False  # whether the last choice switched any of this rank's buckets
        self._new_round()

    def _new_meter(self):
        if self.method == "ciera":
            return BlockChangeMeter(self.args.ciera_block_size)
        return DeltaCostMeter(DeltaConfig(block_size=self.args.delta_block_size))

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
                    meter.update(_new_shard(bucket_group, bucket), bucket.cast_masters.current())
                else:
                    meter.update(_new_shard(bucket_group, bucket))
            self.measured[bucket_group] += 1
        else:
            self._select()

    def _select(self) -> None:
        by_group = {}
        for bucket_group in self.meters:
            group = bucket_group.intra_distributed_optimizer_instance_group
            by_group.setdefault(group, []).append(bucket_group)
        remaining, device = self.budget_bytes, _device(next(iter(self.meters)))
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
                change_rate=next(rates), cache_bytes=_bucket_cache_bytes(bucket, group.size(), self.args),
                block_size=self.args.ciera_block_size, dtype=bucket.param_data.dtype,
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
        seconds = measure_merge_seconds_per_byte(ciera_config(self.args), numel=max(numel, 1),
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
        sent = max(1.0, self.args.delta_capacity_factor)
        payloads, times = (payloads * sent / group.size()).tolist(), times.tolist()
        return [
            DeltaShardStats(key=(i, j), numel=bucket.param_data.numel() // group.size(), payload_bytes=payloads[k],
                            encode_seconds=times[k][0], decode_seconds=times[k][1], world_size=group.size(),
                            sender_copy=not bucket_groups[i].fused_cast,
                            size_exchange=not self.args.delta_capacity_factor)
            for k, (i, j, bucket, _) in enumerate(buckets)
        ]


def _cast(buckets: list) -> None:
    """``--delta-fused-cast``: the optimizer's pending fp32 -> 16-bit copy of these buckets' shards, done now."""
    for bucket in buckets:
        bucket.cast_masters.shard.copy_(bucket.cast_masters.current())
        bucket.cast_pending = False


def _agreed(chosen: set, candidates: list, group, device) -> set:
    """The candidates chosen on every rank of ``group`` (normally all ranks already agree)."""
    flags = torch.tensor([c.key in chosen for c in candidates], dtype=torch.int32, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
    return {c.key for c, flag in zip(candidates, flags.tolist()) if flag}


def _device(bucket_group) -> torch.device:
    return bucket_group.buckets[0].param_data.device


def _own_shard(bucket_group, bucket) -> torch.Tensor:
    size = bucket_group.intra_distributed_optimizer_instance_size
    return bucket.param_data.view(size, -1)[bucket_group.intra_distributed_optimizer_instance_rank]


def _new_shard(bucket_group, bucket) -> torch.Tensor:
    """The values this rank's shard of ``bucket`` gathers next: with ``--delta-fused-cast``'s copy pending, a rounded
    copy of the fp32 masters (the buffer keeps the old values for the delta encode), else the shard itself."""
    if getattr(bucket, "cast_pending", False):
        return bucket.cast_masters.current().to(bucket.param_data.dtype)
    return _own_shard(bucket_group, bucket)


class CompressedBucketGroup(_ParamAndGradBucketGroup):
    """A bucket group whose parameter all-gather goes through one gather object per bucket and whose
    gradient reduce-scatter through the Hadamard-quantized collective. Attributes added at install:
    ``args``, ``comm_class`` (telemetry class of its parameter gathers: dense or expert buckets),
    ``shard_gathers`` (None: stock all-gather; a ``_PlainGather`` for an uncompressed bucket),
    ``selection`` (set while the selection measures), ``benefit`` (the selection, or None),
    ``num_gathers``, ``grad_quant`` (None: stock reduce-scatter)."""

    def start_param_sync(self, force_sync: bool = False):
        if self.shard_gathers is None:
            return super().start_param_sync(force_sync)
        assert self.ddp_config.use_distributed_optimizer
        if force_sync and self.param_gather_handle is not None:
            self.param_gather_handle.wait()
            self.param_gather_handle = None
            self._post_param_sync_if_defined()
            return
        assert force_sync or self.param_gather_handle is None

        async_op = self.ddp_config.overlap_param_gather and not force_sync
        self._transfer(self.prepared.take(self), async_op, force_sync)

    def _transfer(self, prepared: list, async_op: bool, force_sync: bool = False) -> None:
        """Start each bucket's gather from what ``_PreparedGathers`` prepared for it (gather, and the
        exchanged sizes of its encode or None for gathers started here) and record it as dispatched."""
        handles = [gather.start(bucket.param_data, async_op) if ready is None
                   else gather.transfer(bucket.param_data, ready, async_op)
                   for (gather, ready), bucket in zip(prepared, self.buckets)]
        self._param_gathers_started(handles, async_op, force_sync)

    def _param_gathers(self) -> list:
        """This gather's object per bucket (the selection measures first; a trial's plain iteration keeps
        every codec's sender in step). ``--delta-fused-cast``: a bucket whose optimizer copy is pending has it done
        by its delta encode if compressed now, else here first."""
        pending = [bucket for bucket in self.buckets if getattr(bucket, "cast_pending", False)]
        if self.selection is not None:
            self.selection.before_gather(self)
        interval = self.args.param_gather_keyframe_interval
        keyframe = interval > 0 and (self.num_gathers + 1) % interval == 0
        if not self.plain and not keyframe:
            for gather, bucket in zip(self.shard_gathers, self.buckets):
                if bucket in pending and isinstance(gather, ShardGather):  # (delta: the only codec fused_cast has)
                    gather.cast_from = bucket.cast_masters.current()
                    bucket.cast_pending = False
            _cast([bucket for bucket in pending if bucket.cast_pending])
            return self.shard_gathers
        _cast(pending)
        for gather, bucket in zip(self.shard_gathers, self.buckets):
            gather.observe(bucket.param_data)
        return [_PlainGather(self.intra_distributed_optimizer_instance_group, self.comm_class)] * len(self.buckets)

    def _param_gathers_started(self, handles: list, async_op: bool, force_sync: bool) -> None:
        if async_op:
            self.param_gather_handle = _DecodingHandle([h for h in handles if h is not None], self._gathered)
        else:
            self._gathered()
            self.param_gather_handle = None
        if force_sync and self.ddp_config.overlap_param_gather:
            # Stock too: with overlap, no finish_param_sync follows a forced gather to post-process it.
            self._post_param_sync_if_defined()
        self.param_gather_dispatched = True

    def _gathered(self) -> None:
        self.num_gathers += 1
        interval = self.args.param_gather_verify_interval
        if interval > 0 and self.num_gathers % interval == 0:
            self.verify()

    def verify(self) -> None:
        """Bit-compare every bucket against an uncompressed all-gather, or for a lossy gather check that
        all replicas agree (a collective over the group)."""
        for bucket, gather in zip(self.buckets, self.shard_gathers):
            try:
                gather.verify(bucket.param_data)
            except RuntimeError as error:
                what = ("is not identical on every data-parallel replica" if isinstance(gather, WeightDiffGather)
                        else "differs from the uncompressed all-gather")
                raise RuntimeError(
                    f"compressed parameter all-gather of bucket {bucket.bucket_id} {what} at gather "
                    f"{self.num_gathers} (--param-gather-verify-interval "
                    f"{self.args.param_gather_verify_interval}): {error}"
                ) from error

    def finish_grad_sync(self, *args, **kwargs):
        self.prepared.flush()  # the end of a round: the optimizer step comes next
        return super().finish_grad_sync(*args, **kwargs)

    def start_grad_sync(self, force_all_reduce: bool = False):
        if self.grad_quant is None or force_all_reduce:
            return super().start_grad_sync(force_all_reduce)
        if self.is_first_batch and self.grad_reduce_handle is not None:
            return  # already dispatched in the first batch (stock behaviour)
        assert self.grad_reduce_handle is None, "Should not have multiple communication calls outstanding at once"
        if self.ddp_config.check_for_nan_in_grad or self.ddp_config.check_for_large_grads:
            self.check_grads(check_for_nan_or_inf=self.ddp_config.check_for_nan_in_grad,
                             check_for_large=self.ddp_config.check_for_large_grads)
        async_op = self.ddp_config.overlap_grad_reduce
        handles = [self._reduce_scatter(bucket, async_op) for bucket in self.buckets]
        self.grad_reduce_handle = _DecodingHandle(handles) if async_op else None

    def _reduce_scatter(self, bucket, async_op: bool):
        if bucket.gradient_scaling_factor != 1.0:
            bucket.grad_data *= bucket.gradient_scaling_factor
        size = self.intra_distributed_optimizer_instance_size
        shard = bucket.grad_data.view(size, -1)[self.intra_distributed_optimizer_instance_rank]
        return quantized_reduce_scatter(
            shard, bucket.grad_data, self.grad_quant, group=self.intra_distributed_optimizer_instance_group,
            average=self.ddp_config.average_in_collective, async_op=async_op,
        )

    def reset_codecs(self) -> None:
        if self.param_gather_handle is not None or self in self.prepared.pending:
            raise RuntimeError(
                "reset_param_gather_state() was called while a parameter all-gather is in flight; "
                "call it only between iterations (e.g. right after loading a checkpoint)"
            )
        for gather in self.shard_gathers or ():
            gather.reset()

    def select_bucket(self, index: int, compress: bool) -> bool:
        """From the next gather on, send bucket ``index`` through a codec (a new one starts with a keyframe; one
        already compressing goes on) or megatron-core's plain all-gather. Returns whether that switched it."""
        group, plain = self.intra_distributed_optimizer_instance_group, isinstance(self.shard_gathers[index], _PlainGather)
        if compress != plain:
            return False
        self.prepared.fusions.drop(self.shard_gathers[index])
        self.shard_gathers[index] = (build_gather(self.args, group, self.comm_class, self.fused_cast, self.integrity,
                                                  _bucket_name(self.buckets[index])) if compress
                                     else _PlainGather(group, self.comm_class))
        return True

    def set_compressing(self, compressing: bool, final: bool) -> None:
        """Trial switch: plain gathers while not ``compressing``; a final off drops the codecs."""
        self.prepared.flush()  # (empty between iterations) what was encoded goes out the way it was prepared
        self.plain = not compressing
        if final and not compressing:
            for gather in self.shard_gathers:
                self.prepared.fusions.drop(gather)
            group = self.intra_distributed_optimizer_instance_group
            self.shard_gathers = [_PlainGather(group, self.comm_class) for _ in self.buckets]
            self.plain = False

    def _post_param_sync_if_defined(self) -> None:
        # megatron-core >= 0.18 moved FP8 post-processing into _post_param_sync(), which
        # start_param_sync calls after a forced gather under overlap (a no-op for our 16-bit buckets,
        # kept so the override matches the stock method).
        post_param_sync = getattr(super(), "_post_param_sync", None)
        if post_param_sync is not None:
            post_param_sync()


PREPARE_SHARD_BYTES = 512 * 2**20  # shard bytes whose encodes one size exchange covers: each encode holds
# workspace until its transfer (delta: 1.13x the shard), so a large model takes several exchanges


class _PreparedGathers:
    """The compressed parameter gathers of one model chunk, encoded together. megatron-core starts a chunk's
    bucket groups one at a time (without overlap: all in a row after the optimizer step; with
    ``--overlap-param-gather``: each from the forward pre-hook of the one before), and a compressed gather
    alone waits for its size exchange: a host sync per bucket that idles the device while the host queues
    that bucket's transfer (and, during the forward, drains the work the host had queued ahead). So the
    first bucket group to start encodes its own buckets and those of the groups that follow it (megatron's
    order, up to ``PREPARE_SHARD_BYTES``) and exchanges all their sizes at once, one host sync per process
    group; the groups that follow find their sizes ready and only queue transfers. The parameters are final
    for the whole round once the optimizer step has run, so encoding ahead changes nothing in the bits."""

    def __init__(self, bucket_groups: list):
        self.bucket_groups = bucket_groups  # dense then expert groups: megatron-core's order without overlap
        self.pending = {}  # bucket group -> per bucket (gather, PreparedGather or None), not yet transferred
        self.fusions = GatherFusions()  # delta buckets coded as one, across bucket groups (one launch each way)

    def take(self, bucket_group) -> list:
        if bucket_group not in self.pending:
            self._prepare(bucket_group)
        return self.pending.pop(bucket_group)

    def flush(self) -> None:
        """Transfer (synchronously) whatever was prepared and not started: every encode must go out, and before
        the next optimizer step (``finish_grad_sync``) rewrites the parameters it encoded. Normally empty:
        every bucket group starts its gather in each round."""
        while self.pending:
            bucket_group, prepared = next(iter(self.pending.items()))
            del self.pending[bucket_group]
            bucket_group._transfer(prepared, async_op=False)

    def _following(self, first) -> list:
        """``first`` and the groups that start after it this round. A round starts the groups that megatron-core's
        last gradient sync left undispatched: in the overlap's chain from ``first``, then in list order. A forced
        re-gather (``start_param_sync(force_sync=True)`` after a round: ``first`` is dispatched already) goes
        through the list in order, so only the groups after ``first`` are still to come."""
        if first.param_gather_dispatched:
            later = self.bucket_groups[self.bucket_groups.index(first) + 1:]
            return [first] + [bg for bg in later if bg.shard_gathers is not None]
        order, group = [first], first.next_param_gather_bucket_group
        while group is not None and group in self.bucket_groups and group not in order:
            order.append(group)
            group = group.next_param_gather_bucket_group
        order += [bg for bg in self.bucket_groups if bg not in order]  # e.g. the expert groups' own chain
        return [first] + [bg for bg in order[1:] if bg.shard_gathers is not None and not bg.param_gather_dispatched]

    def _prepare(self, first) -> None:
        batch, shard_bytes = [], 0
        for bucket_group in self._following(first):
            nbytes = sum(_own_shard(bucket_group, b).numel() * b.param_data.element_size()
                         for b in bucket_group.buckets)
            if batch and shard_bytes + nbytes > PREPARE_SHARD_BYTES:
                break
            batch.append(bucket_group)
            shard_bytes += nbytes
        gathers = {bg: bg._param_gathers() for bg in batch}
        # Fused delta buckets share one transfer, which the first of them to be waited for waits for whole. With
        # --overlap-param-gather the first group is waited for at once (its layers come first), so it goes alone
        # and the others' fused transfer overlaps its layers' forward, as megatron-core's chain of gathers does.
        alone = set(gathers[first]) if first.ddp_config.overlap_param_gather and len(batch) > 1 else set()
        by_group = {}  # process group -> (ShardGather, buffer) pairs: one size exchange each
        for bucket_group, group_gathers in gathers.items():
            for gather, bucket in zip(group_gathers, bucket_group.buckets):
                if isinstance(gather, ShardGather):
                    by_group.setdefault(gather.group, []).append((gather, bucket.param_data))
        ready = {}  # ShardGather (one per bucket) -> its PreparedGather
        for pairs in by_group.values():
            shard_gathers, buffers = zip(*pairs)
            ready.update(zip(shard_gathers, prepare_gathers(list(shard_gathers), list(buffers), self.fusions, alone)))
        self.pending.update({bg: [(g, ready.get(g)) for g in group_gathers] for bg, group_gathers in gathers.items()})


def _bucket_cache_bytes(bucket, group_size: int, args) -> int:
    """Persistent memory of compressing one rank's shard of ``bucket``: the sender's exponents (compare) or
    block hashes, plus on GPUs the codec's payload buffer (about the shard's own size)."""
    shard = bucket.param_data[:bucket.param_data.numel() // group_size]
    return (cache_bytes(shard.numel(), args.ciera_block_size, args.ciera_change_detect)
            + CieraCodec.payload_buffer_bytes(shard, args.ciera_block_size))


def _check_args(args) -> None:
    if args.param_gather_compression not in PARAM_GATHER_METHODS:
        raise ValueError(
            f"--param-gather-compression must be one of {PARAM_GATHER_METHODS}, "
            f"got {args.param_gather_compression!r}"
        )
    if args.grad_reduce_compression not in GRAD_REDUCE_METHODS:
        raise ValueError(
            f"--grad-reduce-compression must be one of {GRAD_REDUCE_METHODS}, got {args.grad_reduce_compression!r}"
        )
    if args.param_gather_compression == "none" and args.grad_reduce_compression == "none":
        raise ValueError("apply_dp_compression() needs --param-gather-compression or --grad-reduce-compression")
    if args.param_gather_verify_interval < 0:
        raise ValueError(
            f"--param-gather-verify-interval must be >= 0 (0 = off), got {args.param_gather_verify_interval}"
        )
    if args.delta_cuda_graphs and not torch.cuda.is_available():
        raise ValueError("--delta-cuda-graphs replays CUDA graphs and needs GPUs: drop the flag on CPU")
    if args.param_gather_selection not in ("all", "benefit"):
        raise ValueError(f"--param-gather-selection must be 'all' or 'benefit', got {args.param_gather_selection!r}")
    if args.param_gather_compression == "ciera":
        if args.ciera_cache_budget_mb is not None and args.param_gather_selection != "benefit":
            raise ValueError(
                "--ciera-cache-budget-mb applies only with --param-gather-selection benefit: "
                "add that or drop the budget"
            )
        if args.ciera_cache_budget_mb is not None and args.ciera_cache_budget_mb <= 0:
            raise ValueError(
                f"--ciera-cache-budget-mb must be positive (or omitted), got {args.ciera_cache_budget_mb}"
            )


def ciera_config(args) -> CieraConfig:
    return CieraConfig(block_size=args.ciera_block_size, change_detect=args.ciera_change_detect,
                       exponent_coder=args.ciera_exponent_coder)


def build_gather(args, group, comm_class: str, cast: bool = False, integrity: IntegrityCheck = None,
                 name: str = "bucket"):
    """The compressed gather of one bucket over ``group``, from ``--param-gather-compression`` and its
    options; its bytes are counted as ``comm_class``. ``cast``: a delta codec of ``--delta-fused-cast``.
    ``integrity``: the run's integrity check (delta; None: off); ``name``: the bucket, as logs name it."""
    world_size, rank = group.size(), group.rank()
    method = args.param_gather_compression
    if method == "sdp4bit":
        config = Sdp4bitConfig(group_size=args.sdp4bit_group_size, weight_bits=args.sdp4bit_weight_bits)
        return WeightDiffGather(WeightDiffCodec(config, world_size, rank), group, comm_class)
    if method == "ciera":
        return ShardGather(CieraCodec(ciera_config(args), world_size, rank), group, comm_class)
    codec = DeltaCodec(DeltaConfig(block_size=args.delta_block_size), world_size, rank, cast=cast,
                       integrity=integrity is not None)
    return ShardGather(codec, group, comm_class, capacity_factor=args.delta_capacity_factor,
                       cuda_graphs=args.delta_cuda_graphs, integrity=integrity, name=name)


def integrity_check(args):
    """The run's ``IntegrityCheck`` (``--param-gather-integrity-check``), or None; its logs name the training
    iteration that megatron-core's rerun state machine holds (the driver sets it)."""
    if not args.param_gather_integrity_check:
        return None

    def iteration():
        from megatron.core.rerun_state_machine import get_rerun_state_machine

        return getattr(get_rerun_state_machine(), "current_iteration", None)

    return IntegrityCheck(args.param_gather_integrity_max_mismatches, iteration)


def _check_supported(ddp: DistributedDataParallel, args) -> None:
    flag = "--param-gather-compression" if args.param_gather_compression != "none" else "--grad-reduce-compression"
    if not isinstance(ddp, DistributedDataParallel):
        raise ValueError(
            f"{flag} needs megatron-core's DistributedDataParallel, got "
            f"{type(ddp).__name__} (Megatron-FSDP is not supported: drop --use-megatron-fsdp)"
        )
    ddp_config = ddp.ddp_config
    if not ddp_config.use_distributed_optimizer:
        raise ValueError(f"{flag} requires --use-distributed-optimizer")
    for bucket_group in ddp.bucket_groups + ddp.expert_parallel_bucket_groups:
        if isinstance(bucket_group, CompressedBucketGroup):
            raise ValueError("apply_dp_compression() was already applied to this model chunk")
    if args.grad_reduce_compression != "none" and ddp_config.num_distributed_optimizer_instances > 1:
        raise ValueError("--grad-reduce-compression with --num-distributed-optimizer-instances > 1 is not "
                         "implemented (the copies' all-reduce of the gradient shards): drop one of them")
    if args.param_gather_compression != "none":
        _check_param_gather_supported(ddp)


def _check_param_gather_supported(ddp: DistributedDataParallel) -> None:
    ddp_config = ddp.ddp_config
    if ddp_config.fp8_param_gather or ddp_config.reuse_grad_buf_for_mxfp8_param_ag:
        raise ValueError(
            "--param-gather-compression does not support FP8 parameters: drop --fp8-param-gather"
        )
    for buffer in ddp.buffers + ddp.expert_parallel_buffers:
        if buffer.param_dtype not in _SIXTEEN_BIT_DTYPES:
            raise ValueError(
                f"--param-gather-compression carries 16-bit parameters only, but a parameter buffer "
                f"holds {buffer.param_dtype}: train with --bf16 (or --fp16)"
            )
    for bucket_group in ddp.bucket_groups + ddp.expert_parallel_bucket_groups:
        if bucket_group.param_gather_handle is not None:
            raise RuntimeError("apply_dp_compression() must run while no parameter all-gather is in flight")


def _install(bucket_group: _ParamAndGradBucketGroup, args, selection, comm_class: str, integrity) -> None:
    group = bucket_group.intra_distributed_optimizer_instance_group
    num_buckets = len(bucket_group.buckets)
    bucket_group.__class__ = CompressedBucketGroup
    bucket_group.args = args
    bucket_group.comm_class = comm_class
    bucket_group.num_gathers = 0
    bucket_group.selection = selection  # set while the selection measures (None once it has chosen)
    bucket_group.benefit = selection  # for good: re-selections restart it
    bucket_group.plain = False
    bucket_group.fused_cast = False  # set by megatron/hooks/fused_cast.py
    bucket_group.integrity = integrity  # the run's IntegrityCheck (None: off)
    method = args.grad_reduce_compression
    bucket_group.grad_quant = (
        None if method == "none" else HadamardQuantConfig.from_flags(method, args.grad_reduce_block_size)
    )
    if args.param_gather_compression == "none":
        bucket_group.shard_gathers = None
    elif selection is not None:  # uncompressed until the selection decides
        bucket_group.shard_gathers = [_PlainGather(group, comm_class) for _ in range(num_buckets)]
    else:
        # A fresh codec starts with a keyframe, so the first gather after install needs no state.
        bucket_group.shard_gathers = [build_gather(args, group, comm_class, integrity=integrity,
                                                   name=_bucket_name(bucket)) for bucket in bucket_group.buckets]


def _bucket_name(bucket) -> str:
    return f"bucket {bucket.bucket_id}"


def apply_dp_compression(ddp_chunks: list, args) -> None:
    """Compress the distributed optimizer's parameter all-gather and/or gradient reduce-scatter of
    every model chunk (dense and expert buckets), as ``--param-gather-compression`` and
    ``--grad-reduce-compression`` ask. Call after DDP wrapping and optimizer construction."""
    _check_args(args)
    for ddp in ddp_chunks:
        _check_supported(ddp, args)
    classes = {  # bucket group -> telemetry class of its parameter all-gather
        bucket_group: comm_class
        for ddp in ddp_chunks
        for groups, comm_class in ((ddp.bucket_groups, "dp_param_gather"),
                                   (ddp.expert_parallel_bucket_groups, "dp_expert_param_gather"))
        for bucket_group in groups
        if bucket_group.intra_distributed_optimizer_instance_size > 1
    }
    benefit = args.param_gather_compression in SELECTABLE_METHODS and args.param_gather_selection == "benefit"
    selection = _BenefitSelection(list(classes), args) if benefit else None
    integrity = integrity_check(args)
    for bucket_group, comm_class in classes.items():
        _install(bucket_group, args, selection, comm_class, integrity)
    for ddp in ddp_chunks:
        chunk_groups = [bg for bg in ddp.bucket_groups + ddp.expert_parallel_bucket_groups if bg in classes]
        prepared = _PreparedGathers(chunk_groups)
        for bucket_group in chunk_groups:
            bucket_group.prepared = prepared


def _compressed_bucket_groups(ddp_chunks: list) -> list:
    return [bucket_group for ddp in ddp_chunks for bucket_group in ddp.bucket_groups + ddp.expert_parallel_bucket_groups
            if isinstance(bucket_group, CompressedBucketGroup)]


class SelectionSchedule:
    """``--param-gather-selection benefit`` over a run, for the training loop (``before_iteration`` /
    ``after_iteration`` around each iteration, 1-based): with ``--param-gather-reselect-interval N`` the
    buckets are measured and chosen again every N iterations, and every choice that switches a bucket and
    leaves one compressed gets an end-to-end trial (``--param-gather-trial-iters``, megatron/hooks/trial.py).
    One choice is not enough: the first comes from a run's first gathers, whose steps changed far more values
    than later ones in our runs (GPT-350M on 2x H200: wire ratio 2.1x at iteration 5, 3.1x at 20, 7.4x
    at 40, 11.8x from 58 on), and a learning-rate schedule keeps moving the payload over a run. Both modes
    of every bucket are bit-exact, so training is the same whatever is chosen."""

    def __init__(self, selection: _BenefitSelection, new_trial, interval: int, first_trial_after: int, agree,
                 trial_skip: int):
        self.selection, self.new_trial, self.interval = selection, new_trial, interval
        self.first_trial_after = first_trial_after  # iterations from the start before the first trial may start
        self.trial_skip = trial_skip  # iterations from a choice before its trial times any
        self.agree = agree  # (switched, compressed) flags of this rank -> the MAX of each over all ranks
        self.trial, self.start, self.choices_seen, self.active = None, None, 0, False

    @property
    def compressing(self) -> bool:
        """Whether any bucket is compressed in the current iteration (a trial's plain iterations: no)."""
        return self.active and (self.trial is None or self.trial.compressing)

    def before_iteration(self, iteration: int) -> None:
        if self.start is None:
            self.start = iteration
        due = self.interval and iteration > 1 and (iteration - 1) % self.interval == 0
        # not while a choice is still being measured or tried (e.g. just after a resume): the next one is due soon
        if due and not self.selection.measuring and (self.trial is None or self.trial.decided):
            self.selection.restart()
        if self.selection.rounds > self.choices_seen:  # a choice was made during the last iteration
            self.choices_seen = self.selection.rounds
            switched, self.active = self.agree(self.selection.switched, self._any_compressed())
            if switched and self.active:
                skip = max(self.trial_skip, self.start + self.first_trial_after - iteration)
                self.trial = self.new_trial(skip)
        if self.trial is not None:
            self.trial.before_iteration(iteration)

    def after_iteration(self, iteration: int, seconds: float, device: torch.device) -> None:
        if self.trial is not None:
            self.trial.after_iteration(iteration, seconds, device)

    def _any_compressed(self) -> bool:
        return any(not isinstance(gather, _PlainGather)
                   for bucket_group in self.selection.bucket_groups for gather in bucket_group.shard_gathers)


def build_selection_schedule(ddp_chunks: list, args, after_iters: int = 0):
    """The ``SelectionSchedule`` of ``apply_dp_compression``'s benefit selection, or None if there is no trial
    and no re-selection to run. The first trial starts no earlier than ``SELECTION_WINDOW_ITERATIONS``
    iterations from the start, nor before ``after_iters`` more (another trial's) have passed."""
    bucket_groups = _compressed_bucket_groups(ddp_chunks)
    selection = bucket_groups[0].benefit if bucket_groups else None
    interval = args.param_gather_reselect_interval
    if selection is None or not (args.param_gather_trial_iters or interval) or not dist.is_initialized():
        return None
    device = _device(bucket_groups[0])

    def set_compressing(compressing: bool, final: bool) -> None:
        for bucket_group in bucket_groups:
            bucket_group.set_compressing(compressing, final)

    def agree(*flags) -> tuple:  # every rank asks: a MAX over the world, since process groups choose apart
        flags = torch.tensor([int(flag) for flag in flags], device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return tuple(bool(flag) for flag in flags.tolist())

    def new_trial(skip: int):
        if not args.param_gather_trial_iters:
            return None
        return CompressionTrial("parameter-gather compression", set_compressing, args.param_gather_trial_iters,
                                flag="--param-gather-trial-iters", fallback="megatron-core's plain all-gather",
                                skip=skip)

    first_trial_after = max(SELECTION_WINDOW_ITERATIONS, TRIAL_SKIP_ITERATIONS + after_iters)
    return SelectionSchedule(selection, new_trial, interval, first_trial_after, agree, trial_skip_iterations(args))


def trial_skip_iterations(args) -> int:
    """Iterations between a choice and the first its trial times. With ``--delta-cuda-graphs`` the rest of the run
    replays each gather as a CUDA graph, so the trial waits for the replays rather than timing the warm-up: a new
    codec's keyframe, its first delta (whose sizes set the slots' capacity), ``GRAPH_WARMUP`` eager gathers in slots
    and the capture, and one iteration more for ``--overlap-param-gather`` (a round's gathers run in the next
    iteration's forward)."""
    if args.param_gather_compression == "delta" and args.delta_cuda_graphs:
        return GRAPH_WARMUP + 4  # (always more than TRIAL_SKIP_ITERATIONS)
    return TRIAL_SKIP_ITERATIONS


def reset_param_gather_state(ddp_chunks: list) -> None:
    """Make the next gather of every bucket a keyframe. Call after loading a checkpoint or anything
    else that rewrites parameters. No-op for chunks without compression."""
    for bucket_group in _compressed_bucket_groups(ddp_chunks):
        bucket_group.reset_codecs()

