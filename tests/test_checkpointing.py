"""Exact resume through megatron/training/checkpointing.py on a 2-rank gloo world.

A small bf16 GPTModel (dropout on, so resuming also depends on the RNG state) + DDP + distributed Adam
+ cosine LR schedule trains 3 steps, saves, trains 3 more; a freshly built (differently seeded) copy
loads the checkpoint and trains the same 3 steps. Losses and parameters must match bit for bit.
Run once with TP=1 x DP=2 (optimizer state sharded over DP) and once with TP=2 x DP=1, plus
--no-load-optim, --no-load-rng, --finetune, a save that crashes before publishing, bad flags and a TP=2 checkpoint
loaded at TP=1. The second test resumes the real driver (pretrain_gpt.py on 2 ranks) and compares it
with an uninterrupted run through the metrics file, as does one saving with --async-save; another resumes
--dist-ckpt-optim-fully-reshardable optimizer state at the same and at other TP and PP sizes.
"""

import argparse
import hashlib
import os
from unittest import mock

import pytest
import torch

from dist_utils import launch_training, run_on_ranks
from test_parallel_training import GPT, assert_same_trajectory

SEQ, VOCAB, MICRO_BATCH = 32, 128, 2
SAVE_AT = 3  # steps before the checkpoint; as many are trained after it


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _param_hash(chunks) -> str:
    h = hashlib.sha256()
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            h.update(name.encode())
            h.update(_bits(p))
    return h.hexdigest()


def _inner_optimizers(opt):
    return getattr(opt, "chained_optimizers", [opt])


def _optimizer_hash(opt) -> str:
    """fp32 main-param shards and Adam state of this rank."""
    h = hashlib.sha256()
    for sub in _inner_optimizers(opt):
        for group in sub.optimizer.param_groups:
            for p in group["params"]:
                h.update(_bits(p))
                for key, value in sorted(sub.optimizer.state.get(p, {}).items()):
                    h.update(key.encode())
                    h.update(_bits(value) if torch.is_tensor(value) else repr(value).encode())
    return h.hexdigest()


def _main_params_match_model(opt) -> bool:
    return all(
        torch.equal(main, model_shard.float())
        for sub in _inner_optimizers(opt)
        for main_group, model_group in zip(sub.shard_fp32_from_float16_groups, sub.shard_float16_groups)
        for main, model_shard in zip(main_group, model_group)
    )


def _build(tp: int, seed: int, fused_adam: bool = False):
    """Seed, then build ([DDP model chunk], distributed Adam, LR scheduler) as the driver does (``fused_adam``: with
    torch's fused Adam kernel, as the driver steps it on CUDA)."""
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, tensor_model_parallel_size=tp,
        use_cpu_initialization=True, bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
        hidden_dropout=0.1, attention_dropout=0.1, masked_softmax_fusion=False,
        bias_activation_fusion=False, bias_dropout_fusion=False,
    )
    model = Float16Module(config, GPTModel(config, get_gpt_layer_local_spec(), VOCAB, SEQ))
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    ddp = DistributedDataParallel(config, ddp_config, model)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=1e-4, weight_decay=0.01, bf16=True,
                        use_distributed_optimizer=True, clip_grad=1.0),
        [ddp],
    )
    if fused_adam:
        from megatron.hooks import fused_ops

        fused_ops.fuse_adam(opt)
    scheduler = OptimizerParamScheduler(
        opt, init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=4, lr_decay_steps=24,
        lr_decay_style="cosine", start_wd=0.01, end_wd=0.01, wd_incr_steps=24, wd_incr_style="constant",
    )
    config.grad_scale_func = opt.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    return [ddp], opt, scheduler


def _batch(step: int):
    from megatron.core import parallel_state

    g = torch.Generator().manual_seed(1000 * step + parallel_state.get_data_parallel_rank())
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=g)
    position_ids = torch.arange(SEQ).expand(MICRO_BATCH, SEQ)
    return tokens[:, :-1], position_ids, tokens[:, 1:]


def _loss(output):
    loss = output.float().mean()
    return loss, {"lm loss": loss.detach()}


def _forward_step(data_iterator, model):
    tokens, position_ids, labels = next(data_iterator)
    return model(tokens, position_ids, None, labels=labels), _loss


