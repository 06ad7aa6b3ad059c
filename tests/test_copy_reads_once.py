"""The drain's copy of a step to a slower tier reads its source once: each entry's bytes are
hashed as they pass through the copy's buffer and checked before the target's commit; a flipped
byte in any entry fails the copy, names the key and leaves the target without the step."""

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
from ckptio.options import MiB
from ckptio.resources import ReusedIOResources
from ckptio.storage.local.local_store import LocalStore
from ckptio.managing.copy import copy_checkpoint
from tests.conftest import CountingReads, assert_same


def _state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(5)
    return {"big": torch.randn(3 * MiB // 4 + 17, generator=gen),  # blocks, over several pieces
            "small": torch.randn(33, generator=gen), "empty": torch.empty(0),
            "ints": torch.randint(0, 1 << 30, (5000,), generator=gen), "step": 7}


def _resources() -> ReusedIOResources:
    return ReusedIOResources(ckptio.Options(buffer_bytes=MiB, pool_bytes=2 * MiB,
                                            use_profile=False))


def _entries(path: Path) -> list[Any]:
    with open(path / MANIFEST_NAME, "rb") as f:
        return list(manifest_format.decode(f.read(), str(path)).tensors)


def test_the_copy_reads_its_source_once_and_commits_the_same_bytes(tmp_path: Path) -> None:
    state = _state()
    ckptio.save(state, tmp_path / "src")
    resources = _resources()
    try:
        counting = resources.wrap_backend(LocalStore(tmp_path / "src"), CountingReads)
        copied = copy_checkpoint(resources, LocalStore(tmp_path / "src"), LocalStore(tmp_path / "dst"))
    finally:
        resources.release()
    assert copied > 3 * MiB and counting.nbytes == copied, "the source was not read exactly once"
    assert_same(ckptio.load(tmp_path / "dst"), state)
    ckptio.verify(tmp_path / "dst")


@pytest.mark.parametrize("key", ["big", "small", "ints"])
def test_a_flipped_byte_in_any_entry_fails_the_copy_and_commits_nothing(tmp_path: Path, key: str) -> None:
    ckptio.save(_state(), tmp_path / "src")
    entry = next(e for e in _entries(tmp_path / "src") if e.key == key)
    with open(tmp_path / "src" / entry.file, "r+b") as f:
        f.seek(entry.offset + entry.nbytes - 1)  # the last byte: the end of the last piece
        last = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([last[0] ^ 0x10]))
    resources = _resources()
    try:
        with pytest.raises(CorruptCheckpointError, match=f"key '{key}'"):
            copy_checkpoint(resources, LocalStore(tmp_path / "src"), LocalStore(tmp_path / "dst"))
    finally:
        resources.release()
    left = os.listdir(tmp_path / "dst") if os.path.isdir(tmp_path / "dst") else []
    assert MANIFEST_NAME not in left and not [n for n in left if n.startswith("data-")], left
