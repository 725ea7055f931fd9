"""benchmarks/trace_gaps.py on a hand-made trace: idle gaps charged to the host code that launched the
work ending them, host blocking calls listed with their caller."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from trace_gaps import analyze  # noqa: E402


def _x(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1, "args": args}


def test_gap_charged_to_the_late_launch_and_sync_listed():
    frame = "compression/shard_gather.py(80): _exchange_sizes"
    trace = {"traceEvents": [
        _x("python_function", "train.py(1): step", 0, 1000),
        _x("python_function", frame, 100, 400),
        _x("cuda_runtime", "cudaLaunchKernel", 10, 5, correlation=1),
        _x("kernel", "encode", 20, 100, tid=7, stream=7, correlation=1),  # busy 20..120
        _x("cuda_runtime", "cudaStreamSynchronize", 150, 250),  # the host waits inside the frame
        _x("cuda_runtime", "cudaLaunchKernel", 420, 5, correlation=2),  # launched after the gap began
        _x("kernel", "gather", 430, 50, tid=7, stream=7, correlation=2),  # gap 120..430
        _x("kernel", "adam", 480, 20, tid=7, stream=7, correlation=3),  # adjacent: no gap
    ]}
    report = analyze(trace, min_gap_us=20, top=5)
    assert "device busy 0.17 ms" in report
    charged = next(line for line in report.splitlines() if line.strip().startswith("0.31"))
    assert charged.split()[1:3] == ["1", "1"] and charged.endswith("_exchange_sizes")  # 1 gap, launched late
    blocking = report.split("host blocking calls: 1, 0.25 ms")[1]
    assert "cudaStreamSynchronize @ compression/shard_gather.py(80): _exchange_sizes" in blocking
