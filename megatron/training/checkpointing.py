"""Save and load training checkpoints with megatron-core's dist_checkpointing, for exact resume.

Directory layout (Megatron-LM's):
    <save>/iter_0000100/                       one torch_dist checkpoint per saved iteration
    <save>/latest_checkpointed_iteration.txt   the iteration ``load_checkpoint`` resumes from

Saving is fully parallel (each DP-replicated tensor written by one replica, Megatron-LM's default;
``--no-ckpt-fully-parallel-save``: DP rank 0 writes them); with ``--ckpt-assume-constant-structure`` later
saves reuse the first save's plan (``context`` keeps it).
Crash safety: every rank writes into ``iter_0000100.tmp``; after a barrier rank 0 renames it to
``iter_0000100`` and only then rewrites the tracker (atomically). A crash at any point mid-save leaves
the tracker pointing at the previous complete checkpoint. Publishing never moves the tracker back: a run that would
save iterations older than --save's tracker is an error at start-up (``check_save_keeps_newer_checkpoints``), and
each publish checks again. Before the rename every file's size and sha256 go into ``iter_0000100/checksums.json``
(each rank hashes the shards it wrote); a load verifies them on every rank first, and a damaged or truncated file
is an error naming it and the --ckpt-step fallback. With ``--async-save`` the shards are written by a
background process (forked per save, holding a copy of the state; or ``--use-persistent-ckpt-worker``'s, on GPU,
from host copies), and the rename and tracker are the save's finalization, which the training loop runs once every
rank's writer has finished (``megatron.core.dist_checkpointing``'s ``AsyncCallsQueue``); the run waits for
unfinished saves before it exits.

Checkpoint contents (one dist_checkpointing state dict):
    model | model0, model1, ...   each chunk's ``sharded_state_dict`` (numbered for virtual-pipeline chunks)
    optimizer                     ``optimizer.sharded_state_dict``; the distributed optimizer uses
                                  Megatron-LM's default ``dp_reshardable`` form: per DP shard, the fp32
                                  main params and Adam moments (resharding across DP only), or with
                                  ``--dist-ckpt-optim-fully-reshardable`` ``fully_reshardable`` (per parameter,
                                  gathered over DP: reshards across TP and PP too); a load reads which from the
                                  saved args
    opt_param_scheduler           the LR/WD scheduler state
    rng_state                     a ShardedObject per (pp, tp, dp) rank: python, numpy, torch CPU, CUDA
                                  (when present) and the model-parallel RNG tracker states
    iteration, consumed_train_samples, consumed_valid_samples, num_floating_point_operations_so_far,
    parallel_sizes, args (the plain-valued flags, for inspection)

``--no-save-optim`` leaves out the optimizer and scheduler state, ``--no-save-rng`` the RNG states; the saved
args record it, and a load then skips them (Megatron-LM's rule).

Loading restores all of it bit-exactly, except what ``--no-load-optim`` (optimizer and scheduler) or
``--no-load-rng`` skip; ``--finetune`` loads the weights only and starts at iteration 0 with no samples
consumed. Model weights reshard freely across TP/PP/DP; optimizer state needs the same TP, PP and EP
sizes (saved with ``--dist-ckpt-optim-fully-reshardable``: the same EP size only), RNG state the same TP, PP and DP
sizes (clear errors name the flag that skips them).
Which checkpoint: ``--load``'s latest (or ``--ckpt-step``'s iteration) when it holds one, else
``--pretrained-checkpoint``'s as a fine-tuning start; none is a fresh start unless
``--exit-on-missing-checkpoint``. A directory in another format (Megatron-LM's legacy torch or torch_dcp) is
an error naming it. ``load_args_from_checkpoint`` (``--use-checkpoint-args``) reads the saved args before
``validate_args``.
Exact resume also needs the caller not to draw from the global torch RNG between ``load_checkpoint``
and the first step (on CPU that RNG also drives dropout; a DataLoader without its own ``generator``
draws from it on every ``iter()``).

megatron-core 0.16.1 mishandles the per-param ``step`` of torch's Adam (its optimizer when neither
Apex nor Transformer Engine is installed) in the distributed optimizer's checkpoints; two small
functions in ``megatron.hooks.optimizer_state`` work around it.
"""

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import pickle
import random
import re
import shutil
import tempfile

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.serialization import (
    get_default_load_sharded_strategy,
    get_default_save_sharded_strategy,
)
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.distributed import DistributedDataParallel

