"""megatron-core's file-system checkpoint writer, whose helper processes end with their worker.

Every torch_dist save (sync or --async-save) collects its write results through a queue of a ``spawn`` context's
Manager (``filesystem_async._get_write_results_queue`` of megatron-core 0.16, ``get_write_results_queue(mp_mode)`` from
0.17; a release with neither is left as it is): a server process that, with Python's resource tracker it brings along,
outlives a worker killed with kill -9, forever. ``apply`` makes that Manager set its parent-death signal
(``megatron.training.lifetime.die_with_parent``) as it starts; the tracker, which exits once every process holding its
pipe is gone (the worker, the Manager, the forked writers: ``lifetime.fork_children_die_with_parent``), then follows.
The queue and its use are megatron-core's.
"""

import multiprocessing as mp
from multiprocessing.managers import SyncManager

from megatron.training.lifetime import die_with_parent

QUEUE_GETTERS = ("_get_write_results_queue", "get_write_results_queue")  # by release, as above


def apply() -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    for name in QUEUE_GETTERS:
        getter = getattr(filesystem_async, name, None)
        if getter is not None and not getattr(getter, "_dies_with_parent", False):
            setattr(filesystem_async, name, _write_results_queue(filesystem_async))


def _write_results_queue(filesystem_async):
    """The module's queue getter, its Manager started with the parent-death signal."""

    def write_results_queue(mp_mode: str = "spawn"):
        if filesystem_async._results_queue is None:
            manager = SyncManager(ctx=mp.get_context(mp_mode))
            manager.start(initializer=die_with_parent)
            filesystem_async._results_queue = manager.Queue()  # the proxy keeps the manager alive
        return filesystem_async._results_queue

    write_results_queue._dies_with_parent = True
    return write_results_queue
