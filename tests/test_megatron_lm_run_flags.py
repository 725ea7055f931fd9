"""Megatron-LM's logging, checkpoint, data and run-control flags (their bad inputs are in test_arguments.py's
ERRORS list).

Fast checks run in this process (parsing, derived values, the uneven pipeline split, the progress log, the
choice of checkpoint to load, per-split data, the TensorBoard interval) or in one spawned process (the weight-decay
schedule and --apply-wd-to-qk-layernorm's parameter groups, the bf16 params norm, the NaN, spike and large-gradient
checks). Two 2-process runs of the real driver (pretrain_gpt.py):

- A: TP=2, fp32, with --log-params-norm --log-num-zeros-in-grad, the NaN check (on by default), a linear weight-decay
  schedule, level-1 timers, --log-progress, --padded-vocab-size and saves at iterations 2 and 4 with --no-save-optim
  --no-save-rng --ckpt-assume-constant-structure (the second save reuses the first one's plan). The logged params
  norm equals the norm of the checkpoint's weights read back on one process (same bits, summed in another order: rel
  1e-6), which checks that every TP-sharded weight counts once and every replicated one once.
- B: resumes A at TP=1 x DP=2 with the distributed optimizer, --use-checkpoint-args (no model-shape flags; A's padded
  vocabulary too), --no-load-optim, --ckpt-fully-parallel-load, --dist-ckpt-strictness raise_all,
  --ddp-average-in-collective and its own per-split data (--train-data-path / --valid-data-path), and saves with
  --no-ckpt-fully-parallel-save; its last params norm is its checkpoint's.
A reads its data through --data-args-path; both use small indexed datasets (--mock-data's indices of two million
samples take most of a run's time to build here). And --skip-train against the end-of-run evaluation of a TP=2 run,
and --rampup-batch-size / --step-batch-size-schedule (four DP=2 runs: the ramp, a constant batch, a resume in
mid-ramp, the same steps as a schedule).
"""

import importlib.util
import json
import logging
import math
import os
import re

import pytest
import torch

from dist_utils import launch_training, run_on_ranks
from test_parallel_training import GPT, assert_same_trajectory

from megatron.training.arguments import parse_args, validate_args

BASE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
        "--lr 1e-3 --train-iters 10 --mock-data --transformer-impl local")


def make(flags="", world_size=1):
    return validate_args(parse_args((BASE + " " + flags).split()), world_size=world_size, rank=0)


def test_megatron_lm_names_and_defaults():
    args = parse_args([])
    assert (args.log_params_norm, args.log_num_zeros_in_grad, args.log_progress) == (False, False, False)
    assert (args.tensorboard_log_interval, args.tensorboard_queue_size) == (1, 1000)
    assert args.log_loss_scale_to_tensorboard and not args.log_timers_to_tensorboard
    assert (args.timing_log_level, args.timing_log_option, args.memory_snapshot_path) == (0, "minmax", "snapshot.pickle")
    assert args.check_for_nan_in_loss_and_grad and not args.check_for_spiky_loss
    assert args.ckpt_fully_parallel_save and not args.ckpt_fully_parallel_load
    assert args.dist_ckpt_strictness == "assume_ok_unexpected" and args.weight_decay_incr_style == "constant"
    assert args.num_dataset_builder_threads == 1 and args.mmap_bin_files and args.align_param_gather
    assert args.data_parallel_sharding_strategy == "optim_grads_params"
    assert parse_args(["--ckpt-fully-parallel-save"]).ckpt_fully_parallel_save  # Megatron-LM's default, spelled
    spelled = parse_args("--no-save-optim --no-save-rng --no-load-optim --no-load-rng --no-ckpt-fully-parallel-save "
                         "--use-dist-ckpt --auto-detect-ckpt-format --no-mmap-bin-files "
                         "--no-check-for-nan-in-loss-and-grad --no-log-loss-scale-to-tensorboard "
                         "--no-align-param-gather --microbatch-group-size-per-virtual-pipeline-stage 3".split())
    assert spelled.no_save_optim and spelled.no_save_rng and spelled.no_load_optim and spelled.no_load_rng
    assert not spelled.ckpt_fully_parallel_save and not spelled.mmap_bin_files
    assert not spelled.check_for_nan_in_loss_and_grad and not spelled.log_loss_scale_to_tensorboard
    assert not spelled.align_param_gather and spelled.microbatch_group_size_per_vp_stage == 3
    assert parse_args(["--mmap-bin-files", "--check-for-nan-in-loss-and-grad"]).mmap_bin_files


