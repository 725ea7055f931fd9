"""``--dp-comm-emulate N``: a DP=1 run whose distributed-optimizer collectives have the numerics of a DP=N run's
compressed ones (SDP4Bit's quantized weight differences in the parameter all-gather, its Hadamard-quantized gradient
reduce-scatter).

Gradients. A DP=N run with micro-batch b reads, in its micro-step k, samples (k N + r) b ... (k N + r + 1) b - 1 on
rank r: micro-batch j = k N + r of a DP=1 run with the same micro-batch and global batch. So the DP=1 run's
micro-batch j is emulated rank j mod N's: when the next micro-batch starts (a forward pre-hook on the model chunk)
the gradients accumulated in the grad buffer move into that rank's own copy, and the reduce-scatter codes each
rank's copy as that rank's input (``compression.sdp4bit.emulated_reduce_scatter``), writing every rank's reduced
shard. Each rank's copy accumulates as its grad buffer would (from zero, in micro-batch order). DP=1 divides each
micro-batch's loss by N m (its micro-batch count), the real run by m and then its gradients by N: the same values,
so the emulated collective sums without averaging.

Parameters. The bucket layout is the real run's (megatron-core pads a bucket to a multiple of lcm(DP, 128), the same
for every DP dividing 128) and rank r's shard is slice r of N. Each slice is coded by its own rank's
``WeightDiffCodec`` and replaced by the reconstruction that every replica writes, so the one copy of the parameters
is every replica's (``compression.sdp4bit.emulated_weight_diff_gather``).

The emulated run is a DP=N run without overlapped collectives: megatron-core then keeps one bucket per buffer (with
overlap it splits buffers into buckets, which moves the shards SDP4Bit codes). Each rank's gradients are checked
(--check-for-nan-in-loss-and-grad) before they are coded, as each real rank checks its own. What differs from the real
run: the gradient norm is one sum instead of N partial sums (fp32 rounding, which gradient clipping passes on; without
clipping the losses are the real run's bits, tests/test_dp_emulation.py). Byte telemetry counts every emulated rank's
bytes, as a real run's metrics sum its ranks'.
"""

import logging

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel
from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

from compression.sdp4bit import WeightDiffCodec, emulated_reduce_scatter, emulated_weight_diff_gather
from megatron.hooks.config import CompressionConfig

logger = logging.getLogger(__name__)


class MicroBatchRanks:
    """Which emulated rank the gradients in a model chunk's grad buffers belong to: micro-batch j's are rank
    j mod N's. ``rank_grads`` holds, per bucket, the N ranks' accumulated gradients [N, bucket numel]."""

    def __init__(self, bucket_groups: list, size: int):
        self.size = size
        self.bucket_groups = bucket_groups
        self.rank_grads = {bucket: torch.zeros(size, bucket.grad_data.numel(), dtype=bucket.grad_data.dtype,
                                               device=bucket.grad_data.device)
                           for group in bucket_groups for bucket in group.buckets}
        self.micro_batches = 0  # forward passes with gradients in this iteration
        self.synced = set()  # bucket groups whose reduce-scatter ran this iteration

    def before_forward(self, module, inputs) -> None:
        """Forward pre-hook: a micro-batch starts; the previous one's gradients go to their rank."""
        if not torch.is_grad_enabled():  # evaluation
            return
        if self.micro_batches:
            self.take(self.rank_grads)
        self.micro_batches += 1

    def take(self, buckets) -> None:
        """Move the gradients of the last micro-batch in ``buckets`` into its rank's copy."""
        rank = (self.micro_batches - 1) % self.size
        for bucket in buckets:
            self.rank_grads[bucket][rank] += bucket.grad_data
            bucket.grad_data.zero_()

    def reduced(self, bucket_group) -> None:
        """``bucket_group``'s reduce-scatter ran; after the last one the next forward starts an iteration."""
        self.synced.add(bucket_group)
        if len(self.synced) == len(self.bucket_groups):
            self.synced.clear()
            self.micro_batches = 0


