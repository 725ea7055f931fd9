"""compression/timing.py: the wall-clock helpers on the CPU, the profiler's device times on a GPU."""

import json
import os
import time

import pytest
import torch

from compression import timing
from compression.timing import call_seconds, device_op_seconds, device_throughput, queued_call_seconds, queued_seconds


def test_call_and_queued_seconds_on_cpu():
    calls = []
    times = call_seconds(lambda: calls.append("call"), torch.device("cpu"), 3,
                         setup=lambda: calls.append("setup"), check=lambda: calls.append("check"))
    assert len(times) == 3 and all(t >= 0 for t in times)
    assert calls == ["setup", "call", "check"] * 3
    device_s, host_s = queued_seconds(lambda: sum(range(1000)), torch.device("cpu"), 4)
    assert device_s == host_s > 0
    once = []  # a state-changing call runs exactly once
    device_s, host_s = queued_call_seconds(lambda: once.append(sum(range(1000))), torch.device("cpu"), 0.01)
    assert device_s == host_s > 0 and len(once) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_queued_call_seconds_hides_the_launch_gap():
    """A kernel behind a host-side delay: the queued device time is the kernel's, not the delay's."""
    import time

    x = torch.ones(1 << 20, device="cuda")

    def slow_host_then_kernel():
        time.sleep(0.02)  # the host's launch path, slow
        x.mul_(1.0)

    device_s, host_s = queued_call_seconds(slow_host_then_kernel, torch.device("cuda"), 0.02)
    assert host_s >= 0.02 and device_s < 0.01


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


def test_e2e_between_graph_captures():
    """A run with --delta-cuda-graphs: the iterations whose gathers were captured (its metrics' graph_captures
    counters), and its median over the timed iterations neither capturing nor right after a capture, against the
    baseline's median of the same iterations."""
    from benchmarks.e2e_throughput import between_captures, summarize

    def records(times, captures=None):
        counters = lambda i: {"comm_counters": {"dp_param_gather/graph_captures": int(i in captures)}}  # noqa: E731
        return [{"iteration": i, "loss": 1.0, "iter_time_s": t, **(counters(i) if captures is not None else {})}
                for i, t in enumerate(times, 1)]

    base = summarize(records([5.0, 2.0, 2.0, 2.0, 2.0, 2.0, 3.0, 2.0]), warmup=2)
    run = summarize(records([9.0, 1.0, 8.0, 4.0, 1.0, 1.0, 9.0, 6.0], captures={1, 3, 7}), warmup=2)
    assert "graph_capture_iterations" not in base and run["graph_capture_iterations"] == [1, 3, 7]
    steady = between_captures(base, run)  # timed 3-8; 3 and 7 captured, 4 and 8 follow them
    assert steady["iterations"] == [5, 6] and steady["median_iter_time_s"] == 1.0
    assert steady["speedup_vs_baseline"] == 2.0
    assert between_captures(base, summarize(records([1.0] * 8, captures=set()), warmup=2)) is None


def test_e2e_times_a_graphed_gathers_run_after_its_trial():
    """A variant whose gathers are graphed and chosen with a trial (which times replays, so it starts later): the
    benchmark's default warm-up and length grow by as many iterations as the trial's start moved."""
    from benchmarks.e2e_throughput import GRAPHED_TRIAL_LAG, PARAM_GATHER_ABLATION, _graphed_trial
    from megatron.hooks.config import ParamGatherConfig
    from megatron.hooks.param_gather_selection import trial_skip_iterations
    from megatron.hooks.trial import TRIAL_SKIP_ITERATIONS

    graphs = ParamGatherConfig(method="delta", delta_capacity_factor=1.25, delta_cuda_graphs=True)
    assert GRAPHED_TRIAL_LAG == trial_skip_iterations(graphs) - TRIAL_SKIP_ITERATIONS
    assert _graphed_trial(PARAM_GATHER_ABLATION["delta_slots_graphs"])
    assert not _graphed_trial(PARAM_GATHER_ABLATION["delta_all_slots_graphs"])  # no trial: every bucket compressed
    assert not _graphed_trial(PARAM_GATHER_ABLATION["delta"])


