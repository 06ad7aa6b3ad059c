"""The checks of ckptio's torch_checkpointing storage (ckptio/tc_storage.py), shared by the
local/shm tests (tests/test_tc_storage.py) and the S3 ones (tests/s3/test_tc_storage_s3.py):
torch_checkpointing's own storage test (its repository's tests/test_local_filesystem.py) made
to check through the storage rather than os.path, and its CheckpointManager saving and loading
a training state through it, bitwise."""

from __future__ import annotations

import array
from pathlib import Path
from typing import Any

import numpy as np
import torch

BYTES, BYTEARRAY = b"Hello bytes! ", bytearray(b"Hello bytearray! ")
NUMPY = np.array([1, 2, 3, 4, 5], dtype=np.int32)
TENSOR = torch.tensor([10, 20, 30, 40, 50], dtype=torch.int32)
PYARRAY = array.array("i", [100, 200, 300, 400, 500])
EXPECTED = (BYTES + bytes(BYTEARRAY) + NUMPY.tobytes() + TENSOR.numpy().tobytes()
            + PYARRAY.tobytes())


def their_storage_test(storage: Any, base: str) -> None:
    """test_local_filesystem's steps: mkdir, write, stream_write of bytes, bytearray, numpy,
    a tensor's numpy view and array.array, ls, rename, delete, rmdir."""
    level1, level2 = f"{base}/dir_level1", f"{base}/dir_level1/dir_level2"
    storage.mkdir(Path(level1), recursive=True)
    storage.mkdir(Path(level2), recursive=True)
    storage.write(Path(f"{level1}/write_output.bin"), EXPECTED)
    assert storage.read(Path(f"{level1}/write_output.bin")) == EXPECTED
    with storage.stream_write(Path(f"{level2}/stream_write_output.bin")) as stream:
        for data in (BYTES, BYTEARRAY, NUMPY, TENSOR.numpy(), PYARRAY):
            stream.write(data)
    with storage.stream_read(Path(f"{level2}/stream_write_output.bin")) as f:
        assert f.read() == EXPECTED
    with storage.stream_read(Path(f"{level2}/stream_write_output.bin")) as f:
        part = bytearray(7)  # its parallel fill: one stream per range, seek, readinto
        assert f.seek(5) == 5 and f.readinto(part) == 7 and bytes(part) == EXPECTED[5:12]
        assert f.tell() == 12 and f.seek(0, 2) == len(EXPECTED) and f.readinto(part) == 0
    assert storage.getsize(Path(f"{level2}/stream_write_output.bin")) == len(EXPECTED)
    assert sorted(storage.ls(Path(base))) == ["dir_level1"]
    assert sorted(storage.ls(Path(level1))) == ["dir_level2", "write_output.bin"]
    assert storage.isdir(Path(level2)) and not storage.isdir(Path(f"{level1}/write_output.bin"))
    storage.rename(Path(f"{level2}/stream_write_output.bin"), Path(f"{level2}/renamed.bin"))
    assert storage.ls(Path(level2)) == ["renamed.bin"]
    assert not storage.exists(Path(f"{level2}/stream_write_output.bin"))
    storage.delete(Path(f"{level1}/write_output.bin"))
    storage.delete(Path(f"{level2}/renamed.bin"))
    assert not storage.exists(Path(f"{level2}/renamed.bin"))
    storage.rmdir(Path(level1))
    assert not storage.exists(Path(level1)) and not storage.exists(Path(level2))


def rename_table(storage: Any, base: str) -> None:
    """Storage.rename's table: a directory onto an absent one commits at it; onto a populated
    one, or a file onto a directory: OSError, nothing lost."""
    for name in ("a/x.bin", "b/y.bin"):
        storage.write(Path(f"{base}/{name}"), name.encode())
    try:
        storage.rename(Path(f"{base}/a"), Path(f"{base}/b"), is_directory=True)
        raise AssertionError("a directory renamed onto a populated one")
    except OSError as exc:
        assert "occupied" in str(exc)
    try:
        storage.rename(Path(f"{base}/a/x.bin"), Path(f"{base}/b"))
        raise AssertionError("a file renamed onto a directory")
    except OSError:
        pass
    storage.rename(Path(f"{base}/a"), Path(f"{base}/c"), is_directory=True)
    assert storage.read(Path(f"{base}/c/x.bin")) == b"a/x.bin"
    assert storage.read(Path(f"{base}/b/y.bin")) == b"b/y.bin"
    assert not storage.exists(Path(f"{base}/a"))
    try:
        storage.read(Path(f"{base}/a/x.bin"))
        raise AssertionError("a missing file read")
    except FileNotFoundError:
        pass


def _state(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    return model, opt


def manager_round_trip(root: str, asynchronous: bool) -> None:
    """torch_checkpointing's CheckpointManager (sync, or its async saver's background process)
    saving a model, an optimizer and extras through CkptioStorageConfig(root), then loading
    them in place into fresh objects: every tensor bitwise, bf16 and special values too; then
    ckptio.load of the same checkpoint (loading/tcdir.py) into other fresh objects."""
    from torch_checkpointing import CheckpointManager

    from ckptio.tc_storage import CkptioStorageConfig

    model, opt = _state(0)
    extra = {"step": 7, "t": torch.tensor([float("nan"), float("inf"), -0.0, 1.5]).bfloat16()}
    config = (CheckpointManager.Config.with_async_save() if asynchronous
              else CheckpointManager.Config.with_sync_save())
    config.storage_config = CkptioStorageConfig(root)
    manager = config.build()
    try:
        result = manager.save("step-7", {"model": model.state_dict(), "optim": opt.state_dict(),
                                         "extra": extra})
        if asynchronous:
            result.result()
        fresh, fresh_opt = _state(1)
        into = {"model": fresh.state_dict(), "optim": fresh_opt.state_dict(),
                "extra": {"step": 0, "t": torch.zeros(4, dtype=torch.bfloat16)}}
        manager.load("step-7", into=into)
    finally:
        manager.close()
    fresh.load_state_dict(into["model"])
    fresh_opt.load_state_dict(into["optim"])
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    assert into["extra"]["step"] == 7
    assert torch.equal(into["extra"]["t"].view(torch.int16), extra["t"].view(torch.int16))
    assert str(opt.state_dict()) == str(fresh_opt.state_dict())
    # and ckptio.load reads the checkpoint it wrote there (its directory format), wherever
    import ckptio

    again, again_opt = _state(2)
    state = {"model": again, "optim": again_opt,
             "extra": {"step": 0, "t": torch.zeros(4, dtype=torch.bfloat16)}}
    ckptio.load(f"{root.rstrip('/')}/step-7", state)
    for a, b in zip(model.state_dict().values(), again.state_dict().values()):
        assert torch.equal(a, b)
    assert state["extra"]["step"] == 7 and str(opt.state_dict()) == str(again_opt.state_dict())
    assert torch.equal(state["extra"]["t"].view(torch.int16), extra["t"].view(torch.int16))
