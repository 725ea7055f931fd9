"""The private megatron-core names, signatures and attributes that megatron/hooks/ relies on.

A megatron-core upgrade that renames or reshapes one of them fails here, by name, instead of failing
(or silently changing behaviour) mid-run. To pin a new dependency, append a row to a list below. Rows
that hold on one side of a release only (``megatron.hooks.version``) are added under the ``ON_0_*`` flag of the
release that changed them; run this file on every supported release (0.16.1, 0.17.x, 0.18.x and 0.19.x).
"""

import importlib
import inspect
import re

import pytest

from megatron.hooks.version import mcore_at_least

ON_0_17 = mcore_at_least("0.17")
ON_0_18 = mcore_at_least("0.18")
ON_0_19 = mcore_at_least("0.19")

# (module, qualified name, parameter names that must appear, in this order, in the signature)
SIGNATURES = [
    # megatron/hooks/tp.py: the Column override takes these keywords from ColumnParallelLinear.forward.
    ("megatron.core.tensor_parallel.layers", "ColumnParallelLinear._forward_impl", ["self", "input", "weight"]),
    ("megatron.core.tensor_parallel.layers", "linear_with_grad_accumulation_and_async_allreduce",
     ["input", "weight", "bias", "gradient_accumulation_fusion", "allreduce_dgrad", "sequence_parallel"]),
    ("megatron.core.tensor_parallel.layers", "RowParallelLinear.forward", ["self", "input_"]),
    ("megatron.core.tensor_parallel.layers", "RowParallelLinear._forward_impl", ["self", "input", "weight"]),
    ("megatron.core.tensor_parallel.layers", "VocabParallelEmbedding.forward", ["self", "input_"]),
    # megatron/hooks/param_gather.py overrides start_param_sync; megatron-core's finish_param_sync waits on
    # the handle it sets.
    ("megatron.core.distributed.param_and_grad_buffer", "_ParamAndGradBucketGroup.start_param_sync",
     ["self", "force_sync"]),
    ("megatron.core.distributed.param_and_grad_buffer", "_ParamAndGradBucketGroup.finish_param_sync",
     ["self", "skip_next_bucket_dispatch"]),
    # megatron/hooks/pp.py overrides _communicate (keyword-only, as the schedules call it) and sends
    # through megatron-core's own op helpers.
    ("megatron.core.pipeline_parallel.p2p_communication", "P2PCommunicator._communicate",
     ["self", "tensor_send_next", "tensor_send_prev", "recv_prev", "recv_next", "tensor_shape", "wait_on_reqs"]),
    ("megatron.core.pipeline_parallel.p2p_communication", "_batched_p2p_ops",
     ["tensor_send_prev", "tensor_recv_prev", "tensor_send_next", "tensor_recv_next", "group",
      "prev_pipeline_rank", "next_pipeline_rank"]),
    ("megatron.core.pipeline_parallel.p2p_communication", "_p2p_ops",
     ["tensor_send_prev", "tensor_recv_prev", "tensor_send_next", "tensor_recv_next", "group",
      "prev_pipeline_rank", "next_pipeline_rank"]),
    # megatron/hooks/norm.py wraps WrappedTorchNorm.__new__.
    ("megatron.core.transformer.torch_norm", "WrappedTorchNorm.__new__", ["cls", "config", "hidden_size", "eps"]),
    # megatron/hooks/cpu.py wraps these.
    ("megatron.core.transformer.moe.moe_utils", "maybe_move_tensor_to_cpu", ["tensor", "as_numpy", "record_stream"]),
    ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state", ["new_state"]),
    ("megatron.core.transformer.utils", "get_default_causal_mask", ["sq"]),
    ("megatron.core.fusions.fused_softmax", "get_default_causal_mask", ["sq"]),
    # megatron/hooks/mla.py: LatentDotProductAttention passes these on by keyword.
    ("megatron.core.transformer.dot_product_attention", "DotProductAttention.__init__",
     ["self", "config", "layer_number", "attn_mask_type", "attention_type", "attention_dropout", "softmax_scale",
      "cp_comm_type", "pg_collection"]),
    # megatron/hooks/attention.py: SDPAttention.forward takes what the attention module passes its core attention.
    ("megatron.core.transformer.dot_product_attention", "DotProductAttention.forward",
     ["self", "query", "key", "value", "attention_mask", "attn_mask_type", "attention_bias", "packed_seq_params"]),
    # megatron/hooks/fused_ops.py: the stand-ins keep apex's kernels' contracts.
    ("megatron.core.utils", "local_multi_tensor_l2_norm", ["chunk_size", "noop_flag", "tensor_lists", "per_tensor"]),
    ("megatron.core.utils", "local_multi_tensor_scale", ["chunk_size", "noop_flag", "tensor_lists", "scale"]),
    # megatron/training/checkpointing.py passes only the backend (0.19 dropped the version argument).
    ("megatron.core.dist_checkpointing.serialization", "get_default_save_sharded_strategy", ["backend"]),
]
if ON_0_18:
    SIGNATURES += [
        # megatron/training/tokenizer.py: "null-text" takes the full vocabulary size, eod its last id.
        ("megatron.core.tokenizers.text.libraries.null_tokenizer", "NullTokenizer.__init__",
         ["self", "vocab_size", "eod_id"]),
    ]
