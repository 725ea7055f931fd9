"""The training loop on megatron-core: ``pretrain`` builds everything, then every iteration runs the
pipeline schedule's forward-backward over the micro-batches, the optimizer and LR steps, and writes
one metrics record; evaluation and checkpoints happen at their intervals.

Loss: each micro-batch returns (sum of masked token losses, token count); megatron-core divides by
both for the gradient, and the reported loss is the token-weighted mean over the global batch
(all micro-batches of all DP ranks), summed in float64 on the last pipeline stage. With
--check-for-nan-in-loss-and-grad (on by default, as in Megatron-LM) each micro-batch's loss, and in megatron-core's
DDP each bucket's gradient norm, is checked for NaN and Inf on its own rank before any reduction.
"""

import contextlib
import gc
import itertools
import logging
import os
import signal
import time
from functools import partial

import torch

from compression.timing import default_device
from megatron.hooks.lifecycle import Compression
from megatron.training import metrics
from megatron.training.arguments import parse_args, set_padded_vocab_size, validate_args
from megatron.training.batch_schedule import batch_size_at
from megatron.training.initialize import initialize_megatron, records_memory_history
from megatron.training.lifetime import exit_with_launcher
from megatron.training.model import setup_model_and_optimizer
from megatron.training.profiling import IterationProfiler

AUX_LOSS_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}
SPIKY_LOSS_FACTOR = 10  # --check-for-spiky-loss: Megatron-LM's pretrain_gpt.py
logger = logging.getLogger(__name__)


def get_batch(data_iterator):
    """Every stage consumes a batch (keeps the per-chunk iterators aligned); the first stage uses the
    tokens, the last the labels and loss mask."""
    batch = next(data_iterator)
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    return {key: value.to(device, non_blocking=True) for key, value in batch.items() if value is not None}


def check_loss(args, loss_sum) -> None:
    """--check-for-nan-in-loss-and-grad and --check-for-spiky-loss on one micro-batch's loss, before the DP
    reduction so that the error names this rank (Megatron-LM's checks, through megatron-core's rerun state
    machine)."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    machine = get_rerun_state_machine()
    if args.check_for_nan_in_loss_and_grad:
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            machine.validate_result(result=loss_sum, rejection_func=reject, tolerance=0.0, fatal=True,
                                    message=f"found {what} in local forward loss calculation")
    if args.check_for_spiky_loss:
        is_spike = partial(machine.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR, context="loss")
        machine.validate_result(result=loss_sum, rejection_func=is_spike, message="Spiky loss", tolerance=0.0,
                                fatal=False)


def loss_func(args, loss_mask, output_tensor):
    losses = output_tensor.float().view(-1)
    loss_mask = loss_mask.float().view(-1)
    loss_sum = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().to(torch.int)
    check_loss(args, loss_sum)
    return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach(), num_tokens.float()])}


def forward_step(data_iterator, model, *, args):
    batch = get_batch(data_iterator)
    output_tensor = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output_tensor, partial(loss_func, args, batch["loss_mask"])


def _reports_loss() -> bool:
    """One rank per DP replica holds its losses for the log: the last PP stage's TP and CP rank 0."""
    from megatron.core import parallel_state

    return (parallel_state.is_pipeline_last_stage(ignore_virtual=True)
            and parallel_state.get_tensor_model_parallel_rank() == 0
            and parallel_state.get_context_parallel_rank() == 0)


def global_mean_loss(losses_reduced) -> float:
    """Token-weighted mean loss over all micro-batches and DP ranks, identical on every rank.
    Only one rank per DP replica contributes, so one world all-reduce sums exactly the DP replicas."""
    totals = torch.zeros(2, dtype=torch.float64, device=default_device())
    if _reports_loss():
        for item in losses_reduced:
            totals += item["lm loss"].detach().to(totals.device, torch.float64)
    torch.distributed.all_reduce(totals)
    return (totals[0] / totals[1].clamp(min=1)).item()


