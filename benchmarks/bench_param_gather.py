"""Parameter all-gather benchmark: none (NCCL bf16 all_gather_into_tensor) vs CIERA vs lossless delta vs
SDP4Bit's lossy quantized weight differences.

Each rank runs AdamW (betas 0.9/0.95, wd 0.1) on an fp32 master copy of its own shard (N(0, 0.02)
weights, synthetic gradients: a fixed direction plus noise, per-parameter log-normal scales) and
writes the bf16 result into its slice of the bucket, as Megatron's distributed optimizer does; then
the bucket is gathered. Every codec sees the same trajectory (same seeds). Per codec and step:
wire bytes (raw / sent, from the telemetry), gather time; once per codec: encode and decode
throughput against a bf16 copy of the shard. Self-checking: after every gather the bucket is
compared bit for bit with an uncompressed gather, and any difference aborts the run; for the lossy
sdp4bit every rank must hold the same bits instead, and the bucket's error against the uncompressed
gather is reported (relative L2, largest absolute).

The link class is set by the caller's NCCL environment (scripts/gpu/suite.sh collectives runs all three):
    torchrun --nproc-per-node 2 benchmarks/bench_param_gather.py --out pg_nvlink.json
    NCCL_P2P_DISABLE=1 torchrun --nproc-per-node 2 benchmarks/bench_param_gather.py --out pg_p2p_off.json
    NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 torchrun --nproc-per-node 2 benchmarks/bench_param_gather.py --out ...
``--dry-run`` runs a tiny CPU/gloo version (used by the tests).
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from compression.ciera import CieraCodec, CieraConfig  # noqa: E402
from compression.shard_gather import GatherFusions, IntegrityCheck, ShardGather, prepare_gathers  # noqa: E402
from compression.telemetry import COMM_CLASSES, TELEMETRY  # noqa: E402

BETAS, WEIGHT_DECAY = (0.9, 0.95), 0.1
LINK_ENV = ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_NET", "NCCL_IB_DISABLE")
GATHER_CLASS = 2 * COMM_CLASSES.index("dp_param_gather")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=125_000_000, help="bucket values over all ranks")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps (gathers) per codec")
    # lr 3e-5 after 30 warm-up steps gives ~79% of bf16 values unchanged per step, 0.4% exponents
    # changed per value and ~88% of 512-blocks changed: what GPT-125M's DP=2 training at lr
    # 1e-4 showed (81%, 0.38%, 79%).
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--optimizer-warmup", type=int, default=30, help="AdamW steps before the first gather")
    p.add_argument("--codecs", nargs="+", default=["none", "ciera", "delta", "sdp4bit"],
                   choices=["none", "ciera", "delta", "delta-slots", "delta-slots-graphs", "sdp4bit"],
                   help="delta-slots: delta's sync-free gather (payloads in slots of --delta-capacity-factor x the "
                        "last ones, no size exchange before the transfer); delta-slots-graphs: the same replayed as "
                        "a CUDA graph once captured (--delta-cuda-graphs; GPUs)")
    p.add_argument("--ciera-block-size", type=int, default=512)
    p.add_argument("--ciera-change-detect", default="compare", choices=["compare", "hash"])
    p.add_argument("--ciera-exponent-coder", default="raw", choices=["raw", "ans"])
    p.add_argument("--delta-block-size", type=int, default=256)
    p.add_argument("--integrity", default="on", choices=["on", "off"],
                   help="delta's integrity check (--param-gather-integrity-check, on in training by default)")
    p.add_argument("--delta-capacity-factor", type=float, default=1.25, help="slot capacity of delta-slots")
    p.add_argument("--sdp4bit-group-size", type=int, default=128)
    p.add_argument("--sdp4bit-weight-bits", type=int, default=4, choices=[4, 8])
    p.add_argument("--buckets", type=int, default=1,
                   help="split the values into this many buckets (each its own buffer and codec) gathered together, "
                        "as the hook gathers a model chunk: one size exchange, then every transfer queued before "
                        "the first decode, so that decodes overlap the later transfers; the buckets lie in one "
                        "storage, as megatron-core's in one buffer")
    p.add_argument("--fuse-buckets", action="store_true",
                   help="code the buckets of a lossless codec that supports it (delta) as one (GatherFusions, as "
                        "the hook does): one encode, payload and all-gather for all buckets, one decode per rank")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats of encode/decode/copy")
    p.add_argument("--out", required=True, help="JSON results (written by rank 0)")
    p.add_argument("--dry-run", action="store_true", help="tiny CPU/gloo run: numel 8192 per rank, 3 steps")
    p.add_argument("--profile-dir", help="after each codec's timed steps, one more gather under the PyTorch "
                                         "profiler: <dir>/<codec>_rank<r>.json (Chrome trace: where the gather's "
                                         "time goes between kernels, syncs and NCCL) and .txt (top ops)")
    args = p.parse_args(argv)
    if args.dry_run:
        args.numel, args.steps, args.repeats = 8192 * int(os.environ.get("WORLD_SIZE", "1")), 3, 1
        args.optimizer_warmup = 2
    if args.buckets < 1:
        p.error(f"--buckets must be >= 1, got {args.buckets}")
    return args


LOSSY = ("sdp4bit",)


def build_codec(name, args, world, rank):
    if name == "sdp4bit":
        from compression.sdp4bit import Sdp4bitConfig, WeightDiffCodec

        return WeightDiffCodec(Sdp4bitConfig(args.sdp4bit_group_size, args.sdp4bit_weight_bits), world, rank)
    if name == "ciera":
        config = CieraConfig(args.ciera_block_size, args.ciera_change_detect, args.ciera_exponent_coder)
        return CieraCodec(config, world, rank)
    from compression.delta import DeltaCodec, DeltaConfig  # written by another helper: import lazily

    return DeltaCodec(DeltaConfig(args.delta_block_size), world, rank, integrity=args.integrity == "on")


class Trajectory:
    """AdamW on this rank's fp32 master shard; ``step()`` returns the new bf16 shard."""

    def __init__(self, numel, lr, warmup, rank, device):
        g = torch.Generator(device=device).manual_seed(1000 + rank)
        self.g = g
        self.master = torch.nn.Parameter(torch.randn(numel, generator=g, device=device) * 0.02)
        self.scale = torch.exp(torch.randn(numel, generator=g, device=device))
        self.direction = torch.randn(numel, generator=g, device=device)
        self.opt = torch.optim.AdamW([self.master], lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY)
        for _ in range(warmup):  # past Adam's first, large steps
            self.step()

    def bf16(self):
        return self.master.detach().bfloat16()

    def step(self):
        noise = torch.randn(self.master.shape, generator=self.g, device=self.master.device)
        self.master.grad = self.scale * (0.3 * self.direction + noise)
        self.opt.step()
        return self.bf16()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device):
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _gather_uncompressed(buffer, shard):
    dist.all_gather_into_tensor(buffer, shard.contiguous())


