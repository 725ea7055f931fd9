"""The compressed parameter all-gather hook trains bit-identically to uncompressed megatron-core.

Directly on megatron-core (one 2-rank gloo world): a small bf16 GPT (local spec, Float16Module) under
DistributedDataParallel with the distributed optimizer (small buckets, so 9 bucket groups) trains on
identical data with and without ``apply_dp_compression``; the per-step loss bits and a hash
of every parameter buffer must match exactly, for CIERA and delta, with ``--overlap-param-gather`` off
and on, with periodic ``verify()``, across a parameter rewrite followed by ``reset_param_gather_state``
(and without the reset ``verify()`` must fail), for ``--param-gather-selection benefit`` under a budget
that fits only some buckets (CIERA) and with measured delta costs (ranks must agree), and while a trial
switches the gathers between plain and compressed and finally off (``--param-gather-trial-iters``).
Refused settings raise errors naming the flag.

Through the training driver (launch_training, 50 iterations): DP=2 with CIERA from scratch and with delta
resumed from the uncompressed run's iteration-25 checkpoint; and MoE runs (both codecs) with TP=2 x SP
and EP=2 x ETP=1 on 4 ranks, so dense buckets gather over DP=2 (with TP=2) and expert buckets over
expert-DP=2. Per-iteration loss and params_checksum must equal the uncompressed run's.
"""

import argparse
import hashlib
import shutil

import pytest
import torch
from dist_utils import launch_training, run_on_ranks

SEQ, MICRO_BATCH, VOCAB, STEPS = 32, 2, 128, 12
LR = 1e-4  # small enough that some exponent blocks stay unchanged between steps


METHODS = {  # run name -> compression flags
    "none": dict(param_gather_compression="none"),
    "ciera": dict(param_gather_compression="ciera"),
    "ciera-benefit": dict(  # small blocks change less often, so buckets pay; the budget fits about half
        param_gather_compression="ciera", ciera_block_size=64, param_gather_selection="benefit",
        ciera_cache_budget_mb=0.02,
    ),
    "delta": dict(param_gather_compression="delta"),
    # as delta, with PreparedGathers capped at CAPPED_SHARD_BYTES: several size exchanges per step
    "delta-capped": dict(param_gather_compression="delta"),
    # measured on the real shards; on CPU whether delta pays depends on timings, so only agreement is checked
    "delta-benefit": dict(param_gather_compression="delta", param_gather_selection="benefit"),
    # compressed, switched by a trial (TRIAL_SWITCHES) between plain and compressed gathers, then off for good
    "delta-trial": dict(param_gather_compression="delta"),
    "ciera-trial": dict(param_gather_compression="ciera"),
    # chosen (by _alternating_choice) after 2 measured gathers, measured again from step RESELECT_AT, chosen again
    "delta-reselect": dict(param_gather_compression="delta", param_gather_selection="benefit"),
    # sync-free gathers: payloads in slots of the last ones' size (--delta-capacity-factor), the growing ones resent
    "delta-slots": dict(param_gather_compression="delta", delta_capacity_factor=1.0),
}
CAST = "-cast"  # a run name with this after the method: --delta-fused-cast on top (megatron/hooks/fused_cast.py)
RESELECT_AT = 5
CAPPED_SHARD_BYTES = 16_000  # about three of the test model's bucket shards
TRIAL_SWITCHES = {3: (False, False), 4: (True, False), 5: (False, False), 7: (True, False), 9: (False, True)}


def _config(method, verify_interval=0, **overrides):
    """The ``ParamGatherConfig`` of the run ``method`` with the flags' values ``overrides``."""
    from megatron.training.compression_config import param_gather_config

    args = argparse.Namespace(
        param_gather_verify_interval=verify_interval, ciera_block_size=512, ciera_change_detect="compare",
        ciera_exponent_coder="raw", param_gather_selection="all", ciera_cache_budget_mb=None, delta_block_size=256,
        grad_reduce_compression="none", param_gather_trial_iters=0, param_gather_reselect_interval=0,
        delta_capacity_factor=0.0, delta_cuda_graphs=False, param_gather_integrity_check=True,
        param_gather_integrity_max_mismatches=3, param_gather_keyframe_interval=0, sdp4bit_group_size=128,
        sdp4bit_weight_bits=4,
    )
    method, cast = _base(method), method.endswith(CAST)
    vars(args).update(METHODS.get(method, dict(param_gather_compression=method)), delta_fused_cast=cast, **overrides)
    return param_gather_config(args)


def _base(method: str) -> str:
    return method.removesuffix(CAST)


def _build(overlap, bf16=True, distributed_optimizer=True):
    """A 2-layer GPT wrapped in DDP (small buckets: several bucket groups) and its optimizer."""
    from megatron.core import tensor_parallel
    from megatron.core.distributed import (
        DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    dtype = torch.bfloat16 if bf16 else torch.float32
    config = TransformerConfig(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
        use_cpu_initialization=True, bf16=bf16, params_dtype=dtype, pipeline_dtype=dtype,
        hidden_dropout=0.0, attention_dropout=0.0, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
    )
    spec = get_gpt_layer_local_spec()
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ)
    if bf16:
        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=distributed_optimizer, overlap_grad_reduce=True,
        overlap_param_gather=overlap, bucket_size=6000,  # small buckets: several bucket groups
    )
    ddp = DistributedDataParallel(config, ddp_config, model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=LR, bf16=bf16, params_dtype=dtype,
            use_distributed_optimizer=distributed_optimizer, clip_grad=1.0,
        ),
        [ddp],
    )
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func, config.grad_sync_func = ddp.no_sync, ddp.start_grad_sync
    return ddp, optimizer