def wire_config_hooks(config, ddp_chunks, optimizer, args) -> None:
    """The schedule's callbacks, as Megatron-LM sets them: loss scaling, DDP grad-sync control for
    overlapped reduction, param-gather dispatch for overlapped all-gather, and grad finalization."""
    from megatron.core.distributed import finalize_model_grads

    def one_or_list(functions):
        return functions[0] if len(functions) == 1 else functions

    config.grad_scale_func = optimizer.scale_loss
    if args.overlap_grad_reduce:
        config.no_sync_func = one_or_list([chunk.no_sync for chunk in ddp_chunks])
        config.grad_sync_func = one_or_list([chunk.start_grad_sync for chunk in ddp_chunks])
    if args.overlap_param_gather and args.align_param_gather:
        config.param_sync_func = one_or_list([chunk.start_param_sync for chunk in ddp_chunks])
    config.finalize_model_grads_func = finalize_model_grads


def run_schedule(args, ddp_chunks, data_iterators, forward_only: bool, num_microbatches: int):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    forward_backward = get_forward_backward_func()
    return forward_backward(
        forward_step_func=partial(forward_step, args=args),
        data_iterator=data_iterators if len(data_iterators) > 1 else data_iterators[0],
        model=ddp_chunks, num_microbatches=num_microbatches, seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size, decoder_seq_length=args.seq_length, forward_only=forward_only,
    )


def empty_unused_memory(args, level: int) -> None:
    """--empty-unused-memory-level (Megatron-LM's): hand the caching allocator's free blocks back to the device."""
    if args.empty_unused_memory_level >= level and torch.cuda.is_available():
        torch.cuda.empty_cache()


def follow_batch_size(args, batch_size: int) -> int:
    """Set megatron-core's micro-batch calculator to ``batch_size`` where it changes (logged on rank 0) and return its
    micro-batches per DP rank."""
    from megatron.core.num_microbatches_calculator import (get_current_global_batch_size, get_num_microbatches,
                                                           reconfigure_num_microbatches_calculator)

    if batch_size != get_current_global_batch_size():
        if args.rank == 0:
            logger.info(f"setting the global batch size to {batch_size} after {args.consumed_train_samples} samples")
        reconfigure_num_microbatches_calculator(args.rank, None, batch_size, args.micro_batch_size,
                                                args.data_parallel_size)
    return get_num_microbatches()


def train_step(args, ddp_chunks, optimizer, scheduler, data_iterators) -> dict:
    """One iteration at the global batch size of the run's schedule after ``args.consumed_train_samples``
    (``batch_schedule``), which megatron-core's micro-batch calculator is set to as well."""
    batch_size = batch_size_at(args.batch_steps, args.consumed_train_samples)
    num_microbatches = follow_batch_size(args, batch_size)
    timers = ddp_chunks[0].config.timers  # --timing-log-level's (model.setup_model_and_optimizer)
    for chunk in ddp_chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses_reduced = run_schedule(args, ddp_chunks, data_iterators, forward_only=False,
                                  num_microbatches=num_microbatches)
    empty_unused_memory(args, level=1)
    timers("optimizer", log_level=1).start(barrier=True)
    update_successful, grad_norm, num_zeros_in_grad = optimizer.step()
    timers("optimizer").stop()
    if update_successful:
        scheduler.step(increment=batch_size)
    empty_unused_memory(args, level=2)
    return {"loss": global_mean_loss(losses_reduced), "grad_norm": grad_norm, "num_zeros_in_grad": num_zeros_in_grad,
            "skipped": not update_successful, "global_batch_size": batch_size, "num_microbatches": num_microbatches}


def evaluate(args, ddp_chunks, data_iterators, validation: bool = True) -> float:
    """Mean loss over --eval-iters batches of --eval-global-batch-size samples (during a --rampup-batch-size ramp too,
    as Megatron-LM evaluates) of ``data_iterators``' split (the validation split's samples counted in
    ``args.consumed_valid_samples``, where a resume continues it)."""
    for chunk in ddp_chunks:
        chunk.eval()
    total = []
    with torch.no_grad():
        for _ in range(args.eval_iters):
            total += run_schedule(args, ddp_chunks, data_iterators, forward_only=True,
                                  num_microbatches=args.eval_micro_batches)
    for chunk in ddp_chunks:
        chunk.train()
    if validation:
        args.consumed_valid_samples += args.eval_iters * args.eval_global_batch_size
    return global_mean_loss(total)


