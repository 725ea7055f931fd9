"""Run a function on N gloo ranks (or NCCL ranks, a GPU each), or a training entry point on N CPU ranks, and
collect each rank's result.

Process start-up dominates CPU test time: importing torch and megatron-core costs ~8 s of CPU per process,
more than a short run trains. So CPU ranks are forked from one server process that imported them once per
test run (multiprocessing's forkserver, started with the ranks' CPU environment); NCCL ranks are spawned.
Tests should still pack many checks into one call of ``run_on_ranks`` rather than launch one world per check.
"""

import faulthandler
import json
import multiprocessing.connection
import multiprocessing.forkserver
import os
import queue as queue_module
import runpy
import signal
import socket
import sys
import time
import traceback
import warnings

import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_ENV = dict(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")  # also what the server imports under
# what a training run imports; a rank imports whatever else it needs itself
PRELOAD = ["megatron.training.training", "megatron.training.checkpointing", "megatron.training.model",
           "megatron.training.data", "megatron.hooks.param_gather", "megatron.hooks.tp", "megatron.hooks.pp"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_context():
    """The forkserver context, its server running with PRELOAD imported under CPU_ENV (checked on every call:
    multiprocessing would restart a dead server with whatever environment the caller has then)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    saved = {key: os.environ.get(key) for key in CPU_ENV}
    os.environ.update(CPU_ENV)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        for key, value in saved.items():
            if value is None:
                del os.environ[key]
            else:
                os.environ[key] = value
    return ctx


def _worker(rank, world_size, port, fn, args, queue, backend):
    faulthandler.enable(all_threads=True)  # a rank that dies in C code (abort, segfault) says where, in the test log
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
    the children), and its result plain data (numbers, lists, numpy arrays): a tensor travels as a file descriptor
    of shared memory, which can close with the rank's process before the parent reads it."""
    ctx = _cpu_context() if backend == "gloo" else mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, backend))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors, killed = {}, [], set()
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size and not errors:
            try:
                rank, status, value = queue.get(timeout=1)
            except queue_module.Empty:
                # a rank that died in C code (an abort, a segfault) reports nothing, and its peers may wait forever
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
                if time.monotonic() > deadline:
                    errors.append(f"timed out after {timeout} s")
                continue
            if status == "ok":
                results[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
    finally:
        for rank, p in enumerate(procs):
            p.join(timeout=5 if errors or len(results) < world_size else timeout)
            if p.is_alive():
                p.kill()
                killed.add(rank)
    errors += [f"rank {rank} ended without reporting: {_ended(p.exitcode)}" for rank, p in enumerate(procs)
               if rank not in killed and rank not in results and p.exitcode not in (None, 0)]
    if errors:
        raise RuntimeError("distributed test failed\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]


def _ended(exitcode: int) -> str:
    if exitcode < 0:
        return f"died of {signal.Signals(-exitcode).name} (its faulthandler traceback is in the captured stderr)"
    return f"exited with status {exitcode}"


def _run_script(rank, nproc, port, script, argv, env, log_dir):
    """One rank of a training run, as torchrun starts it: torchrun's rank variables in the given environment,
    stdout and stderr in files of its own, the entry point run as __main__ with ``argv``."""
    os.environ.clear()
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc))
    warnings.simplefilter("ignore")  # env's PYTHONWARNINGS, read only at interpreter start (the server's)
    os.makedirs(os.path.join(log_dir, str(rank)))
    for fd, name in ((1, "stdout.log"), (2, "stderr.log")):
        with open(os.path.join(log_dir, str(rank), name), "w") as f:
            os.dup2(f.fileno(), fd)
    faulthandler.enable(all_threads=True)
    os.chdir(ROOT)
    sys.argv = [script, *argv]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _wait_all(procs, timeout):
    """Wait for every rank; at the first that fails (or at the timeout) kill the others, as torchrun stops its
    workers. Returns None, or the failed rank (None: timed out) and what happened."""
    deadline = time.monotonic() + timeout
    running = {p.sentinel: rank for rank, p in enumerate(procs)}
    failed = None
    while running and failed is None:
        ready = multiprocessing.connection.wait(list(running), timeout=max(deadline - time.monotonic(), 0))
        if not ready:
            failed = None, f"timed out after {timeout} s"
        for sentinel in ready:
            rank = running.pop(sentinel)
            procs[rank].join()
            if procs[rank].exitcode != 0 and failed is None:
                failed = rank, f"rank {rank} exited with {procs[rank].exitcode}"
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    return failed


def launch_training(tmp_path, name, script, nproc, flags, timeout=400):
    """Run a training entry point (e.g. ``pretrain_gpt.py``) on ``nproc`` CPU ranks with ``--metrics-file``, as
    ``torchrun --nproc-per-node`` does (ranks forked from the preloaded server); return its per-iteration metrics
    records (none for a run that trains no iteration). Each rank's stdout and stderr: ``{name}_logs/{rank}/``."""
    metrics = tmp_path / f"{name}.jsonl"
    logs = tmp_path / f"{name}_logs"
    argv = [*flags.split(), "--metrics-file", str(metrics), "--data-cache-path", str(tmp_path / "cache")]
    env = dict(os.environ, **CPU_ENV, PYTHONWARNINGS="ignore")
    ctx, port = _cpu_context(), _free_port()
    procs = [ctx.Process(target=_run_script,
                         args=(rank, nproc, port, os.path.join(ROOT, script), argv, env, str(logs)))
             for rank in range(nproc)]
    for p in procs:
        p.start()
    failed = _wait_all(procs, timeout)
    assert failed is None, f"{name} failed: {failed[1]}{_log_tails(logs, failed[0])}"
    return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []


def max_loss_rel_diff(reference, runs) -> float:
    """The largest relative difference of two runs' losses, iteration by iteration (metrics records)."""
    return max(abs(r["loss"] - e["loss"]) / r["loss"] for r, e in zip(reference, runs, strict=True))


def _log_tails(logs, rank) -> str:
    """Rank 0's stdout and the failed rank's stderr (its peers mostly show connection errors)."""
    stdout = logs / "0" / "stdout.log"
    stderr = logs / str(rank or 0) / "stderr.log"
    return "".join(f"\n{path}:\n{path.read_text()[-limit:]}" for path, limit in ((stdout, 3000), (stderr, 6000))
                   if path.exists())
