"""Model flags of Megatron-LM's launch scripts (GPT, Llama, Mixtral/DeepSeek/Qwen-style MoE): what each sets in
megatron-core's TransformerConfig and GPTModel, the layers the local spec then builds, and a tiny CPU run.

- Parsing: every flag reaches the config with Megatron-LM's default and meaning (``core_transformer_config``).
- Building (one process): --qk-layernorm puts a norm on queries and keys, RoPE scaling and interpolation change
  the rotary frequencies and positions, --init-method-xavier-uniform fills to the Xavier bound.
- Training (slow): TP=2 + SP bf16 with --qk-layernorm and the attention flags; the loss must be finite and fall.
"""

import math

import pytest
import torch

from dist_utils import launch_training, run_on_ranks
from test_arguments import make
from test_parallel_training import GPT


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
    assert not (plain.qk_layernorm or plain.apply_query_key_layer_scaling or plain.attention_softmax_in_fp32
                or plain.fp32_residual_connection)
    assert plain.init_method is not xavier
    assert _config("--bf16 --attention-softmax-in-fp32").attention_softmax_in_fp32
    assert make("--apply-query-key-layer-scaling").attention_softmax_in_fp32  # args show it, as Megatron-LM's do


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
                   f"--qk-layernorm --init-method-xavier-uniform")
    fc1 = scaled.decoder.layers[0].mlp.linear_fc1.weight
    return {
        "q_k_norms": [(type(layer.self_attention.q_layernorm).__name__, type(layer.self_attention.k_layernorm).__name__)
                      for model in (plain_rope, scaled) for layer in model.decoder.layers[:2]],
        "inv_freq_ratio": (plain_rope.rotary_pos_emb.inv_freq / scaled.rotary_pos_emb.inv_freq).tolist(),
        "interpolation": scaled.rotary_pos_emb.seq_len_interpolation_factor,
        "fc1_max_over_xavier_bound": (fc1.abs().max() / math.sqrt(6 / sum(fc1.shape))).item(),
    }


def test_local_spec_builds_what_the_flags_ask():
    (built,) = run_on_ranks(_built_layers, 1)
    assert built["q_k_norms"] == [("IdentityOp", "IdentityOp")] * 2 + [("LayerNorm", "LayerNorm")] * 2
    # Llama 3.1 scaling: the highest frequency kept, the lowest (a wavelength beyond 8192 tokens) divided by 4
    ratios = built["inv_freq_ratio"]
    assert ratios[0] == 1.0 and ratios[-1] == pytest.approx(4.0) and ratios == sorted(ratios)
    assert built["interpolation"] == 2
    # uniform in +-sqrt(6 / (fan_in + fan_out)): 16384 draws reach near the bound (the normal of std 0.02 stays
    # below 0.7 of it)
    assert 0.95 < built["fc1_max_over_xavier_bound"] <= 1.0


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
