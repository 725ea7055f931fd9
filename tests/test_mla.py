"""Multi-latent attention (--multi-latent-attention) with the local spec, through megatron/hooks/mla.py.

- ``LatentDotProductAttention`` (key and value head sizes of their own) against torch's scaled-dot-product
  attention, forward and backward.
- Training: a tiny MLA GPT at TP=2 with sequence parallelism follows the single-process run (the layout-independent
  initialization covers MLA's projections), and with TACO it tracks it within the bound of test_tp_hooks.py's GPT
  check, with MLA's projections and latent all-gathers compressed (the latents layer by layer: test_tp_hooks.py).
- The FLOP count behind TFLOP/s/GPU (megatron/training/metrics.py) against torch's FlopCounterMode on the model's
  forward: MLA, GQA + SwiGLU, and the squared-ReLU and quick-GeGLU activations.
"""

import pytest
import torch

from dist_utils import launch_training, run_on_ranks
from test_parallel_training import GPT, RTOL, assert_same_trajectory

MLA = (" --multi-latent-attention --position-embedding-type rope --q-lora-rank 32 --kv-lora-rank 16 "
       "--qk-head-dim 16 --qk-pos-emb-head-dim 8 --v-head-dim 24 --normalization RMSNorm --num-layers 2")


def _latent_attention_against_sdpa():
    """(forward, query grad, key grad, value grad) relative errors of LatentDotProductAttention against torch's
    attention, causal, with key head size 24 and value head size 40, and the context's shape."""
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from megatron.hooks import cpu
    from megatron.hooks.mla import LatentDotProductAttention

    cpu.apply()
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)  # the attention dropout's RNG tracker (dropout 0 here)
    heads, dk, dv, sq, batch = 4, 24, 40, 16, 2
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=heads, kv_channels=16,
                               attention_dropout=0.0, masked_softmax_fusion=False)
    scale = 0.3
    attention = LatentDotProductAttention(config, 1, AttnMaskType.causal, "self", softmax_scale=scale,
                                          k_channels=dk, v_channels=dv)
    torch.manual_seed(0)
    q, k = torch.randn(sq, batch, heads, dk), torch.randn(sq, batch, heads, dk)
    v = torch.randn(sq, batch, heads, dv)
    grad = torch.randn(sq, batch, heads * dv)
    results = []
    for fn in (lambda q, k, v: attention(q, k, v, None),
               lambda q, k, v: F.scaled_dot_product_attention(  # [b, h, s, d] in, [s, b, h * dv] out
                   *(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True, scale=scale)
               .permute(2, 0, 1, 3).reshape(sq, batch, heads * dv)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        out.backward(grad)
        results.append([out.detach()] + [t.grad for t in leaves])
    ours, reference = results
    errors = [((a - b).norm() / b.norm()).item() for a, b in zip(ours, reference)]
    return errors, tuple(ours[0].shape)


def test_latent_attention_matches_torch_attention():
    (result,) = run_on_ranks(_latent_attention_against_sdpa, 1)
    errors, shape = result
    assert shape == (16, 2, 4 * 40)
    assert max(errors) < 1e-6, errors  # fp32, the same sums in another order


@pytest.mark.slow
def test_mla_tp2_sp_follows_single_process_and_taco_tracks_it(tmp_path):
    reference = launch_training(tmp_path, "single", "pretrain_gpt.py", 1, GPT + MLA)
    tp2_sp = GPT + MLA + " --tensor-model-parallel-size 2 --sequence-parallel"
    plain = launch_training(tmp_path, "tp2_sp", "pretrain_gpt.py", 2, tp2_sp)
    assert_same_trajectory(reference, plain, ["loss", "grad_norm", "eval_loss"])
    taco = launch_training(tmp_path, "tp2_sp_taco", "pretrain_gpt.py", 2,
                           tp2_sp + " --tp-comm-compression taco --tp-comm-compression-min-bytes 0")
    for ref, got in zip(reference, taco, strict=True):
        assert got["loss"] == pytest.approx(ref["loss"], rel=2e-3), ref["iteration"]
        assert got["loss"] != ref["loss"]  # compressed: not the same bits
    tp = taco[-1]["comm"]["tp"]
    # MLA's latent all-gathers included (6% of these bytes, docs/taco.md); fp32: 3.88x at B=256
    assert tp["raw_bytes"] > 3 * tp["sent_bytes"] > 0


def _counted_and_formula_flops():
    """For a GQA SwiGLU GPT, quick-GeGLU and squared-ReLU GPTs (their biases added unfused) and MLA with and
    without a query latent: the forward FLOPs that
    torch's FlopCounterMode counts in the model's matrix products, and a third of gpt_flops_per_iteration (which
    counts forward + backward) for the same tokens."""
    from torch.utils.flop_counter import FlopCounterMode

    from megatron.training import metrics
    from megatron.training.arguments import parse_args, set_padded_vocab_size, validate_args
    from megatron.training.initialize import initialize_megatron
    from megatron.training.model import build_model_chunks, core_transformer_config

    variants = {
        "gqa_swiglu": " --group-query-attention --num-query-groups 2 --swiglu",
        "quick_geglu": " --quick-geglu",
        "squared_relu": " --squared-relu",
        "mla": MLA,
        "mla_no_q_latent": MLA.replace("--q-lora-rank 32 ", ""),
    }
    results = {}
    for name, flags in variants.items():
        args = validate_args(parse_args((GPT + flags + " --global-batch-size 2").split()), world_size=1, rank=0)
        if not results:
            initialize_megatron(args)
        set_padded_vocab_size(args, 255)
        model = build_model_chunks(args, core_transformer_config(args))[0]
        tokens = torch.randint(0, 255, (args.global_batch_size, args.seq_length))
        position_ids = torch.arange(args.seq_length).expand(args.global_batch_size, -1)
        with FlopCounterMode(display=False) as counter:
            model(tokens, position_ids, None)
        results[name] = (counter.get_total_flops(), metrics.gpt_flops_per_iteration(args) / 3)
    return results


def test_flop_formula_counts_the_models_matrix_products():
    (results,) = run_on_ranks(_counted_and_formula_flops, 1)
    for name, (counted, formula) in results.items():
        assert counted == pytest.approx(formula, rel=1e-12), name