else:
    SIGNATURES += [
        ("megatron.core.tokenizers.text.libraries.null_tokenizer", "NullTokenizer.__init__", ["self", "vocab_size"]),
    ]

# (module, qualified name, text that must appear in its source): how megatron-core calls what we override.
SOURCE_CONTAINS = [
    ("megatron.core.tensor_parallel.layers", "ColumnParallelLinear.forward", "self._forward_impl("),
    ("megatron.core.tensor_parallel.layers", "ColumnParallelLinear.forward", "allreduce_dgrad=allreduce_dgrad"),
    ("megatron.core.tensor_parallel.layers", "ColumnParallelLinear.forward", "sequence_parallel=False if self.explicit_expert_comm"),
    ("megatron.core.tensor_parallel.layers", "RowParallelLinear.forward", "reduce_scatter_to_sequence_parallel_region("),
    ("megatron.core.tensor_parallel.layers", "VocabParallelEmbedding.forward", "reduce_from_tensor_model_parallel_region("),
    ("megatron.core.transformer.moe.token_dispatcher", "MoEAlltoAllTokenDispatcher", "maybe_move_tensor_to_cpu("),
    ("megatron.core.tensor_parallel.random", "CudaRNGStatesTracker", "_set_cuda_rng_state("),
    # megatron/hooks/mla.py: MLA builds its core attention with separate key and value head sizes, and the local
    # attention's context reshape is the one size it sets from kv_channels.
    ("megatron.core.transformer.multi_latent_attention", "MultiLatentAttention.__init__",
     "v_channels=self.config.v_head_dim"),
    ("megatron.core.transformer.dot_product_attention", "DotProductAttention.forward",
     "(self.hidden_size_per_partition,)"),
    # megatron/hooks/tp.py routes MLA's latent collectives while get_query_key_value_tensors runs.
    ("megatron.core.transformer.multi_latent_attention", "MLASelfAttention.get_query_key_value_tensors",
     "gather_from_tensor_model_parallel_region(kv_combined)"),
    ("megatron.core.transformer.multi_latent_attention", "MLASelfAttention.get_query_key_value_tensors",
     "scatter_to_sequence_parallel_region(kv_compressed)"),
    # ... and the MTP layer's while _concat_embeddings runs.
    ("megatron.core.transformer.multi_token_prediction", "MultiTokenPredictionLayer._concat_embeddings",
     "gather_from_tensor_model_parallel_region("),
    ("megatron.core.transformer.multi_token_prediction", "MultiTokenPredictionLayer._concat_embeddings",
     "scatter_to_sequence_parallel_region(hidden_states"),
    # megatron/hooks/pp_emulation.py hooks a layer's output: (hidden states, context), the layers in the block's list.
    ("megatron.core.transformer.transformer_layer", "TransformerLayer.forward", "return output, context"),
    ("megatron.core.transformer.transformer_block", "TransformerBlock", "self.layers = "),
    # megatron/hooks/pp.py swaps the communicator class the pipelined schedules construct.
    ("megatron.core.pipeline_parallel.schedules", "forward_backward_pipelining_without_interleaving",
     "P2PCommunicator("),
    ("megatron.core.pipeline_parallel.schedules", "forward_backward_pipelining_with_interleaving",
     "P2PCommunicator("),
]
# MLA's query latent: gathered in get_query_key_value_tensors, from 0.17 in the _qkv_down_projection it calls.
Q_LATENT_GATHER = ("MLASelfAttention._qkv_down_projection" if ON_0_17
                   else "MLASelfAttention.get_query_key_value_tensors")
