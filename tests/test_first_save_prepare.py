"""The first save of a job costs what the later ones do (issue 45): the staging of async saves
is sized to the state and faulted in (and pinned, with io_uring) on the pool's own thread as
soon as the state is known: at CheckpointManager.restore() (nothing there, or a step restored),
CheckpointManager.prepare() and Checkpointer.prepare(state=), none of which waits for it,
and at a plain Checkpointer's first async save, before its capture.

"Does not wait for the pre-fault" is checked by holding the pre-fault (a gate around the
page population the pool's thread runs) while the call returns: a call that waited would
only return once the gate gave up (then recorded). "Did not stream through the small pool"
is checked with every write delayed: a capture through Options.pool_bytes' two buffers
must wait for writes to free them, so bytes are written before its call returns.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator

import pytest
import torch

import ckptio
from ckptio import Checkpointer, CheckpointManager, Options
from ckptio import io
from ckptio.io import stage
from ckptio.testing.faults import inject
from tests.pool_states import MiB, STATE_NBYTES, pool_state as _state

SMALL = {"buffer_bytes": MiB, "pool_bytes": 2 * MiB, "io_depth": 2, "use_profile": False,
         "host_budget_bytes": 64 * MiB}

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="a page-locked (CUDA) pool faults in at once")


class Gate:
    """Wraps the pool's page population: each call waits until ``open`` (10 s at most: then
    ``gave_up`` is recorded and the gate opens) and records the thread it ran on."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.gave_up = False
        self.threads: set[str] = set()
        self._populate = stage._populate

    def __call__(self, address: int, nbytes: int) -> None:
        self.threads.add(threading.current_thread().name)
        if not self.opened.wait(10):
            self.gave_up = True
            self.opened.set()
        self._populate(address, nbytes)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    held = Gate()
    monkeypatch.setattr(stage, "_populate", held)
    try:
        yield held
    finally:
        held.opened.set()


def _first_save_did_not_stream(ck: Checkpointer, save) -> None:  # type: ignore[no-untyped-def]
    """``save()`` (an async save) with every write delayed 0.5 s returns before any byte is
    written: its capture found the pool grown to the state and never waited for a write."""
    faulty = inject(ck, delay_s=0.5)
    handle = save()
    assert handle.progress().nbytes_written == 0, "the capture streamed through the small pool"
    handle.wait()
    assert faulty.calls["write"] >= 8


def test_restore_with_nothing_saved_prepares_without_waiting(tmp_path: os.PathLike[str],
                                                             gate: Gate, assert_same) -> None:
    state = _state()
    ck = Checkpointer(Options(**SMALL))
    mgr = CheckpointManager(tmp_path / "ckpts", checkpointer=ck)
    assert ck.staging_nbytes == 0
    assert mgr.restore(state) is None
    assert not gate.gave_up, "restore() waited for the pre-fault"
    assert ck.staging_nbytes >= STATE_NBYTES  # sized before any save
    assert not ck.resources().pool.resident  # still held at the gate
    gate.opened.set()
    _first_save_did_not_stream(ck, lambda: mgr.save(1, state, asynchronous=True))
    assert gate.threads == {"ckptio-prefault"}, gate.threads  # faulted on the pool's thread
    assert_same(ckptio.load(mgr.path(1)), state)
    mgr.close()
    ck.close()


def test_restore_of_a_step_prepares_too(tmp_path: os.PathLike[str], assert_same) -> None:
    state = _state()
    with CheckpointManager(tmp_path / "ckpts") as first:
        first.save(5, state)
    ck = Checkpointer(Options(**SMALL))
    mgr = CheckpointManager(tmp_path / "ckpts", checkpointer=ck)
    dest = _state(seed=1)
    assert mgr.restore(dest) == 5
    assert_same(dest, state)
    assert ck.staging_nbytes >= STATE_NBYTES
    _first_save_did_not_stream(ck, lambda: mgr.save(6, dest, asynchronous=True))
    assert_same(ckptio.load(mgr.path(6)), state)
    mgr.close()
    ck.close()


def test_manager_prepare_for_a_loop_that_never_restores(tmp_path: os.PathLike[str],
                                                        gate: Gate, assert_same) -> None:
    state = _state()
    ck = Checkpointer(Options(**SMALL))
    mgr = CheckpointManager(tmp_path / "ckpts", checkpointer=ck)
    mgr.prepare(state)
    assert not gate.gave_up, "prepare() waited for the pre-fault"
    assert ck.staging_nbytes >= STATE_NBYTES
    gate.opened.set()
    _first_save_did_not_stream(ck, lambda: mgr.save(1, state, asynchronous=True))
    assert_same(ckptio.load(mgr.path(1)), state)
    mgr.close()
    ck.close()


def test_checkpointer_prepare_with_a_state_does_not_wait_unless_asked(
        tmp_path: os.PathLike[str], gate: Gate) -> None:
    state = _state()
    ck = Checkpointer(Options(**SMALL))
    ck.prepare(tmp_path, state=state)
    assert not gate.gave_up, "prepare(state=) waited for the pre-fault"
    assert ck.staging_nbytes >= STATE_NBYTES
    gate.opened.set()
    ck.close()
    waited = Checkpointer(Options(**SMALL))
    waited.prepare(tmp_path, state=state, wait=True)
    assert waited.staging_nbytes >= STATE_NBYTES and waited.resources().pool.resident
    waited.close()


