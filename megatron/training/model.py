"""Model, DDP, optimizer and LR schedule from ``args``, in Megatron-LM's order:

    GPTModel chunks (one per virtual pipeline stage) -> layout-independent init -> Float16Module
    -> TP and PP compression hooks (if asked) -> DDP -> optimizer + scheduler -> param-gather compression (if asked)

Layout-independent init: megatron-core draws weights in construction order from one generator, so a
pipeline stage (or expert-parallel rank) that does not build the earlier layers (experts) would draw
different numbers. We therefore redraw every weight matrix from a generator seeded by
(seed, the parameter's global name), as a full tensor that each rank slices like megatron-core's
``_initialize_affine_weight_cpu``. Any TP/PP/VP/DP/EP layout then starts from the same model. Vectors
(biases, norm weights) are constants in megatron-core and are left as built.
"""

import importlib.util
import hashlib
import re

import torch
import torch.nn.functional as F


def core_transformer_config(args):
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig
    from megatron.core.transformer.enums import AttnBackend

    from megatron.hooks.fused_ops import gradient_accumulation_fusion_available
    from megatron.training.arguments import transformer_engine_installed

    dtype = args.params_dtype
    on_cpu = not torch.cuda.is_available()
    interleaved = args.virtual_pipeline_model_parallel_size is not None
    xavier = torch.nn.init.xavier_uniform_ if args.init_method_xavier_uniform else None  # None: megatron-core's normal
    config_class, mla = TransformerConfig, {}
    if args.multi_latent_attention:
        config_class = MLATransformerConfig
        mla = dict(q_lora_rank=args.q_lora_rank, kv_lora_rank=args.kv_lora_rank, qk_head_dim=args.qk_head_dim,
                   qk_pos_emb_head_dim=args.qk_pos_emb_head_dim, v_head_dim=args.v_head_dim,
                   rotary_base=args.rotary_base, rotary_percent=args.rotary_percent,
                   rotary_scaling_factor=args.rotary_scaling_factor, mscale=args.mscale,
                   mscale_all_dim=args.mscale_all_dim, **({"rope_type": args.rope_type} if args.rope_type else {}))
    return config_class(
        **mla,
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels, hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        layernorm_epsilon=args.norm_epsilon, normalization=args.normalization, add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias, window_size=args.window_size, window_attn_skip_freq=args.window_attn_skip_freq,
        softmax_type=args.softmax_type, rotary_interleaved=args.rotary_interleaved, no_rope_freq=args.no_rope_freq,
        layernorm_zero_centered_gamma=args.apply_layernorm_1p, qk_layernorm=args.qk_layernorm,
        qk_l2_norm=args.qk_l2_norm, attention_output_gate=args.attention_output_gate,
        apply_query_key_layer_scaling=args.apply_query_key_layer_scaling,
        attention_softmax_in_fp32=args.attention_softmax_in_fp32,
        fp32_residual_connection=args.fp32_residual_connection,
        **_activation(args), glu_linear_offset=args.glu_linear_offset,
        activation_func_clamp_value=args.activation_func_clamp_value,
        init_method_std=args.init_method_std, init_method=xavier, output_layer_init_method=xavier,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        # --tp-comm-emulate: the whole sequence in one TP=1 model; --sequence-parallel picks the emulated collectives
        sequence_parallel=args.sequence_parallel and args.tp_comm_emulate == 1,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        params_dtype=dtype, bf16=args.bf16, fp16=args.fp16,
        # what crosses pipeline stages is the residual stream
        pipeline_dtype=(torch.float32 if args.fp32_residual_connection else dtype)
        if args.pipeline_model_parallel_size > 1 else None,
        use_cpu_initialization=args.use_cpu_initialization or on_cpu,
        # apex's wgrad-into-main_grad GEMM, or its stand-in on torch's addmm (megatron/hooks/fused_ops.py) on CUDA
        gradient_accumulation_fusion=args.gradient_accumulation_fusion and gradient_accumulation_fusion_available(),
        # the fused softmax is an apex CUDA extension, selected for bf16/fp16: without it megatron-core
        # fails at the first forward, so use the unfused softmax (same math). megatron-core's fused kernel
        # ignores --window-size (it masks causally only), so a sliding window takes the unfused softmax too.
        masked_softmax_fusion=args.masked_softmax_fusion and args.window_size is None
        and (dtype == torch.float32 or _has_fused_softmax()),
        apply_rope_fusion=args.apply_rope_fusion and transformer_engine_installed(),
        bias_dropout_fusion=args.bias_dropout_fusion,
        cross_entropy_loss_fusion=args.cross_entropy_loss_fusion,
        cross_entropy_fusion_impl=args.cross_entropy_fusion_impl,
        # Megatron-LM's p2p defaults: unbatched, overlapped for the interleaved schedule (batched p2p
        # with PP=2 pairs the wrong messages on gloo: megatron-core-cpu.md item 3).
        batch_p2p_comm=not interleaved, batch_p2p_sync=not on_cpu, overlap_p2p_comm=interleaved and args.overlap_p2p_comm,
        recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        **({"recompute_modules": args.recompute_modules} if args.recompute_modules else {}),
        num_moe_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type, moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        moe_router_load_balancing_type=args.moe_router_load_balancing_type,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size, moe_grouped_gemm=args.moe_grouped_gemm,
        moe_layer_freq=args.moe_layer_freq,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_shared_expert_overlap=args.moe_shared_expert_overlap, moe_shared_expert_gate=args.moe_shared_expert_gate,
        moe_router_score_function=args.moe_router_score_function, moe_router_pre_softmax=args.moe_router_pre_softmax,
        moe_router_topk_scaling_factor=args.moe_router_topk_scaling_factor,
        moe_router_num_groups=args.moe_router_num_groups, moe_router_group_topk=args.moe_router_group_topk,
        moe_router_dtype=args.moe_router_dtype, moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=args.moe_router_bias_update_rate, moe_z_loss_coeff=args.moe_z_loss_coeff,
        moe_expert_capacity_factor=args.moe_expert_capacity_factor,
        moe_pad_expert_input_to_capacity=args.moe_pad_expert_input_to_capacity,
        moe_token_drop_policy=args.moe_token_drop_policy, moe_per_layer_logging=args.moe_per_layer_logging,
        moe_permute_fusion=args.moe_permute_fusion, moe_router_force_load_balancing=args.moe_router_force_load_balancing,
        moe_apply_probs_on_input=args.moe_apply_probs_on_input,
        deterministic_mode=args.deterministic_mode, attention_backend=AttnBackend[args.attention_backend],
        calculate_per_token_loss=args.calculate_per_token_loss,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=args.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=args.account_for_loss_in_pipeline_split,
        pipeline_model_parallel_layout=args.pipeline_model_parallel_layout,
        microbatch_group_size_per_vp_stage=args.microbatch_group_size_per_vp_stage,
        mtp_num_layers=args.mtp_num_layers, mtp_loss_scaling_factor=args.mtp_loss_scaling_factor,
    )


