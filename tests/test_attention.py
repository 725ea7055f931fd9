"""The local spec's core attention on torch's SDPA (megatron/hooks/attention.py).

- Against megatron-core's unfused ``DotProductAttention`` with the same config, forward and backward, on CPU (SDPA's
  CPU kernels): causal, GQA, a sliding window, an arbitrary mask, query-key layer scaling, bf16, and MLA's separate
  key and value head sizes; packed sequences (thd) against each document computed on its own; attention dropout drawn
  under megatron-core's RNG tracker (repeatable, and dropping).
- Which module the spec builds for each --attention-backend and --softmax-type, and the start-up errors of the
  backends that pin one SDPA kernel.
- Training: a tiny GPT's losses with SDPA follow the unfused module's (fp32, dropout 0) to rounding.
- GPU (flash and cuDNN kernels): the same comparisons in bf16.
"""

import pytest
import torch

from dist_utils import launch_training, run_on_ranks
from test_arguments import make
from test_parallel_training import GPT

CASES = {
    # name: (config overrides, attention kwargs, mask kind, dtype)
    "causal": ({}, {}, None, torch.float32),
    "gqa": ({"num_query_groups": 2}, {}, None, torch.float32),
    "window": ({"window_size": (5, 0)}, {}, None, torch.float32),
    "mask": ({}, {}, "random", torch.float32),
    "layer_scaling": ({"apply_query_key_layer_scaling": True, "attention_softmax_in_fp32": True},
                      {"layer_number": 3}, None, torch.float32),
    "bf16": ({"bf16": True, "params_dtype": torch.bfloat16}, {}, None, torch.bfloat16),
    "mla": ({}, {"k_channels": 24, "v_channels": 40, "softmax_scale": 0.3}, None, torch.float32),
    "gqa_bf16": ({"num_query_groups": 2, "bf16": True, "params_dtype": torch.bfloat16}, {}, None, torch.bfloat16),
}


def _setup():
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron.hooks import cpu

    if not torch.cuda.is_available():
        cpu.apply()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)


def _pair(case: str, device: str = "cpu", backend: str = "auto"):
    """(megatron-core's module, the SDPA one) with the same config for ``case``, and the mask kind and dtype."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnBackend, AttnMaskType

    from megatron.hooks.attention import LatentSDPAttention, SDPAttention
    from megatron.hooks.mla import LatentDotProductAttention

    overrides, kwargs, mask, dtype = CASES[case]
    config = TransformerConfig(**{**dict(num_layers=4, hidden_size=64, num_attention_heads=4, kv_channels=16,
                                         attention_dropout=0.0, masked_softmax_fusion=False,
                                         attention_backend=AttnBackend[backend]), **overrides})
    kwargs = dict(kwargs)
    layer = kwargs.pop("layer_number", 1)
    unfused, sdpa = ((LatentDotProductAttention, LatentSDPAttention) if "k_channels" in kwargs
                     else (DotProductAttention, SDPAttention))
    return [cls(config, layer, AttnMaskType.causal, "self", **kwargs).to(device) for cls in (unfused, sdpa)], mask, dtype


def _inputs(case, dtype, device, sq=24, batch=2, heads=4, seed=0):
    _, kwargs, _, _ = CASES[case]
    groups = CASES[case][0].get("num_query_groups", heads)
    dk, dv = kwargs.get("k_channels", 16), kwargs.get("v_channels", 16)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sq, batch, heads, dk, generator=gen)
    k = torch.randn(sq, batch, groups, dk, generator=gen)
    v = torch.randn(sq, batch, groups, dv, generator=gen)
    grad = torch.randn(sq, batch, heads * dv, generator=gen)
    return [t.to(device, dtype) for t in (q, k, v, grad)]


def _errors(case: str, device: str = "cpu", backend: str = "auto"):
    """Relative errors (output, dq, dk, dv) of the SDPA module against megatron-core's, and the output shape."""
    _setup()
    (unfused, sdpa), mask_kind, dtype = _pair(case, device, backend)
    q, k, v, grad = _inputs(case, dtype, device)
    mask = None
    if mask_kind == "random":  # True = masked (megatron-core's convention); every query keeps its own key
        gen = torch.Generator().manual_seed(1)
        mask = (torch.rand(2, 1, q.shape[0], k.shape[0], generator=gen) < 0.4).to(device)
        mask &= ~torch.eye(q.shape[0], dtype=torch.bool, device=device)
    results = []
    for module in (unfused, sdpa):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = module(*leaves, mask)
        out.backward(grad)
        results.append([out.detach().float()] + [t.grad.float() for t in leaves])
    reference, ours = results
    return [((a - b).norm() / b.norm()).item() for a, b in zip(ours, reference)], tuple(ours[0].shape)


@pytest.mark.parametrize("case", sorted(CASES))
def test_sdpa_matches_unfused_attention(case):
    (result,) = run_on_ranks(_errors, 1, case)
    errors, shape = result
    heads_dv = 4 * CASES[case][1].get("v_channels", 16)
    assert shape == (24, 2, heads_dv)
    bound = 1e-2 if "bf16" in case else 1e-5  # fp32: the same sums in another order; bf16: its rounding
    assert max(errors) < bound, errors


