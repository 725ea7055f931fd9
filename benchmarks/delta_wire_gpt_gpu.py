"""Wire ratio of the delta codec over GPT-125M-shaped training on one GPU (format 4, and what format 3 sent).

The real measurement is a DP=2 run of ``pretrain_gpt.py`` (results/wire_ratio/: GPT-125M, byte-level Python
standard library text, AdamW, 150 iterations), which needs two GPUs. This trains the same shape in plain PyTorch on
one: 12 layers, d = 768, 12 heads, byte vocabulary, seq 2048, batch 16 on the same text, fp32 master weights and
AdamW (0.9 / 0.95, weight decay 0.1, gradient clipping 1.0; lr warmed up linearly over 20 iterations, then
constant), bf16 autocast; weights N(0, 0.02), the output projections of attention and MLP N(0, 0.02 / sqrt(2 *
layers)) as megatron-core initializes them (``--no-scaled-init``: 0.02 everywhere; smaller weights have smaller
bf16 steps, so more of them change). After each optimizer step the bf16 parameters (what the distributed optimizer gathers) are
split into ``--shards`` data-parallel shards, each coded by its own ``DeltaCodec`` on the Triton path (iteration 1:
keyframes) and decoded bit for bit into a receiver's copy. Per iteration: bf16 bytes over payload bytes (``ratio``),
the same over what format 3 sent (the payloads with every changed block's bitmap flat, B / 8 bytes:
``ratio_flat_bitmaps``; the two formats differ in nothing else), and the fraction of unchanged values.

    python benchmarks/delta_wire_gpt_gpu.py --out delta_wire_gpt.json
"""

import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.delta_wire_ratio import BETAS, WEIGHT_DECAY, TinyGPT, stdlib_bytes  # noqa: E402
from compression.delta import DeltaCodec, DeltaConfig  # noqa: E402
from kernels.delta import flag_bytes  # noqa: E402


def train(lr: float, args, device):
    """Yield the flat bf16 parameters after each of ``args.iters`` optimizer steps."""
    torch.manual_seed(0)
    model = TinyGPT(layers=args.layers, dim=args.dim, heads=args.heads, seq=args.seq).to(device)
    if args.scaled_init:
        for layer in model.blocks.layers:
            for out in (layer.self_attn.out_proj, layer.linear2):
                torch.nn.init.normal_(out.weight, std=0.02 / (2 * args.layers) ** 0.5)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY)
    text = stdlib_bytes(16 << 20).to(device)
    for it in range(1, args.iters + 1):
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, it / args.warmup)
        start = torch.randint(0, text.numel() - args.seq - 1, (args.batch, 1), device=device)
        window = text[start + torch.arange(args.seq + 1, device=device)]
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(window[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                 window[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        yield it, loss.detach().item(), torch.cat([p.detach().reshape(-1) for p in model.parameters()]).bfloat16()


def sparse_savings(old: torch.Tensor, new: torch.Tensor, block_size: int) -> int:
    """Bytes format 4's sparse bitmaps save over flat ones on a shard: per changed block B / 8 less the smaller of
    the row flags plus the non-empty rows' bytes and B / 8 (kernels/delta.py's rule)."""
    changed = old.view(torch.int16) != new.view(torch.int16)
    rows = torch.nn.functional.pad(changed, (0, -changed.numel() % block_size)).view(-1, block_size // 8, 8).any(-1)
    nonempty = rows.sum(-1)
    bitmap = torch.clamp(flag_bytes(block_size) + nonempty, max=block_size // 8)
    return int(((block_size // 8 - bitmap) * (nonempty > 0)).sum())


def measure(lr: float, args, device) -> list:
    b = args.block_size
    senders = receivers = None
    rows, previous = [], None
    for it, loss, params in train(lr, args, device):
        shards = params.tensor_split(args.shards)
        if senders is None:
            senders = [DeltaCodec(DeltaConfig(b), args.shards, r) for r in range(args.shards)]
            receivers = [torch.zeros_like(s) for s in shards]
        sent = flat = 0
        for rank, (codec, shard, received) in enumerate(zip(senders, shards, receivers)):
            payload = codec.encode(shard)
            sent += payload.numel()
            if not codec.last_stats["keyframe"]:  # what format 3 sent on top: flat bitmaps
                flat += sparse_savings(received, shard, b)
            codec.decode(rank, payload, received)
            if not torch.equal(received.view(torch.int16), shard.view(torch.int16)):
                raise AssertionError(f"iteration {it}: rank {rank}'s shard decoded wrong")
        unchanged = float((params.view(torch.int16) == previous.view(torch.int16)).float().mean()) if it > 1 else 0.0
        previous = params
        raw = 2 * params.numel()
        rows.append(dict(iteration=it, loss=loss, ratio=raw / sent, ratio_flat_bitmaps=raw / (sent + flat),
                         unchanged=unchanged))
        if it % 25 == 0 or it == 1:
            print(f"lr {lr:g} it {it}: loss {loss:.3f}, unchanged {unchanged:.1%}, ratio {raw / sent:.2f}x "
                  f"(flat bitmaps {raw / (sent + flat):.2f}x)", flush=True)
    return rows


def summarize(rows: list) -> dict:
    steady = [r for r in rows if r["iteration"] > len(rows) // 2]
    mean = lambda key, rs: sum(r[key] for r in rs) / len(rs)  # noqa: E731
    return dict(steady_iterations=[steady[0]["iteration"], steady[-1]["iteration"]],
                steady_ratio=mean("ratio", steady), steady_ratio_flat_bitmaps=mean("ratio_flat_bitmaps", steady),
                steady_unchanged=mean("unchanged", steady), all_ratio=mean("ratio", rows),
                all_ratio_flat_bitmaps=mean("ratio_flat_bitmaps", rows), final_loss=rows[-1]["loss"])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lrs", default="1e-4,1e-5")
    p.add_argument("--iters", type=int, default=150)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--scaled-init", action=argparse.BooleanOptionalAction, default=True,
                   help="output projections at 0.02 / sqrt(2 * layers), as megatron-core initializes them")
    p.add_argument("--shards", type=int, default=2, help="data-parallel shards, a codec each")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--device", default="cuda", help="cuda (the Triton kernels), or cpu for a small check")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    device, start, results = torch.device(args.device), time.time(), {}
    for lr_text in args.lrs.split(","):
        rows = measure(float(lr_text), args, device)
        results[lr_text] = dict(summary=summarize(rows), iterations=rows)
        s = results[lr_text]["summary"]
        print(f"lr {lr_text}: steady state (iterations {s['steady_iterations']}) {s['steady_ratio']:.2f}x, format 3 "
              f"{s['steady_ratio_flat_bitmaps']:.2f}x, unchanged {s['steady_unchanged']:.1%}; all iterations "
              f"{s['all_ratio']:.2f}x ({s['all_ratio_flat_bitmaps']:.2f}x)", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(command="python " + " ".join(sys.argv), seconds=round(time.time() - start),
                       device=torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
                       torch=torch.__version__, args=vars(args),
                       results=results), f, indent=1)


if __name__ == "__main__":
    main()
