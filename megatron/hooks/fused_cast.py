"""``--delta-fused-cast``: the distributed optimizer's fp32 -> 16-bit parameter copy of delta-coded buckets done by
the delta encode itself.

megatron-core's optimizer step ends by rounding each fp32 master shard into the parameter buffer
(``_copy_main_params_to_model_params``), which overwrites the previous values; so the delta codec keeps a sender copy
of them (2 bytes per shard value) and its encode reads old and new values and writes that copy. With this hook the
optimizer skips the copy for the buckets whose gather is a delta ``ShardGather``: it marks them ``cast_pending``, and
the bucket's next gather rounds the fp32 values into the buffer itself, inside the encode kernel where the gather is
compressed (coding against the values it overwrites: no sender copy; ``compression.codec.CastShard``) and just before
it otherwise (a plain gather, a keyframe, the selection's measurements). Either way the buffer ends holding exactly
what the stock copy writes, so training is bit-identical.

The kernel reads a bucket's master shard as one fp32 tensor laid out as the bucket's shard (``bucket.cast_masters``):
at install the optimizer's main params of the bucket move into it and become views of it (the same tensor objects,
so the optimizer's state and megatron-core's references to them are untouched); its positions that no main param
covers (padding) hold the buffer's own values, which round back to the same bits. Something that replaces a main
param's storage (rather than writing into it) is noticed before each use and the bucket moved again.

With ``--overlap-param-gather`` the own shard's 16-bit values are the previous step's until the next forward's gather
(the other shards' are in megatron-core too): code that reads or rewrites model params in between must gather first
(``disable_forward_pre_hook(param_sync=True)``, as the driver does before saves). Measurements: docs/delta.md.
"""

import torch

from compression.shard_gather import ShardGather
from megatron.hooks.param_gather import CompressedBucketGroup


