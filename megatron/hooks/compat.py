"""Workarounds for megatron-core defects that show without Transformer Engine, on CPU and GPU alike.

Applied once per process by ``apply()`` (``megatron.training.initialize``), and to each built model chunk by
``fix_model_chunk``; each names the release that needs it and is a no-op where the defect is absent.
"""

import torch


def apply() -> None:
    import megatron.core.transformer.moe.moe_utils as moe_utils

    # 0.16.1's router gating references te_general_gemm unconditionally though it is imported only
    # with TE: every MoE forward raises NameError without TE (found on H200 without TE, and on CPU).
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    import megatron.core.tensor_parallel.random as tp_random

    # 0.16.1 and 0.19.2: CheckpointWithoutOutput(fp8=False) sets self.fp8 = (fp8 is not None), i.e. True, and its
    # forward then reads Transformer Engine's FP8 state, a NameError without TE: every --recompute-modules layernorm
    # (and moe_act) forward fails. Without TE there is no FP8 to restore, so the flag is False.
    if not hasattr(tp_random, "FP8GlobalStateManager") and not getattr(tp_random.CheckpointWithoutOutput,
                                                                        "_fp8_off_without_te", False):
        original_init = tp_random.CheckpointWithoutOutput.__init__

        def init_without_te(self, *args, **kwargs):
            original_init(self, *args, **kwargs)
            self.fp8 = False

        tp_random.CheckpointWithoutOutput.__init__ = init_without_te
        tp_random.CheckpointWithoutOutput._fp8_off_without_te = True  # applied once per process


def fix_model_chunk(chunk) -> None:
    """The model-level workarounds below, on a GPTModel chunk just built (before its initialization and wrapping)."""
    mark_softmax_offsets_tensor_parallel(chunk)
    drop_unused_mtp_output_weight(chunk)


def drop_unused_mtp_output_weight(chunk) -> None:
    """0.16.1 and 0.19.2: with --mtp-num-layers on a last pipeline stage and tied embeddings, the output layer
    allocates a weight of its own that it never uses (the forward passes the stage's copy of the embedding, which
    the MTP layers need anyway), and saving a checkpoint then fails (``tie_embeddings_and_output_weights_state_dict``
    asserts the output layer has no weight there). Dropped, as megatron-core skips it on the first stage: a
    vocabulary-sized parameter and its optimizer state less, the same forward."""
    output_layer = getattr(chunk, "output_layer", None)
    if (getattr(chunk, "mtp_process", False) and not chunk.pre_process and chunk.share_embeddings_and_output_weights
            and output_layer is not None and output_layer.weight is not None):
        output_layer.weight = None


def mark_softmax_offsets_tensor_parallel(chunk) -> None:
    """0.16.1 and 0.19.2: the local ``DotProductAttention`` of ``--softmax-type learnable`` holds this TP rank's heads'
    logits (``softmax_offset``, [heads per partition]) in a parameter without megatron-core's tensor-parallel
    attributes, so the gradient norm (and its clipping) counts TP rank 0's heads only, and a layout-independent
    initialization cannot find the full tensor it is a slice of. Its checkpoint already shards it along dim 0."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    for module in chunk.modules():
        offset = getattr(module, "softmax_offset", None)
        if isinstance(offset, torch.nn.Parameter) and not getattr(offset, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(offset, is_parallel=True, dim=0, stride=1)
