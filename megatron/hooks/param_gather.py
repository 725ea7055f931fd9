"""Compressed data-parallel communication of megatron-core's distributed optimizer: the parameter
all-gather (a method of ``PARAM_GATHER_METHODS``: CIERA, lossless delta, lossy SDP4Bit qWD) and the gradient
reduce-scatter (SDP4Bit's Hadamard-quantized int8/int4).

After each optimizer step rank r has written its new 16-bit values into slice r of every bucket's
``param_data``; the stock ``_ParamAndGradBucketGroup.start_param_sync`` then all-gathers the bucket in
place. We swap the ``__class__`` of every bucket group to ``CompressedBucketGroup``, whose
``start_param_sync`` sends each bucket through its own gather (``build_gather``: a ``ShardGather`` around a stateful
``ShardCodec``, a ``WeightDiffGather``; a ``PlainGather`` where compression would not pay), and whose
``start_grad_sync`` reduce-scatters each bucket through ``quantized_reduce_scatter``. Each override hands over to
megatron-core's own method when its flag is off; the rest of the bucket group is megatron-core's own code.

Invariants:
- Each bucket gathers over the group its bucket group already uses (the intra distributed-optimizer
  instance group: data-parallel for dense buckets, expert-data-parallel for expert buckets). Groups of
  one rank have nothing to send and keep the stock class.
- CIERA and delta are lossless: training is bit-identical to the uncompressed run. sdp4bit is lossy: the
  model's 16-bit params are the reconstruction, identical on every replica.
- The first gather after install, and the first after ``reset_param_gather_state``, is a keyframe. Between
  keyframes the codecs rely on slice s of ``param_data`` holding rank s's previously gathered values, so anything
  that rewrites parameters (checkpoint load, broadcast) must reset them.
- Async (``--overlap-param-gather``): ``param_gather_handle.wait()`` waits and decodes into ``param_data``, so the
  stock ``finish_param_sync`` works as is. Sync: decoded before returning.
- A chunk's compressed buckets are encoded ahead together (megatron/hooks/prepared_gathers.py).
- ``--param-gather-verify-interval N``: every N-th gather of a bucket group is checked bit for bit against an
  uncompressed all-gather (sdp4bit: every replica holds the same bits). ``--param-gather-keyframe-interval N``:
  every N-th gather goes uncompressed (the codecs observe it), rewriting every replica's copies. Integrity
  hashes: compression/shard_gather.py, docs/integrity.md.
- Gradient reduce-scatter: as the stock method (scaling, SUM or AVG into this rank's slice of ``grad_data``,
  first-batch return, overlap); ``force_all_reduce`` falls back to it.
- ``--param-gather-selection benefit``: megatron/hooks/param_gather_selection.py. ``--delta-fused-cast``:
  megatron/hooks/fused_cast.py (a bucket not compressed this time casts first). ``--delta-capacity-factor`` /
  ``--delta-cuda-graphs``: sync-free gathers, compression/shard_gather.py.
"""

import logging

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel
from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

from compression.sdp4bit import WeightDiffGather, quantized_reduce_scatter
from compression.shard_gather import ShardGather
from compression.telemetry import TELEMETRY
from megatron.hooks.config import GradReduceConfig, ParamGatherConfig
from megatron.hooks.bucket_shards import cast_now
from megatron.hooks.gather_methods import build_gather, integrity_check
from megatron.hooks.prepared_gathers import PreparedGathers

logger = logging.getLogger(__name__)

_SIXTEEN_BIT_DTYPES = (torch.bfloat16, torch.float16)


class PlainGather:
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


