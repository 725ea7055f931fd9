"""The run's ``CompressionConfig`` from the parsed flags: the one place that reads the compression flags off the
argparse namespace (``validate_args`` builds it, as ``args.compression``). The hooks and codecs receive only these
typed configs; each config checks its own fields (megatron/hooks/config.py)."""

from compression.ciera import CieraConfig
from compression.delta import DeltaConfig
from compression.pp_quant import TahQuantConfig
from compression.sdp4bit import Sdp4bitConfig
from compression.taco import TacoConfig
from megatron.hooks.config import (
    CompressionConfig, GradReduceConfig, ParamGatherConfig, PipelineCommConfig, TpCommConfig,
)


def tahquant_config(args) -> TahQuantConfig:
    return TahQuantConfig(bits=args.pp_comm_bits, tile_size=args.pp_comm_tile_size,
                          high_bit_fraction=args.pp_comm_high_bit_fraction)


def largest_tp_message_bytes(args) -> int:
    """Bytes of the largest activation a TP collective carries: [seq, micro batch, hidden] in the params dtype
    (the same with sequence parallelism, where it is the gathered size)."""
    if not (args.seq_length and args.micro_batch_size and args.hidden_size):
        return 0  # (a shape read from a checkpoint later)
    itemsize = 2 if (args.bf16 or args.fp16) else 4
    return args.seq_length * args.micro_batch_size * args.hidden_size * itemsize


def tp_comm_config(args) -> TpCommConfig:
    return TpCommConfig(
        method=args.tp_comm_compression, min_bytes=str(args.tp_comm_compression_min_bytes),
        trial_iters=args.tp_comm_compression_trial_iters, cuda_graphs=args.tp_comm_cuda_graphs,
        all_reduce=args.taco_all_reduce, emulate=args.tp_comm_emulate, sequence_parallel=bool(args.sequence_parallel),
        taco=TacoConfig(block_size=args.taco_block_size, format=args.taco_format, transform=args.taco_transform,
                        scaling=args.taco_scaling),
        tahquant=tahquant_config(args), hidden_size=args.hidden_size or 0,
        largest_message_bytes=largest_tp_message_bytes(args), transformer_impl=args.transformer_impl,
    )


def param_gather_config(args) -> ParamGatherConfig:
    return ParamGatherConfig(
        method=args.param_gather_compression, selection=args.param_gather_selection,
        trial_iters=args.param_gather_trial_iters, reselect_interval=args.param_gather_reselect_interval,
        verify_interval=args.param_gather_verify_interval, keyframe_interval=args.param_gather_keyframe_interval,
        integrity_check=args.param_gather_integrity_check,
        integrity_max_mismatches=args.param_gather_integrity_max_mismatches,
        ciera=CieraConfig(block_size=args.ciera_block_size, change_detect=args.ciera_change_detect,
                          exponent_coder=args.ciera_exponent_coder),
        ciera_cache_budget_mb=args.ciera_cache_budget_mb, delta=DeltaConfig(block_size=args.delta_block_size),
        delta_fused_cast=args.delta_fused_cast, delta_capacity_factor=args.delta_capacity_factor,
        delta_cuda_graphs=args.delta_cuda_graphs,
        sdp4bit=Sdp4bitConfig(group_size=args.sdp4bit_group_size, weight_bits=args.sdp4bit_weight_bits),
    )


def compression_config(args) -> CompressionConfig:
    """Every compression setting of the run, checked (a ValueError naming the flag and the fix)."""
    return CompressionConfig(
        tp=tp_comm_config(args),
        param_gather=param_gather_config(args),
        grad_reduce=GradReduceConfig(method=args.grad_reduce_compression, block_size=args.grad_reduce_block_size),
        pp=PipelineCommConfig(method=args.pp_comm_compression, compress_grads=args.pp_comm_compress_grads,
                              tahquant=tahquant_config(args), hidden_size=args.hidden_size,
                              emulate=args.pp_comm_emulate),
        dp_emulate=args.dp_comm_emulate,
    )
