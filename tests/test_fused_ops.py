"""megatron/hooks/fused_ops.py: apex's multi-tensor and gradient-accumulation kernels on torch's own ops.

- ``foreach_l2_norm`` gives megatron-core's fallback's norm (to fp32 rounding) without a host synchronization per
  tensor; ``foreach_scale`` gives its per-tensor ``copy_(src * scale)`` bit for bit.
- ``WgradAccumulation`` adds the weight gradient into ``main_grad`` as apex's kernels do: bf16 (CPU and CUDA), and
  fp32 with bf16 inputs (CUDA).
- ``apply()`` swaps exactly megatron-core's fallbacks; --no-gradient-accumulation-fusion reaches the config.
"""

import pytest
import torch

from megatron.hooks import fused_ops
from test_arguments import make


def _tensors(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    shapes = [(7,), (33, 5), (1,), (128, 64), (3, 3, 3)]
    return [torch.randn(s, generator=gen).to(dtype) * (i + 1) for i, s in enumerate(shapes)]


def test_foreach_l2_norm_matches_megatron_core_fallback(monkeypatch):
    from megatron.core import utils

    tensors = _tensors()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(torch, "tensor", _cpu_tensor(torch.tensor))  # the fallback's device="cuda" result, on CPU
    reference, _ = utils.local_multi_tensor_l2_norm(2048 * 32, None, [tensors], False)
    ours, _ = fused_ops.foreach_l2_norm(2048 * 32, None, [tensors], False)
    assert ours.shape == reference.shape == (1,) and ours.dtype == torch.float32
    assert ours.item() == pytest.approx(reference.item(), rel=1e-6)
    exact = torch.cat([t.double().flatten() for t in tensors]).norm().item()
    assert ours.item() == pytest.approx(exact, rel=1e-6)
    assert fused_ops.foreach_l2_norm(2048 * 32, None, [[]], False)[0].item() == 0.0


def _cpu_tensor(original):
    def tensor(*args, **kwargs):
        if kwargs.get("device") == "cuda":
            kwargs["device"] = "cpu"
        return original(*args, **kwargs)
    return tensor


@pytest.mark.parametrize("src_dtype,dst_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                                 (torch.bfloat16, torch.float32)])
def test_foreach_scale_is_bitwise_the_per_tensor_copy(src_dtype, dst_dtype):
    sources = _tensors(src_dtype)
    ours = [torch.empty_like(t, dtype=dst_dtype) for t in sources]
    fused_ops.foreach_scale(2048 * 32, None, [sources, ours], 0.37)
    for src, out in zip(sources, ours):
        expected = torch.empty_like(out).copy_(src * 0.37)
        assert torch.equal(out.view(torch.int16 if dst_dtype == torch.bfloat16 else torch.int32),
                           expected.view(torch.int16 if dst_dtype == torch.bfloat16 else torch.int32))


def _wgrad_case(device, grad_dtype):
    gen = torch.Generator().manual_seed(3)
    total_input = torch.randn(96, 40, generator=gen).to(device, torch.bfloat16)
    grad_output = torch.randn(96, 24, generator=gen).to(device, torch.bfloat16)
    main_grad = torch.randn(24, 40, generator=gen).to(device, grad_dtype)
    expected = main_grad.double() + grad_output.double().t() @ total_input.double()
    return total_input, grad_output, main_grad, expected


def test_wgrad_accumulation_into_bf16_main_grad():
    total_input, grad_output, main_grad, expected = _wgrad_case("cpu", torch.bfloat16)
    pointer = main_grad.data_ptr()
    fused_ops.WgradAccumulation.wgrad_gemm_accum_fp16(total_input, grad_output, main_grad)
    assert main_grad.data_ptr() == pointer and main_grad.dtype == torch.bfloat16
    # one bf16 rounding of the exact sum (the unfused path rounds the product, then the sum)
    assert torch.allclose(main_grad.double(), expected, rtol=2 ** -8, atol=1e-2)


@pytest.mark.gpu
def test_wgrad_accumulation_into_fp32_main_grad_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    total_input, grad_output, main_grad, expected = _wgrad_case("cuda", torch.float32)
    fused_ops.WgradAccumulation.wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
    assert main_grad.dtype == torch.float32
    assert torch.allclose(main_grad.double(), expected, rtol=1e-5, atol=1e-4)


def test_apply_swaps_megatron_core_fallbacks_only(monkeypatch):
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.tensor_parallel import layers

    for module, name in [(clip_grads, "l2_norm_impl"), (clip_grads, "multi_tensor_scale_impl"),
                         (optimizer, "multi_tensor_scale_impl"), (layers, "fused_weight_gradient_mlp_cuda"),
                         (layers, "_grad_accum_fusion_available")]:
        monkeypatch.setattr(module, name, getattr(module, name, None), raising=False)
    monkeypatch.setattr(fused_ops, "_applied", fused_ops._applied)
    fallbacks = clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm  # no apex / Transformer Engine
    fused_ops.apply()
    if fallbacks:
        assert clip_grads.l2_norm_impl is fused_ops.foreach_l2_norm
        assert clip_grads.multi_tensor_scale_impl is optimizer.multi_tensor_scale_impl is fused_ops.foreach_scale
        assert layers.fused_weight_gradient_mlp_cuda is fused_ops.WgradAccumulation
    assert layers._grad_accum_fusion_available


def test_gradient_accumulation_fusion_flag():
    from megatron.training.model import core_transformer_config

    assert make("").gradient_accumulation_fusion and not make("--no-gradient-accumulation-fusion").gradient_accumulation_fusion
    # on CUDA only: CPU runs keep megatron-core's unfused accumulation
    assert core_transformer_config(make("")).gradient_accumulation_fusion == torch.cuda.is_available()


class _Wrapper:
    """megatron-core's optimizer wrappers hold torch's as ``.optimizer``."""

    def __init__(self, optimizer):
        self.optimizer = optimizer


def _adam_run(fused_on, steps=3):
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(1000))
    wrapper = _Wrapper(torch.optim.AdamW([param], lr=1e-2, weight_decay=0.1))
    if fused_on:
        fused_ops.fuse_adam(wrapper)
    for step in range(steps):
        param.grad = torch.randn(1000, generator=torch.Generator().manual_seed(step))
        wrapper.optimizer.step()
    return wrapper.optimizer, param.detach().clone()


def test_fuse_adam_switches_torch_adam_to_its_fused_kernel(monkeypatch):
    """After apply(), on the devices of FUSED_ADAM_DEVICES (CUDA; the CPU here) torch's AdamW steps fused, with its
    steps on the device in fp32 (a loaded host step moves there), and follows the foreach update; elsewhere, and
    without apply() (benchmarks/stock_pretrain_gpt.py), nothing changes."""
    monkeypatch.setattr(fused_ops, "_applied", False)
    monkeypatch.setattr(fused_ops, "FUSED_ADAM_DEVICES", ("cpu",))
    optimizer, _ = _adam_run(fused_on=True, steps=0)
    assert not optimizer.param_groups[0]["fused"]  # not applied
    monkeypatch.setattr(fused_ops, "_applied", True)
    monkeypatch.setattr(fused_ops, "FUSED_ADAM_DEVICES", ("cuda",))
    optimizer, _ = _adam_run(fused_on=True, steps=0)
    assert not optimizer.param_groups[0]["fused"]  # CPU parameters
    monkeypatch.setattr(fused_ops, "FUSED_ADAM_DEVICES", ("cpu",))
    fused, fused_param = _adam_run(fused_on=True)
    group = fused.param_groups[0]
    assert group["fused"] and not group["foreach"]
    _, foreach_param = _adam_run(fused_on=False)
    torch.testing.assert_close(fused_param, foreach_param, rtol=1e-5, atol=1e-6)
    state = next(iter(fused.state.values()))
    state["step"] = torch.tensor(3.0, dtype=torch.float64)  # as a checkpoint load leaves it
    fused_ops.fuse_adam(_Wrapper(fused))
    assert state["step"].dtype == torch.float32 and state["step"].item() == 3.0
    # a checkpoint of a fused run loaded where the fused kernel is not wanted: torch's default again
    monkeypatch.setattr(fused_ops, "FUSED_ADAM_DEVICES", ("cuda",))
    fused_ops.fuse_adam(_Wrapper(fused))
    assert group["fused"] is None and group["foreach"] is None and state["step"].device.type == "cpu"



@pytest.mark.gpu
def test_fuse_adam_on_cuda(monkeypatch):
    monkeypatch.setattr(fused_ops, "_applied", True)
    param = torch.nn.Parameter(torch.randn(1000, device="cuda"))
    wrapper = _Wrapper(torch.optim.AdamW([param], lr=1e-2))
    fused_ops.fuse_adam(wrapper)
    param.grad = torch.randn_like(param)
    wrapper.optimizer.step()
    assert wrapper.optimizer.param_groups[0]["fused"]
    assert next(iter(wrapper.optimizer.state.values()))["step"].device.type == "cuda"