def _train(parts, steps, args) -> list[int]:
    """Train ``steps`` (global step indices); return each step's loss as int32 bits."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    chunks, opt, scheduler = parts
    samples_per_step = MICRO_BATCH * parallel_state.get_data_parallel_world_size()
    loss_bits = []
    for step in steps:
        for chunk in chunks:
            chunk.zero_grad_buffer()
        opt.zero_grad()
        losses = get_forward_backward_func()(
            forward_step_func=_forward_step, data_iterator=iter([_batch(step)]), model=chunks,
            num_microbatches=1, seq_length=SEQ, micro_batch_size=MICRO_BATCH, forward_only=False,
        )
        opt.step()
        scheduler.step(increment=samples_per_step)
        args.consumed_train_samples += samples_per_step
        loss_bits.append(losses[0]["lm loss"].view(torch.int32).item())
    return loss_bits


def _args(root, **overrides):
    values = dict(save=root, load=root, no_load_optim=False, no_load_rng=False, ckpt_format="torch_dist",
                  consumed_train_samples=0, consumed_valid_samples=0, rank=0)
    values.update(overrides)
    return argparse.Namespace(**values)


def _fresh_load(tp, root, fused_adam=False, **overrides):
    """A differently seeded model/optimizer that then loads ``root`` (``fused_adam``: and fuses its Adam again, as
    the driver does after a load)."""
    from megatron.hooks import fused_ops
    from megatron.training.checkpointing import load_checkpoint

    parts = _build(tp, seed=4321, fused_adam=fused_adam)
    args = _args(root, **overrides)
    iteration = load_checkpoint(args, *parts)
    if fused_adam:
        fused_ops.fuse_adam(parts[1])
    return parts, args, iteration


def _fused_adam_state(opt) -> dict:
    """Whether every group of torch's Adam steps fused, and the devices and dtypes of its states' steps."""
    adams = [sub.optimizer for sub in _inner_optimizers(opt)]
    steps = {(str(s["step"].device), str(s["step"].dtype)) for adam in adams for s in adam.state.values()}
    return dict(fused=all(g["fused"] and not g["foreach"] for adam in adams for g in adam.param_groups), steps=steps)


def _fused_adam_scenario(root: str) -> dict:
    """Resume with torch's fused Adam (forced onto the CPU here): bit-exact, and the fused setting and device-held
    steps survive the load (which restores the saved groups and host steps); the losses follow the foreach run's."""
    from megatron.core import parallel_state
    from megatron.hooks import fused_ops
    from megatron.training.checkpointing import save_checkpoint

    fused_ops.FUSED_ADAM_DEVICES, fused_ops._applied = ("cpu", "cuda"), True
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    out = {}
    args = _args(root)
    parts = _build(1, seed=1234, fused_adam=True)
    out["built"] = _fused_adam_state(parts[1])
    out["losses"] = _train(parts, range(SAVE_AT), args)
    out["trained"] = _fused_adam_state(parts[1])
    save_checkpoint(args, SAVE_AT, *parts)
    out["reference_losses"] = _train(parts, range(SAVE_AT, 2 * SAVE_AT), args)
    out["reference_params"] = _param_hash(parts[0])
    resumed, resumed_args, _ = _fresh_load(1, root, fused_adam=True)
    out["loaded"] = _fused_adam_state(resumed[1])
    out["resumed_losses"] = _train(resumed, range(SAVE_AT, 2 * SAVE_AT), resumed_args)
    out["resumed_params"] = _param_hash(resumed[0])
    foreach_args = _args(root + "_foreach")
    out["foreach_losses"] = _train(_build(1, seed=1234), range(2 * SAVE_AT), foreach_args)
    parallel_state.destroy_model_parallel()
    return out


def _state(parts, args, iteration):
    chunks, opt, scheduler = parts
    return dict(iteration=iteration, consumed=args.consumed_train_samples, params=_param_hash(chunks),
                optim=_optimizer_hash(opt), scheduler_steps=scheduler.num_steps)


def _resume_scenario(tp: int, root: str, with_extras: bool) -> dict:
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.training.checkpointing import TRACKER_FILENAME, save_checkpoint

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    out = {}
    args = _args(root)
    parts = _build(tp, seed=1234)
    _train(parts, range(SAVE_AT), args)
    save_checkpoint(args, SAVE_AT, *parts)
    out["saved"] = _state(parts, args, SAVE_AT)
    out["reference_losses"] = _train(parts, range(SAVE_AT, 2 * SAVE_AT), args)
    out["reference_params"] = _param_hash(parts[0])

    resumed, resumed_args, iteration = _fresh_load(tp, root)
    out["loaded"] = _state(resumed, resumed_args, iteration)
    out["resumed_losses"] = _train(resumed, range(SAVE_AT, 2 * SAVE_AT), resumed_args)
    out["resumed_params"] = _param_hash(resumed[0])

    if with_extras:
        no_optim, no_optim_args, iteration = _fresh_load(tp, root, no_load_optim=True)
        out["no_optim"] = _state(no_optim, no_optim_args, iteration)
        out["no_optim_main_params_match_model"] = _main_params_match_model(no_optim[1])
        out["no_optim_adam_state_empty"] = all(not sub.optimizer.state
                                               for sub in _inner_optimizers(no_optim[1]))
        out["no_optim_first_loss"] = _train(no_optim, [SAVE_AT], no_optim_args)[0]

        finetune, finetune_args, iteration = _fresh_load(tp, root, finetune=True, consumed_train_samples=-1)
        out["finetune"] = _state(finetune, finetune_args, iteration)
        out["finetune_adam_state_empty"] = all(not sub.optimizer.state for sub in _inner_optimizers(finetune[1]))

        no_rng, no_rng_args, _ = _fresh_load(tp, root, no_load_rng=True)
        out["no_rng_losses"] = _train(no_rng, range(SAVE_AT, 2 * SAVE_AT), no_rng_args)

        # A save of iteration 6 that dies after writing its shards but before publishing them.
        real_save = dist_checkpointing.save

        def save_then_crash(*a, **kw):
            real_save(*a, **kw)
            raise KeyboardInterrupt("simulated crash mid-save")

        with mock.patch.object(dist_checkpointing, "save", save_then_crash):
            with pytest.raises(KeyboardInterrupt):
                save_checkpoint(args, 2 * SAVE_AT, *parts)
        torch.distributed.barrier()
        with open(os.path.join(root, TRACKER_FILENAME)) as f:
            out["tracker_after_crash"] = f.read()
        after_crash = _fresh_load(tp, root)
        out["after_crash"] = _state(*after_crash)

        # Saving again over the crash's leftovers works and is what is loaded next.
        save_checkpoint(args, 2 * SAVE_AT, *parts)
        resaved = _fresh_load(tp, root)
        out["resaved"] = _state(*resaved)
        out["resaved_dirs"] = sorted(os.listdir(root))

    parallel_state.destroy_model_parallel()
    return out