from megatron.hooks.optimizer_state import (
    materialize_adam_state,
    restore_adam_steps,
    steps_kept_in_fully_reshardable_load,
)
from megatron.hooks.version import mcore_at_least
from megatron.training.arguments import CheckpointArgs

logger = logging.getLogger(__name__)

NON_PERSISTENT_SUBDIR = "non_persistent"  # Megatron-LM's
TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
# In each checkpoint directory: every file's size and sha256, written when it is published, verified at load.
CHECKSUMS_FILENAME = "checksums.json"
CHECKSUM_CHUNK_BYTES = 4 << 20
SAVE_BACKEND = "torch_dist"  # megatron-core save strategy, at its default version (0.19 takes no version)
# Differ per rank; kept out of the saved args so the common state is identical on every rank.
RANK_LOCAL_ARGS = ("rank", "local_rank")
# Callers may pass an args namespace without the newer checkpoint flags (tests build minimal ones): their defaults.
CHECKPOINT_ARG_DEFAULTS = {f.name: f.default for f in dataclasses.fields(CheckpointArgs)}
# Megatron-LM's load_args_from_checkpoint (--use-checkpoint-args): the model's shape and tokenizer flags. The
# first group keeps a value given on the command line, the second takes the checkpoint's always; names this
# trainer does not have are skipped.
CHECKPOINT_ARGS_UNLESS_GIVEN = ("num_layers", "hidden_size", "ffn_hidden_size", "seq_length", "num_attention_heads",
                                "kv_channels", "max_position_embeddings", "moe_token_dispatcher_type", "ckpt_format",
                                "padded_vocab_size")
CHECKPOINT_ARGS_ALWAYS = (
    "num_query_groups", "group_query_attention", "position_embedding_type", "add_position_embedding",
    "use_rotary_position_embeddings", "rotary_base", "rotary_percent", "rotary_interleaved", "add_bias_linear",
    "add_qkv_bias", "squared_relu", "swiglu", "untie_embeddings_and_output_weights", "apply_layernorm_1p",
    "normalization", "apply_query_key_layer_scaling", "attention_dropout", "hidden_dropout", "spec", "num_experts",
    "moe_layer_freq", "moe_ffn_hidden_size", "moe_router_topk", "moe_router_pre_softmax", "moe_grouped_gemm",
    "moe_shared_expert_intermediate_size", "moe_router_score_function", "moe_router_enable_expert_bias",
    "moe_router_topk_scaling_factor", "tokenizer_model", "tokenizer_type", "tiktoken_pattern",
    # beyond Megatron-LM's list, the shape flags of its newer activations, attention forms, multi-latent attention and
    # multi-token prediction
    "quick_geglu", "window_size", "window_attn_skip_freq", "softmax_type", "multi_latent_attention", "q_lora_rank",
    "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type", "rotary_scaling_factor", "mscale",
    "mscale_all_dim", "mtp_num_layers", "glu_linear_offset", "activation_func_clamp_value",
)


def _option(args, name: str):
    return getattr(args, name, CHECKPOINT_ARG_DEFAULTS[name])


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def non_persistent_root(args, root: str) -> str:
    """Where --non-persistent-ckpt-type global checkpoints of ``root`` (--save or --load) live: Megatron-LM's
    --non-persistent-global-ckpt-dir, else ROOT/non_persistent."""
    return _option(args, "non_persistent_global_ckpt_dir") or os.path.join(root, NON_PERSISTENT_SUBDIR)


def _remove_older_checkpoints(root: str) -> None:
    """Rank 0, before a non-persistent save into ``root``: every published checkpoint there but the newest, which
    stays until the next save has succeeded (Megatron-LM keeps the same one)."""
    iterations = sorted(int(name[len("iter_"):]) for name in os.listdir(root) if re.fullmatch(r"iter_\d{7}", name))
    for iteration in iterations[:-1]:
        shutil.rmtree(checkpoint_dir(root, iteration))


def read_tracker(root: str) -> int | None:
    """The last completely saved iteration under ``root``, or None if there is none."""
    path = os.path.join(root, TRACKER_FILENAME)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    if not text.isdigit():
        raise ValueError(f"{path} must hold an iteration number, got {text!r}; fix or delete it")
    return int(text)


def _check_not_behind_tracker(root: str, iteration: int) -> int | None:
    """The tracker's iteration under ``root``; an error if it is newer than ``iteration``: publishing ``iteration``
    would move the tracker back (and --save-retain-interval would delete the newer checkpoint)."""
    latest = read_tracker(root)
    if latest is not None and latest > iteration:
        raise ValueError(f"{root}/{TRACKER_FILENAME} names iteration {latest}, newer than the iteration {iteration} "
                         f"being saved: publishing it would move the tracker back (and --save-retain-interval would "
                         f"delete iteration {latest}); resume from it with --load {root}, or give --save a new "
                         f"directory")
    return latest


