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
"""

import importlib.util

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


def use_latent_dot_product_attention(spec):
    """``spec`` (a layer spec, or a block spec's ``layer_specs``) with the local core attention of every MLA layer
    replaced by ``LatentDotProductAttention``; changed in place and returned."""
    if importlib.util.find_spec("transformer_engine") is None:
        multi_latent_attention.HAVE_TE = False
    layers = spec.layer_specs if hasattr(spec, "layer_specs") else [spec]  # a block spec (MoE) or a layer spec
    for layer in layers:
        attention = layer.submodules.self_attention
        if attention.module is MLASelfAttention and attention.submodules.core_attention is DotProductAttention:
            attention.submodules.core_attention = LatentDotProductAttention
    return spec