def _flag_checks(root: str) -> dict:
    """Bad flags, an empty --load, and loading the TP=2 checkpoint into this TP=1 x DP=2 world."""
    from megatron.core import parallel_state
    from megatron.training.checkpointing import load_checkpoint, save_checkpoint

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    chunks, opt, scheduler = _build(1, seed=1)
    tp2 = os.path.join(root, "tp2_dp1")
    calls = {
        "format": lambda: save_checkpoint(_args(root, ckpt_format="torch"), 1, chunks, opt, scheduler),
        "empty_load": lambda: load_checkpoint(_args(os.path.join(root, "none")), chunks, opt, scheduler),
        "other_tp_optim": lambda: load_checkpoint(_args(tp2), chunks, opt, scheduler),
        "other_tp_rng": lambda: load_checkpoint(_args(tp2, no_load_optim=True), chunks, opt, scheduler),
        "other_tp_weights": lambda: load_checkpoint(
            _args(tp2, no_load_optim=True, no_load_rng=True), chunks, opt, scheduler),
    }
    results = {}
    for name, call in calls.items():
        try:
            results[name] = call()
        except ValueError as e:
            results[name] = str(e)
    parallel_state.destroy_model_parallel()
    return results


def _checkpoint_world(root: str) -> dict:
    from megatron.hooks import cpu

    cpu.apply()
    return {
        "tp1_dp2": _resume_scenario(1, os.path.join(root, "tp1_dp2"), with_extras=True),
        "tp2_dp1": _resume_scenario(2, os.path.join(root, "tp2_dp1"), with_extras=False),
        "flags": _flag_checks(root),
        "fused_adam": _fused_adam_scenario(os.path.join(root, "fused_adam")),
    }


@pytest.mark.slow
def test_checkpoint_resume_is_bit_exact(tmp_path):
    results = run_on_ranks(_checkpoint_world, 2, str(tmp_path))
    for rank, result in enumerate(results):
        for layout in ("tp1_dp2", "tp2_dp1"):
            r = result[layout]
            where = f"rank {rank} {layout}"
            # iteration, consumed samples, params, fp32 main params + Adam state, scheduler steps
            assert r["loaded"] == r["saved"], where
            assert r["resumed_losses"] == r["reference_losses"], where
            assert r["resumed_params"] == r["reference_params"], where

        r = result["tp1_dp2"]
        no_optim = r["no_optim"]
        assert no_optim["params"] == r["saved"]["params"] and no_optim["iteration"] == SAVE_AT
        assert no_optim["scheduler_steps"] == 0 and no_optim["optim"] != r["saved"]["optim"]
        assert r["no_optim_main_params_match_model"] and r["no_optim_adam_state_empty"]
        assert r["no_optim_first_loss"] == r["reference_losses"][0]  # same weights and RNG, same forward
        assert r["no_rng_losses"] != r["reference_losses"]  # dropout masks come from the RNG state
        finetune = r["finetune"]  # weights only, a new run: iteration 0, no samples consumed, fresh schedule
        assert finetune["params"] == r["saved"]["params"] and finetune["iteration"] == 0
        assert finetune["consumed"] == 0 and finetune["scheduler_steps"] == 0 and r["finetune_adam_state_empty"]

        assert r["tracker_after_crash"] == str(SAVE_AT)
        assert r["after_crash"] == r["saved"]
        assert r["resaved"]["iteration"] == 2 * SAVE_AT and r["resaved"]["params"] == r["reference_params"]
        assert r["resaved_dirs"] == ["iter_0000003", "iter_0000006", "latest_checkpointed_iteration.txt"]

        fused = result["fused_adam"]
        assert fused["built"] == dict(fused=True, steps=set())  # state comes with the first step
        assert fused["trained"] == fused["loaded"] == dict(fused=True, steps={("cpu", "torch.float32")})
        assert fused["resumed_losses"] == fused["reference_losses"], rank
        assert fused["resumed_params"] == fused["reference_params"], rank
        loss = lambda bits: torch.tensor(bits, dtype=torch.int32).view(torch.float32)  # noqa: E731
        fused_losses, foreach_losses = loss(fused["losses"] + fused["reference_losses"]), loss(fused["foreach_losses"])
        assert torch.allclose(fused_losses, foreach_losses, rtol=1e-3), (fused_losses, foreach_losses)

        flags = result["flags"]
        assert "--ckpt-format must be 'torch_dist'" in flags["format"] and "'torch'" in flags["format"]
        assert flags["empty_load"] == 0
        assert "--no-load-optim" in flags["other_tp_optim"] and "--no-load-rng" in flags["other_tp_rng"]
        assert flags["other_tp_weights"] == SAVE_AT  # model weights reshard from TP=2 to TP=1


