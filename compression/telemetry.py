"""Byte telemetry: raw (what uncompressed Megatron would send) vs sent bytes per collective class.

Each rank counts the bytes it hands to collectives as input; the training driver sums the counters
over all ranks once per iteration. Counting is host-side integer arithmetic: no device sync.

``SQNR`` measures a codec's error where the exact result is at hand (an emulated TP group computes every
rank's part in one process): per collective site, the signal-to-quantization-noise ratio of a sample of
its calls, summed on the device and read (one sync) when the driver logs it.
"""

import math
from collections import Counter, defaultdict

import torch

# dp_expert_param_gather: the parameter all-gather of expert (MoE) buckets, apart from the dense ones,
# since their weights change differently between steps
COMM_CLASSES = ("tp", "dp_param_gather", "dp_grad_reduce", "pp", "ep", "dp_expert_param_gather")
PARAM_GATHER_CLASSES = ("dp_param_gather", "dp_expert_param_gather")  # dense and expert buckets


def raw_and_sent(comm: dict, classes) -> tuple:
    """(raw, sent) bytes summed over ``classes`` of a metrics record's ``comm`` entry."""
    return tuple(sum(comm.get(c, {}).get(key, 0) for c in classes) for key in ("raw_bytes", "sent_bytes"))


class CommTelemetry:
    def __init__(self):
        self._raw = defaultdict(int)
        self._sent = defaultdict(int)
        self._extra = defaultdict(int)

    def record(self, comm_class: str, raw_bytes: int, sent_bytes: int) -> None:
        if comm_class not in COMM_CLASSES:
            raise ValueError(f"unknown communication class {comm_class!r}; one of {COMM_CLASSES}")
        self._raw[comm_class] += int(raw_bytes)
        self._sent[comm_class] += int(sent_bytes)

    def declare_counter(self, name: str) -> None:
        """Register an extra counter on every rank at install time, so that all ranks reduce the same
        list of counters even if some never increment it."""
        self._extra[name] += 0

    def add_counter(self, name: str, value: int) -> None:
        """Extra integer counters (e.g. ``dp_param_gather/blocks_changed``); declare them first."""
        if name not in self._extra:
            raise KeyError(f"telemetry counter {name!r} was not declared with declare_counter()")
        self._extra[name] += int(value)

    def counters(self) -> list:
        """Flat list [raw, sent] per class in COMM_CLASSES order, then the extra counters by name."""
        flat = []
        for c in COMM_CLASSES:
            flat += [self._raw[c], self._sent[c]]
        return flat + [self._extra[k] for k in sorted(self._extra)]

    def extra_names(self) -> list:
        return sorted(self._extra)

    def extra_counters(self) -> dict:
        """The declared counters by name (this process's, since the last reset)."""
        return dict(self._extra)

    def reset(self) -> None:
        """Zero every counter (declared counters stay declared)."""
        self._raw.clear()
        self._sent.clear()
        for name in self._extra:
            self._extra[name] = 0


TELEMETRY = CommTelemetry()


class SqnrMeter:
    """Signal and noise power per site, from the first call of each site and every ``every``-th after it."""

    def __init__(self, every: int = 100):
        self.every = every
        self._calls = Counter()
        self._sums = {}  # site -> float64 [2]: sum of exact^2, sum of (coded - exact)^2

    def due(self, site: str) -> bool:
        """Count a call of ``site``; True when this one is sampled."""
        self._calls[site] += 1
        return self._calls[site] % self.every == 1 % self.every

    def add(self, site: str, exact: torch.Tensor, coded: torch.Tensor) -> None:
        exact = exact.float()
        powers = torch.stack([exact.square().sum(), (coded.float() - exact).square().sum()]).double()
        if site in self._sums:
            self._sums[site] += powers
        else:
            self._sums[site] = powers

    def pending(self) -> bool:
        return bool(self._sums)

    def read_db(self) -> dict:
        """SQNR in dB per site since the last read (inf where the code was exact), then start over."""
        sites = sorted(self._sums)
        if not sites:
            return {}
        powers = torch.stack([self._sums[site] for site in sites]).tolist()
        self._sums.clear()
        return {site: _db(signal, noise) for site, (signal, noise) in zip(sites, powers)}


def _db(signal: float, noise: float) -> float:
    if noise == 0:
        return math.inf
    return -math.inf if signal == 0 else 10 * math.log10(signal / noise)


SQNR = SqnrMeter()
