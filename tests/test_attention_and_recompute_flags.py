"""Megatron-LM's attention-form, recompute and replica-check flags, as gpt-oss, Qwen2, Mistral and Llama 4 launch
scripts give them: --window-size with --window-attn-skip-freq (sliding-window attention per layer), --softmax-type,
--no-rope-freq (layers without RoPE), --rotary-interleaved, --add-qkv-bias, --recompute-modules,
--moe-router-force-load-balancing and --check-weight-hash-across-dp-replicas-interval; learnable softmax logits and
the attention output gate at TP=2 against one process.

In one process: which layers get a window and which softmax, the projections' biases, what reaches megatron-core's
config, that a window changes the logits only when it is shorter than the sequence, and that a model whose every
layer skips RoPE is the model without position embedding (same weights, same logit bits); selective recompute of
attention, MLP and norms gives the same gradient bits as no recompute (the backward recomputes the same operations).
One driver run: DP=2 with every new attention form, overlapped delta-coded parameter gathers and the weight-hash
check at start and every 2 iterations, which stops the run on any difference between replicas.
"""

import pytest
import torch

from dist_utils import launch_training, run_on_ranks
from test_parallel_training import GPT, assert_same_trajectory

WINDOWED = "--window-size 8,0 --window-attn-skip-freq 2"


def _build(flags: str, initialize: bool):
    from megatron.training.arguments import parse_args, set_padded_vocab_size, validate_args
    from megatron.training.initialize import initialize_megatron
    from megatron.training.model import build_model_chunks, core_transformer_config

    args = validate_args(parse_args((GPT + " " + flags).split()), world_size=1, rank=0)
    if initialize:
        initialize_megatron(args)
    set_padded_vocab_size(args, 255)
    config = core_transformer_config(args)
    return args, config, build_model_chunks(args, config)[0]


def _core_attentions(model):
    return [layer.self_attention.core_attention for layer in model.decoder.layers]


def _logits(model, tokens):
    position_ids = torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1)
    with torch.no_grad():
        return model(tokens, position_ids, None)


def _layer_forms() -> dict:
    from megatron.training import model as model_module

    _, _, plain = _build("", initialize=True)
    results = {}
    for name, flags in {"every_2nd_full": WINDOWED, "listed": "--window-size (8,0) --window-attn-skip-freq ([1]*3+[0])",
                        "window_past_sequence": "--window-size 32,0", "window_2": "--window-size 2,0"}.items():
        args, _, windowed = _build(flags, initialize=False)
        windowed.load_state_dict(plain.state_dict())
        tokens = torch.randint(0, 255, (2, args.seq_length), generator=torch.Generator().manual_seed(0))
        results[name] = ([a.scale_mask_softmax.window_size for a in _core_attentions(windowed)],
                         torch.equal(_logits(windowed, tokens), _logits(plain, tokens)))
    for softmax_type in ("off-by-one", "learnable"):
        _, config, model = _build(f"--softmax-type {softmax_type}", initialize=False)
        offsets = [a.softmax_offset for a in _core_attentions(model)]
        results[softmax_type] = (config.softmax_type, [type(o).__name__ for o in offsets],
                                 [o.shape[0] for o in offsets], all(torch.equal(o, torch.zeros_like(o)) for o in offsets))
    _, _, halves = _build("--position-embedding-type rope", initialize=False)
    args, config, interleaved = _build("--position-embedding-type rope --rotary-interleaved", initialize=False)
    interleaved.load_state_dict(halves.state_dict())
    tokens = torch.randint(0, 255, (2, args.seq_length), generator=torch.Generator().manual_seed(0))
    results["rotary_interleaved"] = (config.rotary_interleaved,
                                     torch.equal(_logits(interleaved, tokens), _logits(halves, tokens)))
    # Llama 4's NoPE layers: with every layer skipping RoPE the model is the one without position embedding
    rope = {}
    for name, flags in {"rope": "rope", "none": "none", "all": "rope --no-rope-freq 1", "2nd": "rope --no-rope-freq 2",
                        "listed": "rope --no-rope-freq ([0]*3+[1])"}.items():
        args, config, model = _build(f"--position-embedding-type {flags}", initialize=False)
        if rope:
            model.load_state_dict(rope["rope"][1], strict=False)  # (no rotary buffers without RoPE)
        tokens = torch.randint(0, 255, (2, args.seq_length), generator=torch.Generator().manual_seed(0))
        rope[name] = (config.no_rope_freq, model.state_dict(), _logits(model, tokens))
    results["no_rope"] = {name: (freq, torch.equal(logits, rope["none"][2]), torch.equal(logits, rope["rope"][2]))
                          for name, (freq, _, logits) in rope.items()}
    _, config, model = _build("--add-qkv-bias --disable-bias-linear", initialize=False)
    attention = model.decoder.layers[0].self_attention
    results["qkv_bias"] = (config.add_qkv_bias, attention.linear_qkv.bias is not None, attention.linear_proj.bias)
    args, config, _ = _build("--disable-bias-linear --recompute-granularity selective --recompute-modules mlp layernorm "
                             "--moe-router-force-load-balancing", initialize=False)
    results["config"] = (config.recompute_modules, config.moe_router_force_load_balancing)
    # megatron-core's fused softmax masks causally only, so a window keeps it off even where the kernel is installed
    model_module._has_fused_softmax = lambda: True
    results["fused_softmax"] = [model_module.core_transformer_config(_build(flags + " --bf16", False)[0])
                                .masked_softmax_fusion for flags in ("", WINDOWED)]
    return results