def final_evaluation(args, ddp_chunks, valid_iters, test_iters, iteration: int) -> None:
    """Megatron-LM's end of a completed run (and all of a --skip-train one): the validation and the test split
    evaluated, --eval-iters batches each, and logged as Megatron-LM logs them."""
    if not args.eval_iters:
        return
    for name, iterators in (("validation", valid_iters), ("test", test_iters)):
        if iterators[0] is None:  # an empty split (its weight 0 in --split)
            continue
        loss = evaluate(args, ddp_chunks, iterators, validation=name == "validation")
        if args.rank == 0:
            print(metrics.final_evaluation_line(iteration, name, loss), flush=True)


class _ScalarCollector:
    """Stands in for the TensorBoard writer of megatron-core's ``track_moe_metrics``: keeps what it logs."""

    def __init__(self):
        self.scalars = {}

    def add_scalar(self, name, value, iteration):
        self.scalars[name] = float(value)


def moe_metrics(args, num_microbatches: int) -> dict:
    """This iteration's MoE losses from megatron-core's tracker, as Megatron-LM logs them: the mean per MoE layer of
    the load-balancing loss (``moe_aux_loss``) and of the z-loss (``moe_z_loss``), and with --moe-per-layer-logging
    every layer's value (``moe_per_layer``: loss name -> one value per layer, 0 for dense layers)."""
    if args.num_experts is None:
        return {}
    keys = {}  # tracker name -> record key
    balancing = AUX_LOSS_NAMES.get(args.moe_router_load_balancing_type)
    if balancing is not None and args.moe_aux_loss_coeff != 0:
        keys[balancing] = "moe_aux_loss"
    if args.moe_z_loss_coeff is not None:
        keys["z_loss"] = "moe_z_loss"
    if not keys:
        return {}
    from megatron.core.transformer.moe.moe_utils import track_moe_metrics

    writer = _ScalarCollector()
    track_moe_metrics(loss_scale=1.0 / num_microbatches, iteration=0, writer=writer,
                      per_layer_logging=args.moe_per_layer_logging, force_initialize=True, track_names=list(keys),
                      num_layers=args.num_layers, moe_layer_freq=args.moe_layer_freq)
    record = {key: writer.scalars[name] for name, key in keys.items()}
    if args.moe_per_layer_logging:
        record["moe_per_layer"] = {name: [writer.scalars[f"moe/{name}_layer_{i}"] for i in range(args.num_layers)]
                                   for name in keys}
    return record


def mtp_metrics(args, num_microbatches: int) -> dict:
    """This iteration's multi-token prediction losses from megatron-core's tracker, as Megatron-LM logs them
    (``mtp_1 loss``, ...): ``mtp_loss``, one value per MTP layer, averaged over the micro-batches and DP replicas.
    megatron-core's ``track_mtp_metrics`` reduces them over DP on the last stage (and clears its tracker); one world
    all-reduce brings them to the rank that writes the record."""
    if args.mtp_num_layers is None:
        return {}
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    writer = _ScalarCollector()
    MTPLossLoggingHelper.track_mtp_metrics(loss_scale=1.0 / num_microbatches, iteration=0, writer=writer)
    totals = torch.zeros(args.mtp_num_layers + 1, dtype=torch.float64, device=default_device())
    if _reports_loss() and writer.scalars:
        totals[:-1] = torch.tensor([writer.scalars[f"mtp_{i + 1} loss"] for i in range(args.mtp_num_layers)])
        totals[-1] = 1
    torch.distributed.all_reduce(totals)
    return {"mtp_loss": (totals[:-1] / totals[-1].clamp(min=1)).tolist()}


def split_per_chunk(iterator, num_chunks: int) -> list:
    """The interleaved schedule pulls each micro-batch once per model chunk: give every chunk its own
    view of one stream (itertools.tee buffers only the micro-batches in flight)."""
    if iterator is None:
        return [None] * num_chunks
    return list(itertools.tee(iterator, num_chunks)) if num_chunks > 1 else [iterator]


@contextlib.contextmanager
def params_in_sync(args, ddp_chunks):
    """With overlapped param gathers the model params may be stale until the next forward: finish the gather first,
    and gather again from the next forward on (Megatron-LM, before a save or a weight-hash check)."""
    if args.overlap_param_gather:
        for chunk in ddp_chunks:
            chunk.disable_forward_pre_hook(param_sync=True)
    yield
    if args.overlap_param_gather:
        for chunk in ddp_chunks:
            chunk.enable_forward_pre_hook()


