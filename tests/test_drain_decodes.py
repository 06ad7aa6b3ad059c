"""The drain's copy does not decode again a manifest this process committed: the save hands its
record to the Checkpointer's memo (saving/commits.py), keyed by the store's location and the
exact bytes committed, and the copy takes it from there (docs/BENCH_LOOP.md section 19). A step
another process or manager committed, or bytes that differ, are decoded in full; the copied
bytes are checked against the record's checksums either way."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptio
from ckptio import CorruptCheckpointError
from ckptio.format import manifest as manifest_format
from ckptio.format.manifest import MANIFEST_NAME
from ckptio.managing.copy import copy_checkpoint
from ckptio.options import MiB
from ckptio.resources import ReusedIOResources
from ckptio.saving.commits import COMMITS_KEPT, Commits
from ckptio.storage.local.local_store import LocalStore


@pytest.fixture
def decodes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Where every manifest a load, verify or copy opens was decoded (loading/opening.py)."""
    calls: list[str] = []
    real = manifest_format.decode

    def counting(raw: bytes, where: str) -> Any:
        calls.append(where)
        return real(raw, where)
    monkeypatch.setattr(manifest_format, "decode", counting)
    return calls


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.arange(4096, dtype=torch.float32) + step, "b": torch.ones(33) * step,
            "step": step}


def _restored(directory: Path, step: int) -> None:
    with ckptio.CheckpointManager(directory) as again:
        state = {"w": torch.zeros(4096), "b": torch.zeros(33), "step": 0}
        assert again.restore(state) == step
    assert torch.equal(state["w"], _state(step)["w"]) and state["step"] == step


@pytest.mark.parametrize("asynchronous", [False, True])
def test_drained_saves_decode_no_manifest(tmp_path: Path, shm: str, decodes: list[str],
                                          asynchronous: bool) -> None:
    tiers = [ckptio.Tier("shm://run", keep_last=2),
             ckptio.Tier(str(tmp_path / "disk"), every=1, keep_last=2)]
    with ckptio.CheckpointManager(tiers=tiers) as mgr:
        for step in range(1, 6):
            mgr.save(step, _state(step), asynchronous=asynchronous)
            mgr.wait()
            assert mgr.drained(60)
    assert [w for w in decodes if w.startswith(shm)] == [], "the drain decoded its own steps"
    _restored(tmp_path / "disk", 5)


def test_a_step_another_manager_committed_is_decoded(tmp_path: Path, shm: str,
                                                     decodes: list[str]) -> None:
    """The resumed drain copies a step the first manager (its own Checkpointer) committed."""
    with ckptio.CheckpointManager(tiers=[ckptio.Tier("shm://run", keep_last=2)]) as first:
        first.save(2, _state(2))
    tiers = [ckptio.Tier("shm://run", keep_last=2),
             ckptio.Tier(str(tmp_path / "disk"), every=1, keep_last=2)]
    with ckptio.CheckpointManager(tiers=tiers) as mgr:
        assert mgr.drained(60)
    assert len([w for w in decodes if w.startswith(shm)]) == 1
    _restored(tmp_path / "disk", 2)


def _resources() -> ReusedIOResources:
    return ReusedIOResources(ckptio.Options(buffer_bytes=MiB, pool_bytes=2 * MiB,
                                            use_profile=False))


def test_the_copy_takes_the_record_only_for_the_same_bytes(tmp_path: Path,
                                                           decodes: list[str]) -> None:
    ck = ckptio.Checkpointer()
    try:
        ck.resources().commits.listen()  # as a manager with a drain does
        ck.save(_state(3), tmp_path / "src")
        source = LocalStore(tmp_path / "src")
        record = ck.resources().commits.known(source.location, source.read_manifest())
    finally:
        ck.close()
    assert record is not None
    resources = _resources()
    try:
        copy_checkpoint(resources, source, LocalStore(tmp_path / "a"), known=lambda _d: record)
        assert decodes == []
        copy_checkpoint(resources, source, LocalStore(tmp_path / "b"),  # other bytes: decoded
                        known=lambda d: record if d == b"other" else None)
        assert len(decodes) == 1
        entry = next(e for e in record.tensors if e.key == "w")
        with open(tmp_path / "src" / entry.file, "r+b") as f:  # a flipped byte still fails
            f.seek(entry.offset + 5)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x10]))
        with pytest.raises(CorruptCheckpointError, match="key 'w'"):
            copy_checkpoint(resources, source, LocalStore(tmp_path / "c"), known=lambda _d: record)
        assert len(decodes) == 1
    finally:
        resources.release()
    assert not os.path.exists(tmp_path / "c" / MANIFEST_NAME)
    assert torch.equal(ckptio.load(tmp_path / "a")["w"], _state(3)["w"])


def test_commits_keep_the_last_few_by_exact_bytes() -> None:
    commits, record = Commits(), object()
    commits.remember("/x/1", b"one", record)  # type: ignore[arg-type]
    assert commits.known("/x/1", b"one") is None, "nothing kept before a drain listens"
    commits.listen()
    commits.remember("/x/1", b"one", record)  # type: ignore[arg-type]
    assert commits.known("/x/1", b"one") is record
    assert commits.known("/x/1", b"one!") is None and commits.known("/x/2", b"one") is None
    for k in range(2, 2 + COMMITS_KEPT):
        commits.remember(f"/x/{k}", b"k", record)  # type: ignore[arg-type]
    assert commits.known("/x/1", b"one") is None, "the oldest is let go"