def test_a_plain_first_async_save_grows_the_pool_before_its_capture(
        tmp_path: os.PathLike[str], assert_same) -> None:
    """No prepare, no manager: the first async_save of a state larger than Options.pool_bytes
    grows the pool to the state before its capture (faulted in buffer by buffer ahead of the
    copies), so it returns before any write finished; a synchronous save never grows it."""
    state = _state()
    ck = Checkpointer(Options(**SMALL))
    ck.save(state, tmp_path / "sync")
    assert ck.staging_nbytes == SMALL["pool_bytes"], "a synchronous save grew the pool"
    _first_save_did_not_stream(ck, lambda: ck.async_save(state, tmp_path / "first"))
    assert ck.staging_nbytes >= STATE_NBYTES
    assert_same(ckptio.load(tmp_path / "first"), state)
    ck.close()


@pytest.mark.skipif(io.uring_unavailable_reason() is not None, reason="no io_uring here")
def test_the_prepared_pool_is_pinned_on_its_own_thread_once_resident(
        tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch, gate: Gate,
        assert_same) -> None:
    """io_uring registers a grown pool only once it is resident: after restore() that happens
    on the pool's pre-fault thread, not inside the first save's call (the pre-fault held at
    the gate until restore() returned, so it cannot end while restore() holds the lock)."""
    from ckptio.io.uring import UringBackend

    pinned_on: list[str] = []
    register = UringBackend.register_buffers

    def recorded(self: UringBackend, view: memoryview, *, part_bytes: int = 0) -> bool:
        pinned_on.append(threading.current_thread().name)
        return register(self, view, part_bytes=part_bytes)

    monkeypatch.setattr(UringBackend, "register_buffers", recorded)
    state = _state()
    ck = Checkpointer(Options(**{**SMALL, "io_backend": "uring"}))
    mgr = CheckpointManager(tmp_path / "ckpts", checkpointer=ck)
    assert mgr.restore(state) is None
    assert pinned_on == []
    gate.opened.set()
    ck.resources().pool.faulted()
    assert pinned_on == ["ckptio-prefault"], pinned_on
    mgr.save(1, state, asynchronous=True)
    mgr.wait()
    assert pinned_on == ["ckptio-prefault"], pinned_on  # the save found it pinned
    assert_same(ckptio.load(mgr.path(1)), state)
    mgr.close()
    ck.close()


def test_over_budget_the_prepared_pool_stays_within_it_and_says_so_once(
        tmp_path: os.PathLike[str], caplog: pytest.LogCaptureFixture, assert_same) -> None:
    state = _state()
    ck = Checkpointer(Options(**{**SMALL, "host_budget_bytes": 5 * MiB}))
    mgr = CheckpointManager(tmp_path / "ckpts", checkpointer=ck)
    with caplog.at_level(logging.WARNING, logger="ckptio"):
        assert mgr.restore(state) is None
        assert ck.staging_nbytes == 5 * MiB
        for step in (1, 2):
            mgr.save(step, state, asynchronous=True)
            mgr.wait()
    assert ck.staging_nbytes == 5 * MiB
    warned = [r for r in caplog.records if "host_budget_bytes" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]
    assert_same(ckptio.load(mgr.path(2)), state)
    mgr.close()
    ck.close()


def test_prepare_after_close_and_close_during_the_prefault(tmp_path: os.PathLike[str],
                                                           assert_same) -> None:
    """close() frees a pool still faulting in; prepare() afterwards sizes it again."""
    state = _state()
    ck = Checkpointer(Options(**SMALL))
    ck.prepare(state=state)
    ck.close()
    assert ck.staging_nbytes == 0
    ck.prepare(tmp_path, state=state)
    assert ck.staging_nbytes >= STATE_NBYTES
    ck.async_save(state, tmp_path / "a").wait()
    ck.close()
    assert ck.staging_nbytes == 0
    ck.async_save(state, tmp_path / "b").wait()
    assert ck.staging_nbytes >= STATE_NBYTES
    assert_same(ckptio.load(tmp_path / "b"), state)
    ck.close()
    with CheckpointManager(tmp_path / "m") as mgr:  # a manager's own Checkpointer, closed
        mgr.prepare(state)
    assert_same(ckptio.load(tmp_path / "a"), state)


def test_a_grown_pool_pins_beside_a_wrapped_backend_of_a_store_in_memory(
        tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend wrapped for a store in memory (inject(), from a working directory on tmpfs)
    and an async save that grows the pool: once the pool is resident, its thread pins it with
    every backend made so far, without an error in that thread (it looked up a store it never
    recorded for the wrapped kind: KeyError 'local')."""
    errors: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    shm = tempfile.mkdtemp(dir="/dev/shm")
    try:
        monkeypatch.chdir(shm)
        ck = Checkpointer(Options(**SMALL))
        inject(ck)
        ck.async_save(_state(), tmp_path / "s").wait()
        pool = ck.resources().pool
        assert pool is not None
        pool.faulted()  # the pool's thread, when_resident included, has ended
        assert errors == []
        ck.close()
    finally:
        shutil.rmtree(shm, ignore_errors=True)
