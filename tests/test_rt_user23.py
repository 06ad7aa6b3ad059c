"""A user's failure claims of docs/guides/redundancy.md, from outside (a new user's run of the
guide): a peer that freezes during a restore from peers makes every other rank raise
RankFailedError naming it within about peer_timeout_s, as the guide says ("a restore's
transfers from peers ... wait for a peer at most peer_timeout_s").

Real gloo ranks on this machine, one rank per simulated host (``CKPTIO_HOST_ID`` and
``CKPTIO_SHM_DIR`` per rank, as tests/fetch_cases.py), Parity(k=3) on 4 hosts, host 2 lost."""

from __future__ import annotations

import os
import shutil
import signal
import time
from typing import Any

import pytest
import torch

import ckptio
from ckptio import Tier
from ckptio.testing.rank_processes import run_ranks

MiB = 1 << 20
PEER_TIMEOUT_S = 3.0
# the old code's wait: the control group's step_timeout_s (default 30 minutes), shortened so
# that the old code fails the test in a minute rather than hanging it
STEP_TIMEOUT_S = 60.0
OPTS = ckptio.Options(buffer_bytes=MiB, pool_bytes=4 * MiB, peer_timeout_s=PEER_TIMEOUT_S,
                      rank_timeout_s=STEP_TIMEOUT_S, step_timeout_s=STEP_TIMEOUT_S)


def _host(rank: int, base: str) -> None:
    os.environ["CKPTIO_HOST_ID"] = f"host{rank}"
    os.environ["CKPTIO_SHM_DIR"] = os.path.join(base, f"host{rank}")
    os.makedirs(os.environ["CKPTIO_SHM_DIR"], exist_ok=True)


def _tiers(disk: str) -> list[Tier]:
    return [Tier("shm://run", keep_last=2, redundancy=ckptio.Parity(k=3)), Tier(disk, every=100)]


def _state(rank: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(rank)
    return {"w": torch.randn((2 * MiB + rank * 4096) // 4, generator=gen), "step": 1}


def save(rank: int, world: int, base: str, disk: str) -> None:
    _host(rank, base)
    with ckptio.CheckpointManager(tiers=_tiers(disk), options=OPTS) as mgr:
        mgr.save(1, _state(rank))
        mgr.protected()


def restore_one_freezes(rank: int, world: int, base: str, disk: str, victim: int,
                        where: str) -> dict[str, Any]:
    """A fresh job restores; ``victim`` stops itself (SIGSTOP: frozen, not dead, its sockets
    open) as it reads the items it sends (``where="read"``) or as it installs the step it
    received (``"install"``) -> the error and the seconds the restore took."""
    _host(rank, base)
    if rank == victim:
        from ckptio.redundancy import rebuild

        def freezes(*args: Any, **kwargs: Any) -> Any:
            os.kill(os.getpid(), signal.SIGSTOP)

        setattr(rebuild, {"read": "_read_item", "install": "_install"}[where], freezes)
    state = {"w": torch.zeros_like(_state(rank)["w"]), "step": 0}
    out: dict[str, Any] = {"error": None}
    started = time.monotonic()
    try:
        with ckptio.CheckpointManager(tiers=_tiers(disk), options=OPTS) as mgr:
            out["step"] = mgr.restore(state)
    except ckptio.errors.CkptError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["seconds"] = time.monotonic() - started
    return out


@pytest.fixture
def base() -> Any:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    root = os.path.join("/dev/shm", f"ckptio-rt-user23-{os.getpid()}-{time.monotonic_ns()}")
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize(("where", "victim"), [("read", 1), ("install", 2)])
def test_a_peer_frozen_during_a_restore_from_peers_is_named_within_peer_timeout_s(
        base: str, tmp_path: Any, where: str, victim: int) -> None:
    """Before: the gathers between the restore's transfers (the items' metadata, each rank's
    outcome) went over the control group, whose timeout is step_timeout_s (30 minutes by
    default): with a peer frozen while it read the items it sends (rank 1, a member of the
    lost rank's parity group), or while it installed the step it received (rank 2, the lost
    one), every other rank waited that long. Now they go over the peer_timeout_s group with the transfers:
    each raises RankFailedError naming the frozen rank within seconds."""
    disk = str(tmp_path / "disk")
    run_ranks(4, save, base, disk, timeout_s=120)
    shutil.rmtree(os.path.join(base, "host2"))  # host 2 lost: rebuilt from parity
    got = run_ranks(4, restore_one_freezes, base, disk, victim, where, may_die=(victim,),
                    timeout_s=180)
    for rank in sorted({0, 1, 2, 3} - {victim}):
        error = got[rank]["error"]
        assert error and error.startswith("RankFailedError"), (rank, got[rank])
        assert f"rank {victim} on host {victim}" in error, error
        assert got[rank]["seconds"] < STEP_TIMEOUT_S / 3, got[rank]