RESUME_FLAGS = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
    "--global-batch-size 8 --train-iters 4 --lr 1e-3 --lr-warmup-iters 1 --lr-decay-style cosine --bf16 "
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 255 "
    "--hidden-dropout 0.1 --attention-dropout 0.1 --no-bias-gelu-fusion --no-bias-dropout-fusion --transformer-impl local --log-interval 1 "
    "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 --use-distributed-optimizer "
    "--params-checksum-interval 1"
)


def _pretrain_gpt(tmp_path, name, extra_flags) -> list[dict]:
    return launch_training(tmp_path, name, "pretrain_gpt.py", 2, f"{RESUME_FLAGS} {extra_flags}")


@pytest.mark.slow
def test_pretrain_gpt_resume_matches_uninterrupted_run(tmp_path):
    """PP=2 with 2 virtual stages (checkpoint keys model0/model1), bf16, distributed optimizer and
    dropout: 4 uninterrupted iterations (saving at 2 and 4) against a run resumed from iteration 2."""
    from megatron.training.checkpointing import TRACKER_FILENAME

    ckpt = tmp_path / "ckpt"
    uninterrupted = _pretrain_gpt(tmp_path, "uninterrupted", f"--save {ckpt} --save-interval 2")
    # As if the iteration-4 save had crashed before publishing: the tracker still names iteration 2.
    (ckpt / TRACKER_FILENAME).write_text("2")
    resumed = _pretrain_gpt(tmp_path, "resumed", f"--load {ckpt}")

    assert [r["iteration"] for r in resumed] == [3, 4]
    for ref, res in zip(uninterrupted[2:], resumed):
        for key in ("consumed_samples", "loss", "lr", "grad_norm", "params_checksum"):
            assert res[key] == ref[key], (key, ref["iteration"])


@pytest.mark.slow
def test_async_save_publishes_every_checkpoint_and_resumes_bit_exactly(tmp_path):
    """--async-save, with megatron-core's writer named as Megatron-LM names it (--async-strategy mcore): the shards
    are written by a forked writer while training goes on, and each checkpoint is published (renamed, tracker
    written) once every rank's writer is done; the last before the run exits. Resumed from the iteration-2
    checkpoint, iterations 3-4 repeat the uninterrupted run's bits: the writer saved iteration 2's state, not the
    parameters that training changed while it wrote."""
    from megatron.training.checkpointing import TRACKER_FILENAME

    ckpt = tmp_path / "ckpt"
    uninterrupted = _pretrain_gpt(tmp_path, "async",
                                 f"--save {ckpt} --save-interval 2 --async-save --async-strategy mcore")
    assert sorted(os.listdir(ckpt)) == ["iter_0000002", "iter_0000004", TRACKER_FILENAME]
    assert (ckpt / TRACKER_FILENAME).read_text() == "4"
    resumed = _pretrain_gpt(tmp_path, "resumed", f"--load {ckpt} --ckpt-step 2")
    assert [r["iteration"] for r in resumed] == [3, 4]
    for ref, res in zip(uninterrupted[2:], resumed):
        for key in ("consumed_samples", "loss", "grad_norm", "params_checksum"):
            assert res[key] == ref[key], (key, ref["iteration"])


