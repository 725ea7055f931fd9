"""Sequence parallelism with torch's LayerNorm/RMSNorm when apex and Transformer Engine are absent.

megatron-core's local-spec fallback (``WrappedTorchNorm``) refuses ``sequence_parallel`` although a
norm over the hidden dimension is exact on a sequence shard. The only extra duty under SP is that the
norm's weight and bias carry ``param.sequence_parallel = True``, so ``finalize_model_grads`` sums their
gradients over the tensor-parallel group (as apex's FusedLayerNorm tags them).
"""

from megatron.core.transformer import torch_norm

_applied = False


def allow_sequence_parallel_torch_norm() -> None:
    """Let ``WrappedTorchNorm`` build under ``sequence_parallel=True``. Idempotent."""
    global _applied
    if _applied:
        return
    build_norm = torch_norm.WrappedTorchNorm.__new__

    def __new__(cls, config, hidden_size, eps=1e-5, **kwargs):
        sequence_parallel = config.sequence_parallel
        config.sequence_parallel = False
        try:
            norm = build_norm(cls, config, hidden_size, eps, **kwargs)
        finally:
            config.sequence_parallel = sequence_parallel
        for param in norm.parameters():
            param.sequence_parallel = sequence_parallel
        return norm

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(__new__)
    _applied = True
