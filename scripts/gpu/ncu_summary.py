"""Summarize Nsight Compute details pages (``ncu --import R --page details --csv``, as written by
scripts/gpu/ncu_kernels.sh) as a markdown table: one row per kernel name (its first profiled launch),
with the figures that say what bounds it, and the rules ncu flags with their estimated speedup.

    python scripts/gpu/ncu_summary.py results/gpu/ncu/*_details.csv > results/gpu/ncu/SUMMARY.md
"""

import csv
import sys

COLUMNS = [("Duration", "duration"), ("DRAM Throughput", "DRAM % of peak"), ("Compute (SM) Throughput", "SM %"),
           ("Issue Slots Busy", "issue slots %"), ("Registers Per Thread", "regs/thread"),
           ("Theoretical Occupancy", "occupancy theor. %"), ("Achieved Occupancy", "achieved %"),
           ("Executed Instructions", "warp instructions"), ("Block Size", "threads"), ("Grid Size", "programs")]


def first_launch_per_kernel(path: str) -> dict:
    kernels = {}
    for row in csv.DictReader(open(path)):
        name = row["Kernel Name"]
        launch = kernels.setdefault(name, {"id": row["ID"], "metrics": {}, "rules": {}})
        if row["ID"] != launch["id"]:
            continue
        launch["metrics"]["Block Size"] = row["Block Size"]
        launch["metrics"]["Grid Size"] = row["Grid Size"]
        if row["Metric Name"]:
            launch["metrics"][row["Metric Name"]] = f"{row['Metric Value']} {row['Metric Unit']}".strip()
        if row["Rule Description"] and row["Rule Type"] in ("OPT", "WRN") and row["Estimated Speedup"]:
            launch["rules"].setdefault(row["Rule Name"], (row["Estimated Speedup"], row["Rule Description"]))
    return kernels


def main(paths) -> None:
    print("| kernel | " + " | ".join(label for _, label in COLUMNS) + " |")
    print("|---" * (len(COLUMNS) + 1) + "|")
    rules = []
    for path in paths:
        for name, launch in first_launch_per_kernel(path).items():
            print(f"| {name} | " + " | ".join(launch["metrics"].get(key, "-") for key, _ in COLUMNS) + " |")
            top = sorted(launch["rules"].items(), key=lambda kv: -float(kv[1][0].replace(",", "") or 0))[:3]
            rules += [f"- {name}, {rule} (est. {speedup}%): {text[:300]}" for rule, (speedup, text) in top]
    print("\nTop rules per kernel (ncu's estimate of the speedup if fixed):\n")
    print("\n".join(rules))


if __name__ == "__main__":
    main(sys.argv[1:])
