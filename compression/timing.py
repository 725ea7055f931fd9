"""Device choice and wall-clock timing shared by the start-up probes (cost model, TP crossover) and
the benchmarks.

Two ways to time a call on CUDA:
- ``call_seconds``: each call bracketed by device synchronization, so the host's launch cost counts
  whenever it exceeds the device's work (the device idles while the host launches).
- ``queued_seconds`` (``queued_call_seconds`` for one call): back-to-back calls enqueued while the device
  is held busy by a sleep kernel, so the host runs ahead of the device as it does in training; gives the
  device time per call with the host's launch cost hidden, and that host cost separately.
And ``device_op_seconds``: the device's own time per kernel and copy of one call (PyTorch profiler),
without the host's launches and syncs in between: what a kernel-throughput goal is about.
"""

import time

import torch
import torch.distributed as dist

_sleep_cycles_per_second = {}  # device index -> measured clock of torch.cuda._sleep


def default_device() -> torch.device:
    """This process's CUDA device, else the CPU: where probes and small collectives run (NCCL reduces
    only CUDA tensors)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def call_seconds(fn, device: torch.device, repeats: int, setup=None, check=None) -> list:
    """Seconds of each of ``repeats`` calls of ``fn``, every call bracketed by device synchronization;
    ``setup`` runs untimed before each call (e.g. restoring a codec's state), ``check`` after it."""
    times = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
        if check is not None:
            check()
    return times


def device_op_seconds(fn, repeats: int, setup=None) -> dict:
    """{kernel or copy name: device seconds per call of ``fn``} (CUDA), the smallest of ``repeats``
    profiled calls per name; ``setup`` runs untimed and unprofiled before each call."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    best = {}
    for _ in range(repeats):
        if setup is not None:
            setup()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        per_call = {}
        for event in prof.events():
            if event.device_type == DeviceType.CUDA:
                per_call[event.name] = per_call.get(event.name, 0.0) + event.time_range.elapsed_us() * 1e-6
        for name, seconds in per_call.items():
            best[name] = min(best.get(name, seconds), seconds)
    return best


def cold_device_seconds(fn, device: torch.device, repeats: int = 5) -> float:
    """Device seconds of one call of ``fn`` (all its kernels and copies, ``device_op_seconds``) with the L2 cache
    flushed before each call, so that every input comes from memory as in a training step."""
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)  # larger than the L2
    return sum(device_op_seconds(fn, repeats, setup=flush.zero_).values())


def device_throughput(nbytes: int, calls: dict, repeats: int = 5) -> dict:
    """For each ``name: (fn, setup or None)``: ``{name}_device_GBps``, ``nbytes`` over the device time
    of ``fn``'s kernels and copies (``device_op_seconds``), and ``{name}_ops_us``, that time per op."""
    out = {}
    for name, (fn, setup) in calls.items():
        ops = device_op_seconds(fn, repeats, setup=setup)
        out[f"{name}_device_GBps"] = nbytes / sum(ops.values()) / 1e9
        out[f"{name}_ops_us"] = {op: 1e6 * seconds for op, seconds in ops.items()}
    return out


def kernel_ms(fn, device) -> float:
    """Median milliseconds of ``fn`` for the kernel benchmarks: ``triton.testing.do_bench`` on CUDA
    (many repeats, L2 flushed between them), one warmed-up wall-clock call on the CPU."""
    if torch.device(device).type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, return_mode="median")
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def _sleep_rate(device: torch.device) -> float:
    """Cycles per second of ``torch.cuda._sleep`` on ``device``, measured once."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _sleep_cycles_per_second:
        cycles = 10_000_000
        torch.cuda._sleep(cycles)  # warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        _sleep_cycles_per_second[index] = cycles / (start.elapsed_time(end) / 1e3)
    return _sleep_cycles_per_second[index]


def queued_call_seconds(fn, device: torch.device, host_estimate_s: float) -> tuple:
    """(device seconds, host seconds) of ONE call of ``fn`` (for calls that change state): on CUDA queued behind
    a sleep of twice ``host_estimate_s`` (+1 ms), so that its launches reach the device before it idles and
    the device time has no launch gaps (``fn`` must not synchronize); on the CPU the wall time, twice."""
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        seconds = time.perf_counter() - start
        return seconds, seconds
    synchronize(device)
    torch.cuda._sleep(int(_sleep_rate(device) * (2 * host_estimate_s + 1e-3)))
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    start = time.perf_counter()
    fn()
    host = time.perf_counter() - start
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3, host


def queued_seconds(fn, device: torch.device, repeats: int, group=None) -> tuple:
    """(device seconds, host seconds) per call of ``repeats`` back-to-back calls of ``fn``. On CUDA
    the device first sleeps long enough for the host to enqueue every call, so the device time is
    free of launch gaps; on the CPU both are the wall time per call. When ``fn`` is a collective over
    ``group``, every rank of it must call this: the ranks agree on one sleep length, so no rank's
    device time includes waiting for a longer sleep of a peer."""
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        seconds = (time.perf_counter() - start) / repeats
        return seconds, seconds
    synchronize(device)
    start_host = time.perf_counter()
    fn()  # a synced call bounds the host time of one call, to size the sleep
    synchronize(device)
    sleep = torch.tensor([2 * repeats * (time.perf_counter() - start_host) + 2e-3], device=device)
    if group is not None:
        dist.all_reduce(sleep, op=dist.ReduceOp.MAX, group=group)
    torch.cuda._sleep(int(_sleep_rate(device) * sleep.item()))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    start_host = time.perf_counter()
    for _ in range(repeats):
        fn()
    host = (time.perf_counter() - start_host) / repeats
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats, host
