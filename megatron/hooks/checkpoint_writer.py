"""megatron-core's file-system checkpoint writer, whose helper processes end with their worker.

Every torch_dist save (sync or --async-save) collects its write results through a queue of a ``spawn`` context's
Manager (``filesystem_async._get_write_results_queue`` of megatron-core 0.16.1; a release without it is left as it
is): a server process that, with Python's resource tracker it brings along, outlives a worker killed with kill -9,
forever. ``apply`` makes that Manager set its parent-death signal (``megatron.training.lifetime.die_with_parent``) as
it starts; the tracker, which exits once every process holding its pipe is gone (the worker, the Manager, the forked
writers: ``lifetime.fork_children_die_with_parent``), then follows. The queue and its use are megatron-core's.
"""

import multiprocessing as mp
from multiprocessing.managers import SyncManager

from megatron.training.lifetime import die_with_parent


def apply() -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not hasattr(filesystem_async, "_get_write_results_queue") or getattr(
            filesystem_async._get_write_results_queue, "_dies_with_parent", False):
        return

    def write_results_queue():
        if filesystem_async._results_queue is None:
            manager = SyncManager(ctx=mp.get_context("spawn"))
            manager.start(initializer=die_with_parent)
            filesystem_async._results_queue = manager.Queue()  # the proxy keeps the manager alive
        return filesystem_async._results_queue

    write_results_queue._dies_with_parent = True
    filesystem_async._get_write_results_queue = write_results_queue
