"""Rank bodies for tests/test_step.py."""

from __future__ import annotations

import time

import ckptio
from ckptio.distributed.dist import Group, job_ranks, over_torch
from ckptio.distributed.step import coordinate


def _group() -> Group:
    import torch.distributed as dist

    return over_torch(dist.group.WORLD)


def one_step(rank: int, world: int, case: str) -> str:
    group = _group()
    error = ValueError("bad input") if case in ("rank1 fails", "two fail") and rank == 1 else None
    if case == "two fail" and rank == 2:
        error = ckptio.CorruptCheckpointError("bad bytes\nsecond line")
    mine = None if error is not None else f"from {rank}".encode()

    def decide(messages: list[bytes]) -> list[bytes]:
        if case == "decide fails":
            raise ckptio.CkptError("cannot decide")
        return [b"to %d after %s" % (r, b",".join(messages)) for r in range(len(messages))]

    try:
        answer = coordinate(group, mine, error, decide, lambda f: "step failed on " + "; ".join(f))
    except ckptio.RankFailedError as exc:
        kinds = ",".join(exc.kinds)
        return f"RankFailedError: {exc}" + (f" [kinds {kinds}]" if case == "two fail" else "")
    except ckptio.CkptError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "own error" if answer is None else answer.decode()


def late_under_later_options(rank: int, world: int) -> str:
    """The job's ranks made with the defaults (a plugin), then asked for with a 2 s step
    deadline (another plugin's Options): rank 1 comes 8 s late, alive; -> what each saw."""
    first = job_ranks(ckptio.Options())
    ranks = job_ranks(ckptio.Options(rank_timeout_s=2, step_timeout_s=2))
    assert ranks is first  # one per group: its counters are not made again
    if rank == 1:
        time.sleep(8)
    started = time.monotonic()
    try:
        coordinate(ranks, b"x", None, lambda m: m, str)
    except ckptio.CkptError as exc:
        return f"{type(exc).__name__} after {time.monotonic() - started:.1f} s: {exc}"
    return "answered"
