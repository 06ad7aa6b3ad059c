"""The staging pool an async save grows so that the next one returns at copy speed, within a
host-memory budget (Options.host_budget_bytes), and what a user sees of it
(Checkpointer.staging_nbytes, prepare(state=), the warning past the budget).

What makes eager async_save asynchronous for a large state: a pool that holds the whole state
lets the capture finish without waiting for a single write, so at least that much staging must
exist; without growth, a state larger than the pool waits for the disk inside the call.
"""

from __future__ import annotations

import dataclasses

import logging
import os
from collections.abc import Callable
import time

import pytest
import torch

import ckptio
from ckptio import Checkpointer, CkptError, Options
from ckptio.testing.faults import inject

MiB = 1 << 20
SMALL = {"buffer_bytes": MiB, "pool_bytes": 2 * MiB, "io_depth": 2, "use_profile": False}


def _state(nbytes: int, seed: int = 0) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    n = nbytes // 4 // 4
    return {"w": {f"t{i}": torch.randn(n, generator=g) for i in range(4)},
            "small": torch.arange(7.0), "step": 3}


def test_async_save_grows_the_pool_and_a_sync_save_does_not(tmp_path: os.PathLike[str],
                                                            assert_same) -> None:
    state = _state(8 * MiB)
    ck = Checkpointer(Options(**SMALL))
    ck.save(state, tmp_path / "sync")
    saved_sync = {"w": {k: v.clone() for k, v in state["w"].items()},
                  "small": state["small"].clone(), "step": state["step"]}
    assert ck.staging_nbytes == 2 * MiB  # a synchronous save streams: no memory is added
    ck.async_save(state, tmp_path / "a1").wait()
    grown = ck.staging_nbytes
    assert 8 * MiB <= grown <= 12 * MiB, grown  # the whole state, whole buffers per file
    with torch.no_grad():
        state["w"]["t0"].add_(1.0)
    ck.async_save(state, tmp_path / "a2").wait()
    assert ck.staging_nbytes == grown  # allocated once, reused
    assert_same(ckptio.load(tmp_path / "sync"), saved_sync)
    assert_same(ckptio.load(tmp_path / "a2"), state)
    ck.close()
    assert ck.staging_nbytes == 0
    ck.save(state, tmp_path / "after-close")  # back to pool_bytes until an async save grows it
    assert ck.staging_nbytes == 2 * MiB
    ck.close()


def test_grown_pool_capture_never_waits_for_the_disk(tmp_path: os.PathLike[str],
                                                     assert_same) -> None:
    """Every write delayed by 0.5 s: with the grown pool, async_save returns before any write
    has finished (the capture needed no buffer back); with the pool held at pool_bytes
    (host_budget_bytes=0) the same call had to wait for writes to free buffers."""
    state = _state(8 * MiB)
    written_at_return = {}
    for budget in (None, 0):
        ck = Checkpointer(Options(**SMALL, host_budget_bytes=budget))
        ck.async_save(state, tmp_path / f"warm-{budget}").wait()  # grows the pool (or not)
        faulty = inject(ck, delay_s=0.5)
        handle = ck.async_save(state, tmp_path / f"held-{budget}")
        written_at_return[budget] = handle.progress().nbytes_written
        handle.wait()
        assert faulty.calls["write"] >= 8
        assert_same(ckptio.load(tmp_path / f"held-{budget}"), state)
        ck.close()
    assert written_at_return[None] == 0
    assert written_at_return[0] >= 4 * MiB  # streamed: 8 MiB through 2 buffers


def test_budget_caps_the_pool_and_says_so_once(tmp_path: os.PathLike[str], assert_same,
                                               caplog: pytest.LogCaptureFixture) -> None:
    state = _state(8 * MiB)
    ck = Checkpointer(Options(**SMALL, host_budget_bytes=5 * MiB))
    with caplog.at_level(logging.WARNING, logger="ckptio"):
        for i in range(3):
            ck.async_save(state, tmp_path / f"s{i}").wait()
    assert ck.staging_nbytes == 5 * MiB  # the budget, in whole buffers
    warned = [r for r in caplog.records if "host_budget_bytes" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]
    assert "waits for the disk" in warned[0].getMessage()
    assert_same(ckptio.load(tmp_path / "s2"), state)
    ck.close()