def _gather_buckets(gathers, buffers, own, fusions=None):
    """Gather every bucket in place: uncompressed (``gathers`` None: megatron-core's all-gathers, queued
    together), else the compressed ones prepared together (one size exchange; with ``fusions``, coded as one
    where they can be) and all transferred before the first decode."""
    if gathers is None:
        works = [dist.all_gather_into_tensor(b, o, async_op=True) for b, o in zip(buffers, own)]
    elif isinstance(gathers[0], ShardGather):
        prepared = prepare_gathers(gathers, buffers, fusions)
        works = [g.transfer(b, p, async_op=True) for g, b, p in zip(gathers, buffers, prepared)]
        works = [w for w in works if w is not None]  # fused buckets share the first one's handle
    else:
        works = [g.start(b, async_op=True) for g, b in zip(gathers, buffers)]
    for work in works:
        work.wait()


def _check_bits(buffer, shard, name, step):
    reference = torch.empty_like(buffer)
    _gather_uncompressed(reference, shard)
    bad = (buffer.view(torch.int16) != reference.view(torch.int16)).nonzero()
    if bad.numel():
        raise RuntimeError(f"{name}: gathered bucket differs from the uncompressed gather at step {step}, "
                           f"first index {int(bad[0])}")


def _check_replicas(buffer, name, step):
    """Every rank holds the same bits (a lossy gather's invariant); returns the local checksum."""
    from compression.sdp4bit import replica_checksum

    local = replica_checksum(buffer)
    everyone = local.new_empty(dist.get_world_size())
    dist.all_gather_into_tensor(everyone, local)
    if not (everyone == local).all():
        raise RuntimeError(f"{name}: replicas differ after the gather at step {step}")


