"""The io_uring backend against the shared IOBackend conformance suite, through a LocalStore by
file name, in each direct_io mode, at depth 1 (requests beyond the ring's admission queue wait
rather than fail); the staging pool registered as fixed buffers, a dead reaper, and the fallback
to POSIX where io_uring is unavailable."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from ckptio import io
from ckptio.io.ring import address_of
from ckptio.io.stage import StagingPool
from ckptio.options import MiB, Options
from ckptio.storage.local.local_store import LocalStore
from ckptio.testing import accepts_o_direct
from ckptio.testing.io_conformance import Factory, IOBackendConformance, fresh_files

pytestmark = pytest.mark.skipif(io.uring_unavailable_reason() is not None,
                                reason=f"io_uring unavailable: {io.uring_unavailable_reason()}")


def uring_files(directory: Path, *, io_depth: int, direct_io: str) -> Factory:
    """Fresh LocalStores under ``directory``, each with a new io_uring backend."""
    options = Options(buffer_bytes=MiB, pool_bytes=2 * MiB, io_backend="uring",
                      io_depth=io_depth, direct_io=direct_io)  # type: ignore[arg-type]
    return fresh_files(lambda key: LocalStore(directory / key), options)


class TestUringConformance(IOBackendConformance):
    @pytest.fixture
    def files_factory(self, direct_io: str, tmp_path: Path) -> Factory:
        return uring_files(tmp_path, io_depth=8, direct_io=direct_io)

    @pytest.fixture
    def expect_direct(self, direct_io: str, tmp_path: Path) -> bool:
        return direct_io != "off" and accepts_o_direct(os.fspath(tmp_path))


class TestUringDepthOne(IOBackendConformance):
    """One request in the kernel at a time: the rest wait for admission, none is dropped."""

    @pytest.fixture
    def files_factory(self, tmp_path: Path) -> Factory:
        return uring_files(tmp_path, io_depth=1, direct_io="auto")


def test_the_store_makes_a_uring_backend(tmp_path: Path) -> None:
    """The suite above runs io_uring, not the POSIX fallback."""
    files = uring_files(tmp_path, io_depth=1, direct_io="off")()
    assert files.backend.name == "uring"
    files.backend.shutdown()


def test_registered_pool_buffers_round_trip(tmp_path: os.PathLike[str]) -> None:
    """Reads and writes from a registered pool take the fixed-buffer opcodes and move the same
    bytes; a view outside the registered region still works (plain opcodes)."""
    from ckptio.io.uring import UringBackend

    backend = UringBackend(depth=4, direct_io="auto")
    pool = StagingPool(4, MiB)
    try:
        assert backend.register_buffers(memoryview(pool._mapping))
        buffers = [pool.acquire() for _ in range(4)]
        for i, b in enumerate(buffers):
            b.view[:] = bytes([i + 1]) * MiB
        path = os.path.join(tmp_path, "fixed.bin")
        fh = backend.open_write(path, 4 * MiB)
        futures = [backend.submit_write(fh, i * MiB, b.view) for i, b in enumerate(buffers)]
        assert [f.result(60) for f in futures] == [MiB] * 4
        backend.close(fh, sync=True)
        with open(path, "rb") as f:
            on_disk = f.read()
        assert on_disk == b"".join(bytes([i + 1]) * MiB for i in range(4))
        for b in buffers:
            b.view[:] = b"\0" * MiB
        fh = backend.open_read(path)
        assert [backend.submit_read(fh, i * MiB, b.view).result(60) for i, b in enumerate(buffers)] == [MiB] * 4
        backend.close(fh, sync=False)
        assert all(bytes(b.view) == bytes([i + 1]) * MiB for i, b in enumerate(buffers))
        assert all(backend._fixed_index(address_of(b.view), MiB) == 0 for b in buffers)
        for b in buffers:
            pool.release(b)
    finally:
        backend.shutdown()
        pool.close()


def test_a_pool_registered_by_parts_pins_each_part_at_its_first_request(
        tmp_path: os.PathLike[str]) -> None:
    """register_buffers(part_bytes=): a request inside one part pins that part (once) and
    takes the fixed opcode; one across two parts, or outside the pool, stays plain; the bytes
    are right either way."""
    from ckptio.io.uring import UringBackend

    backend = UringBackend(depth=4, direct_io="auto")
    pool = StagingPool(4, MiB, prefault=False)
    whole = memoryview(pool._mapping)
    try:
        assert backend.register_buffers(whole, part_bytes=MiB)
        path = os.path.join(tmp_path, "parts.bin")
        data = bytes(range(256)) * (16 * 1024)  # 4 MiB
        with open(path, "wb") as f:
            f.write(data)
        fh = backend.open_read(path)
        assert backend.submit_read(fh, 0, whole[MiB:2 * MiB]).result(60) == MiB
        assert backend._parts is not None and backend._parts.pinned == {1}
        assert backend.submit_read(fh, MiB, whole[MiB // 2:MiB // 2 + MiB]).result(60) == MiB
        assert backend.submit_read(fh, 0, whole[3 * MiB:]).result(60) == MiB
        backend.close(fh, sync=False)
        assert backend._parts.pinned == {1, 3}  # the straddling read pinned nothing
        assert bytes(whole[MiB // 2:MiB // 2 + MiB]) == data[MiB:2 * MiB]
        assert bytes(whole[3 * MiB:]) == data[:MiB]
        assert backend._fixed_index(address_of(whole[3 * MiB:]), MiB) == 3
        assert backend._fixed_index(address_of(whole[MiB // 2:]), MiB) == -1
    finally:
        backend.shutdown()
        pool.close()


def test_forced_off_falls_back_to_posix_and_logs_once() -> None:
    """With io_uring disabled, asking for it gives the POSIX backend and one warning naming why;
    the default ("auto") gives the POSIX backend without a warning (the one logged is uring's)."""
    code = (
        "import logging, ckptio.io as io\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "c = io.create('auto', depth=2, direct_io='auto')\n"
        "a = io.create('uring', depth=2, direct_io='auto')\n"
        "b = io.create('uring', depth=2, direct_io='auto')\n"
        "print(type(c).__name__, type(a).__name__, type(b).__name__)\n"
    )
    env = dict(os.environ, CKPTIO_DISABLE_IO_URING="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["PosixBackend", "PosixBackend", "PosixBackend"]
    assert done.stderr.count("io_uring is unavailable") == 1, done.stderr
    assert "CKPTIO_DISABLE_IO_URING" in done.stderr


def test_unknown_backend_name_is_refused() -> None:
    from ckptio.errors import CkptError

    with pytest.raises(CkptError, match="'nvme_magic' is unknown; available: auto, posix, uring"):
        io.create("nvme_magic", depth=1, direct_io="auto")


def test_dead_reaper_fails_requests_then_shutdown_recovers(tmp_path: os.PathLike[str]) -> None:
    """If the completion thread dies, in-flight and later requests fail at once (no hang) with
    an error saying why; shutdown() gives a working backend again."""
    from ckptio.errors import StorageIOError
    from ckptio.io.uring import UringBackend

    backend = UringBackend(depth=2, direct_io="off")
    pool = StagingPool(2, MiB)
    buffer = pool.acquire()
    path = os.path.join(tmp_path, "f.bin")
    fh = backend.open_write(path, 2 * MiB)
    assert backend.submit_write(fh, 0, buffer.view).result(60) == MiB  # ring and reaper running

    def broken_wait() -> None:
        raise OSError(5, "injected failure of io_uring_enter")

    backend._ring.wait = broken_wait  # type: ignore[union-attr,method-assign]
    backend._ring.push(0, 0, 0, 0, 0, 0)  # a NOP wakes the reaper into the broken wait
    backend._ring.submit()  # type: ignore[union-attr]
    backend._reaper.join(30)  # type: ignore[union-attr]
    with pytest.raises(StorageIOError, match="reaper stopped"):
        backend.submit_write(fh, MiB, buffer.view).result(30)
    backend.shutdown()
    assert backend.submit_write(fh, MiB, buffer.view).result(60) == MiB
    backend.close(fh, sync=True)
    backend.shutdown()
    pool.release(buffer)
    pool.close()


def test_auto_takes_posix_where_the_pool_could_not_be_pinned(monkeypatch) -> None:
    """Unpinned io_uring is no faster than the POSIX pool: "auto" takes io_uring only where the
    pool may be registered (CAP_IPC_LOCK, or a memlock limit of 1 GiB or more); "uring" still
    does. This process (the tests run as root here) holds CAP_IPC_LOCK or it does not, as
    /proc/self/status says."""
    from ckptio.io.posix import PosixBackend
    from ckptio.io.uring import UringBackend

    monkeypatch.setattr(io, "_capable", lambda _bit: False)  # no CAP_IPC_LOCK
    monkeypatch.setattr(io.resource, "getrlimit", lambda _which: (8 << 20, 8 << 20))
    assert not io.can_pin()
    auto = io.create("auto", depth=2, direct_io="auto")
    uring = io.create("uring", depth=2, direct_io="auto")
    try:
        assert isinstance(auto, PosixBackend) and isinstance(uring, UringBackend)
    finally:
        auto.shutdown()
        uring.shutdown()
    monkeypatch.setattr(io.resource, "getrlimit", lambda _which: (2 << 30, 2 << 30))
    assert io.can_pin()
    monkeypatch.undo()
    status = open("/proc/self/status").read()
    line = next(ln for ln in status.splitlines() if ln.startswith("CapEff:"))
    effective = int(line.split()[1], 16)
    assert io._capable(io.CAP_IPC_LOCK) == bool(effective >> 14 & 1)


def _local_backend(ck, where):
    from ckptio.storage.local.local_store import LocalStore

    with ck.resources().lock:
        pool, files = ck.resources().files(LocalStore(str(where)))
    return pool, files.backend


def test_the_default_backend_is_io_uring_where_it_works(tmp_path) -> None:
    """Options() leaves io_backend at "auto": saves and loads through a local directory run on
    io_uring here (docs/BENCH_LIMIT.md round six: a 2 GB save 0.74-0.80 s against 1.0-1.2 s
    through the POSIX pool), and the bytes come back bitwise."""
    import torch

    import ckptio
    from ckptio.io.uring import UringBackend

    options = ckptio.Options(use_profile=False)
    assert options.io_backend == "auto"
    ck = ckptio.Checkpointer(options)
    try:
        state = {"w": torch.randn(1 << 18), "step": 3}
        ck.save(state, tmp_path / "step-3")
        _pool, backend = _local_backend(ck, tmp_path)
        assert isinstance(backend, UringBackend), type(backend)
        got = ck.load(tmp_path / "step-3")
        assert torch.equal(got["w"], state["w"]) and got["step"] == 3
    finally:
        ck.close()


def test_the_pool_is_pinned_at_first_use_and_a_grown_one_once_resident(tmp_path,
                                                                       monkeypatch) -> None:
    """io_uring registers (pins) a full-size staging pool at the backend's first use, faulting
    in what the background pre-fault has not yet; a pool sized to a small state is not pinned
    while it faults in (that cost a 100 MB cold load 37-39 ms); a pool grown for async saves
    (fit) is pinned only once its pre-fault is done, so the next async_save call does not wait
    for all of it (2 GB: 2.2-2.9 s, docs/BENCH_LIMIT.md round six); prepare(state=, wait=True)
    pins it.
    "Still faulting in" is held by patching StagingPool.resident: a small pool's pre-fault may
    finish before the check could see it running."""
    import ckptio

    options = ckptio.Options(use_profile=False, buffer_bytes=1 << 20, pool_bytes=4 << 20,
                             host_budget_bytes=1 << 30)
    faulting = property(lambda _pool: False)
    ck = ckptio.Checkpointer(options)
    try:
        monkeypatch.setattr(StagingPool, "resident", faulting)
        with ck.resources().lock:  # a use of a small state: a pool of 2 buffers
            small, files = ck.resources().files(LocalStore(str(tmp_path)), nbytes=2 << 20)
        assert small.nbuffers == 2 and files.backend._registered == [], "a small pool was pinned"
        ck.resources().release()
        _pool, backend = _local_backend(ck, tmp_path)
        assert backend._registered, "a full-size pool was not pinned at the backend's first use"
        ck.resources().fit([256 << 20])
        pool, backend = _local_backend(ck, tmp_path)
        assert pool.nbuffers == 256 and backend._registered == [], "a grown pool was pinned"
        monkeypatch.undo()
        pool.faulted()
        assert pool.resident
        pool, backend = _local_backend(ck, tmp_path)
        assert backend._registered, "a grown pool was not pinned once resident"
    finally:
        monkeypatch.undo()
        ck.close()
    prepared = ckptio.Checkpointer(options)
    try:
        prepared.prepare(tmp_path, state={"w": torch.zeros(64 << 20, dtype=torch.uint8)},
                         wait=True)
        pool, backend = _local_backend(prepared, tmp_path)
        assert pool.nbuffers >= 64 and backend._registered, "prepare(state=) left the pool unpinned"
    finally:
        prepared.close()


def _admitted(tmp_path: os.PathLike[str], *, write: bool) -> int:
    """How many requests a backend of io_depth 4 (made as a store makes it) lets into the
    kernel while its reaper is held: the first request's completion callback blocks the
    reaper, so no later request finishes and each holds its admission; a thread submits until
    submit blocks. A count, not a time: the wait only lets that thread run."""
    import threading
    import time

    options = Options(buffer_bytes=MiB, pool_bytes=2 * MiB, io_backend="uring", io_depth=4,
                      direct_io="off")
    backend = LocalStore(tmp_path).backend(options)
    os.makedirs(tmp_path, exist_ok=True)
    path = os.path.join(tmp_path, "depth.bin")
    if not write:
        with open(path, "wb") as f:
            f.write(b"\1" * (64 * 4096))
    fh = backend.open_write(path, 64 * 4096) if write else backend.open_read(path)
    held, release = threading.Event(), threading.Event()
    bufs = [bytearray(4096) for _ in range(17)]
    submitted: list[int] = []

    def submit(i: int) -> Future[int]:
        view = memoryview(bufs[i])
        return (backend.submit_write(fh, i * 4096, view) if write
                else backend.submit_read(fh, i * 4096, view))

    first = submit(0)
    first.add_done_callback(lambda _f: (held.set(), release.wait(60)))
    try:
        assert held.wait(60)
        pusher = threading.Thread(target=lambda: [submitted.append(submit(i)) for i in range(1, 17)],
                                  daemon=True)
        pusher.start()
        last, since = -1, time.monotonic()
        while time.monotonic() - since < 2:  # until the pusher has stopped advancing
            if len(submitted) != last:
                last, since = len(submitted), time.monotonic()
            time.sleep(0.05)
        return len(submitted)
    finally:
        release.set()
        pusher.join(60)
        assert all(f.result(60) == 4096 for f in submitted)
        backend.close(fh, sync=write)
        backend.shutdown()


def test_a_load_keeps_twice_the_io_depth_of_reads_in_the_kernel(tmp_path: Path) -> None:
    """READS_PER_DEPTH: io_depth 4 admits 8 reads into the kernel (a load keeps 2 x io_depth
    reads submitted; fio's ceiling keeps 8) and still 4 writes (saves unchanged). Before, reads
    took the writes' 4 (docs/BENCH_RESTART.md, round seven)."""
    from ckptio.io import uring

    assert uring.READS_PER_DEPTH == 2
    assert _admitted(tmp_path / "r", write=False) == 8
    assert _admitted(tmp_path / "w", write=True) == 4
