"""Wire ratio of the lossless delta codec over a training trajectory (CPU; no GPU needed).

Two sources of bf16 parameter snapshots, one per optimizer step, for each learning rate:
  sim: AdamW (betas 0.9/0.95, wd 0.1) on fp32 master weights N(0, 0.02) driven by synthetic
       gradients (a fixed direction plus noise, per-parameter scales log-normal);
  gpt: a tiny pure-torch GPT (byte vocabulary) trained with the same AdamW on the Python standard
       library's source text.
Per step: the delta codec's payload (encoded and decoded bit-exactly by DeltaCodec), bf16 values
unchanged, the order-0 entropy of the ordered-int delta (the bound of any per-value code), the same
block code at other block sizes, format version 1 (17-bit exception entries), a per-block-width code
without the bitmap, and CIERA (exponent reuse) when compression/ciera.py is present. Prints a
markdown table, writes JSON to --out and the table plus the command line into --doc (docs/delta.md,
between the BENCHMARK markers).

    python benchmarks/delta_wire_ratio.py --steps 120 --out delta_ratio.json --doc docs/delta.md
"""

import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from compression.delta import HEADER, DeltaCodec, DeltaConfig, _Layout  # noqa: E402
from kernels.delta import analyze_blocks_reference, stream_nbytes, to_ordered  # noqa: E402

BETAS, WEIGHT_DECAY = (0.9, 0.95), 0.1
BLOCK_SIZES = (64, 128, 256, 512, 1024)
MARK_BEGIN, MARK_END = "<!-- BENCHMARK BEGIN -->", "<!-- BENCHMARK END -->"


# --- trajectories ------------------------------------------------------------------------------

def simulated_adamw(numel: int, lr: float, steps: int, seed: int = 0, device="cpu", dtype=torch.bfloat16):
    """Yield the snapshot (bf16, or the fp32 master weights with ``dtype``) after each of ``steps`` AdamW steps (the
    first is the initial one)."""
    g = torch.Generator(device).manual_seed(seed)
    master = torch.nn.Parameter(torch.randn(numel, generator=g, device=device) * 0.02)
    scale = torch.exp(torch.randn(numel, generator=g, device=device))
    direction = torch.randn(numel, generator=g, device=device)
    opt = torch.optim.AdamW([master], lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY)
    yield master.detach().to(dtype, copy=True)
    for _ in range(steps):
        master.grad = scale * (0.3 * direction + torch.randn(numel, generator=g, device=device))
        opt.step()
        yield master.detach().to(dtype, copy=True)


def simulated_step(numel: int, lr: float, steps: int, device="cpu", new_dtype=torch.bfloat16) -> tuple:
    """(previous, new): the bf16 snapshot after ``steps`` steps of ``simulated_adamw`` and the one after ``steps + 1``
    (fp32 master weights with ``new_dtype``: what the optimizer rounds to the next bf16 snapshot)."""
    snapshots = simulated_adamw(numel, lr, steps + 1, device=device, dtype=torch.float32)
    for _ in range(steps):
        previous = next(snapshots)
    return previous.bfloat16(), next(snapshots).to(new_dtype)


class TinyGPT(torch.nn.Module):
    def __init__(self, layers=4, dim=256, heads=4, seq=128, vocab=256):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Embedding(seq, dim)
        layer = torch.nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, activation="gelu",
                                                 batch_first=True, norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        for p in self.parameters():
            if p.dim() > 1:
                torch.nn.init.normal_(p, std=0.02)

    def forward(self, tokens):
        seq = tokens.shape[1]
        x = self.tok(tokens) + self.pos(torch.arange(seq, device=tokens.device))
        mask = torch.nn.Transformer.generate_square_subsequent_mask(seq, device=tokens.device)
        return self.head(self.norm(self.blocks(x, mask=mask, is_causal=True)))


def stdlib_bytes(limit: int) -> torch.Tensor:
    """The Python standard library's .py sources, concatenated, as byte tokens."""
    root, chunks, total = os.path.dirname(os.__file__), [], 0
    for name in sorted(os.listdir(root)):
        if name.endswith(".py") and total < limit:
            with open(os.path.join(root, name), "rb") as f:
                chunks.append(f.read())
            total += len(chunks[-1])
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()


