"""Parameter all-gather wire ratio of the lossless codecs when fine-tuning from a pretrained checkpoint
(CPU, real training driver; bytes are exact, so no GPU is needed).

CIERA's premise is that exponents stay put between steps, which holds when weights move little
(fine-tuning, small learning rates) and not when training from scratch. This trains a small GPT with
DP=2 and the distributed optimizer (bf16) from scratch, saves it, then fine-tunes it with `--finetune`
at several constant learning rates, once per codec (`--param-gather-compression ciera|delta`, CIERA
also with `--ciera-block-size 64`; `--param-gather-selection all`), and reads the gather's bytes (raw / sent) per iteration from the
metrics file. The first iteration after a load is a keyframe (a full gather) and is excluded from the
steady-state figure (median of the remaining iterations). The from-scratch run's own ratio per codec is
measured the same way (its iterations after warm-up).

    python benchmarks/finetune_wire_ratio.py --out finetune_wire_ratio
"""

import argparse
import json
import os
import shutil
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.e2e_throughput import run_one  # noqa: E402

# name -> flags; CIERA at its default block (512) and at 64, where fewer blocks see an exponent change
CODECS = {"ciera": ["--param-gather-compression", "ciera"],
          "ciera_b64": ["--param-gather-compression", "ciera", "--ciera-block-size", "64"],
          "delta": ["--param-gather-compression", "delta"]}
CPU_ENV = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def model_flags(args) -> list:
    return ["--config", "configs/tiny_cpu_gpt.yaml", "--hidden-size", str(args.hidden_size),
            "--ffn-hidden-size", str(4 * args.hidden_size), "--bf16", "--use-distributed-optimizer",
            "--eval-interval", "1000000", "--eval-iters", "0", "--data-cache-path", os.path.join(args.out, "cache")]


def gather_ratios(records, comm_class: str = "dp_param_gather") -> list:
    """raw / sent bytes of the parameter gather (of ``comm_class``: dense or expert buckets), per
    iteration that gathered anything."""
    out = []
    for r in records:
        c = r.get("comm", {}).get(comm_class, {})
        if c.get("sent_bytes"):
            out.append(c["raw_bytes"] / c["sent_bytes"])
    return out


def run(args, name, flags) -> list:
    metrics = os.path.join(args.out, "logs", name + ".jsonl")
    _, wall, records = run_one(2, "pretrain_gpt.py", model_flags(args) + flags, CPU_ENV, metrics,
                               os.path.join(args.out, "logs", name + ".log"))
    print(f"{name}: {len(records)} iterations in {wall:.0f} s", flush=True)
    return records


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory: checkpoint, logs, results.json, table.md, plot")
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--pretrain-iters", type=int, default=300)
    p.add_argument("--pretrain-lr", type=float, default=1e-3)
    p.add_argument("--finetune-iters", type=int, default=30)
    p.add_argument("--finetune-lrs", default="1e-4,1e-5,1e-6")
    args = p.parse_args()
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    ckpt = os.path.join(args.out, "checkpoint")
    schedule = ["--lr-decay-style", "constant", "--lr-warmup-iters", "0"]
    results = {"command": " ".join(sys.argv), "pretrain": {}, "finetune": {}}

    # from scratch: the baseline run saves the checkpoint; each codec's run measures its own ratio
    pretrain = ["--train-iters", str(args.pretrain_iters), "--lr", str(args.pretrain_lr),
                "--min-lr", str(args.pretrain_lr / 10), "--lr-warmup-iters", "10", "--lr-decay-style", "cosine"]
    shutil.rmtree(ckpt, ignore_errors=True)  # a rerun's from-scratch save may not go over an earlier run's iterations
    base = run(args, "pretrain_baseline", pretrain + ["--save", ckpt])
    results["pretrain"]["final_loss"] = base[-1]["loss"]
    for codec, flags in CODECS.items():
        records = run(args, f"pretrain_{codec}", pretrain + flags + ["--param-gather-selection", "all"])
        if [r["loss"] for r in records] != [r["loss"] for r in base]:
            raise AssertionError(f"{codec}: training from scratch is not bit-identical to the baseline")
        ratios = gather_ratios(records)
        results["pretrain"][codec] = dict(per_iteration=ratios, steady=statistics.median(ratios[len(ratios) // 2:]))

    for lr in args.finetune_lrs.split(","):
        results["finetune"][lr] = {}
        for codec, flags in CODECS.items():
            records = run(args, f"finetune_lr{lr}_{codec}", [
                "--load", ckpt, "--finetune", "--train-iters", str(args.finetune_iters), "--lr", lr, "--min-lr", lr,
                *schedule, *flags, "--param-gather-selection", "all"])
            ratios = gather_ratios(records)
            results["finetune"][lr][codec] = dict(per_iteration=ratios, steady=statistics.median(ratios[1:]),
                                                  keyframe=ratios[0])

    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    lines = [f"Command: `{results['command']}`", "",
             "| phase | lr | CIERA (B=512) | CIERA (B=64) | delta |", "|---|---|---|---|---|",
             f"| from scratch (second half of {args.pretrain_iters} iterations) | {args.pretrain_lr:g} (cosine) | "
             + " | ".join(f"{results['pretrain'][c]['steady']:.3f}x" for c in CODECS) + " |"]
    for lr, by_codec in results["finetune"].items():
        lines.append(f"| fine-tuning (iterations 2-{args.finetune_iters}) | {float(lr):g} | "
                     + " | ".join(f"{by_codec[c]['steady']:.3f}x" for c in CODECS) + " |")
    table = "\n".join(lines)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    plot(results, os.path.join(args.out, "wire_ratio.png"))


def plot(results, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CODECS), figsize=(5 * len(CODECS), 4), sharex=True)
    for ax, codec in zip(axes, CODECS):
        for lr, by_codec in results["finetune"].items():
            ax.plot(range(1, len(by_codec[codec]["per_iteration"]) + 1), by_codec[codec]["per_iteration"],
                    label=f"fine-tune lr {float(lr):g}")
        scratch = results["pretrain"][codec]["per_iteration"]
        ax.axhline(results["pretrain"][codec]["steady"], color="gray", linestyle="--", label="from scratch (steady)")
        ax.set_title(f"{codec}: parameter gather bytes, raw / sent")
        ax.set_xlabel(f"iteration after load (from scratch: {len(scratch)} iterations)")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
