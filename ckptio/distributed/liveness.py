"""Whether the other ranks of a save or load are alive, without trusting anyone's clock.

Each process that takes part in a collective save or load bumps a counter in the job's c10d
store (the rendezvous store every torch.distributed job has) from a small thread, every
``interval`` seconds: ``ckptio/alive/<global rank>``. A rank waiting for others (``Watch``)
reads the counters of the ranks it waits for; one whose counter has not moved for the
deadline, by the waiting rank's own monotonic clock, is taken as dead (killed, crashed, frozen,
or cut off); one whose interpreter ended says so as it exits (its counter made negative) and
is dead at once, and so is one killed or crashed on a machine where another rank of the job
still beats: the processes of one machine (host, boot and PID namespace) list themselves in
the store (``ckptio/procs/<machine>``) and each one's beating thread marks a listed neighbour
whose death storage/holder.py proves (``DIED``). A rank that is slow but alive (still writing
its share) keeps beating and is waited for. Comparing counters rather than timestamps needs no
synchronised clocks.

Owns: the beating thread (one per process and store; stopped at interpreter exit, after the
saves still running there have finished, or when the store stops answering: not by
destroy_process_group, which may come while an async save still writes), the neighbours' watch
and the staleness rule. Does not own: the messages of a step or what a dead rank means
(storegroup.py).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
from collections.abc import Iterable
from typing import Any

from ckptio.storage import holder

__all__ = ["DIED", "GONE", "SILENT_BEATS", "Neighbours", "Watch", "beat", "key_of", "silent"]

SILENT_BEATS = 3  # silent(): a rank whose counter does not move for this many beats is gone
GONE = 1 << 40  # taken off a rank's counter as its process exits: seen gone at once
DIED = -2 * GONE  # a rank's counter set to this by a neighbour that saw its process gone
REFRESH_BEATS = 10  # how often (in beats) a process reads its machine's list of neighbours
log = logging.getLogger("ckptio")
_lock = threading.Lock()
_beating: dict[int, _Beat] = {}  # id(store) -> its thread (the store object is kept by it)


def key_of(global_rank: int) -> str:
    return f"ckptio/alive/{global_rank}"


class _Beat:
    def __init__(self, store: Any, global_rank: int, interval_s: float) -> None:
        self.store, self.key, self.interval_s = store, key_of(global_rank), interval_s
        self.pid = os.getpid()  # a child forked from this process is not this rank
        self.stop = threading.Event()
        self.neighbours = Neighbours.of(store, global_rank)
        # Not a daemon: a daemon inside a store call while the interpreter finalizes aborts the
        # process; the exit hook below stops it within one interval instead.
        self.thread = threading.Thread(target=self._run, name="ckptio-alive")

    def _run(self) -> None:
        while not self.stop.wait(self.interval_s):
            try:
                self.store.add(self.key, 1)
                if self.neighbours is not None:
                    self._look()
            except RuntimeError:  # the store is gone (its host exited): nobody left to tell
                return

    def _look(self) -> None:
        """The neighbours' watch; a list it cannot read ends the watch, never the beats (a
        rank that stopped beating would be taken for dead)."""
        assert self.neighbours is not None  # internal
        try:
            self.neighbours.look()
        except (ValueError, KeyError, TypeError) as exc:  # a malformed entry in the list
            log.warning("ckptio: the watch of this machine's other ranks stopped (%s: %s); "
                        "a rank killed here is named after rank_timeout_s", type(exc).__name__,
                        exc)
            self.neighbours = None


class Neighbours:
    """The other processes beating in ``store`` from this machine (storage/holder.machine), as
    its list says (read at beats 0, 2, 6, 14, ..., then every REFRESH_BEATS beats); ``look``
    marks each whose death holder.dead proves (killed, crashed) DIED in the store, once."""

    def __init__(self, store: Any, key: str, rank: int) -> None:
        self.store, self.key, self.rank = store, key, rank
        self.watched: dict[int, dict[str, Any]] = {}  # rank -> its process (holder.me)
        self.beats, self.read_at, self.gap = 0, 0, 1  # the list read at beats 0, 2, 6, 14, ...

    @classmethod
    def of(cls, store: Any, rank: int) -> Neighbours | None:
        """This process listed on its machine in ``store`` -> its watch, or None where its
        machine cannot be told (no /proc) or the store keeps no lists."""
        where = holder.machine()
        if not where:
            return None
        key = f"ckptio/procs/{where}"
        try:
            store.append(key, json.dumps({"rank": rank, **holder.me()}) + "\n")
        except (RuntimeError, NotImplementedError):  # a store without append
            return None
        return cls(store, key, rank)

    def _listed(self) -> dict[int, dict[str, Any]]:
        """Each other rank's latest process listed on this machine."""
        latest: dict[int, dict[str, Any]] = {}
        for line in bytes(self.store.get(self.key)).decode().splitlines():
            record = json.loads(line)
            if record["rank"] != self.rank:
                latest[record["rank"]] = record
        return latest

    def look(self) -> None:
        """Raises RuntimeError when the store does not answer."""
        if self.beats >= self.read_at:  # often while the ranks come, then every REFRESH_BEATS
            self.watched = self._listed()
            self.gap = min(2 * self.gap, REFRESH_BEATS)
            self.read_at = self.beats + self.gap
        self.beats += 1
        for rank, record in list(self.watched.items()):
            if holder.dead(record) is not None:
                del self.watched[rank]
                self._mark(rank, record)

    def _mark(self, rank: int, record: dict[str, Any]) -> None:
        """``rank`` DIED, unless its counter says it ended already or another process took the
        rank since (listed before its first beat: compare_set fails past that beat)."""
        count = int(self.store.add(key_of(rank), 0))
        if count >= 0 and self._listed().get(rank) == record:
            self.store.compare_set(key_of(rank), str(count), str(DIED))


