"""End-to-end training throughput: compressed variants vs the uncompressed baseline in the same run.

Runs `torchrun pretrain_gpt.py` (or `pretrain_moe.py`) once per (link class, variant) with identical model and flags, reads
each run's `--metrics-file`, and reports the median iteration time after warm-up, tokens/s,
TFLOP/s/GPU, MFU and the speedup over the baseline of the same link class. The link classes are
NCCL settings: NVLink, ~25 GB/s (NCCL_P2P_DISABLE=1), sockets (NCCL_SHM_DISABLE=1 as well).

    python benchmarks/e2e_throughput.py --suite tp2_taco --model configs/gpt_350m.yaml --out e2e.json

With ``--comm-profile`` the last two iterations of every run are profiled (PyTorch profiler, rank 0, left out
of the timing): the device time per iteration of each NCCL collective and of the codecs' Triton kernels.
The baseline's time in the suite's collective over its iteration time is the measured communication share
s; with a variant's wire ratio r (raw / sent bytes of its communication class) the speedup it can reach
is the bound 1 / (1 - s (1 - 1/r)), reported with the fraction of that gain the variant got.

A run whose gathers were captured as CUDA graphs (``--delta-cuda-graphs``: the ``*/graph_captures`` counters of its
metrics) lists the iterations that captured, and where any capture touches the timed ones, also its median over the
timed iterations that neither captured nor followed a capture, with the speedup over the baseline's median of the same
iterations: the steady state between captures.
"""

import argparse
import collections
import json
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from compression.telemetry import PARAM_GATHER_CLASSES, raw_and_sent  # noqa: E402
from megatron.training.profiling import output_prefix  # noqa: E402  (where the runs' traces go)
H200_BF16_DENSE_TFLOPS = 989.0  # datasheet peak, the MFU denominator

