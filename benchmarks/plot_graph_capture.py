"""Per-step time of ``bench_graph_capture.py`` runs (optimizer + working set + gather, ms) with the re-capture
steps marked, and the reserved memory, one curve per labelled JSON.

    python benchmarks/plot_graph_capture.py 'capturing=a.json' 'torch.cuda.graph=b.json' --out capture.png
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_graph_capture import PHASES  # noqa: E402


def _step_ms(step: dict) -> float:
    return sum(step[p] for p in PHASES) * 1e3


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="LABEL=PATH.json")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (time_ax, memory_ax) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for run in args.runs:
        label, path = run.split("=", 1)
        with open(path) as f:
            steps = json.load(f)["steps"][2:]  # the keyframe, then the first exchange (compiles)
        x = [s["step"] for s in steps]
        line, = time_ax.plot(x, [_step_ms(s) for s in steps], marker=".", label=label)
        captured = [s for s in steps if s["captured"]]
        time_ax.scatter([s["step"] for s in captured], [_step_ms(s) for s in captured],
                        marker="o", s=60, facecolors="none", edgecolors=line.get_color())
        memory_ax.plot(x, [s["reserved_bytes"] / 2**30 for s in steps], marker=".", color=line.get_color(), label=label)
    time_ax.set_ylabel("step ms (circles: captures)")
    time_ax.set_ylim(bottom=0)
    time_ax.legend()
    memory_ax.set_ylabel("reserved GiB after the gather")
    memory_ax.set_xlabel("step")
    fig.suptitle("re-captured graphed gathers (a new slot capacity every 8 steps), 1x H200")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