def check_weight_hashes(args, ddp_chunks, iteration: int) -> None:
    """--check-weight-hash-across-dp-replicas-interval: every data-parallel replica holds the same weights
    (megatron-core hashes each parameter and compares the hashes over the DP and expert-DP groups)."""
    from megatron.core.utils import check_param_hashes_across_dp_replicas

    with params_in_sync(args, ddp_chunks):
        same = check_param_hashes_across_dp_replicas(ddp_chunks, cross_check=True)
    if not same:  # the same answer on every rank: each compared every replica's hashes
        raise RuntimeError(f"after iteration {iteration} the data-parallel replicas hold different weights "
                           f"(--check-weight-hash-across-dp-replicas-interval)")
    logger.info("weight hashes match across data-parallel replicas after %d iterations", iteration)


class Saver:
    """Saves the training state to --save: keeps megatron-core's save plan across saves (reused with
    --ckpt-assume-constant-structure) and with --log-progress appends each save to progress.txt. With --async-save
    the saves are written in the background: ``finalize`` publishes those every rank has finished (each iteration,
    without waiting; before the run exits, waiting for all)."""

    def __init__(self, args, start_time: float):
        from megatron.training.checkpointing import async_calls_queue
        from megatron.training.progress import ProgressLog

        self.args = args
        self.context = {}
        self.progress = ProgressLog(args, start_time)
        self.async_queue = async_calls_queue(args) if args.async_save else None

    def save(self, iteration, ddp_chunks, optimizer, scheduler, non_persistent: bool = False) -> None:
        from megatron.training.checkpointing import non_persistent_root, save_checkpoint

        start = time.perf_counter()
        where = non_persistent_root(self.args, self.args.save) if non_persistent else self.args.save
        with params_in_sync(self.args, ddp_chunks):
            request = save_checkpoint(self.args, iteration, ddp_chunks, optimizer, scheduler,
                                      self.args.num_floating_point_operations_so_far, context=self.context,
                                      non_persistent=non_persistent)
        if request is None:
            logger.info(f"saved checkpoint of iteration {iteration} to {where} in {time.perf_counter() - start:.2f} s")
            self.progress.checkpoint_saved(iteration)
            return
        request.add_finalize_fn(lambda: self._published(iteration, where, start))
        self.async_queue.schedule_async_request(request)  # the writer takes its copy of the state here
        logger.info(f"checkpoint of iteration {iteration} handed to the background writer in "
                    f"{time.perf_counter() - start:.2f} s")

    def _published(self, iteration: int, where: str, start: float) -> None:
        logger.info(f"saved checkpoint of iteration {iteration} to {where} (in the background, "
                    f"published {time.perf_counter() - start:.2f} s after the save began)")
        self.progress.checkpoint_saved(iteration)

    def finalize(self, blocking: bool) -> None:
        """Publish the background saves that every rank has finished (collective: call on every rank)."""
        if self.async_queue is not None and self.async_queue.get_num_unfinalized_calls():
            self.async_queue.maybe_finalize_async_calls(blocking=blocking)

    def close(self) -> None:
        """Wait for every background save, publish it and stop the writer; before the process group goes (the
        persistent writer's shutdown uses it)."""
        self.finalize(blocking=True)
        if self.async_queue is not None:
            self.async_queue.close()


def load(args, ddp_chunks, optimizer, scheduler, compression) -> int:
    from megatron.training.checkpointing import load_checkpoint

    from megatron.hooks import fused_ops

    iteration = load_checkpoint(args, ddp_chunks, optimizer, scheduler)
    fused_ops.fuse_adam(optimizer)  # the loaded groups' settings are the saved ones, the steps on the host
    compression.after_load()  # parameters were rewritten: next gathers are keyframes
    return iteration


