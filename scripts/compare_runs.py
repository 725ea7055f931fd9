"""Whether training runs are bit-identical: their ``--metrics-file`` records compared iteration by iteration.

A lossless compression (``--param-gather-compression ciera`` or ``delta``, ``--delta-fused-cast``) must leave training
bit-identical to the uncompressed run under the same flags; this checks it on your own runs. Each run after the first
is compared with the first on ``loss`` and ``grad_norm`` (exact: the file holds them as round-tripping floats),
``params_checksum`` where both runs logged it (``--params-checksum-interval``), ``eval_loss`` where both evaluated, and
with ``--bytes`` on the bytes sent per communication class (for repeats of one compressed configuration). A resumed
run appends to its metrics file; a repeated iteration's last record counts. Files ending in ``.gz`` are read gzipped
(as scripts/convergence.py keeps its runs'). Exit status 1 if any run differs.

    python scripts/compare_runs.py none.jsonl delta.jsonl delta-fused-cast.jsonl
    python scripts/compare_runs.py --bytes first.jsonl repeat.jsonl

Runs on GPUs repeat bit for bit only with ``--deterministic-mode`` (README "Running on GPUs").
"""

import argparse
import gzip
import json
import sys

FIELDS = ("loss", "grad_norm", "params_checksum", "eval_loss")


def load(path: str) -> dict:
    """Iteration -> record (the last one written for it). A path ending in ``.gz`` is read through gzip."""
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        return {record["iteration"]: record for record in map(json.loads, filter(str.strip, f))}


def sent_bytes(record: dict) -> dict:
    return {name: counts["sent_bytes"] for name, counts in record.get("comm", {}).items()}


def differences(first: dict, other: dict, with_bytes: bool) -> list:
    """(iteration, what differs) for every common iteration where ``other`` is not ``first``, in order."""
    found = []
    for iteration in sorted(first.keys() & other.keys()):
        a, b = first[iteration], other[iteration]
        fields = [(name, a[name], b[name]) for name in FIELDS if name in a and name in b and a[name] != b[name]]
        if with_bytes and sent_bytes(a) != sent_bytes(b):
            fields.append(("sent bytes", sent_bytes(a), sent_bytes(b)))
        if fields:
            found.append((iteration, fields))
    return found


def describe(name: str, reference: str, first: dict, other: dict, with_bytes: bool) -> tuple:
    """(whether ``other`` equals ``first``, one line saying so or where they part)."""
    common = first.keys() & other.keys()
    if not common:
        return False, f"{name}: no iteration in common with {reference}"
    missing = "" if first.keys() == other.keys() else (
        f" ({len(first.keys() - other.keys())} iterations only in {reference}, "
        f"{len(other.keys() - first.keys())} only in {name})")
    found = differences(first, other, with_bytes)
    span = f"iterations {min(common)}-{max(common)}"
    if not found:
        return True, f"{name}: identical to {reference} at all {len(common)} common iterations ({span}){missing}"
    iteration, fields = found[0]
    parts = "; ".join(f"{field} {a!r} vs {b!r}" for field, a, b in fields)
    return False, (f"{name}: differs from {reference} at {len(found)} of {len(common)} common iterations ({span}), "
                   f"first at iteration {iteration}: {parts}{missing}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="--metrics-file of each run; the first is the reference")
    parser.add_argument("--bytes", action="store_true", help="also compare the bytes sent per communication class")
    args = parser.parse_args(argv)
    if len(args.runs) < 2:
        parser.error("give at least two metrics files: the reference, then the runs to compare with it")
    first = load(args.runs[0])
    same = True
    for path in args.runs[1:]:
        equal, line = describe(path, args.runs[0], first, load(path), args.bytes)
        print(line)
        same &= equal
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
