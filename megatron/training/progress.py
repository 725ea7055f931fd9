"""--log-progress (Megatron-LM's): ``progress.txt`` in --save, one line per job start and per saved checkpoint,
in Megatron-LM's format, tab-separated fields:

    2025-01-01 12:00:00 | Job ID: 42 | # GPUs: 8 | Starting job
    2025-01-01 13:00:00 | Job ID: 42 | # GPUs: 8 | Saved checkpoint | Iteration: 100 | Job throughput: 1.2 TFLOP/s/GPU
        | Cumulative throughput: 1.1 TFLOP/s/GPU | Floating-point operations: 3.40e+15 | Tokens (in billions): 0.01

Job throughput counts this job's FLOPs since its start-up; the cumulative one all FLOPs since the first job of
the same world size that the file records (a change of world size starts the count again). Rank 0 writes.
"""

import os
from datetime import datetime

import torch

PROGRESS_FILENAME = "progress.txt"
TIME_FORMAT = "%Y-%m-%d %H:%M:%S"


def _append(args, message) -> None:
    """Rank 0 appends ``message`` (other ranks pass None) once every rank has finished what it reports."""
    torch.distributed.barrier()
    if args.rank != 0:
        return
    os.makedirs(args.save, exist_ok=True)
    with open(os.path.join(args.save, PROGRESS_FILENAME), "a") as f:
        f.write(f"{datetime.now().strftime(TIME_FORMAT)}\tJob ID: {os.environ.get('SLURM_JOB_ID', '')}\t"
                f"# GPUs: {args.world_size}\t{message}\n")


def log_job_start(args) -> None:
    if args.log_progress:
        _append(args, "Starting job")


def _field(text: str) -> str:
    return text.split(": ", 1)[1]


def cumulative_start(path: str, world_size: int) -> tuple[datetime, float]:
    """(start time, FLOPs saved before it) of the first job in the last run of jobs of this world size."""
    start, start_flops, saved_flops = None, None, 0.0
    with open(path) as f:
        for line in f:
            fields = line.rstrip("\n").split("\t")
            if fields[3] == "Saved checkpoint":
                saved_flops = float(_field(fields[7]))
            if int(_field(fields[2])) != world_size:
                start = start_flops = None
            elif fields[3] == "Starting job" and start is None:
                start, start_flops = datetime.strptime(fields[0], TIME_FORMAT), saved_flops
    if start is None:
        raise ValueError(f"{path} records no 'Starting job' at world size {world_size}: --log-progress writes one at "
                         f"each start-up; was the file edited?")
    return start, start_flops


class ProgressLog:
    """The saved-checkpoint lines of one job; ``args.num_floating_point_operations_so_far`` counts the run's FLOPs
    (from the loaded checkpoint's on) and is read at construction as this job's starting count."""

    def __init__(self, args, start_time: float):
        self.args = args
        self.start_time = start_time
        self.start_flops = args.num_floating_point_operations_so_far

    def checkpoint_saved(self, iteration: int) -> None:
        if self.args.log_progress:
            _append(self.args, self._saved_line(iteration) if self.args.rank == 0 else None)

    def _saved_line(self, iteration: int) -> str:
        args = self.args
        flops = args.num_floating_point_operations_so_far
        job_seconds = datetime.now().timestamp() - self.start_time
        job_throughput = (flops - self.start_flops) / (job_seconds * 1e12 * args.world_size)
        first_start, first_flops = cumulative_start(os.path.join(args.save, PROGRESS_FILENAME), args.world_size)
        cumulative_seconds = (datetime.now() - first_start).total_seconds()
        cumulative_throughput = (flops - first_flops) / (cumulative_seconds * 1e12 * args.world_size)
        tokens = args.consumed_train_samples * args.seq_length
        return (f"Saved checkpoint\tIteration: {iteration}\tJob throughput: {job_throughput:.1f} TFLOP/s/GPU\t"
                f"Cumulative throughput: {cumulative_throughput:.1f} TFLOP/s/GPU\t"
                f"Floating-point operations: {flops:.2e}\tTokens (in billions): {tokens / 10**9:.2f}")
