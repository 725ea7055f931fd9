"""Model and MoE flags of Megatron-LM's launch scripts (GPT, Llama, Mixtral/DeepSeek/Qwen-style MoE): what each sets
in megatron-core's TransformerConfig and GPTModel, the layers the local spec then builds, and two tiny CPU runs.

- Parsing: every flag reaches the config with Megatron-LM's default and meaning (``core_transformer_config``).
- Building (one process): --qk-layernorm puts a norm on queries and keys (--qk-l2-norm a weightless one, dense and
  MoE), RoPE scaling and interpolation change the rotary frequencies and positions, --init-method-xavier-uniform
  fills to the Xavier bound, --moe-layer-freq mixes dense and MoE layers, the shared expert and the expert bias exist,
  --moe-apply-probs-on-input reaches the experts and changes the logits of the same weights.
- Training (slow): TP=2 + SP bf16 with --qk-layernorm and the attention flags; EP=2 MoE with sigmoid routing,
  the expert bias, a gated shared expert, capacity dropping, z-loss and per-layer logging. Losses must be finite and
  fall, and the expert bias, which ``finalize_model_grads`` updates after every step, must have moved (read back
  from the checkpoint).
"""

import math

import pytest
import torch

from dist_utils import launch_training, run_on_ranks
from megatron.hooks.version import mcore_at_least
from test_arguments import make
from test_parallel_training import GPT, MOE

MOE_BASE = "--num-experts 8 --disable-bias-linear"
# DeepSeek-V3's router (sigmoid scores, expert bias, group-limited top-k, scaled weights, fp32 routing), a
# shared expert and a dense first layer, scaled down to 8 experts in 2 groups and 4 layers
DEEPSEEK_STYLE = ("--moe-layer-freq ([0]*1+[1]*3) --moe-router-score-function sigmoid --moe-router-enable-expert-bias "
                  "--moe-router-bias-update-rate 1e-2 --moe-router-topk 4 --moe-router-num-groups 2 "
                  "--moe-router-group-topk 1 --moe-router-pre-softmax --moe-router-topk-scaling-factor 2.5 "
                  "--moe-router-dtype fp32 --moe-shared-expert-intermediate-size 64 --moe-shared-expert-overlap "
                  "--moe-token-dispatcher-type alltoall --moe-z-loss-coeff 1e-3 --moe-per-layer-logging "
                  "--moe-expert-capacity-factor 1.5 --moe-pad-expert-input-to-capacity --moe-token-drop-policy position")


def _config(flags=""):
    from megatron.training.model import core_transformer_config

    return core_transformer_config(make(flags))


def test_model_flags_reach_transformer_config():
    config = _config("--qk-layernorm --apply-query-key-layer-scaling --init-method-xavier-uniform "
                     "--use-cpu-initialization --no-persist-layer-norm")
    assert config.qk_layernorm and config.apply_query_key_layer_scaling
    assert config.attention_softmax_in_fp32  # implied by the layer scaling
    xavier = torch.nn.init.xavier_uniform_
    assert config.init_method is xavier and config.output_layer_init_method is xavier
    assert config.embedding_init_method is xavier
    assert config.use_cpu_initialization and not config.persist_layer_norm
    plain = _config()  # Megatron-LM's defaults
    assert not (plain.qk_layernorm or plain.apply_query_key_layer_scaling or plain.fp32_residual_connection)
    assert not plain.attention_softmax_in_fp32 and plain.init_method is not xavier
    assert _config("--bf16 --attention-softmax-in-fp32").attention_softmax_in_fp32
    scaled = make("--no-attention-softmax-in-fp32 --apply-query-key-layer-scaling")
    assert scaled.attention_softmax_in_fp32  # implied by the layer scaling; args show it, as Megatron-LM's do


