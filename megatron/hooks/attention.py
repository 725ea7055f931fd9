"""Core attention of the local spec on ``torch.nn.functional.scaled_dot_product_attention``.

megatron-core's local spec builds ``DotProductAttention``: two batched matmuls around a softmax over the whole
[b, heads, sq, sk] score tensor, written to and read back from memory (about 11x slower than flash attention for
GPT-1.3B's shapes on an H100, and 4-5x the memory). Transformer Engine's fused attention replaces it in the TE spec,
but TACO needs the local spec (it replaces the local linears' TP communication). ``SDPAttention`` keeps megatron-core's
module (its constructor, parameters and checkpoint keys) and computes the same function with SDPA, whose flash,
cuDNN and memory-efficient kernels never materialize the scores; on CPU SDPA runs its CPU flash or math kernel.

What each megatron-core input becomes:
- causal, no mask: ``is_causal=True`` (flash);
- ``--window-size L,R``: megatron-core's sliding-window mask as a boolean mask (memory-efficient / cuDNN kernels);
- an attention mask (True = masked, megatron-core's convention): its negation;
- packed sequences (``qkv_format='thd'``, [t, heads, dim]): one sequence of t tokens, causal within each document;
- GQA/MQA: ``enable_gqa`` (no copy of the keys and values);
- the softmax scale, ``--apply-query-key-layer-scaling`` included (megatron-core divides the scores by the layer
  number and multiplies them back inside the fp32 softmax: SDPA's kernels keep the scores in fp32, so the scale is
  the unscaled one);
- attention dropout: SDPA's ``dropout_p``, drawn under megatron-core's CUDA RNG tracker as its module draws it.

``--softmax-type off-by-one|learnable`` adds a per-head logit to the softmax's denominator, which SDPA cannot express:
``--attention-backend auto`` then keeps megatron-core's module, and ``flash``/``fused`` are a start-up error
(``arguments._validate_attention_backend``).
"""

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnBackend, AttnMaskType
from megatron.core.transformer.utils import is_layer_window_attention

from megatron.hooks.mla import LatentDotProductAttention

# --attention-backend -> the SDPA kernels it may use (None: SDPA's own choice among all)
SDPA_KERNELS = {
    AttnBackend.auto: None,
    AttnBackend.flash: [SDPBackend.FLASH_ATTENTION],
    AttnBackend.fused: [SDPBackend.CUDNN_ATTENTION],
}


def sliding_window_keep_mask(sq: int, sk: int, window_size, device) -> torch.Tensor:
    """[sq, sk] True where a query attends to a key: megatron-core's ``get_sliding_window_causal_mask`` negated (its
    True means masked), built on ``device`` instead of its hard-coded CUDA."""
    ones = torch.ones(sq, sk, dtype=torch.bool, device=device)
    return torch.tril(torch.triu(ones, diagonal=sk - sq - window_size[0]), diagonal=sk - sq + window_size[1])


def packed_causal_keep_mask(cu_seqlens_q: torch.Tensor, cu_seqlens_kv: torch.Tensor) -> torch.Tensor:
    """[t_q, t_kv] True where a packed query attends to a packed key: the same document, and causal within it
    (documents are aligned at their ends, as for any causal attention with sq != sk)."""
    def document_and_position(cu):
        lengths = (cu[1:] - cu[:-1]).long()
        doc = torch.repeat_interleave(torch.arange(len(lengths), device=cu.device), lengths)
        pos = torch.arange(int(cu[-1]), device=cu.device) - cu[:-1].long()[doc]
        return doc, pos, lengths

    doc_q, pos_q, len_q = document_and_position(cu_seqlens_q)
    doc_kv, pos_kv, len_kv = document_and_position(cu_seqlens_kv)
    offset = (len_kv - len_q)[doc_q]  # a query's position counted in its document's keys
    return (doc_q[:, None] == doc_kv[None, :]) & (pos_kv[None, :] <= (pos_q + offset)[:, None])


