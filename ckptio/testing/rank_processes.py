"""Run a function on N real torch.distributed processes (gloo over 127.0.0.1) and collect what
each rank returned, or every rank's traceback.

    results = run_ranks(4, my_case, tmp_path)   # my_case(rank, world_size, tmp_path) on 4 ranks

``fn`` must be importable by name (a module-level function): ranks are forked from a clean
forkserver, never from the caller, so no thread or lock state of the caller leaks into them.
The job's store (a TCPStore) lives in rank 0's process, as with ``init_process_group`` alone, or
with ``agent_store=True`` in the caller's, as torchrun's agent holds it. Every rank still alive
when run_ranks returns or raises (one frozen by the test, one that hung) is killed (SIGKILL,
which also ends a stopped process) and reaped. Test support only.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable, Collection
from datetime import timedelta
from typing import Any

__all__ = ["RanksFailed", "free_port", "run_ranks"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _main(fn: Callable[..., Any], rank: int, world_size: int, port: int, timeout_s: float,
          results: Any, args: tuple[Any, ...], agent_store: bool = False) -> None:
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    timeout = timedelta(seconds=timeout_s)
    try:
        if agent_store:  # a client of the caller's store
            store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                    timeout=timeout)
        else:  # rank 0 holds the store
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=world_size, timeout=timeout)
        try:
            # pickled here: a queue would pass tensors as shared-memory handles that vanish
            # when this process exits
            results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        results.put((rank, False, traceback.format_exc()))


_CTX: Any = None


def _context() -> Any:
    """A forkserver with torch and ckptio imported once: each rank is a fork of that clean,
    single-threaded server (no state of the caller's threads), without paying the import
    of torch per rank (docs/PROBES.md, "Figures moved out of the code")."""
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.tensor",
                                     "torch.distributed.fsdp",
                                     "torch.distributed.checkpoint.state_dict", "ckptio"])
    return _CTX


class RanksFailed(AssertionError):
    """One or more ranks raised (or hung); the message holds each one's traceback."""


def _store_outside(timeout_s: float) -> Any:
    """A TCPStore held by this process (torchrun's agent holds the job's store likewise)."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s))


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 120,
              may_die: Collection[int] = (), spawn: bool = False,
              agent_store: bool = False) -> list[Any]:
    """``fn(rank, world_size, *args)`` on every rank -> the values returned, in rank order.
    Every rank must answer and then exit with status 0 (a rank that aborts at interpreter exit
    fails the run), except the ranks of ``may_die``: they may exit without answering (killed
    by the test; their value is None) and their exit status is not checked. ``spawn``: each
    rank a fresh interpreter that finalizes when it exits (a forkserver child ends with
    os._exit, which skips finalization and with it the aborts that happen there).
    ``agent_store``: the job's store is held by this process, not by rank 0 (so that rank 0
    can be frozen without stalling the others' store calls, as under torchrun)."""
    ctx = mp.get_context("spawn") if spawn else _context()
    results = ctx.Queue()
    store = _store_outside(timeout_s / 2) if agent_store else None  # kept until they are gone
    port = store.port if store is not None else free_port()
    procs = [ctx.Process(target=_main, daemon=True,
                         args=(fn, r, world_size, port, timeout_s / 2, results, args, agent_store))
             for r in range(world_size)]
    got: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.start()
        while len(got) < world_size and time.monotonic() < deadline:
            if all(r in got or r in may_die for r in range(world_size)):
                break  # the others answered (a rank allowed to die may be frozen)
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs)
                        if r not in got and r not in may_die and p.exitcode is not None]
                if dead and results.empty():
                    time.sleep(1.0)  # a last answer may still be in flight
                    if results.empty():
                        break  # a rank died without answering: do not wait out the timeout
                continue
            got[rank] = (ok, pickle.loads(value) if ok else value)
    finally:
        for r, p in enumerate(procs):
            if p.pid is None:
                continue  # never started
            p.join(timeout=1 if r in may_die else 10)
            if p.is_alive():  # frozen (SIGSTOP) or hung: SIGKILL ends a stopped process too
                p.kill()
                p.join(timeout=10)
    failed = {r: v for r, (ok, v) in got.items() if not ok}
    missing = [f"{r} (exit code {procs[r].exitcode})" for r in range(world_size)
               if r not in got and r not in may_die]
    unclean = [f"{r} (exit code {procs[r].exitcode})" for r in range(world_size)
               if r in got and r not in may_die and procs[r].exitcode != 0]
    if failed or missing or unclean:
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failed.items()))
        raise RanksFailed(f"ranks failed: {sorted(failed)}; no answer from {missing}; answered "
                          f"but exited uncleanly: {unclean}\n{text}")
    return [got[r][1] if r in got else None for r in range(world_size)]
