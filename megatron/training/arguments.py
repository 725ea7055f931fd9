"""Command-line arguments: Megatron-LM's flag names, declared once as typed dataclass fields.

Each section is a dataclass; every field becomes the flag ``--field-name`` (dashes for underscores)
with the field's default, type and help text, unless its metadata names another flag (e.g.
``--no-masked-softmax-fusion`` for ``masked_softmax_fusion``, which also takes ``--masked-softmax-fusion``);
every other boolean also takes ``--no-X``, so that a YAML config's setting can be undone on the command
line. The result is one flat
``argparse.Namespace`` whose attributes are Megatron-LM's ``args`` names (the project's shared contract).

Precedence: explicit CLI flags > ``--config FILE.yaml`` (a flat mapping of flag names without ``--``)
> field defaults. ``validate_args`` then derives sizes and rejects bad combinations with a
``ValueError`` that names the flag and the fix.
"""

import argparse
import dataclasses
import os
import re
import typing
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from megatron.hooks.config import check
from megatron.hooks.gather_methods import PARAM_GATHER_METHODS
from megatron.training.batch_schedule import iterations_in, parse_step_schedule, rampup_steps

DEFAULT_SPLIT = "969,30,1"  # Megatron-LM's legacy --split


def arg(default, help, *, choices=None, flag=None, aliases=(), type=None):
    """A field that declares a flag. ``flag`` overrides the derived name: for a bool that defaults to
    True it is the negative flag (``--no-...``) that sets it False; for other types it is the flag whose
    value the field holds (Megatron-LM's ``--microbatch-group-size-per-virtual-pipeline-stage`` for
    ``microbatch_group_size_per_vp_stage``). ``type`` converts the value where the annotation is not one plain
    type (``--moe-layer-freq``: an int or a list)."""
    return field(default=default, metadata=dict(help=help, choices=choices, flag=flag, aliases=aliases, type=type))


def _eval_layer_pattern(text: str):
    """Megatron-LM's layer pattern: a Python list expression of digits, commas, brackets, + and *; None if not one."""
    if re.search(r"[^,\d\[\]\(\)\+\*\s]", text):
        return None
    try:
        return eval(text)  # only list arithmetic on integer literals gets here
    except (SyntaxError, TypeError):
        return None


RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm", "moe", "moe_act", "shared_experts", "mla_up_proj")


def window_size_type(value):
    """--window-size: two ints, "L,R" or "(L,R)" (Megatron-LM's tuple syntax), or in --config a YAML list."""
    parts = value if isinstance(value, (list, tuple)) else str(value).strip("()[] ").split(",")
    try:
        window = tuple(int(part) for part in parts)
    except ValueError:
        window = ()
    if len(window) != 2:
        raise argparse.ArgumentTypeError(f"--window-size takes two ints LEFT,RIGHT such as 128,0, got {value!r}")
    return window


def _layer_freq(value, flag: str):
    """An int N (every Nth layer, from the first) or one 0 or 1 per layer, written as a Python list expression
    ("([0]*1+[1]*3)", Megatron-LM's syntax) or, in --config, a YAML list."""
    pattern = value
    if isinstance(value, str):
        pattern = _eval_layer_pattern(value) if "[" in value else int(value) if value.strip().isdigit() else None
    if not (isinstance(pattern, int) or isinstance(pattern, list) and all(isinstance(x, int) for x in pattern)):
        raise argparse.ArgumentTypeError(f"{flag} takes an int or a list expression such as "
                                         f"\"([0]*1+[1]*3)\", got {value!r}")
    return pattern


def moe_layer_freq_type(value):
    """--moe-layer-freq: an MoE layer every N layers, or a 0 (dense) or 1 (MoE) per layer."""
    return _layer_freq(value, "--moe-layer-freq")


def window_attn_skip_freq_type(value):
    """--window-attn-skip-freq: layers N, 2N, ... with full attention, or a 1 (window) or 0 (full) per layer."""
    return _layer_freq(value, "--window-attn-skip-freq")


def no_rope_freq_type(value):
    """--no-rope-freq: layers N, 2N, ... without RoPE, or a 1 (no RoPE) or 0 (RoPE) per layer."""
    return _layer_freq(value, "--no-rope-freq")


@dataclass(kw_only=True)
class ParallelArgs:
    tensor_model_parallel_size: int = arg(1, "Tensor-parallel degree (TP).")
    pipeline_model_parallel_size: int = arg(1, "Pipeline-parallel degree (PP).")
    num_layers_per_virtual_pipeline_stage: Optional[int] = arg(None, "Layers per virtual stage (interleaved schedule).")
    num_virtual_stages_per_pipeline_rank: Optional[int] = arg(None, "Virtual stages per pipeline rank (interleaved schedule).")
    sequence_parallel: bool = arg(False, "Shard LayerNorm/dropout activations along the sequence (needs TP > 1).")
    context_parallel_size: int = arg(1, "Context-parallel degree (CP).")
    expert_model_parallel_size: int = arg(1, "Expert-parallel degree (EP).")
    expert_tensor_parallel_size: Optional[int] = arg(None, "Tensor-parallel degree inside experts (default: TP).")
    use_distributed_optimizer: bool = arg(False, "Shard the optimizer state over DP (param all-gather, grad reduce-scatter).")
    num_distributed_optimizer_instances: int = arg(1, "Copies of the distributed optimizer over DP: each shards its "
                                                   "state over DP / N ranks (the param all-gather and grad "
                                                   "reduce-scatter stay within them), and the N copies all-reduce "
                                                   "their gradient shards.")
    overlap_grad_reduce: bool = arg(False, "Overlap the DP grad reduction with backward.")
    overlap_param_gather: bool = arg(False, "Overlap the distributed-optimizer param all-gather with forward.")
    accumulate_allreduce_grads_in_fp32: bool = arg(False, "Keep the DP grad buffer in fp32.")
    gradient_accumulation_fusion: bool = arg(True, "On CUDA, the weight-gradient GEMM adds into the DP grad buffer "
                                             "(apex's kernel, or its stand-in on torch's addmm) instead of writing a "
                                             "gradient that a hook then adds.",
                                             flag="no-gradient-accumulation-fusion")
    overlap_p2p_comm: bool = arg(True, "Overlap pipeline p2p with compute (interleaved schedule only).",
                                 flag="no-overlap-p2p-communication")
    ddp_bucket_size: Optional[int] = arg(None, "DP bucket size in elements (default: megatron-core's, max(40M, 1M x "
                                         "DP); with --overlap-grad-reduce only, else one bucket).")
    ddp_num_buckets: Optional[int] = arg(None, "DP buckets instead of --ddp-bucket-size: the bucket size is this "
                                         "rank's parameter count / N (Megatron-LM's).")
    ddp_pad_buckets_for_high_nccl_busbw: bool = arg(False, "Pad each DP bucket to a multiple of 2^16 elements (and of "
                                                    "DP), for NCCL's bus bandwidth at large DP counts.")
    ddp_average_in_collective: bool = arg(False, "Average the DP gradients in the collective (ReduceOp.AVG) instead "
                                          "of scaling them by 1/DP before a sum.")
    align_param_gather: bool = arg(True, "With --overlap-param-gather and the interleaved schedule: the pipeline "
                                   "schedule dispatches the param all-gathers, aligned across pipeline stages "
                                   "(--no-align-param-gather: each stage as it needs them).")
    data_parallel_sharding_strategy: str = arg("optim_grads_params", "Megatron FSDP's sharding; without FSDP (not "
                                               "implemented here) it changes nothing, as in Megatron-LM.",
                                               choices=["no_shard", "optim", "optim_grads", "optim_grads_params"])
    decoder_first_pipeline_num_layers: Optional[int] = arg(None, "Transformer layers on the first pipeline stage "
                                                           "(default: an even split).")
    decoder_last_pipeline_num_layers: Optional[int] = arg(None, "Transformer layers on the last pipeline stage "
                                                          "(default: an even split).")
    account_for_embedding_in_pipeline_split: bool = arg(False, "Count the input embedding as one layer of the first "
                                                        "pipeline stage when splitting the layers.")
    account_for_loss_in_pipeline_split: bool = arg(False, "Count the output layer and loss as one layer of the last "
                                                   "pipeline stage when splitting the layers.")
    pipeline_model_parallel_layout: Optional[str] = arg(None, "The layers of every pipeline stage, Megatron-LM's "
                                                        "syntax: stages split by |, E embedding, t decoder layer, m "
                                                        "multi-token prediction layer, L loss, (..)*n and x*n repeat "
                                                        "(e.g. \"Et*3|(tt|)*2t,L\"); more stages than PP gives PP x "
                                                        "virtual stages, in the interleaved order.")
    microbatch_group_size_per_vp_stage: Optional[int] = arg(
        None, "Interleaved schedule: micro-batches run per virtual stage before moving on (default: PP).",
        flag="microbatch-group-size-per-virtual-pipeline-stage")
    distributed_timeout_minutes: int = arg(10, "Timeout of the process groups' collectives, in minutes.")
    use_tp_pp_dp_mapping: bool = arg(False, "Number the ranks TP fastest, then PP, then DP (tp-cp-ep-pp-dp) instead "
                                     "of TP, DP, PP (tp-cp-ep-dp-pp): a pipeline's stages on neighbouring ranks "
                                     "(one node), its data-parallel replicas further apart.")
    distributed_backend: Optional[str] = arg(None, "torch.distributed backend (default: nccl with CUDA, gloo "
                                             "without).", choices=["nccl", "gloo"])
    disable_gloo_process_groups: bool = arg(False, "Create no gloo groups beside the NCCL ones (megatron-core makes "
                                            "them for checkpoint formats this trainer does not write; on CPU every "
                                            "group is gloo anyway).")
    local_rank: Optional[int] = arg(None, "This process's GPU on its node; torchrun's LOCAL_RANK wins when set "
                                    "(as in Megatron-LM).")


@dataclass(kw_only=True)
class ModelArgs:
    num_layers: int = arg(None, "Number of transformer layers.")
    hidden_size: int = arg(None, "Hidden size.")
    ffn_hidden_size: Optional[int] = arg(None, "MLP hidden size (default 4 x hidden, or 8/3 x hidden with --swiglu).")
    num_attention_heads: int = arg(None, "Attention heads.")
    kv_channels: Optional[int] = arg(None, "Per-head size (default hidden / heads).")
    group_query_attention: bool = arg(False, "Use grouped-query attention.")
    num_query_groups: int = arg(1, "Query groups with --group-query-attention.")
    seq_length: int = arg(None, "Sequence length.")
    max_position_embeddings: Optional[int] = arg(None, "Position table size (default --seq-length).")
    position_embedding_type: str = arg("learned_absolute", "Position embedding.", choices=["learned_absolute", "rope", "none"])
    use_rotary_position_embeddings: bool = arg(False, "Megatron-LM's older spelling of --position-embedding-type rope.")
    add_position_embedding: bool = arg(True, "Megatron-LM's deprecated way to drop the learned position embedding: "
                                       "accepted with --position-embedding-type rope or none (where it changes "
                                       "nothing), an error with learned_absolute.", flag="no-position-embedding")
    rotary_base: int = arg(10000, "RoPE base.")
    rotary_percent: float = arg(1.0, "Fraction of head dims rotated by RoPE.")
    rotary_interleaved: bool = arg(False, "RoPE rotates interleaved pairs (dims 0,1 / 2,3 / ...) instead of the two "
                                   "halves of each head (GPT-NeoX's, the default).")
    rotary_seq_len_interpolation_factor: Optional[int] = arg(None, "RoPE position interpolation: divide the positions "
                                                             "by this factor (a model trained on sequences this many "
                                                             "times shorter).")
    use_rope_scaling: bool = arg(False, "Llama 3.1's RoPE frequency scaling: the low frequencies divided by "
                                 "--rope-scaling-factor, the middle ones interpolated (as for an 8192-token original "
                                 "context).")
    rope_scaling_factor: float = arg(8.0, "Divisor of the low RoPE frequencies with --use-rope-scaling (Llama 3.1: 8).")
    no_rope_freq: Union[int, list[int], None] = arg(None, "Layers that skip RoPE (Llama 4's NoPE layers): N skips "
                                                    "it in layers N, 2N, ... (the last of every N), or a Python list "
                                                    "expression with a 1 (no RoPE) or 0 (RoPE) per layer, e.g. "
                                                    "\"([0]*3+[1])*12\".", type=no_rope_freq_type)
    normalization: str = arg("LayerNorm", "Norm layer.", choices=["LayerNorm", "RMSNorm"])
    norm_epsilon: float = arg(1e-5, "Norm epsilon.")
    apply_layernorm_1p: bool = arg(False, "Zero-centered norm weight (LayerNorm and RMSNorm): stored as gamma - 1, "
                                   "initialized to 0, applied as 1 + weight.")
    qk_layernorm: bool = arg(False, "Normalize each head's queries and keys (with --normalization's norm) before "
                             "the attention scores (OLMoE, Qwen3).")
    qk_l2_norm: bool = arg(False, "Scale each head's queries and keys to unit RMS, without weights, before the "
                           "attention scores (Llama 4's; it replaces --qk-layernorm's norm).")
    attention_output_gate: bool = arg(False, "Gate each head's attention output by the sigmoid of one more projection "
                                      "of the layer's input (Qwen3-Next's: the QKV projection grows by the queries' "
                                      "width).")
    apply_query_key_layer_scaling: bool = arg(False, "Divide the attention scores by the layer number before the "
                                              "softmax and multiply them back inside it, against fp16 overflow; "
                                              "implies --attention-softmax-in-fp32.")
    attention_softmax_in_fp32: bool = arg(False, "With --bf16/--fp16 and --attention-backend unfused: attention "
                                          "masking and softmax in fp32 (SDPA's and Transformer Engine's kernels "
                                          "keep the scores in fp32 either way).")
    fp32_residual_connection: bool = arg(False, "With --bf16/--fp16: keep the residual stream (the embedding output "
                                         "and every residual add) in fp32.")
    swiglu: bool = arg(False, "SwiGLU MLP.")
    squared_relu: bool = arg(False, "Squared-ReLU MLP (Nemotron) instead of GeLU.")
    quick_geglu: bool = arg(False, "Gated MLP with quick GeLU, x * sigmoid(1.702 x) (gpt-oss), instead of GeLU.")
    glu_linear_offset: float = arg(0.0, "Gated MLPs: activation(x_gate) * (x_linear + this) (gpt-oss: 1.0).")
    activation_func_clamp_value: Optional[float] = arg(None, "Gated MLPs: clamp the gate input to at most this and "
                                                       "the linear input to +-this before the activation (gpt-oss: "
                                                       "7.0).")
    untie_embeddings_and_output_weights: bool = arg(False, "Separate input embedding and output layer weights.")
    add_bias_linear: bool = arg(True, "Biases in linear layers.", flag="disable-bias-linear")
    add_qkv_bias: bool = arg(False, "Biases on the query/key/value projection, also with --disable-bias-linear "
                             "(Qwen2).")
    window_size: Optional[tuple] = arg(None, "Sliding-window attention: (left, right) tokens each query sees, "
                                       "written L,R or (L,R), -1 for no limit; causal attention takes (L,0) "
                                       "(default: full attention).",
                                       type=window_size_type)
    window_attn_skip_freq: Union[int, list[int], None] = arg(None, "With --window-size: which layers keep full "
                                                             "attention: N makes layers N, 2N, ... full, or a list "
                                                             "expression with a 1 (window) or 0 (full) per layer, "
                                                             "as for --moe-layer-freq (default: every layer "
                                                             "windowed).", type=window_attn_skip_freq_type)
    softmax_type: str = arg("vanilla", "Attention softmax: vanilla, off-by-one (an extra zero logit per query: "
                            "softmax1) or learnable (a learned per-head logit, gpt-oss's attention sinks).",
                            choices=["vanilla", "off-by-one", "learnable"])
    attention_dropout: float = arg(0.1, "Attention dropout.")
    hidden_dropout: float = arg(0.1, "Hidden dropout.")
    init_method_std: float = arg(0.02, "Std of the normal weight init.")
    init_method_xavier_uniform: bool = arg(False, "Xavier-uniform init of every weight matrix instead of the normal "
                                           "one of --init-method-std (fans of the full, unsharded matrix).")
    use_cpu_initialization: bool = arg(False, "Create the weights on the CPU, then move them to the GPU (different, "
                                       "equally valid random draws; always so without CUDA).")
    make_vocab_size_divisible_by: int = arg(128, "Pad the vocabulary to a multiple of this x TP.")
    padded_vocab_size: Optional[int] = arg(None, "The model's vocabulary size as it is, instead of the tokenizer's "
                                           "padded by --make-vocab-size-divisible-by (at least the tokenizer's, and "
                                           "divisible by TP).")
    transformer_impl: Optional[str] = arg(None, "Layer implementation (default transformer_engine if installed, else local).",
                                          choices=["local", "transformer_engine"])
    spec: Optional[list[str]] = arg(None, "Custom layer spec: MODULE FUNCTION_OR_ATTRIBUTE.")
    attention_backend: str = arg("auto", "Attention implementation. With --transformer-impl local: torch's "
                                 "scaled_dot_product_attention choosing its kernel (auto), only its flash kernel "
                                 "(flash), only cuDNN's (fused), or megatron-core's unfused DotProductAttention "
                                 "(unfused, local). With transformer_engine: Transformer Engine's.",
                                 choices=["auto", "flash", "fused", "unfused", "local"])
    use_flash_attn: bool = arg(False, "Megatron-LM's older spelling of --attention-backend flash.")
    recompute_granularity: Optional[str] = arg(None, "Activation recomputation.", choices=["full", "selective"])
    recompute_activations: bool = arg(False, "Megatron-LM's shorthand for --recompute-granularity selective.")
    moe_layer_recompute: bool = arg(False, "Megatron-LM's deprecated spelling of --recompute-granularity selective "
                                    "with moe added to --recompute-modules (recompute each MoE layer).")
    recompute_method: Optional[str] = arg(None, "Full recompute method.", choices=["uniform", "block"])
    recompute_num_layers: Optional[int] = arg(None, "Layers per recompute unit.")
    recompute_modules: Optional[list[str]] = arg(None, "With --recompute-granularity selective: the parts of each "
                                                 "layer whose activations are recomputed in the backward pass "
                                                 "(default core_attn; moe_act needs --moe-grouped-gemm, mla_up_proj "
                                                 "--multi-latent-attention).", choices=list(RECOMPUTE_MODULES))
    masked_softmax_fusion: bool = arg(True, "Fused masked softmax.", flag="no-masked-softmax-fusion")
    bias_gelu_fusion: bool = arg(True, "Fused bias+GeLU.", flag="no-bias-gelu-fusion")
    bias_swiglu_fusion: bool = arg(True, "Fused bias+SwiGLU.", flag="no-bias-swiglu-fusion")
    bias_dropout_fusion: bool = arg(True, "Fused bias+dropout+add.", flag="no-bias-dropout-fusion")
    cross_entropy_loss_fusion: bool = arg(False, "Fused vocab-parallel cross entropy: two TP all-reduces instead of "
                                          "three, torch.compile'd (the first iteration compiles it; on CPU with a C++ "
                                          "compiler). Its backward rounds the logits' gradient to bf16, also in fp32 "
                                          "runs (megatron-core's kernel).")
    cross_entropy_fusion_impl: str = arg("native", "Implementation of --cross-entropy-loss-fusion: megatron-core's "
                                         "(native) or Transformer Engine's (te).", choices=["native", "te"])