def test_yaml_config_takes_the_new_flags(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("log-params-norm: true\nno-save-optim: true\nno-check-for-nan-in-loss-and-grad: true\n"
                      "microbatch-group-size-per-virtual-pipeline-stage: 2\nno-ckpt-fully-parallel-save: true\n"
                      "train-data-path: [a, b]\n")
    args = parse_args(["--config", str(config)])
    assert args.log_params_norm and args.no_save_optim and not args.check_for_nan_in_loss_and_grad
    assert args.microbatch_group_size_per_vp_stage == 2 and not args.ckpt_fully_parallel_save
    assert args.train_data_path == ["a", "b"]


def test_derived_run_control(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    args = make("--local-rank 3")
    assert (args.distributed_backend, args.local_rank, args.dataloader_type) == ("gloo", 3, "single")
    assert (args.start_weight_decay, args.end_weight_decay) == (0.01, 0.01)  # constant: --weight-decay
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert make("--local-rank 3").local_rank == 1  # torchrun's wins, as in Megatron-LM
    assert not make("--fp16").check_for_nan_in_loss_and_grad  # dynamic loss scaling expects overflows
    assert make("--fp16 --loss-scale 1024").check_for_nan_in_loss_and_grad
    wd = make("--weight-decay-incr-style cosine --start-weight-decay 0.0 --end-weight-decay 0.1")
    assert (wd.start_weight_decay, wd.end_weight_decay) == (0.0, 0.1)
    interleaved = ("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 --global-batch-size 4 "
                   "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather")
    assert make(interleaved, world_size=2).align_param_gather
    assert not make(interleaved + " --no-align-param-gather", world_size=2).align_param_gather
    assert not make("--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather").align_param_gather
    with pytest.raises(ValueError, match="--distributed-backend nccl needs CUDA devices"):
        make("--distributed-backend nccl")
    for flag in ("--log-memory-to-tensorboard", "--record-memory-history"):
        with pytest.raises(ValueError, match=f"{flag} reads the CUDA caching allocator.*drop it on CPU"):
            make(flag)


def test_uneven_pipeline_split_reaches_megatron_core():
    """--decoder-first/last-pipeline-num-layers and --account-for-*-in-pipeline-split become megatron-core's
    TransformerConfig fields, whose layer counts and offsets per stage the model builder uses."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from megatron.training.model import core_transformer_config

    def layers_per_stage(flags, pp):
        """(first layer, layer count) of each pipeline stage of the 4-layer model."""
        config = core_transformer_config(make(f"--pipeline-model-parallel-size {pp} {flags}", world_size=pp))
        return [(get_transformer_layer_offset(config, None, rank), get_num_layers_to_build(config, None, rank))
                for rank in range(pp)]

    assert layers_per_stage("--decoder-first-pipeline-num-layers 1", 2) == [(0, 1), (1, 3)]
    assert layers_per_stage("--decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 1", 3) == [
        (0, 1), (1, 2), (3, 1)]
    # the embedding and the loss count as a layer each: 4 + 2 = 6 over 2 stages, 3 each
    assert layers_per_stage("--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split", 2) == [
        (0, 2), (2, 2)]
    args = make("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 --global-batch-size 12 "
                "--microbatch-group-size-per-virtual-pipeline-stage 3", world_size=2)
    assert core_transformer_config(args).microbatch_group_size_per_vp_stage == 3


def test_pipeline_layout_reaches_megatron_core():
    """--pipeline-model-parallel-layout: megatron-core's layout in TransformerConfig (virtual stages from its length,
    layer counts and offsets per stage from its letters); bad layouts and conflicting flags are errors naming it."""
    from megatron.core.transformer.enums import LayerType

    from megatron.training.model import core_transformer_config

    args = make("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Et|tt|t|L --global-batch-size 4",
                world_size=2)
    assert args.virtual_pipeline_model_parallel_size == 2
    layout = core_transformer_config(args).pipeline_model_parallel_layout
    # stages in the interleaved order: (rank 0, chunk 0), (rank 1, chunk 0), (rank 0, chunk 1), (rank 1, chunk 1)
    assert [layout.layout[rank][vp].count(LayerType.decoder) for vp in (0, 1) for rank in (0, 1)] == [1, 2, 1, 0]
    plain = make("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout E,t*3|tL", world_size=2)
    assert plain.virtual_pipeline_model_parallel_size is None
    for pp, flags, message in (
            (2, "--pipeline-model-parallel-layout Ettt|L", "Number of decoder layers 3"),
            (2, "--pipeline-model-parallel-layout Ett|tt|L", "must be divisible"),
            (2, "--pipeline-model-parallel-layout Ettt|tL --num-layers-per-virtual-pipeline-stage 1",
             "places every layer itself: drop --num-layers-per-virtual-pipeline-stage"),
            (2, "--pipeline-model-parallel-layout Ettt|tX", "Invalid layer character: X"),
            (4, "--pipeline-model-parallel-layout Ettt|m|L|t --mtp-num-layers 1", "The last layer must be loss")):
        with pytest.raises(ValueError, match=message):
            make(f"--pipeline-model-parallel-size {pp} " + flags, world_size=pp)
    with pytest.raises(ValueError, match="standalone MTP stage is not wired up here"):
        make("--pipeline-model-parallel-size 3 --pipeline-model-parallel-layout Etttt|m|L --mtp-num-layers 1",
             world_size=3)


@pytest.mark.slow
def test_pipeline_layout_matches_single_process(tmp_path):
    """GPT with a multi-token prediction layer at PP=2 under two layouts: 4 stages (2 virtual per rank; the last holds
    only the MTP layer and the loss) and 2 uneven ones; both follow the single-process run (test_parallel_training's
    bound)."""
    flags = GPT + " --mtp-num-layers 1 --position-embedding-type rope"
    reference = launch_training(tmp_path, "single", "pretrain_gpt.py", 1, flags)
    for name, layout in (("virtual", "Et|tt|t|mL"), ("uneven", "Ettt|tmL")):
        parallel = launch_training(tmp_path, name, "pretrain_gpt.py", 2,
                                   flags + f" --pipeline-model-parallel-size 2 --pipeline-model-parallel-layout {layout}")
        assert_same_trajectory(reference, parallel, ["loss", "grad_norm", "lr", "eval_loss", "mtp_loss"])


def _write_checkpoint_dir(root, iteration, files):
    directory = os.path.join(root, f"iter_{iteration:07d}")
    os.makedirs(directory)
    for name, text in files.items():
        with open(os.path.join(directory, name), "w") as f:
            f.write(text)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))
    return directory


TORCH_DIST = {"metadata.json": json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                           "common_backend": "torch", "common_backend_version": 1})}


def test_checkpoint_to_load(tmp_path):
    """--load's checkpoint resumes; an empty --load falls back to --pretrained-checkpoint as a fine-tuning start;
    --ckpt-step picks an iteration; a missing checkpoint is a fresh start or, with the flags that ask for one, an
    error; other formats are refused naming them."""
    from megatron.training.checkpointing import checkpoint_to_load

    load, pretrained, legacy = (str(tmp_path / name) for name in ("load", "pretrained", "legacy"))
    os.makedirs(load)
    base = "--num-layers 4"

    def pick(flags):
        return checkpoint_to_load(parse_args(f"{base} {flags}".split()))

    assert pick(f"--load {load}") is None
    with pytest.raises(ValueError, match="--exit-on-missing-checkpoint: no checkpoint under --load"):
        pick(f"--load {load} --exit-on-missing-checkpoint")
    pretrained_dir = _write_checkpoint_dir(pretrained, 7, TORCH_DIST)
    assert pick(f"--load {load} --pretrained-checkpoint {pretrained}") == (pretrained_dir, True)
    load_dir = _write_checkpoint_dir(load, 3, TORCH_DIST)
    assert pick(f"--load {load} --pretrained-checkpoint {pretrained}") == (load_dir, False)
    assert pick(f"--load {load} --finetune") == (load_dir, True)
    assert pick(f"--load {load} --pretrained-checkpoint {pretrained} --ckpt-step 7") == (pretrained_dir, True)
    with pytest.raises(ValueError, match="--ckpt-step 9: there is no iter_0000009 under --load"):
        pick(f"--load {load} --ckpt-step 9")
    with open(os.path.join(load, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("5")
    with pytest.raises(ValueError, match="names iteration 5, but .*iter_0000005 does not exist"):
        pick(f"--load {load}")
    _write_checkpoint_dir(legacy, 2, {"mp_rank_00": ""})
    with pytest.raises(ValueError, match="legacy torch format .*--ckpt-convert-format torch_dist"):
        pick(f"--load {legacy}")


def test_progress_log_cumulative_start(tmp_path):
    """--log-progress's cumulative throughput counts from the first start of the last run of jobs with this world
    size, and from the FLOPs saved before it."""
    from megatron.training.progress import cumulative_start

    def saved(flops):
        return (f"Saved checkpoint\tIteration: 1\tJob throughput: 1.0 TFLOP/s/GPU\tCumulative throughput: 1.0 "
                f"TFLOP/s/GPU\tFloating-point operations: {flops:.2e}\tTokens (in billions): 0.00")

    lines = [("2025-01-01 10:00:00", 8, "Starting job"), ("2025-01-01 10:30:00", 8, saved(1e15)),
             ("2025-01-01 11:00:00", 4, "Starting job"), ("2025-01-01 11:30:00", 4, saved(2e15)),
             ("2025-01-01 12:00:00", 8, "Starting job"), ("2025-01-01 12:30:00", 8, saved(3e15)),
             ("2025-01-01 13:00:00", 8, "Starting job")]
    path = tmp_path / "progress.txt"
    path.write_text("".join(f"{when}\tJob ID: 7\t# GPUs: {gpus}\t{what}\n" for when, gpus, what in lines))
    start, flops = cumulative_start(str(path), 8)
    assert (str(start), flops) == ("2025-01-01 12:00:00", 2e15)
    with pytest.raises(ValueError, match="records no 'Starting job' at world size 4"):  # 8 GPUs since
        cumulative_start(str(path), 4)


def test_per_split_data_and_data_args_files(tmp_path):
    """--train/valid/test-data-path (and the files --data-args-path and --per-split-data-args-path name) give
    megatron-core's blend_per_split: each split is built from its own prefixes, a split without any is not built."""
    import numpy as np

    from megatron.training import data
    from megatron.training.tokenizer import build_tokenizer

    rng = np.random.default_rng(0)
    for name, documents in (("train", 40), ("valid", 10)):
        data.write_documents(str(tmp_path / name), (rng.integers(1, 250, 50).tolist() for _ in range(documents)),
                             256, eod=0)
    common = (f"--tokenizer-type NullTokenizer --vocab-size 255 --eval-interval 5 --eval-iters 1 "
              f"--data-cache-path {tmp_path / 'cache'}").split()
    base = BASE.replace("--mock-data", "").split() + common
    args = validate_args(parse_args(base + ["--train-data-path", str(tmp_path / "train"), "--valid-data-path",
                                            "1", str(tmp_path / "valid")]), world_size=1, rank=0)
    assert data.blends(args) == (None, [([str(tmp_path / "train")], None), ([str(tmp_path / "valid")], [1.0]), None])
    train, valid, test = data.build_datasets(args, build_tokenizer(args))
    assert test is None and len(train) >= 20 and len(valid) >= 6
    assert (train.dataset_path, valid.dataset_path) == (str(tmp_path / "train"), str(tmp_path / "valid"))

    (tmp_path / "split.json").write_text(json.dumps({"train": f"0.3 {tmp_path}/a 0.7 {tmp_path}/b",
                                                     "valid": [str(tmp_path / "v")], "test": None}))
    (tmp_path / "data.txt").write_text(f"0.5 {tmp_path}/a\n0.5 {tmp_path}/b\n")
    per_split = parse_args(base + ["--per-split-data-args-path", str(tmp_path / "split.json")])
    assert data.blends(per_split) == (None, [([f"{tmp_path}/a", f"{tmp_path}/b"], [0.3, 0.7]),
                                             ([str(tmp_path / "v")], None), None])
    whole = parse_args(base + ["--data-args-path", str(tmp_path / "data.txt")])
    assert data.blends(whole) == (([f"{tmp_path}/a", f"{tmp_path}/b"], [0.5, 0.5]), None)


def test_tensorboard_interval_and_log_line(tmp_path):
    """--tensorboard-log-interval: scalars every N iterations (evaluations always); the log line shows Megatron-LM's
    loss scale, num zeros, params norm and validation PPL."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron.training import metrics
    from test_parallel_training import comm_totals

    args = make(f"--tensorboard-dir {tmp_path} --tensorboard-log-interval 2 --tensorboard-queue-size 5 "
                f"--log-interval 1")
    writer = metrics.MetricsWriter(args)
    for iteration in (1, 2, 3):
        record = {"iteration": iteration, "consumed_samples": 2 * iteration, "global_batch_size": 2, "loss": 5.0,
                  "lr": 1e-3, "grad_norm": 1.0, "iter_time_s": 0.1, "tokens_per_s": 1.0, "tflops_per_gpu": 0.0,
                  "comm": comm_totals(0), "comm_counters": {}, "loss_scale": 1.0, "num_zeros_in_grad": 7,
                  "params_norm": 12.5}
        if iteration == 3:
            record.update(eval_loss=2.0, eval_ppl=math.exp(2.0))
        writer.write(record)
    writer.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [event.step for event in events.Scalars("params_norm")] == [2]
    assert [event.step for event in events.Scalars("eval_ppl")] == [3]
    line = metrics.log_line(record, args)
    assert "lm loss: 5.000000E+00 | loss scale: 1.0 | grad norm: 1.0000 | num zeros: 7 | params norm: 12.500" in line
    assert "validation lm loss PPL: 7.389056E+00" in line


def test_perplexity_of_a_nan_loss_is_nan():
    """--no-check-for-nan-in-loss-and-grad lets a NaN loss through: its perplexity is NaN, not exp(20) (min(20, nan)
    is 20); a large loss is still capped at exp(20) and infinity too."""
    from megatron.training import metrics

    assert math.isnan(metrics.perplexity(math.nan))
    assert metrics.perplexity(25.0) == metrics.perplexity(math.inf) == math.exp(20)
    assert metrics.perplexity(2.0) == math.exp(2.0)
    assert "lm loss value: NAN | lm loss PPL: NAN" in metrics.final_evaluation_line(4, "validation", math.nan)


def _single_rank_checks():
    """The weight-decay schedule and its parameter groups, the bf16 params norm, and the loss and gradient checks on
    one rank."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    from megatron.training import metrics
    from megatron.training.arguments import set_padded_vocab_size
    from megatron.training.initialize import initialize_megatron
    from megatron.training.model import setup_model_and_optimizer
    from megatron.training.training import check_loss

    args = validate_args(parse_args((GPT + " --bf16 --use-distributed-optimizer --weight-decay-incr-style cosine "
                                     "--start-weight-decay 0.0 --end-weight-decay 0.1 --check-for-spiky-loss "
                                     "--check-for-large-grads --qk-layernorm --apply-wd-to-qk-layernorm").split()),
                         world_size=1, rank=0)
    initialize_megatron(args)
    set_padded_vocab_size(args, 255)
    ddp_chunks, optimizer, scheduler, _ = setup_model_and_optimizer(args)
    out = {"weight_decays": []}
    names = {id(param): name for name, param in ddp_chunks[0].named_parameters()}
    out["decayed_norms"] = sorted(  # the norm weights and biases of the groups with weight decay
        names[id(param)].split("layers.0.")[-1] for sub in getattr(optimizer, "chained_optimizers", [optimizer])
        for group, params in zip(sub.optimizer.param_groups, sub.model_float16_groups) if group["wd_mult"] == 1.0
        for param in params if "norm" in names[id(param)] and ".layers.0." in names[id(param)])
    for _ in range(args.train_iters):
        scheduler.step(increment=args.global_batch_size)
        out["weight_decays"].append(sorted({group["weight_decay"] for group in optimizer.param_groups}))

    main_params = [main for sub in getattr(optimizer, "chained_optimizers", [optimizer])
                   for group in sub.shard_fp32_from_float16_groups for main in group]
    for main in main_params:  # below bf16's resolution: the fp32 main params now differ from the model's
        main.add_(1e-4)
    out["params_norm"] = metrics.params_l2_norm(ddp_chunks, bf16=True)
    out["main_params_norm"] = torch.sqrt(sum(p.double().pow(2).sum() for p in main_params)).item()
    out["model_params_norm"] = torch.sqrt(sum(p.double().pow(2).sum() for p in ddp_chunks[0].parameters())).item()
    out["main_params_dtype"] = str(main_params[0].dtype)

    for value in ("nan", "inf"):
        try:
            check_loss(args, torch.tensor(float(value)))
        except RuntimeError as error:
            out[f"loss_{value}"] = str(error)
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("megatron.core.rerun_state_machine").addHandler(handler)
    for loss in [1.0] * 100 + [5.0, 50.0]:  # the max of the first 100, then 5x and 50x it
        check_loss(args, torch.tensor(loss))
    out["spike_warnings"] = [message for message in warnings if "Spiky loss" in message]

    chunk = ddp_chunks[0]
    out["ddp_checks_grads"] = chunk.ddp_config.check_for_nan_in_grad
    for value in [1.0] * 100 + [50.0]:  # a bucket's gradient norm: the first 100, then 50x their max
        chunk.buffers[0].grad_data.fill_(value)
        chunk.start_grad_sync()
    out["large_grad_warnings"] = [message for message in warnings if "unexpected large grads" in message]
    chunk.buffers[0].grad_data.fill_(float("nan"))
    get_rerun_state_machine().current_iteration = 7
    try:
        chunk.start_grad_sync()
    except RuntimeError as error:
        out["grad_nan"] = str(error)
    args.check_for_nan_in_loss_and_grad = False
    check_loss(args, torch.tensor(float("nan")))  # unchecked: no error
    return out


def test_weight_decay_schedule_params_norm_and_nan_checks():
    (out,) = run_on_ranks(_single_rank_checks, 1)
    # cosine from 0 to 0.1 over the 4 iterations; biases and norms have no weight decay
    expected = [0.05 * (math.cos(math.pi * (1 - k / 4)) + 1) for k in range(1, 5)]
    assert [decays[0] for decays in out["weight_decays"]] == [0.0] * 4
    assert [decays[1] for decays in out["weight_decays"]] == pytest.approx(expected, rel=1e-12)
    # bf16 with the distributed optimizer: the norm of the fp32 main parameters
    assert out["main_params_dtype"] == "torch.float32"
    assert out["params_norm"] == pytest.approx(out["main_params_norm"], rel=1e-6)
    assert out["params_norm"] != pytest.approx(out["model_params_norm"], rel=1e-6)
    assert "found NaN in local forward loss calculation" in out["loss_nan"]
    assert "found Inf in local forward loss calculation" in out["loss_inf"]
    assert len(out["spike_warnings"]) == 1 and "Unexpected result 50.0" in out["spike_warnings"][0]
    assert out["ddp_checks_grads"]
    assert len(out["large_grad_warnings"]) == 1 and "bucket #0" in out["large_grad_warnings"][0]
    # --apply-wd-to-qk-layernorm: of the norms, only the query and key norms get weight decay (megatron-core's rule)
    assert out["decayed_norms"] == [f"self_attention.{qk}_layernorm.{p}" for qk in "kq" for p in ("bias", "weight")]
    # megatron-core's report names the iteration (7 on 0.16, 8 on 0.19, which counts from 1) and the bucket
    assert re.search(r"iteration [78]:", out["grad_nan"]) and "found NaN in local grad norm for bucket #0" in out["grad_nan"]


def _checkpoint_norm(ckpt_dir, tmp_path) -> tuple[float, list[str]]:
    """The L2 norm of a torch_dist checkpoint's model weights, read back whole on this process, and its keys."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = tmp_path / (os.path.basename(ckpt_dir) + ".pt")
    dcp_to_torch_save(ckpt_dir, whole)
    state = torch.load(whole, weights_only=False)
    weights = [value for key, value in state.items()
               if torch.is_tensor(value) and value.is_floating_point() and not key.startswith("optimizer.")]
    return torch.sqrt(sum(w.double().pow(2).sum() for w in weights)).item(), sorted(state)


RUN_A = (GPT.replace("--mock-data", "--split 90,10,0") + " --tensor-model-parallel-size 2 --log-params-norm "
         "--log-num-zeros-in-grad --check-for-nan-in-loss-and-grad --weight-decay-incr-style linear "
         "--start-weight-decay 0.0 --end-weight-decay 0.1 --timing-log-level 1 --log-validation-ppl-to-tensorboard "
         "--save-interval 2 --no-save-optim --no-save-rng --ckpt-assume-constant-structure --log-progress "
         "--log-timers-to-tensorboard --log-world-size-to-tensorboard --padded-vocab-size 384")


def write_corpus(prefix, documents: int, seed: int) -> None:
    """A small indexed dataset of random documents of 40 tokens below the GPT runs' vocabulary of 255."""
    import numpy as np

    from megatron.training import data

    rng = np.random.default_rng(seed)
    data.write_documents(str(prefix), (rng.integers(1, 250, 40).tolist() for _ in range(documents)), 256, eod=0)


@pytest.fixture(scope="module")
def run_a(tmp_path_factory):
    """Run A, its data given through the file that --data-args-path names."""
    tmp_path = tmp_path_factory.mktemp("run_a")
    write_corpus(tmp_path / "corpus", 300, seed=0)
    (tmp_path / "data_args.txt").write_text(f"{tmp_path / 'corpus'}\n")
    save = tmp_path / "ckpt"
    flags = RUN_A + f" --data-args-path {tmp_path / 'data_args.txt'} --save {save} --tensorboard-dir {tmp_path / 'tb'}"
    return tmp_path, save, launch_training(tmp_path, "a", "pretrain_gpt.py", 2, flags)


@pytest.mark.slow
def test_logged_params_norm_equals_the_checkpoints(run_a):
    tmp_path, save, records = run_a
    assert [r["iteration"] for r in records] == [1, 2, 3, 4]
    for record in records:
        assert isinstance(record["num_zeros_in_grad"], int) and 0 <= record["num_zeros_in_grad"] < 10**6
        assert record["loss_scale"] == 1.0 and math.isfinite(record["loss"])
    assert records[1]["eval_ppl"] == pytest.approx(math.exp(records[1]["eval_loss"]), rel=1e-12)
    for iteration in (2, 4):  # the second save reused the first one's plan
        norm, keys = _checkpoint_norm(str(save / f"iter_{iteration:07d}"), tmp_path)
        assert records[iteration - 1]["params_norm"] == pytest.approx(norm, rel=1e-6)
        assert not any(key.startswith(("optimizer.", "rng_state")) for key in keys)  # --no-save-optim/--no-save-rng
    from megatron.core import dist_checkpointing

    # its own file (common.pt) on megatron-core 0.16, inside the torch_dist shards on 0.19
    common = dist_checkpointing.load_common_state_dict(save / "iter_0000004")
    assert "optimizer" not in common and "opt_param_scheduler" not in common
    assert common["num_floating_point_operations_so_far"] > 0
    progress = [line.split("\t") for line in (save / "progress.txt").read_text().splitlines()]
    assert [fields[2:4] for fields in progress] == [["# GPUs: 2", "Starting job"], ["# GPUs: 2", "Saved checkpoint"],
                                                    ["# GPUs: 2", "Saved checkpoint"]]
    last = progress[-1]
    assert last[4] == "Iteration: 4" and last[5].startswith("Job throughput: ") and last[8] == "Tokens (in billions): 0.00"
    assert float(last[7].removeprefix("Floating-point operations: ")) == pytest.approx(
        common["num_floating_point_operations_so_far"], rel=1e-2)
    rank0 = tmp_path / "a_logs" / "0"
    log = (rank0 / "stdout.log").read_text() + (rank0 / "stderr.log").read_text()
    assert "params norm:" in log and "num zeros:" in log
    assert "(min, max) time across ranks (ms):" in log and "optimizer ....." in log
    if importlib.util.find_spec("tensorboard") is not None:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(tmp_path / "tb"))
        events.Reload()
        assert {"params_norm", "num_zeros_in_grad", "loss_scale", "world_size", "eval_ppl", "forward-backward-time",
                "optimizer-time"} <= set(events.Tags()["scalars"])


