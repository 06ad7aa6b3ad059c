"""The performance page's plots (docs/performance.md, "Plots"), drawn from benchmark results
already in docs/results/ (nothing is measured here):

    python -m benchmarks.docs_plots        # needs matplotlib (pip install -e '.[bench]')

1. save_load.png: durable save and first cold load of a 2 GB GPT + AdamW state in GB/s, ckptio,
   DCP and torch_checkpointing against the disk measured in the same run (fio's read ceiling;
   for saves the project's O_DIRECT write, which ckptio's save beats: no fio write), 1 and 2
   ranks (docs/results/i47/ranks{1,2}_2gb.json, docs/BENCH_TORCH_CHECKPOINTING.md).
2. loop_overhead.png: how much a save every 5 steps slows the training loop, each engine, on
   shared and on pinned cores (docs/results/i47/loop_every5_{shared,pinned}.json).
3. restore.png: a 1 GB restore from the memory tier against a cold disk and one memory copy
   (docs/results/i45/restore_memory_after_r{1,2}.json, docs/BENCH_LOOP.md section 7).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
OUT = RESULTS / "plots"
NAMES = {"ckptio": "ckptio", "dcp_t4": "DCP", "dcp": "DCP", "tcp": "torch_checkpointing"}


def _load(name: str) -> dict[str, Any]:
    with open(RESULTS / name) as f:
        return json.load(f)


def save_load(plt: Any) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), sharey=True)
    for ax, ranks in zip(axes, (1, 2)):
        summary = _load(f"i47/ranks{ranks}_2gb.json")["summary"]
        gb = summary["bytes"] / 1e9
        saves = {s["engine"]: gb / s["save_s"] for s in summary["saves"]}
        loads = {ld["engine"]: gb / ld["load_s"] for ld in summary["loads"]
                 if ld["layout"] == f"{ranks}->{ranks}"}
        engines = [e for e in ("ckptio", "dcp_t4", "tcp") if e in saves]
        xs = range(len(engines))
        ax.bar([x - 0.2 for x in xs], [saves[e] for e in engines], 0.4, label="durable save")
        ax.bar([x + 0.2 for x in xs],
               [loads.get(e, loads.get(e.removesuffix("_t4"), 0.0)) for e in engines], 0.4,
               label="first cold load")
        ax.axhline(gb / summary["ceiling_write_s"], color="C0", linestyle="--", linewidth=1,
                   label="one O_DIRECT write (not a ceiling)")
        ax.axhline(gb / summary["fio_read_s"], color="C1", linestyle=":", linewidth=1,
                   label="fio read ceiling")
        ax.set_xticks(list(xs), [NAMES[e] for e in engines])
        ax.set_title(f"{ranks} rank{'s' if ranks > 1 else ''}, 2 GB")
    axes[0].set_ylabel("GB/s (higher is better)")
    axes[1].legend(fontsize=8, loc="upper right")
    return _save(fig, "save_load.png")


def loop_overhead(plt: Any) -> Path:
    fig, ax = plt.subplots(figsize=(7, 3.4))
    shown = {"disk_lazy_k": "ckptio (lazy)", "disk_k": "ckptio (async)", "dcp_k": "DCP async",
             "tcp_k": "torch_checkpointing"}
    for offset, (how, label) in zip((-0.2, 0.2), (("shared", "cores shared"),
                                                  ("pinned", "training on its own core"))):
        engines = _load(f"i47/loop_every5_{how}.json")["summary"]["engines"]
        keys = [k for k in shown if k in engines]
        ax.bar([i + offset for i in range(len(keys))],
               [engines[k]["overhead_pct"] for k in keys], 0.4, label=label)
    ax.set_xticks(range(len(shown)), list(shown.values()))
    ax.set_ylabel("% slower steps (lower is better)")
    ax.set_title("A save every 5 steps, 0.15 GB GPT + AdamW")
    ax.legend(fontsize=8)
    return _save(fig, "loop_overhead.png")


def restore(plt: Any) -> Path:
    fig, ax = plt.subplots(figsize=(6, 3))
    medians = [_load(f"i45/restore_memory_after_r{r}.json")["median"] for r in (1, 2)]
    rows = [("memory tier", "memory_s"), ("cold disk", "cold_disk_s"), ("one memcpy", "memcpy_s")]
    ax.barh([label for label, _ in rows],
            [sorted(m[key] for m in medians)[0] for _label, key in rows], color=["C2", "C1", "C7"])
    ax.set_xlabel("seconds for 1 GB in 1,000 tensors (lower is better; the faster of 2 runs)")
    ax.set_title("Restore into the same tensors, verified")
    return _save(fig, "restore.png")


def _save(fig: Any, name: str) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(OUT / name, dpi=110)
    return OUT / name


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for draw in (save_load, loop_overhead, restore):
        print(draw(plt))


if __name__ == "__main__":
    main()
