"""What megatron-core's torch-norm fallback (``WrappedTorchNorm``: the local spec's norm without apex, and its
RMSNorm always) refuses to build: sequence parallelism and zero-centered gamma.

- Sequence parallelism: a norm over the hidden dimension is exact on a sequence shard. The only extra duty
  under SP is that the norm's weight and bias carry ``param.sequence_parallel = True``, so
  ``finalize_model_grads`` sums their gradients over the tensor-parallel group (as apex's FusedLayerNorm
  tags them).
- Zero-centered gamma (``layernorm_zero_centered_gamma``, Megatron-LM's ``--apply-layernorm-1p``): the weight
  is stored as gamma - 1, initialized to 0, and applied as 1 + weight, as apex's FusedLayerNorm and
  Transformer Engine's norms do.

Each hook builds the norm with its option off (megatron-core asserts it off) and then applies it.
"""

import contextlib

import torch
import torch.nn.functional as F

from megatron.core.transformer import torch_norm

_allowed_options = set()  # the config options WrappedTorchNorm now builds under


class ZeroCenteredLayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` whose weight is gamma - 1."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        torch.nn.init.zeros_(self.weight)

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class ZeroCenteredRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` whose weight is gamma - 1."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        torch.nn.init.zeros_(self.weight)

    def forward(self, x):
        return F.rms_norm(x, self.normalized_shape, self.weight + 1, self.eps)


ZERO_CENTERED = {torch.nn.LayerNorm: ZeroCenteredLayerNorm, torch.nn.RMSNorm: ZeroCenteredRMSNorm}


@contextlib.contextmanager
def _option_off(config, name: str):
    """Turn ``config.<name>`` off while megatron-core builds the norm; yields its value."""
    value = getattr(config, name)
    setattr(config, name, False)
    try:
        yield value
    finally:
        setattr(config, name, value)


def _allow_option(name: str, finish) -> None:
    """Let ``WrappedTorchNorm`` build under ``config.<name>``: built with it off, then ``finish(norm, value)``.
    Idempotent per option; the wrappers of several options nest."""
    if name in _allowed_options:
        return
    build_norm = torch_norm.WrappedTorchNorm.__new__

    def __new__(cls, config, hidden_size, eps=1e-5, **kwargs):
        with _option_off(config, name) as value:
            norm = build_norm(cls, config, hidden_size, eps, **kwargs)
        finish(norm, value)
        return norm

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(__new__)
    _allowed_options.add(name)


def _tag_sequence_parallel(norm, sequence_parallel: bool) -> None:
    for param in norm.parameters():
        param.sequence_parallel = sequence_parallel


def _center_gamma(norm, zero_centered_gamma: bool) -> None:
    if zero_centered_gamma:
        norm.__class__ = ZERO_CENTERED[type(norm)]
        norm.reset_parameters()


def allow_sequence_parallel_torch_norm() -> None:
    """Let ``WrappedTorchNorm`` build under ``sequence_parallel=True``. Idempotent."""
    _allow_option("sequence_parallel", _tag_sequence_parallel)


def allow_zero_centered_gamma_torch_norm() -> None:
    """Let ``WrappedTorchNorm`` build under ``layernorm_zero_centered_gamma=True``. Idempotent."""
    _allow_option("layernorm_zero_centered_gamma", _center_gamma)
