"""A restore from the memory tier (a directory on tmpfs) reads each whole entry straight into
its destination tensor, hashed there: no staging copy. Destinations that cannot take the bytes
as stored (another dtype, not contiguous) go through the staging pool as before; a flipped or
missing byte is caught either way and names the key."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import ckptio
from ckptio import CorruptCheckpointError
from ckptio.format import manifest as manifest_format
from ckptio.format.manifest import MANIFEST_NAME
from ckptio.storage.local.local_store import LocalStore
from tests.conftest import assert_same


class _Addresses:
    """A backend that records the address and length of every read's memory (then does it)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.reads = inner, []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def submit_read(self, fh: Any, offset: int, into: memoryview) -> Any:
        self.reads.append(_where(into))
        return self.inner.submit_read(fh, offset, into)

    def submit_reads(self, fh: Any, reads: Any, each: Any) -> Any:  # backend_contract.BatchReads
        self.reads.extend(_where(into) for _offset, into in reads)
        return self.inner.submit_reads(fh, reads, each)


def _where(into: memoryview) -> tuple[int, int]:
    return torch.frombuffer(into, dtype=torch.uint8).data_ptr() if len(into) else 0, len(into)


def _state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(11)
    return {"w": torch.randn(300, 257, generator=gen), "b": torch.randn(5, generator=gen),
            "half": torch.randn(1000, generator=gen).to(torch.bfloat16),
            "ids": torch.randint(0, 1 << 40, (77,), generator=gen), "scalar": torch.tensor(2.5),
            "empty": torch.empty(0, 3), "t": torch.randn(64, 32, generator=gen)}


def _blank(state: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.zeros_like(v) for k, v in state.items()}


def test_memory_tier_entries_land_in_their_tensors_without_staging(shm: str) -> None:
    state, path = _state(), os.path.join(shm, "step")
    os.makedirs(shm)
    ckptio.save(state, path)
    into = _blank(state)
    ck = ckptio.Checkpointer()
    try:
        reads = ck.resources().wrap_backend(LocalStore(path), _Addresses)
        ck.load(path, into)
    finally:
        ck.close()
    assert_same(into, state)
    wanted = {(t.data_ptr(), t.numel() * t.element_size()) for t in into.values() if t.numel()}
    assert set(reads.reads) == wanted, "a read went through staging, or one is missing"


def test_destinations_that_cannot_take_the_bytes_go_through_staging(shm: str) -> None:
    state, path = _state(), os.path.join(shm, "step")
    os.makedirs(shm)
    ckptio.save(state, path)
    into = _blank(state)
    into["t"] = torch.zeros(32, 64).t()  # not contiguous
    into["b"] = torch.zeros(5, dtype=torch.float64)  # another dtype: cast=True
    ckptio.Checkpointer().load(path, into, cast=True)
    assert torch.equal(into["t"], state["t"]) and torch.equal(into["b"], state["b"].double())
    assert_same({k: v for k, v in into.items() if k not in ("t", "b")},
                {k: v for k, v in state.items() if k not in ("t", "b")})


def _entry(path: str, key: str) -> Any:
    with open(os.path.join(path, MANIFEST_NAME), "rb") as f:
        return next(e for e in manifest_format.decode(f.read(), path).tensors if e.key == key)


@pytest.mark.parametrize("key", ["w", "half", "scalar"])
def test_a_flipped_byte_in_memory_is_caught_naming_the_key(shm: str, key: str) -> None:
    state, path = _state(), os.path.join(shm, "step")
    os.makedirs(shm)
    ckptio.save(state, path)
    entry = _entry(path, key)
    with open(os.path.join(path, entry.file), "r+b") as f:
        f.seek(entry.offset + entry.nbytes // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(CorruptCheckpointError, match=f"key '{key}'"):
        ckptio.Checkpointer().load(path, _blank(state))


@pytest.mark.parametrize("backend", ["posix", "uring"])
def test_either_backend_reads_a_memory_tier_directly(shm: str, backend: str) -> None:
    """POSIX batches the reads (BatchReads); io_uring, without batches, one read per entry."""
    state, path = _state(), os.path.join(shm, "step")
    os.makedirs(shm)
    ckptio.save(state, path)
    into = _blank(state)
    ckptio.Checkpointer(ckptio.Options(io_backend=backend)).load(path, into)
    assert_same(into, state)


def test_a_truncated_file_in_memory_is_caught(shm: str) -> None:
    state, path = _state(), os.path.join(shm, "step")
    os.makedirs(shm)
    ckptio.save(state, path)
    entry = _entry(path, "w")
    os.truncate(os.path.join(path, entry.file), entry.offset + entry.nbytes - 8)
    with pytest.raises(CorruptCheckpointError, match="truncated|ends"):
        ckptio.Checkpointer().load(path, _blank(state))