def test_prepare_with_the_state_sizes_the_pool_before_the_first_save(
        tmp_path: os.PathLike[str], assert_same) -> None:
    state = _state(8 * MiB)
    ck = Checkpointer(Options(**SMALL))
    ck.prepare(tmp_path, state=state)
    assert ck.staging_nbytes >= 8 * MiB
    faulty = inject(ck, delay_s=0.5)
    handle = ck.async_save(state, tmp_path / "first")
    assert handle.progress().nbytes_written == 0  # the first save, too, did not wait
    handle.wait()
    assert faulty.calls["write"] >= 8
    assert_same(ckptio.load(tmp_path / "first"), state)
    ck.close()


def test_budget_option_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTIO_HOST_BUDGET_BYTES", str(3 << 30))
    assert Options.from_env().host_budget_bytes == 3 << 30
    monkeypatch.setenv("CKPTIO_HOST_BUDGET_BYTES", "auto")
    assert Options.from_env().host_budget_bytes is None
    monkeypatch.setenv("CKPTIO_HOST_BUDGET_BYTES", "lots")
    with pytest.raises(CkptError, match="CKPTIO_HOST_BUDGET_BYTES"):
        Options.from_env()
    with pytest.raises(CkptError, match="host_budget_bytes=-1"):
        Options(host_budget_bytes=-1)


def _pretend_available(monkeypatch: pytest.MonkeyPatch, nbytes: Callable[[], int]) -> None:
    """Make the host report ``nbytes()`` of available memory to every ckptio module that asks
    (wherever ``available_host_bytes`` is defined or imported)."""
    import sys

    patched = [m for name, m in list(sys.modules.items())
               if name.partition(".")[0] == "ckptio" and callable(getattr(m, "available_host_bytes", None))]
    assert patched, "no ckptio module reads available_host_bytes any more"
    for module in patched:
        monkeypatch.setattr(module, "available_host_bytes", nbytes)


@pytest.mark.parametrize("local_world_size,budget_mib", [(None, 20), ("2", 10), ("4", 5)])
def test_the_automatic_budget_is_half_the_available_memory_shared_by_the_hosts_ranks(
        tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch, assert_same,
        local_world_size: str | None, budget_mib: int) -> None:
    """host_budget_bytes=None: half of (available + the pool's own) memory, divided among the
    LOCAL_WORLD_SIZE ranks of the host (torchrun sets it): 40 MiB available before the first
    save -> 20 MiB for one rank, 10 MiB each for 2, 5 MiB each for 4; a 32 MiB state is
    capped. The pool's memory is no longer available once made, as on a real host."""
    if local_world_size is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world_size)
    state = _state(32 * MiB)
    ck = Checkpointer(Options(**SMALL))
    _pretend_available(monkeypatch, lambda: 40 * MiB - ck.staging_nbytes)
    ck.async_save(state, tmp_path / "s").wait()
    assert ck.staging_nbytes == budget_mib * MiB
    assert_same(ckptio.load(tmp_path / "s"), state)
    ck.close()


def test_views_kept_in_buffers_follow_a_changed_layout(tmp_path: os.PathLike[str],
                                                       assert_same) -> None:
    """Saves whose items land at the same buffer offsets with another dtype or shape (the kept
    views are keyed by all three) each store their own bytes."""
    ck = Checkpointer(Options(**SMALL))
    states = [{"x": torch.arange(64, dtype=torch.float32), "y": torch.arange(3.0)},
              {"x": torch.arange(64, dtype=torch.int32), "y": torch.arange(3.0)},
              {"x": torch.arange(64, dtype=torch.float32).reshape(8, 8), "y": torch.ones(3)},
              {"x": torch.arange(64, dtype=torch.float32), "y": torch.arange(3.0)}]
    for i, state in enumerate(states):
        ck.async_save(state, tmp_path / f"s{i}").wait()
    for i, state in enumerate(states):
        assert_same(ckptio.load(tmp_path / f"s{i}"), state)
    ck.close()


