"""``--tp-comm-emulate N``: a TP=1 run whose tensor-parallel collectives have the numerics of a TP=N run.

A compressed TP=N run quantizes what its collectives carry: the N partial sums of each all-reduce /
reduce-scatter and the N sequence shards of each all-gather. Those are functions of the whole
weights and activations, so one process can compute them: the weights stay whole (a TP=1 model) and each
swapped layer cuts its GEMM into the N ranks' partial products (one batched matmul over the N slices,
the FLOPs of the plain GEMM), then combines them with ``compression.tp_collectives``' ``emulated_*``,
which make the real collectives' codec calls in the same order. docs/tp-emulation.md lists which tensors
a TP=N run sends where; in short, as ``megatron/hooks/tp.py`` swaps them:
- column-parallel (qkv, fc1, output layer): fwd all-gather of the N sequence shards of the input (SP);
  bwd all-reduce (no SP) or reduce-scatter (SP) of the N partial dgrads, rank j's being
  ``grad_output[:, cols_j] @ weight[cols_j]`` over its output features ``cols_j``;
- row-parallel (proj, fc2): fwd all-reduce / reduce-scatter (SP) of ``input[:, in_j] @ weight[:, in_j].T``;
  bwd all-gather of the gradient's N sequence shards (SP);
- word embedding: fwd all-reduce / reduce-scatter (SP without learned position embeddings) of the N
  vocabulary shards' lookups (each token's row in its shard's partial, zeros in the others); bwd (SP with
  reduce-scatter) all-gather of the gradient's sequence shards.
Rank j's features are those megatron-core gives it: chunks ``j, j + N, ...`` of ``N x partition_stride``
(stride 2 for a gated fc1: [gate_j; up_j]). Below ``--tp-comm-compression-min-bytes`` (per rank's input,
as in the real run) the partials are summed in rank order, as an uncompressed collective would.

The model itself is built as TP=1 without sequence parallelism (``--sequence-parallel`` only selects the
SP collectives here); the vocabulary is padded for TP=N. Dropout draws differ from a real TP=N run (one
generator instead of N); everything else matches it up to fp32 rounding (tests/test_tp_emulation.py).

Every compressed collective's first call and every 100th after it also measure the codec's SQNR against the exact
result (``compression.telemetry.SQNR``); the metrics file logs it per site as ``tp_sqnr_db``.
"""

import dataclasses
import logging
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)

from compression.codec import TensorCodec
from compression.telemetry import SQNR, TELEMETRY
from compression.tp_collectives import (emulated_all_gather, emulated_all_reduce, emulated_reduce_scatter,
                                         sum_in_rank_order)
