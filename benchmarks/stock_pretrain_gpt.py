"""``pretrain_gpt.py`` on megatron-core's own fallbacks for apex, without ``megatron/hooks/fused_ops.py``'s stand-ins:
the gradient norm takes one host synchronization per parameter, scaling two kernels per tensor, and Adam steps on
torch's foreach implementation (``fuse_adam`` acts only after ``apply``). With
``--attention-backend unfused --no-gradient-accumulation-fusion`` it runs the local spec as megatron-core (and
Megatron-LM's own ``pretrain_gpt.py``) runs it without apex or Transformer Engine: ``compute_path.py``'s ``stock``
baseline. Arguments are ``pretrain_gpt.py``'s."""

import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron.hooks import fused_ops  # noqa: E402

fused_ops.apply = lambda: None  # initialize.py calls it by attribute: megatron-core's fallbacks stay in place
sys.argv[0] = os.path.join(ROOT, "pretrain_gpt.py")
runpy.run_path(sys.argv[0], run_name="__main__")