def test_window_softmax_and_bias_flags_build_what_they_ask():
    (results,) = run_on_ranks(_layer_forms, 1)
    window = (8, 0)
    assert results["every_2nd_full"] == ([window, None, window, None], False)  # layers 2 and 4 full
    assert results["listed"] == ([window] * 3 + [None], False)
    assert results["window_past_sequence"] == ([(32, 0)] * 4, True)  # every key of a 32-token causal row is in it
    assert results["window_2"] == ([(2, 0)] * 4, False)
    assert results["off-by-one"] == ("off-by-one", ["Tensor"] * 4, [4] * 4, True)  # a fixed zero logit per head
    assert results["learnable"][:3] == ("learnable", ["Parameter"] * 4, [4] * 4)
    assert not results["learnable"][3]  # initialized with --init-method-std
    assert results["rotary_interleaved"] == (True, False)  # other pairs rotated: other logits
    assert results["no_rope"] == {"rope": (None, False, True), "none": (None, True, False),
                                  "all": ([1, 1, 1, 1], True, False), "2nd": ([0, 1, 0, 1], False, False),
                                  "listed": ([0, 0, 0, 1], False, False)}
    assert results["qkv_bias"] == (True, True, None)
    assert results["config"] == (["mlp", "layernorm"], True)
    assert results["fused_softmax"] == [True, False]


def _recompute_grads_against_plain() -> tuple:
    """Names of the parameters whose gradient bits differ between a bias-free GPT and the same GPT (same weights)
    recomputing attention, MLP and norms in backward, after one forward-backward of the same tokens; and the
    recompute switches of the second model's first layer."""
    grads = []
    for flags in ("--disable-bias-linear", "--disable-bias-linear --recompute-granularity selective "
                                           "--recompute-modules core_attn mlp layernorm"):
        args, _, model = _build(flags, initialize=not grads)
        if grads:
            model.load_state_dict(plain_state)
        plain_state = model.state_dict()
        tokens = torch.randint(0, 255, (2, args.seq_length), generator=torch.Generator().manual_seed(0))
        position_ids = torch.arange(args.seq_length).expand(2, -1)
        model(tokens, position_ids, None, labels=tokens).float().mean().backward()
        grads.append({name: p.main_grad if hasattr(p, "main_grad") else p.grad for name, p in model.named_parameters()})
    plain, recomputed = grads
    layer = model.decoder.layers[0]
    switches = (model.decoder.config.recompute_granularity, layer.recompute_input_layernorm,
                layer.recompute_pre_mlp_layernorm, layer.recompute_mlp)
    return [name for name in plain if not torch.equal(plain[name], recomputed[name])], switches


def test_selective_recompute_of_every_module_gives_the_same_gradient_bits():
    ((differing, switches),) = run_on_ranks(_recompute_grads_against_plain, 1)
    assert switches == ("selective", True, True, True)
    assert differing == []


@pytest.mark.slow
def test_new_attention_forms_train_with_replicas_checked(tmp_path):
    flags = (GPT + f" {WINDOWED} --softmax-type learnable --add-qkv-bias --disable-bias-linear --train-iters 6 --bf16 "
             "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --param-gather-compression delta "
             "--check-weight-hash-across-dp-replicas-interval 2")
    records = launch_training(tmp_path, "forms", "pretrain_gpt.py", 2, flags)
    assert [r["iteration"] for r in records] == list(range(1, 7))
    assert records[-1]["loss"] < records[0]["loss"]
    rank0 = tmp_path / "forms_logs" / "0"
    log = (rank0 / "stdout.log").read_text() + (rank0 / "stderr.log").read_text()
    checked = [int(line.rsplit(" ", 2)[-2]) for line in log.splitlines()
               if "weight hashes match across data-parallel replicas after" in line]
    assert checked == [0, 2, 4, 6]


