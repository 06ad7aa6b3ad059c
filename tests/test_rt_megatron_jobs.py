"""Two Megatron training jobs started on one ``--save`` directory, with ckptio's save strategy:
Megatron's training loop saves each iteration into ``<save>/iter_NNNNNNN`` and writes
``latest_checkpointed_iteration.txt`` after it, so two jobs there interleave their iterations
and the tracker names either job's. The strategy takes ``<save>``'s run lease at a job's first
save there (rank 0 holds it; megatron_common.leased): the second job's save is refused on every
rank, naming the first job, before any rank writes; ``take_over=True`` goes on; a save into a
directory of another name (a program's own) is not leased.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core.dist_checkpointing",
                    reason="megatron-core is not installed (the test extra has it)")
from megatron.core import dist_checkpointing as mdc  # noqa: E402
from megatron.core.dist_checkpointing.mapping import ShardedTensor  # noqa: E402

import ckptio  # noqa: E402
from ckptio.megatron_strategy import CkptioLoadShardedStrategy, CkptioSaveShardedStrategy  # noqa: E402
from ckptio.testing.rank_processes import run_ranks  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

_FIRST_JOB = """
import sys, time, torch
from pathlib import Path
from megatron.core import dist_checkpointing as mdc
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from ckptio.megatron_strategy import CkptioSaveShardedStrategy

save, flag = sys.argv[1], Path(sys.argv[2])
torch.distributed.init_process_group("gloo", init_method=f"file://{save}.pg", rank=0,
                                     world_size=1)
def state(v):
    return {"a": ShardedTensor.from_rank_offsets("A", torch.arange(4.0) + v)}
for it in (1, 2):
    where = Path(save) / f"iter_{it:07d}"
    where.mkdir(parents=True)
    mdc.save(state(it), str(where), sharded_strategy=CkptioSaveShardedStrategy())
    print("SAVED", it, flush=True)
    deadline = time.monotonic() + 120
    while it == 1 and not flag.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
torch.distributed.destroy_process_group()
print("DONE", flush=True)
"""


def _state(rank: int, v: float) -> dict[str, Any]:
    return {"a": ShardedTensor.from_rank_offsets("A", torch.arange(2.0) + 2 * rank + v,
                                                 (0, rank, 2))}


def _second_job(rank: int, world: int, save: str, take_over: bool) -> dict[str, Any]:
    """Both ranks save iteration 3 elsewhere taking over, iteration 5 into ``save``, then a
    directory of the program's own beside it -> the error each rank met (or None), ckptio's
    warnings, and whether the own save went through."""
    said: list[str] = []
    heard = logging.Handler(logging.WARNING)
    heard.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("ckptio").addHandler(heard)
    where = Path(save) / "iter_0000005"
    # a save of this job elsewhere with take_over=True first: it takes that directory only
    elsewhere = Path(save).parent / "other" / "iter_0000003"
    if rank == 0:
        where.mkdir(parents=True, exist_ok=True)
        elsewhere.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    mdc.save(_state(rank, 3.0), str(elsewhere),
             sharded_strategy=CkptioSaveShardedStrategy(take_over=True))
    out: dict[str, Any] = {}
    try:
        mdc.save(_state(rank, 5.0), str(where),
                 sharded_strategy=CkptioSaveShardedStrategy(take_over=take_over))
        out["error"] = None
    except ckptio.CkptError as exc:
        out["error"] = (type(exc).__name__, str(exc))
    own = Path(save).parent / "own"  # not an iteration: not leased
    if rank == 0:
        own.mkdir(exist_ok=True)
    torch.distributed.barrier()
    mdc.save(_state(rank, 7.0), str(own), sharded_strategy=CkptioSaveShardedStrategy())
    got = mdc.load(_state(rank, 0.0), str(own), sharded_strategy=CkptioLoadShardedStrategy())
    out["own"] = torch.equal(got["a"], torch.arange(2.0) + 2 * rank + 7.0)
    out["warned"] = said
    return out


def _saved_first(first: subprocess.Popen[str], save: Path) -> None:
    """Once the first job has saved its iteration 1 (it then waits for the test's flag)."""
    deadline = time.monotonic() + 120
    while not (save / "iter_0000001" / "metadata.json").exists():
        assert first.poll() is None and time.monotonic() < deadline, first.poll()
        time.sleep(0.05)


def test_a_second_megatron_job_on_one_save_dir_is_refused_on_every_rank(tmp_path: Path) -> None:
    save, flag = tmp_path / "run", tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    first = subprocess.Popen([sys.executable, "-c", _FIRST_JOB, str(save), str(flag)],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        _saved_first(first, save)
        got = run_ranks(2, _second_job, str(save), False, timeout_s=240)
        for rank, g in enumerate(got):
            kind, said = g["error"]
            assert kind == "CheckpointLockedError" and f"pid {first.pid}" in said, (rank, said)
            assert "this Megatron job did not save iteration iter_0000005" in said, said
            assert "CkptioSaveShardedStrategy(take_over=True)" in said, said
            assert g["own"], g
        # no rank wrote a file there (Megatron before 0.19 writes common.pt itself, first)
        assert set(os.listdir(save / "iter_0000005")) <= {"common.pt"}
    finally:
        flag.touch()
        out, _ = first.communicate(timeout=120)
    assert first.returncode == 0 and "SAVED 2" in out and "DONE" in out, out
    got = run_ranks(2, _second_job, str(save), False, timeout_s=240)  # the first job ended
    assert [g["error"] for g in got] == [None, None], got
    # a job's lease goes with its processes (the file too, where the interpreter exits
    # normally; run_ranks' processes skip atexit): the next job saves there
    assert [g["error"] for g in run_ranks(2, _second_job, str(save), False)] == [None, None]
    left = sorted(set(os.listdir(save)) - {".ckptio-run.lease"})
    assert left == ["iter_0000001", "iter_0000002", "iter_0000005"], left


def test_a_megatron_job_taking_the_save_dir_over_saves_warned(tmp_path: Path) -> None:
    save, flag = tmp_path / "run", tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    first = subprocess.Popen([sys.executable, "-c", _FIRST_JOB, str(save), str(flag)],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        _saved_first(first, save)
        got = run_ranks(2, _second_job, str(save), True, timeout_s=240)
        assert [g["error"] for g in got] == [None, None], got
        # the taker (rank 0 holds the lease) is told whose directory it took
        taking = [w for w in got[0]["warned"] if "taking over the run directory" in w]
        assert len(taking) == 1 and f"pid {first.pid}" in taking[0], got[0]["warned"]
        assert not any("taking over" in w for w in got[1]["warned"]), got[1]["warned"]
    finally:
        flag.touch()
        out, err = first.communicate(timeout=120)
    # the first job's next save is refused, naming the job that took over
    assert first.returncode != 0 and "SAVED 2" not in out, out
    assert "was taken over by another job" in err, err[-2000:]
