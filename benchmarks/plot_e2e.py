"""Bar chart of end-to-end speedups from ``benchmarks/e2e_throughput.py`` JSON files: one group of bars per
link class, a bar per variant (its speedup over the baseline of the same run), the bound of
``--comm-profile`` runs drawn as a tick above each bar, and the iteration IQR as an error bar.

    python benchmarks/plot_e2e.py results/e2e/dp2_exposed_gather_gpt_350m.json --out speedups.png
"""

import argparse
import json

LINK_ORDER = ("nvlink", "p2p_off_25GBps", "sockets_4GBps")


def load_runs(paths: list) -> list:
    runs = []
    for path in paths:
        with open(path) as f:
            runs += [r for r in json.load(f)["runs"] if r["variant"] != "baseline" and "failed" not in r]
    return runs


def plot(runs: list, out: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = [link for link in LINK_ORDER if any(r["link"] == link for r in runs)]
    links += sorted({r["link"] for r in runs} - set(links))
    variants = list(dict.fromkeys(r["variant"] for r in runs))
    width = 0.8 / len(variants)
    fig, ax = plt.subplots(figsize=(1.5 + 2.0 * len(links), 4))
    labeled = set()
    for k, variant in enumerate(variants):
        for i, link in enumerate(links):
            run = next((r for r in runs if r["link"] == link and r["variant"] == variant), None)
            if run is None:
                continue
            x = i + (k - (len(variants) - 1) / 2) * width
            ax.bar(x, run["speedup_vs_baseline"] - 1.0, width, bottom=1.0, color=f"C{k}",
                   label=None if variant in labeled else variant,
                   yerr=run["relative_iqr"] / 2 * run["speedup_vs_baseline"], capsize=2)
            labeled.add(variant)
            if "bound" in run:
                ax.hlines(run["bound"], x - width / 2, x + width / 2, colors="black", linewidth=2)
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xticks(range(len(links)), links)
    ax.set_ylabel("speedup over the baseline; bound (black)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", nargs="+")
    parser.add_argument("--out", required=True)
    parser.add_argument("--title", default="end to end vs uncompressed")
    args = parser.parse_args()
    plot(load_runs(args.json), args.out, args.title)


if __name__ == "__main__":
    main()