def _error_vs_uncompressed(buffer, shard, buckets: int = 1) -> dict:
    """``buffer``: the gathered buckets one after another; ``shard``: this rank's true values of them, in order."""
    world, m = dist.get_world_size(), shard.numel() // buckets
    reference = torch.empty(buffer.numel(), dtype=buffer.dtype, device=buffer.device)
    for i, values in enumerate(shard.split(m)):
        _gather_uncompressed(reference[i * m * world:(i + 1) * m * world], values)
    diff = buffer.float() - reference.float()
    return dict(rel_l2_error=float(diff.norm() / reference.float().norm()), max_abs_error=float(diff.abs().max()))


def _gather_for(name, codec, args):
    if name in LOSSY:
        from compression.sdp4bit import WeightDiffGather

        return WeightDiffGather(codec, None)
    slots = name.startswith("delta-slots")
    return ShardGather(codec, None, capacity_factor=args.delta_capacity_factor if slots else 0.0,
                       cuda_graphs=name == "delta-slots-graphs",
                       integrity=IntegrityCheck() if args.integrity == "on" else None)


def run_codec(name, args, world, rank, device):
    """Gathers one trajectory with codec ``name``; returns per-step bytes and times."""
    n, k = args.numel // world, args.buckets
    m = n // k  # values per rank and bucket
    traj = Trajectory(n, args.lr, args.optimizer_warmup, rank, device)
    buffers = list(torch.empty(k * m * world, dtype=torch.bfloat16, device=device).split(m * world))  # one storage
    own = [b[rank * m:(rank + 1) * m] for b in buffers]
    for b, o, values in zip(buffers, own, traj.bf16().split(m)):  # identical start on every rank
        _gather_uncompressed(b, values)
    gathers = None if name == "none" else [_gather_for(name, build_codec(name, args, world, rank), args)
                                           for _ in range(k)]
    fusions = GatherFusions() if args.fuse_buckets else None
    steps = []
    for step in range(args.steps):
        previous = torch.cat(own)
        for o, values in zip(own, traj.step().split(m)):
            o.copy_(values)
        before = TELEMETRY.counters()
        dist.barrier()
        seconds = _timed(lambda: _gather_buckets(gathers, buffers, own, fusions), device)
        if gathers is None:
            raw = sent = n * 2
        else:
            after = TELEMETRY.counters()
            raw, sent = (after[GATHER_CLASS + i] - before[GATHER_CLASS + i] for i in (0, 1))
        error = {}
        if name in LOSSY:
            for b in buffers:
                _check_replicas(b, name, step)
            error = _error_vs_uncompressed(torch.cat(buffers), traj.bf16(), k)  # vs the true values
        else:
            for b, o in zip(buffers, own):
                _check_bits(b, o, name, step)
        steps.append(dict(raw_bytes=raw, sent_bytes=sent, gather_s=seconds, **error,
                          unchanged=float((torch.cat(own).view(torch.int16) == previous.view(torch.int16)).float().mean())))
    snapshots = (previous, torch.cat(own))
    if args.profile_dir:
        for o, values in zip(own, traj.step().split(m)):
            o.copy_(values)
        dist.barrier()
        _profiled(lambda: _gather_buckets(gathers, buffers, own, fusions), device,
                  os.path.join(args.profile_dir, f"{name}_rank{rank}"))
    return steps, snapshots


