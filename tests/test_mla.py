"""Multi-latent attention (--multi-latent-attention) with the local spec, through megatron/hooks/mla.py.

- ``LatentDotProductAttention`` (key and value head sizes of their own) against torch's scaled-dot-product
  attention, forward and backward.
- The rotary key's gradient summed over TP (``SummedRotaryKeyMLASelfAttention``): an MLA layer's parameter gradients
  at TP=2, assembled, equal the TP=1 layer's with the same weights; megatron-core's own layer misses the other
  rank's share in the kv down projection's rotary rows.
- Training: a tiny MLA GPT at TP=2 with sequence parallelism follows the single-process run (the layout-independent
  initialization covers MLA's projections), and with TACO it tracks it within the bound of test_tp_hooks.py's GPT
  check, with MLA's projections and latent all-gathers compressed (the latents layer by layer: test_tp_hooks.py).
- The FLOP count behind TFLOP/s/GPU (megatron/training/metrics.py) against torch's FlopCounterMode on the model's
  forward: MLA, GQA + SwiGLU, GQA with the attention output gate, the squared-ReLU and quick-GeGLU activations, and
  multi-token prediction layers.
"""

import pytest
import torch

from dist_utils import launch_training, run_on_ranks
from test_parallel_training import GPT, assert_same_trajectory

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


def _mla_layer_gradients(tp: int, weights=None):
    """(full weights, {attention class: full parameter gradients by name}) of an MLA layer (test_tp_hooks.py's
    shapes, with a query latent, fp32, no SP) at TP=``tp``, built as megatron-core's ``MLASelfAttention`` and as the
    hook's ``SummedRotaryKeyMLASelfAttention`` with the same weights, after one backward of a fixed input and output
    gradient; TP shards are all-gathered along their partition dim. ``weights``: load these (full) first. Numpy
    arrays: tensors would leave the worker through shared memory that ends with it."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    from test_tp_hooks import MLA_BATCH, MLA_SEQ, MLA_SHAPES, _init_megatron

    from megatron.hooks import mla

    _init_megatron(tp)
    group = parallel_state.get_tensor_model_parallel_group()
    config = MLATransformerConfig(num_layers=1, q_lora_rank=32, rope_type="rope", normalization="RMSNorm",
                                  tensor_model_parallel_size=tp, use_cpu_initialization=True,
                                  params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
                                  add_bias_linear=False, **MLA_SHAPES)

    def full(t, param):
        if not getattr(param, "tensor_model_parallel", False):
            return t.detach().clone()
        shards = [torch.empty_like(t) for _ in range(tp)]
        dist.all_gather(shards, t.detach().contiguous(), group=group)
        return torch.cat(shards, dim=param.partition_dim)

    grads = {}
    for attention_class in (MLASelfAttention, mla.SummedRotaryKeyMLASelfAttention):
        spec = mla.use_latent_dot_product_attention(get_gpt_layer_local_spec(multi_latent_attention=True))
        spec.submodules.self_attention.module = attention_class
        layer = build_module(spec.submodules.self_attention, config=config, layer_number=1)
        if weights is None:
            weights = {name: full(p, p).numpy() for name, p in layer.named_parameters()}
        with torch.no_grad():
            for name, param in layer.named_parameters():
                weight = torch.from_numpy(weights[name])
                param.copy_(weight.chunk(tp, dim=param.partition_dim)[group.rank()]
                            if getattr(param, "tensor_model_parallel", False) else weight)
        torch.manual_seed(5)
        hidden = torch.randn(MLA_SEQ, MLA_BATCH, MLA_SHAPES["hidden_size"])
        output, _ = layer(hidden, None)
        output.backward(torch.randn_like(output))
        grads[attention_class.__name__] = {name: full(p.grad, p).numpy() for name, p in layer.named_parameters()}
    return weights, grads


def test_rotary_key_gradient_is_summed_over_tp():
    weights, tp2 = run_on_ranks(_mla_layer_gradients, 2, 2)[0]
    _, tp1 = run_on_ranks(_mla_layer_gradients, 1, 1, weights)[0]
    tp1, tp2_hook, tp2_core = ({name: torch.from_numpy(g) for name, g in grads.items()} for grads in (
        tp1["SummedRotaryKeyMLASelfAttention"], tp2["SummedRotaryKeyMLASelfAttention"], tp2["MLASelfAttention"]))
    for name, grad in tp1.items():
        assert torch.allclose(tp2_hook[name], grad, rtol=1e-5, atol=1e-7), name
    kv_lora_rank = 16  # the kv down projection's rows: the kv latent's, then the rotary key's
    down = "linear_kv_down_proj.weight"
    assert torch.allclose(tp2_core[down][:kv_lora_rank], tp1[down][:kv_lora_rank], rtol=1e-5, atol=1e-7)
    rotary_error = (tp2_core[down][kv_lora_rank:] - tp1[down][kv_lora_rank:]).norm() / tp1[down][kv_lora_rank:].norm()
    assert rotary_error > 0.1  # megatron-core's own layer: the other rank's heads' share is missing


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
    """For a GQA SwiGLU GPT, a GQA GPT with the attention output gate, quick-GeGLU and squared-ReLU GPTs (their
    biases added unfused), MLA with and without a query latent and two multi-token prediction layers: the forward FLOPs
    that torch's FlopCounterMode counts in the model's matrix products, and a third of gpt_flops_per_iteration (which
    counts forward + backward) for the same tokens."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from megatron.training import metrics
    from megatron.training.arguments import parse_args, set_padded_vocab_size, validate_args
    from megatron.training.initialize import initialize_megatron
    from megatron.training.model import build_model_chunks, core_transformer_config

    variants = {
        "gqa_swiglu": " --group-query-attention --num-query-groups 2 --swiglu",
        "output_gate": " --group-query-attention --num-query-groups 2 --attention-output-gate",
        "quick_geglu": " --quick-geglu",
        "squared_relu": " --squared-relu",
        "mla": MLA,
        "mla_no_q_latent": MLA.replace("--q-lora-rank 32 ", ""),
        "mtp": " --mtp-num-layers 2 --position-embedding-type rope --swiglu",
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
        # SDPA's math kernel: torch's FLOP counter has no formula for its fused CPU kernel
        with FlopCounterMode(display=False) as counter, sdpa_kernel([SDPBackend.MATH]):
            model(tokens, position_ids, None, labels=tokens if args.mtp_num_layers else None)  # MTP: with labels
        results[name] = (counter.get_total_flops(), metrics.gpt_flops_per_iteration(args, args.global_batch_size) / 3)
    return results


def test_flop_formula_counts_the_models_matrix_products():
    (results,) = run_on_ranks(_counted_and_formula_flops, 1)
    for name, (counted, formula) in results.items():
        assert counted == pytest.approx(formula, rel=1e-12), name
