"""Red-team review of the distributed load path (read once across ranks, the plugins' arrival
checks and lease steps), with real gloo ranks: what a long job's store holds after many loads,
and the wire group of a load over some ranks only."""

from __future__ import annotations

import dataclasses
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptio
from ckptio.testing.rank_processes import run_ranks

DEADLINE_S = 3.0  # Options.rank_timeout_s of these loads
LOADS = 5


def _options() -> ckptio.Options:
    return dataclasses.replace(ckptio.Options(buffer_bytes=1 << 20, pool_bytes=4 << 20),
                               rank_timeout_s=DEADLINE_S, step_timeout_s=120.0)


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    return {"big": torch.randn(256, 1024, generator=g),
            "norm": {f"n{i}": torch.randn(33 + i, generator=g) for i in range(6)}, "step": 3}


def _keys_now() -> int:
    """The job's store's keys, once every rank is past the same point."""
    from torch.distributed import distributed_c10d as c10d

    torch.distributed.barrier()
    count = int(c10d._get_default_store().num_keys())
    torch.distributed.barrier()  # read on every rank before rank 0, which holds it, may exit
    return count


def _lightning_loads(rank: int, world: int, path: str) -> list[int]:
    """Rank 0 saves last.ckpt (as Lightning's plugin does), then every rank loads it LOADS
    times (a shared load, after the arrival check) -> the store's keys after each load."""
    from ckptio.lightning import CheckpointIO

    io = CheckpointIO(_options())
    if rank == 0:
        io.save_checkpoint(_state(), path)
    torch.distributed.barrier()
    counts = []
    for _ in range(LOADS):
        got = io.load_checkpoint(path)
        assert torch.equal(got["big"], _state()["big"])
        counts.append(_keys_now())
    io.teardown()
    return counts


def test_lightning_loads_leave_no_keys_in_the_jobs_store(tmp_path: Path) -> None:
    """Each shared load_checkpoint checks the ranks' arrival (a round in the store); a job that
    loads often (validate/test with ckpt_path, Fabric.load) kept every round's keys (before:
    four more keys per load on two ranks, without end)."""
    pytest.importorskip("lightning", reason="lightning is not installed")
    (tmp_path / "run").mkdir()
    got = run_ranks(2, _lightning_loads, str(tmp_path / "run" / "last.ckpt"))
    for counts in got:
        assert max(counts[1:]) - min(counts[1:]) <= 2, got  # a step's own key or two in flight


def _deepspeed_loads(rank: int, world: int, root: str) -> list[int]:
    """A ZeRO 1 engine with ckptio's checkpoint engine saves, then loads LOADS times -> the
    store's keys after each load."""
    sys.path.insert(0, os.path.dirname(__file__))
    import deepspeed_cases as cases

    import ckptio.deepspeed_engine

    engine = cases.engine_for(1, world)
    ckptio.deepspeed_engine.use(engine, allow_pickle=True, options=_options())
    cases.train(engine, 2)
    engine.save_checkpoint(root)
    counts = []
    for _ in range(LOADS):
        engine.load_checkpoint(root)
        counts.append(_keys_now())
    engine.destroy()
    return counts


def test_deepspeed_loads_leave_no_keys_in_the_jobs_store(tmp_path: Path) -> None:
    """Each load_checkpoint checks the ranks' arrival twice (the tag check, the shared model
    file) and the tag check broadcast over ranks made anew at each load (before: nine more keys
    per load on two ranks; now the ranks of the job are kept, as Megatron's lease step's)."""
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (its extra has it)")
    got = run_ranks(2, _deepspeed_loads, str(tmp_path / "ds"), timeout_s=240)
    for counts in got:
        assert max(counts[1:]) - min(counts[1:]) <= 2, got


def _pair_then_world(rank: int, world: int, path: str) -> dict[str, Any]:
    """Ranks 0 and 1 load ``path`` over a group of the two (made on every rank, as torch asks),
    then every rank loads it over the world -> the world load's warnings and seconds, whether
    it is the saved state, and the torch groups the loads registered in this process."""
    from torch.distributed import distributed_c10d as c10d

    pair = torch.distributed.new_group([0, 1])
    held = len(c10d._world.pg_names)
    if rank in (0, 1):
        ckptio.load(path, options=_options(), process_group=pair)
    started = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = ckptio.load(path, options=_options(), process_group=torch.distributed.group.WORLD)
    return {"seconds": time.monotonic() - started, "warnings": [str(w.message) for w in caught],
            "equal": torch.equal(got["big"], _state()["big"]),
            "groups_made": len(c10d._world.pg_names) - held}


def test_a_load_over_some_ranks_makes_no_torch_group_there(tmp_path: Path) -> None:
    """A shared load over ranks 0 and 1 of three made its wire group a torch group of those two
    only: torch names a group by how many each process holds, so the world load's wire group
    after it was named unlike on rank 2 (and so would the program's own groups be): each rank
    waited Options.rank_timeout_s and read from storage what it was to receive, warned. Now the
    wire group is kept out of torch's registry (distributed/wiregroup.py)."""
    path = str(tmp_path / "ck")
    ckptio.save(_state(), path, options=_options())
    got = run_ranks(3, _pair_then_world, path, timeout_s=120)
    assert all(g["equal"] and not g["warnings"] for g in got), got
    assert all(g["seconds"] < DEADLINE_S for g in got), got
    assert all(g["groups_made"] == 0 for g in got), got


