"""CUDA-graph replay of compressed collectives, to take their host cost out of every call.

A compressed collective costs the GPU less than NCCL's but the host more: Triton's Python launch
path, tensor bookkeeping and the NCCL calls add up to 0.24-0.43 ms per one-shot all-reduce against
~0.1 ms for NCCL (measured on an H200), and where the host is the bottleneck (GPT-350M at
TP=2) that cost eats the GPU's saving. The TACO collectives have no host synchronization, so a call
of fixed input shape can be captured once and replayed: the host then launches one graph.

``CollectiveGraphs.run(key, fn, x)`` runs ``fn(x)`` eagerly for the first ``warmup`` calls of a key
(Triton compilation, NCCL communicator set-up, allocator), captures it on the next and replays it from
then on: ``x`` is copied into the graph's static input and the static output is cloned out, two device
copies of the tensor in exchange for the host work. Results are bit-identical to the eager calls
(same kernels, same order). Semantics differ in one way: a replayed call is complete when ``run``
returns (on the current stream), so there is no communication left to overlap with later work.

Telemetry recorded by ``fn`` (host-side counters) runs only while capturing; the graph re-records the
bytes of that call on every replay, and the capture itself counts nothing. All graphs share one
memory pool: they are replayed one at a time on one stream and every replay's output is cloned out
before the next, so one graph's scratch may reuse another's.
"""

import contextlib
import weakref
from typing import Callable, Hashable

import torch

from compression.telemetry import COMM_CLASSES, TELEMETRY


class _Captured:
    def __init__(self, graph, static_in, static_out, telemetry):
        self.graph = graph
        self.static_in = static_in
        self.static_out = static_out
        self.telemetry = telemetry  # [(comm_class, raw, sent)] recorded by one call


def _telemetry_delta(before: list, after: list) -> list:
    return [(c, after[2 * i] - before[2 * i], after[2 * i + 1] - before[2 * i + 1])
            for i, c in enumerate(COMM_CLASSES) if after[2 * i] != before[2 * i] or after[2 * i + 1] != before[2 * i + 1]]


# every live owner of captured collectives (CollectiveGraphs, and ShardGather with cuda_graphs)
_LIVE: weakref.WeakSet = weakref.WeakSet()


def track_graphs(owner) -> None:
    """Have ``release_all_graphs`` call ``owner.release_graphs()`` while ``owner`` lives."""
    _LIVE.add(owner)


def release_all_graphs() -> None:
    """Free every tracked owner's CUDA graphs: call before destroying process groups (a live graph holding NCCL
    kernels makes ``destroy_process_group`` hang in ncclCommDestroy)."""
    for owner in list(_LIVE):
        owner.release_graphs()


@contextlib.contextmanager
def capturing(graph: "torch.cuda.CUDAGraph", pool, stream: "torch.cuda.Stream"):
    """Capture the CUDA work queued inside into ``graph`` on ``stream``, its memory from ``pool`` (the pool of a live
    graph; None: a pool of its own, which the allocator reclaims after the graph's reset only when it next runs
    short or empties its cache). Captures that share a pool should share a stream too: the allocator reuses a freed
    block on the stream it was allocated on only.

    What ``torch.cuda.graph`` does, less its emptying of the allocators' caches (device and pinned host memory) at
    every capture, which makes the rest of the iteration allocate afresh: a gather re-captured during training (a new
    slot capacity) paid for it (+11-17 ms on one H200). ``thread_local``: NCCL's watchdog thread keeps
    querying its events while this thread captures."""
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        graph.capture_begin(pool, capture_error_mode="thread_local")
        try:
            yield
        finally:
            graph.capture_end()


class CollectiveGraphs:
    """One per process group (or any set of collectives replayed on one stream)."""

    def __init__(self, warmup: int = 2):
        if warmup < 1:
            raise ValueError(f"CollectiveGraphs needs >= 1 eager warm-up call per shape, got {warmup}")
        self.warmup = warmup
        self._calls: dict = {}
        self._graphs: dict = {}
        self._pool = self._stream = None  # of every capture (a stream: see capturing)
        track_graphs(self)

    def release_graphs(self) -> None:
        """Free the captured graphs (a later call of a key starts its warm-up again)."""
        if self._graphs:
            torch.cuda.synchronize()
            for captured in self._graphs.values():
                captured.graph.reset()
        self._graphs.clear()
        self._calls.clear()
        self._pool = None

    def run(self, key: Hashable, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """``fn(x)``; ``key`` must identify ``fn`` (op, group, settings): the input's shape, dtype and
        device are added to it."""
        if not x.is_cuda:
            raise ValueError("CUDA graphs of collectives need CUDA tensors (--tp-comm-cuda-graphs needs GPUs)")
        key = (key, tuple(x.shape), x.dtype, x.device)
        captured = self._graphs.get(key)
        if captured is None:
            calls = self._calls.get(key, 0)
            self._calls[key] = calls + 1
            if calls < self.warmup:
                return fn(x)
            captured = self._graphs[key] = self._capture(fn, x)
        captured.static_in.copy_(x)
        captured.graph.replay()
        for comm_class, raw, sent in captured.telemetry:
            TELEMETRY.record(comm_class, raw, sent)
        return captured.static_out.clone()

    def _capture(self, fn, x) -> _Captured:
        if self._pool is None:
            self._pool, self._stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(x.device)
        static_in = torch.empty_like(x, memory_format=torch.contiguous_format)
        static_in.copy_(x)
        graph = torch.cuda.CUDAGraph()
        before = TELEMETRY.counters()
        with capturing(graph, self._pool, self._stream):
            static_out = fn(static_in)
        telemetry = _telemetry_delta(before, TELEMETRY.counters())
        for comm_class, raw, sent in telemetry:  # capturing sent nothing
            TELEMETRY.record(comm_class, -raw, -sent)
        return _Captured(graph, static_in, static_out, telemetry)
