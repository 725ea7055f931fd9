"""End-to-end compression trials in the training loop: keep a compression only if it makes the real
iterations faster.

A start-up measurement times a collective alone (TACO's probe) or models it (the parameter gather's
benefit selection), but in training the host also runs the model's Python and the collectives overlap
compute, so a collective that is faster alone can still make iterations slower (measured on 2x H200:
GPT-350M TACO at TP=2, CIERA on sockets). A trial alternates ``iters`` iterations uncompressed and
compressed after ``skip`` iterations; unless the compressed median is ``TRIAL_MARGIN`` faster, the
uncompressed path stays for the rest of the run. Every rank times its own iterations and the decision
uses the slowest rank's (an all-reduce MAX over the world), so all ranks switch together, at the same
iteration.
"""

import logging
from typing import Callable

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

TRIAL_SKIP_ITERATIONS = 2  # first iterations of a run: allocator and kernel warm-up, not timed
TRIAL_MARGIN = 0.02  # keep compression only if it makes iterations at least this much faster


class CompressionTrial:
    """``before_iteration`` / ``after_iteration`` around each training iteration (1-based).
    ``set_compressing(compressing, final)`` switches the compression; ``final`` is True once, with
    the decision."""

    def __init__(self, what: str, set_compressing: Callable[[bool, bool], None], iters: int, flag: str,
                 fallback: str, skip: int = TRIAL_SKIP_ITERATIONS, has_work: Callable[[], bool] = None):
        if iters < 2 or iters % 2:
            raise ValueError(f"{flag} must be an even number >= 2 (or 0 for no trial), got {iters}")
        self.what, self.fallback = what, fallback
        self.set_compressing = set_compressing
        self.has_work = has_work  # asked (collectively) when the trial starts: is anything compressed at all?
        self.iters, self.skip = iters, skip
        self.first = None  # first trial iteration, set by the first before_iteration call
        self.times = []
        self.compressing = True
        self.decided = False

    def _set(self, compressing: bool, final: bool = False) -> None:
        self.set_compressing(compressing, final)
        self.compressing = compressing

    def before_iteration(self, iteration: int) -> None:
        """Set the mode of ``iteration`` (trial iterations alternate, uncompressed first)."""
        if self.first is None:
            self.first = iteration + self.skip
        if iteration == self.first and self.has_work is not None and not self.has_work():
            self._set(False, final=True)  # nothing is compressed: nothing to try
            self.decided = True
        if not self.decided and self.first <= iteration < self.first + self.iters:
            self._set((iteration - self.first) % 2 == 1)

    def after_iteration(self, iteration: int, seconds: float, device: torch.device) -> None:
        if self.decided or not self.first <= iteration < self.first + self.iters:
            return
        self.times.append(seconds)
        if len(self.times) < self.iters:
            return
        slowest = torch.tensor(self.times, dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        plain, compressed = sorted(slowest[0::2].tolist()), sorted(slowest[1::2].tolist())
        plain_median, compressed_median = plain[len(plain) // 2], compressed[len(compressed) // 2]
        self._set(compressed_median < (1 - TRIAL_MARGIN) * plain_median, final=True)
        self.decided = True
        if dist.get_rank() == 0:
            logger.info("%s trial (iterations %d-%d): median %.1f ms uncompressed, %.1f ms compressed: %s",
                        self.what, self.first, self.first + self.iters - 1, plain_median * 1e3,
                        compressed_median * 1e3, "keeping compression" if self.compressing else
                        f"compression off for the rest of the run ({self.fallback})")