def _load_once_rank_0_is_gone(rank: int, world: int, path: str) -> tuple[str, str] | None:
    """Rank 0 (which holds the job's store) saves last.ckpt and exits; rank 1 then loads it
    -> the error's class and message."""
    from ckptio.lightning import CheckpointIO

    io = CheckpointIO(_options())
    if rank == 0:
        io.save_checkpoint(_state(), path)
    torch.distributed.barrier()
    if rank == 0:
        os._exit(0)
    time.sleep(1.0)
    try:
        io.load_checkpoint(path)
    except ckptio.CkptError as exc:
        return type(exc).__name__, str(exc)
    except Exception as exc:  # noqa: BLE001 - a red-team probe reports any escape
        return "NOT-CkptError " + type(exc).__name__, str(exc)
    return None


def test_a_load_whose_store_is_gone_raises_a_ckpt_error(tmp_path: Path) -> None:
    """The arrival check's store calls failed with torch's DistNetworkError escaping
    load_checkpoint (a save or load's own steps raise RankFailedError naming rank 0)."""
    pytest.importorskip("lightning", reason="lightning is not installed")
    (tmp_path / "run").mkdir()
    got = run_ranks(2, _load_once_rank_0_is_gone, str(tmp_path / "run" / "last.ckpt"),
                    may_die=(0,), destroy=False, timeout_s=120)[1]
    assert got is not None and got[0] == "RankFailedError", got
    assert "rank 0" in got[1] and "store" in got[1], got


def _damaged_on_the_wire(rank: int, world: int, path: str) -> tuple[str, str] | None:
    """Ranks 1 and 2 load ``path`` over a group of the two, every message they send damaged
    (its first byte flipped) -> the error's class and message (None on rank 0)."""
    from tests.reshard_once_cases import damage_every_send

    damage_every_send()
    pair = torch.distributed.new_group([1, 2])
    said = None
    if rank != 0:
        try:
            ckptio.load(path, options=_options(), process_group=pair)
        except ckptio.CkptError as exc:
            said = type(exc).__name__, str(exc)
    torch.distributed.barrier()
    return said


def test_a_damaged_send_over_a_group_of_some_ranks_names_the_sender_by_its_global_rank(
        tmp_path: Path) -> None:
    """Over the group of global ranks 1 and 2, the receiver's error said 'as received from
    rank 0' (the sender's rank in the group: global rank 0 is no member) and the other's
    'failed on rank 1' (global rank 2): each now adds the global rank."""
    path = str(tmp_path / "ck")
    ckptio.save(_state(), path, options=_options())
    got = run_ranks(3, _damaged_on_the_wire, path, timeout_s=120)
    kinds = sorted(g[0] for g in got[1:] if g is not None)
    assert kinds == ["CorruptCheckpointError", "RankFailedError"], got
    receiver = next(r for r in (1, 2) if got[r] is not None and got[r][0] != "RankFailedError")
    sender = 3 - receiver
    assert f"received from rank {sender - 1} (global rank {sender})" in got[receiver][1], got
    assert f"failed on rank {receiver - 1} (global rank {receiver})" in got[sender][1], got


def _save_into_a_broken_lease(rank: int, world: int, save_dir: str) -> tuple[str, str, float]:
    """A ZeRO 1 engine saves into ``save_dir``, where a directory stands at the run lease's
    path -> the error's class and message on this rank, and the seconds it took."""
    sys.path.insert(0, os.path.dirname(__file__))
    import deepspeed_cases as cases

    import ckptio.deepspeed_engine

    engine = cases.engine_for(1, world)
    ckptio.deepspeed_engine.use(engine, options=dataclasses.replace(_options(),
                                                                    step_timeout_s=10.0))
    started = time.monotonic()
    said = ("none", "")
    try:
        engine.save_checkpoint(save_dir)
    except ckptio.CkptError as exc:
        said = (type(exc).__name__, str(exc))
    took = time.monotonic() - started
    torch.distributed.barrier()
    engine.destroy()
    return said[0], said[1], took


def test_a_lease_that_cannot_be_opened_is_raised_on_every_rank_at_once(tmp_path: Path) -> None:
    """Rank 0 could not open the run lease of save_dir (a directory stands at its path): it
    raised StorageIOError while rank 1 waited for rank 0's word for 2 x step_timeout_s, then
    raised RankFailedError calling rank 0 stuck. Now every rank raises the error at once."""
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (its extra has it)")
    from ckptio.storage.local.runlease import LEASE_NAME

    (tmp_path / "ds" / LEASE_NAME).mkdir(parents=True)
    got = run_ranks(2, _save_into_a_broken_lease, str(tmp_path / "ds"), timeout_s=120)
    assert [g[0] for g in got] == ["StorageIOError"] * 2, got
    assert all(LEASE_NAME in g[1] and g[2] < 10.0 for g in got), got