@dataclass(kw_only=True)
class MLAArgs:
    """DeepSeek-V2/V3's multi-latent attention (megatron-core's MLASelfAttention and MLATransformerConfig)."""
    multi_latent_attention: bool = arg(False, "Multi-latent attention: queries, keys and values projected through "
                                       "low-rank latents; its own rotary embedding (--rope-type).")
    q_lora_rank: Optional[int] = arg(None, "Rank of the queries' latent (None: one full-rank query projection).")
    kv_lora_rank: int = arg(32, "Rank of the keys' and values' shared latent.")
    qk_head_dim: int = arg(128, "Per-head query/key size without the rotary part.")
    qk_pos_emb_head_dim: int = arg(64, "Per-head size of the rotary part of queries and keys.")
    v_head_dim: int = arg(128, "Per-head value size.")
    rotary_scaling_factor: float = arg(1.0, "YaRN: context extension factor of the rotary embedding.")
    mscale: float = arg(1.0, "YaRN: attention scale factor.")
    mscale_all_dim: float = arg(0.0, "YaRN: attention scale factor of all dimensions.")
    rope_type: Optional[str] = arg(None, "Rotary embedding of multi-latent attention (default yarn); other attention "
                                   "takes rope only.", choices=["rope", "yarn"])
    # Megatron-LM's default is on; its kernel is Transformer Engine's, so without TE the unfused rotation runs (same math)
    apply_rope_fusion: bool = arg(True, "Fused RoPE (Transformer Engine's kernel; unfused without it).",
                                  flag="no-rope-fusion")


@dataclass(kw_only=True)
class MTPArgs:
    """DeepSeek-V3's multi-token prediction (megatron-core's MultiTokenPredictionBlock, on the last pipeline stage)."""
    mtp_num_layers: Optional[int] = arg(None, "Multi-token prediction layers: layer k predicts the token k + 1 places "
                                        "beyond the next one from the previous layer's hidden states and that token's "
                                        "embedding; their mean loss is added to the training loss.")
    mtp_loss_scaling_factor: float = arg(0.1, "Weight of the mean multi-token prediction loss in the training loss.")


@dataclass(kw_only=True)
class MoEArgs:
    num_experts: Optional[int] = arg(None, "Experts per MoE layer (MoE when set).")
    moe_router_topk: int = arg(2, "Experts per token.")
    moe_token_dispatcher_type: str = arg("allgather", "Token dispatcher.", choices=["allgather", "alltoall"])
    moe_aux_loss_coeff: float = arg(0.0, "Load-balancing loss coefficient.")
    moe_router_load_balancing_type: str = arg("aux_loss", "Load balancing.", choices=["aux_loss", "seq_aux_loss", "sinkhorn", "none"])
    moe_ffn_hidden_size: Optional[int] = arg(None, "Expert MLP hidden size (default --ffn-hidden-size).")
    moe_grouped_gemm: bool = arg(False, "Grouped GEMM experts (CUDA only).")
    moe_layer_freq: Union[int, list[int]] = arg(1, "Which layers are MoE: N puts one every N layers (from the first), "
                                                "or a Python list expression with a 1 (MoE) or 0 (dense) per layer, "
                                                "e.g. \"([0]*1+[1]*3)\": the first layer dense.",
                                                type=moe_layer_freq_type)
    moe_shared_expert_intermediate_size: Optional[int] = arg(None, "Hidden size of the shared expert MLP that every "
                                                             "token also goes through (number of shared experts x "
                                                             "each one's size); default none.")
    moe_shared_expert_overlap: bool = arg(False, "Overlap the shared expert with the alltoall dispatcher's "
                                          "communication.")
    moe_shared_expert_gate: bool = arg(False, "Scale the shared expert's output by the sigmoid of a learned "
                                       "projection of each token (Qwen2-MoE's).")
    moe_router_score_function: str = arg("softmax", "Router score function.", choices=["softmax", "sigmoid"])
    moe_router_pre_softmax: bool = arg(False, "Apply the score function before the top-k choice (else softmax over "
                                       "the chosen k; needed for --moe-router-topk 1 with softmax).")
    moe_router_topk_scaling_factor: Optional[float] = arg(None, "Multiply the chosen experts' routing weights by "
                                                          "this (DeepSeek-V2/V3).")
    moe_router_num_groups: Optional[int] = arg(None, "Group-limited routing: split the experts into this many "
                                               "groups (e.g. the EP size, or the nodes of the EP group).")
    moe_router_group_topk: Optional[int] = arg(None, "Group-limited routing: each token picks its experts from this "
                                               "many groups (those with the highest top scores).")
    moe_router_dtype: Optional[str] = arg(None, "Routing and the weighting of the experts' outputs in this dtype "
                                          "(default: the model's).", choices=["fp32", "fp64"])
    moe_router_enable_expert_bias: bool = arg(False, "Aux-loss-free load balancing (DeepSeek-V3): a per-expert bias "
                                              "on the scores chooses the experts; after every step it moves by "
                                              "--moe-router-bias-update-rate towards even token counts (needs "
                                              "--moe-router-score-function sigmoid).")
    moe_router_bias_update_rate: float = arg(1e-3, "Step of the expert bias per iteration.")
    moe_z_loss_coeff: Optional[float] = arg(None, "Router z-loss coefficient (1e-3 is a good start); logged as "
                                            "moe_z_loss.")
    moe_expert_capacity_factor: Optional[float] = arg(None, "Each expert takes at most this many times its even "
                                                      "share of the tokens; the rest are dropped (default: none "
                                                      "dropped).")
    moe_pad_expert_input_to_capacity: bool = arg(False, "Pad every expert's input to its capacity (needs "
                                                 "--moe-expert-capacity-factor).")
    moe_token_drop_policy: str = arg("probs", "Which tokens an expert over capacity drops: those of lowest routing "
                                     "probability (probs) or the last in the sequence (position).",
                                     choices=["probs", "position"])
    moe_per_layer_logging: bool = arg(False, "Also log each layer's MoE losses (moe/<loss>_layer_<i> in TensorBoard "
                                      "and W&B, moe_per_layer in the metrics file).")
    moe_permute_fusion: bool = arg(False, "Transformer Engine's fused token permutation (needs Transformer Engine).")
    moe_router_force_load_balancing: bool = arg(False, "Route by random scores, so every expert gets about the same "
                                                "tokens (for measuring speed only: the router does not learn).")
    moe_apply_probs_on_input: bool = arg(False, "Scale each token by its routing probability before the expert "
                                         "instead of scaling the expert's output (Llama 4's; --moe-router-topk 1).")


@dataclass(kw_only=True)
class TrainingArgs:
    micro_batch_size: int = arg(None, "Samples per micro-batch per DP rank.")
    global_batch_size: Optional[int] = arg(None, "Samples per iteration (default micro batch x DP).")
    rampup_batch_size: Optional[list[int]] = arg(None, "START INCREMENT SAMPLES: ramp the batch size from START to "
                                                 "--global-batch-size in steps of INCREMENT over the first SAMPLES "
                                                 "samples (Megatron-LM's; needs --train-samples).")
    step_batch_size_schedule: Optional[str] = arg(None, "\"THRESHOLD:BATCH ...\": the global batch size from each "
                                                  "threshold of consumed tokens on, the first 0, K/M/B/T suffixes "
                                                  "(newer Megatron-LM's; instead of --global-batch-size; needs "
                                                  "--train-samples).")
    train_iters: Optional[int] = arg(None, "Training iterations.")
    train_samples: Optional[int] = arg(None, "Training samples (alternative to --train-iters).")
    seed: int = arg(1234, "Random seed.")
    deterministic_mode: bool = arg(False, "Deterministic kernels (torch.use_deterministic_algorithms; cuBLAS "
                                   "workspace :4096:8 and NCCL_ALGO=Ring unless set): run-to-run identical bits, e.g. "
                                   "MoE token scatter on GPUs, at some speed cost.")
    bf16: bool = arg(False, "bf16 mixed precision.")
    disable_bf16_reduced_precision_matmul: bool = arg(False, "cuBLAS bf16 matmuls reduce in full precision "
                                                      "(torch.backends.cuda.matmul."
                                                      "allow_bf16_reduced_precision_reduction = False).")
    enable_experimental: bool = arg(False, "Turn on megatron-core's experimental features "
                                    "(megatron.core.config.set_experimental_flag).")
    fp16: bool = arg(False, "fp16 mixed precision.")
    loss_scale: Optional[float] = arg(None, "Static fp16 loss scale (default dynamic).")
    initial_loss_scale: float = arg(2.0**32, "Initial dynamic loss scale.")
    min_loss_scale: float = arg(1.0, "Minimum dynamic loss scale.")
    loss_scale_window: float = arg(1000, "Iterations between loss-scale increases.")
    hysteresis: int = arg(2, "Dynamic loss-scale hysteresis.")
    exit_interval: Optional[int] = arg(None, "Stop (after saving a checkpoint with --save) at the first iteration "
                                       "divisible by this.")
    exit_duration_in_mins: Optional[float] = arg(None, "Stop (after saving a checkpoint with --save) once this many "
                                                 "minutes have passed since start-up, e.g. before a job's time limit.")
    exit_signal_handler: bool = arg(False, "On --exit-signal, finish the iteration, save a checkpoint (with --save) "
                                    "and stop: SLURM sends SIGTERM before a time limit or a preemption.")
    exit_signal: str = arg("SIGTERM", "The signal of --exit-signal-handler.",
                           choices=["SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2"])
    manual_gc: bool = arg(False, "Disable Python's automatic garbage collection; collect every "
                          "--manual-gc-interval iterations instead (identical timing on every rank).")
    manual_gc_interval: int = arg(0, "With --manual-gc: iterations between collections (0: none during training).")
    calculate_per_token_loss: bool = arg(False, "Scale gradients by the global batch's token count (summed over "
                                         "micro-batches and DP ranks) instead of averaging per micro-batch.")
    check_for_nan_in_loss_and_grad: bool = arg(True, "Stop with an error at a NaN or Inf loss of a micro-batch or "
                                               "gradient norm of a DP bucket (off with fp16 dynamic loss scaling, "
                                               "whose overflows are expected).")
    check_for_spiky_loss: bool = arg(False, "Warn when a micro-batch's loss exceeds 10x the largest of the first 100.")
    rerun_mode: str = arg("disabled", "megatron-core's rerun state machine: disabled checks the losses and gradients "
                          "(--check-for-nan-in-loss-and-grad, --check-for-spiky-loss) without re-running an "
                          "iteration. Megatron-LM's default, validate_results (re-run a rejected iteration to tell a "
                          "transient fault from a persistent one), and report_stats are not implemented (an error).",
                          choices=["disabled", "validate_results", "report_stats"])
    check_for_large_grads: bool = arg(False, "Warn when a DP bucket's gradient norm, before the DP reduction, exceeds "
                                      "10x the largest of the first 100.")
    empty_unused_memory_level: int = arg(0, "Release the CUDA caching allocator's unused memory: 1 after the "
                                         "forward-backward, 2 also after the optimizer step (0: never).",
                                         choices=[0, 1, 2])