def iteration_record(args, iteration, step, iter_time, optimizer) -> dict:
    batch_size = step["global_batch_size"]
    grad_norm = step["grad_norm"]
    record = {
        "iteration": iteration, "consumed_samples": args.consumed_train_samples, "global_batch_size": batch_size,
        "loss": step["loss"], "lr": optimizer.param_groups[0]["lr"],
        "grad_norm": None if grad_norm is None else float(grad_norm),
        "iter_time_s": iter_time, "tokens_per_s": batch_size * args.seq_length / iter_time,
        "tflops_per_gpu": metrics.gpt_flops_per_iteration(args, batch_size) / iter_time / args.world_size / 1e12,
        "skipped": step["skipped"],
    }
    if args.log_num_zeros_in_grad:  # None when the step was skipped (an fp16 overflow)
        zeros = step["num_zeros_in_grad"]
        record["num_zeros_in_grad"] = None if zeros is None else int(zeros)
    if args.log_loss_scale_to_tensorboard:
        record["loss_scale"] = optimizer.get_loss_scale().item()
    if args.log_world_size_to_tensorboard:
        record["world_size"] = args.world_size
    if args.log_memory_to_tensorboard:
        record.update(metrics.cuda_memory_stats())
    return record


def evaluation_record(args, ddp_chunks, valid_iters) -> dict:
    loss = evaluate(args, ddp_chunks, valid_iters)
    if not args.log_validation_ppl_to_tensorboard:
        return {"eval_loss": loss}
    return {"eval_loss": loss, "eval_ppl": metrics.perplexity(loss)}


def dump_memory_snapshot(args) -> None:
    """--record-memory-history: this rank's CUDA allocator history, to --memory-snapshot-path suffixed _RANK."""
    if not records_memory_history(args):
        return
    base, extension = os.path.splitext(args.memory_snapshot_path)
    torch.cuda.memory._dump_snapshot(f"{base}_{args.rank}{extension}")


class ExitSignal:
    """--exit-signal-handler (Megatron-LM's): on --exit-signal (SIGTERM: what SLURM sends before a job's time limit
    or a preemption) only remember it; the loop saves and stops at the end of the iteration."""

    def __init__(self, args):
        self.received = False
        if args.exit_signal_handler:
            signal.signal(getattr(signal, args.exit_signal), self._receive)

    def _receive(self, signum, frame):
        self.received = True


def exit_requested(args, iteration: int, start_time: float, exit_signal: ExitSignal) -> bool:
    """--exit-interval, --exit-duration-in-mins, --exit-signal-handler: stop after this iteration. Clocks and
    signals differ between ranks, so they agree through one all-reduce (only when a duration or handler is set)."""
    if args.exit_interval and iteration % args.exit_interval == 0:
        return True
    if args.exit_duration_in_mins is None and not args.exit_signal_handler:
        return False
    timed_out = args.exit_duration_in_mins is not None and time.time() - start_time > 60 * args.exit_duration_in_mins
    over = torch.tensor([timed_out or exit_signal.received], dtype=torch.int32, device=default_device())
    torch.distributed.all_reduce(over, op=torch.distributed.ReduceOp.MAX)
    return bool(over.item())