def tiny_gpt(lr: float, steps: int, seq: int = 128, batch: int = 8, seed: int = 0):
    torch.manual_seed(seed)
    model = TinyGPT(seq=seq)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY)
    text = stdlib_bytes(4 << 20)
    snapshot = lambda: torch.cat([p.detach().reshape(-1) for p in model.parameters()]).bfloat16()  # noqa: E731
    yield snapshot()
    for _ in range(steps):
        start = torch.randint(0, text.numel() - seq - 1, (batch, 1))
        window = text[start + torch.arange(seq + 1)]
        logits = model(window[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), window[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        yield snapshot()


# --- measures ----------------------------------------------------------------------------------

def delta_block_nbytes(prev, new, block_size: int) -> torch.Tensor:
    """Bytes of each block's sections in the delta code (record offset, exc_width, bitmap, value stream; 0 if the
    block is unchanged), int64 [n_blocks]."""
    a = analyze_blocks_reference(prev.clone(), new, block_size)
    sections = 3 + a.bitmap_nbytes + stream_nbytes(a.counts, a.codes, a.n_esc, a.exc_widths)
    return torch.where(a.codes > 0, sections, 0)


def delta_payload_nbytes(block_nbytes: torch.Tensor, block_size: int) -> int:
    """Exact payload size of the delta code (the layout of compression/delta.py) from ``delta_block_nbytes``: the
    header, a code byte per block, the alignment pad, the group entries and the changed blocks' sections."""
    return _Layout.of(block_nbytes.numel() * block_size, block_size).regions + int(block_nbytes.sum())


def delta_nbytes(prev, new, block_size: int) -> int:
    """Exact payload size of the delta code at ``block_size``."""
    return delta_payload_nbytes(delta_block_nbytes(prev, new, block_size), block_size)


def version1_nbytes(prev, new, block_size: int) -> int:
    """Format version 1: the same block code with every exception entry 17 bits wide (no exc_widths)."""
    d = to_ordered(new) - to_ordered(prev)
    z = torch.nn.functional.pad((d << 1) ^ (d >> 31), (0, -d.numel() % block_size)).view(-1, block_size)
    changed, v = z != 0, (z - 1).long()
    counts = changed.sum(1)
    n_esc = torch.stack([(changed & (v >= (1 << w) - 1)).sum(1) for w in range(1, 18)], 1)
    stream_bits = (counts.unsqueeze(1) * torch.arange(1, 18) + 17 * n_esc).amin(1)
    stream_bits = torch.where(torch.where(changed, v, 0).amax(1) == 0, 0, stream_bits)
    n_blocks, n_changed = z.shape[0], int((counts > 0).sum())
    return (HEADER.size + n_blocks + (HEADER.size + n_blocks) % 2 + n_changed * (2 + block_size // 8)
            + int(((stream_bits + 7) // 8).sum()))


def width_only_nbytes(prev, new, block_size: int) -> int:
    """Alternative without the bitmap: a width byte per block, every value in the block's zigzag width."""
    d = to_ordered(new) - to_ordered(prev)
    z = torch.nn.functional.pad((d << 1) ^ (d >> 31), (0, -d.numel() % block_size)).view(-1, block_size)
    largest = z.amax(1).double()
    width = torch.where(largest > 0, torch.floor(torch.log2(largest.clamp(min=1))) + 1, 0).long()
    return z.shape[0] + int(((width * block_size + 7) // 8).sum())


def delta_entropy_bits(prev, new) -> float:
    d = to_ordered(new) - to_ordered(prev)
    _, counts = torch.unique(d, return_counts=True)
    p = counts.double() / d.numel()
    return float(-(p * p.log2()).sum())


def build_ciera():
    try:
        from compression.ciera import CieraCodec, CieraConfig
    except ImportError:
        return None
    return CieraCodec(CieraConfig(), 1, 0)


def measure(snapshots, block_size: int, detail_every: int) -> list:
    """Encode and decode every step; the other measures every ``detail_every`` steps."""
    codec, ciera = DeltaCodec(DeltaConfig(block_size), 1, 0), build_ciera()
    rows, prev, mirror = [], None, None
    for step, snap in enumerate(snapshots):
        bits = snap.view(torch.int16)
        payload = codec.encode(snap)
        row = dict(step=step, raw=2 * snap.numel(), delta=payload.numel())
        if ciera is not None:
            row["ciera"] = ciera.encode(snap).numel()
        if mirror is None:
            mirror = snap.clone()
        codec.decode(0, payload, mirror)
        if not torch.equal(mirror.view(torch.int16), bits):
            raise RuntimeError(f"delta round trip not bit-exact at step {step}")
        if prev is not None and step % detail_every == 0:
            row["unchanged"] = float((prev == bits).double().mean())
            row["entropy_bits"] = delta_entropy_bits(prev, bits)
            row["width_only"] = width_only_nbytes(prev, bits, block_size)
            row["version1"] = version1_nbytes(prev, bits, block_size)
            row.update({f"delta_b{b}": delta_nbytes(prev, bits, b) for b in BLOCK_SIZES})
            assert row[f"delta_b{block_size}"] == row["delta"] or block_size not in BLOCK_SIZES
        prev = bits.clone()
        rows.append(row)
    return rows


def summarize(rows: list) -> dict:
    """Ratios vs bf16: the steady state (mean bytes over the second half of the steps) and the whole
    run including the keyframe and warm-up."""
    steady = rows[len(rows) // 2:]
    detail = [r for r in steady if "unchanged" in r]
    ratio = lambda key, rs=detail: sum(r["raw"] for r in rs) / sum(r[key] for r in rs)  # noqa: E731
    out = dict(
        steps=len(rows) - 1, numel=rows[0]["raw"] // 2,
        unchanged=sum(r["unchanged"] for r in detail) / len(detail),
        entropy_bits=sum(r["entropy_bits"] for r in detail) / len(detail),
        delta=ratio("delta", steady), delta_incl_warmup=ratio("delta", rows), width_only=ratio("width_only"),
        version1=ratio("version1"),
        first_deltas=[round(r["raw"] / r["delta"], 2) for r in rows[1:6]],
        **{f"delta_b{b}": ratio(f"delta_b{b}") for b in BLOCK_SIZES},
    )
    out["entropy_bound"] = 16 / out["entropy_bits"]
    if "ciera" in rows[0]:
        out["ciera"] = ratio("ciera", steady)
    return out


# --- report ------------------------------------------------------------------------------------

def table(results: dict) -> str:
    has_ciera = any("ciera" in s for s in results.values())
    head = ["trajectory", "lr", "steps", "params", "unchanged", "H (bits)", "entropy bound", "delta (B=256)",
            "incl. keyframe+warm-up", "first 5 deltas"] + [f"B={b}" for b in BLOCK_SIZES]
    head += ["version 1 (17-bit exceptions)", "width-only"]
    head += ["CIERA (B=512)"] if has_ciera else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, s in results.items():
        source, lr = key.split("@")
        cells = [source, lr, str(s["steps"]), f"{s['numel'] / 1e6:.2f}M", f"{100 * s['unchanged']:.1f}%",
                 f"{s['entropy_bits']:.2f}", f"{s['entropy_bound']:.1f}x", f"**{s['delta']:.2f}x**",
                 f"{s['delta_incl_warmup']:.2f}x", " ".join(f"{r:.1f}" for r in s["first_deltas"])]
        cells += [f"{s[k]:.2f}x" for k in [f"delta_b{b}" for b in BLOCK_SIZES] + ["version1", "width_only"]]
        cells += [f"{s.get('ciera', float('nan')):.2f}x"] if has_ciera else []
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_doc(path: str, text: str) -> None:
    with open(path) as f:
        doc = f.read()
    begin, end = doc.index(MARK_BEGIN) + len(MARK_BEGIN), doc.index(MARK_END)
    with open(path, "w") as f:
        f.write(doc[:begin] + "\n" + text + "\n" + doc[end:])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sources", default="sim,gpt", help="comma list of sim, gpt")
    p.add_argument("--lrs", default="1e-4,1e-5")
    p.add_argument("--steps", type=int, default=120, help="optimizer steps of the simulated trajectory")
    p.add_argument("--gpt-steps", type=int, default=60, help="optimizer steps of the tiny GPT")
    p.add_argument("--gpt-batch", type=int, default=8)
    p.add_argument("--gpt-seq", type=int, default=128)
    p.add_argument("--detail-every", type=int, default=5, help="entropy and alternative codes every N steps")
    p.add_argument("--sim-numel", type=int, default=1_000_000)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", required=True, help="JSON output path")
    p.add_argument("--doc", default=None, help="markdown file with BENCHMARK markers to update")
    p.add_argument("--merge", nargs="+", default=None,
                   help="skip measuring: tabulate the results of these JSON outputs (runs split over processes)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    results, commands, t0 = {}, [], time.time()
    for path in args.merge or []:
        with open(path) as f:
            merged = json.load(f)
        results.update(merged["results"])
        commands += merged["commands"]
    for source in [] if args.merge else args.sources.split(","):
        for lr_text in args.lrs.split(","):
            lr = float(lr_text)
            snaps = simulated_adamw(args.sim_numel, lr, args.steps) if source == "sim" else tiny_gpt(
                lr, args.gpt_steps, seq=args.gpt_seq, batch=args.gpt_batch)
            results[f"{source}@{lr_text}"] = summarize(measure(snaps, args.block_size, args.detail_every))
            print(f"{source} lr={lr_text}: {json.dumps(results[f'{source}@{lr_text}'])} ({time.time() - t0:.0f} s)",
                  flush=True)
    if not args.merge:
        commands.append(f"python benchmarks/delta_wire_ratio.py {' '.join(sys.argv[1:])}  # {time.time() - t0:.0f} s")
    text = table(results)
    print(text)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(commands=commands, results=results), f, indent=1)
    if args.doc:
        runs = "\n".join(f"    {c}" for c in commands)
        write_doc(args.doc, f"Commands (wall time on 2 CPU cores shared with other jobs):\n\n{runs}\n\n{text}")

if __name__ == "__main__":
    main()