def _activation(args) -> dict:
    """The MLP's activation as Megatron-LM maps the flags. megatron-core fuses the bias into GeLU and SwiGLU only
    (its MLP refuses the fusion otherwise), so the bias of a squared-ReLU or quick-GeGLU MLP is added unfused."""
    from megatron.core.activations import squared_relu
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    if args.swiglu:
        return dict(activation_func=F.silu, gated_linear_unit=True, bias_activation_fusion=args.bias_swiglu_fusion)
    if args.squared_relu:
        return dict(activation_func=squared_relu, gated_linear_unit=False, bias_activation_fusion=False)
    if args.quick_geglu:
        return dict(activation_func=quick_gelu, gated_linear_unit=True, bias_activation_fusion=False)
    return dict(activation_func=F.gelu, gated_linear_unit=False, bias_activation_fusion=args.bias_gelu_fusion)


def _has_fused_softmax() -> bool:
    return importlib.util.find_spec("scaled_masked_softmax_cuda") is not None


def layer_spec(args, config, vp_stage):
    """Megatron-LM's spec choice: --spec, else MoE block spec, else the local or TE layer spec."""
    from megatron.core.models.gpt import gpt_layer_specs

    if args.spec is not None:
        import importlib

        module, name = args.spec
        spec = getattr(importlib.import_module(module), name)
        return spec() if callable(spec) else spec
    if args.num_experts is None:
        return _dense_layer_spec(args)
    use_te = args.transformer_impl == "transformer_engine"  # the block spec reads multi_latent_attention from config
    spec = gpt_layer_specs.get_gpt_decoder_block_spec(config, use_transformer_engine=use_te,
                                                    normalization=args.normalization, qk_l2_norm=args.qk_l2_norm,
                                                    vp_stage=vp_stage)
    return spec if use_te else _local_core_attention(args, spec)


def _dense_layer_spec(args):
    """The layer spec without experts: Transformer Engine's (which reads the norm from config) or the local one."""
    from megatron.core.models.gpt import gpt_layer_specs

    if args.transformer_impl == "transformer_engine":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=args.qk_layernorm, multi_latent_attention=args.multi_latent_attention,
            qk_l2_norm=args.qk_l2_norm)
    return _local_core_attention(args, gpt_layer_specs.get_gpt_layer_local_spec(
        qk_layernorm=args.qk_layernorm, normalization=args.normalization,
        multi_latent_attention=args.multi_latent_attention, qk_l2_norm=args.qk_l2_norm))


