"""The compressed parameter gathers of one model chunk, encoded ahead together (``PreparedGathers``): one size
exchange per process group and round instead of one per bucket (megatron/hooks/param_gather.py)."""

from compression.shard_gather import GatherFusions, ShardGather, prepare_gathers
from megatron.hooks.bucket_shards import own_shard


PREPARE_SHARD_BYTES = 512 * 2**20  # shard bytes whose encodes one size exchange covers: each encode holds
# workspace until its transfer (delta: 1.13x the shard), so a large model takes several exchanges


class PreparedGathers:
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
            nbytes = sum(own_shard(bucket_group, b).numel() * b.param_data.element_size()
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