def train(args, ddp_chunks, optimizer, scheduler, config, iterators, start_iteration: int,
          start_time: float, saver: Saver, compression) -> int:
    """Train from ``start_iteration`` to --train-iters, or to an exit that --exit-interval, --exit-duration-in-mins
    (counted from ``start_time``, a ``time.time()``) or --exit-signal-handler asks for. Returns the last iteration."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    train_iters, valid_iters = iterators
    wire_config_hooks(config, ddp_chunks, optimizer, args)
    writer = metrics.MetricsWriter(args)
    profiler = IterationProfiler(args)
    exit_signal = ExitSignal(args)
    if args.manual_gc:  # collections at the same iterations on every rank, not whenever one rank's heap says so
        gc.disable()
        gc.collect()
    iteration = start_iteration
    hash_interval = args.check_weight_hash_across_dp_replicas_interval
    if hash_interval:
        check_weight_hashes(args, ddp_chunks, iteration)
    while iteration < args.train_iters:
        compression.before_iteration(iteration + 1)
        profiler.before(iteration + 1)
        get_rerun_state_machine().current_iteration = iteration + 1  # the iteration its NaN errors name
        start = time.perf_counter()
        step = train_step(args, ddp_chunks, optimizer, scheduler, train_iters)
        iteration += 1
        args.consumed_train_samples += step["global_batch_size"]
        args.num_floating_point_operations_so_far += metrics.gpt_flops_per_iteration(args, step["global_batch_size"])
        iter_time = time.perf_counter() - start
        profiler.after(iteration)
        record = iteration_record(args, iteration, step, iter_time, optimizer)
        if args.log_params_norm:
            record["params_norm"] = metrics.params_l2_norm(ddp_chunks, args.bf16)
        record.update(compression.after_iteration(iteration, iter_time))
        record.update(metrics.reduce_telemetry())
        record.update(moe_metrics(args, step["num_microbatches"]))
        record.update(mtp_metrics(args, step["num_microbatches"]))
        if args.eval_interval and iteration % args.eval_interval == 0 and valid_iters[0] is not None:
            record.update(evaluation_record(args, ddp_chunks, valid_iters))
        if args.params_checksum_interval and iteration % args.params_checksum_interval == 0:
            record["params_checksum"] = metrics.params_checksum(ddp_chunks)
        if hash_interval and iteration % hash_interval == 0:
            check_weight_hashes(args, ddp_chunks, iteration)
        writer.write(record)
        if iteration % args.log_interval == 0:
            writer.log_timers(config.timers, iteration)
            dump_memory_snapshot(args)
        saver.finalize(blocking=False)
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            saver.save(iteration, ddp_chunks, optimizer, scheduler)
        elif args.non_persistent_save_interval and iteration % args.non_persistent_save_interval == 0:
            saver.save(iteration, ddp_chunks, optimizer, scheduler, non_persistent=True)
        if args.manual_gc and args.manual_gc_interval and iteration % args.manual_gc_interval == 0:
            gc.collect()
        if exit_requested(args, iteration, start_time, exit_signal):
            break
    writer.close()
    return iteration


def pretrain(args_defaults=None, extra_args_provider=None, model_type="gpt", argv=None) -> int:
    """Parse, initialize, build, (resume,) train, save. Returns the last iteration.
    ``args_defaults`` override flag defaults (CLI and --config still win); ``model_type`` 'moe'
    requires --num-experts."""
    from megatron.training.checkpointing import (check_save_keeps_newer_checkpoints, check_save_writable,
                                                 load_args_from_checkpoint)
    from megatron.training.data import build_train_valid_test_data_iterators
    from megatron.training.progress import log_job_start
    from megatron.training.tokenizer import build_tokenizer

    exit_with_launcher()  # a kill -9 of torchrun ends its workers too
    start_time = time.time()  # --exit-duration-in-mins counts start-up too (a job's time limit does)
    args = parse_args(argv, extra_args_provider, defaults=args_defaults)
    if args.use_checkpoint_args:
        load_args_from_checkpoint(args)
    validate_args(args)
    if model_type == "moe" and args.num_experts is None:
        raise ValueError("pretrain_moe.py trains a mixture of experts: add --num-experts N")
    initialize_megatron(args)
    check_save_writable(args)  # before the work that a failed first save would lose
    check_save_keeps_newer_checkpoints(args)
    log_job_start(args)
    tokenizer = build_tokenizer(args)
    set_padded_vocab_size(args, tokenizer.vocab_size)
    compression = Compression(args.compression)
    ddp_chunks, optimizer, scheduler, config = setup_model_and_optimizer(args, compression)
    loads = args.load is not None or args.pretrained_checkpoint is not None
    start = load(args, ddp_chunks, optimizer, scheduler, compression) if loads else 0
    saver = Saver(args, start_time)  # after the load: --log-progress counts this job's FLOPs from there
    train_iter, valid_iter, test_iter = build_train_valid_test_data_iterators(args, tokenizer)
    chunks = len(ddp_chunks)
    valid_iters = split_per_chunk(valid_iter, chunks)
    iteration = start
    if not args.skip_train:
        iteration = train(args, ddp_chunks, optimizer, scheduler, config,
                          (split_per_chunk(train_iter, chunks), valid_iters), start, start_time, saver, compression)
    # an exit before --train-iters saves here too, so the run can resume from where it stopped
    saved_by_interval = args.save_interval and iteration % args.save_interval == 0
    if args.save and iteration > start and not saved_by_interval:
        saver.save(iteration, ddp_chunks, optimizer, scheduler)
    saver.close()  # every background save published before the run ends
    if args.skip_train or iteration >= args.train_iters:  # not after an exit flag stopped the run
        final_evaluation(args, ddp_chunks, valid_iters, split_per_chunk(test_iter, chunks), iteration)
    compression.close()  # before destroy_process_group, which captured collectives would hang
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return iteration
