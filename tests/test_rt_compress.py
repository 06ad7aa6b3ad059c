"""Red-team of compression and deltas as a training loop uses them: a delta whose base lost a
data file by hand fails like a damaged base (CorruptCheckpointError naming the base step and
the file), ``ckptio verify`` says DAMAGED, and restore() passes over it to an older step.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import ckptio
from ckptio import CorruptCheckpointError, DeltaPolicy, Options

OPTS = Options(buffer_bytes=1 << 20, pool_bytes=4 << 20)
ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 256, generator=g)
    w[step] += step
    frozen = torch.randn(512, 256, generator=g)  # never changes: a reference in every delta
    return {"w": w, "b": torch.arange(64, dtype=torch.float32) + step, "frozen": frozen}


def _run(root: Path, steps: range, **kw: object) -> None:
    with ckptio.CheckpointManager(root, keep_last=10, save_every=1, options=OPTS,
                                  delta=DeltaPolicy(full_every=3), **kw) as mgr:
        for step in steps:
            mgr.save(step, _state(step))


def _data_file(step_dir: Path) -> Path:
    return next(p for p in step_dir.iterdir() if p.name.startswith("data-"))


@pytest.mark.parametrize("compression", ["off", "bytegroup+zstd"])
def test_delta_whose_base_lost_its_data_file_is_damaged(tmp_path: Path,
                                                         compression: str) -> None:
    pytest.importorskip("zstandard")
    root = tmp_path / "run"
    _run(root, range(1, 7), compression=compression)  # full 1, 4; deltas 2, 3, 5, 6
    lost = _data_file(root / "step-4")
    lost.unlink()
    with pytest.raises(CorruptCheckpointError) as caught:
        ckptio.load(root / "step-6")
    assert "step-4" in str(caught.value) and lost.name in str(caught.value)
    verify = subprocess.run([sys.executable, "-m", "ckptio", "verify", str(root / "step-6")],
                            env=ENV, capture_output=True, text=True, timeout=120)
    assert verify.returncode == 1, verify.stdout + verify.stderr
    assert "DAMAGED" in verify.stdout and lost.name in verify.stdout
    got = {"w": torch.zeros(256, 256), "b": torch.zeros(64), "frozen": torch.zeros(512, 256)}
    with ckptio.CheckpointManager(root, keep_last=10, save_every=1, options=OPTS,
                                  delta=DeltaPolicy(full_every=3)) as mgr:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            assert mgr.restore(got) == 3
        assert any("step 6" in str(w.message) and "step-4" in str(w.message) for w in said)
        assert all(torch.equal(got[k], v) for k, v in _state(3).items())
    shutil.rmtree(root)


def test_manager_refuses_two_different_compressions(tmp_path: Path) -> None:
    both = Options(buffer_bytes=1 << 20, pool_bytes=4 << 20, compression="bytegroup+zstd")
    with pytest.raises(ckptio.CkptError, match=r"compression='zstd'.*bytegroup\+zstd"):
        ckptio.CheckpointManager(tmp_path / "a", options=both, compression="zstd")
    for k, (same, given) in enumerate(((both, "bytegroup+zstd"), (OPTS, "zstd"), (both, None))):
        with ckptio.CheckpointManager(tmp_path / f"b{k}", options=same, compression=given) as mgr:
            mgr.save(1, {"zeros": torch.zeros(1 << 18)})  # 1 MiB that compresses to little
        assert _data_file(tmp_path / f"b{k}" / "step-1").stat().st_size < (1 << 16)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_running_manager_saves_full_once_its_base_lost_a_file(tmp_path: Path,
                                                               asynchronous: bool) -> None:
    pytest.importorskip("zstandard")
    root = tmp_path / "run"
    with ckptio.CheckpointManager(root, keep_last=10, save_every=1, options=OPTS,
                                  delta=DeltaPolicy(full_every=10),
                                  compression="bytegroup+zstd") as mgr:
        mgr.save(1, _state(1), asynchronous=asynchronous)
        mgr.save(2, _state(2), asynchronous=asynchronous)
        mgr.wait()
        _data_file(root / "step-1").unlink()  # the base, damaged by hand
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            for step in (3, 4):  # both saved: 3 full, 4 a delta of 3
                mgr.save(step, _state(step), asynchronous=asynchronous)
            mgr.wait()
        assert any("step 1" in str(w.message) and "full" in str(w.message) for w in said)
    for step in (3, 4):
        got = ckptio.load(root / f"step-{step}")
        assert all(torch.equal(got[k], v) for k, v in _state(step).items())
    listing = subprocess.run([sys.executable, "-m", "ckptio", "ls", str(root)], env=ENV,
                             capture_output=True, text=True, timeout=60).stdout
    assert [line.split()[-1] for line in listing.splitlines() if line.split()[:1] == ["4"]] \
        == ["step-3"], listing


def _flip_every(path: Path, stride: int) -> None:
    with path.open("r+b") as f:
        for offset in range(0, path.stat().st_size, stride):
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("asynchronous", [False, True])
def test_delta_save_that_finds_its_base_damaged_makes_the_next_save_full(
        tmp_path: Path, asynchronous: bool) -> None:
    pytest.importorskip("zstandard")
    root = tmp_path / "run"
    failed: list[int] = []
    with ckptio.CheckpointManager(root, keep_last=10, save_every=1, options=OPTS,
                                  delta=DeltaPolicy(full_every=10),
                                  compression="bytegroup+zstd") as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
        _flip_every(_data_file(root / "step-1"), 4096)  # its bytes rot; its files stay whole
        for step in (3, 4, 5, 6):
            try:
                mgr.save(step, _state(step), asynchronous=asynchronous)
                mgr.wait() if not asynchronous else None
            except CorruptCheckpointError as exc:
                assert "step-1/" in str(exc)
                failed.append(step)
        mgr.wait()
    assert len(failed) == 1, failed  # one save found the damage; the next was full
    for step in range(max(failed) + 1, 7):
        got = ckptio.load(root / f"step-{step}")
        assert all(torch.equal(got[k], v) for k, v in _state(step).items())