def _start_described(args) -> tuple[int, str]:
    """The iteration a run starts from (the one ``load_checkpoint`` will return) and how it got there, for errors."""
    found = checkpoint_to_load(args) if args.load or _option(args, "pretrained_checkpoint") else None
    if found is None:
        where = f"--load {args.load} holds no checkpoint" if args.load else "no --load"
        return 0, f"a fresh start: {where}"
    ckpt_dir, finetune = found
    if finetune:
        return 0, f"fine-tuning from {ckpt_dir}, counted from iteration 0"
    iteration = int(re.fullmatch(r"iter_(\d+)", os.path.basename(ckpt_dir)).group(1))
    step = _option(args, "ckpt_step")
    return iteration, f"--load {args.load}" + (f" --ckpt-step {step}" if step is not None else "")


def _save_roots(args) -> list[tuple[str, str]]:
    """(flag, directory) of every checkpoint root a run saves into: --save, and with --non-persistent-save-interval
    its checkpoints' directory."""
    if not args.save:
        return []
    roots = [("--save", args.save)]
    if _option(args, "non_persistent_save_interval"):
        roots.append(("--non-persistent-global-ckpt-dir", non_persistent_root(args, args.save)))
    return roots


def check_save_keeps_newer_checkpoints(args) -> None:
    """At start-up (every rank): a run whose saves would publish iterations older than the checkpoints that --save
    (or its non-persistent directory) already holds is an error naming the flags, before any work is done: publishing
    never moves a tracker back nor deletes a newer checkpoint (``_check_not_behind_tracker`` guards each save too)."""
    for _, root in _save_roots(args):
        latest = read_tracker(root)
        if latest is None:
            continue
        start, how = _start_described(args)
        if latest <= start:
            continue
        deletes = (f" and --save-retain-interval would delete iteration {latest}"
                   if _option(args, "save_retain_interval") else "")
        raise ValueError(f"--save {args.save}: {root}/{TRACKER_FILENAME} names iteration {latest}, and this run "
                         f"starts at iteration {start} ({how}): its saves would move the tracker back{deletes}. "
                         f"Resume from it with --load {args.save} (without --ckpt-step), or give --save a new "
                         f"directory")


def check_save_writable(args) -> None:
    """At start-up (every rank): --save (and the directory of --non-persistent-save-interval's checkpoints) exists
    or can be made, and takes a file; otherwise the first save would fail after the work it should keep."""
    for flag, root in _save_roots(args):
        try:
            os.makedirs(root, exist_ok=True)
            with tempfile.TemporaryFile(dir=root):
                pass
        except OSError as error:
            raise ValueError(f"{flag} {root} is not writable ({error}): fix its permissions or path, or give "
                             f"another directory") from error


def _warn_nothing_to_load(args) -> None:
    """Megatron-LM warns too: a --load that holds no checkpoint (a typo, a wrong mount) starts from a random
    initialization; --exit-on-missing-checkpoint makes it an error (``checkpoint_to_load``)."""
    if (dist.get_rank() if dist.is_initialized() else 0) != 0:
        return
    for flag, root in (("--load", args.load), ("--pretrained-checkpoint", _option(args, "pretrained_checkpoint"))):
        if not root:
            continue
        what = (f"{root}/{TRACKER_FILENAME} does not exist" if os.path.isdir(root)
                else f"the directory {root} does not exist")
        logger.warning(f"{flag} {root} holds no checkpoint ({what}): training starts from a random initialization "
                       f"at iteration 0; pass --exit-on-missing-checkpoint to make this an error")