@pytest.mark.slow
def test_resume_with_checkpoint_args_and_per_split_data(run_a, tmp_path):
    """A's model shape and tokenizer come from its checkpoint (--use-checkpoint-args, none given here but the
    vocabulary size NullTokenizer needs); the weights load at TP=1 x DP=2, read by the DP replicas in parts
    (--ckpt-fully-parallel-load), and hold exactly the model (--dist-ckpt-strictness raise_all); A saved no
    optimizer state (--no-load-optim says so too). B trains on its own per-split data, averages the DP gradients in
    the collective, and saves without spreading the writes over DP; its last params norm is its checkpoint's."""
    from megatron.training.checkpointing import load_args_from_checkpoint

    _, save, a_records = run_a
    write_corpus(tmp_path / "train", 60, seed=1)
    write_corpus(tmp_path / "valid", 30, seed=2)
    flags = (f"--use-checkpoint-args --load {save} --micro-batch-size 2 --global-batch-size 8 --lr 1e-3 "
             f"--train-iters 6 --vocab-size 255 --transformer-impl local --no-bias-gelu-fusion --no-bias-dropout-fusion "
             f"--train-data-path {tmp_path / 'train'} --valid-data-path {tmp_path / 'valid'} --eval-interval 2 "
             f"--eval-iters 1 --log-interval 1 --no-load-optim --use-distributed-optimizer --ckpt-fully-parallel-load "
             f"--dist-ckpt-strictness raise_all --ddp-average-in-collective --log-params-norm "
             f"--save {tmp_path / 'ckpt'} --no-ckpt-fully-parallel-save")
    given = parse_args((flags + " --num-layers 2").split())
    load_args_from_checkpoint(given)
    assert (given.num_layers, given.hidden_size, given.num_attention_heads, given.seq_length) == (2, 64, 4, 32)
    assert (given.tokenizer_type, given.hidden_dropout, given.untie_embeddings_and_output_weights) == (
        "NullTokenizer", 0.0, False)
    assert given.padded_vocab_size == 384  # A's (TP=1 would pad the 256 tokens to 256)

    records = launch_training(tmp_path, "b", "pretrain_gpt.py", 2, flags)
    assert [r["iteration"] for r in records] == [5, 6]
    assert records[0]["consumed_samples"] == a_records[-1]["consumed_samples"] + 8
    assert all(math.isfinite(r["loss"]) and r["params_norm"] > 0 for r in records) and "eval_loss" in records[1]
    norm, _ = _checkpoint_norm(str(tmp_path / "ckpt" / "iter_0000006"), tmp_path)
    assert records[-1]["params_norm"] == pytest.approx(norm, rel=1e-6)


