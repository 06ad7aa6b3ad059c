"""The GPU benchmark (benchmarks.gpu) run on CPU at a tiny size, in process: the mixed-precision
trainer, a lazy ckptio save with after_step through the timed loop, the bitwise check of its last
checkpoint and the tables; every step into a manager's memory tier (ckptio_tiers). No timing is
asserted (docs/BENCH_GPU.md holds the GPU runs)."""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_phases, gpu_report
from benchmarks.gpu_engines import build_trainer


def _args(tmp_path: Path, engine: str) -> argparse.Namespace:
    return argparse.Namespace(engine=engine, rep=0, every=3, steps=8, dir=tmp_path / "d",
                              shm_dir=tmp_path / "shm")


def test_tiny_training_run_checkpoints_lazily_and_reads_back_bit_exact(tmp_path: Path) -> None:
    runs = []
    for engine in ("none", "ckptio_lazy"):
        trainer = build_trainer(0.01, "cpu", 0, batch=1, seq=16, accum=1)
        bf16 = next(trainer.model.parameters())
        assert bf16.dtype == torch.bfloat16 and trainer.master  # mixed precision, fp32 masters
        run = gpu_phases.train_worker(_args(tmp_path, engine), trainer)
        runs.append({"worker": "train", "engine": engine, "every": 3, "rep": 0, **run})
    lazy = runs[1]
    assert lazy["when"] == [3, 6] and [c["step"] for c in lazy["checkpoints"]] == [3, 6]
    assert lazy["bitwise_ok"] is True  # the last checkpoint equals the state at its save
    assert len(gpu_phases.blocked(lazy)) == 2 and min(gpu_phases.blocked(lazy)) >= 0
    assert not (tmp_path / "d" / "ckptio_lazy-r0").exists()  # the run's files are removed
    table = "\n".join(gpu_report.train_table(runs, 3))
    assert "| ckptio_lazy |" in table and "| none |" not in table


def test_tiny_every_step_run_into_the_memory_tier_reads_back_bit_exact(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTIO_SHM_DIR", str(tmp_path))  # restored: TierSaver sets it
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    args = _args(tmp_path, "ckptio_tiers")
    args.every, args.shm_dir = 1, shm / f"ckptio-bench-gpu-{os.getpid()}"
    trainer = build_trainer(0.01, "cpu", 0, batch=1, seq=16, accum=1)
    try:
        run = gpu_phases.train_worker(args, trainer)
        left = sorted(p.name for p in args.shm_dir.iterdir())
    finally:
        shutil.rmtree(args.shm_dir, ignore_errors=True)
    assert left == [], left  # the memory tier's directory and the run's own are removed
    assert [c["step"] for c in run["checkpoints"]] == [3, 4, 5]
    assert run["bitwise_ok"] is True  # the last step, read from the memory tier
    assert run["memory_tier_bytes"] > 0
    assert not (tmp_path / "d" / "tier-r0").exists()  # the disk tier's
