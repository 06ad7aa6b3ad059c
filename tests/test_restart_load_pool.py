"""A restarting job's load does not pin its staging pool before reading: the reads fault the
pool's pages as they land, and the backend registers the pool at a later save, or from the
pre-fault thread once the pool is resident and nothing runs (resources.py,
``files(reading=True)``). Pinning a fresh full-size pool first, with a pre-fault thread beside
the reads, made the first cold load of a fresh 2-rank job about a quarter slower than a later
one (docs/BENCH_RESTART.md)."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

import ckptio
from ckptio.io import uring, uring_unavailable_reason


@pytest.fixture
def registrations(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, bool]]:
    """Every pool registered with an io_uring backend: (bytes, by the pre-fault thread)."""
    calls: list[tuple[int, bool]] = []
    real = uring.UringBackend.register_buffers

    def counting(self: uring.UringBackend, view: memoryview) -> bool:
        calls.append((len(view), any(f.function == "_pin_resident" for f in inspect.stack(0))))
        return real(self, view)
    monkeypatch.setattr(uring.UringBackend, "register_buffers", counting)
    return calls


def _state(fill: float) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.full((1 << 20,), fill + i) for i in range(40)}  # 40 x 4 MiB


@pytest.mark.skipif(uring_unavailable_reason() is not None, reason="io_uring is not available")
def test_a_load_never_pins_the_pool_a_later_save_does(
        tmp_path: Path, registrations: list[tuple[int, bool]]) -> None:
    ckptio.save(_state(1.0), tmp_path / "ck")
    # a pool of the options' full size (the state is larger): the size the old rule pinned at
    # the backend's first use, faulting the rest of it inside the load
    options = ckptio.Options(io_backend="uring", buffer_bytes=4 << 20, pool_bytes=32 << 20)
    ck = ckptio.Checkpointer(options)
    try:
        registrations.clear()
        dest = _state(0.0)
        ck.load(tmp_path / "ck", dest)
        assert all(torch.equal(dest[k], v) for k, v in _state(1.0).items())
        assert [r for r in registrations if not r[1]] == []  # not by the load itself
        pool = ck.resources().pool
        assert pool is not None and pool.nbytes == 32 << 20
        ck.save(dest, tmp_path / "again")
        assert (pool.nbytes, False) in registrations or (pool.nbytes, True) in registrations
    finally:
        ck.close()


@pytest.mark.skipif(uring_unavailable_reason() is not None, reason="io_uring is not available")
def test_a_small_pool_a_load_made_is_still_registered_once_resident(
        tmp_path: Path, registrations: list[tuple[int, bool]]) -> None:
    """A pool sized to a small state is pre-faulted as before and registered once resident, so
    the saves after a restart's load keep io_uring's fixed buffers."""
    small = {f"t{i}": torch.full((1 << 20,), float(i)) for i in range(8)}  # 8 x 4 MiB
    ckptio.save(small, tmp_path / "ck")
    options = ckptio.Options(io_backend="uring", buffer_bytes=4 << 20, pool_bytes=128 << 20)
    ck = ckptio.Checkpointer(options)
    try:
        registrations.clear()
        ck.load(tmp_path / "ck", small)
        pool = ck.resources().pool
        assert pool is not None and pool.nbytes < 128 << 20  # sized to the state
        assert [r for r in registrations if not r[1]] == []
        pool.faulted()
        ck.save(small, tmp_path / "again")
        assert pool.resident and [n for n, _ in registrations] == [pool.nbytes]
    finally:
        ck.close()


@pytest.mark.skipif(uring_unavailable_reason() is not None, reason="io_uring is not available")
def test_a_pool_a_many_rank_load_made_is_registered_by_the_next_save(
        tmp_path: Path, registrations: list[tuple[int, bool]]) -> None:
    """A rank of many makes its pool at its reads, faulted in by them and never pre-faulted
    (so never 'resident'): the next save registers it even when it is smaller than the
    options' pool (a pool a save or fit() makes waits until resident instead)."""
    from ckptio.storage.local import LocalStore

    small = {f"t{i}": torch.full((1 << 20,), float(i)) for i in range(8)}  # 8 x 4 MiB
    options = ckptio.Options(io_backend="uring", buffer_bytes=4 << 20, pool_bytes=128 << 20)
    ck = ckptio.Checkpointer(options)
    try:
        resources = ck.resources()
        with resources.lock:  # what loading/load_session.read_fn asks for on a rank of many
            pool, _files = resources.files(LocalStore(str(tmp_path)), 32 << 20,
                                           copy_faults=True, reading=True)
        assert pool.nbytes == 32 << 20 and not pool.resident and registrations == []
        ck.save(small, tmp_path / "after")
        assert [n for n, _ in registrations] == [pool.nbytes]
    finally:
        ck.close()