def save_checkpoint(args, iteration, model_chunks, optimizer, opt_param_scheduler,
                    num_floating_point_operations_so_far=0, context=None, non_persistent=False):
    """Save the training state of ``iteration`` to ``args.save`` (``non_persistent``: to ``non_persistent_root``, the
    older ones there removed first but the newest) (collective: call on every rank). ``context``, a dict kept across a
    run's saves, holds the reused save plan of --ckpt-assume-constant-structure. With --async-save, returns
    megatron-core's ``AsyncRequest`` for the caller to schedule (``AsyncCallsQueue``): the shards are written in the
    background, and its finalization publishes the checkpoint; else None."""
    _check_format(args)
    root = non_persistent_root(args, args.save) if non_persistent else args.save
    _check_not_behind_tracker(root, iteration)  # every rank, before any writes: none waits on a failed rank 0
    final_dir = checkpoint_dir(root, iteration)
    staging_dir = final_dir + ".tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(staging_dir, ignore_errors=True)  # leftovers of a crashed save
        os.makedirs(staging_dir)
        if non_persistent:
            _remove_older_checkpoints(root)
    dist.barrier()

    with_optimizer = optimizer is not None and not _option(args, "no_save_optim")
    state = _sharded_state_dict(model_chunks, optimizer, with_optimizer=with_optimizer,
                                with_rng=not _option(args, "no_save_rng"), is_loading=False,
                                fully_reshardable=_option(args, "dist_ckpt_optim_fully_reshardable"))
    if opt_param_scheduler is not None and not _option(args, "no_save_optim"):
        state["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    state.update(
        iteration=iteration,
        consumed_train_samples=args.consumed_train_samples,
        consumed_valid_samples=args.consumed_valid_samples,
        num_floating_point_operations_so_far=num_floating_point_operations_so_far,
        parallel_sizes=_parallel_sizes(),
        args=_plain_args(args),
    )
    context = {} if context is None else context
    reused = "save_strategy" in context  # its plan was validated at the first save
    async_save = _option(args, "async_save")
    request = dist_checkpointing.save(state, staging_dir, sharded_strategy=_save_strategy(args, context),
                                      validate_access_integrity=not reused, async_sharded_save=async_save,
                                      **(_async_strategy(args) if async_save else {}))

    retain_interval = None if non_persistent else _option(args, "save_retain_interval")

    def publish():  # collective: every rank hashes its share of the files
        checksums = _checksum_files(staging_dir)
        if dist.get_rank() == 0:
            _write_checksums(staging_dir, checksums)
            _publish(root, staging_dir, final_dir, iteration, retain_interval)

    if async_save:  # finalized once every rank's writer is done, after megatron-core's metadata
        request.add_finalize_fn(publish)
        return request
    dist.barrier()  # every rank's shards are on disk before the checkpoint is published
    publish()
    dist.barrier()
    return None


def _load_scheduler(opt_param_scheduler, state) -> None:
    """megatron-core asserts that the command line's schedule equals the checkpoint's unless told which wins."""
    try:
        opt_param_scheduler.load_state_dict(state)
    except AssertionError as error:
        raise ValueError(f"the LR/WD schedule on the command line differs from the checkpoint's ({error}): pass "
                         f"--override-opt_param-scheduler to use the command line's, or "
                         f"--use-checkpoint-opt_param-scheduler to use the checkpoint's") from error


@torch.no_grad()  # fp32 with the distributed optimizer: it copies into views of parameters that require grad
def load_checkpoint(args, model_chunks, optimizer, opt_param_scheduler) -> int:
    """Restore the checkpoint that ``checkpoint_to_load`` picks; return its iteration (0 if there is nothing to
    load, or for a fine-tuning start). Sets ``args.consumed_train_samples``, ``args.consumed_valid_samples`` and
    ``args.num_floating_point_operations_so_far``."""
    _check_format(args)
    found = checkpoint_to_load(args)
    if found is None:
        _warn_nothing_to_load(args)
        return 0
    ckpt_dir, finetune = found
    logger.info(f"loading {ckpt_dir}" + (" (fine-tuning: weights only, from iteration 0)" if finetune else ""))
    verify_checksums(ckpt_dir)
    with _named_read_errors(ckpt_dir):
        common = dist_checkpointing.load_common_state_dict(ckpt_dir)
    saved_args = common.get("args", {})
    for flag, state in (("no_save_optim", "optimizer and LR-scheduler state"), ("no_save_rng", "RNG states")):
        if saved_args.get(flag):
            logger.info(f"{ckpt_dir} was saved with --{flag.replace('_', '-')}: this run starts its {state} afresh")
    load_optim = optimizer is not None and not (args.no_load_optim or finetune or saved_args.get("no_save_optim"))
    load_rng = not (args.no_load_rng or finetune or saved_args.get("no_save_rng"))
    fully_reshardable = bool(saved_args.get("dist_ckpt_optim_fully_reshardable"))  # the form it was saved in
    _check_topology(common["parallel_sizes"], load_optim, load_rng, fully_reshardable)

    request = _sharded_state_dict(model_chunks, optimizer, with_optimizer=load_optim,
                                  with_rng=load_rng, is_loading=True, fully_reshardable=fully_reshardable)
    with _named_read_errors(ckpt_dir):
        state = dist_checkpointing.load(request, ckpt_dir, sharded_strategy=_load_strategy(args, ckpt_dir),
                                        strict=_option(args, "dist_ckpt_strictness"))

    for key, chunk in zip(_model_keys(model_chunks), model_chunks):
        chunk.load_state_dict(state[key], strict=True)
    if load_optim:
        with steps_kept_in_fully_reshardable_load(optimizer) if fully_reshardable else contextlib.nullcontext():
            optimizer.load_state_dict(state["optimizer"])
        restore_adam_steps(optimizer)
        if opt_param_scheduler is not None:
            _load_scheduler(opt_param_scheduler, state["opt_param_scheduler"])
    elif optimizer is not None:
        optimizer.reload_model_params()  # fresh fp32 main params from the loaded weights
    if load_rng:
        _restore_rng_state(state["rng_state"])

    dist.barrier()
    if finetune:  # a new run on pretrained weights: its own iterations, data order and schedule
        args.consumed_train_samples = args.consumed_valid_samples = 0
        args.num_floating_point_operations_so_far = 0
        return 0
    args.consumed_train_samples = state["consumed_train_samples"]
    args.consumed_valid_samples = state["consumed_valid_samples"]
    args.num_floating_point_operations_so_far = state["num_floating_point_operations_so_far"]
    return state["iteration"]