class CompressedBucketGroup(_ParamAndGradBucketGroup):
    """A bucket group whose parameter all-gather goes through one gather object per bucket and whose
    gradient reduce-scatter through the Hadamard-quantized collective. Attributes added at install:
    ``config``, ``comm_class`` (telemetry class of its parameter gathers: dense or expert buckets),
    ``shard_gathers`` (None: stock all-gather; a ``PlainGather`` for an uncompressed bucket),
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
        """Start each bucket's gather from what ``PreparedGathers`` prepared for it (gather, and the
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
        interval = self.config.keyframe_interval
        keyframe = interval > 0 and (self.num_gathers + 1) % interval == 0
        if not self.plain and not keyframe:
            for gather, bucket in zip(self.shard_gathers, self.buckets):
                if bucket in pending and isinstance(gather, ShardGather):  # (delta: the only codec fused_cast has)
                    gather.cast_from = bucket.cast_masters.current()
                    bucket.cast_pending = False
            cast_now([bucket for bucket in pending if bucket.cast_pending])
            return self.shard_gathers
        cast_now(pending)
        for gather, bucket in zip(self.shard_gathers, self.buckets):
            gather.observe(bucket.param_data)
        return [PlainGather(self.intra_distributed_optimizer_instance_group, self.comm_class)] * len(self.buckets)

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
        interval = self.config.verify_interval
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
                raise RuntimeError(f"compressed parameter all-gather of bucket {bucket.bucket_id} {what} at gather "
                                   f"{self.num_gathers} (--param-gather-verify-interval "
                                   f"{self.config.verify_interval}): {error}") from error

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
            raise RuntimeError("reset_param_gather_state() was called while a parameter all-gather is in flight; "
                               "call it only between iterations (e.g. right after loading a checkpoint)")
        for gather in self.shard_gathers or ():
            gather.reset()

    def select_bucket(self, index: int, compress: bool) -> bool:
        """From the next gather on, send bucket ``index`` through a codec (a new one starts with a keyframe; one
        already compressing goes on) or megatron-core's plain all-gather. Returns whether that switched it."""
        group, plain = self.intra_distributed_optimizer_instance_group, isinstance(self.shard_gathers[index], PlainGather)
        if compress != plain:
            return False
        self.prepared.fusions.drop(self.shard_gathers[index])
        self.shard_gathers[index] = (build_gather(self.config, group, self.comm_class, self.fused_cast, self.integrity,
                                                  _bucket_name(self.buckets[index])) if compress
                                     else PlainGather(group, self.comm_class))
        return True

    def set_compressing(self, compressing: bool, final: bool) -> None:
        """Trial switch: plain gathers while not ``compressing``; a final off drops the codecs."""
        self.prepared.flush()  # (empty between iterations) what was encoded goes out the way it was prepared
        self.plain = not compressing
        if final and not compressing:
            for gather in self.shard_gathers:
                self.prepared.fusions.drop(gather)
            group = self.intra_distributed_optimizer_instance_group
            self.shard_gathers = [PlainGather(group, self.comm_class) for _ in self.buckets]
            self.plain = False

    def _post_param_sync_if_defined(self) -> None:
        # megatron-core >= 0.18 moved FP8 post-processing into _post_param_sync(), which
        # start_param_sync calls after a forced gather under overlap (a no-op for our 16-bit buckets,
        # kept so the override matches the stock method).
        post_param_sync = getattr(super(), "_post_param_sync", None)
        if post_param_sync is not None:
            post_param_sync()


def _check_config(param_gather: ParamGatherConfig, grad_reduce: GradReduceConfig) -> None:
    """What the flags' configs cannot know: whether anything is asked for, and the devices."""
    if param_gather.method == "none" and grad_reduce.method == "none":
        raise ValueError("apply_dp_compression() needs --param-gather-compression or --grad-reduce-compression")
    if param_gather.delta_cuda_graphs and not torch.cuda.is_available():
        raise ValueError("--delta-cuda-graphs replays CUDA graphs and needs GPUs: drop the flag on CPU")


def _check_supported(ddp: DistributedDataParallel, param_gather: ParamGatherConfig,
                     grad_reduce: GradReduceConfig) -> None:
    flag = "--param-gather-compression" if param_gather.method != "none" else "--grad-reduce-compression"
    if not isinstance(ddp, DistributedDataParallel):
        raise ValueError(f"{flag} needs megatron-core's DistributedDataParallel, got {type(ddp).__name__} "
                         f"(Megatron-FSDP is not supported: drop --use-megatron-fsdp)")
    ddp_config = ddp.ddp_config
    if not ddp_config.use_distributed_optimizer:
        raise ValueError(f"{flag} requires --use-distributed-optimizer")
    for bucket_group in ddp.bucket_groups + ddp.expert_parallel_bucket_groups:
        if isinstance(bucket_group, CompressedBucketGroup):
            raise ValueError("apply_dp_compression() was already applied to this model chunk")
    if grad_reduce.method != "none" and ddp_config.num_distributed_optimizer_instances > 1:
        raise ValueError("--grad-reduce-compression with --num-distributed-optimizer-instances > 1 is not "
                         "implemented (the copies' all-reduce of the gradient shards): drop one of them")
    if param_gather.method != "none":
        _check_param_gather_supported(ddp)


