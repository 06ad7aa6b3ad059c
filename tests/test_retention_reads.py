"""Retention does not decode the manifests of the steps its own manager saved: it knows their
bases from the save (managing/chains.py, Chains.made). Decoding a large state's manifest took a
share of every save call's time on the caller's thread (docs/BENCH_LOOP.md, the per-call
Python). A step of another process (a resumed run) is still read, and a delta's base is still
kept while its delta is."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptio
from ckptio.managing import level


@pytest.fixture
def decodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts every manifest the tiers' retention decodes."""
    calls: list[int] = []
    real = level.decode

    def counting(raw: bytes, where: str) -> object:
        calls.append(1)
        return real(raw, where)
    monkeypatch.setattr(level, "decode", counting)
    return calls


def _state(step: int) -> dict[str, object]:
    return {"w": torch.full((64,), float(step)), "step": step}


@pytest.mark.parametrize("asynchronous", [False, True])
def test_own_saves_are_retained_without_reading_their_manifests(
        tmp_path: Path, decodes: list[int], asynchronous: bool) -> None:
    with ckptio.CheckpointManager(tmp_path / "run", keep_last=2) as mgr:
        for step in range(1, 7):
            mgr.save(step, _state(step), asynchronous=asynchronous)
        mgr.wait()
    assert mgr.steps() == [5, 6]
    assert decodes == []


def test_a_resumed_manager_reads_the_steps_it_did_not_save(tmp_path: Path,
                                                           decodes: list[int]) -> None:
    with ckptio.CheckpointManager(tmp_path / "run", keep_last=2) as mgr:
        for step in (1, 2):
            mgr.save(step, _state(step))
    with ckptio.CheckpointManager(tmp_path / "run", keep_last=2) as again:
        again.save(3, _state(3))  # retention drops step 1: its link is read from its manifest
        assert again.steps() == [2, 3]
    assert len(decodes) >= 1


def test_a_deltas_base_is_kept_while_the_delta_is(tmp_path: Path) -> None:
    big = torch.arange(4096, dtype=torch.float32)
    with ckptio.CheckpointManager(tmp_path / "run", keep_last=2,
                                  delta=ckptio.DeltaPolicy(full_every=10)) as mgr:
        for step in range(1, 5):
            mgr.save(step, {"big": big, "step": torch.tensor(step)})
        assert mgr.steps() == [1, 3, 4]  # 3 and 4 are deltas against 1: 1 stays
        state = {"big": torch.zeros(4096), "step": torch.tensor(0)}
        assert mgr.restore(state) == 4
    assert torch.equal(state["big"], big) and int(state["step"]) == 4
