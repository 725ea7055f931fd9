"""benchmarks/plot_e2e.py draws a PNG from e2e_throughput JSON (baselines left out, bounds where measured)."""

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