def _final_evaluations(tmp_path, name) -> list[str]:
    stdout = (tmp_path / f"{name}_logs" / "0" / "stdout.log").read_text()
    return [line for line in stdout.splitlines() if line.startswith(" validation loss at iteration")]


@pytest.mark.slow
def test_skip_train_repeats_the_end_of_run_evaluation(tmp_path):
    """A completed run ends as Megatron-LM's does: --eval-iters batches of the validation and the test split
    evaluated and logged. --skip-train on its last checkpoint trains nothing and logs the same two losses to the
    bit (the same weights; the validation split continues where the checkpoint's consumed samples say, the test
    split starts at 0)."""
    flags = GPT + f" --tensor-model-parallel-size 2 --save {tmp_path / 'ckpt'} --save-interval 4"
    trained = launch_training(tmp_path, "trained", "pretrain_gpt.py", 2, flags)
    assert [r["iteration"] for r in trained] == [1, 2, 3, 4]
    evaluations = _final_evaluations(tmp_path, "trained")
    assert [line.split(" | ")[0] for line in evaluations] == [" validation loss at iteration 4 on validation set",
                                                              " validation loss at iteration 4 on test set"]
    assert launch_training(tmp_path, "skipped", "pretrain_gpt.py", 2,
                           flags + f" --load {tmp_path / 'ckpt'} --skip-train") == []
    assert _final_evaluations(tmp_path, "skipped") == evaluations
    assert not (tmp_path / "ckpt" / "iter_0000005").exists()


