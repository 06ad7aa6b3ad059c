"""The staging a TorchTitan resume leaves (issue 64): ``CkptioCheckpointManager.load()`` of a
job whose saves are synchronous (async_mode "disabled") prepares no staging for later saves
(Checkpointer.prepare is not called: its load reads through a pool of its own size); an async
job's load prepares the staging of its first save behind the load, sized to the state (two
buffers for this small one), never Options.pool_bytes. Counted by the pools made and the
prepare calls (load-independent); one process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torchtitan.components.checkpointer.base")
from ckptio import api, resources
from ckptio.io.stage import StagingPool
from test_torchtitan import Job

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="a page-locked (CUDA) pool faults in at once")


@pytest.mark.parametrize("mode", ["disabled", "async", "async_with_pinned_mem"])
def test_resume_prepares_staging_only_for_async_saves_and_of_the_states_size(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    job = Job(tmp_path, async_mode=mode)
    job.step()
    job.step()  # saves step 2
    job.checkpointer.close()
    made: list[tuple[int, int, bool]] = []  # (nbuffers, buffer_bytes, pre-faulted)

    class Recorded(StagingPool):
        def __init__(self, nbuffers: int, buffer_bytes: int, **kw: Any) -> None:
            made.append((nbuffers, buffer_bytes, kw.get("prefault", True)))
            super().__init__(nbuffers, buffer_bytes, **kw)

    monkeypatch.setattr(resources, "StagingPool", Recorded)
    prepared: list[bool] = []
    prepare = api.Checkpointer.prepare

    def counted(self: api.Checkpointer, *args: Any, **kw: Any) -> Any:
        prepared.append(kw.get("state") is not None)
        return prepare(self, *args, **kw)

    monkeypatch.setattr(api.Checkpointer, "prepare", counted)
    resumed = Job(tmp_path, async_mode=mode)
    assert resumed.checkpointer.load()
    assert resumed.state.step == 2
    if mode == "disabled":  # before: restore() prepared the staging of async saves
        assert prepared == [], prepared
    else:
        assert True in prepared, prepared
    # before: a pool of Options.pool_bytes (16 buffers) for a state of a few KiB
    assert made and all(n == 2 for n, _b, _p in made), made
    resumed.step()
    resumed.step()  # saves step 4 through the pool it found
    resumed.checkpointer.close()