@dataclass(kw_only=True)
class OptimizerArgs:
    optimizer: str = arg("adam", "Optimizer.", choices=["adam", "sgd"])
    lr: float = arg(None, "Peak learning rate.")
    min_lr: float = arg(0.0, "Minimum learning rate.")
    lr_decay_style: str = arg("linear", "LR decay.", choices=["constant", "linear", "cosine", "inverse-square-root"])
    lr_decay_iters: Optional[int] = arg(None, "Iterations to decay over (default --train-iters).")
    lr_warmup_iters: int = arg(0, "Warmup iterations.")
    lr_warmup_fraction: Optional[float] = arg(None, "Warmup as a fraction of --lr-decay-iters.")
    lr_warmup_init: float = arg(0.0, "Learning rate at the start of warmup.")
    lr_decay_samples: Optional[int] = arg(None, "Samples to decay over, with --train-samples (default --train-samples).")
    lr_warmup_samples: int = arg(0, "Warmup samples, with --train-samples.")
    decoupled_lr: Optional[float] = arg(None, "Peak learning rate of the input embedding and output layer (default --lr).")
    decoupled_min_lr: Optional[float] = arg(None, "Minimum learning rate of the input embedding and output layer "
                                            "(default --min-lr), with --decoupled-lr.")
    weight_decay: float = arg(0.01, "Weight decay (with --weight-decay-incr-style constant).")
    apply_wd_to_qk_layernorm: bool = arg(False, "Weight decay on the --qk-layernorm weights too (Qwen3-Next's), which "
                                         "like every other norm weight and bias get none by default.")
    start_weight_decay: Optional[float] = arg(None, "Weight decay at the start of training (with "
                                              "--weight-decay-incr-style linear or cosine).")
    end_weight_decay: Optional[float] = arg(None, "Weight decay at the end of training (with "
                                            "--weight-decay-incr-style linear or cosine).")
    weight_decay_incr_style: str = arg("constant", "How the weight decay goes from --start-weight-decay to "
                                       "--end-weight-decay over training.", choices=["constant", "linear", "cosine"])
    clip_grad: float = arg(1.0, "Gradient-norm clipping (0 = off).")
    adam_beta1: float = arg(0.9, "Adam beta1.")
    adam_beta2: float = arg(0.999, "Adam beta2.")
    adam_eps: float = arg(1e-8, "Adam epsilon.")
    sgd_momentum: float = arg(0.9, "SGD momentum.")


@dataclass(kw_only=True)
class DataArgs:
    data_path: Optional[list[str]] = arg(None, "Dataset prefixes, optionally weighted: [W1] P1 [W2] P2 ...")
    split: str = arg(DEFAULT_SPLIT, "Train,valid,test split weights of --data-path.")
    train_data_path: Optional[list[str]] = arg(None, "The training split's own dataset prefixes, as --data-path.")
    valid_data_path: Optional[list[str]] = arg(None, "The validation split's own dataset prefixes, as --data-path.")
    test_data_path: Optional[list[str]] = arg(None, "The test split's own dataset prefixes, as --data-path.")
    data_args_path: Optional[str] = arg(None, "A file holding --data-path's value (whitespace-separated).")
    per_split_data_args_path: Optional[str] = arg(None, "A JSON file {\"train\": ..., \"valid\": ..., \"test\": ...} "
                                                  "holding the per-split prefixes, each a list or a string.")
    mock_data: bool = arg(False, "Synthetic data (MockGPTDataset).")
    builtin_corpus: Optional[str] = arg(
        None, "Real text on every machine, tokenized with the run's tokenizer: python-stdlib (the standard library's "
        "sources, divided by --split) or python-site-packages (also every installed package's, deduplicated, "
        "1%% of the files held out for validation and 1%% for test).", choices=["python-stdlib", "python-site-packages"])
    builtin_corpus_max_bytes: int = arg(4 << 20, "Source bytes of --builtin-corpus: the first files up to this size "
                                        "(the stdlib holds ~12 MB, with the site-packages ~150 MB; more text, fewer "
                                        "epochs in long runs).")
    data_cache_path: str = arg(os.path.join(os.path.expanduser("~"), ".cache", "megatron-compressed-comm"), "Dataset cache.")
    tokenizer_type: str = arg("ByteTokenizer", "Tokenizer (TikTokenizer: an error naming the alternatives).",
                              choices=["ByteTokenizer", "NullTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer",
                                       "TikTokenizer"])
    tokenizer_model: Optional[str] = arg(None, "Tokenizer model path (HuggingFaceTokenizer).")
    trust_remote_code: bool = arg(False, "Megatron-LM's permission for a HuggingFace tokenizer to run the model's own "
                                  "code. Changes nothing here: tokenizer.json is read by the tokenizers library, which "
                                  "runs none.")
    vocab_file: Optional[str] = arg(None, "Vocabulary file (GPT2BPETokenizer).")
    merge_file: Optional[str] = arg(None, "BPE merges file (GPT2BPETokenizer).")
    vocab_size: Optional[int] = arg(None, "Vocabulary size (NullTokenizer).")
    tiktoken_pattern: Optional[str] = arg(None, "TikTokenizer's pre-tokenization pattern; other tokenizers ignore it "
                                          "(as in Megatron-LM).", choices=["v1", "v2"])
    num_workers: int = arg(0, "Data-loader workers.")
    dataloader_type: Optional[str] = arg(None, "Data loader: single (one pass in order from the consumed samples on, "
                                         "the only one here; the default).", choices=["single", "cyclic", "external"])
    num_dataset_builder_threads: int = arg(1, "Threads per rank that build the datasets' indices.")
    mmap_bin_files: bool = arg(True, "Memory-map the dataset's .bin files (--no-mmap-bin-files: read them).")
    reset_position_ids: bool = arg(False, "Restart position ids after each end-of-document.")
    reset_attention_mask: bool = arg(False, "Block attention across documents.")
    eod_mask_loss: bool = arg(False, "Mask the loss on end-of-document tokens.")


@dataclass(kw_only=True)
class CheckpointArgs:
    save: Optional[str] = arg(None, "Checkpoint directory to save to.")
    load: Optional[str] = arg(None, "Checkpoint directory to resume from.")
    save_interval: Optional[int] = arg(None, "Iterations between saves.")
    save_retain_interval: Optional[int] = arg(None, "Keep under --save only the checkpoints of iterations divisible "
                                              "by this (a multiple of --save-interval) and the latest: once a save is "
                                              "published, the one before it is deleted unless its iteration is such "
                                              "a multiple or it is a symbolic link (Megatron-LM's).")
    non_persistent_save_interval: Optional[int] = arg(None, "Iterations between non-persistent saves (with "
                                                      "--non-persistent-ckpt-type global: only the newest two are "
                                                      "kept, and a load takes the newer of them and --load's).")
    non_persistent_ckpt_type: Optional[str] = arg(None, "Kind of non-persistent checkpoints: global (full "
                                                  "checkpoints in --non-persistent-global-ckpt-dir); Megatron-LM's "
                                                  "local and in_memory are not implemented (an error).",
                                                  choices=["global", "local", "in_memory"])
    non_persistent_global_ckpt_dir: Optional[str] = arg(None, "Directory of global non-persistent checkpoints "
                                                        "(default: the non_persistent directory in --save, and in "
                                                        "--load for a load).")
    no_save_optim: bool = arg(False, "Save no optimizer and LR-scheduler state (a run loading it starts them afresh).")
    no_save_rng: bool = arg(False, "Save no RNG states (a run loading it keeps its own seeded RNG).")
    no_load_optim: bool = arg(False, "Do not load the optimizer state.")
    dist_ckpt_optim_fully_reshardable: bool = arg(False, "Save the distributed optimizer's state fully reshardable "
                                                  "(gathered per parameter on DP rank 0: slower to save, but a resume "
                                                  "may change TP and PP too), instead of the dp_reshardable default.")
    no_load_rng: bool = arg(False, "Do not load the RNG states.")
    # Megatron-LM's spellings keep an underscore (--override-opt_param-scheduler); both are accepted.
    override_opt_param_scheduler: bool = arg(False, "On load, take the LR/WD schedule from the command line, not "
                                             "the checkpoint.", aliases=("override-opt_param-scheduler",))
    use_checkpoint_opt_param_scheduler: bool = arg(False, "On load, take the LR/WD schedule from the checkpoint. "
                                                   "Neither flag: they must agree (as in Megatron-LM).",
                                                   aliases=("use-checkpoint-opt_param-scheduler",))
    finetune: bool = arg(False, "Load only the model weights from --load (no optimizer or RNG state) and start "
                         "at iteration 0 with no samples consumed: fine-tuning from a pretrained checkpoint.")
    pretrained_checkpoint: Optional[str] = arg(None, "Where --load holds no checkpoint yet: fine-tune (as --finetune) "
                                               "from this directory's checkpoint; later runs resume from --load.")
    ckpt_step: Optional[int] = arg(None, "Load this iteration instead of the tracker file's latest.")
    exit_on_missing_checkpoint: bool = arg(False, "Stop with an error when --load holds no checkpoint, instead of "
                                           "training from a random initialization (with a warning naming it).")
    use_checkpoint_args: bool = arg(False, "Take the model's shape and tokenizer flags from the --load (or "
                                    "--pretrained-checkpoint) checkpoint's saved arguments: those given on the "
                                    "command line that Megatron-LM keeps win, the rest are overridden.")
    ckpt_format: str = arg("torch_dist", "Checkpoint format.", choices=["torch_dist"])
    async_save: bool = arg(False, "Write checkpoints in a background process while training goes on (Megatron-LM's; "
                           "a save is published, tracker included, only once every rank has written it).")
    use_persistent_ckpt_worker: bool = arg(False, "--async-save: keep one writer process for the run instead of "
                                           "forking one per save (needs CUDA).")
    async_strategy: Optional[str] = arg(None, "--async-save's background writer: nvidia-resiliency-ext's (nvrx) or "
                                        "megatron-core's own (mcore). Default: nvrx where nvidia-resiliency-ext is "
                                        "installed, else mcore. No effect without --async-save (as in Megatron-LM).",
                                        choices=["nvrx", "mcore"])
    ckpt_fully_parallel_save: bool = arg(True, "Do not spread the writing of DP-replicated tensors over the DP "
                                         "replicas (DP rank 0 writes them).", flag="no-ckpt-fully-parallel-save")
    ckpt_fully_parallel_load: bool = arg(False, "Each DP replica reads part of the checkpoint and they exchange "
                                         "the rest, instead of every rank reading all it needs.")
    ckpt_assume_constant_structure: bool = arg(False, "Every save has the same structure: reuse the first save's "
                                               "plan and skip re-validating it.")
    dist_ckpt_strictness: str = arg("assume_ok_unexpected", "How a load treats keys that differ between the checkpoint "
                                    "and the model (megatron-core's StrictHandling).",
                                    choices=["assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected",
                                             "raise_all", "return_unexpected", "return_all", "ignore_all"])


@dataclass(kw_only=True)
class LoggingArgs:
    log_interval: int = arg(100, "Iterations between log lines.")
    log_params_norm: bool = arg(False, "Log the L2 norm of the parameters (fp32 main parameters with bf16) every "
                                "iteration.")
    log_num_zeros_in_grad: bool = arg(False, "Log the number of zero entries in the (clipped) gradients.")
    log_progress: bool = arg(False, "Append start-ups and saved checkpoints, with throughput, FLOPs and tokens so "
                             "far, to progress.txt in --save.")
    timing_log_level: int = arg(0, "Timers logged every --log-interval: 0 none, 1 once-per-iteration steps "
                                "(forward-backward, grads sync, optimizer), 2 also per-micro-batch steps.",
                                choices=[0, 1, 2])
    timing_log_option: str = arg("minmax", "Timers across ranks: the max, min and max, or every rank's.",
                                 choices=["max", "minmax", "all"])
    eval_interval: Optional[int] = arg(None, "Iterations between evaluations (default: none).")
    eval_iters: int = arg(100, "Iterations per evaluation.")
    eval_global_batch_size: Optional[int] = arg(None, "Samples per evaluation iteration (default: --global-batch-size): "
                                                "a multiple of --micro-batch-size x data-parallel size.")
    skip_train: bool = arg(False, "Do not train: evaluate the validation and test splits (--eval-iters batches each; "
                           "with --load, the checkpoint's model) and exit.")
    tensorboard_dir: Optional[str] = arg(None, "TensorBoard log directory.")
    tensorboard_log_interval: int = arg(1, "Iterations between TensorBoard (and Weights & Biases) writes.")
    tensorboard_queue_size: int = arg(1000, "TensorBoard events held before a write to disk.")
    log_timers_to_tensorboard: bool = arg(False, "Write the --timing-log-level timers to TensorBoard (and Weights & "
                                          "Biases).")
    log_loss_scale_to_tensorboard: bool = arg(True, "Log the loss scale.")
    log_validation_ppl_to_tensorboard: bool = arg(False, "Log the validation perplexity, exp(min(20, loss)).")
    log_memory_to_tensorboard: bool = arg(False, "Log the CUDA caching allocator's reserved, allocated, peak "
                                          "allocated bytes and allocation count (CUDA only).")
    log_world_size_to_tensorboard: bool = arg(False, "Log the world size.")
    record_memory_history: bool = arg(False, "Record the CUDA allocator's history and dump a snapshot every "
                                      "--log-interval to --memory-snapshot-path, suffixed _RANK (CUDA only).")
    memory_snapshot_path: str = arg("snapshot.pickle", "Where --record-memory-history dumps its snapshots.")
    metrics_file: Optional[str] = arg(None, "Per-iteration JSON-lines metrics file.")
    wandb_project: Optional[str] = arg(None, "Weights & Biases project: log the per-iteration metrics there too "
                                       "(needs the wandb package).")
    wandb_exp_name: Optional[str] = arg(None, "Weights & Biases run name.")
    wandb_entity: Optional[str] = arg(None, "Weights & Biases team or user that owns the run (default: wandb's).")
    wandb_save_dir: Optional[str] = arg(None, "Weights & Biases local directory (default: wandb's).")
    params_checksum_interval: int = arg(0, "Iterations between params sha256 checksums in the metrics (0 = off).")
    check_weight_hash_across_dp_replicas_interval: Optional[int] = arg(None, "Iterations between checks that every "
                                                                       "data-parallel replica holds the same "
                                                                       "weights (SHA-1 of each parameter; the run "
                                                                       "stops on a difference); also checked at "
                                                                       "start.")
    logging_level: Optional[int] = arg(None, "Python logging level of every logger (e.g. 10 debug, 20 info, 30 "
                                       "warning); the environment's MEGATRON_LOGGING_LEVEL if not given.")
    profile: bool = arg(False, "Profile iterations --profile-step-start..--profile-step-end (nsys range, or the "
                        "PyTorch profiler with --use-pytorch-profiler).")
    use_pytorch_profiler: bool = arg(False, "With --profile: the PyTorch profiler; trace and op table go to "
                                     "--tensorboard-dir (else next to --metrics-file).")
    profile_step_start: int = arg(10, "First profiled iteration.")
    profile_step_end: int = arg(12, "Iteration at which profiling stops (exclusive).")
    profile_ranks: Optional[list[int]] = arg(None, "Global ranks to profile (default: rank 0).")
    pytorch_profiler_collect_shapes: bool = arg(False, "With --use-pytorch-profiler: record the ops' input shapes.")
    pytorch_profiler_collect_callstack: bool = arg(False, "With --use-pytorch-profiler: record the Python call stack "
                                                   "of each op (larger trace, slower profiled iterations).")