@pytest.mark.slow
def test_eval_global_batch_size_evaluates_the_same_samples(tmp_path):
    """--eval-global-batch-size 16 with --eval-iters 1 evaluates the 16 validation (and test) samples that 2
    iterations of the default batch of 8 do, in the same order: every evaluation logs the same loss to the bit, and
    training is untouched."""
    two_of_8 = launch_training(tmp_path, "two_of_8", "pretrain_gpt.py", 2, GPT + " --eval-iters 2")
    one_of_16 = launch_training(tmp_path, "one_of_16", "pretrain_gpt.py", 2,
                                GPT + " --eval-iters 1 --eval-global-batch-size 16")
    assert [r.get("eval_loss") for r in one_of_16] == [r.get("eval_loss") for r in two_of_8]
    assert [r["eval_loss"] is not None for r in one_of_16 if "eval_loss" in r] == [True, True]
    assert [r["loss"] for r in one_of_16] == [r["loss"] for r in two_of_8]
    assert _final_evaluations(tmp_path, "one_of_16") == _final_evaluations(tmp_path, "two_of_8")
    assert len(_final_evaluations(tmp_path, "two_of_8")) == 2


RAMPUP = (GPT.replace("--micro-batch-size 2", "--micro-batch-size 1").replace("--global-batch-size 8", "--global-batch-size 6")
          .replace("--train-iters 4", "--train-samples 40 --lr-decay-samples 40")
          .replace("--lr-warmup-iters 1", "--lr-warmup-samples 2"))


