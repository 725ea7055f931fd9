"""TahQuant's choice of the 8-bit tokens on the GPU: device time of torch.topk (unsorted) against a stable
descending sort, each making the [T] mask of the K = T / 8 largest scores (session 16: the two cost the same,
28-48 us at 4K-32K tokens, so the codec keeps topk).

    python -m benchmarks.diag_token_selection        # from the repository root, CUDA
"""
import torch
from compression.timing import device_op_seconds
for T in (4096, 8192, 32768):
    k = (T + 7) // 8
    score = torch.rand(T, device="cuda") ** 2
    def topk():
        high = torch.zeros(T, dtype=torch.bool, device="cuda"); high[score.topk(k, sorted=False).indices] = True
    def sort():
        high = torch.zeros(T, dtype=torch.bool, device="cuda")
        high[torch.sort(score, descending=True, stable=True).indices[:k]] = True
    for name, fn in (("topk", topk), ("sort", sort)):
        fn(); torch.cuda.synchronize()
        ops = device_op_seconds(fn, 10)
        print(T, name, round(1e6 * sum(ops.values()), 1), "us:", ", ".join(f"{o[:40]} {1e6*t:.1f}" for o, t in sorted(ops.items(), key=lambda kv: -kv[1])[:4]))