def _batch(step):
    from megatron.core import parallel_state

    gen = torch.Generator().manual_seed(1000 * step + parallel_state.get_data_parallel_rank())
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=gen)
    position_ids = torch.arange(SEQ).expand(MICRO_BATCH, SEQ)
    return tokens[:, :-1], position_ids, tokens[:, 1:]


def _forward_step(data_iterator, model):
    tokens, position_ids, labels = next(data_iterator)
    per_token_loss = model(tokens, position_ids, None, labels=labels)

    def loss_func(output):
        loss = output.float().mean()
        return loss, {"loss": loss.detach()}

    return per_token_loss, loss_func


def _buffers_hash(ddp):
    digest = hashlib.sha256()
    for buffer in ddp.buffers + ddp.expert_parallel_buffers:
        digest.update(buffer.param_data.view(torch.int16).numpy().tobytes())
    return digest.hexdigest()


def _train(method, overlap, rewrite_at=None, reset=True, verify_interval=3, **flags):
    """Per-step loss bits, the final parameter hash and the hook's counters. ``rewrite_at``: after
    that step rewrite every parameter (as a checkpoint load does) and, if ``reset``, reset the codecs. ``flags``:
    other flags' values (``_config``)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.hooks.param_gather import apply_dp_compression, reset_param_gather_state

    from compression.selection import CommModel
    from compression.telemetry import COMM_CLASSES, TELEMETRY

    from megatron.hooks import param_gather_selection, prepared_gathers

    TELEMETRY.reset()
    ddp, optimizer = _build(overlap)
    if method != "none":
        apply_dp_compression([ddp], _config(method, verify_interval, **flags))
    if method.endswith(CAST):
        from megatron.hooks.fused_cast import apply_delta_fused_cast

        assert apply_delta_fused_cast([ddp], optimizer) == sum(len(g.buckets) for g in _compressed_groups(ddp))
    method, cast = _base(method), method.endswith(CAST)
    exchanges = []  # gathers per size exchange
    prepare_gathers = prepared_gathers.prepare_gathers

    def counted(gathers, *rest, **kwargs):
        exchanges.append(len(gathers))
        return prepare_gathers(gathers, *rest, **kwargs)

    prepared_gathers.prepare_gathers = counted
    cap = prepared_gathers.PREPARE_SHARD_BYTES
    if method == "delta-capped":
        prepared_gathers.PREPARE_SHARD_BYTES = CAPPED_SHARD_BYTES
    patched = {name: getattr(param_gather_selection, name) for name in ("SELECTION_WARMUP_GATHERS", "select_shards",
                                                               "profile_comm", "_comm_models")}
    choice = _alternating_choice()
    if method == "delta-reselect":
        param_gather_selection.SELECTION_WARMUP_GATHERS, param_gather_selection.select_shards = 2, choice
    merges = []  # what the benefit selection's candidates would cost each receiver to merge (CIERA's T_decmp)
    if method == "ciera-benefit":  # a link slow enough that the CPU's merge (~13 MB/s) costs less than it saves
        param_gather_selection.profile_comm = lambda group: CommModel(1e-4, 1 / 1e6)
        param_gather_selection._comm_models = {}
        select = param_gather_selection.select_shards

        def recorded(candidates, comm, budget):
            merges.extend(c.merge_seconds for c in candidates)
            return select(candidates, comm, budget)

        param_gather_selection.select_shards = recorded
    forward_backward = get_forward_backward_func()
    loss_bits = []
    for step in range(STEPS):
        if method.endswith("-trial") and step in TRIAL_SWITCHES:
            for bucket_group in _compressed_groups(ddp):
                bucket_group.set_compressing(*TRIAL_SWITCHES[step])
        if method == "delta-reselect" and step == RESELECT_AT:
            _compressed_groups(ddp)[0].benefit.restart()
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        losses = forward_backward(
            forward_step_func=_forward_step, data_iterator=iter([_batch(step)]), model=[ddp],
            num_microbatches=1, seq_length=SEQ, micro_batch_size=MICRO_BATCH,
        )
        loss_bits.append(losses[0]["loss"].view(torch.int32).item())
        optimizer.step()
        if step == rewrite_at:
            if cast and overlap:  # the step's new values are still fp32 only until a gather casts them: gather first,
                ddp.start_param_sync(force_sync=True)  # as anything that reads or writes params there must
            with torch.no_grad():
                for param in ddp.module.parameters():
                    param.mul_(0.5)
            optimizer.reload_model_params()
            if reset:
                reset_param_gather_state([ddp])
    raw, sent = TELEMETRY.counters()[2 * COMM_CLASSES.index("dp_param_gather"):][:2]
    steps_sent_ratio = sent / max(raw, 1)  # a forced gather with no step before it is a keyframe with fused casts
    ddp.start_param_sync(force_sync=True)  # with overlap the last gather is still pending
    prepared_gathers.prepare_gathers = prepare_gathers
    prepared_gathers.PREPARE_SHARD_BYTES = cap
    for name, value in patched.items():
        setattr(param_gather_selection, name, value)
    raw, sent = TELEMETRY.counters()[2 * COMM_CLASSES.index("dp_param_gather"):][:2]
    counters = TELEMETRY.extra_counters()
    return dict(
        slot_gathers=counters.get("dp_param_gather/slot_gathers", 0),
        slot_overflows=counters.get("dp_param_gather/slot_overflows", 0),
        loss_bits=loss_bits, param_hash=_buffers_hash(ddp), sent_ratio=sent / max(raw, 1),
        steps_sent_ratio=steps_sent_ratio, candidate_cache_bytes=choice.cache_bytes, merge_seconds=merges,
        exchanges=exchanges, **_hook_counts(ddp),
    )


def _alternating_choice():
    """A select_shards that picks the even bucket groups in its first round and the odd ones in the next, so
    that a re-selection switches every bucket: compressed ones to plain, plain ones to a new codec."""
    rounds = []

    def choose(candidates, comm, budget):
        parity = len(rounds) % 2
        rounds.append(parity)
        choose.cache_bytes.append([c.cache_bytes for c in candidates])
        return {c.key for c in candidates if c.key[0] % 2 == parity}

    choose.cache_bytes = []  # per round, each candidate's codec memory as the selection counts it
    return choose


def _compressed_groups(ddp):
    from megatron.hooks.param_gather import CompressedBucketGroup

    return [g for g in ddp.bucket_groups + ddp.expert_parallel_bucket_groups if isinstance(g, CompressedBucketGroup)]


def _hook_counts(ddp):
    from megatron.hooks.param_gather import PlainGather

    groups = _compressed_groups(ddp)
    return dict(
        num_groups=len(groups), num_gathers=sum(g.num_gathers for g in groups),
        num_compressed=sum(not isinstance(gather, PlainGather) for g in groups for gather in g.shard_gathers),
        undecided=sum(g.selection is not None for g in groups),
        selections=groups[0].benefit.rounds if groups and groups[0].benefit else 0,
        fused_buckets=sum(groups[0].prepared.fusions.sets) if groups else 0,
    )


def _expect_error(error_type, needle, fn):
    try:
        fn()
    except error_type as error:
        assert needle in str(error), str(error)
        return
    raise AssertionError(f"expected {error_type.__name__} mentioning {needle!r}")


def _check_refusals():
    from megatron.hooks.param_gather import apply_dp_compression

    fp32_ddp, _ = _build(overlap=False, bf16=False)
    _expect_error(ValueError, "--bf16", lambda: apply_dp_compression([fp32_ddp], _config("delta")))
    ddp, _ = _build(overlap=False, distributed_optimizer=False)
    _expect_error(ValueError, "--use-distributed-optimizer",
                  lambda: apply_dp_compression([ddp], _config("ciera")))
    ddp, _ = _build(overlap=False)
    for bad_flags, flag in [
        (dict(method="zstd"), "--param-gather-compression"),
        (dict(method="delta", verify_interval=-1), "--param-gather-verify-interval"),
        (dict(method="ciera", ciera_cache_budget_mb=8.0), "--ciera-cache-budget-mb"),
        (dict(method="delta", delta_capacity_factor=1.25, delta_cuda_graphs=True),
         "--delta-cuda-graphs replays CUDA graphs"),
    ]:
        _expect_error(ValueError, flag, lambda: apply_dp_compression([ddp], _config(**bad_flags)))
    apply_dp_compression([ddp], _config("delta"))
    _expect_error(ValueError, "already applied",
                  lambda: apply_dp_compression([ddp], _config("delta")))


def _compare_runs(runs):
    """Train every (method, overlap, rewrite_at) of ``runs`` and the matching uncompressed baseline."""
    results, baselines = {}, {}
    for method, overlap, rewrite_at in runs:
        if (overlap, rewrite_at) not in baselines:
            baselines[overlap, rewrite_at] = _train("none", overlap, rewrite_at)
        baseline = baselines[overlap, rewrite_at]
        run = _train(method, overlap, rewrite_at)
        run["same_losses"] = run.pop("loss_bits") == baseline["loss_bits"]
        run["same_params"] = run.pop("param_hash") == baseline["param_hash"]
        results[method, overlap, rewrite_at] = run
    return results


def _dense_world():
    from megatron.core import parallel_state
    from megatron.hooks import cpu

    cpu.apply()
    parallel_state.initialize_model_parallel()
    _check_refusals()
    # Without the reset a rewrite breaks the codecs' "previous values" invariant; verify() must see it (the integrity
    # check, on by default, re-gathers such a gather: tests/test_integrity.py)
    _expect_error(RuntimeError, "differs from the uncompressed all-gather",
                  lambda: _train("delta", False, rewrite_at=5, reset=False, verify_interval=1,
                                 param_gather_integrity_check=False))
    runs = [(method, overlap, None) for method in ("ciera", "delta") for overlap in (False, True)]
    runs += [("delta", False, 5), ("ciera", True, 5), ("ciera-benefit", True, None), ("delta-benefit", True, None)]
    runs += [("delta-capped", False, None), ("delta-capped", True, None)]
    runs += [("delta-trial", True, None), ("delta-trial", False, None), ("ciera-trial", True, None)]
    runs += [("delta-reselect", True, None)]
    runs += [("delta-slots", False, None), ("delta-slots", True, 5), ("delta-slots-cast", True, None)]
    runs += [("delta-cast", False, None), ("delta-cast", True, 5), ("delta-trial-cast", True, None),
             ("delta-reselect-cast", True, None)]
    _check_trial_wiring()
    return _compare_runs(runs)


def _check_trial_wiring():
    """build_selection_schedule: only with benefit selection and a trial length or a re-selection interval. A
    choice that switches buckets and leaves one compressed gets a trial, no earlier than the selection's window
    (and another trial's iterations) after the start; a choice that switches nothing, or compresses nothing,
    gets none; re-selections restart the measuring every interval, not while a choice is measured or tried."""
    from compression import shard_gather
    from compression.selection import SELECTION_WINDOW_ITERATIONS
    from megatron.hooks import param_gather, param_gather_selection
    from megatron.hooks.param_gather import apply_dp_compression
    from megatron.hooks.param_gather_selection import build_selection_schedule

    ddp, _ = _build(overlap=False)
    apply_dp_compression([ddp], _config("delta", param_gather_trial_iters=4))
    assert build_selection_schedule([ddp], _config("delta", param_gather_trial_iters=4)) is None  # "all": no trial
    idle = build_selection_schedule([_build(overlap=False)[0]], _config("delta-benefit", param_gather_trial_iters=4))
    assert idle is None  # no compression installed on that model
    ddp, _ = _build(overlap=False)
    apply_dp_compression([ddp], _config("delta-benefit", param_gather_trial_iters=4))
    assert build_selection_schedule([ddp], _config("delta-benefit", param_gather_trial_iters=0)) is None
    schedule = build_selection_schedule([ddp], _config("delta-benefit", param_gather_trial_iters=4,
                                                     param_gather_reselect_interval=30), after_iters=12)
    selection, groups = _compressed_groups(ddp)[0].benefit, _compressed_groups(ddp)
    choose = param_gather_selection.select_shards
    try:
        param_gather_selection.select_shards = lambda candidates, comm, budget: {c.key for c in candidates}  # everything
        schedule.before_iteration(1)
        selection._select()  # as at the 9th gather: every bucket switches to a codec
        schedule.before_iteration(2)
        assert schedule.active and schedule.trial.first == 1 + 2 + 12  # after the other trial's 12 iterations
        assert schedule.compressing  # until the trial starts, with a plain iteration
        for iteration in range(3, 31):
            schedule.before_iteration(iteration)
            schedule.after_iteration(iteration, 1.0 if schedule.compressing else 2.0, torch.device("cpu"))
        assert schedule.trial.decided and schedule.compressing  # compressed iterations were faster: kept
        assert not selection.measuring
        schedule.before_iteration(31)  # (31 - 1) % 30 == 0: measuring again, the buckets as they were
        assert selection.measuring and all(g.selection is selection for g in groups) and schedule.compressing
        first_trial = schedule.trial
        selection._select()  # the same choice: nothing switches, no new trial
        schedule.before_iteration(32)
        assert schedule.trial is first_trial and schedule.compressing
        param_gather_selection.select_shards = lambda candidates, comm, budget: set()  # nothing pays any more
        schedule.before_iteration(61)
        selection._select()
        schedule.before_iteration(62)
        assert schedule.trial is first_trial and not schedule.active and not schedule.compressing
    finally:
        param_gather_selection.select_shards = choose
    assert all(isinstance(gather, param_gather.PlainGather) for g in groups for gather in g.shard_gathers)
    schedule = build_selection_schedule([ddp], _config("delta-benefit", param_gather_trial_iters=2,
                                                     param_gather_reselect_interval=20))
    schedule.before_iteration(20)
    schedule.before_iteration(21)  # due, but the selection (restarted by nobody) is not measuring: restarts
    assert selection.measuring
    selection.restart()
    schedule.before_iteration(41)  # due while still measuring (as just after a resume): no restart, no choice
    assert schedule.trial is None and SELECTION_WINDOW_ITERATIONS == 10
    # --delta-cuda-graphs: a trial times replayed gathers, not the new codecs' keyframe, first delta, eager gathers in
    # slots and capture (+1 iteration for overlap); a choice long after the start waits that much, not 2 iterations
    graphs = _config("delta-benefit", param_gather_trial_iters=2, delta_capacity_factor=1.25, delta_cuda_graphs=True)
    assert param_gather_selection.trial_skip_iterations(graphs) == shard_gather.GRAPH_WARMUP + 4
    assert param_gather_selection.trial_skip_iterations(_config("delta-benefit", delta_capacity_factor=1.25)) == 2
    schedule = build_selection_schedule([ddp], graphs)
    schedule.before_iteration(100)
    schedule.start = 100 - SELECTION_WINDOW_ITERATIONS  # the run's first choice is long past
    try:
        param_gather_selection.select_shards = lambda candidates, comm, budget: {c.key for c in candidates}
        selection._select()  # every bucket switches to a new codec
        schedule.before_iteration(101)
        assert schedule.trial.first == 101 + shard_gather.GRAPH_WARMUP + 4 and schedule.compressing
    finally:
        param_gather_selection.select_shards = choose


def _assert_identical(results_by_rank):
    decisions = {run: result["num_compressed"] for run, result in results_by_rank[0].items()}
    for results in results_by_rank:
        assert {run: result["num_compressed"] for run, result in results.items()} == decisions  # ranks agree
        for (name, *setting), result in results.items():
            run = (_base(name), *setting)  # a --delta-fused-cast run behaves as its method's
            assert result["same_losses"] and result["same_params"], (name, run, result)
            if name != run[0] and run in results:  # and sends the same bytes in the steps (no extra keyframes)
                assert result["steps_sent_ratio"] == results[run]["steps_sent_ratio"], (name, result, results[run])
            # Every bucket group gathers once per step (+1 before the first forward with overlap).
            assert result["num_groups"] > 1, (run, result)
            assert result["num_gathers"] >= result["num_groups"] * STEPS, (run, result)
            assert result["undecided"] == 0, (run, result)
            if run[0] == "ciera-benefit":
                assert 0 < result["num_compressed"] < result["num_groups"], (run, result)
                assert len(result["merge_seconds"]) >= result["num_groups"] and min(result["merge_seconds"]) > 0
            elif run[0] == "delta-reselect":  # the odd bucket groups, chosen in the second round
                assert result["selections"] == 2 and result["num_compressed"] == result["num_groups"] // 2, (run, result)
                # the memory a bucket's codec keeps: its sender copy (2 bytes per shard value), none with a fused cast
                cache = result["candidate_cache_bytes"]
                assert len(cache) == 2 and cache[0] == cache[1] and len(cache[0]) >= result["num_groups"], (run, cache)
                assert all(c == 0 for c in cache[0]) if name.endswith(CAST) else min(cache[0]) > 0, (run, cache)
            elif run[0] == "delta-benefit":
                assert 0 <= result["num_compressed"] <= result["num_groups"], (run, result)
            elif run[0].endswith("-trial"):  # switched off for good at step 9
                assert result["num_compressed"] == 0, (run, result)
            else:
                assert result["num_compressed"] == result["num_groups"], (run, result)
            if run[0] in ("ciera", "delta"):
                # each step's gathers share one size exchange (with overlap: + the gather before the first forward)
                assert result["exchanges"] == [result["num_groups"]] * (STEPS + 1), (run, result)
            # delta's buckets (one storage) are coded as one set once they hold state, but with overlap the first
            # bucket group (compressed in "delta", not in "delta-reselect") goes alone; CIERA's never are
            first_alone = int(run[0] == "delta" and run[1])
            expected_fused = result["num_compressed"] - first_alone if run[0] in ("delta", "delta-reselect") else 0
            if run[0] in ("delta", "delta-reselect", "ciera", "ciera-benefit"):
                assert result["fused_buckets"] == expected_fused, (run, result)
            if run[0] == "delta-slots":  # most gathers in slots (not keyframes, nor a new set's first gather)
                assert result["slot_gathers"] >= STEPS // 2, (name, run, result)
                assert result["slot_overflows"] < result["slot_gathers"], (name, run, result)
            else:
                assert result["slot_gathers"] == 0, (name, run, result)
            if run[0] == "delta-capped":  # the same gathers in exchanges of at most a few buckets
                assert sum(result["exchanges"]) == result["num_groups"] * (STEPS + 1), (run, result)
                assert len(result["exchanges"]) >= 3 * (STEPS + 1) and max(result["exchanges"]) <= 4, (run, result)


@pytest.mark.slow
def test_dense_lossless_overlap_verify_reset_selection_and_refusals():
    _assert_identical(run_on_ranks(_dense_world, 2))


# --- Through the training driver (CPU ranks): per-iteration loss and params_checksum -----------------
DRIVER = ("--train-iters 50 --lr-warmup-iters 1 --bf16 --use-distributed-optimizer --overlap-grad-reduce "
          "--overlap-param-gather --mock-data --tokenizer-type NullTokenizer --vocab-size 255 "
          "--eval-interval 1000 --params-checksum-interval 1")
GPT = "--config configs/tiny_cpu_gpt.yaml " + DRIVER
# TP2 x SP with experts EP2 x ETP1 on 4 ranks: dense buckets over DP=2, expert buckets over expert-DP=2.
MOE = ("--config configs/tiny_cpu_moe.yaml --num-layers 2 --tensor-model-parallel-size 2 --sequence-parallel "
       "--expert-model-parallel-size 2 --expert-tensor-parallel-size 1 " + DRIVER)
COMPRESSED = "--param-gather-verify-interval 2 --param-gather-selection all --param-gather-compression"
SMALL_BUCKETS = "--ddp-bucket-size 40000"  # ~6 buckets of the tiny GPT: delta codes all but the first as one set


def _resume_from(checkpoints, iteration: int) -> None:
    """Make ``checkpoints`` look as if the run had stopped after saving ``iteration``: later saves removed."""
    for directory in checkpoints.glob("iter_*"):
        if int(directory.name.removeprefix("iter_")) > iteration:
            shutil.rmtree(directory)
    (checkpoints / "latest_checkpointed_iteration.txt").write_text(str(iteration))


def _assert_same_iterations(reference, run, gathered=True):
    by_iteration = {r["iteration"]: r for r in reference}
    assert run
    for record in run:
        expected = by_iteration[record["iteration"]]
        assert record["loss"] == expected["loss"], record["iteration"]
        assert record["params_checksum"] == expected["params_checksum"], record["iteration"]
        assert (record["comm"]["dp_param_gather"]["raw_bytes"] > 0) == gathered  # the hook did the gathers (or none)


@pytest.mark.slow
def test_driver_dp2_lossless_and_resume(tmp_path):
    """50 uncompressed iterations (saving at 25) vs CIERA from scratch and delta resumed at 25 (chosen by the
    benefit selection, tried, and chosen again; and on every bucket)."""

    checkpoints = tmp_path / "checkpoints"
    reference = launch_training(tmp_path, "none", "pretrain_gpt.py", 2,
                       f"{GPT} {SMALL_BUCKETS} --save {checkpoints} --save-interval 25")
    _resume_from(checkpoints, 25)
    ciera = launch_training(tmp_path, "ciera", "pretrain_gpt.py", 2, f"{GPT} {SMALL_BUCKETS} {COMPRESSED} ciera")
    assert [r["iteration"] for r in ciera] == list(range(1, 51))
    _assert_same_iterations(reference, ciera)
    # Resumed with the benefit selection, its trial and a re-selection from iteration 40 (on the CPU the
    # selection finds that nothing pays: compressing or not, the bits must be the same).
    benefit = ("--param-gather-verify-interval 2 --param-gather-compression delta --param-gather-selection benefit "
               "--param-gather-trial-iters 2 --param-gather-reselect-interval 13")
    delta = launch_training(tmp_path, "delta", "pretrain_gpt.py", 2, f"{GPT} {SMALL_BUCKETS} {benefit} --load {checkpoints}")
    assert [r["iteration"] for r in delta] == list(range(26, 51))
    _assert_same_iterations(reference, delta)
    assert all(isinstance(r["param_gather_compressed"], bool) for r in delta)
    # Resumed with delta on every bucket: keyframes after the load, then the buckets coded as one set.
    delta_all = launch_training(tmp_path, "delta-all", "pretrain_gpt.py", 2,
                                f"{GPT} {SMALL_BUCKETS} {COMPRESSED} delta --load {checkpoints}")
    assert [r["iteration"] for r in delta_all] == list(range(26, 51))
    _assert_same_iterations(reference, delta_all)


@pytest.mark.slow
def test_driver_dp2_delta_fused_cast(tmp_path):
    """--delta-fused-cast (the optimizer's fp32 -> bf16 copy of delta buckets done by the delta encode) against the
    uncompressed run: every bit of the parameters after each step without --overlap-param-gather (checksums); with it
    (where the own shard, like every other shard, keeps the previous values until the next forward's gather) every
    loss, resumed from a checkpoint with the benefit selection, its trial and a re-selection, and resumed on every
    bucket from the checkpoint a fused-cast run saved."""
    checkpoints = tmp_path / "checkpoints"
    sync = GPT.replace("--train-iters 50", "--train-iters 30").replace("--overlap-param-gather", "")
    reference = launch_training(tmp_path, "none", "pretrain_gpt.py", 2,
                                f"{sync} {SMALL_BUCKETS} --save {checkpoints} --save-interval 15")
    cast_checkpoints = tmp_path / "cast_checkpoints"
    cast = launch_training(tmp_path, "cast", "pretrain_gpt.py", 2, f"{sync} {SMALL_BUCKETS} {COMPRESSED} delta "
                           f"--delta-fused-cast --save {cast_checkpoints} --save-interval 15")
    assert [r["iteration"] for r in cast] == list(range(1, 31))
    _assert_same_iterations(reference, cast)
    assert cast[-1]["comm"]["dp_param_gather"]["sent_bytes"] < cast[-1]["comm"]["dp_param_gather"]["raw_bytes"] / 2
    _resume_from(checkpoints, 15)
    overlap = GPT.replace("--train-iters 50", "--train-iters 30").replace("--params-checksum-interval 1", "")
    benefit = ("--param-gather-verify-interval 2 --param-gather-compression delta --param-gather-selection benefit "
               "--param-gather-trial-iters 2 --param-gather-reselect-interval 13 --delta-fused-cast")
    resumed = launch_training(tmp_path, "cast-benefit", "pretrain_gpt.py", 2,
                              f"{overlap} {SMALL_BUCKETS} {benefit} --load {checkpoints}")
    assert [r["iteration"] for r in resumed] == list(range(16, 31))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in reference[15:]]
    # every bucket compressed, from the checkpoint the fused-cast run saved: keyframes after the load, then the fused
    # encodes overlapped with the forward
    _resume_from(cast_checkpoints, 15)
    resumed = launch_training(tmp_path, "cast-all", "pretrain_gpt.py", 2,
                              f"{overlap} {SMALL_BUCKETS} {COMPRESSED} delta --delta-fused-cast --load {cast_checkpoints}")
    assert [r["loss"] for r in resumed] == [r["loss"] for r in reference[15:]]
    assert resumed[-1]["comm"]["dp_param_gather"]["sent_bytes"] < resumed[-1]["comm"]["dp_param_gather"]["raw_bytes"] / 2


@pytest.mark.slow
def test_driver_dp2_fp16_with_skipped_steps(tmp_path):
    """fp16 parameters under dynamic loss scaling: the overflowing steps that the grad scaler skips change no
    parameter and megatron-core gathers none after them, so a codec's state carries over iterations without a
    gather. Both lossless codecs, delta also fused into the optimizer's fp32 -> fp16 copy, give the uncompressed
    run's loss and parameter bits at every step."""
    fp16 = (GPT.replace("--bf16", "--fp16").replace("--train-iters 50", "--train-iters 12")
            .replace("--overlap-param-gather", "") + f" {SMALL_BUCKETS} --initial-loss-scale 1048576 "
            "--loss-scale-window 2 --hysteresis 1")  # the scale doubles every 2 good steps until a step overflows
    reference = launch_training(tmp_path, "none", "pretrain_gpt.py", 2, fp16)
    skipped = [r["iteration"] for r in reference if r["skipped"]]
    assert skipped and skipped[0] == 1 and max(skipped) > min(r["iteration"] for r in reference if not r["skipped"])
    for name, flags in (("ciera", "ciera"), ("delta", "delta"), ("cast", "delta --delta-fused-cast")):
        run = launch_training(tmp_path, name, "pretrain_gpt.py", 2, f"{fp16} {COMPRESSED} {flags}")
        assert [r["iteration"] for r in run] == list(range(1, 13))
        _assert_same_iterations(reference, [r for r in run if not r["skipped"]])
        _assert_same_iterations(reference, [r for r in run if r["skipped"]], gathered=False)
        if name != "ciera":
            assert run[-1]["comm"]["dp_param_gather"]["sent_bytes"] < run[-1]["comm"]["dp_param_gather"]["raw_bytes"]


@pytest.mark.slow
def test_driver_pp2_interleaved_dp2_lossless(tmp_path):
    """PP=2 with 2 virtual stages x DP=2 and Megatron's overlapped gathers: a DDP instance and buckets per model
    chunk, each chunk's gathers dispatched by the previous chunk's forward. Every loss of CIERA, delta, delta in
    slots and delta fused into the optimizer's copy equals the uncompressed run's, and every parameter bit too
    (except with the fused cast, whose own shard keeps its old values until the next forward's gather)."""
    layout = (GPT.replace("--train-iters 50", "--train-iters 12") + f" {SMALL_BUCKETS} "
              "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1")
    reference = launch_training(tmp_path, "none", "pretrain_gpt.py", 4, layout)
    for name, flags in (("ciera", "ciera"), ("delta", "delta"), ("slots", "delta --delta-capacity-factor 1.25"),
                        ("cast", "delta --delta-fused-cast")):
        run = launch_training(tmp_path, name, "pretrain_gpt.py", 4, f"{layout} {COMPRESSED} {flags}")
        assert [r["loss"] for r in run] == [r["loss"] for r in reference], name
        if name != "cast":
            _assert_same_iterations(reference, run)
        gathered = run[-1]["comm"]["dp_param_gather"]
        if name != "ciera":  # (the slots' headroom: ~0.57x of the raw bytes here, the exchange's ~0.35x)
            assert gathered["sent_bytes"] < gathered["raw_bytes"] * 0.6


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory):
    """The uncompressed MoE run both codecs are compared with (one launch for both)."""
    return launch_training(tmp_path_factory.mktemp("moe"), "none", "pretrain_moe.py", 4, MOE)


@pytest.mark.slow
@pytest.mark.parametrize("codec", ["delta", "ciera"])
def test_driver_moe_tp2_ep2(tmp_path, codec, moe_reference):
    """Dense buckets over DP=2 with TP=2 + SP, expert buckets over expert-DP=2 (EP=2), 50 iterations."""

    compressed = launch_training(tmp_path, codec, "pretrain_moe.py", 4, f"{MOE} {COMPRESSED} {codec}")
    assert [r["iteration"] for r in compressed] == list(range(1, 51))
    _assert_same_iterations(moe_reference, compressed)
    # On this toy every CIERA block changes each step (nothing to reuse), so the wire carries the full
    # values plus each gather's fixed cost: the size message (8 bytes and the 32-byte header the decoders
    # take on the host), the payload's header, the change bitmap and padding to 16 bytes. Measured over raw:
    # experts 0.13%, dense 1.8% (~30 KB of dense shards per rank and iteration: the fixed cost weighs more).
    ciera_bound = {"dp_expert_param_gather": 1.01, "dp_param_gather": 1.03}
    for comm_class, bound in ciera_bound.items():  # dense and expert buckets are counted apart
        gather = compressed[-1]["comm"][comm_class]
        assert gather["raw_bytes"] > 0, comm_class
        if codec == "delta":
            assert gather["sent_bytes"] < gather["raw_bytes"], comm_class
        else:
            assert gather["sent_bytes"] <= bound * gather["raw_bytes"], comm_class
    assert moe_reference[-1]["comm"]["dp_expert_param_gather"]["raw_bytes"] == 0  # no hook, no count


@pytest.mark.slow
def test_driver_dp4_two_optimizer_instances(tmp_path):
    """--num-distributed-optimizer-instances 2 at DP=4: each codec gathers within its copy of the distributed
    optimizer (2 ranks) and the copies all-reduce their gradient shards. CIERA and delta give the uncompressed run's
    loss and parameter bits at every step, also resumed from its checkpoint and with the benefit selection and its
    trial (delta fused into the optimizer's cast: every loss), SDP4Bit's weights are the same on all four replicas, and the training follows the one-copy run
    (the same sums of gradients, added in another order)."""
    checkpoints = tmp_path / "checkpoints"
    run = GPT.replace("--train-iters 50", "--train-iters 12") + f" {SMALL_BUCKETS}"
    copies = f"{run} --num-distributed-optimizer-instances 2"
    one_copy = launch_training(tmp_path, "one-copy", "pretrain_gpt.py", 4, run)
    reference = launch_training(tmp_path, "none", "pretrain_gpt.py", 4,
                                f"{copies} --save {checkpoints} --save-interval 6")
    assert [r["loss"] for r in reference] == pytest.approx([r["loss"] for r in one_copy], rel=2e-2)
    for name, flags in (("ciera", "ciera"), ("delta", "delta")):
        compressed = launch_training(tmp_path, name, "pretrain_gpt.py", 4, f"{copies} {COMPRESSED} {flags}")
        assert [r["iteration"] for r in compressed] == list(range(1, 13))
        _assert_same_iterations(reference, compressed)
    benefit = launch_training(tmp_path, "benefit", "pretrain_gpt.py", 4, f"{copies} --param-gather-verify-interval 2 "
                              "--param-gather-compression delta --param-gather-trial-iters 2")  # (per copy)
    _assert_same_iterations(reference, benefit)
    cast = launch_training(tmp_path, "cast", "pretrain_gpt.py", 4, f"{copies} {COMPRESSED} delta --delta-fused-cast")
    assert [r["loss"] for r in cast] == [r["loss"] for r in reference]  # (its own shard is gathered with the rest)
    # the lossy weight differences: every replica of both copies holds the same weights (the run stops otherwise)
    lossy = launch_training(tmp_path, "sdp4bit", "pretrain_gpt.py", 4, f"{copies} {COMPRESSED} sdp4bit "
                            "--check-weight-hash-across-dp-replicas-interval 2")
    assert [r["loss"] for r in lossy] == pytest.approx([r["loss"] for r in reference], rel=2e-2)
    _resume_from(checkpoints, 6)
    resumed = launch_training(tmp_path, "delta-resumed", "pretrain_gpt.py", 4,  # (no gloo groups of megatron-core's)
                              f"{copies} {COMPRESSED} delta --load {checkpoints} --disable-gloo-process-groups")
    assert [r["iteration"] for r in resumed] == list(range(7, 13))
    _assert_same_iterations(reference, resumed)
    gathered = resumed[-1]["comm"]["dp_param_gather"]
    assert gathered["sent_bytes"] < gathered["raw_bytes"]


@pytest.mark.slow
def test_driver_dp2_counted_and_padded_buckets(tmp_path):
    """--ddp-num-buckets and --ddp-pad-buckets-for-high-nccl-busbw reach megatron-core's buckets, and delta codes the
    padded buckets bit for bit: the uncompressed run's losses and parameters. Each rank's raw gather bytes are its
    buckets' padded sizes, whole multiples of 2^16 values: 2 x 2^16 for the tiny GPT's ~110K parameters in one
    bucket, more for the same parameters in four buckets (each padded on its own)."""
    run = GPT.replace("--train-iters 50", "--train-iters 4") + " --ddp-pad-buckets-for-high-nccl-busbw"
    reference = launch_training(tmp_path, "none", "pretrain_gpt.py", 2, f"{run} --ddp-num-buckets 4")
    runs = {buckets: launch_training(tmp_path, f"delta{buckets}", "pretrain_gpt.py", 2,
                                     f"{run} --ddp-num-buckets {buckets} {COMPRESSED} delta") for buckets in (1, 4)}
    _assert_same_iterations(reference, runs[4])
    raw = {buckets: records[-1]["comm"]["dp_param_gather"]["raw_bytes"] // 2 for buckets, records in runs.items()}
    value_bytes, padding = 2, 2**16
    assert raw[1] == 2 * padding * value_bytes
    assert raw[4] > raw[1] and raw[4] % (padding * value_bytes) == 0