@pytest.mark.slow
def test_rampup_batch_size(tmp_path):
    """--rampup-batch-size 2 2 12 at DP=2, micro-batch 1, --global-batch-size 6, --train-samples 40: batches of 2
    up to 6 consumed samples, 4 up to 12 and 6 after, so the run has 9 iterations (the last batch that fits ends at
    38 samples). Its first three iterations repeat a run at a constant batch of 2 bit for bit (same samples in the
    same order, the LR schedule counted in samples), a resume from its mid-ramp checkpoint (iteration 4, batch 4)
    repeats the rest, batch sizes included, and --step-batch-size-schedule with the same steps (thresholds in
    tokens: 6 and 12 samples of 32) repeats the whole run."""
    ramp = launch_training(tmp_path, "ramp", "pretrain_gpt.py", 2,
                           RAMPUP + f" --rampup-batch-size 2 2 12 --save {tmp_path / 'ckpt'} --save-interval 4")
    assert [r["global_batch_size"] for r in ramp] == [2, 2, 2, 4, 4, 6, 6, 6, 6]
    assert [r["consumed_samples"] for r in ramp] == [2, 4, 6, 10, 14, 20, 26, 32, 38]
    stdout = (tmp_path / "ramp_logs" / "0" / "stdout.log").read_text()
    assert re.search(r"iteration +4/ +9 \|.*\| global batch size: +4 \|", stdout)
    constant = launch_training(tmp_path, "constant", "pretrain_gpt.py", 2,
                               RAMPUP.replace("--global-batch-size 6", "--global-batch-size 2") + " --exit-interval 3")
    assert [r["loss"] for r in constant] == [r["loss"] for r in ramp[:3]]
    assert [r["lr"] for r in constant] == [r["lr"] for r in ramp[:3]]
    resumed = launch_training(tmp_path, "resumed", "pretrain_gpt.py", 2,
                              RAMPUP + f" --rampup-batch-size 2 2 12 --load {tmp_path / 'ckpt'} --ckpt-step 4")
    keys = ("iteration", "global_batch_size", "consumed_samples", "loss", "grad_norm", "lr")
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in ramp[4:]]
    stepped = launch_training(tmp_path, "stepped", "pretrain_gpt.py", 2,
                              RAMPUP.replace("--global-batch-size 6", "--step-batch-size-schedule 0:2,192:4,384:6"))
    assert [[r[k] for k in keys] for r in stepped] == [[r[k] for k in keys] for r in ramp]


