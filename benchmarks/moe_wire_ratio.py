"""Parameter all-gather wire ratio of the lossless codecs on an MoE, dense and expert buckets apart (CPU,
real training driver; bytes are exact, so no GPU is needed).

Issue 4 asks where each model lands against CIERA's 2x ceiling "by shard type": an MoE's expert weights
each see only the tokens routed to them, so their exponents and bits may change less between steps than
the dense ones. This trains `configs/tiny_cpu_moe.yaml` (4 experts, top-2) in bf16 on 4 processes with EP=2
and the distributed optimizer (dense buckets gathered over DP=4, expert buckets over expert-DP=2; at EP=1
megatron-core 0.16.1 keeps the experts in the dense buffer, so the two cannot be told apart), at a constant
learning rate after warm-up, with `--overlap-param-gather` (each bucket gathered once per iteration, in
the forward pre-hook: without it megatron-core 0.16.1 gathers every bucket after each optimizer of its
chain, dense then expert, i.e. twice per iteration, once with nothing changed), once uncompressed and
once per codec (`--param-gather-selection all`), checks
that every run's losses are bit-identical to the uncompressed one, and reads raw / sent bytes per
iteration for `dp_param_gather` (dense) and `dp_expert_param_gather` (experts) from the metrics file.
Steady state: median over the second half of the iterations.

    python benchmarks/moe_wire_ratio.py --out moe_wire_ratio_cpu
"""

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.e2e_throughput import run_one  # noqa: E402
from benchmarks.finetune_wire_ratio import CODECS, CPU_ENV, gather_ratios  # noqa: E402

CLASSES = {"dense": "dp_param_gather", "expert": "dp_expert_param_gather"}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory: logs, results.json, table.md")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--lrs", default="1e-3,1e-4,1e-5")
    args = p.parse_args()
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    model = ["--config", "configs/tiny_cpu_moe.yaml", "--bf16", "--use-distributed-optimizer", "--overlap-param-gather",
             "--overlap-grad-reduce",
             "--expert-model-parallel-size", "2", "--train-iters", str(args.iters), "--eval-interval", "1000000",
             "--eval-iters", "0", "--lr-decay-style", "constant", "--lr-warmup-iters", "10",
             "--data-cache-path", os.path.join(args.out, "cache")]
    results = {"command": " ".join(sys.argv), "runs": {}}
    for lr in args.lrs.split(","):
        flags = model + ["--lr", lr, "--min-lr", lr]
        base = None
        for codec, codec_flags in {"none": [], **CODECS}.items():
            name = f"lr{lr}_{codec}"
            selection = [] if codec == "none" else ["--param-gather-selection", "all"]
            _, wall, records = run_one(4, "pretrain_moe.py", flags + codec_flags + selection, CPU_ENV,
                                       os.path.join(args.out, "logs", name + ".jsonl"),
                                       os.path.join(args.out, "logs", name + ".log"))
            print(f"{name}: {len(records)} iterations in {wall:.0f} s", flush=True)
            losses = [r["loss"] for r in records]
            if base is None:
                base = losses
                continue
            if losses != base:
                raise AssertionError(f"{name}: losses are not bit-identical to the uncompressed run")
            entry = {}
            for kind, comm_class in CLASSES.items():
                ratios = gather_ratios(records, comm_class)
                entry[kind] = dict(per_iteration=ratios, steady=statistics.median(ratios[len(ratios) // 2:]),
                                   raw_bytes_per_iteration=records[-1]["comm"][comm_class]["raw_bytes"])
            results["runs"].setdefault(lr, {})[codec] = entry

    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    some = next(iter(results["runs"].values()))
    raw = {kind: some[next(iter(some))][kind]["raw_bytes_per_iteration"] for kind in CLASSES}
    lines = [f"Command: `{results['command']}`", "",
             f"Raw bytes per iteration (all ranks): dense {raw['dense']}, expert {raw['expert']}. "
             "Steady wire ratio (raw / sent, median of the second half of the iterations); losses of every "
             "run bit-identical to the uncompressed one.", "",
             "| lr | " + " | ".join(f"{c} dense | {c} expert" for c in CODECS) + " |",
             "|---|" + "---|---|" * len(CODECS)]
    for lr, by_codec in results["runs"].items():
        lines.append(f"| {float(lr):g} | " + " | ".join(
            f"{by_codec[c]['dense']['steady']:.3f}x | {by_codec[c]['expert']['steady']:.3f}x" for c in CODECS) + " |")
    table = "\n".join(lines)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
