"""One GPU's compute path: tokens/s, TFLOP/s/GPU, MFU and peak memory of each attention variant against the local
spec's unfused attention, measured in the same run, for GPT-1.3B, GPT-350M and a Llama-style model.

Each (model, variant) is one `torchrun --nproc-per-node 1 pretrain_gpt.py` run on mock data (bf16, distributed
optimizer, micro-batch 2, global batch 16, seq 2048, Megatron-LM's defaults). The baselines: ``stock``, the local spec
as megatron-core runs it without apex or Transformer Engine (its unfused ``DotProductAttention``, its gradient-norm
fallback; ``stock_pretrain_gpt.py``), and ``unfused``, the same with this project's sync-free norm. Reported: the median
over the iterations after warm-up, TFLOP/s/GPU as Megatron-LM counts it (megatron/training/metrics.py, which
tests/test_mla.py checks against torch's FLOP counter) and MFU against the H100/H200's 989 dense bf16 TFLOP/s.

With ``--profile MODEL`` that model's runs also record one iteration with the PyTorch profiler, and its device time
is split into attention, GEMMs, norms, elementwise/other kernels, optimizer and the time the device sat idle.

    python benchmarks/compute_path.py --out /tmp/res/compute_path --profile gpt_1.3b
"""

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEAK_BF16_TFLOPS = 989.0  # H100 SXM and H200 dense bf16, the MFU denominator

COMMON = ("--bf16 --transformer-impl local --use-distributed-optimizer --mock-data --tokenizer-type NullTokenizer "
          "--vocab-size 50304 --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 2 "
          "--global-batch-size 16 --lr 1e-4 --lr-warmup-iters 2 --hidden-dropout 0 --attention-dropout 0 "
          "--log-interval 1 --eval-iters 0 --eval-interval 1000000 --log-memory-to-tensorboard --seed 1234 "
          "--no-check-for-nan-in-loss-and-grad")
MODELS = {
    "gpt_1.3b": "--num-layers 24 --hidden-size 2048 --num-attention-heads 16",
    "gpt_350m": "--num-layers 24 --hidden-size 1024 --num-attention-heads 16",
    # Llama-style: GQA (8 query groups), SwiGLU, RMSNorm, RoPE, no biases, untied output layer
    "llama_1.2b": ("--num-layers 16 --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 32 "
                   "--group-query-attention --num-query-groups 8 --swiglu --normalization RMSNorm "
                   "--position-embedding-type rope --disable-bias-linear --untie-embeddings-and-output-weights"),
}
VARIANTS = {
    # the local spec as megatron-core runs it without apex or Transformer Engine: its DotProductAttention, unfused
    # gradient accumulation and its own gradient-norm fallback (run by stock_pretrain_gpt.py)
    "stock": "--attention-backend unfused --no-gradient-accumulation-fusion",
    # the same with this project's sync-free gradient norm (megatron/hooks/fused_ops.py)
    "unfused": "--attention-backend unfused --no-gradient-accumulation-fusion",
    "sdpa_unfused_wgrad": "--no-gradient-accumulation-fusion",
    "sdpa": "",  # the defaults: SDPA choosing its kernel, the weight gradient accumulated inside its GEMM
    "sdpa_flash": "--attention-backend flash",
    "sdpa_eager_elementwise": "--no-bias-gelu-fusion --no-bias-dropout-fusion",  # without torch.compile'd bias fusions
    "sdpa_ce_fusion": "--cross-entropy-loss-fusion",  # the defaults + megatron-core's fused cross entropy (opt-in)
}
WARMUP = 4  # iterations left out of the medians
# --curves: loss curves on real text (the built-in corpus, byte-tokenized), GPT-125M, against the unfused baseline and
# the baseline's second seed (run-to-run noise)
CURVES = ("--bf16 --transformer-impl local --use-distributed-optimizer --builtin-corpus python-stdlib "
          "--tokenizer-type ByteTokenizer --num-layers 12 --hidden-size 768 --num-attention-heads 12 "
          "--seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 8 --global-batch-size 32 --lr 6e-4 "
          "--min-lr 6e-5 --lr-decay-style cosine --lr-warmup-iters 30 --weight-decay 0.1 --clip-grad 1.0 "
          "--hidden-dropout 0 --attention-dropout 0 --log-interval 10 --eval-interval 100 --eval-iters 10")
