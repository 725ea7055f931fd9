"""Device choice and wall-clock timing shared by the start-up probes (cost model, TP crossover)."""

import time

import torch


def default_device() -> torch.device:
    """This process's CUDA device, else the CPU: where probes and small collectives run (NCCL reduces
    only CUDA tensors)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def call_seconds(fn, device: torch.device, repeats: int) -> list:
    """Seconds of each of ``repeats`` calls of ``fn``, every call bracketed by device synchronization."""
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times
