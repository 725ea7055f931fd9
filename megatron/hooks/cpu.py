"""Run megatron-core on CPU processes (gloo) when CUDA is absent.

megatron-core assumes a CUDA device in a few dozen places (``torch.cuda.current_device()`` as a
``device=``, ``device="cuda"`` literals, ``torch.cuda.Stream``, the CUDA RNG tracker, and
``param.type()`` checks against ``torch.cuda.*Tensor`` names). This module redirects exactly those to
the CPU. It changes no numerics: every redirected call does the same arithmetic on the CPU tensor.
It is applied once per process by ``apply()``, and only when ``torch.cuda.is_available()`` is False.

Measured on megatron-core 0.16.1 (each shim below names the failure site it replaces).
"""

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_applied = False


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


class _CudaToCpuMode(TorchFunctionMode):
    """Map ``device="cuda"``, ``.cuda()`` and ``.to("cuda")`` to the CPU, and make ``t.type()`` report
    ``torch.cuda.*`` names so the optimizer's wrapped-parameter type checks accept CPU tensors."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        options = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if _is_cuda_device(options.get("device")):
            options["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu") + tuple(args[2:])
        result = func(*args, **options)
        if func is torch.Tensor.type and len(args) == 1 and not options and isinstance(result, str):
            result = result.replace("torch.", "torch.cuda.", 1)
        return result


class _NoOpEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class _NoOpStream(_NoOpEvent):
    """CPU work is synchronous, so a stream is a no-op."""

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, event=None):
        return event or _NoOpEvent()


def _patch_torch_cuda() -> None:
    default_stream = _NoOpStream()
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)
    torch.cuda.Stream = _NoOpStream
    torch.cuda.Event = _NoOpEvent
    torch.cuda.current_stream = lambda device=None: default_stream
    torch.cuda.default_stream = lambda device=None: default_stream
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.Tensor.record_stream = lambda self, stream: None


def _patch_megatron_core() -> None:
    import megatron.core.tensor_parallel.random as tp_random
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    # The model-parallel RNG tracker saves and restores "CUDA" generator states.
    tp_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    tp_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)

    # all_to_all split sizes must be Python/numpy, but the helper only converts CUDA tensors.
    to_host = token_dispatcher.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return to_host(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu

    # Activation recompute re-runs the forward inside torch.autograd.backward, which reaches
    # _CudaToCpuMode as one call, and a mode is off while it handles a call: the forward's
    # device="cuda" literals on that path are redirected by name instead.
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.transformer.utils as transformer_utils

    def get_default_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq), diagonal=1).bool()

    transformer_utils.get_default_causal_mask = get_default_causal_mask
    fused_softmax.get_default_causal_mask = get_default_causal_mask


def apply() -> bool:
    """Install the CPU redirections once per process. Returns True if they are active."""
    global _applied
    if torch.cuda.is_available():
        return False
    if not _applied:
        _patch_torch_cuda()
        _patch_megatron_core()
        _CudaToCpuMode().__enter__()
        _applied = True
    return True
