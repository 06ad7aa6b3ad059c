"""Run a function on N real torch.distributed processes (gloo over 127.0.0.1) and collect what
each rank returned, or every rank's traceback.

    results = run_ranks(4, my_case, tmp_path)   # my_case(rank, world_size, tmp_path) on 4 ranks

``fn`` must be importable by name (a module-level function): ranks are forked from a clean
forkserver, never from the caller, so no thread or lock state of the caller leaks into them.
The job's store (a TCPStore) lives in rank 0's process, as with ``init_process_group`` alone,
or with ``agent_store=True`` in the caller's, as torchrun's agent holds it. Every rank still
alive when run_ranks returns or raises (one frozen by the test, one that hung; a rank that
answered has EXIT_WAIT_S to exit) is killed (SIGKILL, which also ends a stopped process) and
reaped. Each rank's standard error goes to a file of its own, written out here once the ranks
are gone; its end is in the error of a rank that failed, gave no answer or exited uncleanly
(an abort at exit prints only there). Test support only.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import random
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Collection
from datetime import timedelta
from typing import Any

__all__ = ["EXIT_WAIT_S", "PRELOAD", "RanksFailed", "free_port", "run_ranks", "warm_context"]


def free_port() -> int:
    """A port of 127.0.0.1 free now, for a store a rank binds later: drawn below the kernel's
    ephemeral range (ip_local_port_range), where no other process's outgoing connection takes
    it meanwhile (a port the kernel handed out as free was once taken that way before rank 0
    bound it: EADDRINUSE, and the other ranks waited for a store that never came)."""
    low = _ephemeral_low()
    draw = random.SystemRandom()  # not the tests' seeded generator: processes would collide
    for _ in range(200):
        port = draw.randrange(max(1024, low - 16384), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use: draw another
                continue
            return port
    with socket.socket() as s:  # all taken: any the kernel gives
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where unreadable)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _main(fn: Callable[..., Any], rank: int, world_size: int, port: int, timeout_s: float,
          results: Any, args: tuple[Any, ...], agent_store: bool = False,
          stderr_path: str | None = None, destroy: bool = True) -> None:
    if stderr_path is not None:  # fd 2 itself: also what C++ and the interpreter's exit write
        sys.stderr.flush()
        os.dup2(os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), 2)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the stacks of a rank that hangs
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
        dist.barrier()  # every rank connected before any case runs (and could exit early)
        try:
            # pickled here: a queue would pass tensors as shared-memory handles that vanish
            # when this process exits
            results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
        finally:
            if destroy:
                dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        results.put((rank, False, traceback.format_exc()))


_CTX: Any = None
# What a warm process imports before it forks ranks (warm_context, hostjob's agents), so that no
# rank imports it again: torch; torch._dynamo, which torch imports on the first optimizer a
# process makes (most ranks make one; it brings sympy and hundreds of modules); and ckptio's API
# modules, as ``import ckptio`` imports none of them (its names are lazy). docs/TESTS.md, "Where
# the time goes (per file)", has what each saves.
PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp",
           "torch.distributed.checkpoint.state_dict", "torch._dynamo", "ckptio", "ckptio.api",
           "ckptio.shared", "ckptio.managing.manager")
EXIT_WAIT_S = 60.0  # how long the ranks have to exit once they answered, all together
UNANSWERED_WAIT_S = 10.0  # how long a rank that gave no answer has, once the run has ended


def warm_context() -> Any:
    """A forkserver with torch and ckptio imported once (PRELOAD): each rank (and each command of
    ckptio.testing.cli_process) is a fork of that clean, single-threaded server (no state of
    the caller's threads), without paying the import of torch per process (docs/PROBES.md,
    "Figures moved out of the code")."""
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(list(PRELOAD))
    return _CTX


class RanksFailed(AssertionError):
    """One or more ranks raised (or hung); the message holds each one's traceback."""


def _store_outside(timeout_s: float) -> Any:
    """A TCPStore held by this process (torchrun's agent holds the job's store likewise)."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s))


def _stderr_tail(path: str, limit: int = 4000) -> str:
    """The end of a rank's standard error ('' when it wrote none)."""
    try:
        with open(path, "rb") as f:
            text = f.read().decode(errors="replace")
    except FileNotFoundError:
        return ""
    return text if len(text) <= limit else "...\n" + text[-limit:]