def checkpoint_to_load(args) -> tuple[str, bool] | None:
    """(directory, fine-tune) of the checkpoint to load: --load's when it holds one (a resume), else
    --pretrained-checkpoint's as a fine-tuning start (Megatron-LM's rule); the latest iteration or --ckpt-step's.
    With --non-persistent-ckpt-type global, --load's newest non-persistent checkpoint where it is at least as new as
    the persistent one (unless --ckpt-step names one). None when there is none (an error with --ckpt-step or
    --exit-on-missing-checkpoint)."""
    step = _option(args, "ckpt_step")
    sources = [(args.load, _option(args, "finetune"), "--load"),
               (_option(args, "pretrained_checkpoint"), True, "--pretrained-checkpoint")]
    if args.load and step is None and _option(args, "non_persistent_ckpt_type") == "global":
        root = non_persistent_root(args, args.load)
        newest, persistent = read_tracker(root), read_tracker(args.load)
        if newest is not None and (persistent is None or newest >= persistent):
            sources.insert(0, (root, _option(args, "finetune"), "--non-persistent-global-ckpt-dir"))
    for root, finetune, _ in sources:
        iteration = step if step is not None else (read_tracker(root) if root else None)
        if root and iteration is not None and os.path.isdir(checkpoint_dir(root, iteration)):
            ckpt_dir = checkpoint_dir(root, iteration)
            _check_is_torch_dist(ckpt_dir)
            return ckpt_dir, finetune
        if root and iteration is not None and step is None:
            raise ValueError(f"{root}/{TRACKER_FILENAME} names iteration {iteration}, but "
                             f"{checkpoint_dir(root, iteration)} does not exist: fix the tracker or restore the "
                             f"directory")
    where = " or ".join(f"{flag} {root}" for root, _, flag in sources if root)
    if step is not None:
        raise ValueError(f"--ckpt-step {step}: there is no iter_{step:07d} under {where}")
    if _option(args, "exit_on_missing_checkpoint"):
        raise ValueError(f"--exit-on-missing-checkpoint: no checkpoint under {where} (no {TRACKER_FILENAME}): fix the "
                         f"path, or drop the flag to start from a random initialization")
    return None


def _files_of_rank(names: list[str], rank: int, world_size: int) -> list[str]:
    """This rank's share of a checkpoint's files to hash: the shards megatron-core's writer names after a rank
    (``__R_k.distcp``) go to that rank, which has just written them, the rest round-robin."""
    mine = []
    for index, name in enumerate(sorted(names)):
        writer = re.match(r"__(\d+)_", name)
        owner = int(writer.group(1)) if writer and int(writer.group(1)) < world_size else index % world_size
        if owner == rank:
            mine.append(name)
    return mine


def _file_checksum(path: str) -> dict:
    digest, size = hashlib.sha256(), 0
    buffer = memoryview(bytearray(CHECKSUM_CHUNK_BYTES))
    with open(path, "rb", buffering=0) as f:
        while count := f.readinto(buffer):
            digest.update(buffer[:count])
            size += count
    return {"bytes": size, "sha256": digest.hexdigest()}


