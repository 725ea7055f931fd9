"""Run a function on N gloo ranks in spawned CPU processes (or NCCL ranks, a GPU each) and collect each
rank's return value.

Process start-up dominates CPU test time (~2.5 s per rank on 2 cores), so tests should pack many
checks into one call of ``run_on_ranks`` rather than launch one world per check.
"""

import os
import socket
import traceback

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue, backend):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), OMP_NUM_THREADS="1",
    )
    if backend == "gloo":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        result = fn(*args)
        queue.put((rank, "ok", result))
    except BaseException:  # report the failure to the parent rather than hang it
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(fn, world_size: int, *args, timeout: float = 600, backend: str = "gloo"):
    """Call ``fn(*args)`` on every rank of a fresh gloo world (CPU), or with ``backend="nccl"`` one GPU per
    rank; return the list of results by rank. ``fn`` must be a module-level function (it is pickled into
    the children)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, backend))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world_size):
            rank, status, value = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if errors else timeout)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("distributed test failed\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]


def launch_training(tmp_path, name, script, nproc, flags, timeout=400):
    """Run a training entry point (e.g. ``pretrain_gpt.py``) under torchrun on ``nproc`` CPU processes
    with ``--metrics-file``; return its per-iteration metrics records."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    metrics = tmp_path / f"{name}.jsonl"
    logs = tmp_path / f"{name}_logs"  # every rank's own stdout/stderr (also echoed: --tee 3)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--log-dir", str(logs), "--tee", "3", os.path.join(root, script), *flags.split(),
           "--metrics-file", str(metrics), "--data-cache-path", str(tmp_path / "cache")]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    result = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (f"{name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
                                    f"{_root_cause_log(result.stderr, logs)}")
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def _root_cause_log(stderr: str, logs) -> str:
    """The stderr of the rank torchrun names as the root cause of a failure (the combined tail above mostly
    shows its peers' "connection closed" errors)."""
    import re

    found = re.search(r"Root Cause.*?rank\s*:\s*\d+ \(local_rank: (\d+)\)", stderr, re.S)
    files = sorted(logs.glob(f"*/attempt_*/{found.group(1)}/stderr.log")) if found else []
    return f"\nroot-cause rank {found.group(1)}'s stderr:\n{files[-1].read_text()[-6000:]}" if files else ""