def _local_core_attention(args, spec):
    """A local-spec layer or block spec with its MLA layers made buildable (megatron/hooks/mla.py) and its core
    attention computed by torch's SDPA unless --attention-backend unfused|local (megatron/hooks/attention.py)."""
    from megatron.hooks.attention import sdpa_supports, use_sdpa_core_attention
    from megatron.hooks.mla import use_latent_dot_product_attention

    if args.multi_latent_attention:
        spec = use_latent_dot_product_attention(spec)
    if args.attention_backend in ("unfused", "local") or not sdpa_supports(args.softmax_type):
        return spec
    return use_sdpa_core_attention(spec)


def mtp_block_spec(args, config, decoder_spec, vp_stage):
    """Megatron-LM's multi-token prediction spec: each MTP layer is built as the decoder's last layer (or, where this
    stage's MoE block holds no layer, as a layer of the spec without experts); None without --mtp-num-layers or off
    the last stage."""
    from megatron.core.models.gpt import gpt_layer_specs

    if args.mtp_num_layers is None:
        return None
    layer = decoder_spec
    if hasattr(decoder_spec, "layer_specs"):  # a block spec (MoE)
        layer = decoder_spec.layer_specs[-1] if decoder_spec.layer_specs else _dense_layer_spec(args)
    return gpt_layer_specs.get_gpt_mtp_block_spec(config, layer, vp_stage=vp_stage,
                                                  use_transformer_engine=args.transformer_impl == "transformer_engine")


def build_gpt_chunk(args, config, vp_stage):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    decoder_spec = layer_spec(args, config, vp_stage)
    return GPTModel(
        config=config, transformer_layer_spec=decoder_spec,
        mtp_block_spec=mtp_block_spec(args, config, decoder_spec, vp_stage),
        vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process, post_process=post_process, parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base, rope_scaling=args.use_rope_scaling, rope_scaling_factor=args.rope_scaling_factor,
        seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor, vp_stage=vp_stage,
    )


def _global_name(chunk, name: str, param) -> str:
    """The parameter's name in the unpartitioned model: global layer and expert indices (decoder and multi-token
    prediction layers), and the last stage's copy of a tied embedding named as the embedding."""
    if getattr(param, "shared_embedding", False):
        return "embedding.word_embeddings.weight"
    expert = re.search(r"\.local_experts\.(\d+)\.", name)
    if expert:
        from megatron.core import parallel_state

        local = chunk.get_submodule(name[:expert.start()]).num_local_experts
        index = parallel_state.get_expert_model_parallel_rank() * local + int(expert.group(1))
        name = name[:expert.start()] + f".local_experts.{index}." + name[expert.end():]
    match = re.match(r"decoder\.layers\.(\d+)\.", name)
    if match:
        layer = chunk.decoder.layers[int(match.group(1))]
        name = f"decoder.layers.{layer.layer_number - 1}." + name[match.end():]
    return name


def _tensor_parallel_slice(param, full):
    """This rank's slice of ``full``, split as megatron-core splits a master weight (with stride)."""
    from megatron.core import parallel_state

    if not getattr(param, "tensor_model_parallel", False):
        return full
    if getattr(param, "allreduce", True):
        rank, size = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()
    else:  # expert parameter: sharded over the expert tensor-parallel group
        rank, size = (parallel_state.get_expert_tensor_parallel_rank(),
                      parallel_state.get_expert_tensor_parallel_world_size())
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    pieces = torch.chunk(full, size * stride, dim=dim)
    return torch.cat(pieces[rank::size], dim=dim)


def init_weights_layout_independent(chunk, config, seed: int) -> None:
    for name, param in chunk.named_parameters():
        if param.dim() < 2 and not name.endswith("softmax_offset"):  # biases and norms keep megatron-core's init
            continue
        global_name = _global_name(chunk, name, param)
        full_shape = list(param.shape)
        if getattr(param, "tensor_model_parallel", False):
            from megatron.core import parallel_state

            size = (parallel_state.get_tensor_model_parallel_world_size() if getattr(param, "allreduce", True)
                    else parallel_state.get_expert_tensor_parallel_world_size())
            full_shape[param.partition_dim] *= size
        digest = hashlib.sha256(f"{seed}:{global_name}".encode()).digest()
        scaled = global_name.endswith(("linear_proj.weight", "linear_fc2.weight"))
        init = config.output_layer_init_method if scaled else config.init_method
        # Drawn on the parameter's device: fast on GPU; CPU and CUDA generators give different
        # (equally valid) draws, so compare layouts on one kind of device.
        cuda = [param.device] if param.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            torch.manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
            full = torch.empty(full_shape, dtype=torch.float32, device=param.device)
            init(full)
        with torch.no_grad():
            param.copy_(_tensor_parallel_slice(param, full))