@dataclass(kw_only=True)
class CompressionArgs:
    tp_comm_compression: str = arg("none", "TP collective compression: taco, or tahquant (TahQuant's low-bit "
                                   "pipeline code, set by --pp-comm-bits/-tile-size/-high-bit-fraction, on the TP "
                                   "path: the TACO paper's comparison).", choices=["none", "taco", "tahquant"])
    tp_comm_compression_min_bytes: str = arg(
        "auto", "TP tensors smaller than this many bytes stay uncompressed; 'auto' measures, per collective, the "
        "size from which compression is faster on this TP group at start-up (never, if it never is).")
    tp_comm_compression_trial_iters: int = arg(
        6, "With --tp-comm-compression-min-bytes auto: training iterations (after the first 2) that alternate "
        "uncompressed and compressed TP collectives; compression stays on only if it makes iterations at least "
        "2%% faster, or faster in every trial iteration (0: no trial, trust the start-up probe).")
    tp_comm_cuda_graphs: bool = arg(
        False, "Replay each compressed TP collective of a fixed shape as a CUDA graph (after 2 eager calls), "
        "cutting its host cost; a replayed collective completes before the next GEMM (no comm/compute overlap).")
    tp_comm_emulate: int = arg(
        1, "With --tensor-model-parallel-size 1 and --tp-comm-compression taco: give every TP collective the numerics "
        "of a TP=N run (the N partial sums and shards coded and combined as the compressed collectives do, with "
        "--sequence-parallel the SP ones), in one process: the convergence of compressed TP=N on one GPU "
        "(docs/tp-emulation.md). 1: off.")
    taco_block_size: int = arg(256, "TACO block size (power of two, 32..1024).")
    taco_format: str = arg("int8", "TACO element format: int8 (default, best error and convergence in our "
                           "runs) or the paper's e4m3, or e5m2.", choices=["e4m3", "e5m2", "int8"])
    taco_transform: str = arg("ash", "TACO outlier transform.", choices=["ash", "hadamard", "none"])
    taco_scaling: str = arg("dual", "TACO scaling.", choices=["dual", "single"])
    taco_all_reduce: str = arg(
        "auto", "Compressed all-reduce algorithm: two-shot (the paper's: all-to-all, reduce, re-encode, all-gather), "
        "one-shot (all-gather, decode and sum: same bytes at TP=2, fewer launches, one quantization), or auto "
        "(one-shot at TP=2, else two-shot).", choices=["auto", "one-shot", "two-shot"])
    param_gather_compression: str = arg("none", "DP param all-gather compression (sdp4bit is lossy).",
                                        choices=["none", *PARAM_GATHER_METHODS])
    param_gather_verify_interval: int = arg(0, "Gathers between checks (0 = off): lossless codecs bit-compare with an "
                                            "uncompressed gather, sdp4bit checks that all replicas agree.",
                                            aliases=("ciera-verify-interval",))
    param_gather_integrity_check: bool = arg(
        True, "With --param-gather-compression delta: send a 64-bit hash of each rank's coded change with its payload "
        "(computed by the encode kernel) and compare it with each receiver's decode (computed by the decode kernel); "
        "a bucket whose decode differs is gathered again uncompressed, counted (integrity_mismatches in the metrics' "
        "comm_counters) and logged (--no-param-gather-integrity-check: off).",
        flag="no-param-gather-integrity-check")
    param_gather_integrity_max_mismatches: int = arg(
        3, "With --param-gather-integrity-check: stop with an error at this many gathers whose decodes differed from "
        "what was sent (each was re-gathered uncompressed; >= 1).")
    param_gather_keyframe_interval: int = arg(
        0, "With --param-gather-compression ciera or delta: every this many gathers of a bucket group go "
        "uncompressed (a keyframe: every replica's copy of the other ranks' shards is rewritten); 0: off.")
    ciera_block_size: int = arg(512, "CIERA block size (power of two, 64..65536).")
    ciera_change_detect: str = arg("compare", "CIERA change detection.", choices=["hash", "compare"])
    ciera_exponent_coder: str = arg("raw", "CIERA exponent coder.", choices=["raw", "ans"])
    param_gather_selection: str = arg(
        "benefit", "Which buckets the lossless param-gather codecs (ciera, delta) compress: 'benefit' measures the "
        "first 8 gathers and keeps only buckets where compression is expected to be faster (never slower than "
        "uncompressed); 'all' compresses every bucket.", choices=["all", "benefit"], aliases=("ciera-selection",))
    param_gather_trial_iters: int = arg(
        6, "With --param-gather-selection benefit: once the buckets are chosen, training iterations that "
        "alternate the plain and the compressed parameter all-gather (both bit-exact); compression stays on only "
        "if it makes iterations at least 2%% faster, or faster in every trial iteration (0: no trial, trust the "
        "per-bucket model).")
    param_gather_reselect_interval: int = arg(
        500, "With --param-gather-selection benefit: every this many iterations, measure the buckets again and "
        "choose again (and try a choice that switches buckets), as the parameters' drift changes over a run "
        "(a run's first steps change far more values than later ones); 0: choose once, at the start.")
    ciera_cache_budget_mb: Optional[float] = arg(None, "CIERA cache budget in MB per rank (default unlimited): the "
                                                 "sender's exponent copy or block hashes, plus on GPUs the payload "
                                                 "buffer, of every compressed shard.")
    delta_block_size: int = arg(256, "Delta codec block size (power of two, 32..8192).")
    delta_fused_cast: bool = arg(False, "With --param-gather-compression delta: round the optimizer's fp32 master "
                                 "weights into the parameter buffer inside the delta encode instead of in the "
                                 "optimizer step (bit-identical; no sender copy, 2 bytes per shard value less).")
    delta_capacity_factor: float = arg(0.0, "With --param-gather-compression delta: send each delta payload in a "
                                       "slot of this many times the last gather's largest payload, behind its size, "
                                       "so that no host sync waits for the sizes before the transfer (one at its "
                                       "end instead); a payload that outgrows its slot is followed by the bucket's "
                                       "uncompressed all-gather (lossless). 0: exchange the sizes first; else >= 1, "
                                       "e.g. 1.25.")
    delta_cuda_graphs: bool = arg(False, "With --delta-capacity-factor: capture each sync-free delta gather's device "
                                  "work (encode, all-gather, decode) as a CUDA graph after 2 eager gathers and replay "
                                  "it, cutting its host cost (GPUs only).")
    sdp4bit_group_size: int = arg(128, "SDP4Bit weight-difference quantization group (power of two, 16..4096).")
    sdp4bit_weight_bits: int = arg(4, "SDP4Bit weight-difference code bits.", choices=[4, 8])
    grad_reduce_compression: str = arg("none", "DP gradient reduce-scatter compression (lossy, SDP4Bit's Hadamard "
                                       "rotation + int8/int4).", choices=["none", "hadamard-int8", "hadamard-int4"])
    grad_reduce_block_size: int = arg(128, "Hadamard block size of --grad-reduce-compression (power of two, 16..4096).")
    pp_comm_compression: str = arg("none", "Pipeline-parallel p2p compression (lossy).", choices=["none", "tahquant"])
    pp_comm_compress_grads: bool = arg(True, "Compress the backward gradients between stages too (with "
                                       "--pp-comm-compression).", flag="no-pp-comm-compress-grads")
    pp_comm_emulate: int = arg(
        1, "With --pipeline-model-parallel-size 1 and --pp-comm-compression tahquant: pass the hidden states that a "
        "PP=N run (equal stages) sends between its stages, and their gradients, through the codec as that run's "
        "messages, in one process: the convergence of compressed PP=N on one GPU, also with --tp-comm-emulate "
        "(docs/tp-emulation.md). 1: off.")
    dp_comm_emulate: int = arg(
        1, "With data-parallel size 1, --use-distributed-optimizer and SDP4Bit (--param-gather-compression sdp4bit, "
        "--grad-reduce-compression hadamard-int8/int4): give the parameter all-gather and gradient reduce-scatter the "
        "numerics of a DP=N run (each micro-batch's gradients coded as its rank's, N a power of two up to 128), in one "
        "process (docs/tp-emulation.md). 1: off.")
    pp_comm_bits: int = arg(4, "TahQuant bits per value of the low-bit tokens (2..8).")
    pp_comm_tile_size: int = arg(64, "TahQuant tile size: channels per scale (power of two, 16..1024).")
    pp_comm_high_bit_fraction: float = arg(0.125, "Fraction of each message's tokens that TahQuant sends with 8 bits.")


SECTIONS = (ParallelArgs, ModelArgs, MLAArgs, MTPArgs, MoEArgs, TrainingArgs, OptimizerArgs, DataArgs, CheckpointArgs,
            LoggingArgs, CompressionArgs)

# Megatron-LM flags that launch scripts pass and that change nothing here (they ask for what this trainer always does,
# or for nothing without another flag): accepted, no effect (number of values).
ALREADY_SO = {
    "use-mcore-models": (0, "megatron-core models are the only models here"),
    "no-create-attention-mask-in-dataloader": (0, "the data loader never builds attention masks (causal attention "
                                                  "needs none)"),
    "log-throughput": (0, "every log line shows tokens/s and TFLOP/s/GPU"),
    "grad-reduce-in-bf16": (0, "gradients are reduced in the parameters' dtype unless "
                               "--accumulate-allreduce-grads-in-fp32"),
    "no-persist-layer-norm": (0, "apex's persistent LayerNorm kernel is never used here (persist_layer_norm stays "
                                 "off; without apex the local spec's norms are torch's)"),
    "use-dist-ckpt": (0, "Megatron-LM's older spelling of --ckpt-format torch_dist, the only format here"),
    "auto-detect-ckpt-format": (0, "a load reads the checkpoint's format from its directory: torch_dist loads, "
                                   "another format is an error naming it"),
    "openai-gelu": (0, "Megatron-LM parses it and uses it nowhere: its GeLU, and this trainer's, is torch's"),
    "straggler-minmax-count": (1, "it sizes the report of --log-straggler (not implemented here, an error), and "
                                  "without it Megatron-LM uses it nowhere either"),
}
# Megatron-LM flags this trainer does not implement: an error that names the flag and the fix (number of values).
NOT_IMPLEMENTED = {
    "log-straggler": (0, "the straggler detector (each rank's GPU throughput) is not implemented: drop it "
                         "(--timing-log-option all logs every rank's timers)"),
    "non-persistent-local-ckpt-dir": (1, "local non-persistent checkpoints (nvidia-resiliency-ext's) are not "
                                         "implemented: use --non-persistent-ckpt-type global"),
    "non-persistent-local-ckpt-algo": (1, "local non-persistent checkpoints (nvidia-resiliency-ext's) are not "
                                          "implemented: use --non-persistent-ckpt-type global"),
    "object-storage-cache-path": (1, "data is read from local files only (no object storage): copy the dataset to a "
                                     "filesystem and give --data-path"),
    "s3-cache-path": (1, "data is read from local files only (no S3): copy the dataset to a filesystem and give "
                         "--data-path"),
    "overlap-param-gather-with-optimizer-step": (0, "Megatron-LM supports it only with --ckpt-format torch, and "
                                                    "this trainer saves torch_dist only: drop it "
                                                    "(--overlap-param-gather still overlaps the gather with the "
                                                    "forward pass)"),
    "use-torch-fsdp2": (0, "FSDP is not implemented: use --use-distributed-optimizer (ZeRO-1: optimizer state "
                           "sharded over DP)"),
    "use-custom-fsdp": (0, "FSDP is not implemented: use --use-distributed-optimizer (ZeRO-1: optimizer state "
                           "sharded over DP)"),
    "use-megatron-fsdp": (0, "FSDP is not implemented: use --use-distributed-optimizer (ZeRO-1: optimizer state "
                             "sharded over DP)"),
    "tp-comm-overlap": (0, "Transformer Engine's userbuffer TP overlap is not implemented: drop it (TP "
                           "communication can be compressed with --tp-comm-compression taco)"),
    "defer-embedding-wgrad-compute": (0, "it needs gradient accumulation fusion, an apex CUDA extension never used "
                                         "here: drop it"),
    "delay-wgrad-compute": (0, "delaying the weight-gradient GEMMs needs Transformer Engine's split backward, which "
                               "this trainer does not wire up: drop it"),
    "eval-only": (0, "not a Megatron-LM flag: its evaluation-only run is --skip-train (with --load and --eval-iters)"),
    **{flag: (nargs, "FP8/FP4 training (Transformer Engine's low-precision GEMMs) is not wired up here: drop the "
                     "--fp8-*/--fp4-* flags and train with --bf16 (--tp-comm-compression taco sends the TP "
                     "collectives in 8 bits)")
       for flag, nargs in (("fp8-format", 1), ("fp8-recipe", 1), ("fp8-margin", 1), ("fp8-interval", 1),
                           ("fp8-amax-history-len", 1), ("fp8-amax-compute-algo", 1), ("fp8-param-gather", 0),
                           ("first-last-layers-bf16", 0), ("fp4-format", 1), ("fp4-recipe", 1),
                           ("fp4-param-gather", 0))},
    **{flag: (nargs, "CUDA graphs of whole layers are not implemented: drop --cuda-graph-impl/--cuda-graph-modules "
                     "(--tp-comm-cuda-graphs captures the compressed TP collectives)")
       for flag, nargs in (("cuda-graph-impl", 1), ("cuda-graph-modules", "+"), ("cuda-graph-scope", "+"))},
    "use-precision-aware-optimizer": (0, "it needs Transformer Engine's FusedAdam, which is not wired up here: drop "
                                         "it (fp32 main parameters and Adam moments)"),
    "overlap-moe-expert-parallel-comm": (0, "overlapping the MoE all-to-all with another micro-batch's compute is not "
                                            "implemented: drop it (--moe-shared-expert-overlap overlaps the shared "
                                            "expert with the dispatch)"),
    "moe-router-fusion": (0, "Transformer Engine's fused router kernels are not wired up here: drop it (the same "
                             "routing runs unfused)"),
    "moe-flex-dispatcher-backend": (1, "the flex token dispatcher (DeepEP, HybridEP) is not wired up here: use "
                                       "--moe-token-dispatcher-type alltoall or allgather"),
    "init-model-with-meta-device": (0, "it is for FSDP, which is not implemented: drop it"),
    **{flag: (nargs, "Megatron FSDP is not implemented: use --use-distributed-optimizer (ZeRO-1: optimizer state "
                     "sharded over DP)")
       for flag, nargs in (("fsdp-double-buffer", 0), ("megatron-fsdp-main-grads-dtype", 1),
                           ("megatron-fsdp-grad-comm-dtype", 1), ("megatron-fsdp-main-params-dtype", 1),
                           ("megatron-fsdp-max-pool-double-buffer", 0), ("fsdp-db-use-persist-buf-on-alloc-fail", 0),
                           ("fsdp-manual-registration", 0), ("outer-dp-sharding-strategy", 1),
                           ("megatron-fsdp-enable-fine-grained-param-gather", 0), ("megatron-fsdp-version", 1))},
    "use-nccl-ub": (0, "NCCL user buffers (registered for FSDP and NVLS collectives) are not wired up: drop it"),
    "enable-gpt-oss": (0, "it is a ModelOpt (post-training) flag that makes Megatron-LM's ModelOpt model builder use "
                          "YaRN RoPE; not implemented here: drop it (gpt-oss's layers: --quick-geglu "
                          "--glu-linear-offset 1.0 --activation-func-clamp-value 7.0 --softmax-type learnable "
                          "--window-size 127,0 --window-attn-skip-freq 2)"),
    "export-force-local-attention": (0, "it is a ModelOpt export flag; drop it (--transformer-impl local builds "
                                        "megatron-core's local attention)"),
}


def _value_type(annotation):
    """(element type, is_list) of a field annotation such as Optional[list[str]]."""
    if typing.get_origin(annotation) is typing.Union:
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    if typing.get_origin(annotation) is list:
        return typing.get_args(annotation)[0], True
    return annotation, False


def _add_field(group, f) -> None:
    meta = f.metadata
    value_type, is_list = _value_type(f.type)
    name = "--" + f.name.replace("_", "-")
    if value_type is bool:
        if meta["flag"] is not None:  # Megatron-LM's own negative flag (--no-masked-softmax-fusion), and --X
            group.add_argument("--" + meta["flag"], dest=f.name, action="store_false", default=f.default,
                               help=meta["help"])
            group.add_argument(name, dest=f.name, action="store_true", default=f.default,
                               help=f"Undo --{meta['flag']} (e.g. one that a --config file gives).")
        elif f.name.startswith("no_"):  # Megatron-LM's --no-load-optim: argparse reads a --no-X of --X as False
            group.add_argument(name, dest=f.name, action="store_true", default=f.default,
                               help=meta["help"])
        else:  # --X and --no-X: a YAML config's true can be turned off on the command line
            group.add_argument(name, *["--" + a for a in meta["aliases"]], dest=f.name,
                               action=argparse.BooleanOptionalAction, default=f.default, help=meta["help"])
        return
    flags = ["--" + meta["flag"] if meta["flag"] else name] + ["--" + a for a in meta["aliases"]]
    group.add_argument(*flags, dest=f.name, type=meta["type"] or value_type, default=f.default,
                       choices=meta["choices"], nargs="+" if is_list else None, help=meta["help"])