@pytest.mark.slow
def test_learnable_softmax_at_tp2_follows_the_single_process_run(tmp_path):
    """megatron-core's local attention keeps a TP rank's heads' learnable logits in a parameter without its
    tensor-parallel attributes (megatron/hooks/compat.py adds them): with them the logits are initialized as slices
    of one tensor and the gradient norm counts every rank's heads, so TP=2 follows one process (without, the norm
    counted rank 0's heads only)."""
    flags = GPT + " --softmax-type learnable"
    reference = launch_training(tmp_path, "single", "pretrain_gpt.py", 1, flags)
    parallel = launch_training(tmp_path, "tp2", "pretrain_gpt.py", 2, flags + " --tensor-model-parallel-size 2")
    assert_same_trajectory(reference, parallel, ["loss", "grad_norm", "eval_loss"])
    assert parallel[-1]["loss"] < parallel[0]["loss"]


@pytest.mark.slow
def test_attention_output_gate_at_tp2_follows_the_single_process_run(tmp_path):
    """--attention-output-gate widens each query group's rows of the QKV projection by its heads' gates: split over
    TP=2 by groups (GQA, 2 groups) and initialized layout-independently, the run follows one process."""
    flags = GPT + " --group-query-attention --num-query-groups 2 --attention-output-gate"
    reference = launch_training(tmp_path, "single", "pretrain_gpt.py", 1, flags)
    parallel = launch_training(tmp_path, "tp2", "pretrain_gpt.py", 2, flags + " --tensor-model-parallel-size 2")
    assert_same_trajectory(reference, parallel, ["loss", "grad_norm", "eval_loss"])
    plain = launch_training(tmp_path, "plain", "pretrain_gpt.py", 1, GPT + " --group-query-attention "
                            "--num-query-groups 2")
    assert plain[0]["loss"] != reference[0]["loss"]  # the gate (at its random init) changes the model


def _gpt_oss_mlp_against_formula() -> tuple:
    """A layer's MLP built with gpt-oss's activation flags, against the formula on its own weights and inputs large
    enough to hit both clamps."""
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    _, config, model = _build("--quick-geglu --glu-linear-offset 1.0 --activation-func-clamp-value 0.5", True)
    mlp = model.decoder.layers[0].mlp
    x = torch.randn(5, 2, config.hidden_size) * 20
    with torch.no_grad():
        out, bias = mlp(x)
        fc1 = x @ mlp.linear_fc1.weight.t() + mlp.linear_fc1.bias
        gate, linear = torch.chunk(fc1, 2, dim=-1)
        hidden = quick_gelu(gate.clamp(max=0.5)) * (linear.clamp(-0.5, 0.5) + 1.0)
        expected = hidden @ mlp.linear_fc2.weight.t()
    clamped = float((gate > 0.5).float().mean()), float((linear.abs() > 0.5).float().mean())
    return (config.glu_linear_offset, config.activation_func_clamp_value), (out - expected).abs().max().item(), clamped


def test_gpt_oss_activation_follows_its_formula():
    """--glu-linear-offset and --activation-func-clamp-value (gpt-oss: 1.0 and 7.0) reach megatron-core, whose gated
    MLP then computes quick_gelu(min(gate, c)) * (clamp(linear, -c, c) + offset); the errors name the flags where a
    fused or legacy kernel would leave them out."""
    ((settings, error, clamped),) = run_on_ranks(_gpt_oss_mlp_against_formula, 1)
    assert settings == (1.0, 0.5) and error < 1e-5 and min(clamped) > 0.1
    from megatron.training.arguments import parse_args, validate_args

    for flags, message in (("--glu-linear-offset 1.0", "shape a gated MLP: add --quick-geglu"),
                           ("--swiglu --activation-func-clamp-value 7", "add --no-bias-swiglu-fusion"),
                           ("--quick-geglu --activation-func-clamp-value -1", "must be positive")):
        with pytest.raises(ValueError, match=message):
            validate_args(parse_args((GPT + " " + flags).split()), world_size=1, rank=0)


def _mismatch_raises() -> str:
    from megatron.core import utils
    from megatron.training import training
    from megatron.training.arguments import parse_args

    args = parse_args(GPT.split())
    utils.check_param_hashes_across_dp_replicas = lambda model, cross_check: False
    try:
        training.check_weight_hashes(args, [], 4)
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_weight_hash_mismatch_stops_the_run():
    (message,) = run_on_ranks(_mismatch_raises, 1)
    assert message == ("after iteration 4 the data-parallel replicas hold different weights "
                       "(--check-weight-hash-across-dp-replicas-interval)")


@pytest.mark.parametrize("value, window", [("128,0", (128, 0)), ("(128, 0)", (128, 0)), ([64, 0], (64, 0)),
                                           ("-1,0", (-1, 0))])
def test_window_size_forms(value, window):
    from megatron.training.arguments import window_size_type

    assert window_size_type(value) == window


@pytest.mark.parametrize("value", ["8", "8,0,1", "a,b"])
def test_window_size_needs_two_ints(value):
    import argparse

    from megatron.training.arguments import window_size_type

    with pytest.raises(argparse.ArgumentTypeError, match="--window-size takes two ints LEFT,RIGHT"):
        window_size_type(value)