from megatron.hooks.config import TpCommConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TpEmulation:
    """The collectives of an emulated TP group of ``size`` ranks, compressed for large floating-point tensors."""

    codec: TensorCodec
    size: int
    min_bytes: int
    """Per rank's input, as ``TpComm.min_bytes``: from this many bytes a collective is compressed."""
    all_reduce_algorithm: str = "auto"
    sequence_parallel: bool = False
    site: str = ""
    """The module whose collectives these are: their SQNR is logged under ``<site>.<collective>``."""

    def _compresses(self, x: torch.Tensor) -> bool:
        return x.is_floating_point() and x.numel() * x.element_size() >= self.min_bytes

    @staticmethod
    def _stock(x: torch.Tensor) -> None:
        nbytes = x.numel() * x.element_size()
        TELEMETRY.record("tp", nbytes, nbytes)

    def _check_sequence(self, length: int) -> None:
        if length % self.size:
            raise ValueError(f"--tp-comm-emulate {self.size} with --sequence-parallel needs the sequence ({length}) "
                             f"divisible by {self.size}")

    def _measured(self, collective: str, exact, coded: torch.Tensor) -> torch.Tensor:
        """``coded``, with its SQNR against ``exact()`` recorded on the sampled calls of this site."""
        site = f"{self.site}.{collective}"
        if SQNR.due(site):
            SQNR.add(site, exact(), coded)
        return coded

    def all_reduce(self, parts: torch.Tensor) -> torch.Tensor:
        """parts: [N, ...] (rank j's contribution at j) -> the sum every rank gets."""
        if self._compresses(parts[0]):
            coded = emulated_all_reduce(parts, self.codec, algorithm=self.all_reduce_algorithm)
            return self._measured("all_reduce", lambda: parts.float().sum(0), coded)
        self._stock(parts[0])
        return sum_in_rank_order(parts)

    def reduce_scatter(self, parts: torch.Tensor) -> torch.Tensor:
        """parts: [N, s, ...] -> the N ranks' [s / N, ...] sums, concatenated: [s, ...]."""
        self._check_sequence(parts.shape[1])
        if self._compresses(parts[0]):
            coded = emulated_reduce_scatter(parts, self.codec)
            return self._measured("reduce_scatter", lambda: parts.float().sum(0), coded)
        self._stock(parts[0])
        return sum_in_rank_order(parts)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """x: [s, ...] whole -> what the all-gather of its N sequence shards returns."""
        self._check_sequence(x.shape[0])
        shards = x.reshape(self.size, x.shape[0] // self.size, *x.shape[1:])
        if self._compresses(shards[0]):
            coded = emulated_all_gather(shards, self.codec)
            return self._measured("all_gather", lambda: x, coded)
        self._stock(shards[0])
        return x


def _rank_major(x: torch.Tensor, size: int, stride: int) -> torch.Tensor:
    """[..., F] -> [size, ..., F / size]: rank j's features (chunks j, j + size, ... of size x stride) at j."""
    lead, features = x.shape[:-1], x.shape[-1]
    if features % (size * stride):
        raise ValueError(f"--tp-comm-emulate {size}: a dimension of {features} features does not split into "
                         f"{size} x {stride} (partition stride) equal shards")
    chunk = features // (size * stride)
    x = x.reshape(*lead, stride, size, chunk).movedim(-2, 0)  # [size, ..., stride, chunk]
    return x.reshape(size, *lead, stride * chunk)


def column_dgrad_partials(grad_output: torch.Tensor, weight: torch.Tensor, size: int, stride: int) -> torch.Tensor:
    """Rank j's ``grad_output[..., cols_j] @ weight[cols_j]``, all N in one batched matmul: [N, ..., in]."""
    grads = _rank_major(grad_output.reshape(-1, grad_output.shape[-1]), size, stride)  # [N, T, out / N]
    weights = _rank_major(weight.t(), size, stride).transpose(1, 2)  # [N, out / N, in]
    return torch.bmm(grads, weights).view(size, *grad_output.shape[:-1], weight.shape[1])


def row_output_partials(input: torch.Tensor, weight: torch.Tensor, size: int, stride: int) -> torch.Tensor:
    """Rank j's ``input[..., in_j] @ weight[:, in_j].T``, all N in one batched matmul: [N, ..., out]."""
    inputs = _rank_major(input.reshape(-1, input.shape[-1]), size, stride)  # [N, T, in / N]
    weights = _rank_major(weight, size, stride).transpose(1, 2)  # [N, in / N, out]
    return torch.bmm(inputs, weights).view(size, *input.shape[:-1], weight.shape[0])


class _EmulatedColumnMatmul(torch.autograd.Function):
    """``gather(input) @ weight.T + bias``; backward reduces the N ranks' partial dgrads."""

    @staticmethod
    def forward(ctx, input, weight, bias, emulation: TpEmulation):
        total_input = emulation.all_gather(input) if emulation.sequence_parallel else input
        # The real run re-gathers in backward; the deterministic codec gives these same values.
        ctx.save_for_backward(total_input, weight)
        ctx.emulation, ctx.use_bias = emulation, bias is not None
        output = torch.matmul(total_input, weight.t())
        return output + bias if bias is not None else output

    @staticmethod
    def backward(ctx, grad_output):
        total_input, weight = ctx.saved_tensors
        emulation = ctx.emulation
        partials = column_dgrad_partials(grad_output, weight, emulation.size, getattr(weight, "partition_stride", 1))
        if emulation.sequence_parallel:
            grad_input = emulation.reduce_scatter(partials)
        else:
            grad_input = emulation.all_reduce(partials)
        grad_output = grad_output.reshape(-1, grad_output.shape[-1])
        grad_weight = grad_output.t().matmul(total_input.reshape(-1, total_input.shape[-1]))
        grad_bias = grad_output.sum(dim=0) if ctx.use_bias else None
        return grad_input, grad_weight, grad_bias, None


class _EmulatedRowMatmul(torch.autograd.Function):
    """Sum (all-reduce, or reduce-scatter under SP) of the N ranks' partial products; backward (SP)
    all-gathers the gradient's sequence shards."""

    @staticmethod
    def forward(ctx, input, weight, emulation: TpEmulation):
        ctx.save_for_backward(input, weight)
        ctx.emulation = emulation
        partials = row_output_partials(input, weight, emulation.size, getattr(weight, "partition_stride", 1))
        return emulation.reduce_scatter(partials) if emulation.sequence_parallel else emulation.all_reduce(partials)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        emulation = ctx.emulation
        if emulation.sequence_parallel:
            grad_output = emulation.all_gather(grad_output)
        grad_input = grad_output.matmul(weight)
        grad_output = grad_output.reshape(-1, grad_output.shape[-1])
        grad_weight = grad_output.t().matmul(input.reshape(-1, input.shape[-1]))
        return grad_input, grad_weight, None


class _EmulatedReduce(torch.autograd.Function):
    """Forward: all-reduce of parts [N, ...], or reduce-scatter along dim 1 (``scatter``); backward: every
    rank's part gets the gradient (after the all-gather of its sequence shards for the reduce-scatter)."""

    @staticmethod
    def forward(ctx, parts, emulation: TpEmulation, scatter: bool):
        ctx.emulation, ctx.scatter, ctx.size = emulation, scatter, parts.shape[0]
        return emulation.reduce_scatter(parts) if scatter else emulation.all_reduce(parts)

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.scatter:
            grad_output = ctx.emulation.all_gather(grad_output)
        return grad_output.unsqueeze(0).expand(ctx.size, *grad_output.shape), None, None


class EmulatedColumnParallelLinear(ColumnParallelLinear):
    def _forward_impl(self, input, weight, bias=None, *args, **kwargs):
        if not weight.requires_grad:  # frozen: the real run takes megatron-core's uncompressed path
            return super()._forward_impl(input, weight, bias, *args, **kwargs)
        return _EmulatedColumnMatmul.apply(input, weight, bias, self.tp_emulation)


class EmulatedRowParallelLinear(RowParallelLinear):
    def forward(self, input_, *args, **kwargs):
        if not self.weight.requires_grad:
            return super().forward(input_, *args, **kwargs)
        output = _EmulatedRowMatmul.apply(input_, self.weight, self.tp_emulation)
        if self.skip_bias_add:
            return output, self.bias
        return (output + self.bias if self.bias is not None else output), None


class EmulatedVocabParallelEmbedding(VocabParallelEmbedding):
    """[b, s] ids -> [b, s, h]: the reduction of the N vocabulary shards' lookups."""

    emulated_reduce_scatter = False  # set from the parent LanguageModelEmbedding

    def forward(self, input_):
        size = self.tp_emulation.size
        shard_rows = self.weight.shape[0] // size
        rows = self.weight[input_] if self.deterministic_mode else F.embedding(input_, self.weight)
        owner = torch.arange(size, device=input_.device).view(size, 1, 1) == (input_ // shard_rows).unsqueeze(0)
        parts = rows.unsqueeze(0).masked_fill(~owner.unsqueeze(-1), 0.0)  # [N, b, s, h]
        if self.emulated_reduce_scatter:
            # the real run scatters the sequence of [s, b, h]; the TP=1 model wants [b, s, h] back
            parts = parts.transpose(1, 2).contiguous()
            return _EmulatedReduce.apply(parts, self.tp_emulation, True).transpose(0, 1)
        return _EmulatedReduce.apply(parts, self.tp_emulation, False)


_EMULATED_CLASS = {
    ColumnParallelLinear: EmulatedColumnParallelLinear,
    RowParallelLinear: EmulatedRowParallelLinear,
    VocabParallelEmbedding: EmulatedVocabParallelEmbedding,
}


def _check_module(name: str, module: torch.nn.Module, size: int) -> None:
    """What a TP=N run would have rejected, or what emulation does not reproduce."""
    kind = type(module).__name__
    if "MultiLatentAttention" in kind or "MLASelfAttention" in kind or "MultiTokenPrediction" in kind:
        raise ValueError(f"--tp-comm-emulate does not emulate {kind} ({name}): drop it, or run real TP")
    if getattr(module, "explicit_expert_comm", False) or ".experts." in f".{name}.":
        raise ValueError(f"--tp-comm-emulate does not emulate MoE expert layers ({name}): use a dense model")
    if type(module) is VocabParallelEmbedding and module.weight.shape[0] % size:
        raise ValueError(f"--tp-comm-emulate {size}: the vocabulary ({module.weight.shape[0]} rows of {name}) "
                         f"is not divisible by {size}: drop --padded-vocab-size or make it divisible")


def apply_tp_emulation(model_chunks: list, config: TpCommConfig, codec: TensorCodec = None) -> None:
    """Swap every column-, row-parallel linear and vocabulary embedding of a TP=1 model for its emulated
    class (``config.emulate`` ranks, ``config.sequence_parallel`` collectives). Call where
    ``apply_tp_compression`` is called."""
    from megatron.hooks.tp import build_tp_codec

    if config.emulate < 2:
        raise ValueError(f"apply_tp_emulation() needs --tp-comm-emulate of 2 or more, got {config.emulate}")
    size = config.emulate
    emulation = TpEmulation(codec if codec is not None else build_tp_codec(config), size, int(config.min_bytes),
                            config.all_reduce, config.sequence_parallel)
    swapped = Counter()
    for chunk in model_chunks:
        for name, module in chunk.named_modules():
            _check_module(name, module, size)
            if isinstance(module, LanguageModelEmbedding):
                # megatron-core's rule for TP=N with SP: reduce-scatter unless position / token-type
                # embeddings are added to the whole sequence first
                module.word_embeddings.emulated_reduce_scatter = bool(
                    config.sequence_parallel and not module.add_position_embedding and module.num_tokentypes <= 0)
            if type(module) in _EMULATED_CLASS:
                module.tp_emulation = dataclasses.replace(emulation, site=name)
                module.__class__ = _EMULATED_CLASS[type(module)]
                swapped[type(module).__name__] += 1
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.info("TP emulation: TP=%d collectives (%s, %r, compress from %d bytes) in %s", size,
                    "sequence-parallel" if emulation.sequence_parallel else "no SP", emulation.codec, emulation.min_bytes,
                    dict(swapped))
