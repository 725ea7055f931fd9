"""Process start-up: check the installed packages, start torch.distributed and megatron-core's
parallel state, seed every RNG, and set up the micro-batch calculator.

Backend choice (--distributed-backend): by default NCCL with one GPU per process (--local-rank, torchrun's
LOCAL_RANK) when CUDA is present, gloo on CPU (with the CPU shim of ``megatron.hooks.cpu`` installed first, since
megatron-core assumes CUDA in places).
"""

import logging
import os
import random
from datetime import timedelta

import numpy as np
import torch

from megatron.training.lifetime import fork_children_die_with_parent

SUPPORTED_MCORE = ("0.16.1", "0.20")  # >= first, < second


def check_installation() -> None:
    """Fail loudly if ``megatron.core`` is not a supported pip megatron-core or ``megatron.training`` is
    not this project's (a Megatron-LM checkout on PYTHONPATH merges into the ``megatron`` namespace)."""
    from packaging.version import Version

    import megatron.core
    import megatron.training
    from megatron.core.package_info import __version__

    low, high = SUPPORTED_MCORE
    if not Version(low) <= Version(__version__) < Version(high):
        raise RuntimeError(f"megatron-core {__version__} at {megatron.core.__path__[0]} is not supported: "
                           f"pip install 'megatron-core>={low},<{high}'")
    ours = os.path.dirname(os.path.abspath(__file__))
    found = os.path.dirname(os.path.abspath(megatron.training.__file__))
    if os.path.realpath(ours) != os.path.realpath(found):
        raise RuntimeError(f"megatron.training resolves to {found}, not this project's {ours}: a Megatron-LM "
                           f"checkout on PYTHONPATH shadows it; remove it from PYTHONPATH")


def install_cpu_support() -> bool:
    """Without CUDA: redirect megatron-core's CUDA calls to the CPU. Returns True on CPU."""
    if torch.cuda.is_available():
        return False
    from megatron.hooks import cpu

    cpu.apply()
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # N ranks share the cores; more threads only contend
    return True


def allow_torch_norm_options(args) -> None:
    """The local spec's norms are torch's without apex (its RMSNorm also with apex), and those refuse SP
    although a norm over the hidden dimension is exact on a sequence shard, and refuse zero-centered gamma
    (--apply-layernorm-1p) although it is one addition (megatron.hooks.norm)."""
    import importlib.util

    if args.transformer_impl != "local":
        return
    from megatron.hooks import norm

    if args.sequence_parallel and importlib.util.find_spec("apex") is None:
        norm.allow_sequence_parallel_torch_norm()
    if args.apply_layernorm_1p:
        norm.allow_zero_centered_gamma_torch_norm()


def set_deterministic_mode(args) -> None:
    """--deterministic-mode: deterministic torch kernels (megatron-core's MoE then scatters tokens with
    index_add), a fixed cuBLAS workspace and one NCCL algorithm, all set before CUDA and NCCL start."""
    if not args.deterministic_mode:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ.setdefault("NCCL_ALGO", "Ring")
    torch.use_deterministic_algorithms(True)


def set_matmul_and_experimental_flags(args) -> None:
    """--disable-bf16-reduced-precision-matmul and --enable-experimental, as Megatron-LM sets them."""
    if args.disable_bf16_reduced_precision_matmul:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    if args.enable_experimental:
        from megatron.core.config import set_experimental_flag

        set_experimental_flag(True)


def initialize_distributed(args) -> None:
    """torch.distributed from torchrun's environment (a one-process world without it)."""
    if torch.distributed.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    if torch.cuda.is_available():
        torch.cuda.set_device(args.local_rank)
    torch.distributed.init_process_group(args.distributed_backend, world_size=args.world_size, rank=args.rank,
                                         timeout=timedelta(minutes=args.distributed_timeout_minutes))


def initialize_rerun_state_machine() -> None:
    """megatron-core's rerun state machine checks the losses and gradients of --check-for-nan-in-loss-and-grad
    (and --check-for-spiky-loss); disabled (--rerun-mode's only mode here), it checks without re-running: a NaN or
    Inf stops with an error naming the rank and iteration, a spike is a warning."""
    from megatron.core.rerun_state_machine import RerunMode
    from megatron.core.rerun_state_machine import initialize_rerun_state_machine as initialize

    initialize(mode=RerunMode.DISABLED)


def records_memory_history(args) -> bool:
    """Whether this rank records with --record-memory-history: the --profile-ranks, by default every rank
    (Megatron-LM's)."""
    return args.record_memory_history and (not args.profile_ranks or args.rank in args.profile_ranks)


def record_memory_history(args) -> None:
    """--record-memory-history: the CUDA caching allocator records its last 100k allocations and frees with their
    stacks from here on (Megatron-LM's setting)."""
    if records_memory_history(args):
        torch.cuda.memory._record_memory_history(max_entries=100_000)


def initialize_model_parallel(args) -> None:
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
        create_gloo_process_groups=not args.disable_gloo_process_groups,
        order="tp-cp-ep-pp-dp" if args.use_tp_pp_dp_mapping else "tp-cp-ep-dp-pp",  # Megatron-LM's two
    )


def set_random_seed(seed: int) -> None:
    """Same seed on every rank: with use_cpu_initialization megatron-core draws each full weight from
    this generator and slices it, so the model is identical for every parallel layout. The
    model-parallel tracker gets rank-dependent seeds for TP-sharded dropout."""
    from megatron.core import tensor_parallel

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def set_logging_level(args) -> None:
    """--logging-level, else the environment's MEGATRON_LOGGING_LEVEL (Megatron-LM's): every logger's level."""
    level = args.logging_level
    if level is None and os.environ.get("MEGATRON_LOGGING_LEVEL"):
        level = int(os.environ["MEGATRON_LOGGING_LEVEL"])
    if level is not None:
        logging.getLogger().setLevel(level)


def initialize_megatron(args) -> None:
    """Everything before the model is built. ``args`` must have passed ``validate_args``."""
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator

    check_installation()
    install_cpu_support()
    from megatron.hooks import checkpoint_writer, compat, fused_ops

    compat.apply()
    fused_ops.apply()
    checkpoint_writer.apply()  # the writer's helper processes, spawned or forked, end with this one
    fork_children_die_with_parent()
    allow_torch_norm_options(args)
    set_deterministic_mode(args)
    set_matmul_and_experimental_flags(args)
    initialize_distributed(args)
    # The hooks report what they installed (swapped layers, TP thresholds, CIERA selection) on rank 0.
    logging.basicConfig(level=logging.INFO if args.rank == 0 else logging.WARNING,
                        format="[%(name)s] %(message)s")
    set_logging_level(args)
    initialize_model_parallel(args)
    initialize_rerun_state_machine()
    record_memory_history(args)
    set_random_seed(args.seed)
    init_num_microbatches_calculator(args.rank, None, args.global_batch_size, args.micro_batch_size,
                                     args.data_parallel_size)