LINKS = {
    "nvlink": {},
    "p2p_off_25GBps": {"NCCL_P2P_DISABLE": "1"},
    "sockets_4GBps": {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"},
}

COMMON = ["--bf16", "--transformer-impl", "local", "--use-distributed-optimizer", "--mock-data", "--lr-warmup-iters", "2",
          "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000000"]

TACO = {"baseline": [], "taco": ["--tp-comm-compression", "taco", "--taco-format", "e4m3"],
        "taco_int8": ["--tp-comm-compression", "taco", "--taco-format", "int8"],
        # every floating-point TP tensor compressed, whatever the start-up probe would pick
        "taco_int8_all": ["--tp-comm-compression", "taco", "--taco-format", "int8", "--tp-comm-compression-min-bytes", "0"],
        # taco_int8_all with the compressed collectives replayed as CUDA graphs (the start-up probe times eager calls)
        "taco_int8_graphs": ["--tp-comm-compression", "taco", "--taco-format", "int8", "--tp-comm-compression-min-bytes",
                             "0", "--tp-comm-cuda-graphs"],
        # the default `auto` (start-up probe + in-loop trial) with CUDA graphs: the trial times replayed calls
        "taco_int8_auto_graphs": ["--tp-comm-compression", "taco", "--taco-format", "int8", "--tp-comm-cuda-graphs"]}
PARAM_GATHER = {"baseline": [], "ciera": ["--param-gather-compression", "ciera"],
                "delta": ["--param-gather-compression", "delta"],
                # lossy (SDP4Bit): 4-bit weight differences; + Hadamard int8 gradient reduce-scatter
                "sdp4bit": ["--param-gather-compression", "sdp4bit"],
                "sdp4bit_grad": ["--param-gather-compression", "sdp4bit", "--grad-reduce-compression", "hadamard-int8"]}
OVERLAP = ["--overlap-grad-reduce", "--overlap-param-gather"]
# CIERA's ablation (exponent reuse alone, + benefit selection, + overlap), with the parameter gather exposed
# (--no-overlap-param-gather: the model configs turn the overlap on) unless the variant adds it; delta beside
# it, every bucket compressed (delta_all) or chosen by the benefit selection (delta).
PARAM_GATHER_ABLATION = {
    "baseline": [],
    "delta_all": ["--param-gather-compression", "delta", "--param-gather-selection", "all"],
    "ciera_reuse": ["--param-gather-compression", "ciera", "--param-gather-selection", "all"],
    "ciera_reuse_selection": ["--param-gather-compression", "ciera"],
    "ciera_reuse_selection_overlap": ["--param-gather-compression", "ciera", "--overlap-param-gather"],
    "baseline_overlap": ["--overlap-param-gather"],
    "delta": ["--param-gather-compression", "delta"],
    # every bucket compressed, in sync-free slots (no size exchange before the transfer)
    "delta_all_slots": ["--param-gather-compression", "delta", "--param-gather-selection", "all",
                        "--delta-capacity-factor", "1.25"],
    # and replayed as CUDA graphs
    "delta_all_slots_graphs": ["--param-gather-compression", "delta", "--param-gather-selection", "all",
                               "--delta-capacity-factor", "1.25", "--delta-cuda-graphs"],
    # the same chosen by the benefit selection and kept by the trial (which times replayed gathers)
    "delta_slots_graphs": ["--param-gather-compression", "delta", "--delta-capacity-factor", "1.25",
                           "--delta-cuda-graphs"]}


GRAPHED_TRIAL_LAG = 4  # iterations a trial of graphed gathers starts later (megatron.hooks.param_gather_selection.trial_skip_iterations)


def _graphed_trial(flags) -> bool:
    """Whether a variant's parameter gathers are replayed as CUDA graphs and chosen with a trial (the default)."""
    return "--delta-cuda-graphs" in flags and "all" not in flags


def tp_suite(tp, sequence_parallel=False):
    flags = ["--tensor-model-parallel-size", str(tp)] + (["--sequence-parallel"] if sequence_parallel else [])
    return (tp, "pretrain_gpt.py", flags, TACO)


# suite -> (nproc, entry point, shared flags, {variant: flags}); the first variant is the baseline.
SUITES = {
    "baseline_tp1": (2, "pretrain_gpt.py", ["--tensor-model-parallel-size", "1"], {"baseline": []}),  # DP=2
    "baseline_tp2": (2, "pretrain_gpt.py", ["--tensor-model-parallel-size", "2"], {"baseline": []}),
    "tp2_taco": tp_suite(2), "tp2_sp_taco": tp_suite(2, True),
    # 4- and 8-GPU machines (issue 6)
    "tp4_taco": tp_suite(4), "tp4_sp_taco": tp_suite(4, True),
    "tp8_taco": tp_suite(8), "tp8_sp_taco": tp_suite(8, True),
    "dp2_param_gather": (2, "pretrain_gpt.py", OVERLAP, PARAM_GATHER),
    "dp2_param_gather_ablation": (2, "pretrain_gpt.py", ["--overlap-grad-reduce", "--no-overlap-param-gather"],
                                  PARAM_GATHER_ABLATION),
    "dp2_moe_param_gather": (2, "pretrain_moe.py", OVERLAP, PARAM_GATHER),  # EP=1: expert buckets gather over DP=2
    "dp4_moe_param_gather": (4, "pretrain_moe.py", OVERLAP, PARAM_GATHER),  # EP via extra flags
    "dp8_moe_param_gather": (8, "pretrain_moe.py", OVERLAP, PARAM_GATHER),
}


# suite kind -> (NCCL collectives whose device time is the baseline's share, telemetry classes of the wire ratio)
SHARE = {"param_gather": (("AllGather",), PARAM_GATHER_CLASSES),
         "taco": (("AllReduce", "AllGather", "ReduceScatter"), ("tp",))}
CODEC_KERNEL = re.compile(r"^_\w+_kernel$")  # the Triton kernels of kernels/ (by their naming)
NCCL_KERNEL = re.compile(r"^nccl(?:Dev)?Kernel_([A-Za-z]+)")


def profile_flags(train_iters: int) -> list:
    """Profile the last two iterations of a run (rank 0)."""
    return ["--profile", "--use-pytorch-profiler", "--profile-step-start", str(train_iters - 1),
            "--profile-step-end", str(train_iters + 1)]


def device_time_per_iteration(trace_path: str, iterations: int = 2) -> dict:
    """Milliseconds per iteration of each NCCL collective's kernels and of the codec kernels in a trace."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    ms = collections.Counter()
    for e in events:
        if e.get("ph") != "X" or e.get("cat") != "kernel":
            continue
        nccl = NCCL_KERNEL.match(e["name"])
        if nccl:
            ms[nccl.group(1)] += e["dur"] / 1e3 / iterations
        elif CODEC_KERNEL.match(e["name"]):
            ms["codec_kernels"] += e["dur"] / 1e3 / iterations
    return dict(ms)


def share_and_bound(base: dict, run: dict, kind: str) -> dict:
    """The baseline's communication share and this run's bound and fraction of it (see the module doc)."""
    collectives, comm_classes = SHARE[kind]
    share = sum(base["device_ms_per_iter"].get(c, 0.0) for c in collectives) / (base["median_iter_time_s"] * 1e3)
    out = {"baseline_comm_share": share}
    comm = run.get("comm_last_iter", {})
    raw, sent = raw_and_sent(comm, comm_classes)
    if sent:
        ratio = raw / sent
        bound = 1.0 / (1.0 - share * (1.0 - 1.0 / ratio))
        out.update(wire_ratio=ratio, bound=bound)
        if bound > 1.0:
            out["fraction_of_bound_gain"] = (run["speedup_vs_baseline"] - 1.0) / (bound - 1.0)
    return out


class RunFailed(RuntimeError):
    """A training run that exited with an error or was stopped at --run-timeout."""


def run_one(nproc, script, flags, env_extra, metrics, log, timeout=None):
    env = dict(os.environ, **env_extra)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           script, *flags, "--metrics-file", metrics]
    start = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()  # torchrun stops its ranks on SIGTERM (each rank leads its own process group)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise RunFailed(f"timed out after {timeout} s (--run-timeout): {' '.join(cmd)}") from None
    if returncode != 0:
        tail = open(log).read()[-3000:]
        raise RunFailed(f"run failed ({returncode}): {' '.join(cmd)}\n{tail}")
    return cmd, time.time() - start, [json.loads(line) for line in open(metrics) if line.strip()]


def summarize(records, warmup, last=None):
    """Median iteration time etc. of the iterations after ``warmup``, up to ``last`` (inclusive)."""
    steps = [r for r in records if "iter_time_s" in r and "loss" in r and (last is None or r["iteration"] <= last)]
    steps = steps[warmup:]
    if not steps:
        raise RuntimeError("no timed iterations after warm-up: raise --train-iters")
    times = [r["iter_time_s"] for r in steps]
    t = statistics.median(times)
    # the spread of one run's own iterations: a speedup inside it is not a measured difference
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1 else (t, t, t)
    out = {"median_iter_time_s": t, "iters_timed": len(steps),
           "iter_time_s_quartiles": [min(times), q1, t, q3, max(times)], "relative_iqr": (q3 - q1) / t}
    for key in ("tokens_per_s", "tflops_per_gpu"):
        vals = [r[key] for r in steps if key in r]
        if vals:
            out[key] = statistics.median(vals)
    if "tflops_per_gpu" in out:
        out["mfu"] = out["tflops_per_gpu"] / H200_BF16_DENSE_TFLOPS
    comm = steps[-1].get("comm", {})
    out["comm_last_iter"] = comm
    out["iteration_times_s"] = [[r["iteration"], r["iter_time_s"]] for r in steps]
    if any(name.endswith("/graph_captures") for r in records for name in r.get("comm_counters", {})):
        out["graph_capture_iterations"] = [r["iteration"] for r in records if any(
            count for name, count in r.get("comm_counters", {}).items() if name.endswith("/graph_captures"))]
    return out


def between_captures(base: dict, run: dict):
    """The run's median over its timed iterations that neither captured a graph nor followed a capture, and the
    speedup over the baseline's median of the same iterations; None without captures in the timed window."""
    captured = set(run.get("graph_capture_iterations") or ())
    if not captured:
        return None
    base_times = dict(base["iteration_times_s"])
    times = {i: t for i, t in run["iteration_times_s"]
             if i not in captured and i - 1 not in captured and i in base_times}
    if not times:
        return None
    median = statistics.median(times.values())
    return dict(iterations=sorted(times), median_iter_time_s=median,
                speedup_vs_baseline=statistics.median(base_times[i] for i in times) / median)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=sorted(SUITES), required=True)
    parser.add_argument("--model", required=True, help="YAML config with the model shape")
    parser.add_argument("--links", nargs="+", choices=sorted(LINKS), default=list(LINKS))
    parser.add_argument("--variants", nargs="+", help="run only these of the suite's variants (the baseline always)")
    parser.add_argument("--train-iters", type=int, default=None,
                        help="default 16, or 22 for the param-gather suites (26 with a graphed gather's trial)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="iterations excluded from timing; default 10 (past TACO's `auto` trial, iterations "
                             "3-8), or 17 for the param-gather suites (past the selection's 8 warm-up gathers and its "
                             "trial, iterations 12-17 with --param-gather-trial-iters 6; 21 where a variant's trial "
                             "times graphed gathers, iterations 16-21)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--log-dir", default="/tmp/e2e_logs")
    parser.add_argument("--run-timeout", type=float, default=None,
                        help="seconds one run may take: a run past it is killed. A failed run is recorded as such "
                             "and the suite goes on with the next variant (the next link after a failed baseline); "
                             "the exit status says whether any failed")
    parser.add_argument("--comm-profile", action="store_true",
                        help="profile the last two iterations of each run (not timed): device time per collective, "
                             "the baseline's communication share and each variant's bound (module doc)")
    args, extra = parser.parse_known_args()
    param_gather_suite = "param_gather" in args.suite
    nproc, script, suite_flags, variants = SUITES[args.suite]
    if args.variants:
        unknown = set(args.variants) - set(variants)
        if unknown:
            parser.error(f"--variants: {sorted(unknown)} not in suite {args.suite}: {sorted(variants)}")
        first = next(iter(variants))
        variants = {name: flags for name, flags in variants.items() if name == first or name in args.variants}
    trial_lag = GRAPHED_TRIAL_LAG if any(_graphed_trial(flags) for flags in variants.values()) else 0
    args.train_iters = args.train_iters or (22 + trial_lag if param_gather_suite else 16)
    args.warmup = args.warmup if args.warmup is not None else (17 + trial_lag if param_gather_suite else 10)
    os.makedirs(args.log_dir, exist_ok=True)
    flags = ["--config", args.model, *COMMON, *suite_flags, "--train-iters", str(args.train_iters), *extra]
    timed_last = args.train_iters
    if args.comm_profile:
        flags += profile_flags(args.train_iters)
        timed_last = args.train_iters - 2
    kind = "param_gather" if param_gather_suite else "taco" if "taco" in args.suite else None
    results = {"suite": args.suite, "model": args.model, "argv": sys.argv, "runs": []}
    failures = 0
    for link in args.links:
        base = None
        for name, vflags in variants.items():
            tag = f"{args.suite}_{link}_{name}"
            metrics = os.path.join(args.log_dir, tag + ".jsonl")
            try:
                cmd, wall, records = run_one(nproc, script, flags + vflags, LINKS[link], metrics,
                                             os.path.join(args.log_dir, tag + ".log"), args.run_timeout)
            except RunFailed as error:  # recorded; the suite goes on (a hung run cost whole device calls)
                failures += 1
                results["runs"].append(dict(link=link, variant=name, failed=str(error)[:4000]))
                save(results, args.out)
                print(f"{link:16s} {name:10s} FAILED: {str(error).splitlines()[0]}", flush=True)
                if base is None:
                    break  # no speedups without the link's baseline
                continue
            res = summarize(records, args.warmup, timed_last)
            base = base or res
            res.update(link=link, variant=name, env=LINKS[link], command=" ".join(cmd[1:]), wall_s=wall,
                       speedup_vs_baseline=base["median_iter_time_s"] / res["median_iter_time_s"])
            steady = between_captures(base, res)
            if steady:
                res["between_captures"] = steady
            bound_text = ""
            if args.comm_profile:
                trace = output_prefix(None, metrics) + "trace_rank0.json"
                res["device_ms_per_iter"] = device_time_per_iteration(trace)
                if kind:
                    res.update(share_and_bound(base, res, kind))
                    bound_text = f"  share {res['baseline_comm_share']:.1%} bound {res.get('bound', 1.0):.3f}x"
            results["runs"].append(res)
            save(results, args.out)  # after every run: a time-out keeps the runs before it
            print(f"{link:16s} {name:10s} {res['median_iter_time_s'] * 1e3:9.1f} ms/iter "
                  f"{res.get('tokens_per_s', 0):10.0f} tok/s  MFU {res.get('mfu', 0) * 100:5.1f}%  "
                  f"speedup {res['speedup_vs_baseline']:.3f}x  (iteration IQR {res['relative_iqr']:.1%}){bound_text}",
                  flush=True)
            if "graph_capture_iterations" in res:
                between = (f"; between them {steady['median_iter_time_s'] * 1e3:.1f} ms/iter, speedup "
                           f"{steady['speedup_vs_baseline']:.3f}x over {len(steady['iterations'])} iterations"
                           if steady else "")
                print(f"{'':16s} {name:10s} graph captures in iterations {res['graph_capture_iterations']}{between}",
                      flush=True)
    if failures:
        sys.exit(f"{failures} run(s) failed: see the 'failed' entries of {args.out}")


def save(results: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