def test_save_retain_interval_deletes_the_previous_checkpoint_once_the_next_is_published(tmp_path):
    """--save-retain-interval 4 with saves at 2, 4, 6, 8, 10: each publish deletes the checkpoint the tracker named
    before unless its iteration is a multiple of 4 or it is a symbolic link; re-saving the latest iteration keeps it."""
    from megatron.training.checkpointing import TRACKER_FILENAME, _publish, checkpoint_dir

    def publish(iteration):
        final = checkpoint_dir(str(tmp_path), iteration)
        os.makedirs(final + ".tmp")
        _publish(str(tmp_path), final + ".tmp", final, iteration, retain_interval=4)

    publish(2)
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", TRACKER_FILENAME]
    publish(4)
    assert sorted(os.listdir(tmp_path)) == ["iter_0000004", TRACKER_FILENAME]
    publish(4)
    assert sorted(os.listdir(tmp_path)) == ["iter_0000004", TRACKER_FILENAME]
    publish(6)
    os.rename(tmp_path / "iter_0000006", tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", tmp_path / "iter_0000006")
    publish(8)
    publish(10)
    assert sorted(os.listdir(tmp_path)) == ["elsewhere", "iter_0000004", "iter_0000006", "iter_0000008",
                                            "iter_0000010", TRACKER_FILENAME]
    assert (tmp_path / TRACKER_FILENAME).read_text() == "10"


@pytest.mark.slow
def test_save_retain_interval_in_training(tmp_path):
    """--save-interval 1 --save-retain-interval 2 over 4 iterations keeps iterations 2 and 4, and the retained
    iteration 2 resumes into the uninterrupted run's iterations 3-4 bit for bit."""
    from megatron.training.checkpointing import TRACKER_FILENAME

    ckpt = tmp_path / "ckpt"
    uninterrupted = _pretrain_gpt(tmp_path, "retain", f"--save {ckpt} --save-interval 1 --save-retain-interval 2")
    assert sorted(os.listdir(ckpt)) == ["iter_0000002", "iter_0000004", TRACKER_FILENAME]
    resumed = _pretrain_gpt(tmp_path, "resumed", f"--load {ckpt} --ckpt-step 2")
    assert [r["iteration"] for r in resumed] == [3, 4]
    for ref, res in zip(uninterrupted[2:], resumed):
        for key in ("consumed_samples", "loss", "grad_norm", "params_checksum"):
            assert res[key] == ref[key], (key, ref["iteration"])


@pytest.mark.slow
def test_non_persistent_checkpoints(tmp_path):
    """--non-persistent-save-interval 1 --non-persistent-ckpt-type global beside --save-interval 3 over 6
    iterations: persistent saves at 3 and 6, non-persistent ones at 1, 2, 4, 5 into --save's non_persistent
    directory, where only the newest two stay (the older removed before each save). As if the job had died after
    iteration 5 (its persistent iteration 6 lost), a resume takes the newer non-persistent iteration 5 and repeats
    iteration 6 bit for bit; without --non-persistent-ckpt-type it takes persistent iteration 3."""
    import shutil

    from megatron.training.checkpointing import TRACKER_FILENAME

    ckpt = tmp_path / "ckpt"
    flags = RESUME_FLAGS.replace("--train-iters 4", "--train-iters 6")
    full = launch_training(tmp_path, "full", "pretrain_gpt.py", 2,
                           flags + f" --save {ckpt} --save-interval 3 --non-persistent-save-interval 1 "
                                   f"--non-persistent-ckpt-type global")
    assert sorted(os.listdir(ckpt)) == ["iter_0000003", "iter_0000006", TRACKER_FILENAME, "non_persistent"]
    assert sorted(os.listdir(ckpt / "non_persistent")) == ["iter_0000004", "iter_0000005", TRACKER_FILENAME]
    assert (ckpt / "non_persistent" / TRACKER_FILENAME).read_text() == "5"
    shutil.rmtree(ckpt / "iter_0000006")
    (ckpt / TRACKER_FILENAME).write_text("3")
    resumed = launch_training(tmp_path, "resumed", "pretrain_gpt.py", 2,
                              flags + f" --load {ckpt} --non-persistent-ckpt-type global")
    keys = ("iteration", "consumed_samples", "loss", "grad_norm", "params_checksum")
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in full[5:]]
    persistent = launch_training(tmp_path, "persistent", "pretrain_gpt.py", 2, flags + f" --load {ckpt}")
    assert [[r[k] for k in keys] for r in persistent] == [[r[k] for k in keys] for r in full[3:]]


@pytest.mark.slow
def test_fully_reshardable_optimizer_state_resumes_at_other_tp_and_pp(tmp_path):
    """--dist-ckpt-optim-fully-reshardable (fp32, distributed optimizer, TP=2, saved at iteration 2): resumed at TP=2
    it repeats iterations 3-4 bit for bit; at TP=1 and at PP=2 (with --no-load-rng, whose states are per rank) it
    follows them within the TP=1-vs-TP=2 rounding of test_parallel_training.py (measured: 1e-7)."""
    ckpt = tmp_path / "ckpt"
    flags = GPT + " --use-distributed-optimizer --dist-ckpt-optim-fully-reshardable"
    saved = launch_training(tmp_path, "tp2", "pretrain_gpt.py", 2, flags + f" --tensor-model-parallel-size 2 "
                            f"--save {ckpt} --save-interval 2")
    resume = f" --load {ckpt} --ckpt-step 2"
    same = launch_training(tmp_path, "tp2_resumed", "pretrain_gpt.py", 2,
                           flags + " --tensor-model-parallel-size 2" + resume)
    assert [(r["loss"], r["grad_norm"]) for r in same] == [(r["loss"], r["grad_norm"]) for r in saved[2:]]
    for name, nproc, layout in (("tp1", 1, ""), ("pp2", 2, " --pipeline-model-parallel-size 2")):
        resharded = launch_training(tmp_path, name, "pretrain_gpt.py", nproc, flags + layout + resume + " --no-load-rng")
        assert_same_trajectory(saved[2:], resharded, ["loss", "grad_norm", "lr"])


@pytest.mark.slow
def test_exit_interval_and_duration_save_and_resume(tmp_path):
    """--exit-interval stops at its iteration and saves there (no --save-interval); a resumed run with
    --exit-duration-in-mins already passed trains one iteration, agrees on stopping across ranks, and saves it.
    Megatron-LM launch flags that change nothing here ride along (--use-mcore-models, --log-throughput, ...)."""
    from megatron.training.checkpointing import TRACKER_FILENAME

    ckpt = tmp_path / "ckpt"
    extra = "--manual-gc --manual-gc-interval 1 --distributed-timeout-minutes 5 --use-mcore-models --log-throughput"
    first = _pretrain_gpt(tmp_path, "exit_interval", f"--save {ckpt} --exit-interval 2 {extra}")
    assert [r["iteration"] for r in first] == [1, 2] and (ckpt / TRACKER_FILENAME).read_text().strip() == "2"
    second = _pretrain_gpt(tmp_path, "exit_duration", f"--load {ckpt} --save {ckpt} --exit-duration-in-mins 1e-9 {extra}")
    assert [r["iteration"] for r in second] == [3] and (ckpt / TRACKER_FILENAME).read_text().strip() == "3"


