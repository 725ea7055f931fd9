"""End-to-end compression trials in the training loop: keep a compression only if it makes the real
iterations faster.

A start-up measurement times a collective alone (TACO's probe) or models it (the parameter gather's
benefit selection), but in training the host also runs the model's Python and the collectives overlap
compute, so a collective that is faster alone can still make iterations slower (measured on 2x H200:
GPT-350M TACO at TP=2, CIERA on sockets). A trial alternates ``iters`` iterations uncompressed and
compressed after ``skip`` iterations; unless the compressed median is ``TRIAL_MARGIN`` faster, or every
compressed iteration was faster than every uncompressed one, the uncompressed path stays (for the rest of
the run, or until a parameter-gather re-selection tries again). Every rank times its own iterations and
the decision uses the slowest rank's (an all-reduce MAX over the world), so all ranks switch together, at
the same iteration.
"""

import logging
from typing import Callable

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

TRIAL_SKIP_ITERATIONS = 2  # first iterations of a run: allocator and kernel warm-up, not timed
TRIAL_MARGIN = 0.02  # keep compression if it makes iterations at least this much faster...
SEPARATION_MIN_ITERS = 3  # ... or faster in every one of at least this many iterations of each mode


class CompressionTrial:
    """``before_iteration`` / ``after_iteration`` around each training iteration (1-based).
    ``set_compressing(compressing, final)`` switches the compression; ``final`` is True once, with
    the decision."""

    def __init__(self, what: str, set_compressing: Callable[[bool, bool], None], iters: int, flag: str,
                 fallback: str, skip: int = TRIAL_SKIP_ITERATIONS):
        if iters < 2 or iters % 2:
            raise ValueError(f"{flag} must be an even number >= 2 (or 0 for no trial), got {iters}")
        self.what, self.fallback = what, fallback
        self.set_compressing = set_compressing
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
        plain, compressed = slowest[0::2].tolist(), slowest[1::2].tolist()
        keep, why = keep_compression(plain, compressed)
        self._set(keep, final=True)
        self.decided = True
        if dist.get_rank() == 0:
            logger.info("%s trial (iterations %d-%d): median %.1f ms uncompressed, %.1f ms compressed (%s): %s",
                        self.what, self.first, self.first + self.iters - 1, _median(plain) * 1e3,
                        _median(compressed) * 1e3, why, "keeping compression" if self.compressing else
                        f"compression off ({self.fallback})")


def _median(values: list) -> float:
    return sorted(values)[len(values) // 2]


def keep_compression(plain: list, compressed: list) -> tuple:
    """(keep, why) from the seconds of a trial's uncompressed and compressed iterations: keep if the compressed
    median is ``TRIAL_MARGIN`` faster, or if every compressed iteration beat every uncompressed one, with at
    least ``SEPARATION_MIN_ITERS`` of each (a gain smaller than the margin but larger than the noise: with
    3 + 3 iterations that order arises by chance in 1 of 20 trials of equal speeds). Measured on 2x H200:
    GPT-350M DP=2 with the parameter gather exposed at ~25 GB/s, compressed 258.5 / 258.5 /
    262.6 ms against 264.5 / 263.5 / 264.0 ms plain: 2.0% by the medians, 0.1 ms short of the margin, and
    faster in every iteration."""
    plain_median, compressed_median = _median(plain), _median(compressed)
    if compressed_median < (1 - TRIAL_MARGIN) * plain_median:
        return True, f"{TRIAL_MARGIN:.0%} faster or more"
    if min(len(plain), len(compressed)) >= SEPARATION_MIN_ITERS and max(compressed) < min(plain):
        return True, "every compressed iteration faster"
    return False, f"not {TRIAL_MARGIN:.0%} faster, nor faster in every iteration"