CURVE_RUNS = {"unfused": ("unfused", 1234), "unfused_seed2": ("unfused", 1235), "sdpa": ("sdpa", 1234)}

KERNEL_CLASSES = [  # (class, substrings of a kernel name, lower case), first match wins
    ("attention", ("flash", "fmha", "attention", "cudnn", "softmax")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul", "sm90_")),
    ("norm", ("layer_norm", "layernorm", "rms_norm", "rmsnorm", "norm_kernel")),
    ("optimizer", ("adam", "multi_tensor", "foreach", "l2norm")),
]


def run(model: str, variant: str, iters: int, out: str, profile: bool) -> dict:
    name = f"{model}_{variant}"
    metrics = os.path.join(out, name + ".jsonl")
    flags = f"{COMMON} {MODELS[model]} {VARIANTS[variant]} --train-iters {iters} --metrics-file {metrics}".split()
    if profile:
        flags += ["--profile", "--use-pytorch-profiler", "--profile-step-start", str(iters - 1),
                  "--profile-step-end", str(iters)]
    script = "benchmarks/stock_pretrain_gpt.py" if variant == "stock" else "pretrain_gpt.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           os.path.join(ROOT, script), *flags]
    with open(os.path.join(out, name + ".log"), "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    rows = [json.loads(line) for line in open(metrics)] if os.path.exists(metrics) else []
    timed = [r for r in rows if WARMUP < r["iteration"] < iters - (1 if profile else 0)]
    if rc != 0 or not timed:
        return {"model": model, "variant": variant, "rc": rc}
    iter_s = statistics.median(r["iter_time_s"] for r in timed)
    tflops = statistics.median(r["tflops_per_gpu"] for r in timed)
    result = {"model": model, "variant": variant, "rc": rc, "iter_ms": iter_s * 1e3,
              "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed), "tflops_per_gpu": tflops,
              "mfu": tflops / PEAK_BF16_TFLOPS, "peak_mem_gib": max(r["mem_max_allocated_bytes"] for r in rows) / 2**30,
              "losses": [r["loss"] for r in rows]}
    if profile:
        result["profile"] = device_time_breakdown(os.path.splitext(metrics)[0] + ".trace_rank0.json")
    return result


def curves(iters: int, out: str) -> None:
    """Train GPT-125M on real text with each of CURVE_RUNS; print the evaluations and the largest gap between the
    SDPA run's training loss and the baseline's (10-iteration means) beside the same gap between the baseline's two
    seeds; write every run's records to ``curves_gpt125m.jsonl``, each with its run's name."""
    runs = {}
    for name, (variant, seed) in CURVE_RUNS.items():
        metrics = os.path.join(out, f"curve_{name}.jsonl")
        flags = f"{CURVES} {VARIANTS[variant]} --seed {seed} --train-iters {iters} --metrics-file {metrics}".split()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
               os.path.join(ROOT, "pretrain_gpt.py"), *flags]
        with open(os.path.join(out, f"curve_{name}.log"), "w") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT).returncode
        runs[name] = [json.loads(line) for line in open(metrics)] if os.path.exists(metrics) else []
        evals = [(r["iteration"], round(r["eval_loss"], 4)) for r in runs[name] if "eval_loss" in r]
        print(f"curve {name}: rc {rc}, final loss {runs[name][-1]['loss'] if runs[name] else None}, evals {evals}",
              flush=True)

    def means(rows):
        losses = [r["loss"] for r in rows]
        return [statistics.mean(losses[i:i + 10]) for i in range(0, len(losses) - 9, 10)]

    base, seed2, sdpa = (means(runs[n]) for n in CURVE_RUNS)
    noise = max(abs(a - b) for a, b in zip(base, seed2))
    gap = max(abs(a - b) for a, b in zip(base, sdpa))
    print(f"curves: largest gap of 10-iteration mean losses: sdpa vs unfused {gap:.4f}, "
          f"unfused seed 1234 vs 1235 {noise:.4f}")
    with open(os.path.join(out, "curves_gpt125m.jsonl"), "w") as f:  # the runs in one file, each record's run first
        f.writelines(json.dumps({"run": name, **record}) + "\n" for name in CURVE_RUNS for record in runs[name])