SOURCE_CONTAINS += [
    ("megatron.core.transformer.multi_latent_attention", Q_LATENT_GATHER,
     "gather_from_tensor_model_parallel_region(q_compressed)"),
    ("megatron.core.transformer.multi_latent_attention", Q_LATENT_GATHER,
     "scatter_to_sequence_parallel_region(q_compressed)"),
]
if ON_0_17:
    SOURCE_CONTAINS += [
        ("megatron.core.transformer.multi_latent_attention", "MLASelfAttention.get_query_key_value_tensors",
         "self._qkv_down_projection(hidden_states)"),
    ]
if ON_0_18:
    SOURCE_CONTAINS += [
        # FP8 post-processing moved into _post_param_sync(), which our start_param_sync override calls
        # after waiting on an outstanding gather, as the stock one does.
        ("megatron.core.distributed.param_and_grad_buffer", "_ParamAndGradBucketGroup.start_param_sync",
         "self._post_param_sync()"),
        ("megatron.core.distributed.param_and_grad_buffer", "_ParamAndGradBucketGroup.finish_param_sync",
         "self._post_param_sync()"),
    ]
if ON_0_19:
    SOURCE_CONTAINS += [
        # Generalized TP, rejected by megatron/hooks/tp.py, reaches the linears through this keyword.
        ("megatron.core.tensor_parallel.layers", "ColumnParallelLinear.forward", "gtp_remat_size=self.gtp_remat_size"),
        ("megatron.core.tensor_parallel.layers", "RowParallelLinear.forward", "gtp_remat_size=self.gtp_remat_size"),
    ]

# (module, name of a collection, member it must hold)
MEMBERS = [
    # megatron/training/tokenizer.py: the null tokenizer's library name.
    ("megatron.core.tokenizers.megatron_tokenizer", "TEXT_LIBRARIES", "null-text") if ON_0_17
    else ("megatron.core.tokenizers.megatron_tokenizer", "TOKENIZER_LIBRARIES", "null"),
]

# megatron/hooks/fused_ops.py replaces these fallbacks and the gradient-accumulation extension, by module attribute.
SOURCE_CONTAINS += [
    ("megatron.core.optimizer.clip_grads", "get_grad_norm_fp32", "l2_norm_impl"),
    ("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32", "multi_tensor_scale_impl"),
    ("megatron.core.optimizer.optimizer", "_multi_tensor_copy_this_to_that", "multi_tensor_scale_impl"),
    ("megatron.core.tensor_parallel.layers", "LinearWithGradAccumulationAndAsyncCommunication.backward",
     "fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp16("),
    ("megatron.core.tensor_parallel.layers", "LinearWithGradAccumulationAndAsyncCommunication.backward",
     "fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32("),
]

