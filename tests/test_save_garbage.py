"""A finished save leaves no cyclic garbage: its job (hashers, views of the state, buffers'
bookkeeping) is freed when the last reference goes, not by the garbage collector, whose
generation-2 walks of a training process's objects land in some later save call as a stall
(docs/BENCH_LOOP.md, "the per-call Python"). The hand-over kept the job alive from the handle's
cycle with its control before."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

import ckptio


# Not this test's: a local save by a plain Checkpointer touches no object store and no
# redundancy, whose objects here are another test's background threads' (a worker process runs
# many files: an unclosed manager's lease renewing through a failing network, in CI once)
_ELSEWHERE = ("ckptio.storage.s3", "ckptio.storage.gcs", "ckptio.storage.azure",
              "ckptio.redundancy")


def _ckptio_garbage() -> list[str]:
    """Names of the ckptio objects the collector finds unreachable now (module.qualname)."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        return sorted({f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage
                       if type(o).__module__.startswith("ckptio")
                       and not type(o).__module__.startswith(_ELSEWHERE)})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


@pytest.mark.parametrize("lazy", [False, True])
def test_a_finished_async_save_leaves_no_cyclic_garbage(tmp_path: Path, lazy: bool) -> None:
    model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(20)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    state = {"model": model, "optim": opt}
    ck = ckptio.Checkpointer()
    try:
        ck.async_save(state, tmp_path / "warm", lazy=lazy, optimizers=[opt] if lazy else ()).wait()
        gc.collect()  # whatever came before is not this test's
        for i in range(3):  # the first ones' objects are no longer the Checkpointer's after
            handle = ck.async_save(state, tmp_path / f"s{i}", lazy=lazy,
                                   optimizers=[opt] if lazy else ())
            if lazy:
                opt.step()
            handle.wait()
            del handle
        assert _ckptio_garbage() == []
        ck.save(state, tmp_path / "sync")
        assert _ckptio_garbage() == []
    finally:
        ck.close()


def test_a_closed_checkpointer_leaves_no_cyclic_garbage(tmp_path: Path) -> None:
    """close() joins its threads; each thread's Worker and its owner (a Calls: the owner holds
    the worker, the worker its owner's queue) were left to the collector as a cycle, found in
    some later save call's generation-2 walk (the CI failure of this file's test above, another
    test's Checkpointer closed meanwhile). Now freed when the last reference goes."""
    ck = ckptio.Checkpointer()
    ck.async_save({"w": torch.ones(1000)}, tmp_path / "a").wait()
    ck.save({"w": torch.ones(1000)}, tmp_path / "b")
    gc.collect()
    ck.close()
    del ck
    assert _ckptio_garbage() == []
