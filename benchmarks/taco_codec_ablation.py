"""Quantization error of every TACO variant on synthetic TP-like tensors (CPU is fine).

Writes a markdown table between the ablation markers of docs/taco.md (or prints it with --print):
    python benchmarks/taco_codec_ablation.py --out docs/taco.md

Every variant sends 1 byte per value plus two fp32 scalars per block, so the wire sizes are equal
and only the error differs. Error: relative L2 over the tensor (SQNR in dB) and the mean relative
error per token row, which shows what a global norm hides (small-magnitude rows).
"""

import argparse
import math
import re

import torch

from compression.taco import TacoCodec, TacoConfig

VARIANTS = {  # name: (format, transform, scaling)
    "naive FP8 (E4M3, one scale per tensor)": ("e4m3", "none", "single"),
    "DS only (E4M3, per-block max scale)": ("e4m3", "none", "dual"),
    "Hadamard + DS (E4M3)": ("e4m3", "hadamard", "dual"),
    "Hadamard + single scale (E4M3)": ("e4m3", "hadamard", "single"),
    "ASH + single scale (E4M3)": ("e4m3", "ash", "single"),
    "ASH + DS = TACO (E4M3)": ("e4m3", "ash", "dual"),
    "ASH + DS, E5M2": ("e5m2", "ash", "dual"),
    "DS only, INT8": ("int8", "none", "dual"),
    "Hadamard + DS, INT8": ("int8", "hadamard", "dual"),
}
BLOCK_SIZES = (64, 256)
BEGIN, END = "<!-- ablation:begin -->", "<!-- ablation:end -->"


def activation_like(tokens=512, hidden=1024, seed=0, row_scale_sigma=0.7):
    """Heavy-tailed (Student t, 4 dof) values of RMS ~0.03 with 1% outlier channels 40x larger and
    log-normal per-token magnitudes: the shape of attention/MLP outputs before the residual add."""
    g = torch.Generator().manual_seed(seed)
    x = _student_t(4, (tokens, hidden), g) * 0.02
    outliers = torch.randperm(hidden, generator=g)[: hidden // 100]
    x[:, outliers] *= 40.0
    return x * torch.exp(torch.randn(tokens, 1, generator=g) * row_scale_sigma)


def gradient_like(tokens=512, hidden=1024, seed=1, row_scale_sigma=1.5):
    """Tiny (~1e-6), heavier-tailed (3 dof) values, log-normal per-token magnitudes and 10% of the
    tokens exactly zero (masked out of the loss): the shape of TP backward activation gradients."""
    g = torch.Generator().manual_seed(seed)
    x = _student_t(3, (tokens, hidden), g) * 1e-6
    x = x * torch.exp(torch.randn(tokens, 1, generator=g) * row_scale_sigma)
    x[torch.rand(tokens, generator=g) < 0.1] = 0
    return x


def _student_t(dof: int, shape, g):
    """Student t samples: a normal over the root of a chi-square with ``dof`` (a sum of squared normals)."""
    chi2 = torch.randn(dof, *shape, generator=g).square().sum(dim=0)
    return torch.randn(shape, generator=g) / torch.sqrt(chi2 / dof)


def errors(x, fmt, transform, scaling, block_size):
    codec = TacoCodec(TacoConfig(block_size, fmt, transform, scaling))
    y = codec.decode(codec.encode(x), x.numel(), torch.float32).view_as(x)
    rel = ((y - x).norm() / x.norm()).item()
    norms = x.norm(dim=1)
    keep = norms > 0
    per_row = ((y - x).norm(dim=1)[keep] / norms[keep]).mean().item()
    return rel, per_row


def table() -> str:
    tensors = {"activations": activation_like(), "gradients": gradient_like()}
    head = "| variant | " + " | ".join(f"{t}, B={b}" for t in tensors for b in BLOCK_SIZES) + " |"
    lines = [head, "|---" * (1 + len(tensors) * len(BLOCK_SIZES)) + "|"]
    for name, (fmt, transform, scaling) in VARIANTS.items():
        cells = []
        for x in tensors.values():
            for b in BLOCK_SIZES:
                rel, per_row = errors(x, fmt, transform, scaling, b)
                cells.append(f"{rel:.4f} ({-20 * math.log10(rel):.1f} dB) / {per_row:.4f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_between_markers(path: str, text: str) -> None:
    with open(path) as f:
        doc = f.read()
    if BEGIN not in doc or END not in doc:
        raise ValueError(f"{path} has no {BEGIN} ... {END} section to fill")
    block = f"{BEGIN}\nCommand: `python benchmarks/taco_codec_ablation.py --out {path}`\n\n{text}\n{END}"
    with open(path, "w") as f:
        f.write(re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, doc, flags=re.S))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/taco.md", help="markdown file with the ablation markers")
    parser.add_argument("--print", action="store_true", help="print the table instead of writing it")
    args = parser.parse_args()
    text = table()
    if args.print:
        print(text)
    else:
        write_between_markers(args.out, text)
        print(text)


if __name__ == "__main__":
    main()
