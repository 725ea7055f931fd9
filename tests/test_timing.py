"""compression/timing.py: the wall-clock helpers on the CPU, the profiler's device times on a GPU."""

import pytest
import torch

from compression import timing
from compression.timing import call_seconds, device_op_seconds, device_throughput, queued_seconds


def test_call_and_queued_seconds_on_cpu():
    calls = []
    times = call_seconds(lambda: calls.append("call"), torch.device("cpu"), 3,
                         setup=lambda: calls.append("setup"), check=lambda: calls.append("check"))
    assert len(times) == 3 and all(t >= 0 for t in times)
    assert calls == ["setup", "call", "check"] * 3
    device_s, host_s = queued_seconds(lambda: sum(range(1000)), torch.device("cpu"), 4)
    assert device_s == host_s > 0


def test_device_throughput_sums_each_calls_ops(monkeypatch):
    ops = {"kernel_a": 1e-3, "Memcpy DtoD": 1e-3}
    monkeypatch.setattr(timing, "device_op_seconds", lambda fn, repeats, setup=None: ops)
    out = device_throughput(4_000_000, {"encode": (lambda: None, None)})
    assert out["encode_device_GBps"] == pytest.approx(2.0)  # 4 MB in 2 ms
    assert out["encode_ops_us"] == {"kernel_a": pytest.approx(1000.0), "Memcpy DtoD": pytest.approx(1000.0)}


@pytest.mark.gpu
def test_device_op_seconds_counts_the_call_not_its_setup():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x = torch.randn(1 << 24, device="cuda")
    y = torch.empty_like(x)
    ops = device_op_seconds(lambda: y.copy_(x), 3, setup=lambda: torch.mul(x, 2))
    assert len(ops) == 1 and 0 < next(iter(ops.values())) < 1e-2, ops  # the copy only, not the mul
    assert torch.equal(x, y)


def test_e2e_summary_reports_the_runs_own_spread():
    """benchmarks/e2e_throughput.py: the median of the timed iterations after the warm-up, and their
    quartiles, so that a speedup can be read against the run's own iteration-to-iteration spread."""
    from benchmarks.e2e_throughput import summarize

    records = [{"iteration": i, "loss": 1.0, "iter_time_s": t} for i, t in enumerate([9.0, 9.0, 1.0, 2.0, 3.0, 4.0, 5.0])]
    records.insert(3, {"iteration": 99, "validation_loss": 1.0})  # rows without a training loss are skipped
    out = summarize(records, warmup=2)
    assert out["iters_timed"] == 5 and out["median_iter_time_s"] == 3.0
    assert out["iter_time_s_quartiles"] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert out["relative_iqr"] == pytest.approx(2.0 / 3.0)
