"""Exact wire sizes of candidate delta formats built for GPU throughput, against the current format (CPU).

Session 14 found the delta kernels bound by integer work per value (results/gpu/README.md, session 14): most of it
goes to the current format's variable-width slots, whose positions need each changed value's rank within its
block (a bitmap, in-row and cross-row scans) and a per-block width search over the escape counts. The candidates
here put every value of a row of 8 at a fixed place instead, so a row needs only its own rank among the block's
non-empty rows:

- ``rows``: per changed block a bit per row of 8 values (non-empty or not), then ``w`` bytes per non-empty row
  holding the row's 8 symbols of ``w`` bits (symbol s < 2^w - 1: zigzag delta z = s; 2^w - 1: an escape), then the
  escapes' ``z - (2^w - 1)`` as ``xw``-bit entries (``xw``: bits of the block's largest; a byte per changed block).
  ``w`` (1..4) per block minimizes its bytes; the code byte carries it, as the current format's carries the width.
- ``rows, byte entries``: the same with each entry padded to whole bytes (1-3), so no entry straddles a byte.
- ``rows, w=2``: a fixed w = 2 (symbols 0, -1, +1, escape): no search at all.
- ``either``: each changed block in whichever of the current format and ``rows`` is smaller (a decoder would branch
  per block, uniformly across the block's threads).

Session 20's serial per-thread stream codes (benchmarks/diag_delta_stream_code.py: a stream is a thread's 8 columns
of 32 rows of 256 values, 256 values coded in order, with a u16 length per stream and each stream padded to whole
bytes):

- ``stream``: ``0`` for an unchanged value, else ``1`` and the exponential-Golomb code of order 1 of ``z - 1`` (escape
  to the raw pattern after 8 leading zeros); ``stream, row flags``: a bit per row of 8 first, ``0`` = all unchanged.
- ``stream, gaps``: for each changed value the EG1 code of the count of unchanged values before it and the EG1 code
  of ``z - 1``, then the EG1 code of the trailing unchanged count (run lengths instead of a bit per value).

Sizes are exact byte counts of whole payloads (24-byte header, a code byte per block, each block's sections padded
to whole bytes); "current" is compression/delta.py's format (version 2), measured by the same function the wire
ratio benchmark uses. Trajectories are benchmarks/delta_wire_ratio.py's (``sim``: AdamW on synthetic gradients;
``gpt``: a tiny GPT on text).

    python benchmarks/delta_format_study.py --out results/delta_format_study_cpu/study.json
"""

import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.delta_wire_ratio import (delta_block_nbytes, delta_payload_nbytes, simulated_adamw,  # noqa: E402
                                         tiny_gpt)
from benchmarks.diag_delta_stream_code import _streams, codes_reference  # noqa: E402
from compression.delta import HEADER  # noqa: E402
from kernels.delta import to_ordered  # noqa: E402

WIDTHS = (1, 2, 3, 4)


