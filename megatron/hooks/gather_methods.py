"""The parameter-gather methods by name (``--param-gather-compression``): how each builds one bucket's gather.

A gather is a ``ShardGather`` around a stateful ``ShardCodec`` (``compression/codec.py``), or an object with the
same ``start / verify / reset / observe`` methods (``WeightDiffGather``). Adding a method is one entry here
(docs/adding-a-codec.md); the flag's choices and the config's check are read from this table. The codec modules
are imported when a gather is built, so reading the names imports no codec.
"""

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class GatherMethod:
    build: Callable
    """``build(config, group, comm_class, cast, integrity, name)``: the gather of one bucket over ``group``
    (``config``: the ``ParamGatherConfig``; ``comm_class``: the telemetry class its bytes count as; ``cast``: a delta
    codec of ``--delta-fused-cast``; ``integrity``: the run's ``IntegrityCheck`` or None; ``name``: the bucket, as
    logs name it)."""
    lossless: bool
    """Bit-exact: verification compares with an uncompressed gather, and keyframes apply."""
    selectable: bool = False
    """``--param-gather-selection benefit`` has a model of its gain (megatron/hooks/param_gather_selection.py);
    the others compress every bucket."""


def _ciera(config, group, comm_class, cast=False, integrity=None, name="bucket"):
    from compression.ciera import CieraCodec
    from compression.shard_gather import ShardGather

    return ShardGather(CieraCodec(config.ciera, group.size(), group.rank()), group, comm_class)


def _delta(config, group, comm_class, cast=False, integrity=None, name="bucket"):
    from compression.delta import DeltaCodec
    from compression.shard_gather import ShardGather

    codec = DeltaCodec(config.delta, group.size(), group.rank(), cast=cast, integrity=integrity is not None)
    return ShardGather(codec, group, comm_class, capacity_factor=config.delta_capacity_factor,
                       cuda_graphs=config.delta_cuda_graphs, integrity=integrity, name=name)


def _sdp4bit(config, group, comm_class, cast=False, integrity=None, name="bucket"):
    from compression.sdp4bit import WeightDiffCodec, WeightDiffGather

    return WeightDiffGather(WeightDiffCodec(config.sdp4bit, group.size(), group.rank()), group, comm_class)


PARAM_GATHER_METHODS = {
    "ciera": GatherMethod(_ciera, lossless=True, selectable=True),
    "delta": GatherMethod(_delta, lossless=True, selectable=True),
    "sdp4bit": GatherMethod(_sdp4bit, lossless=False),
}


def build_gather(config, group, comm_class: str, cast: bool = False, integrity=None, name: str = "bucket"):
    """The compressed gather of one bucket over ``group`` by ``config.method``."""
    return PARAM_GATHER_METHODS[config.method].build(config, group, comm_class, cast, integrity, name)


def integrity_check(config):
    """The run's ``IntegrityCheck`` (``--param-gather-integrity-check``), or None; its logs name the training
    iteration that megatron-core's rerun state machine holds (the driver sets it)."""
    if not config.integrity_check:
        return None

    def iteration():
        from megatron.core.rerun_state_machine import get_rerun_state_machine

        return getattr(get_rerun_state_machine(), "current_iteration", None)

    from compression.shard_gather import IntegrityCheck

    return IntegrityCheck(config.integrity_max_mismatches, iteration)