def _optimizers(optimizer) -> list:
    """The distributed optimizers inside ``optimizer`` (a ChainedOptimizer holds one per parameter kind)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _shard_range(bucket, group_size: int, group_rank: int) -> tuple:
    size = bucket.param_data.numel() // group_size
    return group_rank * size, size


class _BucketMasters:
    """One bucket's fp32 master shard: ``source`` (fp32, the bucket shard's layout) and the main params in it."""

    def __init__(self, bucket, group_size: int, group_rank: int, pieces: list):
        self.bucket, self.pieces = bucket, pieces  # pieces: (main param, offset in the shard)
        first, size = _shard_range(bucket, group_size, group_rank)
        self.shard = bucket.param_data[first:first + size]
        self.source = self.shard.float()  # padding keeps the buffer's values: they round back to the same bits
        self._home()

    def _home(self) -> None:
        for main, offset in self.pieces:
            view = self.source[offset:offset + main.numel()]
            view.copy_(main.detach().view(-1))
            main.data = view.view_as(main)
        self._homed = [main.data_ptr() for main, _ in self.pieces]

    def current(self) -> torch.Tensor:
        """``source``, after moving back any main param whose storage was replaced since."""
        if any(main.data_ptr() != ptr for (main, _), ptr in zip(self.pieces, self._homed)):
            self._home()
        return self.source


def _bucket_pieces(optimizer, buckets: dict) -> dict:
    """bucket -> [(main param, offset in this rank's shard)] for every 16-bit parameter of ``optimizer`` that lies
    in one of ``buckets`` (bucket -> (group size, group rank)), from where its data sits in the bucket's buffer."""
    by_param = {param: bucket for bucket in buckets for param in bucket.params}
    pieces = {}
    for model_group in optimizer.model_float16_groups:
        for model_param in model_group:
            bucket = by_param.get(model_param)
            main = getattr(model_param, "main_param", None)
            if bucket is None or main is None:
                continue
            group_size, group_rank = buckets[bucket]
            first, size = _shard_range(bucket, group_size, group_rank)
            start = (model_param.data_ptr() - bucket.param_data.data_ptr()) // bucket.param_data.element_size()
            lo, hi = max(start, first), min(start + model_param.numel(), first + size)
            if hi - lo != main.numel():
                raise RuntimeError(f"--delta-fused-cast: a main parameter of {main.numel()} values does not match its "
                                   f"{max(hi - lo, 0)} values in bucket {bucket.bucket_id}'s shard (megatron-core's "
                                   f"buffer layout changed?): drop --delta-fused-cast")
            pieces.setdefault(bucket, []).append((main, lo - first))
    return pieces


def _skip_copies(optimizer, masters: list) -> None:
    """``optimizer._copy_main_params_to_model_params`` without the params of ``masters``' buckets, which it marks
    ``cast_pending`` instead; megatron-core's own method copies the rest."""
    in_cast = {id(main) for m in masters for main, _ in m.pieces}
    stock = optimizer._copy_main_params_to_model_params
    kept = [[(main, model) for main, model in zip(mains, models) if id(main) not in in_cast]
            for mains, models in zip(optimizer.shard_fp32_from_float16_groups, optimizer.model_float16_groups)]
    kept_mains = [[main for main, _ in group] for group in kept]
    kept_models = [[model for _, model in group] for group in kept]

    def copy_main_params_to_model_params():
        saved = optimizer.shard_fp32_from_float16_groups, optimizer.model_float16_groups
        optimizer.shard_fp32_from_float16_groups, optimizer.model_float16_groups = kept_mains, kept_models
        try:
            stock()
        finally:
            optimizer.shard_fp32_from_float16_groups, optimizer.model_float16_groups = saved
        for m in masters:
            m.bucket.cast_pending = True

    optimizer._copy_main_params_to_model_params = copy_main_params_to_model_params


def apply_delta_fused_cast(ddp_chunks: list, optimizer) -> int:
    """Install ``--delta-fused-cast`` on every bucket that ``apply_dp_compression`` gave delta gathers (call after it).
    Returns the number of buckets whose copy moved into their gather."""
    groups = [bg for ddp in ddp_chunks for bg in ddp.bucket_groups + ddp.expert_parallel_bucket_groups
              if isinstance(bg, CompressedBucketGroup) and bg.shard_gathers is not None]
    if any(bg.config.method != "delta" for bg in groups):
        raise ValueError("--delta-fused-cast needs --param-gather-compression delta")
    buckets = {bucket: (bg.intra_distributed_optimizer_instance_size, bg.intra_distributed_optimizer_instance_rank)
               for bg in groups for bucket in bg.buckets}
    optimizers = []
    for opt in _optimizers(optimizer):
        if getattr(opt, "is_stub_optimizer", False):
            continue
        if not hasattr(opt, "model_float16_groups") or not hasattr(opt, "shard_fp32_from_float16_groups"):
            raise ValueError(f"--delta-fused-cast needs megatron-core's DistributedOptimizer with fp32 main params, got "
                             f"{type(opt).__name__} (e.g. --use-precision-aware-optimizer keeps them inside the "
                             f"optimizer): drop --delta-fused-cast")
        optimizers.append((opt, _bucket_pieces(opt, buckets)))
    if not optimizers:
        return 0
    for bucket_group in groups:  # its codecs from now on code CastShards (and keep no sender copy)
        bucket_group.fused_cast = True
        for gather in bucket_group.shard_gathers:
            if isinstance(gather, ShardGather):
                gather.codec.cast_mode()
    # A shard of padding only has no main params: the first optimizer marks its (identity) cast pending too, since
    # the bucket's codec codes CastShards only (a plain shard would be a keyframe).
    owned = {bucket for _, pieces in optimizers for bucket in pieces}
    optimizers[0][1].update({bucket: [] for bucket in buckets if bucket not in owned})
    for opt, pieces in optimizers:
        masters = [_BucketMasters(bucket, *buckets[bucket], bucket_pieces) for bucket, bucket_pieces in pieces.items()]
        for master in masters:
            master.bucket.cast_masters, master.bucket.cast_pending = master, False
        if masters:
            _skip_copies(opt, masters)
    return len(buckets)
