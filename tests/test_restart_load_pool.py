"""A restarting job's load pins its staging pool buffer by buffer, each at its first read, and
never pre-faults it: pinning a buffer faults its pages in, once, beside the reads in flight.
Pinning a whole fresh pool before the first read, or a pre-fault thread beside the reads, or
reading through unpinned buffers each made the first cold load slower (docs/BENCH_RESTART.md).
A save after the load keeps the pool and its pinned parts (resources.py, ``files(reading=True)``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptio
from ckptio.io import ring, uring, uring_unavailable_reason

pytestmark = pytest.mark.skipif(uring_unavailable_reason() is not None,
                                reason="io_uring is not available")


@pytest.fixture
def registrations(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Every pool registered with an io_uring backend: (bytes, part_bytes)."""
    calls: list[tuple[int, int]] = []
    real = uring.UringBackend.register_buffers

    def counting(self: uring.UringBackend, view: memoryview, *, part_bytes: int = 0) -> bool:
        calls.append((len(view), part_bytes))
        return real(self, view, part_bytes=part_bytes)
    monkeypatch.setattr(uring.UringBackend, "register_buffers", counting)
    return calls


@pytest.fixture
def pinned_parts(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(slot, bytes) of every part of a sparse table pinned, in order."""
    calls: list[tuple[int, int]] = []
    real = ring.Ring.update_buffer

    def counting(self: ring.Ring, slot: int, address: int, nbytes: int) -> None:
        calls.append((slot, nbytes))
        real(self, slot, address, nbytes)
    monkeypatch.setattr(ring.Ring, "update_buffer", counting)
    return calls


def _state(fill: float, n: int = 40) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.full((1 << 20,), fill + i) for i in range(n)}  # n x 4 MiB


def test_a_load_pins_the_pool_buffer_by_buffer_and_never_prefaults_it(
        tmp_path: Path, registrations: list[tuple[int, int]],
        pinned_parts: list[tuple[int, int]]) -> None:
    """The state is larger than the pool: the load cycles through its 2 x io_depth buffers, so
    only those are pinned (and faulted); the rest of the pool stays untouched."""
    ckptio.save(_state(1.0), tmp_path / "ck")
    options = ckptio.Options(io_backend="uring", io_depth=2, buffer_bytes=4 << 20,
                             pool_bytes=32 << 20)
    ck = ckptio.Checkpointer(options)
    try:
        registrations.clear()
        pinned_parts.clear()  # what the save pinned (the shared default Checkpointer's pool)
        dest = _state(0.0)
        ck.load(tmp_path / "ck", dest)
        assert all(torch.equal(dest[k], v) for k, v in _state(1.0).items())
        pool = ck.resources().pool
        assert pool is not None and not pool.resident  # no pre-fault thread ran
        assert registrations == [(pool.nbytes, 4 << 20)]
        assert [n for _, n in pinned_parts] == [4 << 20] * 4  # 2 x io_depth buffers
        ck.load(tmp_path / "ck", dest)  # a later load: the same buffers, pinned already
        assert len(pinned_parts) == 4
        ck.save(dest, tmp_path / "again")  # a save keeps the pool and pins what it uses
        # How many buffers the save's writes keep in flight depends on the disk's pace; what
        # must hold is one registration and no buffer pinned twice.
        slots = [slot for slot, _ in pinned_parts]
        assert len(registrations) == 1 and len(slots) == len(set(slots))
        assert 4 <= len(slots) <= pool.nbytes // (4 << 20)
        back = _state(0.0)
        ck.load(tmp_path / "again", back)
        assert all(torch.equal(back[k], v) for k, v in _state(1.0).items())
    finally:
        ck.close()


def test_a_save_first_still_pins_the_whole_pool_at_once(
        tmp_path: Path, registrations: list[tuple[int, int]],
        pinned_parts: list[tuple[int, int]]) -> None:
    """A pool a save makes is registered whole (a save fills every buffer); a load after it
    reads through the same registration."""
    options = ckptio.Options(io_backend="uring", buffer_bytes=4 << 20, pool_bytes=32 << 20)
    ck = ckptio.Checkpointer(options)
    try:
        ck.save(_state(2.0), tmp_path / "ck")
        pool = ck.resources().pool
        assert pool is not None and registrations == [(pool.nbytes, 0)]
        dest = _state(0.0)
        ck.load(tmp_path / "ck", dest)
        assert all(torch.equal(dest[k], v) for k, v in _state(2.0).items())
        assert len(registrations) == 1 and pinned_parts == []
    finally:
        ck.close()
