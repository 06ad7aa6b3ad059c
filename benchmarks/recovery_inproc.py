"""The recovery benchmark's job without a relaunch (``--restart inprocess``, benchmarks/recovery.py,
docs/BENCH_RECOVERY.md "In-process recovery"): ``python -m benchmarks.recovery_inproc HOSTNAME|-
CFG.json``, one process per host plus a hot spare on a host of its own, no torchrun.

The same model, data, sources and events as recovery_worker.py. Rank 0 holds one TCPStore for
the whole job (host 0 is never the victim); each generation of the process group runs on a
prefix of it of its own (``gen<N>/``), so a stale key of a failed generation is never read. The
spare (RANK=-1) starts with torch and ckptio imported and its model built, and waits for the key
that names the rank it takes. When a collective fails (a peer gone), the survivor says so in the
store; a survivor not adjacent to the lost rank in gloo's ring, whose collective would wait for
its timeout, sees that key while it waits (``sync``). Each survivor then keeps a reference to the
failed group (gloo cannot abort a collective: destroying a group whose collective still waits
would block for its timeout), destroys it, closes its manager (the protection in flight fails:
expected) and checks in;
rank 0 names the ranks that did not check in and gives the first to the spare; every rank forms
the next generation's group and makes a new CheckpointManager on the same tiers, whose restore
rolls the survivors back to the newest step every rank can obtain (they may have trained past
it) from their own memory, and brings the spare its rank's copy from its partner (or parity).

Owns: the generations, the spare's wait, the survivors' check-in. Does not own: the model, the
sources, the events (recovery_worker.py), the hosts and the kill (recovery.py).
"""

from __future__ import annotations

import time

T0 = time.time()  # the process is up: before any import that takes time

import json  # noqa: E402 - after T0 on purpose
import os  # noqa: E402
import sys  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks.recovery_agent import set_hostname  # noqa: E402
from benchmarks.recovery_worker import (  # noqa: E402
    Ckptio, Events, build, digest, fail_fast, import_source, train_step)

CHECK_IN_S = 30.0  # rank 0 waits this long for the survivors to check in after a failure
POLL_S = 0.002  # a rank waiting in the step's collective looks at the store this often
_FAILED: list[Any] = []  # failed groups, kept: their destructor waits for their collective


class PeerFailed(RuntimeError):
    """Another survivor said in the store that the generation's collective failed."""


def sync(store: Any, generation: int, loss: Any) -> None:
    """The step's all_reduce; PeerFailed when the generation is said failed meanwhile."""
    import torch.distributed as dist

    work = dist.all_reduce(loss, async_op=True)
    while not work.is_completed():
        if store.check([f"gen{generation + 1}/failed"]):
            _FAILED.append(work)
            raise PeerFailed(f"generation {generation} failed (said in the store)")
        time.sleep(POLL_S)
    work.wait()


def join(store: Any, generation: int, rank: int, cfg: dict[str, Any]) -> None:
    """The process group of ``generation`` (its own prefix of the job's store)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.PrefixStore(f"gen{generation}/", store),
                            rank=rank, world_size=cfg["world"],
                            timeout=timedelta(seconds=cfg["pg_timeout"]))


def assign(store: Any, generation: int, world: int) -> list[int]:
    """Rank 0: the ranks that did not check in to ``generation`` (one lost host of one rank is
    awaited; others after CHECK_IN_S) -> the first is the spare's."""
    deadline = time.monotonic() + CHECK_IN_S
    while True:
        here = [r for r in range(1, world) if store.check([f"gen{generation}/in/{r}"])]
        if len(here) >= world - 2 or time.monotonic() > deadline:
            break
        time.sleep(0.005)
    lost = [r for r in range(1, world) if r not in here]
    if len(lost) != 1:
        raise RuntimeError(f"generation {generation}: ranks {lost} lost, one spare")
    store.set("spare/gen", str(generation))
    store.set("spare/rank", str(lost[0]))
    return lost


def _engine(cfg: dict[str, Any], rank: int, model: Any, opt: Any, ev: Events) -> tuple[Ckptio, int]:
    """A new manager on the same tiers, its restore -> (it, the step restored)."""
    engine = Ckptio(cfg, rank, model, opt)
    ev("engine")
    first, where = engine.restore()
    ev("restored", step=first, source=where)
    return engine, first


def _recover(cfg: dict[str, Any], store: Any, generation: int, rank: int, engine: Ckptio,
             ev: Events) -> None:
    """A survivor after a failed collective: its group destroyed, its manager closed, checked
    in, the next generation's group formed."""
    import torch.distributed as dist

    from ckptio.errors import CkptError

    store.set(f"gen{generation}/failed", "1")
    _FAILED.append(dist.group.WORLD)
    dist.destroy_process_group()  # first: the manager's close() then agrees with no one
    try:
        engine.close()
    except CkptError as exc:  # the protection of a step in flight failed with the peer
        ev("close_error", what=f"{type(exc).__name__}: {str(exc)[:300]}")
    ev("torn_down")
    if rank == 0:
        ev("assigned", lost=assign(store, generation, cfg["world"]))
    else:
        store.set(f"gen{generation}/in/{rank}", "1")
    join(store, generation, rank, cfg)
    ev("pg", gen=generation)


def run(cfg: dict[str, Any], ev: Events, rank: int) -> None:
    import torch
    import torch.distributed as dist

    from ckptio.errors import RankFailedError

    import_source(cfg["source"])
    ev("imported")
    torch.set_num_threads(1)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=rank == 0, timeout=timedelta(seconds=cfg["hold_s"]),
                          wait_for_workers=False)
    model, opt = build(cfg, max(rank, 0))  # the spare's values: overwritten by its restore
    ev("built")
    generation = 0
    if rank < 0:
        ev("spare_ready")
        rank = int(store.get("spare/rank"))  # waits for the key
        generation = int(store.get("spare/gen"))
        ev.base["rank"] = rank
        ev("assigned")
    join(store, generation, rank, cfg)
    ev("pg", gen=generation)
    engine, first = _engine(cfg, rank, model, opt, ev)
    step = first + 1
    while step <= cfg["steps"]:
        try:
            loss = train_step(cfg, rank, step, model, opt)
            if step == cfg["kill_step"] + 1 and not generation and rank == cfg["victim"]:
                ev("hold")  # the kill comes mid-run: the others wait in the collective
                time.sleep(cfg["hold_s"])
            sync(store, generation, loss)
            ev("step", step=step)
            engine.save(step)
            if step == cfg["kill_step"] and not generation:
                engine.settle()
                dist.barrier()
                ev("ready", step=step)
            step += 1
        except (RuntimeError, RankFailedError) as exc:  # a peer gone (gloo's errors)
            ev("failed", what=f"{type(exc).__name__}: {str(exc)[:300]}")
            generation += 1
            _recover(cfg, store, generation, rank, engine, ev)
            engine, first = _engine(cfg, rank, model, opt, ev)
            step = first + 1
    engine.close()
    ev("final", digest=digest(model, opt))
    dist.destroy_process_group()
    if _FAILED:  # their collectives end at their timeout: not waited for at the exit
        sys.stdout.flush()
        os._exit(0)


def main(argv: list[str]) -> int:
    hostname, cfg_path = argv
    if hostname != "-":
        set_hostname(hostname)
    cfg = json.loads(Path(cfg_path).read_text())
    rank = int(os.environ["RANK"])  # -1: the spare
    ev = Events(cfg["events"], rank)
    return fail_fast(ev, lambda: run(cfg, ev, rank))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
