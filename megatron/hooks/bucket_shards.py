"""This rank's shard of a bucket of megatron-core's parameter buffer, as the compressed gathers read it."""

import torch


def own_shard(bucket_group, bucket) -> torch.Tensor:
    """This rank's shard of ``bucket``'s parameter buffer."""
    size = bucket_group.intra_distributed_optimizer_instance_size
    return bucket.param_data.view(size, -1)[bucket_group.intra_distributed_optimizer_instance_rank]


def new_shard(bucket_group, bucket) -> torch.Tensor:
    """The values this rank's shard of ``bucket`` gathers next: with ``--delta-fused-cast``'s copy pending, a rounded
    copy of the fp32 masters (the buffer keeps the old values for the delta encode), else the shard itself."""
    if getattr(bucket, "cast_pending", False):
        return bucket.cast_masters.current().to(bucket.param_data.dtype)
    return own_shard(bucket_group, bucket)


def cast_now(buckets: list) -> None:
    """``--delta-fused-cast``: the optimizer's pending fp32 -> 16-bit copy of these buckets' shards, done now."""
    for bucket in buckets:
        bucket.cast_masters.shard.copy_(bucket.cast_masters.current())
        bucket.cast_pending = False


def bucket_device(bucket_group) -> torch.device:
    return bucket_group.buckets[0].param_data.device
