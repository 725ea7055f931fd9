"""Processes that end with the process that started them (Linux): training workers with their torchrun launcher,
a worker's forked helpers (megatron-core's checkpoint writers, data-loader workers) and the spawned Manager of
megatron-core's file-system writer (``megatron.hooks.checkpoint_writer``) with their worker.

A kill -9 of the launcher otherwise leaves its workers training and writing checkpoints, reparented to init; a
kill -9 of a worker leaves the writer's Manager and, through it, Python's resource tracker running forever, and a
writer forked for a save in flight can block forever on its results queue (holding the tracker too). The kernel's
parent-death signal (prctl PR_SET_PDEATHSIG) ends them. It is sent when the *thread* that started the process exits,
so forks from other threads than the main one are left alone. Imports nothing heavy: the writer's Manager process
imports this module to call ``die_with_parent``.
"""

import ctypes
import os
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
LAUNCHER_ENV = "TORCHELASTIC_RUN_ID"  # set by torchrun (torch.distributed.elastic) in every worker's environment


def set_parent_death_signal(signum: int = signal.SIGKILL) -> bool:
    """Have the kernel send ``signum`` to this process when its parent exits; False where there is no prctl."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    return True


def die_with_parent() -> None:
    """SIGKILL when the parent exits; at once if it exited while the signal was being set (this process was
    reparented). One that exited earlier goes unnoticed (its orphan's parent is init or a subreaper, which may also
    be a real parent): call this first thing."""
    parent = os.getppid()
    if set_parent_death_signal() and os.getppid() != parent:
        os._exit(1)


def exit_with_launcher() -> None:
    """A torchrun worker ends when its launcher does (a kill -9 of torchrun sends its workers nothing): the launcher
    is the worker's parent (torch.distributed.elastic starts workers as its own subprocesses). Other launchers
    (srun, mpirun, a plain python) stop their processes themselves."""
    if LAUNCHER_ENV in os.environ:
        die_with_parent()


_fork_hooks = {"registered": False, "from_main_thread": False}


def _note_forking_thread() -> None:
    _fork_hooks["from_main_thread"] = threading.current_thread() is threading.main_thread()


def _forked_child_dies_with_parent() -> None:
    if _fork_hooks["from_main_thread"]:  # the parent's state, copied into the child at the fork
        die_with_parent()


def fork_children_die_with_parent() -> None:
    """From now on every process this one forks from its main thread (multiprocessing's fork context: the checkpoint
    writers, data-loader workers) is SIGKILLed when this one exits. ``subprocess`` and the spawn context exec a new
    program and run no fork hooks."""
    if _fork_hooks["registered"] or not hasattr(os, "register_at_fork"):
        return
    os.register_at_fork(before=_note_forking_thread, after_in_child=_forked_child_dies_with_parent)
    _fork_hooks["registered"] = True