def beat(store: Any, global_rank: int, interval_s: float) -> None:
    """Make sure this process beats in ``store`` (at least every ``interval_s``) until exit or
    until the store stops answering. Idempotent."""
    with _lock:
        for key in [k for k, b in _beating.items() if not b.thread.is_alive()]:
            del _beating[key]  # stopped: the store went away or was replaced
        running = _beating.get(id(store))
        if running is not None and running.interval_s <= interval_s:
            return
        if running is not None:
            running.stop.set()
        started = _Beat(store, global_rank, interval_s)  # listed first: a neighbour marks
        # this rank dead only if its latest listed process is gone
        count = int(store.add(key_of(global_rank), 1))
        if count < 0:  # seen alive from now on, before any step can wait; a process before
            store.add(key_of(global_rank), 1 - count)  # with this rank (the store outlived
            # it: a job re-formed around it) had exited or died
        _beating[id(store)] = started
        started.thread.start()


def _stop_at_exit() -> None:
    with _lock:
        for running in _beating.values():
            running.stop.set()


threading._register_atexit(_stop_at_exit)  # type: ignore[attr-defined]


def _gone_at_exit() -> None:
    """As the interpreter ends (after its threads, an async save's and the beats', were
    joined): each store this process beat in is told (its counter made negative), so that a
    rank waiting for this one names it at its next look, not after the deadline. A process
    killed, or ended by os._exit, says nothing: its silence is the deadline's."""
    beating = list(_beating.values())  # no lock: the beats are joined (and a forked child
    # may hold a copy of a lock some thread of its parent held)
    for running in (b for b in beating if b.pid == os.getpid()):
        try:
            running.store.add(running.key, -GONE)
        except RuntimeError:  # the store is gone (its host exited): nobody left to tell
            pass


atexit.register(_gone_at_exit)  # atexit's functions run after the threads are joined


def silent(store: Any, global_ranks: Iterable[int]) -> list[int]:
    """Those of ``global_ranks`` (each beating in ``store`` before) whose counter does not move
    for SILENT_BEATS of this process's beats there: after a transfer with them failed, which
    ones died or froze. Waits that long; [] when this process does not beat in ``store`` or
    the store does not answer (its host gone: nothing can tell)."""
    with _lock:
        running = _beating.get(id(store))
    if running is None:
        return []
    ranks = list(global_ranks)
    try:
        before = {rank: int(store.add(key_of(rank), 0)) for rank in ranks}
        if all(count < 0 for count in before.values()):
            return ranks  # each one's process ended (or died) already: nothing to wait for
        time.sleep(SILENT_BEATS * running.interval_s)
        after = {rank: int(store.add(key_of(rank), 0)) for rank in ranks}
    except RuntimeError:  # the store is gone (its host exited)
        return []
    return [rank for rank in ranks if before[rank] < 0 or after[rank] < 0
            or (before[rank] and after[rank] == before[rank])]


class Watch:
    """The liveness of some ranks as seen from one wait: ``stale(ranks)`` -> those of them whose
    counter has not moved for ``deadline_s`` since this watch began (or since it last moved).
    A rank that has never beaten (not yet in its first ckptio save or load: ranks reach the
    first one at different times) is not stale: it is waited for up to the step's deadline."""

    def __init__(self, store: Any, deadline_s: float) -> None:
        self.store, self.deadline_s = store, deadline_s
        self.seen: dict[int, tuple[int, float]] = {}  # global rank -> (counter, when it moved)
        self.exited: set[int] = set()  # the ranks found stale because their process ended
        self.died: set[int] = set()  # those of them seen gone by a neighbour (killed, crashed)
        self.began = time.monotonic()

    def stale(self, global_ranks: Iterable[int]) -> list[int]:
        """Raises RuntimeError when the store itself does not answer."""
        now = time.monotonic()
        dead = []
        for rank in global_ranks:
            count = int(self.store.add(key_of(rank), 0))
            if count < 0:  # its process exited (_gone_at_exit) or died (Neighbours)
                self.exited.add(rank)
                if count < -GONE:
                    self.died.add(rank)
                dead.append(rank)
                continue
            last = self.seen.get(rank)
            if last is None or last[0] != count:  # first seen: counts from the wait's start
                last = self.seen[rank] = (count, self.began if last is None else now)
            if count and now - last[1] > self.deadline_s:
                dead.append(rank)
        return dead
