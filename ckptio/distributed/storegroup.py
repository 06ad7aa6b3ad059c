"""The byte collectives of a save or load over the job's c10d store, each with a deadline.

Ranks exchange their (small) messages as keys of the rendezvous store every torch.distributed
job already has (a TCPStore held by rank 0 or by torchrun's agent), instead of a gloo group:
no process group is made, nothing is pickled, and every wait is a loop that can give up. A
waiting rank watches the ranks it waits for (liveness.py); a rank dead for ``Deadlines.rank_s``
or not at the step after ``Deadlines.step_s`` is named in a RankFailedError on every live rank,
and the group stays failed (a job that lost a rank restarts). The key layout and the failure
record are on StoreGroup.

Call order: ``StoreGroup(...)`` once per group, then ``gather`` / ``scatter`` / ``broadcast``
in the same order on every rank.

Owns: the Group protocol's implementation over a store, deadlines and the failure record. Does
not own: what the messages say (wire.py, step.py), the bytes a key holds (storeframes.py), or
liveness (liveness.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptio.distributed.liveness import Watch
from ckptio.distributed.storeframes import (get_many, pack, set_many, stamped, unpack,
                                             unstamped)
from ckptio.errors import CkptError, RankFailedError

__all__ = ["COORDINATOR", "Deadlines", "StoreGroup", "poll_pause"]

log = logging.getLogger("ckptio")

COORDINATOR = 0
_POLL_MIN_S = 0.0002  # a waiting rank's shortest pause between two looks at the store
_POLLS_PER_S = 20000  # the most polls per second a group makes of the store, all ranks together
_LATE_SHARE = 1 / 16  # a wait ends at most this share of its length after it could have


@dataclass(frozen=True)
class Deadlines:
    """rank_s: a rank that shows no sign of life for this long while others wait is dead.
    step_s: the longest a live rank may keep the others waiting at one step."""

    rank_s: float = 60.0
    step_s: float = 1800.0

    @property
    def beat_s(self) -> float:
        """How often a rank shows it is alive: often enough for rank_s to see ten beats."""
        return max(0.05, min(1.0, self.rank_s / 10))


class StoreGroup:
    """``rank`` of ``size`` ranks (global ranks ``members``) exchanging bytes in ``store``.

    Keys of a group live under ``ckptio/<ranks>/<instance>/``. A gather's messages and a
    scatter's answers are one key per rank, stamped with the step's number and deleted by their
    rank once it has its answer (a rank sends its next message only after the coordinator's
    answer, which reads every message first); broadcasts are one key per step, deleted by the
    coordinator once every rank read it. Counters (``add``) say when a step is complete and
    which ranks sent: they never block, so no wait depends on a key existing, and a look never
    fetches a message.

    A failure is recorded in the store, so every rank waiting anywhere in the group raises it at
    its next look (every beat). A store whose host exited fails the step at once, naming rank
    0; a frozen host stalls store calls (TCPStore calls have no receive timeout)."""

    def __init__(self, store: Any, alive_store: Any, members: tuple[int, ...], rank: int,
                 name: str, deadlines: Deadlines) -> None:
        self.store, self.alive_store, self.members = store, alive_store, members
        self.rank, self.size, self.name, self.deadlines = rank, len(members), name, deadlines
        self._counts = {"gather": 0, "scatter": 0, "broadcast": 0}
        # poll_pause's bounds. The floor keeps the group's polls under 20k/s however many ranks
        # wait at once (4096 ranks: one per 0.2 s each); the cap bounds a long wait's lateness.
        self._poll_floor_s = max(_POLL_MIN_S, self.size / _POLLS_PER_S)
        self._poll_cap_s = max(0.05, self._poll_floor_s)
        self._failed_seen = False
        self._sent = False  # this rank's last gather message is still in the store
        self._dead: set[int] = set()  # found dead after a decision stood (see _delivered)
        self._why: dict[int, str] = {}  # why each of _dead was given up on, for later steps

    # ------------------------------------------------------------- the Group protocol

    def gather(self, data: bytes) -> list[bytes] | None:
        self._call(self._raise_if_failed_before)
        step = self._next("gather")
        if self.rank != COORDINATOR:
            self._call(lambda: self._send(step, data))
            return None
        return self._call(lambda: [data] + self._collect(step))

    def scatter(self, parts: list[bytes] | None) -> bytes:
        step = self._next("scatter")
        if self.rank == COORDINATOR:  # it decided (perhaps committed): it answers regardless
            if parts is None or len(parts) != self.size:
                raise TypeError("scatter: the coordinator passes one part per rank")  # internal
            self._call(lambda: self._answer(step, parts))
            return parts[0]
        return self._call(lambda: self._answered(step))

    def broadcast(self, data: bytes | None) -> bytes:
        self._call(self._raise_if_failed_before)
        step = self._next("broadcast")
        key = self._key(f"b/{step}")
        if self.rank == COORDINATOR:
            if data is None:
                raise TypeError("broadcast: the coordinator passes the bytes")  # internal
            self._call(lambda: self._send_broadcast(step, key, data))
            return data
        return self._call(lambda: self._read_broadcast(step, key))

    def all_gather(self, data: bytes) -> list[bytes]:
        gathered = self.gather(data)
        return unpack(self.broadcast(None if gathered is None else pack(gathered)))

    def publish(self, name: str, data: bytes) -> None:
        """Store ``data`` under ``name`` unless another rank claimed the name first (equal
        names are equal bytes): one copy in the store however many ranks publish it."""
        key = self._key(f"shared/{name}")

        def put() -> None:
            if self.store.add(f"{key}/claim", 1) != 1:
                return
            try:
                self.store.set(key, data)
            except BaseException:
                self.store.delete_key(f"{key}/claim")  # the next publisher claims it anew
                raise

        self._call(self._raise_if_failed_before)
        self._call(put)

    def fetch(self, names: list[str]) -> list[bytes]:
        """The coordinator, once the gather is in: every claimer stored its bytes before
        sending its message, so they are there (a missing one is an error, never a wait)."""
        keys = [self._key(f"shared/{n}") for n in names]
        if not self._call(lambda: self.store.check(keys)):
            missing = next(n for n, k in zip(names, keys) if not self.store.check([k]))
            raise CkptError(f"plan part {missing} was named by a rank but never stored in the "
                            "job's store (a publish that failed in an earlier save?); save again")
        return self._call(lambda: get_many(self.store, keys))

    def record_failure(self, ranks: list[int], why: str) -> None:
        """Record that ``ranks`` (group ranks) failed, ``why``, without waiting (the first
        record stands): every rank waiting in this group raises it at its next look. For a
        rank that leaves the group's steps after an error found outside them (a transfer with
        a peer that died), so that the others do not wait for it, alive, up to step_s."""
        named = "; ".join(f"rank {r}{_global(r, self.members)}: {why}" for r in ranks[:8])
        try:
            self.store.compare_set(self._key("failed"), "", named)
            self.store.set(self._key(f"failed/seen/{self.rank}"), b"1")  # known here: read
        except RuntimeError:  # torch's DistError family: the store's host is gone, which the
            return  # others find out at their next look
        self._failed_seen = True
        self._dead.update(ranks)

    # ------------------------------------------------------------- steps

    def _next(self, kind: str) -> int:
        self._counts[kind] += 1
        return self._counts[kind]

    def _key(self, suffix: str) -> str:
        return f"{self.name}/{suffix}"

    def _send(self, step: int, data: bytes) -> None:
        self.store.set(self._key(f"in/{self.rank}"), stamped(step, data))
        self.store.add(self._key(f"in/{self.rank}/n"), 1)  # = step: what the coordinator looks at
        self.store.add(self._key("in/n"), 1)
        self._sent = True

    def _collect(self, step: int) -> list[bytes]:
        """On the coordinator: the other ranks' messages of gather ``step``, once all are in."""
        expected = step * (self.size - 1)
        arrived: set[int] = set()
        self._wait(lambda: int(self.store.add(self._key("in/n"), 0)) >= expected,
                   lambda: self._not_sent(step, arrived), "its part of the step")
        keys = [self._key(f"in/{r}") for r in range(1, self.size)]
        return [unstamped(step, value, what=key) for key, value
                in zip(keys, get_many(self.store, keys))]

    def _not_sent(self, step: int, arrived: set[int]) -> list[int]:
        """The ranks whose message of ``step`` is not in yet (``arrived``: those seen, kept
        between looks): one small counter per rank, never the message itself."""
        missing = []
        for r in range(1, self.size):
            if r in arrived:
                continue
            if int(self.store.add(self._key(f"in/{r}/n"), 0)) >= step:
                arrived.add(r)
            else:
                missing.append(r)
        return missing

    def _tidy(self) -> None:
        """Once this rank has its answer, its message and answer are read: delete them (the
        store keeps no message per rank between steps, nor after a group is dropped)."""
        if self._sent:
            self.store.delete_key(self._key(f"in/{self.rank}"))
            self._sent = False

    def _answer(self, step: int, parts: list[bytes]) -> None:
        set_many(self.store, [self._key(f"out/{r}") for r in range(1, self.size)],
                 [stamped(step, p) for p in parts[1:]])
        self.store.add(self._key("out/n"), 1)
        self._delivered(self._key("out/read"), step * (self.size - 1))

    def _answered(self, step: int) -> bytes:
        self._wait(lambda: int(self.store.add(self._key("out/n"), 0)) >= step,
                   lambda: [COORDINATOR], "its answer", patience=2)
        key = self._key(f"out/{self.rank}")
        answer = unstamped(step, self.store.get(key), what=key)
        self.store.delete_key(key)
        self._tidy()
        # Last: once every rank said it read its answer, the coordinator may return and its
        # process (which may hold the store) exit; nothing of this step may come after.
        self.store.add(self._key("out/read"), 1)
        return answer

    def _send_broadcast(self, step: int, key: str, data: bytes) -> None:
        self.store.set(key, data)
        self.store.add(self._key("b/n"), 1)
        if self._delivered(key + "/read", self.size - 1):  # else a live rank may read it yet
            self.store.delete_key(key)
            self.store.delete_key(key + "/read")

    def _read_broadcast(self, step: int, key: str) -> bytes:
        self._wait(lambda: int(self.store.add(self._key("b/n"), 0)) >= step,
                   lambda: [COORDINATOR], "its message", patience=2)
        data = bytes(self.store.get(key))
        self._tidy()
        self.store.add(key + "/read", 1)  # last, as in _answered
        return data

    def _delivered(self, counter: str, expected: int) -> bool:
        """On the coordinator, after answering: until every rank has read its answer (the
        store may live in this process, which must not exit before). A rank that died
        meanwhile is the next step's concern: what was decided stands (it may be a commit).
        -> whether every rank read it."""
        if self._dead:  # a rank died: the count will not be reached; the next step fails
            return False
        try:
            self._wait(lambda: int(self.store.add(counter, 0)) >= expected,
                       lambda: list(range(1, self.size)), "the answers to be read", record=False)
        except RankFailedError as lost:
            self._dead.update(lost.ranks)
            self._why.update({r: f"given up on in an earlier step: {lost}" for r in lost.ranks})
            log.warning("ckptio: rank 0 answered, but not every rank read it: %s", lost)
            return False
        return True

    # ------------------------------------------------------------- waiting and failing

    def _wait(self, ready: Callable[[], bool], waiting_for: Callable[[], list[int]],
              what: str, *, record: bool = True, check_failed: bool = True,
              patience: float = 1) -> None:
        """Until ``ready()``; fails when a rank of ``waiting_for()`` (group ranks) is dead (no
        beat for rank_s), or still missing after ``patience`` x step_s: recorded for the whole
        group unless ``record`` is false. Waits for the coordinator's answer have patience 2:
        the coordinator, alive, may itself wait up to step_s for another rank, and it is the one
        that names that rank."""
        began = time.monotonic()
        watch = Watch(self.alive_store, self.deadlines.rank_s)
        look_at = began + self.deadlines.beat_s
        while not ready():
            now = time.monotonic()
            if now >= look_at:  # a look: a recorded failure, then the missing ranks' liveness
                if check_failed:
                    self._raise_if_failed()
                look_at = now + self.deadlines.beat_s
                failure = self._judge(waiting_for(), watch, now - began, what, patience)
                if failure is not None:
                    self._fail(*failure, record=record)
            time.sleep(poll_pause(now - began, self._poll_floor_s, self._poll_cap_s))

    def _judge(self, missing: list[int], watch: Watch, waited_s: float, what: str,
               patience: float) -> tuple[list[int], str] | None:
        by_global = {self.members[r]: r for r in missing if r not in self._dead}
        stale = {by_global[g] for g in watch.stale(by_global)}
        dead = sorted(stale | (self._dead & {*missing}))
        exited = {by_global[g] for g in watch.exited if g in by_global}
        if dead and exited.issuperset(dead) and watch.died & {self.members[r] for r in dead}:
            return dead, (f"its process died while rank {self.rank} waited for {what} (killed "
                          "or crashed: a process of the job on its machine saw it gone)")
        if dead and exited.issuperset(dead):
            return dead, (f"its process exited while rank {self.rank} waited for {what} (it "
                          "ended, saying so to the job's store): see that rank's output for "
                          "its own error; with none there, its script ended before this "
                          "collective (every rank makes each save and load)")
        if dead and (stale or not all(r in self._why for r in dead)):
            return dead, (f"no sign of life for {self.deadlines.rank_s:g} s (Options."
                          f"rank_timeout_s) while rank {self.rank} waited for {what}: its "
                          "process exited, was killed, is frozen or was cut off")
        if dead:  # alive, but given up on before (late past step_timeout_s): say why
            return dead, self._why[dead[0]]
        limit_s = patience * self.deadlines.step_s
        if missing and waited_s > limit_s:
            # a rank never seen has not reached this step; the others named may have (a wait on
            # a count, as for its answers to be read, names every rank): only it is to blame
            unseen = [r for r in missing if watch.seen.get(self.members[r], (0, 0.0))[0] == 0]
            why = ("never seen alive by ckptio: it may have failed before its first save or load"
                   if unseen else
                   "alive, but stuck? (or not calling this save or load: every rank calls each)")
            return unseen or missing, (f"did not send {what} within {limit_s:g} s ({patience:g} "
                                       f"x Options.step_timeout_s) while rank {self.rank} "
                                       f"waited; {why}")
        return None

    def _fail(self, ranks: list[int], why: str, *, record: bool = True) -> None:
        named = "; ".join(f"rank {r}{_global(r, self.members)}: {why}" for r in ranks[:8])
        named += f" (and {len(ranks) - 8} more ranks)" if len(ranks) > 8 else ""
        if not record:
            raise RankFailedError(named, ranks=tuple(ranks))
        first = self.store.compare_set(self._key("failed"), "", named)  # the first cause stays
        self._dead.update(ranks)
        # The live ranks read it before this one raises, for up to rank_s: the store may live
        # in this process, which is about to exit (a rank still busy writing reads it at its
        # next step, or finds the store gone: its message then says why). Each rank marks its
        # own reading (a rank that read it and exited is not waited for, nor counted twice).
        if not self._failed_seen:  # marked before waiting: ranks recording at once do not
            self._failed_seen = True  # wait for one another
            self.store.set(self._key(f"failed/seen/{self.rank}"), b"1")
        until = time.monotonic() + self.deadlines.rank_s
        while time.monotonic() <= until:
            try:
                self._wait(lambda: self._all_read() or time.monotonic() > until,
                           self._unread, "the failure to be read", record=False,
                           check_failed=False)
                break
            except RankFailedError as lost:  # a rank died meanwhile: it will not read it
                self._dead.update(lost.ranks)
            except RuntimeError:  # the store's host gone: rank 0 saw the failure read and left
                break
        message = bytes(first).decode(errors="replace")  # raised as every rank raises it
        raise RankFailedError(message, ranks=_named_ranks(message))

    def _raise_if_failed_before(self) -> None:
        """At the start of a collective: a failure this rank has raised before means the group
        is still failed (a job that lost a rank restarts); say so."""
        if not self._failed_seen:
            self._raise_if_failed()
            return
        message = bytes(self.store.get(self._key("failed"))).decode(errors="replace")
        lost = RankFailedError(f"these ranks failed together in an earlier save or load, and "
                               f"ckptio does not use them again (restart the job): {message}",
                               ranks=_named_ranks(message))
        lost.earlier = True  # type: ignore[attr-defined]  # step.coordinate raises it as is
        raise lost

    def _raise_if_failed(self) -> None:
        key = self._key("failed")
        if self.store.check([key]):
            message = bytes(self.store.get(key)).decode(errors="replace")
            if not self._failed_seen:
                self._failed_seen = True
                self.store.set(f"{key}/seen/{self.rank}", b"1")
            raise RankFailedError(message, ranks=_named_ranks(message))

    def _seen_keys(self) -> dict[int, str]:
        """Each live rank's (but this one's) mark that it read the group's failure."""
        return {r: self._key(f"failed/seen/{r}") for r in range(self.size)
                if r != self.rank and r not in self._dead}

    def _all_read(self) -> bool:
        keys = list(self._seen_keys().values())
        return not keys or bool(self.store.check(keys))  # one call: each poll

    def _unread(self) -> list[int]:  # one call per rank: each look
        return [r for r, key in self._seen_keys().items() if not self.store.check([key])]

    def _call(self, body: Callable[[], Any]) -> Any:
        """``body()``; a store that stopped answering fails the step naming it."""
        try:
            return body()
        except RuntimeError as exc:  # torch's DistError family: the store's host is gone
            where = _address(self.store)
            raise RankFailedError(
                f"rank 0: the job's rendezvous store ({where}) stopped answering rank "
                f"{self.rank} ({type(exc).__name__}: {exc}): the process that holds it (rank "
                "0's, unless torchrun's agent holds it) exited or is unreachable; if rank 0 "
                "stopped because it lost another rank, its own error names that rank",
                ranks=(COORDINATOR,)) from None


def poll_pause(waited_s: float, floor_s: float, cap_s: float) -> float:
    """The sleep before a waiting rank's next poll, having waited ``waited_s``: 1/16 of it,
    within [floor_s, cap_s], so a step is seen at most ~6 % of its wait late (doubling pauses
    overslept by up to the whole wait so far: docs/BENCH_LIMIT.md, "the 2-rank save")."""
    return min(cap_s, max(floor_s, waited_s * _LATE_SHARE))


def _address(store: Any) -> str:
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return f"{getattr(store, 'host', '?')}:{getattr(store, 'port', '?')}"


def _global(rank: int, members: tuple[int, ...]) -> str:
    return "" if members[rank] == rank else f" (global rank {members[rank]})"


def _named_ranks(message: str) -> tuple[int, ...]:
    ranks = []
    for part in message.split("; "):
        head = part.split(":", 1)[0].split(" ")
        if len(head) >= 2 and head[0] == "rank" and head[1].isdigit():
            ranks.append(int(head[1]))
    return tuple(ranks)