def _check_param_gather_supported(ddp: DistributedDataParallel) -> None:
    ddp_config = ddp.ddp_config
    if ddp_config.fp8_param_gather or ddp_config.reuse_grad_buf_for_mxfp8_param_ag:
        raise ValueError("--param-gather-compression does not support FP8 parameters: drop --fp8-param-gather")
    for buffer in ddp.buffers + ddp.expert_parallel_buffers:
        if buffer.param_dtype not in _SIXTEEN_BIT_DTYPES:
            raise ValueError(f"--param-gather-compression carries 16-bit parameters only, but a parameter buffer "
                             f"holds {buffer.param_dtype}: train with --bf16 (or --fp16)")
    for bucket_group in ddp.bucket_groups + ddp.expert_parallel_bucket_groups:
        if bucket_group.param_gather_handle is not None:
            raise RuntimeError("apply_dp_compression() must run while no parameter all-gather is in flight")


def _install(bucket_group: _ParamAndGradBucketGroup, config: ParamGatherConfig, grad_reduce: GradReduceConfig,
             selection, comm_class: str, integrity) -> None:
    group = bucket_group.intra_distributed_optimizer_instance_group
    num_buckets = len(bucket_group.buckets)
    bucket_group.__class__ = CompressedBucketGroup
    bucket_group.config = config
    bucket_group.comm_class = comm_class
    bucket_group.num_gathers = 0
    bucket_group.selection = selection  # set while the selection measures (None once it has chosen)
    bucket_group.benefit = selection  # for good: re-selections restart it
    bucket_group.plain = False
    bucket_group.fused_cast = False  # set by megatron/hooks/fused_cast.py
    bucket_group.integrity = integrity  # the run's IntegrityCheck (None: off)
    bucket_group.grad_quant = grad_reduce.quant()
    if config.method == "none":
        bucket_group.shard_gathers = None
    elif selection is not None:  # uncompressed until the selection decides
        bucket_group.shard_gathers = [PlainGather(group, comm_class) for _ in range(num_buckets)]
    else:
        # A fresh codec starts with a keyframe, so the first gather after install needs no state.
        bucket_group.shard_gathers = [build_gather(config, group, comm_class, integrity=integrity,
                                                   name=_bucket_name(bucket)) for bucket in bucket_group.buckets]


def _bucket_name(bucket) -> str:
    return f"bucket {bucket.bucket_id}"


def apply_dp_compression(ddp_chunks: list, param_gather: ParamGatherConfig,
                         grad_reduce: GradReduceConfig = GradReduceConfig()) -> None:
    """Compress the distributed optimizer's parameter all-gather and/or gradient reduce-scatter of
    every model chunk (dense and expert buckets) as the configs ask. Call after DDP wrapping and optimizer
    construction."""
    _check_config(param_gather, grad_reduce)
    for ddp in ddp_chunks:
        _check_supported(ddp, param_gather, grad_reduce)
    classes = {  # bucket group -> telemetry class of its parameter all-gather
        bucket_group: comm_class
        for ddp in ddp_chunks
        for groups, comm_class in ((ddp.bucket_groups, "dp_param_gather"),
                                   (ddp.expert_parallel_bucket_groups, "dp_expert_param_gather"))
        for bucket_group in groups
        if bucket_group.intra_distributed_optimizer_instance_size > 1
    }
    selection = None
    if param_gather.benefit_selection:
        from megatron.hooks.param_gather_selection import BenefitSelection

        selection = BenefitSelection(list(classes), param_gather)
    integrity = integrity_check(param_gather)
    for bucket_group, comm_class in classes.items():
        _install(bucket_group, param_gather, grad_reduce, selection, comm_class, integrity)
    for ddp in ddp_chunks:
        chunk_groups = [bg for bg in ddp.bucket_groups + ddp.expert_parallel_bucket_groups if bg in classes]
        prepared = PreparedGathers(chunk_groups)
        for bucket_group in chunk_groups:
            bucket_group.prepared = prepared


def compressed_bucket_groups(ddp_chunks: list) -> list:
    return [bucket_group for ddp in ddp_chunks for bucket_group in ddp.bucket_groups + ddp.expert_parallel_bucket_groups
            if isinstance(bucket_group, CompressedBucketGroup)]


def reset_param_gather_state(ddp_chunks: list) -> None:
    """Make the next gather of every bucket a keyframe. Call after loading a checkpoint or anything
    else that rewrites parameters. No-op for chunks without compression."""
    for bucket_group in compressed_bucket_groups(ddp_chunks):
        bucket_group.reset_codecs()

