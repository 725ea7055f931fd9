"""TACO-compressed tensor-parallel collectives, installed by swapping the class of built modules.

``apply_tp_compression`` sets ``module.__class__`` of every local-spec ``ColumnParallelLinear``,
``RowParallelLinear``, ``VocabParallelEmbedding``, MLA attention (``megatron/hooks/mla.py``'s) and multi-token
prediction layer (TP size > 1, not an expert linear with explicit expert communication) to a subclass whose TP
collectives, forward and backward, go through ``megatron.hooks.tp_functions``. Nothing is re-initialised: parameters, buffers and checkpoint layout
stay those of the stock module. Left uncompressed: expert linears (MoE dispatcher traffic), frozen
weights, the inference-only ``gather_output`` all-gather, the cross-entropy all-reduces, and
Transformer Engine layers (their TP comm is inside TE; rejected with an error).

The overrides are the smallest methods that carry the communication (megatron-core 0.16.1 to 0.19;
0.19's extra keyword ``gtp_remat_size`` is only ever 1 here, as generalized TP is rejected):
- Column: ``_forward_impl``, which gets ``allreduce_dgrad`` and ``sequence_parallel`` as keywords.
- Row: ``forward``, whose output all-reduce / reduce-scatter is in ``forward`` itself.
- Embedding: ``forward`` (masked lookup of the vocab shard, then all-reduce / reduce-scatter).
- MLA: ``get_query_key_value_tensors``, during which the two mapping functions that
  ``multi_latent_attention`` imported and calls on the down projections' latents are bound to the layer's
  ``TpComm``: ``gather_from_tensor_model_parallel_region`` (all-gather of the last dim, backward a local
  split) and, with SP, ``scatter_to_sequence_parallel_region`` (local split, backward all-gather). Its
  third, ``gather_from_sequence_parallel_region`` of the rotary key, only runs when the kv down projection is
  not tensor-parallel (Transformer Engine's duplicated ``TELinear``), never with the local spec.
- Multi-token prediction layer: ``_concat_embeddings``, during which the same two functions, as
  ``multi_token_prediction`` imported them, carry its projection's output.
``tests/test_megatron_api.py`` pins the megatron-core names and signatures relied on here.
"""

import contextlib
import logging
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from megatron.core.transformer import multi_latent_attention, multi_token_prediction
from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

from compression.codec import TensorCodec
from compression.collective_graphs import CollectiveGraphs
from compression.taco import TacoCodec
from compression.tp_collectives import OPS, PROBE_BYTES, measure_min_bytes
from megatron.hooks.config import TpCommConfig
from megatron.hooks.mla import SummedRotaryKeyMLASelfAttention
from megatron.hooks.tp_functions import (
    TpComm,
    all_reduce_forward,
    column_parallel_linear,
    gather_last_dim,
    reduce_scatter_forward,
    split_first_dim,
)
from megatron.hooks.trial import CompressionTrial

logger = logging.getLogger(__name__)


class CompressedColumnParallelLinear(ColumnParallelLinear):
    """qkv, fc1, output layer: fwd SP all-gather; bwd dgrad all-reduce / reduce-scatter + SP re-gather."""

    def _forward_impl(
        self, input, weight, bias=None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
        sequence_parallel=False, **kwargs,
    ):
        if not weight.requires_grad or not (allreduce_dgrad or sequence_parallel):
            return super()._forward_impl(
                input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel, **kwargs
            )
        # gradient_accumulation_fusion only saves an add: the wgrad is returned as .grad and DDP's
        # grad hook accumulates it into main_grad. tp_group is self.tp_group (in self.tp_comm);
        # grad_output_buffer (deferred embedding wgrad) is rejected by apply_tp_compression.
        return column_parallel_linear(input, weight, bias, self.tp_comm, sequence_parallel)


class CompressedRowParallelLinear(RowParallelLinear):
    """proj, fc2: fwd output all-reduce (no SP) or reduce-scatter (SP); bwd SP all-gather."""

    def forward(self, input_, *args, **kwargs):
        if not self.input_is_parallel:  # never in GPT; keeps the stock scatter path
            return super().forward(input_, *args, **kwargs)
        output_parallel = self._forward_impl(
            input=input_,
            weight=self.weight,
            bias=None,
            gradient_accumulation_fusion=self.gradient_accumulation_fusion,
            allreduce_dgrad=False,
            sequence_parallel=False,
            tp_group=None,
            grad_output_buffer=None,
        )
        if self.sequence_parallel:
            output = reduce_scatter_forward(output_parallel, self.tp_comm)
        else:
            output = all_reduce_forward(output_parallel, self.tp_comm)
        if self.skip_bias_add:
            return output, self.bias
        return (output + self.bias if self.bias is not None else output), None


