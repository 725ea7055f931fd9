"""Compressed parameter all-gather of megatron-core's distributed optimizer (CIERA, lossless delta).

After each optimizer step rank r has written its new 16-bit values into slice r of every bucket's
``param_data``; the stock ``_ParamAndGradBucketGroup.start_param_sync`` then all-gathers the bucket in
place. We swap the ``__class__`` of every bucket group to ``CompressedParamGatherBucketGroup``, whose
``start_param_sync`` sends each bucket through its own gather: a ``ShardGather`` with one stateful
``ShardCodec`` per bucket, or a plain all-gather for buckets that compression would not pay for.
Everything else of the bucket group (grad reduce-scatter, hooks, the next-bucket chain,
``finish_param_sync``) is megatron-core's own code, unchanged.

Invariants:
- Each bucket gathers over the group its bucket group already uses (the intra distributed-optimizer
  instance group: data-parallel for dense buckets, expert-data-parallel for expert buckets). Groups of
  one rank have nothing to send and keep the stock class.
- The codecs are lossless, so training is bit-identical to the uncompressed run.
- The first gather after install, and the first after ``reset_param_gather_state``, is a keyframe.
  Between keyframes the codecs rely on slice s of ``param_data`` holding rank s's previously gathered
  values, so anything that rewrites parameters (checkpoint load, broadcast) must reset them.
- Async (``--overlap-param-gather``): ``param_gather_handle.wait()`` waits and decodes into
  ``param_data``, so the stock ``finish_param_sync`` works as is. Sync: decoded before returning.
- ``--param-gather-verify-interval N``: every N-th gather of a bucket group is checked bit for bit
  against an uncompressed all-gather (a RuntimeError on any difference).
- ``--ciera-selection benefit``: the first ``SELECTION_WARMUP_GATHERS`` gathers of each bucket group
  are uncompressed while each bucket's block change rate is measured; then the buckets whose expected
  gain is positive are picked once, within ``--ciera-cache-budget-mb`` (compression/selection.py),
  identically on every rank of a group, and only those are compressed from then on.
"""

import logging

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel
from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

from compression.ciera import CieraCodec, CieraConfig
from compression.delta import DeltaCodec, DeltaConfig
from compression.selection import (
    BlockChangeMeter, ShardStats, cache_bytes, profile_comm, select_shards, selection_summary,
)
from compression.shard_gather import ShardGather
from compression.telemetry import TELEMETRY

logger = logging.getLogger(__name__)

PARAM_GATHER_METHODS = ("ciera", "delta")
SELECTION_WARMUP_GATHERS = 8  # uncompressed gathers that measure change rates before selecting
_SIXTEEN_BIT_DTYPES = (torch.bfloat16, torch.float16)
_comm_models = {}  # process group -> all-gather latency/bandwidth model, profiled once per group


class _PlainGather:
    """The uncompressed in-place all-gather of one bucket (what megatron-core itself does)."""

    def __init__(self, group):
        self.group = group

    def start(self, buffer: torch.Tensor, async_op: bool):
        shard = buffer.view(self.group.size(), -1)[self.group.rank()]
        nbytes = shard.numel() * shard.element_size()
        TELEMETRY.record("dp_param_gather", nbytes, nbytes)
        return dist.all_gather_into_tensor(buffer, shard, group=self.group, async_op=async_op)

    def verify(self, buffer: torch.Tensor) -> None:
        """Nothing to check: the bytes went uncompressed."""


class _DecodingHandle:
    """The async handle of one bucket group's gathers: ``wait()`` waits for (and thereby decodes)
    every bucket's gather, then runs the periodic verification."""

    def __init__(self, handles: list, on_complete):
        self._handles = handles
        self._on_complete = on_complete

    def wait(self) -> None:
        for handle in self._handles:
            handle.wait()
        self._on_complete()