class EmulatedBucketGroup(_ParamAndGradBucketGroup):
    """A bucket group of a one-rank data-parallel group whose collectives reproduce a compressed DP=N run's.
    Attributes added at install: ``weight_codecs`` (per bucket the N ranks' ``WeightDiffCodec``, or None: stock
    gather), ``grad_quant`` (None: stock reduce-scatter), ``micro_batch_ranks`` (with ``grad_quant``)."""

    def start_param_sync(self, force_sync: bool = False):
        super().start_param_sync(force_sync)  # a group of one: nothing moves
        for bucket, codecs in zip(self.buckets, self.weight_codecs or ()):
            emulated_weight_diff_gather(codecs, bucket.param_data)

    def start_grad_sync(self, force_all_reduce: bool = False):
        if self.grad_quant is None:
            return super().start_grad_sync(force_all_reduce)
        ranks = self.micro_batch_ranks
        ranks.take(self.buckets)
        if self.ddp_config.check_for_nan_in_grad or self.ddp_config.check_for_large_grads:
            self._check_rank_grads()
        for bucket in self.buckets:
            rank_grads = ranks.rank_grads[bucket]
            if bucket.gradient_scaling_factor != 1.0:
                rank_grads *= bucket.gradient_scaling_factor
            if force_all_reduce:  # the compressed run falls back to the stock all-reduce: the exact sum
                torch.sum(rank_grads, 0, out=bucket.grad_data)
            else:
                emulated_reduce_scatter(list(rank_grads), bucket.grad_data, self.grad_quant)
            rank_grads.zero_()
        ranks.reduced(self)
        self.grad_reduce_handle = None

    def _check_rank_grads(self) -> None:
        """megatron-core's check of the local gradients before the collective, on each emulated rank's."""
        stock = [bucket.grad_data for bucket in self.buckets]
        try:
            for rank in range(self.micro_batch_ranks.size):
                for bucket in self.buckets:
                    bucket.grad_data = self.micro_batch_ranks.rank_grads[bucket][rank]
                self.check_grads(check_for_nan_or_inf=self.ddp_config.check_for_nan_in_grad,
                                 check_for_large=self.ddp_config.check_for_large_grads)
        finally:
            for bucket, grad_data in zip(self.buckets, stock):
                bucket.grad_data = grad_data

    def reset_codecs(self) -> None:
        for codecs in self.weight_codecs or ():
            for codec in codecs:
                codec.reset()


def _check_supported(ddp, size: int) -> None:
    if not isinstance(ddp, DistributedDataParallel):
        raise ValueError(f"--dp-comm-emulate needs megatron-core's DistributedDataParallel, got {type(ddp).__name__}")
    ddp_config = ddp.ddp_config
    if not ddp_config.use_distributed_optimizer:
        raise ValueError("--dp-comm-emulate emulates the distributed optimizer's collectives: add "
                         "--use-distributed-optimizer")
    if ddp_config.overlap_grad_reduce or ddp_config.overlap_param_gather:
        raise ValueError("--dp-comm-emulate emulates a DP=N run without overlapped collectives (one bucket per "
                         "buffer) and runs them in place: add --no-overlap-grad-reduce --no-overlap-param-gather")
    if ddp.expert_parallel_bucket_groups:
        raise ValueError("--dp-comm-emulate emulates dense models: drop --num-experts, or run real DP")
    for bucket_group in ddp.bucket_groups:
        if bucket_group.intra_distributed_optimizer_instance_size != 1:
            raise ValueError(f"--dp-comm-emulate {size} emulates DP={size} in a DP=1 run, but the data-parallel "
                             f"group has {bucket_group.intra_distributed_optimizer_instance_size} ranks")
        for bucket in bucket_group.buckets:
            if bucket.param_data.numel() % size:
                raise ValueError(f"--dp-comm-emulate {size}: bucket {bucket.bucket_id} of {bucket.param_data.numel()} "
                                 f"values does not split into {size} shards (use a power of two up to 128)")


def apply_dp_emulation(ddp_chunks: list, config: CompressionConfig) -> None:
    """Give the (one-rank) distributed optimizer's collectives of every model chunk the numerics of compressed
    DP=``config.dp_emulate``. Call after DDP wrapping and optimizer construction."""
    size = config.dp_emulate  # (CompressionConfig checked the codecs: sdp4bit weights and/or Hadamard gradients)
    if size < 2:
        raise ValueError(f"apply_dp_emulation() needs --dp-comm-emulate of 2 or more, got {size}")
    weights = config.param_gather.method == "sdp4bit"
    grad_quant = config.grad_reduce.quant()
    for ddp in ddp_chunks:
        _check_supported(ddp, size)
    for ddp in ddp_chunks:
        ranks = MicroBatchRanks(ddp.bucket_groups, size) if grad_quant is not None else None
        if ranks is not None:
            ddp.register_forward_pre_hook(ranks.before_forward)
        for bucket_group in ddp.bucket_groups:
            bucket_group.__class__ = EmulatedBucketGroup
            bucket_group.grad_quant = grad_quant
            bucket_group.micro_batch_ranks = ranks
            bucket_group.weight_codecs = ([[WeightDiffCodec(config.param_gather.sdp4bit, size, rank)
                                            for rank in range(size)] for _ in bucket_group.buckets]
                                          if weights else None)
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.info("DP emulation: the distributed optimizer's collectives as DP=%d's (parameter gather: %s, gradient "
                    "reduce-scatter: %s)", size, config.param_gather.method, config.grad_reduce.method)


def reset_emulated_codecs(ddp_chunks: list) -> None:
    """Every bucket's next emulated gather is a keyframe (after a checkpoint load)."""
    for ddp in ddp_chunks:
        for bucket_group in ddp.bucket_groups:
            if isinstance(bucket_group, EmulatedBucketGroup):
                bucket_group.reset_codecs()