@pytest.mark.slow
def test_exit_signal_handler_saves_and_stops(tmp_path):
    """--exit-signal-handler: a SIGTERM mid-run (what SLURM sends before a time limit or a preemption) ends the
    current iteration, saves it and exits 0, long before --train-iters."""
    import json
    import signal
    import subprocess
    import sys
    import time

    from dist_utils import _free_port
    from megatron.training.checkpointing import TRACKER_FILENAME

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    flags = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
             "--train-iters 2000 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 255 "
             f"--transformer-impl local --log-interval 1000 --exit-signal-handler --save {ckpt} "
             f"--metrics-file {metrics} --data-cache-path {tmp_path / 'cache'}")
    env = dict(os.environ, MASTER_PORT=str(_free_port()))
    with open(tmp_path / "log.txt", "w") as log:
        run = subprocess.Popen([sys.executable, os.path.join(root, "pretrain_gpt.py"), *flags.split()], cwd=root,
                               env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + 300
        while not metrics.exists() or len(metrics.read_text().splitlines()) < 2:
            assert run.poll() is None and time.time() < deadline, (tmp_path / "log.txt").read_text()[-3000:]
            time.sleep(0.05)
        run.send_signal(signal.SIGTERM)
        assert run.wait(timeout=300) == 0, (tmp_path / "log.txt").read_text()[-3000:]
    last = [json.loads(line) for line in metrics.read_text().splitlines()][-1]["iteration"]
    assert 2 <= last < 2000 and (ckpt / TRACKER_FILENAME).read_text().strip() == str(last)


def _fake_checkpoints(root, *iterations) -> None:
    """Checkpoint directories that checkpoint_to_load accepts (a torch_dist metadata.json), the tracker at the last."""
    import json

    from megatron.training.checkpointing import TRACKER_FILENAME, checkpoint_dir

    for iteration in iterations:
        os.makedirs(checkpoint_dir(str(root), iteration))
        with open(os.path.join(checkpoint_dir(str(root), iteration), "metadata.json"), "w") as f:
            json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                       "common_backend_version": 1}, f)
    (root / TRACKER_FILENAME).write_text(str(iterations[-1]))


def test_load_without_a_checkpoint_warns(tmp_path, caplog):
    """A --load directory that does not exist, or holds no tracker, starts from a random initialization with a
    warning naming it and --exit-on-missing-checkpoint (which makes it an error)."""
    from megatron.training.checkpointing import load_checkpoint

    missing, empty = tmp_path / "typo", tmp_path / "empty"
    empty.mkdir()
    with caplog.at_level("WARNING", logger="megatron.training.checkpointing"):
        assert load_checkpoint(_args(str(missing)), None, None, None) == 0
        assert load_checkpoint(_args(str(empty)), None, None, None) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2
    assert f"--load {missing} holds no checkpoint (the directory {missing} does not exist)" in warnings[0]
    assert f"{empty}/latest_checkpointed_iteration.txt does not exist" in warnings[1]
    assert all("--exit-on-missing-checkpoint" in w and "random initialization" in w for w in warnings)
    with pytest.raises(ValueError, match="--exit-on-missing-checkpoint: no checkpoint under --load"):
        load_checkpoint(_args(str(missing), exit_on_missing_checkpoint=True), None, None, None)


def test_saves_never_move_the_tracker_back(tmp_path):
    """--save holding iteration 10 with a run that would start before it (a --load that holds nothing, no --load, a
    --ckpt-step of an older iteration) is an error at start-up naming the flags; resuming from it is not. Publishing
    an older iteration is refused too, leaving the tracker and the newer checkpoint as they were (the user's case:
    --save-retain-interval 4 deleted iteration 10 and the tracker moved back to 2)."""
    from megatron.training.checkpointing import (TRACKER_FILENAME, _publish, check_save_keeps_newer_checkpoints,
                                                 checkpoint_dir)

    save = tmp_path / "ckpt"
    _fake_checkpoints(save, 2, 10)
    cases = {
        "missing load": dict(load=str(tmp_path / "typo"), save_retain_interval=4),
        "no load": dict(load=None),
        "older step": dict(load=str(save), ckpt_step=2),
    }
    for name, overrides in cases.items():
        with pytest.raises(ValueError) as error:
            check_save_keeps_newer_checkpoints(_args(str(save), **overrides))
        message = str(error.value)
        assert f"--save {save}: {save}/{TRACKER_FILENAME} names iteration 10" in message, name
        assert "would move the tracker back" in message and f"Resume from it with --load {save}" in message, name
    assert "starts at iteration 0 (a fresh start: --load" in str(
        pytest.raises(ValueError, check_save_keeps_newer_checkpoints, _args(str(save), load=str(tmp_path / "typo"))).value)
    assert "--save-retain-interval would delete iteration 10" in str(pytest.raises(
        ValueError, check_save_keeps_newer_checkpoints, _args(str(save), load=None, save_retain_interval=4)).value)
    assert f"iteration 2 (--load {save} --ckpt-step 2)" in str(pytest.raises(
        ValueError, check_save_keeps_newer_checkpoints, _args(str(save), ckpt_step=2)).value)
    check_save_keeps_newer_checkpoints(_args(str(save)))  # resumes from 10
    check_save_keeps_newer_checkpoints(_args(str(tmp_path / "new"), load=str(save), ckpt_step=2))  # a new --save

    staged = checkpoint_dir(str(save), 4) + ".tmp"
    os.makedirs(staged)
    with pytest.raises(ValueError, match="names iteration 10, newer than the iteration 4 being saved"):
        _publish(str(save), staged, checkpoint_dir(str(save), 4), 4, retain_interval=4)
    assert (save / TRACKER_FILENAME).read_text() == "10"
    assert sorted(os.listdir(save)) == ["iter_0000002", "iter_0000004.tmp", "iter_0000010", TRACKER_FILENAME]