def _profiled(fn, device, path_stem):
    """One call of ``fn`` under the PyTorch profiler (host and device): Chrome trace and top-ops table."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    os.makedirs(os.path.dirname(path_stem), exist_ok=True)
    _sync(device)
    with profile(activities=activities) as prof:
        fn()
        _sync(device)
    prof.export_chrome_trace(path_stem + ".json")
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    with open(path_stem + ".txt", "w") as f:
        f.write(prof.key_averages().table(sort_by=sort, row_limit=25))


def codec_throughput(name, args, world, rank, snapshots, device):
    """Encode of a delta (not keyframe) shard and its decode, timed, vs a bf16 copy; bytes/s of shard."""
    previous, new = snapshots
    nbytes = new.numel() * 2
    sender, receiver = build_codec(name, args, world, rank), build_codec(name, args, world, (rank + 1) % world)
    out = torch.empty_like(new)
    enc, dec, copy = [], [], []
    for _ in range(args.repeats):
        sender.reset()
        receiver.reset()
        receiver.decode(rank, sender.encode(previous), out)
        payload = None

        def encode():
            nonlocal payload
            payload = sender.encode(new)

        enc.append(_timed(encode, device))
        # room after it, as the gather's receive buffer leaves (ShardCodec.read_slack_bytes)
        slack = getattr(receiver, "read_slack_bytes", 0)
        payload = torch.cat([payload, payload.new_zeros(slack)])[:payload.numel()]
        header = receiver.read_header(payload)  # the gather delivers it on the host
        dec.append(_timed(lambda: receiver.decode(rank, payload, out, header), device))
        copy.append(_timed(lambda: out.copy_(new), device))
    return dict(encode_GBps=nbytes / min(enc) / 1e9, decode_GBps=nbytes / min(dec) / 1e9,
                copy_GBps=nbytes / min(copy) / 1e9)


def summarize(name, steps, throughput, baseline_gather_s):
    delta_steps = steps[1:] or steps  # step 0 of a codec is its keyframe
    gather_s = statistics.median(s["gather_s"] for s in delta_steps)
    raw = sum(s["raw_bytes"] for s in delta_steps)
    sent = sum(s["sent_bytes"] for s in delta_steps)
    speedup = baseline_gather_s / gather_s if baseline_gather_s else None
    lossy = {key: max(s[key] for s in delta_steps) for key in ("rel_l2_error", "max_abs_error") if key in steps[0]}
    return dict(codec=name, wire_ratio=raw / sent, keyframe_ratio=steps[0]["raw_bytes"] / steps[0]["sent_bytes"],
                **lossy,
                gather_ms=gather_s * 1e3, gather_speedup_vs_none=speedup,
                unchanged_fraction=statistics.mean(s["unchanged"] for s in delta_steps), steps=steps, **throughput)


def print_table(results):
    print(f"{'codec':<11}{'wire ratio':>12}{'keyframe':>10}{'gather ms':>11}{'vs none':>9}"
          f"{'enc GB/s':>10}{'dec GB/s':>10}{'copy GB/s':>11}{'unchanged':>11}")
    for r in results:
        speed = f"{r['gather_speedup_vs_none']:.2f}x" if r["gather_speedup_vs_none"] else "-"
        print(f"{r['codec']:<11}{r['wire_ratio']:>11.2f}x{r['keyframe_ratio']:>9.2f}x"
              f"{r['gather_ms']:>11.2f}{speed:>9}"
              f"{r.get('encode_GBps', 0):>10.1f}{r.get('decode_GBps', 0):>10.1f}{r.get('copy_GBps', 0):>11.1f}"
              f"{r['unchanged_fraction']:>11.1%}")
        if "rel_l2_error" in r:
            print(f"{'':<8}lossy: relative L2 error {r['rel_l2_error']:.2e}, largest |error| {r['max_abs_error']:.2e} "
                  f"(worst step), replicas identical")


def run(args):
    world, rank = dist.get_world_size(), dist.get_rank()
    if args.numel % (world * args.buckets):
        raise ValueError(f"--buckets {args.buckets} must divide the values per rank ({args.numel} / {world} ranks)")
    on_gpu = torch.cuda.is_available() and not args.dry_run
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    results, baseline = [], None
    for name in args.codecs:
        steps, snapshots = run_codec(name, args, world, rank, device)
        throughput = {} if name == "none" else codec_throughput(name, args, world, rank, snapshots, device)
        if name == "none":
            baseline = statistics.median(s["gather_s"] for s in (steps[1:] or steps))
        results.append(summarize(name, steps, throughput, baseline))
    report = dict(world_size=world, numel=args.numel, buckets=args.buckets, fuse_buckets=args.fuse_buckets, lr=args.lr,
                  device=str(device),
                  link_env={k: os.environ[k] for k in LINK_ENV if k in os.environ},
                  args={k: v for k, v in vars(args).items() if k != "out"}, results=results)
    if rank == 0:
        print_table(results)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


def main(argv=None):
    args = parse_args(argv)
    if dist.is_initialized():
        return run(args)
    if torch.cuda.is_available() and not args.dry_run:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
    try:
        return run(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