def test_pool_hands_out_lowest_buffers_first_and_bounds_kept_views() -> None:
    from ckptio.io.buffers import MAX_KEPT_VIEWS
    from ckptio.io.stage import StagingPool

    pool = StagingPool(4, MiB)
    taken = [pool.acquire() for _ in range(4)]
    assert [b.index for b in taken] == [0, 1, 2, 3]
    for i in (2, 0, 3, 1):
        pool.release(taken[i])
    again = [pool.acquire() for _ in range(2)]
    assert [b.index for b in again] == [0, 1]
    buffer = again[0]
    for n in range(MAX_KEPT_VIEWS + 10):
        view = buffer.view_at(0, torch.float32, torch.Size([n % 1000 + 1, n // 1000 + 1]))
        assert view.data_ptr() == buffer.data.data_ptr()
    assert len(buffer._views) <= MAX_KEPT_VIEWS
    for b in again:
        pool.release(b)
    pool.close()


def test_background_prefault_hands_out_buffers_before_it_ends() -> None:
    from ckptio.io.stage import StagingPool

    pool = StagingPool(64, MiB, background=True)
    first = pool.acquire()  # as soon as one buffer's pages exist, not after all 64
    first.data.fill_(7)
    pool.release(first)
    pool.faulted()
    assert pool.idle()
    every = [pool.acquire() for _ in range(64)]
    assert sum(int(b.data[0]) == 7 for b in every) == 1  # the others were zeroed, once
    for b in every:
        pool.release(b)
    pool.close()


def test_idle_while_the_background_prefault_runs():
    """Buffers the background pre-fault has not handed out yet are held by nobody: a save that
    failed before using the pool leaves it idle at once (CI caught idle() False there)."""
    from ckptio.io.stage import StagingPool

    pool = StagingPool(64, 1 << 20, background=True)
    try:
        assert pool.idle()
        held = pool.acquire()
        assert not pool.idle()
        pool.release(held)
        assert pool.idle()
        pool.faulted()
        assert pool.idle()
    finally:
        pool.close()


def test_a_small_state_gets_a_pool_of_its_size_and_a_larger_one_the_full_pool(
        tmp_path: os.PathLike[str], assert_same) -> None:
    """Issue 29: a save or load of a state smaller than pool_bytes stages through a pool of
    the state's size (whole buffers, two at least), not pool_bytes of pre-faulted memory;
    a larger state later gets the full pool_bytes (a synchronous save never more)."""
    options = Options(buffer_bytes=MiB, pool_bytes=16 * MiB, io_depth=2, use_profile=False)
    small = _state(3 * MiB)
    ck = Checkpointer(options)
    ck.save(small, tmp_path / "small")
    assert 2 * MiB <= ck.staging_nbytes <= 4 * MiB  # 3 MiB of tensors, in whole buffers
    ck.close()
    reader = Checkpointer(options)
    loaded = reader.load(tmp_path / "small")
    assert 2 * MiB <= reader.staging_nbytes <= 4 * MiB
    assert_same(loaded, small)
    large = _state(24 * MiB, seed=1)
    reader.save(large, tmp_path / "large")
    assert reader.staging_nbytes == 16 * MiB
    reader.save(small, tmp_path / "small2")  # a smaller use keeps the pool it finds
    assert reader.staging_nbytes == 16 * MiB
    assert_same(reader.load(tmp_path / "large"), large)
    reader.close()


def test_populate_faults_the_pages_in() -> None:
    """The background pre-fault's madvise(MADV_POPULATE_WRITE) (or its memset fallback) makes
    every page resident: the process's RSS grows by the mapping's size."""
    import mmap

    from ckptio.io.stage import _populate

    def rss() -> int:
        with open("/proc/self/status", encoding="ascii") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

    mapping = mmap.mmap(-1, 64 * MiB)
    address = torch.frombuffer(mapping, dtype=torch.uint8).data_ptr()
    before = rss()
    _populate(address, 64 * MiB)
    assert rss() - before >= 60 * MiB


def test_a_synchronous_save_writes_while_it_still_copies(
        tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch, assert_same) -> None:
    """Issue 29: a synchronous save's writes start with its first full buffer, not once the
    whole state is copied (an async save's caller waits only for the copy, a synchronous one's
    for the writes too): held at the end of its capture, it has written already."""
    from ckptio.saving import capture_window

    state = _state(8 * MiB)
    ck = Checkpointer(Options(buffer_bytes=MiB, pool_bytes=16 * MiB, use_profile=False))
    faulty = inject(ck)
    writes_before_the_end = []
    close = capture_window.Window.close

    def held_close(window: capture_window.Window, file_nbytes: int) -> None:
        if window.file == 0 and not writes_before_the_end:
            deadline = time.monotonic() + 5
            while faulty.calls["write"] == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            writes_before_the_end.append(faulty.calls["write"])
        close(window, file_nbytes)

    monkeypatch.setattr(capture_window.Window, "close", held_close)
    ck.save(state, tmp_path / "sync")
    assert writes_before_the_end[0] >= 1
    assert_same(ckptio.load(tmp_path / "sync"), state)
    ck.close()


def test_a_load_makes_its_pool_before_it_plans_its_reads(tmp_path: os.PathLike[str],
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          assert_same) -> None:
    """Issue 29 round three: a one-rank load makes its staging pool (sized to the stored bytes
    of the keys it asks for) as soon as the manifest is open, so the pool's background
    pre-fault overlaps the planning; the reads then use that pool, made once. Not a load
    larger than the buffers it keeps in flight (2 x io_depth): it pins each buffer it cycles
    through at its first read, no pre-fault (issue 51)."""
    from ckptio.io import stage
    from ckptio.loading import load_session

    options = Options(buffer_bytes=MiB, pool_bytes=16 * MiB, io_depth=4, use_profile=False)
    state = _state(6 * MiB)
    ckptio.save(state, tmp_path / "c", options=options)
    made: list[int] = []
    real_pool = stage.StagingPool.__init__

    def pool_init(self, nbuffers, *args, **kwargs):  # type: ignore[no-untyped-def]
        made.append(nbuffers)
        real_pool(self, nbuffers, *args, **kwargs)

    at_planning: list[list[int]] = []
    real_fill = load_session.fill_in_place

    def fill(*args, **kwargs):  # type: ignore[no-untyped-def]
        at_planning.append(list(made))
        return real_fill(*args, **kwargs)

    monkeypatch.setattr(stage.StagingPool, "__init__", pool_init)
    monkeypatch.setattr(load_session, "fill_in_place", fill)
    reader = Checkpointer(options)
    dest = {"w": {k: torch.zeros_like(v) for k, v in state["w"].items()},
            "small": torch.zeros(7), "step": 0}
    reader.load(tmp_path / "c", dest)
    assert_same(dest, state)
    assert len(made) == 1 and 6 <= made[0] <= 7  # 6 MiB of tensors: made once
    assert at_planning == [made]  # before the load planned its reads
    made.clear()
    at_planning.clear()
    other = Checkpointer(options)
    part = {"w": {"t0": torch.zeros_like(state["w"]["t0"])}}
    other.load(tmp_path / "c", part, keys="w.t0")  # only the keys asked for: 1.5 MiB
    assert torch.equal(part["w"]["t0"], state["w"]["t0"])
    assert at_planning == [[2]] and made == [2]
    made.clear()
    at_planning.clear()
    larger = Checkpointer(dataclasses.replace(options, io_depth=2))  # 6 MiB > 2 x 2 buffers
    larger.load(tmp_path / "c", dest)
    assert_same(dest, state)
    assert at_planning == [[]] and len(made) == 1  # made by the reads, after the planning
    reader.close()
    other.close()
    larger.close()