def _corruption_world(root: str) -> dict:
    """Saves iterations 1 and 2 of the tiny GPT (TP=1 x DP=2), then damages iteration 2's files on rank 0 and loads
    it each time on both ranks: 16 flipped bytes in a shard, the shard cut short, then cut short with its
    checksums.json gone. Returns each load's error, what was published, and the cost of the checksums."""
    import json
    import time

    from megatron.core import parallel_state
    from megatron.hooks import cpu
    from megatron.training import checkpointing
    from megatron.training.checkpointing import (CHECKSUMS_FILENAME, checkpoint_dir, load_checkpoint,
                                                 save_checkpoint)

    cpu.apply()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    rank = torch.distributed.get_rank()
    args = _args(root)
    parts = _build(1, seed=1234)
    out = {}
    for iteration in (1, 2):
        _train(parts, [iteration - 1], args)
        start = time.perf_counter()
        save_checkpoint(args, iteration, *parts)
        out[f"save_{iteration}_s"] = time.perf_counter() - start
    out["saved"] = _state(parts, args, 2)
    newest = checkpoint_dir(root, 2)
    start = time.perf_counter()
    checkpointing._checksum_files(newest)
    out["checksum_s"] = time.perf_counter() - start
    start = time.perf_counter()
    checkpointing.verify_checksums(newest)
    out["verify_s"] = time.perf_counter() - start
    with open(os.path.join(newest, CHECKSUMS_FILENAME)) as f:
        out["manifest"] = json.load(f)
    out["bytes"] = sum(entry["bytes"] for entry in out["manifest"]["files"].values())
    out["loaded"] = _state(*_fresh_load(1, root))

    shard = sorted(name for name in os.listdir(newest) if name.endswith(".distcp"))[-1]
    path = os.path.join(newest, shard)
    with open(path, "rb") as f:
        original = f.read()

    def damaged_load(damage):
        if rank == 0:
            damage()
        torch.distributed.barrier()
        try:
            _fresh_load(1, root)
            return None
        except ValueError as error:
            return str(error)

    def flip():
        middle = len(original) // 2
        with open(path, "wb") as f:
            f.write(original[:middle] + bytes(b ^ 0xFF for b in original[middle:middle + 16]) + original[middle + 16:])

    def truncate():
        with open(path, "wb") as f:
            f.write(original[:len(original) - 100])

    out["shard"] = path
    out["flipped"] = damaged_load(flip)
    out["truncated"] = damaged_load(truncate)
    out["truncated_unverified"] = damaged_load(lambda: os.remove(os.path.join(newest, CHECKSUMS_FILENAME)))
    out["fallback"] = _state(*_fresh_load(1, root, ckpt_step=1))
    parallel_state.destroy_model_parallel()
    return out


def test_corrupt_or_truncated_checkpoint_is_an_error_naming_the_file(tmp_path):
    """A published checkpoint holds checksums.json (every file's size and sha256); a load verifies it on every rank
    and names the damaged file and the --ckpt-step fallback: 16 flipped bytes in a .distcp shard (which loaded
    silently into a loss of 1345), the shard cut short (a bare EOFError without checksums, now also named)."""
    from megatron.training.checkpointing import CHECKSUMS_FILENAME

    results = run_on_ranks(_corruption_world, 2, str(tmp_path))
    for rank, r in enumerate(results):
        assert r["loaded"] == r["saved"], rank  # checksums change nothing of an intact resume
        files = r["manifest"]["files"]
        assert r["manifest"]["algorithm"] == "sha256" and os.path.basename(r["shard"]) in files
        # every file of the checkpoint (megatron-core 0.16 writes common.pt, 0.19 keeps that state in the shards)
        assert set(files) == set(os.listdir(os.path.dirname(r["shard"]))) - {CHECKSUMS_FILENAME}
        assert {"metadata.json", ".metadata"} <= set(files)
        assert f"{r['shard']} differs from what was saved" in r["flipped"], rank
        assert "fall back to an earlier checkpoint with --ckpt-step N (there: 1)" in r["flipped"]
        assert f"{r['shard']} holds {files[os.path.basename(r['shard'])]['bytes'] - 100} bytes" in r["truncated"]
        assert "truncated" in r["truncated"] and "--ckpt-step N (there: 1)" in r["truncated"]
        # on every rank, also where only one read the damaged shard (megatron-core 0.19: the others used to wait)
        assert "reading checkpoint" in r["truncated_unverified"] and "iter_0000002" in r["truncated_unverified"]
        assert "--ckpt-step N (there: 1)" in r["truncated_unverified"]
        assert r["fallback"]["iteration"] == 1
    r = results[0]
    print(f"tiny checkpoint: {r['bytes']} bytes in {len(r['manifest']['files'])} files; saves "
          f"{r['save_1_s']:.3f} s / {r['save_2_s']:.3f} s, of which hashing {r['checksum_s']:.4f} s; "
          f"verifying at load {r['verify_s']:.4f} s")


