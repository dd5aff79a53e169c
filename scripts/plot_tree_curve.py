"""tau and speedup against tree size, from the JSON of `dflash-hf bench --tree-size ... --json FILE`.

    python scripts/plot_tree_curve.py trees.json docs/tree_curve.png [trees_t1.json]

The optional second JSON (the same command at --temperature 1) adds its tau as a second curve.
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def rows(path: str) -> list[dict]:
    return sorted(json.load(open(path, encoding="utf-8"))["results"], key=lambda row: row.get("tree_size") or 0)


def main(greedy_path: str, out_path: str, sampled_path: str | None = None) -> None:
    greedy = rows(greedy_path)
    sizes = [row.get("tree_size") or 0 for row in greedy]
    labels = ["chain" if size == 0 else str(size) for size in sizes]
    figure, (tau_axis, speed_axis) = plt.subplots(1, 2, figsize=(9, 3.4))
    tau_axis.plot(labels, [row["tau"] for row in greedy], "o-", label="greedy")
    sampled = {row.get("tree_size") or 0: row for row in rows(sampled_path)} if sampled_path else {}
    sampled_labels = [label for label, size in zip(labels, sizes) if size in sampled]
    if sampled:
        tau_axis.plot(sampled_labels, [sampled[size]["tau"] for size in sizes if size in sampled], "s--",
                      label="temperature 1")
    tau_axis.set(xlabel="tree size (drafted tokens verified per step)", ylabel="tau (tokens per step)")
    tau_axis.legend()
    speed_axis.plot(labels, [row["speedup"] for row in greedy], "o-", label="measured (greedy)")
    if sampled:
        speed_axis.plot(sampled_labels, [sampled[size]["speedup"] for size in sizes if size in sampled], "s--",
                        label="measured (temperature 1)")
    speed_axis.axhline(1.0, color="gray", linewidth=0.8)
    speed_axis.set(xlabel="tree size", ylabel="speedup over target.generate")
    speed_axis.legend()
    figure.tight_layout()
    figure.savefig(out_path, dpi=120)


if __name__ == "__main__":
    main(*sys.argv[1:])
