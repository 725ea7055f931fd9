"""``--pp-comm-emulate N``: a PP=1 run whose hidden states cross the stage boundaries of a PP=N run as that run's
compressed messages do.

A PP=N run of equal stages sends, per micro-batch, the output of the last layer of stage k (decoder layer
``(k + 1) L / N - 1``) to stage k + 1, which computes on the decoded message; in the backward, stage k + 1 sends the
gradient of that tensor back, and stage k back-propagates the decoded gradient (with ``--pp-comm-compress-grads``).
So one process has the same numerics when each boundary layer's output passes through ``decode(encode(.))`` in the
forward and its gradient likewise in the backward (``PipelineMessage``), the codec being the one
``--pp-comm-compression`` builds (``megatron/hooks/pp.py``). With ``--tp-comm-emulate M --sequence-parallel`` each of
the M tensor-parallel ranks sends its own sequence shard: M messages of ``s / M`` tokens (the codec's rows).

Byte telemetry counts what the boundary stages send (class ``pp``; uncompressed gradients at their size), as the real
communicators do.
"""

import logging

import torch
import torch.distributed as dist
from megatron.core.transformer.transformer_block import TransformerBlock

from compression.pp_quant import TahQuantCodec
from compression.telemetry import TELEMETRY
from megatron.hooks.config import PipelineCommConfig

logger = logging.getLogger(__name__)


def _round_trip(x: torch.Tensor, codec: TahQuantCodec, rows: int) -> torch.Tensor:
    """``x`` as the receiving stage decodes it."""
    wire = codec.encode(x.detach(), rows=rows)
    TELEMETRY.record("pp", x.numel() * x.element_size(), wire.numel())
    return codec.decode(wire, x.numel(), x.dtype, rows=rows).view(x.shape)


class PipelineMessage(torch.autograd.Function):
    """Forward: the message as the next stage receives it; backward: the gradient as this stage receives it
    (``compress_grads``) or as it is."""

    @staticmethod
    def forward(ctx, x, codec: TahQuantCodec, rows: int, compress_grads: bool):
        ctx.codec, ctx.rows, ctx.compress_grads = codec, rows, compress_grads
        return _round_trip(x, codec, rows)

    @staticmethod
    def backward(ctx, grad):
        if ctx.compress_grads:
            grad = _round_trip(grad.contiguous(), ctx.codec, ctx.rows)
        else:  # sent as it is
            TELEMETRY.record("pp", grad.numel() * grad.element_size(), grad.numel() * grad.element_size())
        return grad, None, None, None


def _send_to_next_stage(codec: TahQuantCodec, rows: int, compress_grads: bool):
    """A forward hook on a stage's last layer: its hidden states (the first output) become the message."""

    def hook(module, inputs, output):
        if isinstance(output, tuple):
            return (PipelineMessage.apply(output[0], codec, rows, compress_grads), *output[1:])
        return PipelineMessage.apply(output, codec, rows, compress_grads)

    return hook


def apply_pp_emulation(model_chunks: list, config: PipelineCommConfig, sequence_shards: int = 1) -> None:
    """Hook the last layer of each of the first ``config.emulate - 1`` equal stages of the PP=1 model's decoder;
    ``sequence_shards``: the messages per boundary (the emulated TP degree with sequence parallelism, else 1)."""
    stages = config.emulate
    if stages < 2 or config.method != "tahquant":
        raise ValueError(f"apply_pp_emulation() needs --pp-comm-emulate of 2 or more and --pp-comm-compression "
                         f"tahquant, got {stages} and {config.method}")
    blocks = [m for chunk in model_chunks for m in chunk.modules() if isinstance(m, TransformerBlock)]
    if len(blocks) != 1:
        raise ValueError(f"--pp-comm-emulate needs one decoder (a GPT model at PP=1), found {len(blocks)} "
                         f"transformer blocks")
    layers = blocks[0].layers
    if len(layers) % stages:
        raise ValueError(f"--pp-comm-emulate {stages}: {len(layers)} decoder layers do not split into {stages} "
                         f"equal stages")
    codec = TahQuantCodec(config.tahquant, blocks[0].config.hidden_size)
    per_stage = len(layers) // stages
    boundaries = [(k + 1) * per_stage - 1 for k in range(stages - 1)]
    for i in boundaries:
        layers[i].register_forward_hook(_send_to_next_stage(codec, sequence_shards, config.compress_grads))
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.info("PP emulation: PP=%d messages after decoder layers %s (%r, %d per boundary, gradients %s)",
                    stages, boundaries, codec, sequence_shards, "coded" if config.compress_grads else "exact")