def test_unwritable_save_is_an_error_at_start_up(tmp_path):
    """--save checked when the run starts, not at its first save after the work is done: a path that cannot be made
    (under a file) and, where permissions hold (not as root), a read-only directory; a new directory is made."""
    from megatron.training.checkpointing import check_save_writable

    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=rf"--save {tmp_path}/file/ckpt is not writable \(.*Not a directory"):
        check_save_writable(_args(str(tmp_path / "file" / "ckpt")))
    check_save_writable(_args(str(tmp_path / "new" / "ckpt"), non_persistent_save_interval=1))
    assert sorted(os.listdir(tmp_path / "new" / "ckpt")) == ["non_persistent"]
    if os.geteuid() != 0:
        (tmp_path / "read_only").mkdir(mode=0o500)
        with pytest.raises(ValueError, match=rf"--save {tmp_path}/read_only is not writable"):
            check_save_writable(_args(str(tmp_path / "read_only")))


def _process_table() -> dict:
    """pid -> (parent pid, state, command line) of every process."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        table[int(name)] = (int(fields[1]), fields[0], cmdline)
    return table


def _descendants(pid: int) -> dict:
    """pid -> (parent pid, command line) of every process below ``pid``."""
    table, found, frontier = _process_table(), {}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, (ppid, _, cmdline) in table.items():
            if ppid == parent and child not in found:
                found[child] = ppid, cmdline
                frontier.append(child)
    return found


def _left_behind(run_processes: dict, ckpt) -> dict:
    """Of a run's processes (and those forked after ``run_processes`` was taken: the workers' forks share their
    command line, which names ``ckpt``), the ones still running (a zombie has ended)."""
    return {pid: cmdline for pid, (_, state, cmdline) in _process_table().items()
            if state != "Z" and (pid in run_processes or f"--save {ckpt} " in cmdline)}


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process table from /proc (Linux)")
def test_kill_9_of_torchrun_leaves_no_process_behind(tmp_path):
    """torchrun with 2 CPU workers saving every iteration; once a checkpoint is published (each worker then runs
    megatron-core's writer Manager and Python's resource tracker), kill -9 of the launcher alone. Its workers used to
    go on training and saving, reparented; killed, they left Manager and tracker behind forever. Now every process
    of the run ends within a minute (also a writer forked for a save in flight, which held the tracker), and the
    published checkpoint is whole (checksums.json holds)."""
    import hashlib
    import json
    import signal
    import subprocess
    import sys
    import time

    from dist_utils import ROOT, _free_port
    from megatron.training.checkpointing import CHECKSUMS_FILENAME, TRACKER_FILENAME, checkpoint_dir

    ckpt = tmp_path / "ckpt"
    flags = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
             "--train-iters 2000 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 255 "
             f"--transformer-impl local --log-interval 1000 --save {ckpt} --save-interval 1 "
             f"--data-cache-path {tmp_path / 'cache'}")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(_free_port()), os.path.join(ROOT, "pretrain_gpt.py"), *flags.split()]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore")
    run_processes = {}
    with open(tmp_path / "log.txt", "w") as log:
        launcher = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.time() + 300
            while not (ckpt / TRACKER_FILENAME).exists() or sum(
                    "resource_tracker" in cmdline for _, cmdline in _descendants(launcher.pid).values()) < 2:
                assert launcher.poll() is None and time.time() < deadline, (tmp_path / "log.txt").read_text()[-3000:]
                time.sleep(0.2)
            run_processes = _descendants(launcher.pid)
            os.kill(launcher.pid, signal.SIGKILL)
            launcher.wait(timeout=60)
            deadline = time.time() + 60
            while _left_behind(run_processes, ckpt) and time.time() < deadline:
                time.sleep(0.5)
            left = _left_behind(run_processes, ckpt)
        finally:  # never leave the run behind, whatever failed
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait()
            for pid in _left_behind(run_processes, ckpt):
                os.kill(pid, signal.SIGKILL)
    workers = [pid for pid, (ppid, _) in run_processes.items() if ppid == launcher.pid]
    for helper in ("spawn_main", "resource_tracker"):  # each worker's: the writer's Manager and its tracker
        assert sum(helper in cmdline for _, cmdline in run_processes.values()) == 2, (helper, run_processes)
    assert len(workers) == 2, run_processes
    assert not left, f"still running a minute after kill -9 of torchrun: {left}"

    published = checkpoint_dir(str(ckpt), int((ckpt / TRACKER_FILENAME).read_text()))
    with open(os.path.join(published, CHECKSUMS_FILENAME)) as f:
        saved = json.load(f)["files"]
    for name, entry in saved.items():
        with open(os.path.join(published, name), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == entry["sha256"], name
