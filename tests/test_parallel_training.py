"""The parallel layouts are right, not merely running: per-iteration losses (and grad norms, eval
losses, MoE aux losses) of TP/PP/VP/DP/SP/EP runs match the single-process run of the same model on
the same data.

This holds because the driver initializes weights layout-independently (model.py) and every layout
consumes the same global batches in the same order. Runs are fp32 with dropout 0, so the only
differences are the order of floating-point reductions (TP all-reduce of partial matmul sums, SP
reduce-scatter, DP gradient averaging, float64 loss sums): a few fp32 ulps per step, compounded over
4 Adam steps. Measured: <= 2e-7 relative on the loss. RTOL = 1e-5 sits far above that rounding and far
below what a real bug does (a wrong shard, a missing gradient reduction or a misrouted pipeline
message changes the loss by >= 1e-3, e.g. megatron-core-cpu.md item 3).

Launch count is kept low (process start dominates on 2 cores): one 1-process GPT reference and one
8-process TP2 x PP2 (interleaved, 2 virtual stages) x DP2 run with the distributed optimizer and both
overlaps; one 1-process MoE reference and one 8-process TP2 + SP x PP2 (1F1B) x DP2 = EP2 MoE run
(expert-TP 1: gloo lacks the uneven all-gather that expert-TP 2 needs) with the distributed optimizer.
"""

import json
import os

import pytest

from dist_utils import launch_training

RTOL = 1e-5

GPT = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
       "--global-batch-size 8 --lr 1e-3 --lr-warmup-iters 1 --lr-decay-style cosine --train-iters 4 "
       "--mock-data --tokenizer-type NullTokenizer --vocab-size 255 --hidden-dropout 0 --attention-dropout 0 "
       "--no-bias-gelu-fusion --no-bias-dropout-fusion --transformer-impl local --log-interval 1 "
       "--eval-interval 2 --eval-iters 1")
MOE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
       "--global-batch-size 8 --lr 1e-3 --train-iters 4 --mock-data --tokenizer-type NullTokenizer "
       "--vocab-size 255 --hidden-dropout 0 --attention-dropout 0 --no-bias-gelu-fusion --no-bias-dropout-fusion "
       "--transformer-impl local --log-interval 1 --disable-bias-linear --num-experts 4 --moe-router-topk 2 "
       "--moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 0.01 --moe-ffn-hidden-size 64")


def comm_totals(value):
    from compression.telemetry import COMM_CLASSES

    return {c: {"raw_bytes": value, "sent_bytes": value} for c in COMM_CLASSES}


def assert_same_trajectory(reference, parallel, keys):
    assert [r["iteration"] for r in parallel] == [r["iteration"] for r in reference]
    for ref, par in zip(reference, parallel):
        for key in keys:
            assert (key in ref) == (key in par), key
            if key in ref:
                assert par[key] == pytest.approx(ref[key], rel=RTOL), (key, ref["iteration"])


@pytest.mark.slow
def test_gpt_tp_pp_interleaved_dp_matches_single_process(tmp_path):
    """TP=2 x PP=2 (2 virtual stages) x DP=2 against one process. The parallel run also scales gradients by the
    global token count (--calculate-per-token-loss: summed losses, one division after the DP reduction), which
    every micro-batch's equal token count makes the same arithmetic up to rounding."""
    reference = launch_training(tmp_path, "single", "pretrain_gpt.py", 1, GPT)
    parallel = launch_training(tmp_path, "tp2_pp2_vp2_dp2", "pretrain_gpt.py", 8,
                      GPT + " --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
                      "--num-layers-per-virtual-pipeline-stage 1 --use-distributed-optimizer "
                      "--overlap-grad-reduce --overlap-param-gather --params-checksum-interval 4 "
                      "--calculate-per-token-loss")
    assert len(reference) == 4
    assert_same_trajectory(reference, parallel, ["loss", "grad_norm", "lr", "eval_loss"])
    assert "eval_loss" in parallel[1] and "eval_loss" not in parallel[0]
    # Learning must happen (so equal trajectories are not trivially equal), and the metrics shape holds.
    assert parallel[-1]["loss"] < parallel[0]["loss"]
    last = parallel[-1]
    assert last["comm"] == comm_totals(0) and last["comm_counters"] == {}  # every class present; no compression
    assert len(last["params_checksum"]) == 64 and "params_checksum" not in parallel[0]
    assert last["consumed_samples"] == 32 and last["tokens_per_s"] > 0