def zigzag_rows(prev: torch.Tensor, new: torch.Tensor, block_size: int) -> torch.Tensor:
    """int64 [n_blocks, B / 8, 8]: the zigzag of each value's ordered-integer delta (0: unchanged), zero-padded."""
    d = to_ordered(new).long() - to_ordered(prev).long()
    z = (d << 1) ^ (d >> 63)
    return torch.nn.functional.pad(z, (0, -z.numel() % block_size)).view(-1, block_size // 8, 8)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """Bit length of each non-negative int64 (0 for 0)."""
    return torch.where(x > 0, torch.floor(torch.log2(x.clamp(min=1).double())).long() + 1, 0)


def rows_block_bytes(z: torch.Tensor, width: int, byte_entries: bool) -> torch.Tensor:
    """Bytes of each block's sections in the ``rows`` format at symbol width ``width`` (int64 [n_blocks])."""
    rows = z.shape[1]
    escape = (1 << width) - 1
    escaped = z >= escape
    entries = torch.where(escaped, z - escape, 0)
    xw = _bits(entries.amax(dim=(1, 2)))
    n_esc = escaped.sum(dim=(1, 2))
    if byte_entries:
        entry_bits = (xw + 7) // 8 * 8
    else:
        entry_bits = xw
    nonempty_rows = (z != 0).any(dim=2).sum(dim=1)
    return 1 + (rows + 7) // 8 + nonempty_rows * width + (n_esc * entry_bits + 7) // 8


def rows_sizes(z: torch.Tensor, widths, byte_entries: bool = False) -> torch.Tensor:
    """Bytes of each block in the ``rows`` format at each of ``widths``, int64 [n_blocks, len(widths)]."""
    return torch.stack([rows_block_bytes(z, w, byte_entries) for w in widths], dim=1)


def cheapest(sizes: torch.Tensor, changed: torch.Tensor, labels) -> tuple:
    """(payload bytes, changed blocks per chosen column) with each changed block coded in its cheapest column of
    ``sizes`` [n_blocks, len(labels)] (header and a code byte per block as in the current format)."""
    best, choice = sizes.min(dim=1)
    total = HEADER.size + sizes.shape[0] + int(best[changed].sum())
    return total, {label: int((choice[changed] == k).sum()) for k, label in enumerate(labels)}


def rows_nbytes(z: torch.Tensor, widths, byte_entries: bool = False) -> tuple:
    """(payload bytes, blocks per chosen width) of the ``rows`` format, each changed block at its cheapest width."""
    return cheapest(rows_sizes(z, widths, byte_entries), (z != 0).any(dim=(1, 2)), widths)


STREAM_ROWS, STREAM_THREADS = 32, 32  # the stream code's tile: 32 rows of 256 values, a stream per thread


def _stream_payload(nbits: torch.Tensor) -> int:
    """Payload bytes of stream codes of ``nbits`` bits each: header, a u16 length per stream, whole bytes."""
    return HEADER.size + int(((nbits + 7) // 8 + 2).sum())


def _eg1_bits(x: torch.Tensor) -> torch.Tensor:
    """Bits of the exponential-Golomb code of order 1 of each x >= 0."""
    return 2 * _bits(x + 2) - 2


def stream_gap_bits(prev, new) -> torch.Tensor:
    """Bits of each stream in the ``stream, gaps`` code (int64 [n_streams])."""
    d = to_ordered(_streams(new, STREAM_ROWS, STREAM_THREADS)).long() - to_ordered(
        _streams(prev, STREAM_ROWS, STREAM_THREADS)).long()
    z = (d << 1) ^ (d >> 63)
    changed, at = z != 0, torch.arange(z.shape[1]).expand_as(z)
    before = torch.cummax(torch.cat([torch.full((z.shape[0], 1), -1), torch.where(changed, at, -1)[:, :-1]], 1), 1)
    gap = at - before.values - 1
    value_bits = torch.where(changed, _eg1_bits(gap) + _eg1_bits((z - 1).clamp(min=0)), 0).sum(1)
    trailing = z.shape[1] - 1 - torch.where(changed, at, -1).amax(1)
    return value_bits + _eg1_bits(trailing)


def measure_step(prev, new, block_size: int) -> dict:
    z = zigzag_rows(prev, new, block_size)
    changed, raw = (z != 0).any(dim=(1, 2)), 2 * new.numel()
    current_blocks = delta_block_nbytes(prev, new, block_size)
    sizes = rows_sizes(z, WIDTHS)
    rows, used = cheapest(sizes, changed, WIDTHS)
    rows_bytes, _ = rows_nbytes(z, WIDTHS, byte_entries=True)
    rows_w2, _ = cheapest(sizes[:, WIDTHS.index(2)][:, None], changed, (2,))
    # either: the current format's sections as column "0" beside the rows format's widths
    either, either_used = cheapest(torch.cat([current_blocks[:, None], sizes], dim=1), changed, (0,) + WIDTHS)
    streams = {name: _stream_payload(codes_reference(prev, new, STREAM_ROWS, STREAM_THREADS, flags)[1].sum(1))
               for name, flags in (("stream", False), ("stream_row_flags", True))}
    return dict(unchanged=float((z == 0).float().mean()), current=raw / delta_payload_nbytes(current_blocks, block_size),
                rows=raw / rows, rows_byte_entries=raw / rows_bytes, rows_w2=raw / rows_w2, either=raw / either,
                **{name: raw / nbytes for name, nbytes in streams.items()},
                stream_gaps=raw / _stream_payload(stream_gap_bits(prev, new)), widths=used, either_choice=either_used)


def run(source: str, lr: float, args) -> dict:
    if source == "sim":
        snapshots = simulated_adamw(args.sim_numel, lr, args.steps)
    else:
        snapshots = tiny_gpt(lr, args.steps, seq=args.gpt_seq, batch=args.gpt_batch)
    prev, rows = next(snapshots), []
    prev = prev.view(torch.int16)
    for step, new in enumerate(snapshots, start=1):
        new = new.view(torch.int16)
        if step > args.steps // 2 and step % args.every == 0:
            rows.append(dict(step=step, **measure_step(prev, new, args.block_size)))
        prev = new
    keys = ("unchanged", "current", "rows", "rows_byte_entries", "rows_w2", "either", "stream", "stream_row_flags",
            "stream_gaps")
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in keys}
    return dict(source=source, lr=lr, steps=rows, mean=mean)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sources", default="sim,gpt")
    p.add_argument("--lrs", default="1e-4,1e-5")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps; the second half is measured")
    p.add_argument("--every", type=int, default=4, help="measure every this many steps")
    p.add_argument("--sim-numel", type=int, default=300_000)
    p.add_argument("--gpt-seq", type=int, default=64)
    p.add_argument("--gpt-batch", type=int, default=4)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    start, results = time.time(), []
    for source in args.sources.split(","):
        for lr in map(float, args.lrs.split(",")):
            results.append(run(source, lr, args))
            m = results[-1]["mean"]
            choice = results[-1]["steps"][-1]["either_choice"]
            print(f"{source} lr {lr:g}: unchanged {m['unchanged']:.1%}, ratio current {m['current']:.2f}x, rows "
                  f"{m['rows']:.2f}x, rows with byte entries {m['rows_byte_entries']:.2f}x, rows w=2 "
                  f"{m['rows_w2']:.2f}x, either per block {m['either']:.2f}x; blocks per choice (0: current) {choice}; "
                  f"stream {m['stream']:.2f}x, with row flags {m['stream_row_flags']:.2f}x, gaps {m['stream_gaps']:.2f}x",
                  flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(command="python " + " ".join(sys.argv), seconds=round(time.time() - start),
                       results=results), f, indent=1)


if __name__ == "__main__":
    main()