class _BenefitSelection:
    """``--ciera-selection benefit``, shared by every bucket group of one install. The first
    ``SELECTION_WARMUP_GATHERS`` gathers of each bucket group go uncompressed while each bucket's block
    change rate is measured; then the buckets to compress are picked once, for all groups together.
    Process groups are decided in turn (dense first), each spending what is left of
    ``--ciera-cache-budget-mb``; a MIN over each group makes all of its ranks agree."""

    def __init__(self, bucket_groups: list, args):
        self.args = args
        self.budget_bytes = None if args.ciera_cache_budget_mb is None else args.ciera_cache_budget_mb * 2**20
        self.meters = {
            bg: [BlockChangeMeter(args.ciera_block_size) for _ in bg.buckets] for bg in bucket_groups
        }
        self.measured = {bg: 0 for bg in bucket_groups}

    def before_gather(self, bucket_group) -> None:
        if self.measured[bucket_group] < SELECTION_WARMUP_GATHERS:
            for meter, bucket in zip(self.meters[bucket_group], bucket_group.buckets):
                meter.update(_own_shard(bucket_group, bucket))
            self.measured[bucket_group] += 1
        else:
            self._select()

    def _select(self) -> None:
        by_group = {}
        for bucket_group in self.meters:
            group = bucket_group.intra_distributed_optimizer_instance_group
            by_group.setdefault(group, []).append(bucket_group)
        remaining, device = self.budget_bytes, _device(next(iter(self.meters)))
        for group, bucket_groups in by_group.items():
            candidates = self._candidates(group, bucket_groups, device)
            if group not in _comm_models:
                _comm_models[group] = profile_comm(group)
            chosen = select_shards(candidates, _comm_models[group], remaining)
            chosen = _agreed(chosen, candidates, group, device)
            for group_index, bucket_index in chosen:
                bucket_groups[group_index].compress_bucket(bucket_index)
            if remaining is not None:
                remaining -= sum(c.cache_bytes for c in candidates if c.key in chosen)
            if group.rank() == 0:
                logger.info("%s", selection_summary(candidates, chosen, _comm_models[group]))
        for bucket_group in self.meters:
            bucket_group.selection = None

    def _candidates(self, group, bucket_groups: list, device) -> list:
        """Every bucket's shard, keyed (bucket group index, bucket index), with its change rate
        averaged over the group so that all ranks rank the same numbers."""
        rates = [m.change_rate for bg in bucket_groups for m in self.meters[bg]]
        rates = torch.tensor(rates, dtype=torch.float64, device=device)
        dist.all_reduce(rates, group=group)
        rates = iter((rates / group.size()).tolist())
        return [
            ShardStats(
                key=(group_index, bucket_index), numel=bucket.param_data.numel() // group.size(),
                change_rate=next(rates), cache_bytes=_bucket_cache_bytes(bucket, group.size(), self.args),
                block_size=self.args.ciera_block_size, dtype=bucket.param_data.dtype,
            )
            for group_index, bg in enumerate(bucket_groups)
            for bucket_index, bucket in enumerate(bg.buckets)
        ]


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


class CompressedParamGatherBucketGroup(_ParamAndGradBucketGroup):
    """A bucket group whose parameter all-gather goes through one gather object per bucket.
    Attributes added at install: ``args``, ``codecs`` (None for uncompressed buckets),
    ``shard_gathers``, ``selection`` (None once decided), ``num_gathers``."""

    def start_param_sync(self, force_sync: bool = False):
        assert self.ddp_config.use_distributed_optimizer
        if force_sync and self.param_gather_handle is not None:
            self.param_gather_handle.wait()
            self.param_gather_handle = None
            self._post_param_sync_if_defined()
            return
        assert force_sync or self.param_gather_handle is None

        if self.selection is not None:
            self.selection.before_gather(self)
        async_op = self.ddp_config.overlap_param_gather and not force_sync
        handles = [
            gather.start(bucket.param_data, async_op)
            for gather, bucket in zip(self.shard_gathers, self.buckets)
        ]
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
        """Bit-compare every bucket against an uncompressed all-gather (a collective over the group)."""
        for bucket, gather in zip(self.buckets, self.shard_gathers):
            try:
                gather.verify(bucket.param_data)
            except RuntimeError as error:
                raise RuntimeError(
                    f"compressed parameter all-gather of bucket {bucket.bucket_id} differs from the "
                    f"uncompressed all-gather at gather {self.num_gathers} "
                    f"(--param-gather-verify-interval {self.args.param_gather_verify_interval}): {error}"
                ) from error

    def reset_codecs(self) -> None:
        if self.param_gather_handle is not None:
            raise RuntimeError(
                "reset_param_gather_state() was called while a parameter all-gather is in flight; "
                "call it only between iterations (e.g. right after loading a checkpoint)"
            )
        for codec in self.codecs:
            if codec is not None:
                codec.reset()

    def compress_bucket(self, index: int) -> None:
        """Send bucket ``index`` through CIERA from the next gather on (a keyframe)."""
        group = self.intra_distributed_optimizer_instance_group
        self.codecs[index] = build_shard_codec(self.args, group.size(), group.rank())
        self.shard_gathers[index] = ShardGather(self.codecs[index], group)

    def _post_param_sync_if_defined(self) -> None:
        # megatron-core >= 0.19 moved FP8 post-processing into _post_param_sync(), which
        # start_param_sync calls after a forced gather under overlap (a no-op for our 16-bit buckets,
        # kept so the override matches the stock method).
        post_param_sync = getattr(super(), "_post_param_sync", None)
        if post_param_sync is not None:
            post_param_sync()