class CompressedVocabParallelEmbedding(VocabParallelEmbedding):
    """Word embedding: fwd all-reduce, or reduce-scatter to [s/tp, b, h] (SP); bwd SP all-gather."""

    def forward(self, input_):
        outside_shard = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
        local_ids = (input_ - self.vocab_start_index).masked_fill(outside_shard, 0)
        if self.deterministic_mode:
            partial = self.weight[local_ids]
        else:
            partial = F.embedding(local_ids, self.weight)
        partial = partial.masked_fill(outside_shard.unsqueeze(-1), 0.0)
        if self.reduce_scatter_embeddings:
            # [b, s, h] -> [s, b, h], then scatter the sequence.
            return reduce_scatter_forward(partial.transpose(0, 1).contiguous(), self.tp_comm)
        return all_reduce_forward(partial, self.tp_comm)


@contextlib.contextmanager
def _mapping_functions_through(namespace, comm: TpComm):
    """The two mapping functions that ``namespace`` (megatron-core's ``multi_latent_attention`` or
    ``multi_token_prediction``) imported and calls as functions, routed through ``comm`` while the block runs
    (megatron-core's own outside it): ``gather_from_tensor_model_parallel_region`` (all-gather of the last dim,
    backward a local split) and ``scatter_to_sequence_parallel_region`` (local split, backward all-gather). The
    group 0.19 passes is the layer's TP group, ``comm``'s."""
    stock = (namespace.gather_from_tensor_model_parallel_region, namespace.scatter_to_sequence_parallel_region)
    namespace.gather_from_tensor_model_parallel_region = lambda x, group=None: gather_last_dim(x, comm)
    namespace.scatter_to_sequence_parallel_region = lambda x, group=None: split_first_dim(x, comm)
    try:
        yield
    finally:
        namespace.gather_from_tensor_model_parallel_region, namespace.scatter_to_sequence_parallel_region = stock


class CompressedMLASelfAttention(SummedRotaryKeyMLASelfAttention):
    """MLA: fwd all-gather of the q and kv down projections' latents; bwd (SP) all-gather of their gradients.
    The projections themselves are swapped linears."""

    def get_query_key_value_tensors(self, *args, **kwargs):
        with _mapping_functions_through(multi_latent_attention, self.tp_comm):
            return super().get_query_key_value_tensors(*args, **kwargs)


class CompressedMultiTokenPredictionLayer(MultiTokenPredictionLayer):
    """MTP layer: fwd all-gather (last dim) of its [embedding, hidden] projection's output, then with SP the split to
    the layer's sequence shard; bwd (SP) the all-gather of its gradient. The projection and the transformer layer
    are swapped modules of their own."""

    def _concat_embeddings(self, *args, **kwargs):
        with _mapping_functions_through(multi_token_prediction, self.tp_comm):
            return super()._concat_embeddings(*args, **kwargs)


def _tp_group(module: torch.nn.Module):
    """The module's TP group; megatron-core 0.16's MTP layer keeps none of its own: its projection's."""
    group = getattr(module, "tp_group", None)
    return group if group is not None else module.eh_proj.tp_group


_COMPRESSED_CLASS = {
    ColumnParallelLinear: CompressedColumnParallelLinear,
    RowParallelLinear: CompressedRowParallelLinear,
    VocabParallelEmbedding: CompressedVocabParallelEmbedding,
    SummedRotaryKeyMLASelfAttention: CompressedMLASelfAttention,
    MultiTokenPredictionLayer: CompressedMultiTokenPredictionLayer,
}


def build_tp_codec(config: TpCommConfig) -> TensorCodec:
    """The TP codec ``--tp-comm-compression`` names: TACO, or TahQuant's pipeline code on the TP path (the TACO
    paper's comparison; its settings are TahQuant's flags, --pp-comm-bits etc.)."""
    if config.method == "tahquant":
        from compression.pp_quant import TahQuantCodec

        return TahQuantCodec(config.tahquant, config.hidden_size)
    return TacoCodec(config.taco)


def _check_module(name: str, module: torch.nn.Module, method: str) -> None:
    if type(module).__module__.startswith(("transformer_engine", "megatron.core.extensions.transformer_engine")):
        raise ValueError(
            f"--tp-comm-compression {method} needs --transformer-impl local, but {name} is a Transformer Engine "
            f"layer ({type(module).__name__})"
        )
    if getattr(module, "gtp_remat_size", 1) > 1:
        # megatron-core >= 0.19: generalized TP shards the weight and gathers it inside the linear.
        raise ValueError(
            f"--tp-comm-compression {method} does not support generalized tensor parallelism ({name} has "
            f"gtp_remat_size {module.gtp_remat_size}): train without GTP"
        )
    config = getattr(module, "config", None)
    if config is not None and getattr(config, "defer_embedding_wgrad_compute", False):
        raise ValueError(
            f"--tp-comm-compression {method} does not support --defer-embedding-wgrad-compute; drop that flag"
        )