def _checkpoint_files(ckpt_dir: str) -> list[str]:
    return [os.path.relpath(os.path.join(folder, name), ckpt_dir)
            for folder, _, names in os.walk(ckpt_dir) for name in names if name != CHECKSUMS_FILENAME]


def _checksum_files(ckpt_dir: str) -> dict:
    """{file: {"bytes", "sha256"}} of every file in ``ckpt_dir``, each hashed by one rank (collective)."""
    mine = {name: _file_checksum(os.path.join(ckpt_dir, name))
            for name in _files_of_rank(_checkpoint_files(ckpt_dir), dist.get_rank(), dist.get_world_size())}
    shares = [None] * dist.get_world_size()
    dist.all_gather_object(shares, mine)
    return {name: entry for share in shares for name, entry in sorted(share.items())}


def _write_checksums(ckpt_dir: str, checksums: dict) -> None:
    with open(os.path.join(ckpt_dir, CHECKSUMS_FILENAME), "w") as f:
        json.dump({"algorithm": "sha256", "files": dict(sorted(checksums.items()))}, f, indent=1)


def _fallback_hint(ckpt_dir: str) -> str:
    root, name = os.path.split(os.path.normpath(ckpt_dir))
    others = sorted(int(n[len("iter_"):]) for n in os.listdir(root)
                    if re.fullmatch(r"iter_\d{7}", n) and n != name)
    if not others:
        return "no other checkpoint is there to fall back to"
    return f"fall back to an earlier checkpoint with --ckpt-step N (there: {', '.join(map(str, others))})"


def verify_checksums(ckpt_dir: str) -> None:
    """Every file of ``ckpt_dir``'s checksums.json (written when it was published) has its size and sha256, each
    file read by one rank; else an error on every rank naming the files (a truncated one as such) and the
    --ckpt-step fallback. A checkpoint without checksums.json (Megatron-LM's, or older) loads unverified."""
    path = os.path.join(ckpt_dir, CHECKSUMS_FILENAME)
    if not os.path.isfile(path):
        if dist.get_rank() == 0:
            logger.info(f"{ckpt_dir} has no {CHECKSUMS_FILENAME}: its files are not verified")
        return
    with open(path) as f:
        expected = json.load(f)["files"]
    problems = []
    for name in _files_of_rank(list(expected), dist.get_rank(), dist.get_world_size()):
        file_path, want = os.path.join(ckpt_dir, name), expected[name]
        if not os.path.isfile(file_path):
            problems.append(f"{file_path} is missing")
            continue
        got = _file_checksum(file_path)
        if got["bytes"] != want["bytes"]:
            problems.append(f"{file_path} holds {got['bytes']} bytes, {want['bytes']} were saved (truncated or "
                            f"overwritten)")
        elif got["sha256"] != want["sha256"]:
            problems.append(f"{file_path} differs from what was saved (sha256 {got['sha256']}, saved "
                            f"{want['sha256']}): corrupted on disk")
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problems)
    problems = sorted(p for share in everyone for p in share)
    if problems:
        raise ValueError(f"checkpoint {ckpt_dir} fails its checksums ({CHECKSUMS_FILENAME}): " + "; ".join(problems)
                         + f". Restore the files, or {_fallback_hint(ckpt_dir)}")


@contextlib.contextmanager
def _named_read_errors(ckpt_dir: str):
    """A checkpoint without checksums.json whose file is cut short fails inside torch (a bare EOFError, an unpickling
    error, or torch.distributed.checkpoint's exception with every rank's traceback): name the checkpoint, the first
    cause and the fallback, on every rank. The ranks agree on it (one all-gather of each rank's cause): a read that
    fails only where the damaged file is read (megatron-core 0.19's loads) would otherwise leave the other ranks
    waiting in the next collective."""
    failure = None
    try:
        yield
    except (EOFError, pickle.UnpicklingError, CheckpointException) as error:
        failure = error
    cause = None
    if failure is not None:
        first = next(iter(failure.failures.values()))[0] if isinstance(failure, CheckpointException) else failure
        cause = f"{type(first).__name__}: {str(first).splitlines()[0] if str(first) else ''}"
    causes = [None] * dist.get_world_size()
    dist.all_gather_object(causes, cause)
    failed = [rank for rank, text in enumerate(causes) if text is not None]
    if failed:
        ranks = f"rank {failed[0]}" if len(failed) == 1 else f"ranks {', '.join(map(str, failed))}"
        raise ValueError(f"reading checkpoint {ckpt_dir} failed on {ranks} ({causes[failed[0]]}): a file of it is "
                         f"damaged, or the load does not fit it; {_fallback_hint(ckpt_dir)}") from failure