@pytest.mark.slow
def test_activation_recompute_matches_plain_run(tmp_path):
    """Selective (--recompute-activations, Megatron-LM's shorthand) and full recompute at TP=2 + SP reproduce the
    plain run's losses and gradient norms bit for bit (no dropout): on CPU the recomputed forward runs inside
    backward, where the CPU shims must still apply (megatron/hooks/cpu.py)."""
    tp_sp = GPT + " --tensor-model-parallel-size 2 --sequence-parallel --bf16"
    plain = launch_training(tmp_path, "plain", "pretrain_gpt.py", 2, tp_sp)
    for name, flags in (("selective", "--recompute-activations"),
                        ("full", "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1")):
        recomputed = launch_training(tmp_path, name, "pretrain_gpt.py", 2, f"{tp_sp} {flags}")
        assert [(r["loss"], r["grad_norm"]) for r in recomputed] == [(r["loss"], r["grad_norm"]) for r in plain], name


@pytest.mark.slow
def test_moe_tp_sp_pp_ep_matches_single_process(tmp_path):
    # --deterministic-mode only changes kernel choices (index_add for the token scatter), not the math
    reference = launch_training(tmp_path, "moe_single", "pretrain_moe.py", 1, MOE + " --deterministic-mode")
    parallel = launch_training(tmp_path, "moe_tp2_sp_pp2_ep2", "pretrain_moe.py", 8,
                      MOE + " --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2 "
                      "--expert-model-parallel-size 2 --expert-tensor-parallel-size 1 --use-distributed-optimizer "
                      "--overlap-grad-reduce")
    assert_same_trajectory(reference, parallel, ["loss", "grad_norm", "moe_aux_loss"])
    assert parallel[-1]["loss"] < parallel[0]["loss"]


def test_flops_formula_and_metrics_record(tmp_path):
    """The FLOP count equals the closed form 72 B s L h^2 (1 + s/6h + V/12Lh) of Narayanan et al. for a
    standard GPT, and a metrics record round-trips its float loss bit-exactly through the JSONL file."""
    from megatron.training import metrics
    from megatron.training.arguments import parse_args, set_padded_vocab_size, validate_args

    args = validate_args(parse_args((GPT + f" --metrics-file {tmp_path / 'm.jsonl'}").split()), world_size=1, rank=0)
    assert set_padded_vocab_size(args, 255) == 256
    b, s, layers, h, v = args.global_batch_size, args.seq_length, args.num_layers, args.hidden_size, args.padded_vocab_size
    closed_form = 72 * b * s * layers * h * h * (1 + s / (6 * h) + v / (12 * layers * h))
    assert metrics.gpt_flops_per_iteration(args, args.global_batch_size) == pytest.approx(closed_form, rel=1e-12)

    comm = comm_totals(0)
    loss = 5.537488341331482 + 2 ** -50
    record = {"iteration": 1, "consumed_samples": 8, "global_batch_size": 8, "loss": loss, "lr": 1e-3,
              "grad_norm": 1.5, "iter_time_s": 0.1, "tokens_per_s": 2560.0, "tflops_per_gpu": 0.0, "comm": comm,
              "comm_counters": {}}
    writer = metrics.MetricsWriter(args)
    writer.write(record)
    writer.close()
    assert json.loads((tmp_path / "m.jsonl").read_text())["loss"] == loss
    assert "lm loss: 5.537488E+00" in metrics.log_line(record, args)


def test_tensorboard_sink(tmp_path):
    """--tensorboard-dir writes event files, or fails up front with the install command."""
    import importlib.util

    from megatron.training import metrics
    from megatron.training.arguments import parse_args, validate_args

    args = validate_args(parse_args((GPT + f" --tensorboard-dir {tmp_path / 'tb'}").split()), world_size=1, rank=0)
    if importlib.util.find_spec("tensorboard") is None:
        with pytest.raises(RuntimeError, match="pip install tensorboard"):
            metrics.MetricsWriter(args)
        return
    writer = metrics.MetricsWriter(args)
    comm = comm_totals(1)
    writer.write({"iteration": 1, "consumed_samples": 8, "global_batch_size": 8, "loss": 5.0, "lr": 1e-3,
                  "grad_norm": 1.0, "iter_time_s": 0.1, "tokens_per_s": 1.0, "tflops_per_gpu": 0.0, "comm": comm, "comm_counters": {}})
    writer.close()
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path / "tb"))