def _bucket_cache_bytes(bucket, group_size: int, args) -> int:
    shard_numel = bucket.param_data.numel() // group_size
    return cache_bytes(shard_numel, args.ciera_block_size, args.ciera_change_detect)


def _check_args(args) -> None:
    if args.param_gather_compression not in PARAM_GATHER_METHODS:
        raise ValueError(
            f"--param-gather-compression must be one of {PARAM_GATHER_METHODS}, "
            f"got {args.param_gather_compression!r}"
        )
    if args.param_gather_verify_interval < 0:
        raise ValueError(
            f"--param-gather-verify-interval must be >= 0 (0 = off), got {args.param_gather_verify_interval}"
        )
    if args.param_gather_compression == "ciera":
        if args.ciera_selection not in ("all", "benefit"):
            raise ValueError(f"--ciera-selection must be 'all' or 'benefit', got {args.ciera_selection!r}")
        if args.ciera_cache_budget_mb is not None and args.ciera_selection != "benefit":
            raise ValueError(
                "--ciera-cache-budget-mb applies only with --ciera-selection benefit: "
                "add that or drop the budget"
            )
        if args.ciera_cache_budget_mb is not None and args.ciera_cache_budget_mb <= 0:
            raise ValueError(
                f"--ciera-cache-budget-mb must be positive (or omitted), got {args.ciera_cache_budget_mb}"
            )


def build_shard_codec(args, world_size: int, rank: int):
    """The stateful codec of one bucket, from ``--param-gather-compression`` and its options."""
    if args.param_gather_compression == "ciera":
        config = CieraConfig(
            block_size=args.ciera_block_size,
            change_detect=args.ciera_change_detect,
            exponent_coder=args.ciera_exponent_coder,
        )
        return CieraCodec(config, world_size, rank)
    return DeltaCodec(DeltaConfig(block_size=args.delta_block_size), world_size, rank)


def _check_supported(ddp: DistributedDataParallel) -> None:
    if not isinstance(ddp, DistributedDataParallel):
        raise ValueError(
            f"--param-gather-compression needs megatron-core's DistributedDataParallel, got "
            f"{type(ddp).__name__} (Megatron-FSDP is not supported: drop --use-megatron-fsdp)"
        )
    ddp_config = ddp.ddp_config
    if not ddp_config.use_distributed_optimizer:
        raise ValueError("--param-gather-compression requires --use-distributed-optimizer")
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
        if isinstance(bucket_group, CompressedParamGatherBucketGroup):
            raise ValueError("apply_param_gather_compression() was already applied to this model chunk")
        if bucket_group.param_gather_handle is not None:
            raise RuntimeError(
                "apply_param_gather_compression() must run while no parameter all-gather is in flight"
            )


def _install(bucket_group: _ParamAndGradBucketGroup, args, selection) -> None:
    group = bucket_group.intra_distributed_optimizer_instance_group
    num_buckets = len(bucket_group.buckets)
    bucket_group.__class__ = CompressedParamGatherBucketGroup
    bucket_group.args = args
    bucket_group.num_gathers = 0
    bucket_group.selection = selection
    if selection is not None:  # uncompressed until the selection decides
        bucket_group.codecs = [None] * num_buckets
        bucket_group.shard_gathers = [_PlainGather(group) for _ in range(num_buckets)]
        return
    # A fresh codec starts with a keyframe, so the first gather after install needs no state.
    bucket_group.codecs = [build_shard_codec(args, group.size(), group.rank()) for _ in range(num_buckets)]
    bucket_group.shard_gathers = [ShardGather(codec, group) for codec in bucket_group.codecs]


def apply_param_gather_compression(ddp_chunks: list, args) -> None:
    """Compress the distributed optimizer's parameter all-gather of every model chunk (dense and
    expert buckets). Call after DDP wrapping and optimizer construction."""
    _check_args(args)
    for ddp in ddp_chunks:
        _check_supported(ddp)
    bucket_groups = [
        bucket_group
        for ddp in ddp_chunks
        for bucket_group in ddp.bucket_groups + ddp.expert_parallel_bucket_groups
        if bucket_group.intra_distributed_optimizer_instance_size > 1
    ]
    benefit = args.param_gather_compression == "ciera" and args.ciera_selection == "benefit"
    selection = _BenefitSelection(bucket_groups, args) if benefit else None
    for bucket_group in bucket_groups:
        _install(bucket_group, args, selection)


def reset_param_gather_state(ddp_chunks: list) -> None:
    """Make the next gather of every bucket a keyframe. Call after loading a checkpoint or anything
    else that rewrites parameters. No-op for chunks without compression."""
    for ddp in ddp_chunks:
        for bucket_group in ddp.bucket_groups + ddp.expert_parallel_bucket_groups:
            if isinstance(bucket_group, CompressedParamGatherBucketGroup):
                bucket_group.reset_codecs()