def _check_is_torch_dist(ckpt_dir: str) -> None:
    if dist_checkpointing.check_is_distributed_checkpoint(ckpt_dir):
        return
    names = os.listdir(ckpt_dir)
    found = ("Megatron-LM's legacy torch format (mp_rank_*)" if any(n.startswith("mp_rank_") for n in names)
             else "the torch_dcp format (.metadata)" if ".metadata" in names else "no known format")
    raise ValueError(f"{ckpt_dir} holds {found}; this trainer reads torch_dist checkpoints only: convert it with "
                     f"Megatron-LM (--ckpt-convert-format torch_dist --ckpt-convert-save DIR) and load DIR")


def _save_strategy(args, context: dict):
    """torch_dist, by default with each replicated tensor written by one of its DP replicas in turn rather than
    all by DP rank 0 (Megatron-LM's default --ckpt-fully-parallel-save). With --ckpt-assume-constant-structure
    the strategy (which holds the plan and distribution of the first save) is kept in ``context`` and reused."""
    if "save_strategy" in context:
        return context["save_strategy"]
    constant = _option(args, "ckpt_assume_constant_structure")
    strategy = get_default_save_sharded_strategy(SAVE_BACKEND)
    strategy.use_cached_ckpt_structure = constant
    if _option(args, "ckpt_fully_parallel_save"):
        dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        strategy = FullyParallelSaveStrategyWrapper(strategy, dp_group, do_cache_distribution=constant)
    if constant:
        context["save_strategy"] = strategy
    return strategy


def _load_strategy(args, ckpt_dir: str):
    """megatron-core's default (every rank reads what it needs), or with --ckpt-fully-parallel-load each DP
    replica reads a part and they exchange the rest."""
    if not _option(args, "ckpt_fully_parallel_load"):
        return None
    dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    return FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(ckpt_dir), dp_group)


def load_args_from_checkpoint(args) -> None:
    """--use-checkpoint-args (Megatron-LM's): before ``validate_args``, set the model's shape and tokenizer flags
    from the saved args of the checkpoint that will load (``checkpoint_to_load``). No checkpoint changes nothing."""
    found = checkpoint_to_load(args)
    if found is None:
        logger.warning(f"--use-checkpoint-args: no checkpoint under --load {args.load} (or --pretrained-checkpoint): "
                       f"the command line's arguments stay")
        return
    saved = dist_checkpointing.load_common_state_dict(found[0]).get("args", {})
    for name in CHECKPOINT_ARGS_UNLESS_GIVEN + CHECKPOINT_ARGS_ALWAYS:
        keep_given = name in CHECKPOINT_ARGS_UNLESS_GIVEN and getattr(args, name, None) is not None
        if hasattr(args, name) and saved.get(name) is not None and not keep_given:
            setattr(args, name, saved[name])
    if saved.get("num_experts") is None and hasattr(args, "moe_ffn_hidden_size"):
        args.moe_ffn_hidden_size = None


def _check_format(args) -> None:
    if args.ckpt_format != "torch_dist":
        raise ValueError(f"--ckpt-format must be 'torch_dist' (the only format implemented), "
                         f"got {args.ckpt_format!r}")


def _sharded_state_dict(model_chunks, optimizer, with_optimizer, with_rng, is_loading, fully_reshardable) -> dict:
    metadata = {
        # Megatron-LM's default form of the distributed optimizer's state, or --dist-ckpt-optim-fully-reshardable's
        "distrib_optim_sharding_type": "fully_reshardable" if fully_reshardable else "dp_reshardable",
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
        "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True),
    }
    state = {key: _unwrap_ddp(chunk).sharded_state_dict(metadata=metadata)
             for key, chunk in zip(_model_keys(model_chunks), model_chunks)}
    if with_optimizer:
        materialize_adam_state(optimizer)
        # The optimizer maps its state onto the model's shards, so it reads the model entries.
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=metadata)
    if with_rng:
        state["rng_state"] = _rng_state_object()
    return state


def _model_keys(model_chunks) -> list[str]:
    if len(model_chunks) == 1:
        return ["model"]
    return [f"model{i}" for i in range(len(model_chunks))]


def _unwrap_ddp(chunk):
    # megatron DDP forwards load_state_dict to its module but has no sharded_state_dict.
    return chunk.module if isinstance(chunk, DistributedDataParallel) else chunk


