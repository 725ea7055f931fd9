"""Processes that end with the process that started them (Linux): training workers with their torchrun launcher,
and megatron-core's checkpoint-writer helpers with their worker (``megatron.hooks.checkpoint_writer``).

A kill -9 of the launcher otherwise leaves its workers training and writing checkpoints, reparented to init; a
kill -9 of a worker leaves the spawned manager process of megatron-core's file-system writer and, through it,
Python's resource tracker running forever. The kernel's parent-death signal (prctl PR_SET_PDEATHSIG) ends them:
it is sent when the thread that started the process exits, here always a main thread. Imports nothing heavy: the
writer's manager process imports this module to call ``die_with_parent``.
"""

import ctypes
import os
import signal
import sys

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