def test_position_embedding_and_rope_flags():
    # Mixtral's script: rope with the deprecated --no-position-embedding, which then changes nothing
    args = make("--position-embedding-type rope --no-position-embedding")
    assert args.position_embedding_type == "rope" and not args.add_position_embedding
    assert make("--position-embedding-type none --no-position-embedding").position_embedding_type == "none"
    args = make("--use-rotary-position-embeddings --use-rope-scaling --rope-scaling-factor 4 "
                "--rotary-seq-len-interpolation-factor 2")
    assert args.use_rope_scaling and (args.rope_scaling_factor, args.rotary_seq_len_interpolation_factor) == (4.0, 2)
    defaults = make()
    assert (defaults.use_rope_scaling, defaults.rope_scaling_factor) == (False, 8.0)  # Megatron-LM's
    assert defaults.rotary_seq_len_interpolation_factor is None and defaults.add_position_embedding


def test_bias_gelu_fusion_both_spellings(tmp_path):
    assert make().bias_gelu_fusion and not make("--no-bias-gelu-fusion").bias_gelu_fusion
    assert make("--no-bias-gelu-fusion --bias-gelu-fusion").bias_gelu_fusion  # the last one wins
    assert not make("--disable-bias-linear").bias_gelu_fusion  # no bias to fuse (Megatron-LM)
    config = tmp_path / "c.yaml"
    config.write_text("no-bias-gelu-fusion: true\n")
    assert make(f"--config {config} --bias-gelu-fusion").bias_gelu_fusion
    assert not make(f"--config {config}").bias_gelu_fusion
    config.write_text("bias-gelu-fusion: false\n")
    assert not make(f"--config {config}").bias_gelu_fusion


def test_moe_flags_reach_transformer_config():
    config = _config(f"{MOE_BASE} {DEEPSEEK_STYLE}")
    assert config.moe_layer_freq == [0, 1, 1, 1]
    assert (config.moe_router_score_function, config.moe_router_dtype) == ("sigmoid", "fp32")
    assert config.moe_router_enable_expert_bias and config.moe_router_bias_update_rate == 1e-2
    assert (config.moe_router_num_groups, config.moe_router_group_topk) == (2, 1)
    assert config.moe_router_pre_softmax and config.moe_router_topk_scaling_factor == 2.5
    assert config.moe_shared_expert_intermediate_size == 64 and config.moe_shared_expert_overlap
    assert config.moe_z_loss_coeff == 1e-3 and config.moe_per_layer_logging
    assert config.moe_expert_capacity_factor == 1.5 and config.moe_pad_expert_input_to_capacity
    assert config.moe_token_drop_policy == "position" and not config.moe_permute_fusion
    plain = _config(MOE_BASE)  # Megatron-LM's (and megatron-core's) defaults
    assert plain.moe_layer_freq == 1 and plain.moe_router_score_function == "softmax"
    assert plain.moe_router_dtype is None and plain.moe_z_loss_coeff is None
    assert not (plain.moe_router_enable_expert_bias or plain.moe_router_pre_softmax or plain.moe_per_layer_logging)
    assert plain.moe_router_bias_update_rate == 1e-3 and plain.moe_token_drop_policy == "probs"
    assert plain.moe_expert_capacity_factor is None and plain.moe_shared_expert_intermediate_size is None


@pytest.mark.parametrize("value, pattern", [
    ("2", 2),
    ("([0]*1+[1]*3)", [0, 1, 1, 1]),
    ("[0]*2+[1]*2", [0, 0, 1, 1]),  # DeepSeek-R1's conf writes it without parentheses
])
def test_moe_layer_freq_forms(value, pattern):
    assert make(f"{MOE_BASE} --moe-layer-freq {value}").moe_layer_freq == pattern


def test_moe_layer_freq_in_yaml_and_bad_values(tmp_path):
    from megatron.training.arguments import parse_args

    config = tmp_path / "c.yaml"
    config.write_text("moe-layer-freq: [0, 1, 0, 1]\n")
    assert make(f"{MOE_BASE} --config {config}").moe_layer_freq == [0, 1, 0, 1]
    config.write_text("moe-layer-freq: '([1]*4)'\n")
    assert make(f"{MOE_BASE} --config {config}").moe_layer_freq == [1, 1, 1, 1]
    config.write_text("moe-layer-freq: __import__('os')\n")
    with pytest.raises(ValueError, match="'moe-layer-freq': --moe-layer-freq takes an int or a list expression"):
        parse_args(["--config", str(config)])
    with pytest.raises(SystemExit):  # argparse's usage error names the flag
        parse_args(["--moe-layer-freq", "[1]*2+os"])