def _compressible(module: torch.nn.Module) -> bool:
    return (
        type(module) in _COMPRESSED_CLASS
        and _tp_group(module).size() > 1
        and not getattr(module, "explicit_expert_comm", False)
    )


def resolve_min_bytes(config: TpCommConfig, codec: TensorCodec, group) -> dict:
    """Per-collective compression thresholds for one TP group. With 'auto', time plain vs compressed
    collectives on the group at the probe sizes up to the largest message this model sends (every
    rank of the group gets the same answer); else the flag's value for every collective."""
    if not config.auto_min_bytes:
        return {op: int(config.min_bytes) for op in OPS}
    largest = config.largest_message_bytes
    sizes = [size for size in PROBE_BYTES if size < largest] + [largest]  # the model's own largest message
    # margin: compress only where it wins by 10%, above the run-to-run noise of the probe
    return measure_min_bytes(codec, group, sizes=sizes, margin=0.1, all_reduce_algorithm=config.all_reduce)


def _collective_graphs(config: TpCommConfig):
    if not config.cuda_graphs:
        return None
    if not torch.cuda.is_available():
        raise ValueError("--tp-comm-cuda-graphs replays CUDA graphs and needs GPUs: drop the flag on CPU")
    return CollectiveGraphs()


def apply_tp_compression(model_chunks: list, config: TpCommConfig, codec: TensorCodec = None) -> None:
    """Route the TP collectives of every local tensor-parallel layer in ``model_chunks`` through
    ``codec`` (default: the one ``config`` names). Call after building (and Float16Module wrapping)
    the model chunks and before DDP wrapping."""
    if config.method == "none":
        raise ValueError("apply_tp_compression() needs --tp-comm-compression taco or tahquant")
    codec = codec if codec is not None else build_tp_codec(config)
    swapped, kept = Counter(), Counter()
    thresholds = {}  # per TP group, measured once
    graphs = {}  # per TP group: its collectives' CUDA graphs (--tp-comm-cuda-graphs)
    for chunk in model_chunks:
        for name, module in chunk.named_modules():
            _check_module(name, module, config.method)
            if not _compressible(module):
                if type(module) in _COMPRESSED_CLASS:
                    kept[type(module).__name__] += 1
                continue
            swapped[type(module).__name__] += 1
            group = _tp_group(module)
            if group not in thresholds:
                thresholds[group] = resolve_min_bytes(config, codec, group)
                graphs[group] = _collective_graphs(config)
            module.tp_comm = TpComm(codec, group, thresholds[group], config.all_reduce, graphs[group])
            module.__class__ = _COMPRESSED_CLASS[type(module)]
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.info(
            "TP compression (%r, compress from bytes %s): swapped %s; left stock (TP size 1 or expert) %s",
            codec,
            list(thresholds.values()),
            dict(swapped),
            dict(kept),
        )


def build_trial(model_chunks: list, config: TpCommConfig):
    """The ``TpCompressionTrial`` for the training loop to drive: with ``--tp-comm-compression-min-bytes
    auto`` and a non-zero ``--tp-comm-compression-trial-iters`` when the start-up probe chose to
    compress anything; else None."""
    modules = [m for chunk in model_chunks for m in chunk.modules() if type(m) in _STOCK_CLASS]
    compresses_any = any(v is not None for m in modules for v in m.tp_comm.min_bytes.values())
    if not (config.auto_min_bytes and config.trial_iters and compresses_any and dist.is_initialized()):
        return None
    return TpCompressionTrial(modules, config.trial_iters)


_STOCK_CLASS = {compressed: stock for stock, compressed in _COMPRESSED_CLASS.items()}


class TpCompressionTrial(CompressionTrial):
    """Second stage of ``--tp-comm-compression-min-bytes auto`` (``megatron/hooks/trial.py``): the
    start-up probe times each collective alone, with the host enqueuing ahead of the device; where the
    host is the bottleneck, faster collectives still make slower iterations (measured: GPT-350M, TP=2,
    ~25 GB/s, 18-24% slower though every collective was faster alone). Uncompressed iterations use the
    stock layer classes, i.e. megatron-core's own TP path, which also stays if the trial says so."""

    def __init__(self, modules: list, iters: int):
        self.modules = modules
        super().__init__("TP compression", self._swap_classes, iters, flag="--tp-comm-compression-trial-iters",
                         fallback="megatron-core's own TP path")

    def _swap_classes(self, compressing: bool, final: bool) -> None:
        for module in self.modules:
            compressed = type(module) in _STOCK_CLASS
            if compressing and not compressed:
                module.__class__ = _COMPRESSED_CLASS[type(module)]
            elif not compressing and compressed:
                module.__class__ = _STOCK_CLASS[type(module)]