def build_parser(extra_args_provider=None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Megatron-core GPT/MoE training with compressed communication",
                                     allow_abbrev=False)
    parser.add_argument("--config", default=None, help="Flat YAML file of flag names without '--'; CLI flags win.")
    for section in SECTIONS:
        group = parser.add_argument_group(section.__name__.removesuffix("Args").lower())
        for f in dataclasses.fields(section):
            _add_field(group, f)
    group = parser.add_argument_group("Megatron-LM flags that change nothing here")
    for flag, (nargs, reason) in ALREADY_SO.items():
        takes = dict(nargs=nargs) if nargs else dict(action="store_true")
        group.add_argument("--" + flag, **takes, dest="megatron_lm_" + flag.replace("-", "_"),
                           help=f"Accepted: {reason}.")
    group = parser.add_argument_group("Megatron-LM flags not implemented (error)")
    for flag, (nargs, reason) in NOT_IMPLEMENTED.items():
        takes = dict(nargs=nargs) if nargs else dict(action="store_true")
        group.add_argument("--" + flag, **takes, default=None, dest="not_implemented_" + flag.replace("-", "_"),
                           help=reason[0].upper() + reason[1:] + ".")
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    return parser


def _yaml_value(action, key, value, path):
    """Convert one YAML value with the flag's own type and choices."""
    if isinstance(action, (argparse.BooleanOptionalAction, argparse._StoreFalseAction, argparse._StoreTrueAction)):
        if not isinstance(value, bool):
            raise ValueError(f"--config {path}: '{key}' must be true or false, got {value!r}")
        return not value if isinstance(action, argparse._StoreFalseAction) else value
    if value is None:
        return None
    convert = action.type or str
    exact = {int: (int,), float: (int, float)}.get(convert)  # YAML's own numbers: 2.7 is no int (int() would cut it)
    values = value if isinstance(value, list) else [value]
    if exact and any(isinstance(v, bool) or not isinstance(v, exact + (str,)) for v in values):
        raise ValueError(f"--config {path}: '{key}' expects {convert.__name__}, got {value!r}")
    try:
        if action.nargs == "+":
            return [convert(v) for v in (value if isinstance(value, list) else [value])]
        result = convert(value)
    except argparse.ArgumentTypeError as error:  # a converter's own message (--moe-layer-freq)
        raise ValueError(f"--config {path}: '{key}': {error}") from error
    except (TypeError, ValueError) as error:
        raise ValueError(f"--config {path}: '{key}' expects {convert.__name__}, got {value!r}") from error
    if action.choices is not None and result not in action.choices:
        raise ValueError(f"--config {path}: '{key}' must be one of {list(action.choices)}, got {value!r}")
    return result


def load_yaml_defaults(parser: argparse.ArgumentParser, path: str) -> dict:
    """Map a flat YAML file onto parser destinations; unknown keys are an error naming key and file."""
    import yaml

    with open(path) as f:
        mapping = yaml.safe_load(f) or {}
    if not isinstance(mapping, dict):
        raise ValueError(f"--config {path}: expected a flat mapping of flag names, got {type(mapping).__name__}")
    by_flag = {opt[2:]: action for action in parser._actions for opt in action.option_strings if opt.startswith("--")}
    by_dest = {action.dest: action for action in parser._actions if action.option_strings}
    defaults = {}
    for key, value in mapping.items():
        name = str(key).lstrip("-").replace("_", "-")
        action = by_flag.get(name) or by_dest.get(name.replace("-", "_"))
        if action is None or action.dest in ("config", "help"):
            raise ValueError(f"--config {path}: unknown key '{key}' (not a flag of this trainer)")
        value = _yaml_value(action, key, value, path)
        if name not in by_flag and isinstance(action, argparse._StoreFalseAction):
            value = not value  # the destination of an extra_args_provider's --no-X flag was named (X: false)
        if isinstance(action, argparse.BooleanOptionalAction) and action.option_strings[0] != "--" + name:
            value = not value  # the --no- form was named (no-overlap-param-gather: true)
        defaults[action.dest] = value
    return defaults


DATA_SOURCES = ("mock_data", "data_path", "data_args_path", "train_data_path", "valid_data_path", "test_data_path",
                "per_split_data_args_path", "builtin_corpus")