class _SDPAForward:
    """``forward`` of megatron-core's core attention on SDPA; mixed into its ``DotProductAttention`` subclasses, whose
    constructors set the scale, heads, window and dropout this reads."""

    def _init_sdpa(self, layer_number: int) -> None:
        coeff = self.layer_number if self.config.apply_query_key_layer_scaling else 1
        self.sdpa_scale = self.softmax_scale * coeff  # the scale megatron-core's scores end up with (module doc)
        self.sdpa_kernels = SDPA_KERNELS.get(self.config.attention_backend)  # other values: SDPA chooses
        self.sdpa_window = (self.config.window_size if is_layer_window_attention(
            self.config.window_size, self.config.window_attn_skip_freq, layer_number) else None)
        self._window_mask, self._window_mask_key = None, None

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        assert attention_bias is None, "Attention bias is not supported by the local spec's core attention."
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if packed:  # [t, heads, dim] -> [1, heads, t, dim]
            q, k, v = (x.unsqueeze(0).transpose(1, 2) for x in (query, key, value))
        else:  # [s, b, heads, dim] -> [b, heads, s, dim]: views, the last dimension stays contiguous
            q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        keep, causal = self._keep_mask(q.shape[2], k.shape[2], q.device, attention_mask, packed_seq_params)
        dropout = self.attention_dropout.p if self.training else 0.0
        kwargs = dict(attn_mask=keep, dropout_p=dropout, is_causal=causal, scale=self.sdpa_scale,
                      enable_gqa=q.shape[1] != k.shape[1])
        with self._kernels(), self._rng(dropout):
            context = F.scaled_dot_product_attention(q, k, v, **kwargs)
        if packed:  # [1, heads, t, dim] -> [t, heads * dim]
            return context[0].transpose(0, 1).reshape(context.shape[2], self.hidden_size_per_partition)
        # [b, heads, s, dim] -> [s, b, heads * dim]
        return context.permute(2, 0, 1, 3).reshape(context.shape[2], context.shape[0], self.hidden_size_per_partition)

    def _keep_mask(self, sq, sk, device, attention_mask, packed_seq_params):
        """SDPA's boolean mask (True: attend) and is_causal, from what megatron-core's softmax would apply."""
        if self.sdpa_window is not None:  # megatron-core's softmax replaces any mask by the window's
            key = (sq, sk, device)
            if self._window_mask_key != key:  # one mask per shape, not one per call
                self._window_mask = sliding_window_keep_mask(sq, sk, self.sdpa_window, device)
                self._window_mask_key = key
            return self._window_mask, False
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            cu_q = packed_seq_params.cu_seqlens_q_padded
            cu_kv = packed_seq_params.cu_seqlens_kv_padded
            cu_q = packed_seq_params.cu_seqlens_q if cu_q is None else cu_q
            cu_kv = packed_seq_params.cu_seqlens_kv if cu_kv is None else cu_kv
            return packed_causal_keep_mask(cu_q, cu_kv), False
        if attention_mask is not None:
            return ~attention_mask, False
        if self.attn_mask_type == AttnMaskType.causal and sq > 1:
            assert sq == sk, "causal mask is only for self attention"
            return None, True
        return None, False

    def _kernels(self):
        return sdpa_kernel(self.sdpa_kernels) if self.sdpa_kernels is not None else contextlib.nullcontext()

    def _rng(self, dropout: float):
        # megatron-core draws attention dropout under the tracker's fork unless sequence parallel
        if dropout > 0 and not self.config.sequence_parallel:
            return tensor_parallel.get_cuda_rng_tracker().fork()
        return contextlib.nullcontext()


class SDPAttention(_SDPAForward, DotProductAttention):
    """megatron-core's ``DotProductAttention`` computed by SDPA (module docstring)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None):
        super().__init__(config=config, layer_number=layer_number, attn_mask_type=attn_mask_type,
                         attention_type=attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        self._init_sdpa(layer_number)


class LatentSDPAttention(_SDPAForward, LatentDotProductAttention):
    """MLA's core attention (separate key and value head sizes, ``megatron/hooks/mla.py``) computed by SDPA."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None):
        super().__init__(config=config, layer_number=layer_number, attn_mask_type=attn_mask_type,
                         attention_type=attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, k_channels=k_channels, v_channels=v_channels,
                         cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        self._init_sdpa(layer_number)


_SDPA_VERSION_OF = {DotProductAttention: SDPAttention, LatentDotProductAttention: LatentSDPAttention}


def use_sdpa_core_attention(spec):
    """``spec`` (a layer spec, or a block spec's ``layer_specs``) with every local core attention computed by SDPA;
    changed in place and returned. Run after ``use_latent_dot_product_attention`` so MLA layers get theirs."""
    layers = spec.layer_specs if hasattr(spec, "layer_specs") else [spec]
    for layer in layers:
        attention = getattr(layer.submodules, "self_attention", None)
        submodules = getattr(attention, "submodules", None)
        core = getattr(submodules, "core_attention", None)
        if core in _SDPA_VERSION_OF:
            submodules.core_attention = _SDPA_VERSION_OF[core]
    return spec


def sdpa_supports(softmax_type: str) -> bool:
    """Whether SDPA computes megatron-core's attention for this ``--softmax-type`` (module docstring)."""
    return softmax_type == "vanilla"