def device_time_breakdown(trace_path: str) -> dict:
    """Milliseconds of kernel time per class in the profiled iteration, the idle time of the device (the profiled
    span minus the union of kernel intervals), and the heaviest kernels outside attention and GEMMs (name, ms,
    launches): where the next fusion would come from."""
    if not os.path.exists(trace_path):
        return {}
    events = json.load(open(trace_path))["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    per_class, other_ms, other_launches = collections.Counter(), collections.Counter(), collections.Counter()
    for kernel in kernels:
        lowered = kernel["name"].lower()
        cls = next((c for c, keys in KERNEL_CLASSES if any(k in lowered for k in keys)), "elementwise/other")
        per_class[cls] += kernel["dur"] / 1e3
        if cls not in ("attention", "gemm"):
            name = kernel["name"][:120]
            other_ms[name] += kernel["dur"] / 1e3
            other_launches[name] += 1
    spans = sorted((k["ts"], k["ts"] + k["dur"]) for k in kernels)
    busy, end = 0.0, float("-inf")
    for start, stop in spans:
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    total = (spans[-1][1] - spans[0][0]) / 1e3 if spans else 0.0
    return {**{k: round(v, 1) for k, v in per_class.most_common()}, "idle": round(total - busy / 1e3, 1),
            "span": round(total, 1),
            "top_other": [[name, round(ms, 2), other_launches[name]] for name, ms in other_ms.most_common(15)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--variants", nargs="+", default=["unfused", "sdpa"], choices=list(VARIANTS))
    parser.add_argument("--iters", type=int, default=14)
    parser.add_argument("--profile", nargs="*", default=[], choices=list(MODELS), help="models to profile")
    parser.add_argument("--out", default="runs/compute_path")
    parser.add_argument("--curves", type=int, default=0, metavar="ITERS",
                        help="instead: loss curves of ITERS iterations on real text (CURVE_RUNS)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.curves:
        return curves(args.curves, args.out)
    results = []
    for model in args.models:
        for variant in args.variants:
            results.append(run(model, variant, args.iters, args.out, model in args.profile))
            print(json.dumps({k: v for k, v in results[-1].items() if k != "losses"}), flush=True)
    print(f"\n| model | variant | ms/iter | tokens/s | TFLOP/s/GPU | MFU | peak GiB | x {args.variants[0]} |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        if "iter_ms" not in r:
            print(f"| {r['model']} | {r['variant']} | failed (rc {r['rc']}) | | | | | |")
            continue
        base = next((b for b in results if b["model"] == r["model"] and b["variant"] == args.variants[0]
                     and "iter_ms" in b), None)
        speedup = f"{base['iter_ms'] / r['iter_ms']:.2f}" if base else "-"
        print(f"| {r['model']} | {r['variant']} | {r['iter_ms']:.0f} | {r['tokens_per_s']:.0f} | "
              f"{r['tflops_per_gpu']:.0f} | {r['mfu']:.1%} | {r['peak_mem_gib']:.1f} | {speedup} |")
    for r in results:
        if r.get("profile"):
            classes = {k: v for k, v in r["profile"].items() if k != "top_other"}
            print(f"profile {r['model']} {r['variant']} (ms of one iteration):", json.dumps(classes))
            for name, ms, launches in r["profile"].get("top_other", []):
                print(f"  {ms:8.2f} ms {launches:5d}x {name}")
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