def _parallel_sizes() -> dict:
    return {
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
        "pp": parallel_state.get_pipeline_model_parallel_world_size(),
        "dp": parallel_state.get_data_parallel_world_size(with_context_parallel=True),
        "ep": parallel_state.get_expert_model_parallel_world_size(),
    }


def _check_topology(saved: dict, load_optim: bool, load_rng: bool, fully_reshardable: bool) -> None:
    current = _parallel_sizes()

    def differs(keys):
        return any(saved[k] != current[k] for k in keys)

    if load_optim and fully_reshardable and differs(("ep",)):
        raise ValueError(f"the checkpoint's optimizer state was saved with parallel sizes {saved}, this run "
                         f"has {current} (with --dist-ckpt-optim-fully-reshardable DP, TP and PP may change, not EP: "
                         f"megatron-core's expert optimizer state does not reshard); pass --no-load-optim to load "
                         f"only the weights")
    if load_optim and not fully_reshardable and differs(("tp", "pp", "ep")):
        raise ValueError(f"the checkpoint's optimizer state was saved with parallel sizes {saved}, this run "
                         f"has {current} (only DP may change: save with --dist-ckpt-optim-fully-reshardable to "
                         f"change TP or PP too); pass --no-load-optim to load only the weights")
    if load_rng and differs(("tp", "pp", "dp")):
        raise ValueError(f"the checkpoint's RNG states were saved with parallel sizes {saved}, this run "
                         f"has {current}; pass --no-load-rng to keep this run's seeded RNG")


def _plain_args(args) -> dict:
    plain = (type(None), bool, int, float, str)

    def is_plain(value):
        if isinstance(value, (list, tuple)):
            return all(isinstance(v, plain) for v in value)
        return isinstance(value, plain)

    return {k: v for k, v in sorted(vars(args).items()) if k not in RANK_LOCAL_ARGS and is_plain(v)}


def _rng_state_object() -> ShardedObject:
    """This rank's RNG states, one entry of a (pp, tp, dp) grid of checkpoint objects."""
    sizes = _parallel_sizes()
    ranks = (
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_data_parallel_rank(with_context_parallel=True),
    )
    shape = (sizes["pp"], sizes["tp"], sizes["dp"])
    return ShardedObject("rng_state", _capture_rng_state(), shape, ranks, replica_id=0)


def _capture_rng_state() -> dict:
    # numpy's state is stored as plain Python values: checkpoints are read with torch.load(weights_only).
    name, key, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    return {
        "random": random.getstate(),
        "numpy": (name, key.tolist(), pos, has_gauss, cached_gaussian),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _restore_rng_state(state: dict) -> None:
    random.setstate(state["random"])
    name, key, pos, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((name, np.array(key, dtype=np.uint32), pos, has_gauss, cached_gaussian))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _async_strategy(args) -> dict:
    """megatron-core 0.17 and later take the background writer as ``async_strategy``: --async-strategy (validate_args
    fills in the default); 0.16 has only its own."""
    return {"async_strategy": args.async_strategy} if mcore_at_least("0.17") else {}


def async_calls_queue(args):
    """The queue that runs and finalizes --async-save's requests: the one of the writer ``_async_strategy`` picks."""
    if mcore_at_least("0.17"):
        from megatron.core.dist_checkpointing.strategies.torch import get_async_strategy

        queue_class = get_async_strategy(args.async_strategy)[1]["AsyncCallsQueue"]
    else:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue as queue_class
    return queue_class(persistent=args.use_persistent_ckpt_worker)


def _publish(root: str, staging_dir: str, final_dir: str, iteration: int, retain_interval: int | None = None) -> None:
    """Rank 0: move the finished checkpoint into place, then point the tracker at it. ``retain_interval``
    (--save-retain-interval): then delete the checkpoint the tracker named before, unless its iteration is a multiple
    of it or it is a symbolic link, as Megatron-LM does: only once the new one is published."""
    previous = _check_not_behind_tracker(root, iteration)
    if os.path.exists(final_dir):  # re-saving an iteration (e.g. after resuming from it)
        shutil.rmtree(final_dir)
    os.replace(staging_dir, final_dir)
    tracker = os.path.join(root, TRACKER_FILENAME)
    with open(tracker + ".tmp", "w") as f:
        f.write(str(iteration))
    os.replace(tracker + ".tmp", tracker)
    if retain_interval and previous is not None and previous != iteration and previous % retain_interval:
        stale = checkpoint_dir(root, previous)
        if os.path.isdir(stale) and not os.path.islink(stale):
            shutil.rmtree(stale)