def test_e2e_comm_profile_share_and_bound(tmp_path):
    """--comm-profile: profiled iterations are left out of the timing; NCCL kernels are summed per collective
    and the codec kernels apart, per iteration; the bound is 1 / (1 - s (1 - 1/r)) from the baseline's share s
    and the variant's wire ratio r."""
    from benchmarks.e2e_throughput import device_time_per_iteration, share_and_bound, summarize

    records = [{"iteration": i, "loss": 1.0, "iter_time_s": t} for i, t in enumerate([1.0, 2.0, 3.0, 50.0, 60.0], 1)]
    assert summarize(records, warmup=0, last=3)["median_iter_time_s"] == 2.0  # iterations 4-5 profiled

    def kernel(name, dur):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": 0, "dur": dur}

    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": [
        kernel("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 6000),
        kernel("ncclKernel_AllGather_RING_LL_Sum_int8_t", 2000), kernel("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", 4000),
        kernel("_encode_kernel", 1000), kernel("void at::native::vectorized_elementwise_kernel<4>", 9000),
        {"ph": "X", "cat": "cpu_op", "name": "_encode_kernel", "ts": 0, "dur": 7000}]}))
    ms = device_time_per_iteration(str(trace), iterations=2)
    assert ms == {"AllGather": 4.0, "ReduceScatter": 2.0, "codec_kernels": 0.5}

    base = {"median_iter_time_s": 0.020, "device_ms_per_iter": ms}  # all-gather share 4 / 20 ms
    run = {"speedup_vs_baseline": 1.1, "comm_last_iter": {"dp_param_gather": {"raw_bytes": 400, "sent_bytes": 100}}}
    out = share_and_bound(base, run, "param_gather")
    assert out["baseline_comm_share"] == pytest.approx(0.2) and out["wire_ratio"] == 4.0
    assert out["bound"] == pytest.approx(1 / (1 - 0.2 * 0.75))
    assert out["fraction_of_bound_gain"] == pytest.approx(0.1 / (out["bound"] - 1))
    assert "bound" not in share_and_bound(base, {"speedup_vs_baseline": 1.0, "comm_last_iter": {}}, "param_gather")
    moe = {"speedup_vs_baseline": 1.0, "comm_last_iter": {"dp_param_gather": {"raw_bytes": 400, "sent_bytes": 100},
                                                          "dp_expert_param_gather": {"raw_bytes": 200, "sent_bytes": 100}}}
    assert share_and_bound(base, moe, "param_gather")["wire_ratio"] == 3.0  # dense and expert buckets together


def test_e2e_run_timeout_kills_the_run_and_its_ranks(tmp_path):
    """--run-timeout: a run past it (here a rank that never ends, as a hung shutdown) is stopped, torchrun with its
    ranks, and reported as failed, rather than holding the suite (and the device call) to its end."""
    from benchmarks.e2e_throughput import RunFailed, run_one

    pid_file = tmp_path / "rank.pid"
    script = tmp_path / "hangs.py"
    script.write_text(f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(600)\n")
    start = time.monotonic()
    with pytest.raises(RunFailed, match=r"timed out after 20 s \(--run-timeout\)"):
        run_one(1, str(script), [], {}, str(tmp_path / "m.jsonl"), str(tmp_path / "run.log"), timeout=20)
    assert time.monotonic() - start < 120  # the time-out and torchrun's shutdown, not the rank's 600 s
    pid = int(pid_file.read_text())
    time.sleep(0.5)
    state = open(f"/proc/{pid}/stat").read().split()[2] if os.path.exists(f"/proc/{pid}") else "gone"
    assert state in ("gone", "Z", "X"), state  # the rank was killed too