def test_wandb_sink(tmp_path, monkeypatch):
    """--wandb-project logs the record's scalars per iteration to a Weights & Biases run (here a stand-in module
    that records the calls), or fails up front with the install command."""
    import sys
    import types

    from megatron.training import metrics
    from megatron.training.arguments import parse_args, validate_args

    args = validate_args(parse_args((GPT + f" --wandb-project p --wandb-entity team --wandb-exp-name run1 "
                                          f"--wandb-save-dir {tmp_path}").split()), world_size=1, rank=0)
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(RuntimeError, match="pip install wandb"):
        metrics.MetricsWriter(args)

    calls = []

    class Run:
        def log(self, data, step):
            calls.append(("log", data, step))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs))
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    writer = metrics.MetricsWriter(args)
    writer.write({"iteration": 3, "consumed_samples": 24, "global_batch_size": 8, "loss": 5.0, "lr": 1e-3,
                  "grad_norm": 1.0, "iter_time_s": 0.1, "tokens_per_s": 1.0, "tflops_per_gpu": 0.0, "comm": comm_totals(1),
                  "comm_counters": {}})
    writer.close()
    (_, init_kwargs), (_, logged, step), finish = calls
    assert (init_kwargs["project"], init_kwargs["entity"], init_kwargs["name"], init_kwargs["dir"]) == (
        "p", "team", "run1", str(tmp_path))
    assert init_kwargs["config"]["num_layers"] == 4 and step == 3 and finish == ("finish",)
    assert logged["loss"] == 5.0 and logged["comm/tp/raw_bytes"] == 1


def _decoupled_lr_groups():
    from megatron.training.arguments import parse_args, set_padded_vocab_size, validate_args
    from megatron.training.initialize import initialize_megatron
    from megatron.training.model import setup_model_and_optimizer

    args = validate_args(parse_args((GPT + " --lr-decay-style linear --min-lr 1e-4 --decoupled-lr 5e-3 "
                                     "--decoupled-min-lr 5e-4").split()), world_size=1, rank=0)
    initialize_megatron(args)
    set_padded_vocab_size(args, 255)
    _, optimizer, scheduler, _ = setup_model_and_optimizer(args)
    lrs = []
    for _ in range(args.train_iters):  # warm-up to the peak, then linear decay to the minimum
        scheduler.step(increment=args.global_batch_size)
        lrs.append(sorted({(any(getattr(p, "is_embedding_or_output_parameter", False) for p in group["params"]),
                            group["lr"]) for group in optimizer.param_groups}))
    return lrs


def test_decoupled_lr_schedules_embedding_and_output_separately():
    """--decoupled-lr / --decoupled-min-lr (Megatron-LM's): the input embedding's and output layer's parameter groups
    follow their own schedule (warm-up to 5e-3, decay to 5e-4), the other groups --lr / --min-lr's."""
    from dist_utils import run_on_ranks

    (lrs,) = run_on_ranks(_decoupled_lr_groups, 1)
    peak, end = dict(lrs[0]), dict(lrs[-1])  # GPT: 1 warm-up iteration, 4 in all
    assert peak[True] == pytest.approx(5e-3) and peak[False] == pytest.approx(1e-3)
    assert end[True] == pytest.approx(5e-4) and end[False] == pytest.approx(1e-4)


def test_pytorch_profiler_range(tmp_path):
    """--profile --use-pytorch-profiler records exactly the iterations start..end-1 and writes the Chrome
    trace and the op table next to the metrics file, named after it; a bad range is refused naming the flags."""
    import torch

    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.profiling import IterationProfiler

    flags = f" --profile --use-pytorch-profiler --profile-step-start 2 --profile-step-end 3 --metrics-file {tmp_path / 'm.jsonl'}"
    profiler = IterationProfiler(validate_args(parse_args((GPT + flags).split()), world_size=1, rank=0))
    for iteration in (1, 2, 3):
        profiler.before(iteration)
        x = torch.ones(8, 8)
        for _ in range(iteration):  # iteration 2 runs exactly two matmuls
            x = torch.mm(x, x)
        profiler.after(iteration)
    table = (tmp_path / "m.profile_rank0.txt").read_text()
    assert table.startswith("iterations 2..2\nby self_cpu_time_total")
    mm_row = next(line for line in table.splitlines() if line.strip().startswith("aten::mm"))
    assert mm_row.split()[-1] == "2"  # the "# of Calls" column
    assert json.loads((tmp_path / "m.trace_rank0.json").read_text())["traceEvents"]
    with pytest.raises(ValueError, match="--profile-step-start"):
        validate_args(parse_args((GPT + " --profile --profile-step-start 5 --profile-step-end 5").split()),
                      world_size=1, rank=0)