def test_flops_count_dense_layers_and_the_shared_expert():
    """One dense layer (MLP 256) and three MoE layers (2 routed experts of 64 and a shared one of 32 per token):
    the FLOPs of a dense model whose every MLP has the mean width (256 + 3 x 160) / 4 = 184."""
    from megatron.training import metrics
    from megatron.training.arguments import set_padded_vocab_size

    mixed = make("--num-experts 4 --disable-bias-linear --moe-ffn-hidden-size 64 --moe-layer-freq ([0]*1+[1]*3) "
                 "--moe-shared-expert-intermediate-size 32")
    dense = make("--ffn-hidden-size 184")
    for args in (mixed, dense):
        set_padded_vocab_size(args, 255)
    assert metrics.gpt_flops_per_iteration(mixed, 8) == pytest.approx(metrics.gpt_flops_per_iteration(dense, 8), rel=1e-12)


def test_moe_permute_fusion_needs_transformer_engine(monkeypatch):
    import megatron.training.arguments as arguments

    monkeypatch.setattr(arguments, "transformer_engine_installed", lambda: False)
    with pytest.raises(ValueError, match="--moe-permute-fusion runs Transformer Engine's fused permutation"):
        make(f"{MOE_BASE} --moe-permute-fusion")


def _built_layers():
    """What the local spec builds from the flags: per model, the facts the test checks."""
    from megatron.training.arguments import parse_args, set_padded_vocab_size, validate_args
    from megatron.training.initialize import initialize_megatron
    from megatron.training.model import build_model_chunks, core_transformer_config

    def build(flags):
        args = validate_args(parse_args((GPT + " " + flags).split()), world_size=1, rank=0)
        set_padded_vocab_size(args, 255)
        return build_model_chunks(args, core_transformer_config(args))[0]

    initialize_megatron(validate_args(parse_args(GPT.split()), world_size=1, rank=0))
    rope = "--position-embedding-type rope"
    plain_rope = build(rope)
    scaled = build(f"{rope} --use-rope-scaling --rope-scaling-factor 4 --rotary-seq-len-interpolation-factor 2 "
                   "--qk-layernorm --init-method-xavier-uniform")
    fc1 = scaled.decoder.layers[0].mlp.linear_fc1.weight
    moe = build("--disable-bias-linear --num-experts 4 --moe-ffn-hidden-size 64 --moe-layer-freq ([0]*1+[1]*3) "
                "--moe-shared-expert-intermediate-size 32 --moe-router-score-function sigmoid "
                "--moe-router-enable-expert-bias --qk-layernorm")
    l2_models = [build(f"{rope} --qk-l2-norm"),
                 build("--disable-bias-linear --num-experts 4 --qk-layernorm --qk-l2-norm")]
    # Llama 4's top-1 routing, each token scaled by its probability before its expert instead of after (the GeLU
    # experts are not linear, so the same weights give other logits)
    top1 = ("--disable-bias-linear --num-experts 4 --moe-ffn-hidden-size 64 --moe-router-topk 1 "
            "--moe-router-score-function sigmoid")
    after, on_input = build(top1), build(top1 + " --moe-apply-probs-on-input")
    on_input.load_state_dict(after.state_dict())
    tokens = torch.randint(0, 255, (2, 32), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(32).expand(2, -1)
    with torch.no_grad():
        logits = [model(tokens, positions, None) for model in (after, after, on_input)]
    return {
        "q_k_norms": [(type(layer.self_attention.q_layernorm).__name__, type(layer.self_attention.k_layernorm).__name__)
                      for model in (plain_rope, scaled, moe, *l2_models) for layer in model.decoder.layers[:2]],
        "probs_on_input": (on_input.decoder.layers[0].mlp.config.moe_apply_probs_on_input,
                           torch.equal(logits[0], logits[1]), torch.equal(logits[0], logits[2])),
        "inv_freq_ratio": (plain_rope.rotary_pos_emb.inv_freq / scaled.rotary_pos_emb.inv_freq).tolist(),
        "interpolation": scaled.rotary_pos_emb.seq_len_interpolation_factor,
        "fc1_max_over_xavier_bound": (fc1.abs().max() / math.sqrt(6 / sum(fc1.shape))).item(),
        "mlps": [type(layer.mlp).__name__ for layer in moe.decoder.layers],
        "shared_expert_width": moe.decoder.layers[1].mlp.shared_experts.linear_fc1.weight.shape[0],
        "expert_bias": moe.decoder.layers[1].mlp.router.expert_bias.tolist(),
    }


def test_local_spec_builds_what_the_flags_ask():
    (built,) = run_on_ranks(_built_layers, 1)
    no_norm = [("NoneType", "NoneType")] if mcore_at_least("0.18") else [("IdentityOp", "IdentityOp")]
    assert built["q_k_norms"] == no_norm * 2 + [("LayerNorm", "LayerNorm")] * 4 + [("L2Norm", "L2Norm")] * 4
    assert built["probs_on_input"] == (True, True, False)
    # Llama 3.1 scaling: the highest frequency kept, the lowest (a wavelength beyond 8192 tokens) divided by 4
    ratios = built["inv_freq_ratio"]
    assert ratios[0] == 1.0 and ratios[-1] == pytest.approx(4.0) and ratios == sorted(ratios)
    assert built["interpolation"] == 2
    # uniform in +-sqrt(6 / (fan_in + fan_out)): 16384 draws reach near the bound (the normal of std 0.02 stays
    # below 0.7 of it)
    assert 0.95 < built["fc1_max_over_xavier_bound"] <= 1.0
    assert built["mlps"] == ["MLP", "MoELayer", "MoELayer", "MoELayer"]
    assert built["shared_expert_width"] == 32 and built["expert_bias"] == [0.0] * 4


def _assert_trained(records):
    losses = [record["loss"] for record in records]
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0], losses


