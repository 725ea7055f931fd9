"""benchmarks/plot_e2e.py draws a PNG from e2e_throughput JSON (baselines left out, bounds where measured);
plot_wire_ratio.py the per-iteration wire ratio from metrics files."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from plot_e2e import load_runs, plot  # noqa: E402


def test_plot_from_e2e_json(tmp_path):
    def run(link, variant, speedup, **extra):
        return dict(link=link, variant=variant, speedup_vs_baseline=speedup, relative_iqr=0.01, **extra)

    path = tmp_path / "e2e.json"
    path.write_text(json.dumps({"runs": [run("sockets_4GBps", "baseline", 1.0), run("sockets_4GBps", "delta", 1.18, bound=1.22),
                                         run("nvlink", "baseline", 1.0), run("nvlink", "delta", 0.98)]}))
    runs = load_runs([str(path)])
    assert [(r["link"], r["variant"]) for r in runs] == [("sockets_4GBps", "delta"), ("nvlink", "delta")]
    plot(runs, str(tmp_path / "out.png"), "test")
    assert (tmp_path / "out.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_wire_ratio_curve_from_metrics(tmp_path):
    """plot_wire_ratio.py: raw / sent of the dense and expert gathers per iteration; a trial's plain iterations and
    runs of plain gathers (sent == raw) are left out, the keyframe (sent a little above raw) kept."""
    from plot_wire_ratio import plot, wire_ratios

    def record(iteration, dense, expert=(0, 0), compressed=None):
        comm = {"dp_param_gather": dict(raw_bytes=dense[0], sent_bytes=dense[1]),
                "dp_expert_param_gather": dict(raw_bytes=expert[0], sent_bytes=expert[1])}
        extra = {} if compressed is None else {"param_gather_compressed": compressed}
        return json.dumps(dict(iteration=iteration, comm=comm, **extra))

    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join([record(1, (1000, 1040)), record(2, (1000, 200), (600, 100), True),
                               record(3, (1000, 1000), compressed=False), record(4, (1000, 1000))]) + "\n")
    points = wire_ratios(str(path))
    assert [i for i, _ in points] == [1, 2] and abs(points[1][1] - 1600 / 300) < 1e-12
    plot({"run": points}, str(tmp_path / "ratio.png"), "test")
    assert (tmp_path / "ratio.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_wire_ratio_curve_from_gpu_benchmark_json(tmp_path):
    """plot_wire_ratio.py reads delta_wire_gpt_gpu.py's JSON: one learning rate's per-iteration ratio, or another
    field of it."""
    from plot_wire_ratio import wire_ratios

    iterations = [dict(iteration=1, ratio=1.0, ratio_flat_bitmaps=1.0),
                  dict(iteration=2, ratio=6.5, ratio_flat_bitmaps=6.0)]
    path = tmp_path / "wire.json"
    path.write_text(json.dumps({"results": {"1e-5": {"iterations": iterations}, "1e-4": {"iterations": []}}}))
    assert wire_ratios(f"{path}@1e-5") == [(1, 1.0), (2, 6.5)]
    assert wire_ratios(f"{path}@1e-5@ratio_flat_bitmaps") == [(1, 1.0), (2, 6.0)]
    assert wire_ratios(f"{path}@1e-4") == []
