"""What apex's CUDA extensions give megatron-core, on torch's own kernels, for installs without apex or Transformer
Engine.

- Gradient norm and scaling. Without either package megatron-core falls back to ``local_multi_tensor_l2_norm``,
  which takes each gradient's norm, then gathers the norms into a CPU tensor: one host-device synchronization per
  parameter (about 290 per GPT-1.3B step), each draining the queue of launched kernels, so the device then waits for
  the host. ``foreach_l2_norm`` computes the same norm of norms with ``torch._foreach_norm`` on the device, with no
  synchronization; ``foreach_scale`` scales a list of tensors with one foreach kernel instead of two kernels each.
- Gradient-accumulation fusion (Megatron-LM's default, ``--no-gradient-accumulation-fusion`` turns it off): apex's
  ``fused_weight_gradient_mlp_cuda`` makes the weight-gradient GEMM add into ``main_grad`` (cuBLAS's beta = 1), so no
  separate gradient tensor is written, read and added per parameter and micro-batch. ``WgradAccumulation`` is that
  module on ``torch.addmm``'s ``out=``. For an fp32 ``main_grad`` (``--accumulate-allreduce-grads-in-fp32``) the
  product of bf16 inputs is taken in fp32 (``torch.mm``'s ``out_dtype``) and added, as apex's fp32 kernel does.
  Numerics: the bf16 product is rounded once (into the sum) instead of twice (the gradient, then the sum).

- Adam: without either package megatron-core steps ``torch.optim.AdamW`` (or ``Adam``) with torch's default
  ``foreach`` implementation, a pass over the states per elementwise op; apex's ``FusedAdam`` updates each value in one
  pass. ``fuse_adam`` switches torch's optimizer to its own fused kernel (``fused=True``: one pass, as apex's) on CUDA,
  and keeps each state's ``step`` on the device as that kernel needs (also after a checkpoint load, which restores the
  saved groups' settings and a host ``step``). Numerics: the same update formula in fp32, not the same rounding order.

``apply()`` installs the first two where megatron-core uses its fallbacks (once per process, before the model is
built); ``fuse_adam`` then acts on the optimizer megatron-core builds, and on it again after each checkpoint load.
"""

import torch

_applied = False  # apply() ran: the stand-ins are wanted (benchmarks/stock_pretrain_gpt.py leaves them out)
FUSED_ADAM_DEVICES = ("cuda",)  # where fuse_adam switches to torch's fused kernel (apex's runs on CUDA only)


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """``amp_C.multi_tensor_l2norm``'s contract: (the 2-norm of every tensor of ``tensor_lists[0]`` together, as a
    one-element fp32 device tensor, None)."""
    tensors = tensor_lists[0]
    if not tensors:
        return torch.zeros(1, dtype=torch.float, device=torch.cuda.current_device()), None
    norms = torch._foreach_norm(tensors, 2.0)
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms])).reshape(1), None


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """``amp_C.multi_tensor_scale``'s contract: ``tensor_lists[1][i] = tensor_lists[0][i] * scale``."""
    sources, targets = tensor_lists[0], tensor_lists[1]
    if not sources:
        return
    torch._foreach_copy_(targets, torch._foreach_mul(sources, scale))


class WgradAccumulation:
    """Stand-in for apex's ``fused_weight_gradient_mlp_cuda``: ``main_grad += grad_output^T @ input``."""

    @staticmethod
    def wgrad_gemm_accum_fp16(total_input, grad_output, main_grad):
        torch.addmm(main_grad, grad_output.t(), total_input, out=main_grad)

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input, grad_output, main_grad):
        if total_input.dtype == torch.float32:
            torch.addmm(main_grad, grad_output.t(), total_input, out=main_grad)
        else:
            main_grad.add_(torch.mm(grad_output.t(), total_input, out_dtype=torch.float32))


def fuse_adam(optimizer) -> None:
    """Step torch's Adam/AdamW inside ``optimizer`` with torch's fused kernel where every parameter of a group is on
    ``FUSED_ADAM_DEVICES`` (after apply(); a no-op for apex's or TE's optimizer), and every other group with torch's
    default (a loaded checkpoint restores the settings it was saved with). Call after building the optimizer and
    after loading its state."""
    from megatron.hooks.optimizer_state import adam_step_device, torch_adams

    for _, adam in torch_adams(optimizer):  # (apex's and Transformer Engine's FusedAdam are not among them)
        for group in adam.param_groups:
            # plain tensors only (Megatron-FSDP's DTensor shards keep torch's default)
            fused = _applied and bool(group["params"]) and all(
                type(p) in (torch.Tensor, torch.nn.Parameter) and p.device.type in FUSED_ADAM_DEVICES
                for p in group["params"])
            if not fused and not group.get("fused"):
                continue
            group["fused"], group["foreach"] = (True, False) if fused else (None, None)
            for param in group["params"]:  # the fused kernel reads its steps on the device, the others on the host
                state = adam.state.get(param, {})
                step = state.get("step")
                device = adam_step_device(group, param)
                if step is not None and (not torch.is_tensor(step) or step.device != device
                                         or step.dtype != torch.float32):
                    state["step"] = torch.as_tensor(step, dtype=torch.float32).to(device)


def apply() -> None:
    global _applied
    _applied = True
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.tensor_parallel import layers

    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = foreach_l2_norm
    for module in (clip_grads, optimizer):
        if module.multi_tensor_scale_impl is utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = foreach_scale
    if not layers._grad_accum_fusion_available:
        layers.fused_weight_gradient_mlp_cuda = WgradAccumulation
        layers._grad_accum_fusion_available = True


def gradient_accumulation_fusion_available() -> bool:
    """Whether ``WgradAccumulation`` runs where the model is: on CUDA (``mm``'s ``out_dtype`` for bf16 x bf16 -> fp32 is
    a CUDA kernel; on CPU the fusion stays off, as without apex)."""
    return torch.cuda.is_available()
