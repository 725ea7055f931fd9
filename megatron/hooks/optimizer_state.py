"""Workarounds for megatron-core 0.16.1's checkpointing of torch Adam inside the distributed optimizer.

Without Apex or Transformer Engine, megatron-core's DistributedOptimizer wraps ``torch.optim.Adam(W)``,
whose per-param ``step`` it mishandles in ``state_dict``/``load_state_dict``. Used by
``megatron.training.checkpointing`` around save and load.
"""

import contextlib

import torch
from megatron.core.optimizer import DistributedOptimizer


def torch_adams(optimizer):
    """(wrapper, adam) for each ``torch.optim.Adam``/``AdamW`` inside megatron-core's optimizer wrappers (chained,
    mixed precision, distributed): what megatron-core steps when neither Apex nor Transformer Engine is installed."""
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            yield sub, inner


def _native_adams(optimizer):
    """The torch Adam(W) inside each DistributedOptimizer, whose per-param ``step`` megatron-core 0.16.1 checkpoints
    wrongly (below)."""
    return [adam for sub, adam in torch_adams(optimizer) if isinstance(sub, DistributedOptimizer)]


def adam_step_device(group: dict, param: torch.Tensor) -> torch.device:
    """Where torch keeps a param's Adam ``step``: on the param's device for the fused kernel (and capturable steps),
    else on the host."""
    return param.device if group.get("fused") or group.get("capturable") else torch.device("cpu")


def _step(value: float, group: dict, param: torch.Tensor) -> torch.Tensor:
    return torch.tensor(float(value), dtype=torch.float32, device=adam_step_device(group, param))


def materialize_adam_state(optimizer) -> None:
    """DistributedOptimizer.state_dict() asserts on a never-stepped torch Adam (it reads the per-param
    ``step``, which does not exist yet), so a fresh optimizer can be neither saved nor loaded into.
    Create the zero state Adam's first step would create (a load overwrites it)."""
    for adam in _native_adams(optimizer):
        for group in adam.param_groups:
            for param in group["params"]:
                state = adam.state[param]
                if not state:
                    state.update(step=_step(0, group, param), exp_avg=torch.zeros_like(param),
                                 exp_avg_sq=torch.zeros_like(param))


def restore_adam_steps(optimizer) -> None:
    """DistributedOptimizer.load_state_dict() gives all params ONE shared ``step`` tensor (so every
    optimizer step would bump it once per param), then overwrites it with the pre-load value from the
    ``dp_reshardable`` state. The checkpoint's step is kept in each param group; give each param its
    own copy of it."""
    for adam in _native_adams(optimizer):
        for group in adam.param_groups:
            for param in group["params"]:
                adam.state[param]["step"] = _step(group["step"], group, param)


@contextlib.contextmanager
def steps_kept_in_fully_reshardable_load(optimizer):
    """0.16.1 and 0.19.2: the ``fully_reshardable`` load (--dist-ckpt-optim-fully-reshardable) leaves the checkpoint's
    per-param ``step`` out of the tensors it hands ``_set_main_param_and_optimizer_states``, which then copies into
    every state entry torch Adam holds, ``step`` included: a KeyError. While the load runs each call gets the step
    Adam already holds (``load_state_dict`` set it from the param groups), a copy onto itself;
    ``restore_adam_steps`` then gives each param its own."""
    patched = [sub for sub, _ in torch_adams(optimizer) if isinstance(sub, DistributedOptimizer)]
    for sub in patched:
        def set_states(model_param, tensors, sub=sub, stock=sub._set_main_param_and_optimizer_states):
            if "step" not in tensors:
                group_index, group_order = sub.model_param_group_index_map[model_param]
                main_param = sub.optimizer.param_groups[group_index]["params"][group_order]
                tensors = {**tensors, "step": sub.optimizer.state[main_param]["step"]}
            return stock(model_param, tensors)

        sub._set_main_param_and_optimizer_states = set_states
    try:
        yield
    finally:
        for sub in patched:
            del sub._set_main_param_and_optimizer_states