def build_model_chunks(args, config) -> list:
    """One GPTModel per virtual pipeline stage of this rank, initialized layout-independently and
    wrapped in Float16Module for bf16/fp16 (the torch norm fallback ignores params_dtype)."""
    from megatron.core.transformer.module import Float16Module

    from megatron.hooks import compat

    vp_size = args.virtual_pipeline_model_parallel_size
    stages = range(vp_size) if vp_size is not None else [None]
    chunks = []
    for vp_stage in stages:
        chunk = build_gpt_chunk(args, config, vp_stage)
        compat.fix_model_chunk(chunk)
        init_weights_layout_independent(chunk, config, args.seed)
        if torch.cuda.is_available():
            chunk.cuda(torch.cuda.current_device())
        if args.bf16 or args.fp16:
            chunk = Float16Module(config, chunk)
        chunks.append(chunk)
    return chunks


def wrap_ddp(args, config, chunks) -> list:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    bucket_size = args.ddp_bucket_size
    if args.ddp_num_buckets is not None:  # Megatron-LM's: this rank's parameters, all chunks, over N
        bucket_size = sum(p.numel() for chunk in chunks for p in chunk.parameters()) // args.ddp_num_buckets
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        overlap_grad_reduce=args.overlap_grad_reduce, overlap_param_gather=args.overlap_param_gather,
        align_param_gather=args.align_param_gather, use_distributed_optimizer=args.use_distributed_optimizer,
        num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
        bucket_size=bucket_size, average_in_collective=args.ddp_average_in_collective,
        pad_buckets_for_high_nccl_busbw=args.ddp_pad_buckets_for_high_nccl_busbw,
        check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad, check_for_large_grads=args.check_for_large_grads,
    )
    # Only the first chunk's buckets may be skipped for overlap (Megatron-LM's bucketing rule).
    return [DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=index > 0)
            for index, chunk in enumerate(chunks)]


def build_optimizer(args, ddp_chunks, timers=None):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron.hooks import fused_ops
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    config = OptimizerConfig(
        optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum, clip_grad=args.clip_grad, bf16=args.bf16, fp16=args.fp16,
        params_dtype=ddp_chunks[0].config.params_dtype, loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale, min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window, hysteresis=args.hysteresis,
        use_distributed_optimizer=args.use_distributed_optimizer, overlap_param_gather=args.overlap_param_gather,
        decoupled_lr=args.decoupled_lr, decoupled_min_lr=args.decoupled_min_lr,  # embedding and output layer groups
        apply_wd_to_qk_layernorm=args.apply_wd_to_qk_layernorm,
        log_num_zeros_in_grad=args.log_num_zeros_in_grad, timers=timers, barrier_with_L1_time=True,
    )
    optimizer = get_megatron_optimizer(config, ddp_chunks, use_gloo_process_groups=not args.disable_gloo_process_groups)
    fused_ops.fuse_adam(optimizer)  # torch's fused Adam kernel where megatron-core falls back to torch's optimizer
    # The scheduler counts samples, stepped by the global batch size each iteration (Megatron-LM); the weight
    # decay goes from start to end over the training length.
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_steps, lr_decay_steps=args.lr_decay_steps,
        lr_decay_style=args.lr_decay_style, start_wd=args.start_weight_decay, end_wd=args.end_weight_decay,
        wd_incr_steps=args.train_samples or args.train_iters * args.global_batch_size,
        wd_incr_style=args.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
    )
    return optimizer, scheduler


def setup_model_and_optimizer(args, compression=None):
    """Returns (ddp_chunks, optimizer, scheduler, config), with ``compression`` (a ``Compression``; default: the one
    ``args.compression`` configures) installed. Its hooks are imported only when asked for, so with every
    compression off the run is stock megatron-core."""
    from megatron.core.timers import Timers

    from megatron.hooks.lifecycle import Compression

    compression = compression if compression is not None else Compression(args.compression)
    config = core_transformer_config(args)
    # --timing-log-level's timers, which megatron-core's schedules, grad finalization and optimizer start and stop
    # (Megatron-LM's setup: a barrier before each level-1 timer)
    config.timers = Timers(args.timing_log_level, args.timing_log_option)
    chunks = build_model_chunks(args, config)
    compression.install_model(chunks, config)  # (TP and PP hooks swap the bare chunks' classes, before DDP)
    ddp_chunks = wrap_ddp(args, config, chunks)
    optimizer, scheduler = build_optimizer(args, ddp_chunks, config.timers)
    compression.install_data_parallel(ddp_chunks, optimizer)
    return ddp_chunks, optimizer, scheduler, config
