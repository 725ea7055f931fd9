"""Iteration-range profiling with Megatron-LM's flags (``--profile``, ``--use-pytorch-profiler``,
``--profile-step-start/-end``, ``--profile-ranks``, ``--pytorch-profiler-collect-shapes/-callstack``).

Without ``--use-pytorch-profiler`` the range is marked with cudaProfilerStart/Stop for
``nsys profile --capture-range=cudaProfilerApi``. With it, the PyTorch profiler records CPU and CUDA
activity of those iterations and writes a Chrome trace (``trace_rank{R}.json``; ``benchmarks/trace_gaps.py``
reads where the device waits) plus a table of the ops by self time (``profile_rank{R}.txt``, the quickest way
to see host cost next to kernel time) to ``--tensorboard-dir``, or without one next to ``--metrics-file``,
named after it (``<metrics stem>.trace_rank{R}.json``: runs sharing a directory keep their own).
"""

import os

import torch


def output_prefix(tensorboard_dir, metrics_file) -> str:
    """Where the PyTorch profiler's files go: ``<prefix>trace_rank{R}.json`` and ``<prefix>profile_rank{R}.txt``."""
    if tensorboard_dir or not metrics_file:
        return os.path.join(tensorboard_dir or ".", "")
    return os.path.splitext(os.path.abspath(metrics_file))[0] + "."


class IterationProfiler:
    """``before(iteration)`` / ``after(iteration)`` around each training iteration (1-based)."""

    def __init__(self, args):
        ranks = args.profile_ranks if args.profile_ranks is not None else [0]
        self.enabled = args.profile and args.rank in ranks
        self.start, self.end = args.profile_step_start, args.profile_step_end
        self.use_torch = args.use_pytorch_profiler
        self.record_shapes = args.pytorch_profiler_collect_shapes
        self.with_stack = args.pytorch_profiler_collect_callstack
        self.out_prefix = output_prefix(args.tensorboard_dir, args.metrics_file)
        self.rank = args.rank
        self._profiler = None

    def before(self, iteration: int) -> None:
        if not self.enabled or iteration != self.start:
            return
        if self.use_torch:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities, record_shapes=self.record_shapes,
                                                    with_stack=self.with_stack)
            self._profiler.__enter__()
        elif torch.cuda.is_available():
            torch.cuda.cudart().cudaProfilerStart()

    def after(self, iteration: int) -> None:
        if not self.enabled or iteration != self.end - 1:
            return
        if self.use_torch:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self._profiler.__exit__(None, None, None)
            os.makedirs(os.path.dirname(self.out_prefix), exist_ok=True)
            self._profiler.export_chrome_trace(f"{self.out_prefix}trace_rank{self.rank}.json")
            averages = self._profiler.key_averages()
            sorts = ["self_cpu_time_total"] + (["self_cuda_time_total"] if torch.cuda.is_available() else [])
            with open(f"{self.out_prefix}profile_rank{self.rank}.txt", "w") as f:
                f.write(f"iterations {self.start}..{self.end - 1}\n")
                for sort_by in sorts:
                    f.write(f"by {sort_by}\n{averages.table(sort_by=sort_by, row_limit=40)}\n")
            self._profiler = None
        elif torch.cuda.is_available():
            torch.cuda.cudart().cudaProfilerStop()
