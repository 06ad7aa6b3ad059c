"""ckptio's storage under torch_checkpointing's API (ckptio/tc_storage.py), on a local
directory and on shm://: its own storage test, its rename table, and its CheckpointManager
(sync and async) saving and loading through it, bitwise. The S3 runs: tests/s3/."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

pytest.importorskip("torch_checkpointing", reason="the [torch-checkpointing] extra")

from ckptio.errors import CkptError  # noqa: E402
from ckptio.tc_storage import CkptioStorage  # noqa: E402
from tests.tc_storage_cases import (manager_round_trip, rename_table,  # noqa: E402
                                    their_storage_test)


@pytest.fixture(params=["local", "shm"])
def root(request: pytest.FixtureRequest, tmp_path, monkeypatch) -> str:
    if request.param == "local":
        return str(tmp_path / "root")
    monkeypatch.setenv("CKPTIO_SHM_DIR", str(tmp_path / "shm"))
    return f"shm://tc-{uuid.uuid4().hex[:8]}"


def test_their_storage_test_passes(root):
    their_storage_test(CkptioStorage(root), "/run")


def test_the_rename_table(root):
    rename_table(CkptioStorage(root), "/run")


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_their_manager_saves_and_loads_through_it_bitwise(root, asynchronous):
    manager_round_trip(root, asynchronous)


def test_a_path_outside_the_root_is_refused(tmp_path):
    storage = CkptioStorage(str(tmp_path))
    with pytest.raises(CkptError, match=r"'\.\.' is not a name under"):
        storage.write(Path("../escape.bin"), b"x")
    assert not os.path.exists(tmp_path.parent / "escape.bin")