# (module, class, attributes its __init__ must set on self)
INSTANCE_ATTRIBUTES = [
    ("megatron.core.tensor_parallel.layers", "ColumnParallelLinear",
     ["tp_group", "sequence_parallel", "explicit_expert_comm", "allreduce_dgrad", "config"]),
    ("megatron.core.tensor_parallel.layers", "RowParallelLinear",
     ["tp_group", "sequence_parallel", "explicit_expert_comm", "input_is_parallel", "skip_bias_add",
      "gradient_accumulation_fusion", "config"]),
    ("megatron.core.tensor_parallel.layers", "VocabParallelEmbedding",
     ["tp_group", "vocab_start_index", "vocab_end_index", "deterministic_mode", "reduce_scatter_embeddings"]),
    # megatron/hooks/param_gather.py
    ("megatron.core.distributed.param_and_grad_buffer", "_ParamAndGradBucketGroup",
     ["buckets", "ddp_config", "param_gather_handle", "param_gather_dispatched",
      "intra_distributed_optimizer_instance_group", "intra_distributed_optimizer_instance_size",
      "intra_distributed_optimizer_instance_rank"]),
    ("megatron.core.distributed.param_and_grad_buffer", "_ParamAndGradBuffer", ["param_dtype", "buckets"]),
    ("megatron.core.transformer.dot_product_attention", "DotProductAttention",
     ["hidden_size_per_partition", "hidden_size_per_attention_head", "num_attention_heads_per_partition",
      "layer_number", "attn_mask_type", "softmax_scale", "attention_dropout"]),
    ("megatron.core.pipeline_parallel.p2p_communication", "P2PCommunicator",
     ["pp_group", "config", "next_rank", "prev_rank"]),
    ("megatron.core.distributed.param_and_grad_buffer", "_ParamAndGradBucket", ["param_data", "bucket_id"]),
    ("megatron.core.distributed.distributed_data_parallel", "DistributedDataParallel",
     ["ddp_config", "buffers", "expert_parallel_buffers", "bucket_groups", "expert_parallel_bucket_groups"]),
]
if ON_0_19:
    INSTANCE_ATTRIBUTES += [
        ("megatron.core.tensor_parallel.layers", "ColumnParallelLinear", ["gtp_remat_size"]),
        ("megatron.core.tensor_parallel.layers", "RowParallelLinear", ["gtp_remat_size"]),
        ("megatron.core.tensor_parallel.layers", "VocabParallelEmbedding", ["gtp_remat_size"]),
    ]


def _resolve(module_name: str, qualname: str):
    obj = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("module_name, qualname, params", SIGNATURES, ids=[row[1] for row in SIGNATURES])
def test_signature(module_name, qualname, params):
    names = list(inspect.signature(_resolve(module_name, qualname)).parameters)
    assert names[: len(params)] == params, f"{module_name}.{qualname}{names}"


@pytest.mark.parametrize("module_name, qualname, text", SOURCE_CONTAINS, ids=[row[2] for row in SOURCE_CONTAINS])
def test_source_contains(module_name, qualname, text):
    assert text in inspect.getsource(_resolve(module_name, qualname)), f"{module_name}.{qualname}"


@pytest.mark.parametrize("module_name, name, member", MEMBERS, ids=[row[2] for row in MEMBERS])
def test_members(module_name, name, member):
    assert member in _resolve(module_name, name), f"{module_name}.{name}"


@pytest.mark.parametrize("module_name, cls, attrs", INSTANCE_ATTRIBUTES, ids=[row[1] for row in INSTANCE_ATTRIBUTES])
def test_instance_attributes(module_name, cls, attrs):
    source = inspect.getsource(_resolve(module_name, f"{cls}.__init__"))
    # "self.a = ..." or a tuple target "(self.a, self.b) = ..."; not "self.a == ...".
    missing = [a for a in attrs if not re.search(rf"self\.{a}\b[^=\n]*=(?!=)", source)]
    assert not missing, f"{module_name}.{cls}.__init__ no longer sets {missing}"


ROUTED_MAPPINGS = {"gather_from_tensor_model_parallel_region", "scatter_to_sequence_parallel_region"}


@pytest.mark.parametrize("module_name, imported_too, package_calls", [
    # the third, gather_from_sequence_parallel_region, runs only when the kv down projection is not tensor-parallel,
    # never with the local spec
    ("megatron.core.transformer.multi_latent_attention", {"gather_from_sequence_parallel_region"},
     {"CheckpointWithoutOutput"}),
    ("megatron.core.transformer.multi_token_prediction", set(), {"get_cuda_rng_tracker", "checkpoint"}),
])
def test_layers_import_only_the_tp_collectives_we_route(module_name, imported_too, package_calls):
    """megatron/hooks/tp.py rebinds, while MLA's query/key/value and the MTP layer's projection run, two of the
    mapping functions these modules imported; a new one would go uncompressed, so it fails here, and so does a
    mapping reached through the tensor_parallel package (only the recompute and RNG helpers are)."""
    module = importlib.import_module(module_name)
    imported = {name for name, obj in vars(module).items()
                if getattr(obj, "__module__", None) == "megatron.core.tensor_parallel.mappings"}
    assert imported == ROUTED_MAPPINGS | imported_too
    assert set(re.findall(r"tensor_parallel\.(\w+)\(", inspect.getsource(module))) == package_calls
