"""The staging a restore leaves (issue 64, the resume's host memory): a restore or prepare(state=)
of a state smaller than Options.pool_bytes sizes the pool to that state's files (whole
buffers), not to pool_bytes, and the first async save after it still never streams; the
pinning after a restored step keeps that size; ``restore(prepare=False)`` (a job whose saves
are synchronous) prepares nothing: the load reads through a pool of its own size that no
thread pre-faults. Counted by the pool's size and by the pools made (load-independent).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import ckptio
from ckptio import Checkpointer, CheckpointManager, Options
from ckptio import resources
from ckptio.io.stage import StagingPool
from ckptio.testing.faults import inject
from tests.pool_states import MiB, STATE_NBYTES, pool_state as _state

OPTIONS = {"buffer_bytes": MiB, "pool_bytes": 32 * MiB, "io_depth": 2, "use_profile": False,
           "host_budget_bytes": 64 * MiB}
SLACK = 2 * MiB  # each planned file rounds up to whole buffers (a data file and a small one)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="a page-locked (CUDA) pool faults in at once")


class Made:
    """Records every StagingPool the resources make: (nbytes, pre-faulted)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.pools: list[tuple[int, bool]] = []
        made = self

        class Recorded(StagingPool):
            def __init__(self, nbuffers: int, buffer_bytes: int, **kw: Any) -> None:
                made.pools.append((nbuffers * buffer_bytes, kw.get("prefault", True)))
                super().__init__(nbuffers, buffer_bytes, **kw)

        monkeypatch.setattr(resources, "StagingPool", Recorded)


def _first_async_save_did_not_stream(ck: Checkpointer, mgr: CheckpointManager, step: int,
                                     state: Any) -> None:
    faulty = inject(ck, delay_s=0.5)
    handle = mgr.save(step, state, asynchronous=True)
    assert handle.progress().nbytes_written == 0, "the capture streamed through the pool"
    handle.wait()
    assert faulty.calls["write"] >= 8


@pytest.mark.parametrize("saved", [False, True], ids=["nothing-saved", "a-step-restored"])
def test_restore_sizes_the_pool_to_the_state_not_pool_bytes(
        tmp_path: os.PathLike[str], saved: bool, assert_same) -> None:
    state = _state()
    if saved:
        with CheckpointManager(tmp_path / "ckpts") as first:
            first.save(5, state)
    ck = Checkpointer(Options(**OPTIONS))
    mgr = CheckpointManager(tmp_path / "ckpts", checkpointer=ck)
    dest = _state(seed=1)
    assert mgr.restore(dest) == (5 if saved else None)
    ck.resources().pool.faulted()
    # before: Options.pool_bytes (32 MiB) for an 8 MiB state
    assert STATE_NBYTES <= ck.staging_nbytes <= STATE_NBYTES + SLACK, ck.staging_nbytes
    _first_async_save_did_not_stream(ck, mgr, 6, state)
    assert ck.staging_nbytes <= STATE_NBYTES + SLACK
    assert_same(ckptio.load(mgr.path(6)), state)
    mgr.close()
    ck.close()


def test_checkpointer_prepare_with_a_state_sizes_the_pool_to_it(
        tmp_path: os.PathLike[str]) -> None:
    ck = Checkpointer(Options(**OPTIONS))
    ck.prepare(tmp_path, state=_state(), wait=True)
    assert STATE_NBYTES <= ck.staging_nbytes <= STATE_NBYTES + SLACK, ck.staging_nbytes
    ck.prepare(tmp_path)  # without a state: the pool made stays as it is
    assert ck.staging_nbytes <= STATE_NBYTES + SLACK
    ck.close()
    ck.prepare(tmp_path)  # nothing made yet: Options.pool_bytes, as before
    assert ck.staging_nbytes == OPTIONS["pool_bytes"]
    ck.close()


def test_restore_without_prepare_faults_no_pool_ahead(
        tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch, assert_same) -> None:
    state = _state()
    ck = Checkpointer(Options(**OPTIONS))
    mgr = CheckpointManager(tmp_path / "ckpts", checkpointer=ck)
    made = Made(monkeypatch)
    assert mgr.restore(_state(seed=1), prepare=False) is None
    assert ck.staging_nbytes == 0 and made.pools == []  # nothing saved: nothing made
    mgr.save(5, state)
    mgr.close()
    ck.close()
    ck = Checkpointer(Options(**OPTIONS))
    mgr = CheckpointManager(tmp_path / "ckpts", checkpointer=ck)
    made.pools.clear()
    dest = _state(seed=1)
    assert mgr.restore(dest, prepare=False) == 5
    assert_same(dest, state)
    # the load's own pool, of the state's size, faulted by its reads only
    assert made.pools and all(not prefault for _n, prefault in made.pools), made.pools
    assert all(n <= STATE_NBYTES + SLACK for n, _p in made.pools), made.pools
    assert not ck.resources().pool.resident
    mgr.save(6, dest)  # a synchronous save reuses it
    assert ck.staging_nbytes <= STATE_NBYTES + SLACK
    mgr.close()
    ck.close()