def test_batch_schedules():
    """The steps of a ramp, Megatron-LM's schedule syntax, the batch size at a sample count, and the iterations
    that fit in --train-samples (a batch may pass the next threshold: the step after it is then skipped)."""
    from megatron.training.batch_schedule import batch_size_at, iterations_in, parse_step_schedule, rampup_steps

    assert rampup_steps(16, 16, 5859375, 1536)[:3] == ((0, 16), (61678, 32), (123356, 48))
    assert rampup_steps(16, 16, 5859375, 1536)[-1] == (5859375, 1536) and rampup_steps(8, 8, 100, 8) == ((0, 8),)
    assert parse_step_schedule("0:768 250B:1536 500B:3072", 2048) == ((0, 768), (122070312, 1536), (244140625, 3072))
    assert parse_step_schedule("1.5k:4, 0:2", 1) == ((0, 2), (1500, 4))
    steps = ((0, 4), (10, 8), (14, 2), (100, 4))
    assert [batch_size_at(steps, c) for c in (0, 9, 10, 13, 14, 99, 100)] == [4, 4, 8, 8, 2, 2, 4]
    # 0 4 8 (batch 4) -> 12 (batch 8: passes 14) -> 20, 22, ..., 98 (batch 2) -> 100 (batch 4) -> 104, 108
    assert iterations_in(steps, 110) == 3 + 1 + 40 + 2 and iterations_in(((0, 4),), 30) == 7
    for text, message in (("8:4", "the first threshold must be 0"), ("0:4 x:8", "'X' is not a number"),
                          ("0:4 8", "is not THRESHOLD:BATCH_SIZE"), ("0:4 3:8", "two thresholds fall on the same"),
                          ("0:0", "batch sizes must be positive")):
        with pytest.raises(ValueError, match=message):
            parse_step_schedule(text, 4)