def _packed_against_documents():
    """Relative error of the packed (thd) SDPA call against each document attended on its own, forward and input
    gradients, for documents of 5, 11 and 8 tokens."""
    from megatron.core.packed_seq_params import PackedSeqParams

    _setup()
    (_, sdpa), _, _ = _pair("gqa")
    lengths = [5, 11, 8]
    cu = torch.tensor([0, 5, 16, 24], dtype=torch.int32)
    q, k, v, grad = _inputs("gqa", torch.float32, "cpu", sq=24, batch=1)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=11, max_seqlen_kv=11)
    leaves = [t[:, 0].clone().requires_grad_() for t in (q, k, v)]  # [t, heads, dim], as megatron-core squeezes it
    out = sdpa(*leaves, None, packed_seq_params=packed)
    out.backward(grad[:, 0])
    ours = [out.detach()] + [t.grad for t in leaves]
    doc_outs, doc_grads = [], [[], [], []]
    for start, length in zip(cu[:-1].tolist(), lengths):
        parts = [t[start:start + length].clone().requires_grad_() for t in (q, k, v)]
        doc = sdpa(*parts, None)
        doc.backward(grad[start:start + length])
        doc_outs.append(doc.detach()[:, 0])
        for acc, part in zip(doc_grads, parts):
            acc.append(part.grad[:, 0])
    reference = [torch.cat(doc_outs)] + [torch.cat(g) for g in doc_grads]
    return [((a - b).norm() / b.norm()).item() for a, b in zip(ours, reference)], tuple(out.shape)


def test_sdpa_packed_sequences_attend_within_documents():
    (result,) = run_on_ranks(_packed_against_documents, 1)
    errors, shape = result
    assert shape == (24, 4 * 16)
    assert max(errors) < 1e-5, errors


def _dropout_outputs():
    """Outputs of the SDPA module with attention dropout 0.5 in training: twice from the same tracker seed, once
    from another, and once in eval mode."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    _setup()
    (_, sdpa), _, _ = _pair("causal")
    sdpa.attention_dropout.p = 0.5
    q, k, v, _ = _inputs("causal", torch.float32, "cpu")
    outs = []
    for seed in (7, 7, 8):
        model_parallel_cuda_manual_seed(seed)
        outs.append(sdpa.train()(q, k, v, None))
    outs.append(sdpa.eval()(q, k, v, None))
    return [out.detach().numpy() for out in outs]  # tensors would leave through shared memory that ends with the rank


def test_sdpa_dropout_follows_the_rng_tracker():
    (outs,) = run_on_ranks(_dropout_outputs, 1)
    same_seed_a, same_seed_b, other_seed, evaluated = (torch.from_numpy(out) for out in outs)
    assert torch.equal(same_seed_a, same_seed_b)
    assert not torch.equal(same_seed_a, other_seed)
    assert not torch.allclose(same_seed_a, evaluated)


def _core_attention_class(flags: str) -> str:
    from megatron.training.model import core_transformer_config, layer_spec

    _setup()  # the MoE block spec reads the pipeline layout
    args = make(flags)
    spec = layer_spec(args, core_transformer_config(args), None)
    layer = spec.layer_specs[0] if hasattr(spec, "layer_specs") else spec
    return layer.submodules.self_attention.submodules.core_attention.__name__


@pytest.mark.parametrize("flags,expected", [
    ("", "SDPAttention"),
    ("--attention-backend flash", "SDPAttention"),
    ("--use-flash-attn", "SDPAttention"),
    ("--attention-backend unfused", "DotProductAttention"),
    ("--attention-backend local", "DotProductAttention"),
    ("--softmax-type off-by-one", "DotProductAttention"),  # SDPA cannot add the extra logit: auto keeps the module
    ("--num-experts 4 --moe-router-topk 2 --disable-bias-linear", "SDPAttention"),
    ("--multi-latent-attention --position-embedding-type rope --q-lora-rank 32 --kv-lora-rank 16 --qk-head-dim 16 "
     "--qk-pos-emb-head-dim 8 --v-head-dim 24", "LatentSDPAttention"),
])
def test_spec_core_attention_per_backend(flags, expected):
    (name,) = run_on_ranks(_core_attention_class, 1, "--transformer-impl local " + flags)
    assert name == expected


@pytest.mark.parametrize("flags,message", [
    ("--attention-backend flash --softmax-type learnable", "--softmax-type learnable"),
    ("--use-flash-attn --softmax-type off-by-one", "--softmax-type off-by-one"),
    ("--attention-backend flash --window-size 16,0", "--window-size"),
    ("--attention-backend fused", "needs CUDA"),
])
def test_pinned_sdpa_kernel_errors_name_the_flag(flags, message):
    if "fused" in flags and torch.cuda.is_available():
        pytest.skip("cuDNN attention runs where CUDA is")
    with pytest.raises(ValueError, match=message):
        make("--transformer-impl local " + flags)


@pytest.mark.slow
def test_gpt_losses_with_sdpa_follow_the_unfused_module(tmp_path):
    """fp32, dropout 0: the two modules compute the same attention in another summation order."""
    unfused = launch_training(tmp_path, "unfused", "pretrain_gpt.py", 1, GPT + " --attention-backend unfused")
    sdpa = launch_training(tmp_path, "sdpa", "pretrain_gpt.py", 1, GPT)
    assert [r["iteration"] for r in sdpa] == [r["iteration"] for r in unfused] == [1, 2, 3, 4]
    for ref, ours in zip(unfused, sdpa):
        assert ours["loss"] == pytest.approx(ref["loss"], rel=1e-5), ref["iteration"]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flash", "fused", "auto"])
@pytest.mark.parametrize("case", ["bf16", "gqa_bf16"])
def test_sdpa_gpu_kernels_match_unfused_attention(case, backend):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    (result,) = run_on_ranks(_errors, 1, case, "cuda", backend, backend="nccl")
    errors, _ = result
    assert max(errors) < 1e-2, errors