@pytest.mark.slow
def test_qk_layernorm_and_attention_flags_train(tmp_path):
    records = launch_training(
        tmp_path, "qk_layernorm", "pretrain_gpt.py", 2,
        GPT + " --tensor-model-parallel-size 2 --sequence-parallel --bf16 --qk-layernorm "
        "--apply-query-key-layer-scaling --position-embedding-type rope --no-position-embedding --use-rope-scaling "
        "--init-method-xavier-uniform --no-persist-layer-norm")
    _assert_trained(records)


def _saved(checkpoint) -> dict:
    """The model's tensors as saved (torch_dist format read back into one state dict)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    merged = checkpoint.parent / "merged.pt"
    dcp_to_torch_save(checkpoint, merged)
    return torch.load(merged, weights_only=False)


@pytest.mark.slow
def test_moe_router_flags_train_and_move_the_expert_bias(tmp_path):
    records = launch_training(
        tmp_path, "moe_router", "pretrain_moe.py", 2,
        MOE + " --expert-model-parallel-size 2 --train-iters 3 --moe-layer-freq ([0]*1+[1]*1) "
        "--moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-dtype fp64 "
        "--moe-shared-expert-intermediate-size 64 --moe-shared-expert-overlap --moe-shared-expert-gate "
        "--moe-expert-capacity-factor 1.0 "
        f"--moe-token-drop-policy position --moe-z-loss-coeff 1e-3 --moe-per-layer-logging --save {tmp_path / 'ckpt'}")
    _assert_trained(records)
    last = records[-1]
    per_layer = last["moe_per_layer"]
    assert set(per_layer) == {"load_balancing_loss", "z_loss"}
    for name, key in (("load_balancing_loss", "moe_aux_loss"), ("z_loss", "moe_z_loss")):
        # layer 0 is dense; the mean is over the one MoE layer
        assert per_layer[name][0] == 0.0 and per_layer[name][1] == last[key] > 0, name
    saved = _saved(tmp_path / "ckpt" / "iter_0000003")
    bias = saved["decoder.layers.1.mlp.router.expert_bias"]
    assert bias.dtype == torch.float32 and bias.abs().sum() > 0, bias  # steps of 1e-3 after every iteration
    assert saved["decoder.layers.1.mlp.shared_experts.gate_weight"].shape == (1, 64)  # Qwen2-MoE's shared-expert gate