def _echo(paths: list[str]) -> None:
    """Every rank's standard error onto this process's, rank by rank."""
    for path in paths:
        if os.path.exists(path) and os.path.getsize(path):
            with open(path, "rb") as f:
                sys.stderr.write(f.read().decode(errors="replace"))
    sys.stderr.flush()


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 120,
              may_die: Collection[int] = (), spawn: bool = False,
              agent_store: bool = False, destroy: bool = True) -> list[Any]:
    """``fn(rank, world_size, *args)`` on every rank -> the values returned, in rank order.
    Every rank must answer and then exit with status 0 (a rank that aborts at interpreter exit
    fails the run, its standard error in the message), except the ranks of ``may_die``: they
    may exit without answering (killed by the test; their value is None) and their exit status
    is not checked. ``spawn``: each rank a fresh interpreter that finalizes when it exits (a
    forkserver child ends with os._exit, which skips finalization and with it the aborts that
    happen there). ``agent_store``: the job's store is held by this process, not by rank 0 (so
    that rank 0 can be frozen without stalling the others' store calls, as under torchrun).
    ``destroy=False``: the ranks exit without destroy_process_group, as many scripts do."""
    ctx = mp.get_context("spawn") if spawn else warm_context()
    results = ctx.Queue()
    logs = tempfile.mkdtemp(prefix="ckptio-ranks-")
    errs = [os.path.join(logs, f"rank{r}.stderr") for r in range(world_size)]
    store = _store_outside(timeout_s / 2) if agent_store else None  # kept until they are gone
    port = store.port if store is not None else free_port()
    procs = [ctx.Process(target=_main, daemon=True,
                         args=(fn, r, world_size, port, timeout_s / 2, results, args, agent_store,
                               errs[r], destroy))
             for r in range(world_size)]
    try:
        got = _collect(procs, results, world_size, may_die, timeout_s, errs)
        _echo(errs)
        _check(procs, got, errs, world_size, may_die)
    finally:
        shutil.rmtree(logs, ignore_errors=True)
    return [got[r][1] if r in got else None for r in range(world_size)]


def _collect(procs: list[Any], results: Any, world_size: int, may_die: Collection[int],
             timeout_s: float, errs: list[str]) -> dict[int, tuple[bool, Any]]:
    """Start the ranks, take their answers, and end every rank (killed if still alive)."""
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
        _end(procs, got, may_die, errs)
    return got


def _end(procs: list[Any], answered: Collection[int], may_die: Collection[int],
         errs: list[str]) -> None:
    """Wait for each rank to exit (a rank that answered: up to EXIT_WAIT_S for them all, as a
    loaded machine finalizes slowly; one that did not: UNANSWERED_WAIT_S), then kill it; a
    rank that must not die first writes its threads' stacks to its standard error."""
    until = time.monotonic() + EXIT_WAIT_S
    for r, p in enumerate(procs):
        if p.pid is None:
            continue  # never started
        wait = max(1.0, until - time.monotonic()) if r in answered else UNANSWERED_WAIT_S
        p.join(timeout=1 if r in may_die else wait)
        if p.is_alive() and r not in may_die:  # hung: its stacks (unless already finalizing)
            os.kill(p.pid, signal.SIGUSR1)
            p.join(timeout=1)
        if p.is_alive():  # frozen (SIGSTOP) or hung: SIGKILL ends a stopped process too
            p.kill()
            p.join(timeout=10)
            with open(errs[r], "a") as f:
                f.write(f"run_ranks: rank {r} still ran {wait:.0f} s after "
                        f"{'it answered' if r in answered else 'the run ended'}: killed\n")


def _check(procs: list[Any], got: dict[int, tuple[bool, Any]], errs: list[str], world_size: int,
           may_die: Collection[int]) -> None:
    """RanksFailed naming each rank that raised, gave no answer or exited uncleanly."""
    failed = {r: v for r, (ok, v) in got.items() if not ok}
    missing = [r for r in range(world_size) if r not in got and r not in may_die]
    unclean = [r for r in range(world_size)
               if r in got and r not in may_die and procs[r].exitcode != 0]
    if failed or missing or unclean:
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failed.items()))
        for r in sorted({*missing, *unclean}):
            text += f"\n--- rank {r}: standard error ---\n{_stderr_tail(errs[r]) or '(empty)'}"
        raise RanksFailed(
            f"ranks failed: {sorted(failed)}; no answer from "
            f"{[f'{r} (exit code {procs[r].exitcode})' for r in missing]}; answered but exited "
            f"uncleanly: {[f'{r} (exit code {procs[r].exitcode})' for r in unclean]}\n{text}")
