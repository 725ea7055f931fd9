import sys, os
sys.path.insert(0, os.getcwd())
import torch
from benchmarks import bench_delta_buckets as bb
from benchmarks.delta_wire_ratio import simulated_step
from compression.timing import device_op_seconds
previous, new = simulated_step(62_500_000, 1e-4, 20, device="cuda")
PAD = int(os.environ.get("PAD", "1"))
for world in (2,):
    b = bb.Buckets(previous, new, 8, 256, world, PAD)
    for mode in ("fused", "alone"):
        units = b.units(mode)
        def gather():
            starts = bb.begin(units)
            sizes, headers = bb.exchange(starts)
            bb.finish_and_decode(units, b.world, starts, sizes, headers, False)
        b.restore(); gather()
        ops = device_op_seconds(gather, 5, setup=b.restore)
        print(mode, round(sum(ops.values()) * 1e6, 1), {k[:28]: round(v * 1e6, 1) for k, v in ops.items()})
