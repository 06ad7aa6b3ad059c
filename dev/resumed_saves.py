"""Probe: the save calls of a resumed job, and of a job that called prepare(state=), against
their later calls (docs/BENCH_LOOP.md, "A resumed job's first saves"). The state: a stack of
500 Linear(64, 64) layers (1,000 parameters) and its AdamW, passed as the objects (a module and
an optimizer, as the guides write it). ``save`` writes step 1 into a ``shm://`` tier (under
/dev/shm/rsprobe, and a copy beside it); ``run`` is one fresh process of a resumed job (step 1
put back as saved): ``restore()``, then
SAVES asynchronous saves, each after a training step (its wait outside the clock); ``prepared``
is one fresh process that calls ``Checkpointer.prepare(path, state=)`` after its first step and
then makes SAVES ``async_save`` calls the same way. Prints one line: the calls in ms.

    python dev/resumed_saves.py save
    python dev/resumed_saves.py run          # the resumed job: restore, then the saves
    python dev/resumed_saves.py prepared     # prepare(state=), then the saves
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as `python dev/NAME.py` from the checkout: its ckptio/ first.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gc
import os
import shutil
import time

import torch

import ckptio

os.environ["CKPTIO_SHM_DIR"] = "/dev/shm/rsprobe"
SAVES = 5
RUN, PRISTINE = Path("/dev/shm/rsprobe/run"), Path("/dev/shm/rsprobe/pristine")


def _build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(500)])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    opt.zero_grad()


def _timed(save: object, model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[float]:
    calls = []
    for step in range(2, 2 + SAVES):
        _step(model, opt)
        started = time.perf_counter()
        handle = save(step)  # type: ignore[operator]
        calls.append((time.perf_counter() - started) * 1e3)
        handle.wait()
    return calls


def main() -> None:
    model, opt = _build()
    state = {"model": model, "optim": opt}
    tiers = [ckptio.Tier("shm://run", keep_last=2)]
    if sys.argv[1:] == ["save"]:
        shutil.rmtree("/dev/shm/rsprobe", ignore_errors=True)
        _step(model, opt)
        with ckptio.CheckpointManager(tiers=tiers) as mgr:
            mgr.save(1, state)
        shutil.copytree(RUN / "step-1", PRISTINE)
        return
    gc.collect()
    gc.freeze()
    if sys.argv[1:] == ["run"]:
        shutil.rmtree(RUN)  # step 1 as saved (the last run's retention removed it)
        shutil.copytree(PRISTINE, RUN / "step-1")
        with ckptio.CheckpointManager(tiers=tiers) as mgr:
            assert mgr.restore(state) == 1
            calls = _timed(lambda s: mgr.save(s, state, asynchronous=True, force=True),
                           model, opt)
            mgr.wait()
    else:
        target = Path("/dev/shm/rsprobe/prepared")
        shutil.rmtree(target, ignore_errors=True)
        _step(model, opt)
        with ckptio.Checkpointer() as ck:
            ck.prepare(target, state=state)
            calls = _timed(lambda s: ck.async_save(state, target / f"s{s}"), model, opt)
        shutil.rmtree(target, ignore_errors=True)
    print(" ".join(f"{c:.1f}" for c in calls))


if __name__ == "__main__":
    main()
