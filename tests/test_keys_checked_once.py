"""A save whose plan is reused does not walk its keys again before the commit: the reader's key
rules (format/validate.py, check_keys) gave the same answer for the same keys, tree and
aliases, and for a state of thousands of tensors the walk held the interpreter on the save's
thread in every save of a training loop (docs/BENCH_LOOP.md section 17). A manifest whose keys
differ from the last one that passed is still checked."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import ckptio
from ckptio.errors import ManifestError
from ckptio.format import manifest, validate
from ckptio.format.types import ObjectEntry


@pytest.fixture
def walks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the walks of the key rules."""
    calls: list[int] = []
    real = validate._check_keys

    def counting(*args: object, **kwargs: object) -> None:
        calls.append(1)
        real(*args, **kwargs)  # type: ignore[arg-type]
    monkeypatch.setattr(validate, "_check_keys", counting)
    return calls


def _state(step: int) -> dict[str, object]:
    return {"model": {f"w{i}": torch.full((8,), float(step + i)) for i in range(20)},
            "step": step, "tags": ["a", "b"]}


def test_saves_of_one_layout_walk_the_keys_once(tmp_path: Path, walks: list[int]) -> None:
    with ckptio.CheckpointManager(tmp_path / "run", keep_last=2) as mgr:
        for step in range(1, 6):
            mgr.save(step, _state(step), asynchronous=True)
        mgr.wait()
        assert len(walks) == 1
        other = {**_state(6), "extra": torch.ones(3)}  # another layout: checked again
        mgr.save(6, other)
        assert len(walks) == 2
    back = {**_state(0), "extra": torch.zeros(3)}
    with ckptio.CheckpointManager(tmp_path / "run") as again:
        assert again.restore(back) == 6
    assert torch.equal(back["model"]["w3"], torch.full((8,), 9.0))  # type: ignore[index]
    assert torch.equal(back["extra"], torch.ones(3)) and back["tags"] == ["a", "b"]


def test_a_bad_manifest_after_a_good_one_is_still_refused() -> None:
    m = manifest.Manifest(version=3, save_id="s", checksum_algorithm="xxh3_64", world_size=1,
                          files=(), tensors=(), objects=(ObjectEntry("a", ["int", 1]),),
                          aliases=(), tree={"d": [["a", {"k": "a"}]]}, meta={},
                          block_nbytes=1 << 20)
    manifest.check_keys(m, "x")
    manifest.check_keys(m, "x")
    clash = dataclasses.replace(m, objects=(*m.objects, ObjectEntry("a", ["int", 2])))
    with pytest.raises(ManifestError):
        manifest.check_keys(clash, "x")