def test_batch_size_schedule_errors():
    """--rampup-batch-size's and --step-batch-size-schedule's bad inputs: Megatron-LM's sample-based rule, ramps that
    miss the global batch size, steps that are not whole micro-batches on every DP rank (the interleaved schedule's
    groups checked at every step), and a schedule beside --global-batch-size."""
    samples = BASE.replace("--train-iters 10", "--train-samples 64")
    cases = [
        (BASE + " --global-batch-size 16 --rampup-batch-size 4 4 16", 1, "changes the batch size with the samples "
                                                                           "consumed: train with --train-samples"),
        (samples + " --rampup-batch-size 4 4", 1, "takes three ints"),
        (samples + " --global-batch-size 16 --rampup-batch-size 0 4 16", 1, "START and INCREMENT must be positive"),
        (samples + " --global-batch-size 16 --rampup-batch-size 4 8 16", 1, "does not reach --global-batch-size 16"),
        (samples + " --global-batch-size 16 --rampup-batch-size 20 4 16", 1, "does not reach --global-batch-size 16"),
        (samples + " --global-batch-size 16 --rampup-batch-size 2 2 16", 2, "--rampup-batch-size: its batch size 2 is "
                                                                            "not a multiple of --micro-batch-size 2 x "
                                                                            "data-parallel size 2 = 4"),
        (samples + " --global-batch-size 16 --rampup-batch-size 2 2 16 --pipeline-model-parallel-size 2 "
                   "--num-layers-per-virtual-pipeline-stage 1", 2, "between PP=2 and the 1 micro-batches of an iteration"),
        (samples + " --global-batch-size 16 --step-batch-size-schedule 0:8", 1, "drop --global-batch-size"),
        (samples + " --step-batch-size-schedule 0:3,64:8", 1, "--step-batch-size-schedule: its batch size 3 is not"),
        (BASE + " --step-batch-size-schedule 0:4,64:8", 1, "--step-batch-size-schedule changes the batch size"),
    ]
    for flags, world_size, message in cases:
        with pytest.raises(ValueError) as error:
            validate_args(parse_args(flags.split()), world_size=world_size, rank=0)
        assert message in str(error.value), flags
    args = validate_args(parse_args((samples + " --global-batch-size 16 --rampup-batch-size 4 4 16").split()),
                         world_size=1, rank=0)
    assert args.rampup_batch_size == [4, 4, 16] and args.num_micro_batches == 8
    # batches of 4 to 8 samples, one of 8 (to 16: past the step to 12), then (64 - 16) / 16
    assert args.batch_steps == ((0, 4), (6, 8), (11, 12), (16, 16)) and args.train_iters == 2 + 1 + 3
    args = validate_args(parse_args((samples + " --step-batch-size-schedule 0:4,64:8").split()), world_size=1, rank=0)
    assert args.global_batch_size == 8 and args.batch_steps == ((0, 4), (2, 8)) and args.train_iters == 8


def _scheduler(max_lr, **flags):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=max_lr)
    return OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=max_lr, min_lr=0.0, lr_warmup_steps=0,
                                   lr_decay_steps=10, lr_decay_style="linear", start_wd=0.0, end_wd=0.0,
                                   wd_incr_steps=10, wd_incr_style="constant", **flags)


def test_schedule_on_load_follows_megatron_lm():
    """A resume whose LR schedule differs from the checkpoint's stops with the two flags named, unless one of
    them says which wins (Megatron-LM's defaults: neither, so they must agree); both at once is an error."""
    from megatron.training.checkpointing import _load_scheduler

    args = make("--override-opt_param-scheduler")
    assert args.override_opt_param_scheduler and not args.use_checkpoint_opt_param_scheduler
    assert make("--use-checkpoint-opt_param-scheduler").use_checkpoint_opt_param_scheduler
    with pytest.raises(ValueError, match="are exclusive: pick one"):
        make("--override-opt_param-scheduler --use-checkpoint-opt_param-scheduler")
    saved = _scheduler(1e-3).state_dict()
    same = _scheduler(1e-3, use_checkpoint_opt_param_scheduler=False)
    _load_scheduler(same, saved)
    with pytest.raises(ValueError, match="pass --override-opt_param-scheduler to use the command line's"):
        _load_scheduler(_scheduler(2e-3, use_checkpoint_opt_param_scheduler=False), saved)
    override = _scheduler(2e-3, use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True)
    _load_scheduler(override, saved)
    checkpoint = _scheduler(2e-3, use_checkpoint_opt_param_scheduler=True)
    _load_scheduler(checkpoint, saved)
    assert (override.max_lr, checkpoint.max_lr) == (2e-3, 1e-3)