# Flags that replace each other: where the command line gives a flag of one option of a group, the --config file's
# flags of the group's other options are dropped, so that the command line wins (`--config configs/gpt_350m.yaml
# --data-path P` trains on P; `--train-samples N` replaces the file's --train-iters and its iteration-counted schedule).
PIPELINE_SPLIT = ("num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank",
                  "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                  "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")
ALTERNATIVES = (
    tuple((source,) for source in DATA_SOURCES),
    (("train_iters", "lr_warmup_iters", "lr_decay_iters"), ("train_samples", "lr_warmup_samples", "lr_decay_samples")),
    (("lr_warmup_iters", "lr_warmup_samples"), ("lr_warmup_fraction",)),
    (("global_batch_size", "rampup_batch_size"), ("step_batch_size_schedule",)),
    (("pipeline_model_parallel_layout",), PIPELINE_SPLIT),
    (("num_layers_per_virtual_pipeline_stage",), ("num_virtual_stages_per_pipeline_rank",)),
)


def _without_replaced(from_config: dict, given) -> dict:
    """``from_config`` less the flags that the command line's flags replace (``ALTERNATIVES``); ``given(dest)``: whether
    the command line gave it."""
    dropped = set()
    for group in ALTERNATIVES:
        for option in group:
            if any(given(dest) for dest in option):
                dropped.update(dest for other in group if other is not option for dest in other)
    return {dest: value for dest, value in from_config.items() if dest not in dropped}


def parse_args(argv=None, extra_args_provider=None, defaults=None) -> argparse.Namespace:
    """Parse flags (and ``--config``) into Megatron-LM's flat ``args``; not yet validated.
    ``defaults`` (dest -> value) replace field defaults; the YAML file and the CLI still win."""
    parser = build_parser(extra_args_provider)
    if defaults:
        parser.set_defaults(**defaults)
    known, _ = parser.parse_known_args(argv)
    if known.config is not None:
        from_config = load_yaml_defaults(parser, known.config)
        parser.set_defaults(**_without_replaced(from_config, lambda dest: getattr(known, dest) not in (None, False)))
    args = parser.parse_args(argv)
    check_ranges(args)
    return args


def _at_least(low):
    return lambda value: value >= low, f"at least {low}"


def _above(low):
    return lambda value: value > low, f"above {low}"


def _between(low, high):
    return lambda value: low <= value <= high, f"between {low} and {high}"


def _fraction_below_one():
    return lambda value: 0 <= value < 1, "in [0, 1)"


# The sizes, counts and rates whose range no combination with other flags decides (those are checked in
# validate_args's sections), checked as soon as the flags are parsed: a zero size otherwise ends in a division by zero
# (or a SIGFPE) deep in megatron-core, a negative rate only after the model is built. NaN fails every check.
RANGES = {
    **{name: _at_least(1) for name in (
        "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
        "expert_model_parallel_size", "expert_tensor_parallel_size", "num_layers_per_virtual_pipeline_stage",
        "num_virtual_stages_per_pipeline_rank", "microbatch_group_size_per_vp_stage", "ddp_bucket_size",
        "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels", "num_query_groups",
        "seq_length", "max_position_embeddings", "make_vocab_size_divisible_by", "padded_vocab_size", "vocab_size",
        "rotary_base", "rotary_seq_len_interpolation_factor", "recompute_num_layers", "q_lora_rank", "kv_lora_rank",
        "qk_head_dim", "v_head_dim", "mtp_num_layers", "num_experts", "moe_router_topk", "moe_ffn_hidden_size",
        "moe_router_num_groups", "moe_router_group_topk", "micro_batch_size", "global_batch_size", "train_iters",
        "train_samples", "lr_decay_iters", "lr_decay_samples", "hysteresis", "loss_scale_window", "save_interval",
        "log_interval", "eval_interval", "tp_comm_emulate", "pp_comm_emulate", "dp_comm_emulate")},
    **{name: _at_least(0) for name in (
        "qk_pos_emb_head_dim", "lr_warmup_iters", "lr_warmup_samples", "eval_iters", "num_workers", "seed",
        "ckpt_step", "params_checksum_interval", "lr", "min_lr", "lr_warmup_init", "decoupled_lr",
        "decoupled_min_lr", "weight_decay", "start_weight_decay", "end_weight_decay", "clip_grad", "adam_eps",
        "init_method_std", "norm_epsilon", "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_bias_update_rate",
        "mtp_loss_scaling_factor", "param_gather_keyframe_interval")},
    **{name: _above(0) for name in (
        "loss_scale", "initial_loss_scale", "min_loss_scale", "moe_expert_capacity_factor", "rope_scaling_factor")},
    **{name: _between(0, 1) for name in (
        "attention_dropout", "hidden_dropout", "lr_warmup_fraction", "sgd_momentum")},
    "rotary_percent": (lambda value: 0 < value <= 1, "in (0, 1]"),
    "adam_beta1": _fraction_below_one(),
    "adam_beta2": _fraction_below_one(),
}


def _flag_name(parser_dest: str) -> str:
    for section in SECTIONS:
        for f in dataclasses.fields(section):
            if f.name == parser_dest and f.metadata["flag"] and f.type is not bool:
                return "--" + f.metadata["flag"]
    return "--" + parser_dest.replace("_", "-")


def check_ranges(args) -> None:
    """Every size, count and rate of ``RANGES`` within its range, or a ValueError naming the flag (on the command
    line or in --config)."""
    for name, (within, text) in RANGES.items():
        value = getattr(args, name, None)
        if value is not None and not within(value):
            raise ValueError(f"{_flag_name(name)} must be {text}, got {value}")


def transformer_engine_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


def _validate_parallel(args) -> None:
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    model_parallel = tp * pp * cp
    check(args.world_size % model_parallel == 0,
           f"world size {args.world_size} is not divisible by --tensor-model-parallel-size {tp} x "
           f"--pipeline-model-parallel-size {pp} x --context-parallel-size {cp}: change the sizes or the process count")
    args.data_parallel_size = args.world_size // model_parallel
    check(not args.sequence_parallel or tp > 1 or args.tp_comm_emulate > 1,
           "--sequence-parallel needs --tensor-model-parallel-size > 1 (or --tp-comm-emulate N): drop "
           "--sequence-parallel or raise TP")
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = tp
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size
    if ep > 1:
        check(args.num_experts is not None, "--expert-model-parallel-size > 1 needs --num-experts")
    expert_parallel = ep * etp * pp * cp
    check(args.world_size % expert_parallel == 0,
           f"world size {args.world_size} is not divisible by --expert-model-parallel-size {ep} x "
           f"--expert-tensor-parallel-size {etp} x PP {pp} x CP {cp}: change the expert-parallel sizes")
    _validate_optimizer_instances(args, args.world_size // (ep * etp * pp))
    check(args.ddp_num_buckets is None or args.ddp_num_buckets >= 1,
           f"--ddp-num-buckets must be at least 1, got {args.ddp_num_buckets}")
    check(args.ddp_num_buckets is None or args.ddp_bucket_size is None,
           "--ddp-num-buckets and --ddp-bucket-size both size the DP buckets: give one")
    _validate_virtual_pipeline(args)


def _validate_optimizer_instances(args, expert_data_parallel_size: int) -> None:
    copies = args.num_distributed_optimizer_instances
    flag = f"--num-distributed-optimizer-instances {copies}"
    check(copies >= 1, f"{flag} must be at least 1")
    if copies == 1:
        return
    check(args.use_distributed_optimizer, f"{flag} makes copies of the distributed optimizer: add "
                                           f"--use-distributed-optimizer")
    dp_cp = args.data_parallel_size * args.context_parallel_size
    check(dp_cp % copies == 0, f"{flag} does not divide the data-parallel size {dp_cp} (x CP) into equal copies")
    check(expert_data_parallel_size % copies == 0, f"{flag} does not divide the expert data-parallel size "
                                                    f"{expert_data_parallel_size} into equal copies")


def _validate_pipeline_layout(args) -> None:
    """--pipeline-model-parallel-layout: megatron-core's parser and checks (embedding first, loss last, every decoder
    and MTP layer placed once), as errors naming the flag; the virtual stages follow from its length."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    flag = f"--pipeline-model-parallel-layout {args.pipeline_model_parallel_layout!r}"
    pp = args.pipeline_model_parallel_size
    others = [name for name, given in (
        ("--num-layers-per-virtual-pipeline-stage", args.num_layers_per_virtual_pipeline_stage is not None),
        ("--num-virtual-stages-per-pipeline-rank", args.num_virtual_stages_per_pipeline_rank is not None),
        ("--decoder-first-pipeline-num-layers", args.decoder_first_pipeline_num_layers is not None),
        ("--decoder-last-pipeline-num-layers", args.decoder_last_pipeline_num_layers is not None),
        ("--account-for-embedding-in-pipeline-split", args.account_for_embedding_in_pipeline_split),
        ("--account-for-loss-in-pipeline-split", args.account_for_loss_in_pipeline_split)) if given]
    check(not others, f"{flag} places every layer itself: drop {', '.join(others)}")
    try:
        layout = PipelineParallelLayerLayout(args.pipeline_model_parallel_layout, pp)
        standalone_mtp = layout.validate_layer_layout(num_layers=args.num_layers, mtp_num_layers=args.mtp_num_layers)
    except (AssertionError, ValueError, KeyError) as error:
        raise ValueError(f"{flag} with --num-layers {args.num_layers}, --mtp-num-layers {args.mtp_num_layers} and "
                         f"PP {pp} (stages are PP x virtual stages): {error}") from None
    check(not standalone_mtp, f"{flag} puts the multi-token prediction layers (m) on another stage than the loss "
                               f"(L): megatron-core's standalone MTP stage is not wired up here; place them with L")
    vp = layout.virtual_pipeline_model_parallel_size
    check(vp == 1 or pp > 1, f"{flag} has {vp} stages for PP 1: the interleaved schedule needs "
                              f"--pipeline-model-parallel-size > 1 (or one stage)")
    args.virtual_pipeline_model_parallel_size = vp if vp > 1 else None
    if vp == 1:
        args.overlap_p2p_comm = False  # only the interleaved schedule overlaps p2p (as Megatron-LM)


def _validate_virtual_pipeline(args) -> None:
    if args.pipeline_model_parallel_layout is not None:
        _validate_pipeline_layout(args)
        return
    pp = args.pipeline_model_parallel_size
    per_stage, per_rank = args.num_layers_per_virtual_pipeline_stage, args.num_virtual_stages_per_pipeline_rank
    check(per_stage is None or per_rank is None,
           "give only one of --num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank")
    uneven = args.decoder_first_pipeline_num_layers is not None or args.decoder_last_pipeline_num_layers is not None
    split_layers, layers_text = _layers_to_split(args)
    vp = per_rank
    if per_stage is not None:
        check(not uneven, "with --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers give the "
                           "virtual stages as --num-virtual-stages-per-pipeline-rank (Megatron-LM's rule)")
        check(split_layers % (pp * per_stage) == 0,
               f"{layers_text} is not divisible by PP {pp} x --num-layers-per-virtual-pipeline-stage {per_stage}")
        vp = split_layers // pp // per_stage
    if vp is not None and vp > 1:
        check(pp > 1, "the interleaved schedule needs --pipeline-model-parallel-size > 1: drop the virtual-stage flag")
        args.virtual_pipeline_model_parallel_size = vp
    else:
        args.virtual_pipeline_model_parallel_size = None
        args.overlap_p2p_comm = False  # only the interleaved schedule overlaps p2p (as Megatron-LM)
    if uneven:
        _validate_uneven_pipeline_split(args)
        return
    vp = args.virtual_pipeline_model_parallel_size or 1
    check(split_layers % (pp * vp) == 0,
           f"{layers_text} is not divisible by PP {pp} x virtual stages {vp}: change --num-layers or the pipeline "
           f"sizes")


def _layers_to_split(args) -> tuple[int, str]:
    """The layer count the pipeline split divides, and how to name it: the input embedding and the loss each
    count as one layer with their --account-for-*-in-pipeline-split flag (megatron-core's rule)."""
    flags = (("--account-for-embedding-in-pipeline-split", args.account_for_embedding_in_pipeline_split),
             ("--account-for-loss-in-pipeline-split", args.account_for_loss_in_pipeline_split))
    accounted = [flag for flag, on in flags if on]
    text = f"--num-layers {args.num_layers}" + "".join(f" + 1 ({flag})" for flag in accounted)
    return args.num_layers + len(accounted), text


def _validate_uneven_pipeline_split(args) -> None:
    """--decoder-first/last-pipeline-num-layers: those stages get that many layers, the middle stages the rest
    evenly; with virtual stages every stage's layers split evenly over them (megatron-core's rules)."""
    pp, vp = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size or 1
    check(pp > 1, "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers split the layers over "
                   "pipeline stages: add --pipeline-model-parallel-size > 1")
    check(not (args.account_for_embedding_in_pipeline_split or args.account_for_loss_in_pipeline_split),
           "give either --decoder-first/last-pipeline-num-layers or --account-for-embedding/loss-in-pipeline-split, "
           "not both")
    middle_layers, middle_stages = args.num_layers, pp
    for flag, layers in (("--decoder-first-pipeline-num-layers", args.decoder_first_pipeline_num_layers),
                         ("--decoder-last-pipeline-num-layers", args.decoder_last_pipeline_num_layers)):
        if layers is None:
            continue
        check(layers > 0 and layers % vp == 0,
               f"{flag} {layers} must be positive and divisible by the {vp} virtual stages per pipeline rank")
        middle_layers -= layers
        middle_stages -= 1
    check(middle_layers >= 0 and (middle_layers > 0) == (middle_stages > 0)
           and (middle_stages == 0 or middle_layers % (middle_stages * vp) == 0),
           f"--num-layers {args.num_layers} leaves {middle_layers} layers for {middle_stages} middle pipeline stages "
           f"x {vp} virtual stages: change --decoder-first/last-pipeline-num-layers or --num-layers")


def _validate_megatron_lm_spellings(args) -> None:
    """Megatron-LM's older spellings onto the flags they stand for; its flags we do not implement: an error."""
    for flag, (_, reason) in NOT_IMPLEMENTED.items():
        check(getattr(args, "not_implemented_" + flag.replace("-", "_")) in (None, False), f"--{flag}: {reason}")
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    check(args.add_position_embedding or args.position_embedding_type != "learned_absolute",
           "--no-position-embedding (Megatron-LM's deprecated spelling) contradicts --position-embedding-type "
           "learned_absolute (the default): use --position-embedding-type rope or none instead")
    if args.use_flash_attn:
        args.attention_backend = "flash"
    if args.recompute_activations:
        args.recompute_granularity = "selective"
    if args.moe_layer_recompute:  # megatron-core's own translation of it, which warns that it is deprecated
        check(args.recompute_granularity != "full", "--moe-layer-recompute recomputes MoE layers in selective "
                                                     "recompute: drop it or --recompute-granularity full")
        args.recompute_granularity = "selective"
        modules = args.recompute_modules or ["core_attn"]  # megatron-core's default
        args.recompute_modules = modules if "moe" in modules else [*modules, "moe"]


def _validate_model(args) -> None:
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size", "lr"):
        check(getattr(args, flag) is not None, f"--{flag.replace('_', '-')} is required")
    tp = args.tensor_model_parallel_size
    heads = args.num_attention_heads
    check(heads % tp == 0, f"--num-attention-heads {heads} is not divisible by --tensor-model-parallel-size {tp}")
    if not args.group_query_attention:
        args.num_query_groups = heads
    check(args.num_query_groups % tp == 0,
           f"--num-query-groups {args.num_query_groups} is not divisible by --tensor-model-parallel-size {tp}")
    if args.kv_channels is None:
        check(args.hidden_size % heads == 0,
               f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads {heads}: set --kv-channels")
        args.kv_channels = args.hidden_size // heads
    activations = [flag for flag in ("swiglu", "squared_relu", "quick_geglu") if getattr(args, flag)]
    check(len(activations) <= 1, f"--{' and --'.join(a.replace('_', '-') for a in activations)} are exclusive "
                                  f"activations: pick one")
    if args.ffn_hidden_size is None:
        # SwiGLU keeps the MLP's parameter count of a 4h GeLU MLP, rounded down to a multiple of 64.
        args.ffn_hidden_size = int(4 * args.hidden_size * 2 / 3 / 64) * 64 if args.swiglu else 4 * args.hidden_size
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.position_embedding_type == "learned_absolute":
        check(args.seq_length <= args.max_position_embeddings,
               f"--seq-length {args.seq_length} exceeds --max-position-embeddings {args.max_position_embeddings}")
    check(args.padded_vocab_size is None or args.padded_vocab_size % tp == 0,
           f"--padded-vocab-size {args.padded_vocab_size} is not divisible by --tensor-model-parallel-size {tp}: the "
           f"embedding and output layer split the vocabulary over TP")
    check(not (args.fp16 and args.bf16), "--fp16 and --bf16 are exclusive: pick one")
    args.params_dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    if args.apply_query_key_layer_scaling:
        args.attention_softmax_in_fp32 = True  # megatron-core's rule, shown in args as Megatron-LM does
    if not args.add_bias_linear:
        args.bias_gelu_fusion = False  # no bias to fuse (Megatron-LM's rule; megatron-core refuses the combination)
    check(args.spec is None or len(args.spec) == 2, f"--spec takes MODULE NAME, got {args.spec}")
    if args.recompute_granularity == "full":
        check(args.recompute_method is not None, "--recompute-granularity full needs --recompute-method uniform|block")
    _validate_glu_options(args)
    _validate_recompute_modules(args)
    _validate_attention_window(args)
    _validate_no_rope(args)
    _validate_transformer_impl(args)
    _validate_fp32_residual_connection(args)
    _validate_mla(args)
    check(args.cross_entropy_fusion_impl != "te" or transformer_engine_installed(),
           "--cross-entropy-fusion-impl te runs Transformer Engine's parallel cross entropy, and Transformer Engine is "
           "not installed: use --cross-entropy-fusion-impl native (the default) or pip install '.[te]'")


def _validate_glu_options(args) -> None:
    """--glu-linear-offset and --activation-func-clamp-value act in megatron-core's unfused gated MLP (and Transformer
    Engine's grouped experts); its fused bias-SwiGLU and its legacy grouped-GEMM experts would leave them out."""
    given = [flag for flag, on in (("--glu-linear-offset", args.glu_linear_offset != 0.0),
                                   ("--activation-func-clamp-value", args.activation_func_clamp_value is not None))
             if on]
    if not given:
        return
    flags = " and ".join(given)
    check(args.swiglu or args.quick_geglu, f"{flags} shape a gated MLP: add --quick-geglu (gpt-oss) or --swiglu")
    check(args.activation_func_clamp_value is None or args.activation_func_clamp_value > 0,
           f"--activation-func-clamp-value must be positive, got {args.activation_func_clamp_value}")
    check(not (args.swiglu and args.bias_swiglu_fusion),
           f"{flags} with --swiglu: the fused bias-SwiGLU kernel leaves them out, add --no-bias-swiglu-fusion")
    check(not (args.num_experts and args.moe_grouped_gemm and args.transformer_impl == "local"),
           f"{flags} with --moe-grouped-gemm: megatron-core's grouped-GEMM experts of the local spec leave them out; "
           f"use --transformer-impl transformer_engine or drop --moe-grouped-gemm")


def _validate_recompute_modules(args) -> None:
    modules = args.recompute_modules
    if not modules:
        return
    check(args.recompute_granularity == "selective",
           f"--recompute-modules {' '.join(modules)} chooses what --recompute-granularity selective recomputes: add it")
    check("moe_act" not in modules or args.moe_grouped_gemm,
           "--recompute-modules moe_act recomputes the grouped-GEMM experts' activation: add --moe-grouped-gemm")
    # megatron-core's MLP recompute returns the output layer's bias parameter from its checkpoint function, which
    # gives that leaf a backward of its own: the backward then recomputes the MLP without end (0.16.1, 0.19.2)
    check("mlp" not in modules or not args.add_bias_linear,
           "--recompute-modules mlp works on MLPs without biases only (megatron-core's MLP recompute recurses without "
           "end when the MLP returns its bias): add --disable-bias-linear, or recompute core_attn/layernorm only")
    check("mla_up_proj" not in modules or args.multi_latent_attention,
           "--recompute-modules mla_up_proj recomputes multi-latent attention's up projections: add "
           "--multi-latent-attention")


def _validate_attention_window(args) -> None:
    if args.window_size is None:
        check(args.window_attn_skip_freq is None, "--window-attn-skip-freq picks the layers of --window-size's "
                                                   "sliding-window attention: add --window-size")
        return
    freq = args.window_attn_skip_freq
    check(not isinstance(freq, list) or len(freq) == args.num_layers,
           f"--window-attn-skip-freq lists {len(freq) if isinstance(freq, list) else 0} layers, the model has "
           f"--num-layers {args.num_layers}")
    check(not isinstance(freq, int) or freq > 0, f"--window-attn-skip-freq {freq} must be positive")


def _validate_no_rope(args) -> None:
    freq = args.no_rope_freq
    if freq is None:
        return
    # megatron-core's multi-latent attention applies its rotary embedding in every layer, --no-rope-freq or not
    check(args.position_embedding_type == "rope" and not args.multi_latent_attention,
           "--no-rope-freq picks the layers that skip RoPE: it needs --position-embedding-type rope (and "
           "megatron-core's multi-latent attention does not take it)")
    check(not isinstance(freq, list) or len(freq) == args.num_layers,
           f"--no-rope-freq lists {len(freq) if isinstance(freq, list) else 0} layers, the model has "
           f"--num-layers {args.num_layers}")
    check(not isinstance(freq, int) or freq > 0 and args.num_layers % freq == 0,
           f"--no-rope-freq {freq} must divide --num-layers {args.num_layers} (every {freq}th layer skips RoPE)")


def _validate_mla(args) -> None:
    """Megatron-LM's rules for --multi-latent-attention, and the TP splits the local spec's projections need."""
    if not args.multi_latent_attention:
        check(args.rope_type in (None, "rope"), f"--rope-type {args.rope_type} is for --multi-latent-attention; "
                                                 f"other attention takes --rope-type rope only")
        return
    check(not args.group_query_attention, "--group-query-attention and --multi-latent-attention are exclusive "
                                           "(as in Megatron-LM): drop one")
    # megatron-core's specs refuse the L2 norm with MLA, and its MLA forward has no output gate
    for flag, given in (("--qk-l2-norm", args.qk_l2_norm), ("--attention-output-gate", args.attention_output_gate)):
        check(not given, f"{flag} is not supported with --multi-latent-attention (megatron-core's): drop one")
    tp = args.tensor_model_parallel_size
    if args.transformer_impl != "local":  # Transformer Engine's down projections are replicated over TP
        return
    # megatron/hooks/mla.py tells the kv latent's gather from the query latent's by its width
    check(tp == 1 or args.q_lora_rank != args.kv_lora_rank + args.qk_pos_emb_head_dim,
           f"--q-lora-rank {args.q_lora_rank} equals --kv-lora-rank + --qk-pos-emb-head-dim: with TP > 1 and the local "
           f"spec the query and kv latents must differ in width (megatron/hooks/mla.py sums the rotary key's gradient "
           f"over TP by the kv latent's width): change one of them")
    # the local spec's down projections are column-parallel linears, split over TP like the up projections
    for flag, size in (("--kv-lora-rank + --qk-pos-emb-head-dim", args.kv_lora_rank + args.qk_pos_emb_head_dim),
                       ("--q-lora-rank", args.q_lora_rank)):
        check(size is None or size % tp == 0,
               f"{flag} = {size} is not divisible by --tensor-model-parallel-size {tp}: the local spec splits the "
               f"down projections over TP")


def _validate_transformer_impl(args) -> None:
    if args.transformer_impl is None:
        args.transformer_impl = "transformer_engine" if transformer_engine_installed() else "local"
    if args.transformer_impl == "transformer_engine":
        check(transformer_engine_installed(),
               "--transformer-impl transformer_engine asks for Transformer Engine, which is not installed: "
               "pip install '.[te]' or use --transformer-impl local")
    else:
        _validate_local_attention_backend(args)


def _validate_local_attention_backend(args) -> None:
    """--attention-backend flash|fused with the local spec pins SDPA's kernel (megatron/hooks/attention.py): what that
    kernel cannot compute is an error here rather than torch's "no available kernel" at the first step."""
    from megatron.hooks.attention import sdpa_supports

    backend = args.attention_backend
    if backend not in ("flash", "fused"):
        return
    fix = "use --attention-backend auto (SDPA picks a kernel that can) or unfused"
    check(sdpa_supports(args.softmax_type),
           f"--softmax-type {args.softmax_type} adds a logit to the softmax's denominator, which no SDPA kernel "
           f"computes, so --attention-backend {backend} (or --use-flash-attn) cannot run it: {fix}")
    check(backend != "flash" or args.window_size is None,
           f"--window-size {args.window_size} needs an attention mask, which SDPA's flash kernel does not take: {fix}")
    check(backend != "fused" or torch.cuda.is_available(),
           f"--attention-backend fused is cuDNN's attention, which needs CUDA: {fix}")


def _validate_fp32_residual_connection(args) -> None:
    if not args.fp32_residual_connection:
        return
    check(args.bf16 or args.fp16, "--fp32-residual-connection keeps the residual stream in fp32 under --bf16/--fp16: "
                                   "add one of them, or drop the flag (an fp32 run's residual stream is fp32 anyway)")
    # Without apex the local spec's norms are torch's: the fp32 residual stream with half-precision weights fails
    # in them (LayerNorm) or in the linear after them (RMSNorm); Transformer Engine's layers cast their input.
    check(args.transformer_impl == "transformer_engine",
           "--fp32-residual-connection needs --transformer-impl transformer_engine: the local spec's torch norms "
           "pass the fp32 residual stream on to the bf16/fp16 linears unconverted; drop the flag")


def _validate_moe(args) -> None:
    if args.num_experts is None:
        return
    ep = args.expert_model_parallel_size
    check(args.num_experts % ep == 0,
           f"--num-experts {args.num_experts} is not divisible by --expert-model-parallel-size {ep}")
    check(args.moe_router_topk <= args.num_experts,
           f"--moe-router-topk {args.moe_router_topk} exceeds --num-experts {args.num_experts}")
    check(not args.moe_apply_probs_on_input or args.moe_router_topk == 1,
           f"--moe-apply-probs-on-input scales a token by its one expert's probability: it needs --moe-router-topk 1, "
           f"got {args.moe_router_topk}")
    check(args.tensor_model_parallel_size == 1 or args.sequence_parallel,
           "MoE with --tensor-model-parallel-size > 1 needs --sequence-parallel: add it")
    # megatron-core 0.16.1 adds the expert bias in place on a view when no expert communication
    # happens (mlp.py:247), which autograd forbids.
    check(not args.add_bias_linear or ep * args.expert_tensor_parallel_size > 1,
           "MoE with linear biases at --expert-model-parallel-size 1 and expert-TP 1 hits a megatron-core bug "
           "(in-place bias add on a view): add --disable-bias-linear (as Mixtral/OLMoE do) or use EP > 1")
    if not torch.cuda.is_available():
        check(args.moe_token_dispatcher_type != "alltoall" or args.expert_tensor_parallel_size == 1,
               "on CPU (gloo) the alltoall dispatcher with --expert-tensor-parallel-size > 1 needs uneven "
               "all-gathers, which gloo lacks: add --expert-tensor-parallel-size 1")
    if args.moe_grouped_gemm:
        check(torch.cuda.is_available(), "--moe-grouped-gemm needs CUDA: drop it on CPU")
    if args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size
    _validate_moe_layer_freq(args)
    _validate_moe_router(args)
    _validate_moe_capacity_and_shared_expert(args)


def _validate_moe_layer_freq(args) -> None:
    freq, layers = args.moe_layer_freq, args.num_layers
    if isinstance(freq, int):
        check(freq >= 1, f"--moe-layer-freq must be >= 1 (an MoE layer every N layers), got {freq}")
        return
    check(len(freq) == layers and set(freq) <= {0, 1},
           f"--moe-layer-freq gives {len(freq)} layers {freq}: give one 1 (MoE) or 0 (dense) per layer, "
           f"--num-layers {layers} in all")


def _validate_moe_router(args) -> None:
    """The routing combinations megatron-core's TransformerConfig refuses, as flag-naming errors."""
    sigmoid = args.moe_router_score_function == "sigmoid"
    check(not args.moe_router_enable_expert_bias or sigmoid,
           "--moe-router-enable-expert-bias (aux-loss-free routing) needs --moe-router-score-function sigmoid: add it")
    # softmax over the one chosen expert is 1, which gives the router no gradient
    check(args.moe_router_topk > 1 or sigmoid or args.moe_router_pre_softmax
           or args.moe_router_load_balancing_type == "sinkhorn",
           "--moe-router-topk 1 with the softmax score function leaves the router without a gradient: add "
           "--moe-router-pre-softmax (or use --moe-router-score-function sigmoid)")
    groups, group_topk = args.moe_router_num_groups, args.moe_router_group_topk
    if group_topk is None:
        return
    check(groups is not None, "--moe-router-group-topk limits routing to groups: add --moe-router-num-groups")
    check(args.num_experts % groups == 0,
           f"--num-experts {args.num_experts} is not divisible by --moe-router-num-groups {groups}")
    check(group_topk <= groups, f"--moe-router-group-topk {group_topk} exceeds --moe-router-num-groups {groups}")


def _validate_moe_capacity_and_shared_expert(args) -> None:
    check(args.moe_expert_capacity_factor is None or args.moe_router_load_balancing_type != "sinkhorn",
           "--moe-expert-capacity-factor does not work with --moe-router-load-balancing-type sinkhorn: use aux_loss, "
           "seq_aux_loss or none")
    check(not args.moe_pad_expert_input_to_capacity or args.moe_expert_capacity_factor is not None,
           "--moe-pad-expert-input-to-capacity pads to the capacity of --moe-expert-capacity-factor: add it")
    shared = args.moe_shared_expert_intermediate_size
    check(shared is None or shared > 0, f"--moe-shared-expert-intermediate-size must be positive, got {shared}")
    check(not args.moe_shared_expert_gate or shared is not None,
           "--moe-shared-expert-gate gates the shared expert: add --moe-shared-expert-intermediate-size")
    check(not args.moe_shared_expert_overlap or args.moe_token_dispatcher_type == "alltoall",
           "--moe-shared-expert-overlap overlaps the shared expert with the alltoall dispatcher's communication: add "
           "--moe-token-dispatcher-type alltoall")
    check(not args.moe_permute_fusion or transformer_engine_installed(),
           "--moe-permute-fusion runs Transformer Engine's fused permutation kernels, and Transformer Engine is not "
           "installed: drop --moe-permute-fusion or pip install '.[te]'")


def _validate_batch_and_schedule(args) -> None:
    micro_dp = args.micro_batch_size * args.data_parallel_size
    if args.step_batch_size_schedule is not None:
        check(args.global_batch_size is None and args.rampup_batch_size is None,
               "--step-batch-size-schedule sets the global batch size of every iteration: drop --global-batch-size "
               "and --rampup-batch-size (Megatron-LM refuses them together too)")
        args.batch_steps = parse_step_schedule(args.step_batch_size_schedule, args.seq_length)
        args.global_batch_size = args.batch_steps[-1][1]  # the schedule's last: what evaluation uses
    if args.global_batch_size is None:
        args.global_batch_size = micro_dp
    check(args.global_batch_size % micro_dp == 0,
           f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
           f"{args.micro_batch_size} x data-parallel size {args.data_parallel_size}: change the batch sizes")
    args.num_micro_batches = args.global_batch_size // micro_dp
    if args.rampup_batch_size is not None:
        _validate_rampup(args)
        args.batch_steps = rampup_steps(*args.rampup_batch_size, args.global_batch_size)
    elif args.step_batch_size_schedule is None:
        args.batch_steps = ((0, args.global_batch_size),)
    _validate_batch_steps(args, micro_dp)
    if args.eval_global_batch_size is None:
        args.eval_global_batch_size = args.global_batch_size
    check(args.eval_global_batch_size > 0 and args.eval_global_batch_size % micro_dp == 0,
           f"--eval-global-batch-size {args.eval_global_batch_size} must be a positive multiple of --micro-batch-size "
           f"{args.micro_batch_size} x data-parallel size {args.data_parallel_size}: change it")
    args.eval_micro_batches = args.eval_global_batch_size // micro_dp
    if args.virtual_pipeline_model_parallel_size is not None:
        _validate_microbatch_groups(args, args.eval_micro_batches)
    _validate_lr_schedule(args)
    _validate_weight_decay_schedule(args)
    # Megatron-LM's: only the interleaved schedule dispatches aligned param all-gathers
    args.align_param_gather = (args.align_param_gather and args.overlap_param_gather
                               and args.virtual_pipeline_model_parallel_size is not None)
    check(not args.overlap_param_gather or args.use_distributed_optimizer,
           "--overlap-param-gather needs --use-distributed-optimizer: add it")
    # Megatron-LM's rule: the overlapped gather is dispatched from the bucket groups that the overlapped grad
    # reduce sets up, and its launch scripts always pass both
    check(not args.overlap_param_gather or args.overlap_grad_reduce,
           "--overlap-param-gather needs --overlap-grad-reduce (as in Megatron-LM): add it, or drop "
           "--overlap-param-gather")


def _validate_rampup(args) -> None:
    """--rampup-batch-size START INCREMENT SAMPLES: steps of INCREMENT from START that reach --global-batch-size."""
    flag = "--rampup-batch-size START INCREMENT SAMPLES"
    check(len(args.rampup_batch_size) == 3, f"{flag} takes three ints, got {args.rampup_batch_size}")
    start, increment, samples = args.rampup_batch_size
    check(start > 0 and increment > 0 and samples >= 0,
           f"{flag}: START and INCREMENT must be positive and SAMPLES non-negative, got {args.rampup_batch_size}")
    gbs = args.global_batch_size
    check(start <= gbs and (gbs - start) % increment == 0,
           f"{flag} = {start} {increment} {samples} does not reach --global-batch-size {gbs}: START must be at most "
           f"it and it must be START plus a multiple of INCREMENT")


def _validate_batch_steps(args, micro_dp: int) -> None:
    """A batch size that changes over the run (``args.batch_steps``) counts in samples, and every step of it must be a
    whole number of micro-batches on every DP rank (and of interleaved-schedule groups)."""
    flag = "--rampup-batch-size" if args.rampup_batch_size is not None else "--step-batch-size-schedule"
    if len(args.batch_steps) > 1:
        check(args.train_samples is not None,
               f"{flag} changes the batch size with the samples consumed: train with --train-samples (and "
               f"--lr-decay-samples / --lr-warmup-samples) instead of --train-iters, as Megatron-LM requires")
    for _, batch in args.batch_steps:
        check(batch % micro_dp == 0,
               f"{flag}: its batch size {batch} is not a multiple of --micro-batch-size {args.micro_batch_size} x "
               f"data-parallel size {args.data_parallel_size} = {micro_dp}: every step must be a whole number of "
               f"micro-batches on every DP rank")
    if args.virtual_pipeline_model_parallel_size is not None:
        for micro in sorted({batch // micro_dp for _, batch in args.batch_steps}):
            _validate_microbatch_groups(args, micro)


def _validate_microbatch_groups(args, micro: int) -> None:
    """The interleaved schedule runs the micro-batches in groups of G per virtual stage; a last group smaller
    than PP would stall the pipeline (megatron-core refuses it)."""
    pp = args.pipeline_model_parallel_size
    group = args.microbatch_group_size_per_vp_stage or pp
    check(pp <= group <= micro,
           f"--microbatch-group-size-per-virtual-pipeline-stage {group} must lie between PP={pp} and the "
           f"{micro} micro-batches of an iteration (--global-batch-size, --eval-global-batch-size or a step of "
           f"--rampup-batch-size, / (--micro-batch-size x DP))")
    check(micro % group == 0 or micro % group >= pp,
           f"the interleaved schedule runs micro-batches in groups of {group} (--microbatch-group-size-per-virtual-"
           f"pipeline-stage, default PP={pp}), but an iteration of {micro} micro-batches (--global-batch-size, "
           f"--eval-global-batch-size or a step of --rampup-batch-size, / (--micro-batch-size x DP)) leaves a last "
           f"group of {micro % group}, fewer than PP: make it a multiple of {group}")


def _validate_weight_decay_schedule(args) -> None:
    """Megatron-LM's rule: constant decay is --weight-decay; linear and cosine go from --start-weight-decay to
    --end-weight-decay over the training length."""
    if args.weight_decay_incr_style == "constant":
        check(args.start_weight_decay is None and args.end_weight_decay is None,
               "--start-weight-decay / --end-weight-decay set a changing weight decay: add --weight-decay-incr-style "
               "linear or cosine (a constant one is --weight-decay)")
        args.start_weight_decay = args.end_weight_decay = args.weight_decay
        return
    check(args.start_weight_decay is not None and args.end_weight_decay is not None,
           f"--weight-decay-incr-style {args.weight_decay_incr_style} needs --start-weight-decay and "
           f"--end-weight-decay")


def _validate_lr_schedule(args) -> None:
    """Training length and LR schedule, in iterations (--train-iters) or in samples (--train-samples, with
    --lr-decay-samples / --lr-warmup-samples), as Megatron-LM; the scheduler counts samples either way
    (``args.lr_warmup_steps``, ``args.lr_decay_steps``)."""
    check((args.train_iters is None) != (args.train_samples is None),
           "give exactly one of --train-iters and --train-samples")
    gbs = args.global_batch_size
    check(args.lr_warmup_fraction is None or (args.lr_warmup_iters == 0 and args.lr_warmup_samples == 0),
           "give only one of --lr-warmup-iters, --lr-warmup-samples and --lr-warmup-fraction")
    if args.train_samples is not None:
        check(args.lr_decay_iters is None and args.lr_warmup_iters == 0,
               "--train-samples counts the schedule in samples: use --lr-decay-samples / --lr-warmup-samples instead "
               "of --lr-decay-iters / --lr-warmup-iters")
        args.train_iters = iterations_in(args.batch_steps, args.train_samples)
        decay, warmup, unit = args.lr_decay_samples or args.train_samples, args.lr_warmup_samples, "samples"
    else:
        check(args.lr_decay_samples is None and args.lr_warmup_samples == 0,
               "--lr-decay-samples / --lr-warmup-samples go with --train-samples: with --train-iters use "
               "--lr-decay-iters / --lr-warmup-iters")
        if args.lr_decay_iters is None:
            args.lr_decay_iters = args.train_iters
        decay, warmup, unit = args.lr_decay_iters * gbs, args.lr_warmup_iters * gbs, "iters"
    if args.lr_warmup_fraction is not None:
        warmup = int(args.lr_warmup_fraction * decay)
    check(warmup < decay, f"the warm-up ({warmup} samples: --lr-warmup-{unit} or --lr-warmup-fraction) must be "
                           f"below the decay length (--lr-decay-{unit}, default the training length: {decay} samples): "
                           f"lower the warm-up or train longer")
    args.lr_warmup_steps, args.lr_decay_steps = warmup, decay
    check(args.decoupled_min_lr is None or args.decoupled_lr is not None,
           "--decoupled-min-lr sets the minimum of --decoupled-lr's schedule: add --decoupled-lr")


def _validate_training_exit(args) -> None:
    check(args.exit_interval is None or args.exit_interval > 0,
           f"--exit-interval must be a positive number of iterations, got {args.exit_interval}")
    check(args.exit_duration_in_mins is None or args.exit_duration_in_mins > 0,
           f"--exit-duration-in-mins must be positive, got {args.exit_duration_in_mins}")
    check(args.manual_gc_interval >= 0, f"--manual-gc-interval must be >= 0, got {args.manual_gc_interval}")
    check(args.distributed_timeout_minutes > 0,
           f"--distributed-timeout-minutes must be positive, got {args.distributed_timeout_minutes}")


def _validate_data(args) -> None:
    per_split = [args.train_data_path, args.valid_data_path, args.test_data_path]
    check(args.data_path is None or args.data_args_path is None, "give only one of --data-path and --data-args-path")
    check(not any(per_split) or args.per_split_data_args_path is None,
           "give only one of --train/valid/test-data-path and --per-split-data-args-path")
    whole, split = (args.data_path or args.data_args_path), (any(per_split) or args.per_split_data_args_path)
    check(not (whole and split), "give either --data-path (or --data-args-path), divided by --split, or each split's "
                                  "own data (--train/valid/test-data-path or --per-split-data-args-path), not both")
    check(not split or args.split == DEFAULT_SPLIT,
           "--split divides --data-path into splits; with --train/valid/test-data-path each split has its own data: "
           "drop --split")
    sources = {"--mock-data": args.mock_data, "--data-path": whole, "--train/valid/test-data-path": split,
               "--builtin-corpus": args.builtin_corpus is not None}
    given = [flag for flag, present in sources.items() if present]
    check(len(given) <= 1, f"give one source of training data, not {' and '.join(given)} (as in Megatron-LM): "
                            f"drop all but one")
    check(whole or split or args.mock_data or args.builtin_corpus is not None,
           "no training data: give --data-path PREFIX, --mock-data or --builtin-corpus python-stdlib")
    check(args.builtin_corpus != "python-site-packages" or args.split == DEFAULT_SPLIT,
           "--builtin-corpus python-site-packages holds out validation and test files itself: drop --split")
    check(args.builtin_corpus_max_bytes > 0,
           f"--builtin-corpus-max-bytes must be positive, got {args.builtin_corpus_max_bytes}")
    if args.dataloader_type is None:
        args.dataloader_type = "single"
    check(args.dataloader_type == "single",
           f"--dataloader-type {args.dataloader_type} is not implemented: this trainer's loader is Megatron-LM's "
           f"single (one pass in order, resumed at the consumed samples): drop the flag")
    check(args.num_dataset_builder_threads > 0,
           f"--num-dataset-builder-threads must be positive, got {args.num_dataset_builder_threads}")
    # Megatron-LM's TikTokenizer reads its own JSON vocabulary format through the tiktoken package; Megatron-LM's
    # Llama 3 script uses HuggingFaceTokenizer for real data and NullTokenizer for mock data.
    check(args.tokenizer_type != "TikTokenizer",
           "--tokenizer-type TikTokenizer is not implemented here: Megatron-LM's reads a tiktoken vocabulary through "
           "the `tiktoken` package (pip install tiktoken), which this trainer does not use. Give the model's "
           "tokenizer.json instead: --tokenizer-type HuggingFaceTokenizer --tokenizer-model FILE (as Megatron-LM's "
           "Llama 3 script does for real data), or use GPT2BPETokenizer, ByteTokenizer or NullTokenizer")


def _validate_compression(args) -> None:
    """The combinations with other sections' flags; the compression flags themselves are checked by the configs
    that ``compression_config`` builds (megatron/hooks/config.py), kept as ``args.compression``."""
    check(args.param_gather_compression == "none" or args.use_distributed_optimizer,
           f"--param-gather-compression {args.param_gather_compression} compresses the distributed optimizer's "
           f"param all-gather: add --use-distributed-optimizer")
    check(args.grad_reduce_compression == "none" or args.use_distributed_optimizer,
           f"--grad-reduce-compression {args.grad_reduce_compression} compresses the distributed optimizer's "
           f"gradient reduce-scatter: add --use-distributed-optimizer")
    check(args.grad_reduce_compression == "none" or args.num_distributed_optimizer_instances == 1,
           f"--grad-reduce-compression {args.grad_reduce_compression} with --num-distributed-optimizer-instances "
           f"{args.num_distributed_optimizer_instances} is not implemented (the optimizer copies' all-reduce of the "
           f"gradient shards would stay uncompressed): drop one of them")
    from megatron.training.compression_config import compression_config

    args.compression = compression_config(args)
    _validate_tp_emulation(args)
    _validate_pp_emulation(args)
    _validate_dp_emulation(args)


def _validate_tp_emulation(args) -> None:
    n = args.tp_comm_emulate
    if n == 1:
        return
    check(args.tensor_model_parallel_size == 1,
           f"--tp-comm-emulate {n} emulates TP={n} in a TP=1 run: set --tensor-model-parallel-size 1, got "
           f"{args.tensor_model_parallel_size}")
    check(args.num_experts is None and not args.multi_latent_attention and not args.mtp_num_layers,
           "--tp-comm-emulate emulates dense GPT layers only: drop --num-experts, --multi-latent-attention and "
           "--mtp-num-layers, or run real TP")
    for flag, value in (("--num-attention-heads", args.num_attention_heads),
                        ("--num-query-groups", args.num_query_groups),
                        ("--ffn-hidden-size", args.ffn_hidden_size)):
        check(value is None or value % n == 0, f"{flag} {value} is not divisible by --tp-comm-emulate {n}")
    check(not args.sequence_parallel or args.seq_length % n == 0,
           f"--sequence-parallel with --tp-comm-emulate {n} shards the sequence: --seq-length {args.seq_length} "
           f"must be divisible by {n}")


def _validate_pp_emulation(args) -> None:
    n = args.pp_comm_emulate
    if n == 1:
        return
    check(args.pipeline_model_parallel_size == 1,
           f"--pp-comm-emulate {n} emulates PP={n} in a PP=1 run: set --pipeline-model-parallel-size 1, got "
           f"{args.pipeline_model_parallel_size}")
    check(args.num_layers % n == 0,
           f"--pp-comm-emulate {n} emulates {n} equal stages: --num-layers {args.num_layers} must be divisible by {n}")
    check(args.num_experts is None and not args.mtp_num_layers,
           "--pp-comm-emulate emulates dense GPT stages only: drop --num-experts and --mtp-num-layers, or run real PP")


def _validate_dp_emulation(args) -> None:
    n = args.dp_comm_emulate
    if n == 1:
        return
    check(n & (n - 1) == 0 and n <= 128,
           f"--dp-comm-emulate {n}: a power of two up to 128 (the buckets of DP=N and DP=1 then have one layout)")
    check(args.data_parallel_size == 1,
           f"--dp-comm-emulate {n} emulates DP={n} in a DP=1 run: use {args.world_size // args.data_parallel_size} "
           f"ranks (the model-parallel size), got data-parallel size {args.data_parallel_size}")
    check(args.use_distributed_optimizer, "--dp-comm-emulate emulates the distributed optimizer's collectives: add "
           "--use-distributed-optimizer")
    check(args.pipeline_model_parallel_size == 1,
           "--dp-comm-emulate assigns micro-batches to ranks in order, which a pipeline schedule interleaves: use "
           "--pipeline-model-parallel-size 1 (--pp-comm-emulate emulates the pipeline)")
    check(args.context_parallel_size == 1,
           "--dp-comm-emulate emulates the data-parallel group alone, and context parallelism joins it: use "
           "--context-parallel-size 1")
    check(args.num_experts is None, "--dp-comm-emulate emulates dense models: drop --num-experts, or run real DP")
    check(not args.overlap_grad_reduce and not args.overlap_param_gather,
           "--dp-comm-emulate emulates a DP=N run without overlapped collectives (one bucket per buffer: overlap "
           "splits the buffers into buckets, which changes what SDP4Bit codes) and runs them in place: add "
           "--no-overlap-grad-reduce --no-overlap-param-gather")
    for _, batch in args.batch_steps:  # the global batch, or each step of a ramp-up or schedule
        check(batch % (args.micro_batch_size * n) == 0,
               f"--dp-comm-emulate {n} splits each global batch over {n} ranks: its size {batch} must be divisible "
               f"by --micro-batch-size {args.micro_batch_size} x {n}")
    check(not args.param_gather_verify_interval,
           "--param-gather-verify-interval compares the data-parallel replicas; under --dp-comm-emulate there is one "
           "copy: drop the flag")


def validate_args(args, world_size: Optional[int] = None, rank: Optional[int] = None) -> argparse.Namespace:
    """Derive sizes (DP, virtual pipeline, micro-batches, ...) and reject bad combinations.
    ``world_size``/``rank`` default to torchrun's WORLD_SIZE/RANK (1/0 without them)."""
    args.world_size = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    args.rank = rank if rank is not None else int(os.environ.get("RANK", "0"))
    _validate_megatron_lm_spellings(args)
    _validate_checkpointing(args)
    _validate_model(args)
    _validate_parallel(args)  # sets expert_tensor_parallel_size, used by _validate_moe
    _validate_moe(args)
    _validate_batch_and_schedule(args)
    _validate_training_exit(args)
    _validate_run_control(args)
    _validate_data(args)
    _validate_compression(args)
    _validate_logging(args)
    _validate_profile(args)
    args.consumed_train_samples = getattr(args, "consumed_train_samples", 0)
    args.consumed_valid_samples = getattr(args, "consumed_valid_samples", 0)
    args.num_floating_point_operations_so_far = getattr(args, "num_floating_point_operations_so_far", 0)
    return args


def _validate_checkpointing(args) -> None:
    loads = args.load is not None or args.pretrained_checkpoint is not None
    check(not (args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler),
           "--override-opt_param-scheduler (the command line's LR/WD schedule) and --use-checkpoint-opt_param-scheduler "
           "(the checkpoint's) are exclusive: pick one")
    for flag, given in (("--use-checkpoint-args", args.use_checkpoint_args),
                        ("--ckpt-step", args.ckpt_step is not None),
                        ("--exit-on-missing-checkpoint", args.exit_on_missing_checkpoint)):
        check(not given or loads, f"{flag} reads a checkpoint: add --load DIR (or --pretrained-checkpoint DIR)")
    _validate_non_persistent(args)
    check(not args.dist_ckpt_strictness.startswith("return_"),
           f"--dist-ckpt-strictness {args.dist_ckpt_strictness} hands the mismatched keys back to the caller, and this "
           f"trainer has no use for them: use log_unexpected or log_all to see them, raise_unexpected or raise_all "
           f"to stop on them")
    # The persistent writer takes the state through a queue: on CPU the tensors it gets are the live parameters
    # (a GPU save copies them to the host first), which the next step changes while it writes.
    check(not (args.async_save and args.use_persistent_ckpt_worker) or torch.cuda.is_available(),
           "--use-persistent-ckpt-worker with --async-save needs CUDA (on CPU its writer would read the parameters "
           "while training changes them): drop --use-persistent-ckpt-worker, each save then forks a writer that "
           "holds a copy")
    if args.save_retain_interval is not None:
        check(args.save is not None and args.save_interval is not None,
               "--save-retain-interval thins out --save's checkpoints: add --save DIR and --save-interval N")
        check(args.save_retain_interval > 0 and args.save_retain_interval % args.save_interval == 0,
               f"--save-retain-interval {args.save_retain_interval} must be a positive multiple of --save-interval "
               f"{args.save_interval}, or no checkpoint but the latest would be kept")
    if args.async_save:
        import importlib.util

        from megatron.hooks.version import MCORE_VERSION, mcore_at_least

        nvrx_runs = importlib.util.find_spec("nvidia_resiliency_ext") is not None and mcore_at_least("0.17")
        if args.async_strategy is None:  # Megatron-LM's default where it runs, else megatron-core's own writer
            args.async_strategy = "nvrx" if nvrx_runs else "mcore"
        elif args.async_strategy == "nvrx":
            check(mcore_at_least("0.17"), f"--async-strategy nvrx needs megatron-core 0.17 or later, this is "
                                           f"{MCORE_VERSION}: drop the flag (megatron-core's own writer is its only one)")
            check(nvrx_runs, "--async-strategy nvrx writes through nvidia-resiliency-ext, which is not installed: "
                              "pip install nvidia-resiliency-ext, or pass --async-strategy mcore")
    # A fine-tuning run counts from iteration 0: saving into the pretrained directory would overwrite its
    # iterations (and the tracker file) with the new run's.
    if args.finetune:
        check(args.load is not None, "--finetune loads pretrained weights: add --load DIR")
        check(args.save is None or os.path.realpath(args.save) != os.path.realpath(args.load),
               f"--finetune with --save equal to --load ({args.load}) would overwrite the pretrained checkpoint's "
               f"iterations with the fine-tuning run's: give --save a new directory")
    if args.pretrained_checkpoint is not None:
        check(args.save is None or os.path.realpath(args.save) != os.path.realpath(args.pretrained_checkpoint),
               f"--save equal to --pretrained-checkpoint ({args.pretrained_checkpoint}) would overwrite the pretrained "
               f"checkpoint's iterations with the fine-tuning run's: give --save (and --load) a new directory")


def _validate_non_persistent(args) -> None:
    """Megatron-LM's non-persistent checkpoints, of the global kind (full checkpoints in their own directory)."""
    kind, interval = args.non_persistent_ckpt_type, args.non_persistent_save_interval
    check(kind in (None, "global"),
           f"--non-persistent-ckpt-type {kind} (nvidia-resiliency-ext's node-local checkpoints) is not implemented: "
           f"use --non-persistent-ckpt-type global (full checkpoints in --non-persistent-global-ckpt-dir)")
    if interval is not None:
        check(interval > 0, f"--non-persistent-save-interval must be a positive number of iterations, got {interval}")
        check(kind == "global", "--non-persistent-save-interval saves non-persistent checkpoints: add "
                                 "--non-persistent-ckpt-type global")
        check(args.save is not None or args.non_persistent_global_ckpt_dir is not None,
               "--non-persistent-save-interval: add --save DIR (the checkpoints go to DIR/non_persistent) or "
               "--non-persistent-global-ckpt-dir")


def _validate_logging(args) -> None:
    check(args.tensorboard_log_interval > 0,
           f"--tensorboard-log-interval must be positive, got {args.tensorboard_log_interval}")
    check(args.tensorboard_queue_size > 0,
           f"--tensorboard-queue-size must be positive, got {args.tensorboard_queue_size}")
    check(not args.log_progress or args.save is not None,
           "--log-progress writes progress.txt into --save: add --save DIR")
    for flag, on in (("--log-memory-to-tensorboard", args.log_memory_to_tensorboard),
                     ("--record-memory-history", args.record_memory_history)):
        check(not on or torch.cuda.is_available(),
               f"{flag} reads the CUDA caching allocator, and this run has no CUDA device: drop it on CPU")
    interval = args.check_weight_hash_across_dp_replicas_interval
    check(interval is None or interval > 0,
           f"--check-weight-hash-across-dp-replicas-interval must be a positive number of iterations, got {interval}")


def _validate_run_control(args) -> None:
    """Backend, local rank, NaN checks and DP averaging (Megatron-LM's rules)."""
    check(args.rerun_mode == "disabled",
           f"--rerun-mode {args.rerun_mode} re-runs iterations, which is not implemented: use --rerun-mode disabled "
           f"(the default here), with which a NaN or Inf loss still stops the run with an error naming the rank and "
           f"iteration")
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if torch.cuda.is_available() else "gloo"
    check(args.distributed_backend != "nccl" or torch.cuda.is_available(),
           "--distributed-backend nccl needs CUDA devices, and this run has none: use --distributed-backend gloo "
           "(or drop the flag: gloo is the default without CUDA)")
    # measured with torch 2.11 on an H200 (both ranks on cuda:0 over gloo): of
    # megatron-core's coalesced DP collectives on CUDA tensors, gloo survives only the reduce-scatter; one bucket at a
    # time (the compressed gathers' path) works for every collective
    gloo_with_cuda = args.distributed_backend == "gloo" and torch.cuda.is_available()
    check(not (gloo_with_cuda and not args.use_distributed_optimizer),
           "--distributed-backend gloo with CUDA tensors: megatron-core's gradient all-reduce without "
           "--use-distributed-optimizer (a coalesced all_reduce) fails in torch's gloo backend "
           "(allreduce_coalesced: unsupported device type cuda): use --distributed-backend nccl (gloo with CUDA "
           "works only with --use-distributed-optimizer and a --param-gather-compression)")
    check(not (gloo_with_cuda and args.param_gather_compression == "none"),
           "--distributed-backend gloo with CUDA tensors: megatron-core's parameter all-gather of "
           "--use-distributed-optimizer (a coalesced all_gather_into_tensor) crashes torch's gloo backend with a "
           "segmentation fault: use --distributed-backend nccl (gloo with CUDA works only with a "
           "--param-gather-compression, whose gathers go bucket by bucket)")
    if "LOCAL_RANK" in os.environ:  # torchrun's wins over the flag (Megatron-LM)
        args.local_rank = int(os.environ["LOCAL_RANK"])
    elif args.local_rank is None:
        args.local_rank = 0
    if args.fp16 and args.loss_scale is None:
        # dynamic loss scaling expects overflows: they lower the scale and skip the step
        args.check_for_nan_in_loss_and_grad = False
    check(not (args.ddp_average_in_collective and args.calculate_per_token_loss),
           "--ddp-average-in-collective averages the DP gradients, and --calculate-per-token-loss sums them to divide "
           "by the global token count: drop one")


def _validate_profile(args) -> None:
    if not args.profile:
        return
    if not 0 <= args.profile_step_start < args.profile_step_end:
        raise ValueError(f"--profile-step-start ({args.profile_step_start}) must be >= 0 and below "
                         f"--profile-step-end ({args.profile_step_end})")
    if args.use_pytorch_profiler and not (args.tensorboard_dir or args.metrics_file):
        raise ValueError("--use-pytorch-profiler writes its trace to --tensorboard-dir or next to --metrics-file: "
                         "add one of them")


def set_padded_vocab_size(args, vocab_size: int) -> int:
    """--padded-vocab-size where given (or taken from a checkpoint by --use-checkpoint-args), else the tokenizer's
    vocabulary rounded up to a multiple of make_vocab_size_divisible_by x TP, so the output layer splits evenly over
    tensor-parallel ranks (Megatron-LM's padding)."""
    if args.padded_vocab_size is not None:
        check(args.padded_vocab_size >= vocab_size,
               f"--padded-vocab-size {args.padded_vocab_size} is smaller than the tokenizer's {vocab_size} tokens: "
               f"raise it, or drop it to pad by --make-vocab-size-divisible-by")
        return args.padded_vocab_size
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size * getattr(args, "tp_comm_emulate", 1)
    args.padded_vocab_size = -(-vocab_size // multiple) * multiple
    return args.padded_vocab_size
