"""Rank functions of tests/test_redundancy_regrow.py (importable by name: ranks are forked from
a clean forkserver): one rank per simulated host (tests/redundancy_cases.py's hosts), a state
of one float32 tensor Shard(0) over every rank (an FSDP2 job's layout) large enough that its
shards span several checksum blocks, saved and protected each step, then restored by a job of
another number of ranks."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch

import ckptio
from tests.redundancy_cases import OPTS, _play_host, _tiers, restore_then_meet

ROWS, COLS = 480, 4096  # 7.5 MiB: 4 ranks hold 120 rows each (2 blocks), 3 ranks 160
ROW_NBYTES = COLS * 4


def whole(step: int) -> torch.Tensor:
    """The job's whole tensor after ``step`` steps (alike on every rank)."""
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(0)) + step


def _state(world: int, rank: int, step: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    local = whole(step).chunk(world)[rank].clone()
    return {"w": DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                    shape=torch.Size((ROWS, COLS)), stride=(COLS, 1)),
            "step": step}


def train(rank: int, world: int, base: str, disk: str, spec: str, steps: int,
          per_host: int = 1) -> None:
    """``steps`` steps, each saved and protected (the disk tier takes every second);
    ``per_host`` consecutive ranks play each host."""
    _play_host(rank, per_host, base)
    mgr = ckptio.CheckpointManager(tiers=_tiers(spec, disk), options=OPTS)
    for step in range(1, steps + 1):
        mgr.save(step, _state(world, rank, step))
        mgr.protected()
    mgr.close()


def restore(rank: int, world: int, base: str, disk: str, spec: str,
            victim: int = -1, per_host: int = 1) -> dict[str, Any]:
    """A restarted job restores into zeros -> the step, ``last_restore``, whether bitwise, or
    the error (and whether the state was left untouched), and the bytes this rank wrote as
    checkpoints into its memory tier (peers.write_checkpoint) during the restore.
    ``victim``: that rank SIGKILLs itself as it starts sending its pieces' bytes."""
    _play_host(rank, per_host, base)
    if rank == victim:
        from ckptio.redundancy import peers

        def dies(*args: Any, **kwargs: Any) -> Any:
            os.kill(os.getpid(), signal.SIGKILL)

        peers.send = dies  # type: ignore[assignment]
    from ckptio.redundancy import peers

    written, write = [0], peers.write_checkpoint

    def counted(store: Any, manifest: bytes, files: Any, data: Any, **kwargs: Any) -> None:
        written[0] += 0 if kwargs.get("placed") else data.numel()  # placed: already there
        write(store, manifest, files, data, **kwargs)

    peers.write_checkpoint = counted  # type: ignore[assignment]
    state = _state(world, rank, 0)
    state["w"].to_local().zero_()
    mgr = ckptio.CheckpointManager(tiers=_tiers(spec, disk), options=OPTS)
    started = time.monotonic()
    try:
        step = mgr.restore(state)
    except ckptio.errors.CkptError as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - started,
                "untouched": not state["w"].to_local().any().item() and state["step"] == 0}
    finally:
        mgr.close()
    want = whole(step or 0).chunk(world)[rank]
    return {"step": step, "state_step": state["step"], "how": mgr.last_restore, "error": None,
            "bitwise": torch.equal(state["w"].to_local(), want), "written": written[0]}


def restore_said(rank: int, world: int, base: str, disk: str, spec: str,
                 per_host: int) -> dict[str, Any]:
    """restore() with ``per_host`` ranks per host, also -> the ckptio warnings this rank logged
    (``said``)."""
    import logging

    said: list[str] = []

    class Said(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    logging.getLogger("ckptio").addHandler(Said(logging.WARNING))
    return {**restore(rank, world, base, disk, spec, per_host=per_host), "said": said}


def restore_one_fails(rank: int, world: int, base: str, disk: str, spec: str, failing: int,
                      peer_timeout_s: float, step_timeout_s: float,
                      where: str = "reshard_fetch.exchange") -> dict[str, Any]:
    """restore() with those deadlines; rank ``failing`` fails ``where`` (``module.function``
    of ckptio.redundancy: the restart's exchange, or a rebuild's chains) as it ends (torch's
    RuntimeError, as a wait on a link to a peer fails; its peers' parts done) and stays
    alive; every rank then meets the others at a barrier of the job's group (as a script's
    next collective) -> the error and the seconds its restore took."""
    import importlib

    _play_host(rank, 1, base)
    if rank == failing:
        module, name = where.split(".")
        owner = importlib.import_module(f"ckptio.redundancy.{module}")
        done = getattr(owner, name)

        def fails(*args: Any, **kwargs: Any) -> Any:
            done(*args, **kwargs)
            raise RuntimeError(f"rank {rank}: a link of the restart failed (test)")

        setattr(owner, name, fails)
    state = _state(world, rank, 0)
    state["w"].to_local().zero_()
    return restore_then_meet(_tiers(spec, disk), state, peer_timeout_s, step_timeout_s)
