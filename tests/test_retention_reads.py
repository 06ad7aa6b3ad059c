"""Retention does not decode the manifests of the steps its own manager saved: it knows their
bases from the save (managing/chains.py, Chains.made). Decoding a large state's manifest took a
share of every save call's time on the caller's thread (docs/BENCH_LOOP.md, the per-call
Python). A step of another process (a resumed run) is still read, its bases and stored bytes
alone (format.manifest.bases_and_bytes: no entry validated), and a delta's base is still kept
while its delta is."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptio
from ckptio.format import validate
from ckptio.managing import chains, level


@pytest.fixture
def decodes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The path of every manifest the tiers decode or read a link from (``link:`` first)."""
    calls: list[str] = []
    real, real_link = level.decode, chains.bases_and_bytes

    def counting(raw: bytes, where: str) -> object:
        calls.append(where)
        return real(raw, where)

    def counting_links(raw: bytes, where: str) -> tuple[tuple[str, ...], int]:
        calls.append(f"link:{where}")
        return real_link(raw, where)
    monkeypatch.setattr(level, "decode", counting)
    monkeypatch.setattr(chains, "bases_and_bytes", counting_links)
    return calls


def _state(step: int) -> dict[str, object]:
    return {"w": torch.full((64,), float(step)), "step": step}


@pytest.mark.parametrize("asynchronous", [False, True])
def test_own_saves_are_retained_without_reading_their_manifests(
        tmp_path: Path, decodes: list[str], asynchronous: bool) -> None:
    with ckptio.CheckpointManager(tmp_path / "run", keep_last=2) as mgr:
        for step in range(1, 7):
            mgr.save(step, _state(step), asynchronous=asynchronous)
        mgr.wait()
    assert mgr.steps() == [5, 6]
    assert decodes == []


@pytest.mark.parametrize("delta", [False, True])
def test_the_drain_retains_its_copies_without_reading_their_manifests(
        tmp_path: Path, shm: str, decodes: list[str], delta: bool) -> None:
    """The drain's copy has the source step's bytes: the slower tier's retention takes its
    bases from the source tier (which this manager saved), as the fast tier's does."""
    policy = ckptio.DeltaPolicy(full_every=3) if delta else None
    big = torch.arange(4096, dtype=torch.float32)
    tiers = [ckptio.Tier("shm://run", keep_last=2),
             ckptio.Tier(str(tmp_path / "disk"), every=2, keep_last=2)]
    with ckptio.CheckpointManager(tiers=tiers, delta=policy) as mgr:
        for step in range(1, 11):
            mgr.save(step, {"big": big + (step % 2), "step": torch.tensor(step)})
            mgr.wait()
    # (the fast tier's delta steps are still read: their bases are not told at the save)
    assert [where for where in decodes if not delta or "disk" in where] == []
    with ckptio.CheckpointManager(tmp_path / "disk") as again:  # the copies kept restore
        kept = again.steps()
        assert kept[-1] == 10 and len(kept) <= 2 + delta  # a delta's base stays with it
        state = {"big": torch.zeros(4096), "step": torch.tensor(0)}
        assert again.restore(state) == 10
    assert torch.equal(state["big"], big) and int(state["step"]) == 10


def test_a_resumed_manager_reads_the_steps_it_did_not_save(tmp_path: Path,
                                                           decodes: list[str]) -> None:
    with ckptio.CheckpointManager(tmp_path / "run", keep_last=2) as mgr:
        for step in (1, 2):
            mgr.save(step, _state(step))
    with ckptio.CheckpointManager(tmp_path / "run", keep_last=2) as again:
        again.save(3, _state(3))  # retention drops step 1: its link is read from its manifest
        assert again.steps() == [2, 3]
    assert decodes and all(where.startswith("link:") for where in decodes), decodes


def test_a_resumed_jobs_retention_validates_no_manifest(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The steps of the run before are read for their bases and stored bytes only: validating
    a large state's manifest (every entry) took tens of milliseconds inside a resumed job's
    second save call (the first retention); the load validated it already."""
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(20)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    with ckptio.CheckpointManager(tmp_path / "run", keep_last=1) as mgr:
        mgr.save(1, {"model": model, "optim": opt})
    validated: list[str] = []
    real = validate.from_body
    monkeypatch.setattr(validate, "from_body", lambda raw, where, version: (
        validated.append(where), real(raw, where, version))[1])
    fresh = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(20)])
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    with ckptio.CheckpointManager(tmp_path / "run", keep_last=1) as again:
        assert again.restore({"model": fresh, "optim": fresh_opt}) == 1
        assert len(validated) == 1  # the load's
        for step in (2, 3):
            again.save(step, {"model": fresh, "optim": fresh_opt}, asynchronous=True)
        again.wait()
        assert again.steps()[-1] == 3
    assert len(validated) == 1, validated


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
