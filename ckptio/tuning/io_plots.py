"""Plots of the checkpoint I/O study: three PNGs drawn from io_report's summary.

Owns: throughput vs write size per engine and mode, file per tensor vs aggregated, and the GPT +
AdamW tensor-size mix, each beside the ceiling of the same run (matplotlib, optional:
`pip install matplotlib`). Does not own: the summary rows and their selection helpers, the
markdown or the JSON (io_report.py), or measuring anything (io_study.py, io_cells.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ckptio.tuning.io_report import Row, configs, engine_label, fmt_nbytes, select

__all__ = ["plots"]

ENGINE_COLORS = {"posix1": "black", "posix_pool": "tab:blue", "uring": "tab:red"}

def plots(summary: dict[str, Any], prefix: Path) -> list[Path]:
    """Three PNGs; raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, ceil = summary["rows"], summary["ceiling"]
    made = []
    for name, draw in (("sizes", _plot_sizes), ("layout", _plot_layout), ("mix", _plot_mix)):
        fig = draw(plt, rows, ceil)
        if fig is None:
            continue
        path = prefix.with_name(f"{prefix.name}_{name}.png")
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        made.append(path)
    return made


def _ceiling_line(ax: Any, ceil: dict[str, Any], direction: str) -> None:
    if ceil[f"{direction}_gbps"]:
        ax.axhline(ceil[f"{direction}_gbps"], color="gray", linestyle="--", label="O_DIRECT ceiling")


def _plot_sizes(plt: Any, rows: Sequence[Row], ceil: dict[str, Any]) -> Any:
    sweep = select(rows, workload="equal", layout="aggregated", aligned=True, prealloc=True)
    if not sweep:
        return None
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex=True, squeeze=False)
    for col, mode in enumerate(("direct", "buffered")):
        for row_i, direction in enumerate(("write", "read")):
            ax = axes[row_i][col]
            for engine, depth in configs(sweep):
                pts = sorted((r["write_nbytes"], r[f"{direction}_gbps"])
                             for r in select(sweep, mode=mode, engine=engine, depth=depth)
                             if r[f"{direction}_gbps"])
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                            color=ENGINE_COLORS.get(engine), alpha=_shade(depth),
                            label=engine_label({"engine": engine, "depth": depth}))
            _ceiling_line(ax, ceil, direction)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{direction}, {mode}" + (" + fsync" if direction == "write" else ", cold"))
            ax.set_ylabel("GB/s")
            ax.grid(True, alpha=0.3)
    sizes = sorted({r["write_nbytes"] for r in sweep})
    for ax in axes[1]:
        ax.set_xticks(sizes, [fmt_nbytes(n) for n in sizes])
        ax.set_xlabel("write size")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Throughput vs write size (one file, aligned, preallocated)")
    return fig


def _shade(depth: int) -> float:
    return min(1.0, 0.35 + 0.65 * depth.bit_length() / 6)  # deeper queue, darker line


def _bars(ax: Any, groups: list[str], series: dict[str, list[float]], direction: str,
          ceil: dict[str, Any]) -> None:
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        ax.bar([g + i * width for g in range(len(groups))], values, width, label=name)
    ax.set_xticks([g + width * (len(series) - 1) / 2 for g in range(len(groups))], groups, fontsize=8)
    _ceiling_line(ax, ceil, direction)
    ax.set_ylabel("GB/s")
    ax.grid(True, axis="y", alpha=0.3)


def _grouped(plt: Any, rows: Sequence[Row], layouts: Sequence[str], title: str,
             group: Callable[[Row], str], ceil: dict[str, Any]) -> Any:
    keys = list(dict.fromkeys(group(r) for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(max(10.0, 2.6 * len(keys)), 4.5), squeeze=False)
    for ax, direction in zip(axes[0], ("write", "read"), strict=True):
        series = {lay: [next((r[f"{direction}_gbps"] or 0.0 for r in rows
                              if r["layout"] == lay and group(r) == k), 0.0) for k in keys]
                  for lay in layouts}
        _bars(ax, keys, series, direction, ceil)
        ax.set_title(direction + (" + fsync" if direction == "write" else ", cold"))
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title)
    return fig


def _plot_layout(plt: Any, rows: Sequence[Row], ceil: dict[str, Any]) -> Any:
    fpt = select(rows, workload="equal", layout="file_per_tensor")
    keys = {(r["engine"], r["depth"], r["mode"], r["write_nbytes"]) for r in fpt}
    pick = [r for r in select(rows, workload="equal", aligned=True, prealloc=True)
            if (r["engine"], r["depth"], r["mode"], r["write_nbytes"]) in keys]
    if not fpt:
        return None
    return _grouped(plt, pick, ("aggregated", "file_per_tensor"), "File per tensor vs aggregated",
                    lambda r: f"{engine_label(r)}\n{r['mode']} {fmt_nbytes(r['write_nbytes'])}", ceil)


def _plot_mix(plt: Any, rows: Sequence[Row], ceil: dict[str, Any]) -> Any:
    mix = select(rows, workload="gpt")
    if not mix:
        return None
    return _grouped(plt, mix, ("file_per_tensor", "aggregated", "coalesced"),
                    "GPT + AdamW tensor-size mix", lambda r: f"{engine_label(r)}\n{r['mode']}", ceil)
