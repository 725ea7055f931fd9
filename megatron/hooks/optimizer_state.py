"""Workarounds for megatron-core 0.16.1's checkpointing of torch Adam inside the distributed optimizer.

Without Apex or Transformer Engine, megatron-core's DistributedOptimizer wraps ``torch.optim.Adam(W)``,
whose per-param ``step`` it mishandles in ``state_dict``/``load_state_dict``. Used by
``megatron.training.checkpointing`` around save and load.
"""

import torch
from megatron.core.optimizer import DistributedOptimizer


def _native_adams(optimizer):
    """The torch Adam(W) inside each DistributedOptimizer: megatron-core uses it when neither Apex nor
    Transformer Engine is installed, and 0.16.1 checkpoints its per-param ``step`` wrongly (below)."""
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        if isinstance(sub, DistributedOptimizer) and isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            yield inner


def materialize_adam_state(optimizer) -> None:
    """DistributedOptimizer.state_dict() asserts on a never-stepped torch Adam (it reads the per-param
    ``step``, which does not exist yet), so a fresh optimizer can be neither saved nor loaded into.
    Create the zero state Adam's first step would create (a load overwrites it)."""
    for adam in _native_adams(optimizer):
        for group in adam.param_groups:
            for param in group["params"]:
                state = adam.state[param]
                if not state:
                    state.update(step=torch.zeros((), dtype=torch.float32),
                                 exp_avg=torch.zeros_like(param), exp_avg_sq=torch.zeros_like(param))


def restore_adam_steps(optimizer) -> None:
    """DistributedOptimizer.load_state_dict() gives all params ONE shared ``step`` tensor (so every
    optimizer step would bump it once per param), then overwrites it with the pre-load value from the
    ``dp_reshardable`` state. The checkpoint's step is kept in each param group; give each param its
    own copy of it."""
    for adam in _native_adams(optimizer):
        for group in adam.param_groups:
            for param in group["params"]:
                adam.state[param]["step"] = torch.tensor(float(group["step"]), dtype=torch.float32)
