"""When the parameter gather's buckets are chosen again, and when a choice is tried end to end
(``--param-gather-reselect-interval``, ``--param-gather-trial-iters``).

``SelectionSchedule`` drives a selection (anything with ``measuring``, ``restart()``, ``rounds`` and ``switched``:
megatron/hooks/param_gather_selection.py's) and the trials of its choices around each training iteration."""

from typing import Callable

import torch


class SelectionSchedule:
    """``--param-gather-selection benefit`` over a run, for the training loop (``before_iteration`` /
    ``after_iteration`` around each iteration, 1-based): with ``--param-gather-reselect-interval N`` the
    buckets are measured and chosen again every N iterations, and every choice that switches a bucket and
    leaves one compressed gets an end-to-end trial (``--param-gather-trial-iters``, megatron/hooks/trial.py).
    One choice is not enough: the first comes from a run's first gathers, whose steps changed far more values
    than later ones in our runs (GPT-350M on 2x H200: wire ratio 2.1x at iteration 5, 3.1x at 20, 7.4x
    at 40, 11.8x from 58 on), and a learning-rate schedule keeps moving the payload over a run. Both modes
    of every bucket are bit-exact, so training is the same whatever is chosen."""

    def __init__(self, selection, new_trial: Callable, interval: int, first_trial_after: int, agree: Callable,
                 trial_skip: int, any_compressed: Callable[[], bool]):
        self.selection, self.new_trial, self.interval = selection, new_trial, interval
        self.first_trial_after = first_trial_after  # iterations from the start before the first trial may start
        self.trial_skip = trial_skip  # iterations from a choice before its trial times any
        self.agree = agree  # (switched, compressed) flags of this rank -> the MAX of each over all ranks
        self.any_compressed = any_compressed  # whether any of this rank's buckets has a codec now
        self.trial, self.start, self.choices_seen, self.active = None, None, 0, False

    @property
    def compressing(self) -> bool:
        """Whether any bucket is compressed in the current iteration (a trial's plain iterations: no)."""
        return self.active and (self.trial is None or self.trial.compressing)

    def before_iteration(self, iteration: int) -> None:
        if self.start is None:
            self.start = iteration
        due = self.interval and iteration > 1 and (iteration - 1) % self.interval == 0
        # not while a choice is still being measured or tried (e.g. just after a resume): the next one is due soon
        if due and not self.selection.measuring and (self.trial is None or self.trial.decided):
            self.selection.restart()
        if self.selection.rounds > self.choices_seen:  # a choice was made during the last iteration
            self.choices_seen = self.selection.rounds
            switched, self.active = self.agree(self.selection.switched, self.any_compressed())
            if switched and self.active:
                skip = max(self.trial_skip, self.start + self.first_trial_after - iteration)
                self.trial = self.new_trial(skip)
        if self.trial is not None:
            self.trial.before_iteration(iteration)

    def after_iteration(self, iteration: int, seconds: float, device: torch.device) -> None:
        if self.trial is not None:
            self.trial.after_iteration(iteration, seconds, device)
