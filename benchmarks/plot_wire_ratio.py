"""Wire ratio of the parameter all-gather over a training run, per iteration, from the metrics files of
``--metrics-file`` (JSON lines): raw bf16 bytes over bytes sent, dense and expert buckets together, warm-up
and keyframe included. Iterations where nothing was gathered through a codec (the trial's plain ones, a
choice of none) are left out, since their 1.0x says nothing about the code. A curve may also come from the JSON
of ``benchmarks/delta_wire_gpt_gpu.py`` (``PATH.json@LR``, its ``ratio`` per iteration, or ``PATH.json@LR@FIELD``
for another per-iteration field such as ``ratio_flat_bitmaps``, format 3's bytes of the same run).

    python benchmarks/plot_wire_ratio.py 'lr 1e-4=results/wire_ratio/gpt125m_dp2_delta_lr1e-4.jsonl' --out ratio.png
    python benchmarks/plot_wire_ratio.py 'format 4, lr 1e-5=delta_wire_gpt.json@1e-5' --out ratio.png
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from compression.telemetry import PARAM_GATHER_CLASSES, raw_and_sent  # noqa: E402


def wire_ratios(path: str) -> list:
    """(iteration, raw / sent) of every record whose gathers went through a codec (a metrics file), or of every
    iteration of one learning rate of a ``delta_wire_gpt_gpu.py`` JSON (``PATH.json@LR[@FIELD]``)."""
    if "@" in path:
        path, lr, *field = path.split("@")
        with open(path) as f:
            iterations = json.load(f)["results"][lr]["iterations"]
        return [(it["iteration"], it[field[0] if field else "ratio"]) for it in iterations]
    points = []
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            raw, sent = raw_and_sent(record.get("comm", {}), PARAM_GATHER_CLASSES)
            if raw and sent and record.get("param_gather_compressed", True) and sent != raw:
                points.append((record["iteration"], raw / sent))
    return points


def plot(curves: dict, out: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for label, points in curves.items():
        ax.plot([p[0] for p in points], [p[1] for p in points], label=label, linewidth=1.2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("iteration")
    ax.set_ylabel("bf16 bytes / bytes sent")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("curves", nargs="+", help="LABEL=METRICS.jsonl")
    parser.add_argument("--out", required=True)
    parser.add_argument("--title", default="parameter all-gather wire ratio over training")
    args = parser.parse_args()
    curves = {}
    for spec in args.curves:
        label, sep, path = spec.rpartition("=")  # labels may hold "=" (DP=2)
        if not sep:
            parser.error(f"expected LABEL=PATH, got {spec!r}")
        curves[label] = wire_ratios(path)
    plot(curves, args.out, args.title)
    for label, points in curves.items():
        tail = points[len(points) // 2:]
        print(f"{label}: {len(points)} iterations, first {points[0][1]:.2f}x, last {points[-1][1]:.2f}x, "
              f"second half mean {sum(r for _, r in tail) / len(tail):.2f}x")


if __name__ == "__main__":
    main()
