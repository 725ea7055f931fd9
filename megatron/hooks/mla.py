"""Multi-latent attention (``--multi-latent-attention``) with the local spec.

megatron-core's ``MLASelfAttention`` builds its core attention with separate key and value head sizes
(``k_channels`` = qk_head_dim + qk_pos_emb_head_dim, ``v_channels`` = v_head_dim), which only Transformer
Engine's attention accepts (0.16.1 to 0.19): the local spec's ``DotProductAttention`` fails to build. Its
arithmetic already handles them (scores and context are batched matmuls over whatever head size the query, key
and value carry); only its constructor and the context's final reshape assume ``kv_channels``.
``LatentDotProductAttention`` takes the two sizes, and ``use_latent_dot_product_attention`` puts it into an MLA
layer spec.

megatron-core 0.16.1 also takes Transformer Engine for installed in ``multi_latent_attention`` whenever its TE
extension module imports, which it does without TE (with stand-ins for the TE classes), and then fails on
``isinstance(linear_proj, TELinear)``; 0.19 reads TE's presence properly. Without TE the flag is corrected.

With TP > 1 the local spec's kv down projection is column-parallel: its output is all-gathered
(``gather_from_tensor_model_parallel_region``, whose backward keeps this rank's slice of the gradient) and split into
the kv latent and the rotary key. The latent's gradient comes back from a column-parallel up projection, which sums
it over TP; the rotary key's does not: each rank's attention heads add only their own share, so the rank that owns
the rotary columns of the down projection got its heads' share of their gradient only (0.16.1 and 0.19.2; at TP=2
those weight rows' gradient was 60-100% off the single-process one). ``SummedRotaryKeyMLASelfAttention`` passes the
rotary key through an identity whose backward all-reduces the gradient over TP, right after the gather, so it is
the sum over every rank's heads, as in the single-process model (tests/test_mla.py). Not megatron-core's
``copy_to_tensor_model_parallel_region``: its backward all-reduces ``grad.contiguous()`` and returns ``grad``, so
the non-contiguous gradient of a split's slice comes back unreduced.
"""

import contextlib
import importlib.util

import torch
import torch.distributed as dist

from megatron.core.transformer import multi_latent_attention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.multi_latent_attention import MLASelfAttention


class LatentDotProductAttention(DotProductAttention):
    """The local ``DotProductAttention`` with key and value head sizes of their own."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None):
        k_channels, v_channels = k_channels or config.kv_channels, v_channels or config.kv_channels
        if softmax_scale is None:  # the default scale, from the query/key head size (MLA passes its own)
            softmax_scale = k_channels ** -0.5
        super().__init__(config=config, layer_number=layer_number, attn_mask_type=attn_mask_type,
                         attention_type=attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        self.hidden_size_per_attention_head = k_channels
        # the context [sq, b, heads of this partition, v_channels] is reshaped to [sq, b, this]
        self.hidden_size_per_partition = self.num_attention_heads_per_partition * v_channels


class _SumGradientOverGroup(torch.autograd.Function):
    """Identity forward; backward: the gradient summed over ``group``."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


@contextlib.contextmanager
def _rotary_key_gradient_summed(config, tp_group):
    """While the block runs, the kv latent gather that ``multi_latent_attention`` calls (megatron-core's, or TACO's
    bound by ``megatron/hooks/tp.py`` around this) hands back the rotary key with its gradient summed over TP. The
    gather of the kv latent is the one whose result has kv_lora_rank + qk_pos_emb_head_dim columns
    (``arguments._validate_mla`` rejects a query latent of that width)."""
    gather = multi_latent_attention.gather_from_tensor_model_parallel_region
    widths = [config.kv_lora_rank, config.qk_pos_emb_head_dim]

    def gather_with_summed_rotary_gradient(x):
        gathered = gather(x)
        if gathered.shape[-1] != sum(widths):
            return gathered  # the query latent
        latent, rotary_key = torch.split(gathered, widths, dim=-1)
        return torch.cat([latent, _SumGradientOverGroup.apply(rotary_key, tp_group)], dim=-1)

    multi_latent_attention.gather_from_tensor_model_parallel_region = gather_with_summed_rotary_gradient
    try:
        yield
    finally:
        multi_latent_attention.gather_from_tensor_model_parallel_region = gather


class SummedRotaryKeyMLASelfAttention(MLASelfAttention):
    """``MLASelfAttention`` whose rotary key's gradient is summed over the TP group (module docstring)."""

    def get_query_key_value_tensors(self, *args, **kwargs):
        with _rotary_key_gradient_summed(self.config, self.tp_group):
            return super().get_query_key_value_tensors(*args, **kwargs)


def use_latent_dot_product_attention(spec):
    """``spec`` (a layer spec, or a block spec's ``layer_specs``) with every local MLA layer's core attention replaced
    by ``LatentDotProductAttention`` and its attention by ``SummedRotaryKeyMLASelfAttention``; changed in place and
    returned."""
    if importlib.util.find_spec("transformer_engine") is None:
        multi_latent_attention.HAVE_TE = False
    layers = spec.layer_specs if hasattr(spec, "layer_specs") else [spec]  # a block spec (MoE) or a layer spec
    for layer in layers:
        attention = layer.submodules.self_attention
        if attention.module is MLASelfAttention and attention.submodules.core_attention is DotProductAttention:
            attention.module = SummedRotaryKeyMLASelfAttention
            attention.submodules.core_attention = LatentDotProductAttention
    return spec
