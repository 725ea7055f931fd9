"""Workarounds for megatron-core defects that show without Transformer Engine, on CPU and GPU alike.

Applied once per process by ``apply()`` (``megatron.training.initialize``); each names the release
that needs it and is a no-op where the defect is absent.
"""


def apply() -> None:
    import megatron.core.transformer.moe.moe_utils as moe_utils

    # 0.16.1's router gating references te_general_gemm unconditionally though it is imported only
    # with TE: every MoE forward raises NameError without TE (found on H200 without TE, and on CPU).
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
