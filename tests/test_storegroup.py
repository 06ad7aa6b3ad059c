"""The store transport of many-rank saves and loads (ckptio/distributed/storegroup.py), with
ranks as threads of this process sharing one in-memory c10d store: every collective delivers
each rank's bytes, and a rank that stops (no heartbeat) fails every other rank naming it.

No test here races a sleep against a deadline: the outcome (who raised, naming whom, which
deadline) is asserted, and time bounds only say that nothing hung, so a loaded machine passes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch.distributed as dist

from ckptio.distributed.liveness import GONE, Watch, key_of
from ckptio.distributed.storeframes import pack, unpack
from ckptio.distributed.storegroup import Deadlines, StoreGroup
from ckptio.errors import RankFailedError


def _on_threads(size: int, body: Callable[[StoreGroup], Any], deadlines: Deadlines,
                dead: frozenset[int] = frozenset(), view: Callable[[int, Any], Any] | None = None
                ) -> list[Any]:
    """``body(group)`` on ``size`` thread-ranks; ranks in ``dead`` never run (and never beat).
    ``view(rank, store)``: what that rank's group uses as its store (default: the store)."""
    store = dist.HashStore()
    stop = threading.Event()
    out: list[Any] = [None] * size

    def beat() -> None:  # the live ranks' heartbeats (liveness.beat runs one per process)
        while not stop.wait(deadlines.beat_s):
            for r in range(size):
                if r not in dead:
                    store.add(key_of(r), 1)

    def run(rank: int) -> None:
        mine = store if view is None else view(rank, store)
        group = StoreGroup(mine, store, tuple(range(size)), rank, "ckptio/test/0", deadlines)
        try:
            out[rank] = body(group)
        except RankFailedError as exc:
            out[rank] = exc

    for r in range(size):
        store.add(key_of(r), 1)  # every rank was alive once
    beater = threading.Thread(target=beat)
    beater.start()
    threads = [threading.Thread(target=run, args=(r,)) for r in range(size) if r not in dead]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    stop.set()
    beater.join()
    return out


def test_every_collective_delivers_each_ranks_bytes():
    def body(group: StoreGroup) -> Any:
        me = f"r{group.rank}".encode()
        gathered = group.gather(me)
        answer = group.scatter([b"to%d" % r for r in range(group.size)] if gathered else None)
        first = group.broadcast(b"one" if group.rank == 0 else None)
        second = group.broadcast(b"two" if group.rank == 0 else None)  # back to back
        return gathered, answer, first, second, group.all_gather(me * 3)

    results = _on_threads(4, body, Deadlines(rank_s=5.0))
    assert results[0][0] == [b"r0", b"r1", b"r2", b"r3"]
    for rank, (gathered, answer, first, second, everyone) in enumerate(results):
        assert (gathered is None) == (rank != 0)
        assert answer == b"to%d" % rank and (first, second) == (b"one", b"two")
        assert everyone == [f"r{r}".encode() * 3 for r in range(4)]


def _gather_then_scatter(group: StoreGroup) -> Any:
    gathered = group.gather(b"x")
    return group.scatter([b""] * group.size if gathered else None)


@pytest.mark.parametrize("dead_rank", [0, 2])
def test_a_rank_without_heartbeat_fails_every_other_rank_naming_it(dead_rank):
    """rank_s is 2 s: a live rank would have to miss 10 beats in a row to be taken for dead."""
    started = time.monotonic()
    results = _on_threads(3, _gather_then_scatter, Deadlines(rank_s=2.0),
                          dead=frozenset({dead_rank}))
    assert time.monotonic() - started < 4 * 2.0 + 10  # it did not hang (step_s is 30 min)
    for rank, result in enumerate(results):
        if rank == dead_rank:
            continue
        assert isinstance(result, RankFailedError), result
        assert result.ranks == (dead_rank,), result
        assert f"rank {dead_rank}: no sign of life for 2 s (Options.rank_timeout_s)" in str(result)


def test_the_failing_rank_waits_for_every_live_rank_to_read_the_failure_even_after_one_left():
    """Rank 1 never comes (rank_s 3 s); rank 2 reads the failure and its process exits (its
    counter made negative, as liveness does at exit); rank 3 comes late, 4 s in. Rank 0, which
    may hold the job's store, raises only once rank 3 has read the failure too: rank 2's exit
    after reading it does not count it twice (before: rank 0 left at once, and rank 3 found
    the store gone instead of the failure)."""
    came: dict[int, float] = {}

    def body(group: StoreGroup) -> Any:
        if group.rank == 3:
            time.sleep(4.0)  # within rank_s of rank 0's failure (about 3 s in)
            came[3] = time.monotonic()
        try:
            return _gather_then_scatter(group)
        except RankFailedError:
            came[group.rank] = came.get(group.rank, time.monotonic())
            if group.rank == 2:  # read it, then exited
                group.alive_store.add(key_of(2), -GONE)
            if group.rank == 0:
                came[-1] = time.monotonic()
            raise

    results = _on_threads(4, body, Deadlines(rank_s=3.0), dead=frozenset({1}))
    for rank in (0, 2, 3):
        assert isinstance(results[rank], RankFailedError) and results[rank].ranks == (1,)
    assert came[-1] >= came[3], came  # rank 0 raised after rank 3 came (and read it)


def test_a_live_rank_that_never_arrives_fails_the_step_after_step_timeout():
    """Rank 1 beats but never takes part until the others have failed: rank 0 names it for
    step_s (not for rank_s: it is alive), and so does rank 2, which waited for rank 0."""
    others_failed = threading.Event()

    def body(group: StoreGroup) -> Any:
        if group.rank == 1:  # alive (it beats) but absent from the step
            return others_failed.wait(timeout=60)
        try:
            return _gather_then_scatter(group)
        finally:
            if group.rank == 0:  # it raises once rank 2 has read the failure
                others_failed.set()

    results = _on_threads(3, body, Deadlines(rank_s=1.0, step_s=1.5))
    assert results[1] is True  # it waited until the others had failed
    for rank in (0, 2):
        assert isinstance(results[rank], RankFailedError) and results[rank].ranks == (1,)
        assert ("rank 1: did not send its part of the step within 1.5 s (1 x "
                "Options.step_timeout_s)") in str(results[rank]), results[rank]
        assert "alive, but stuck?" in str(results[rank])


def test_a_live_rank_given_up_on_is_named_for_why_not_for_silence():
    """Rank 1 beats but skips a load (its broadcast is never read past step_s): rank 0's next
    step named it with "no sign of life ... exited, was killed, is frozen" (the rank was
    alive); it now says it was given up on, why, and that every rank calls each save or load."""
    others_failed = threading.Event()

    def body(group: StoreGroup) -> Any:
        if group.rank == 1:  # alive (it beats) but calls nothing
            return others_failed.wait(timeout=60)
        try:
            group.broadcast(b"manifest")  # nobody reads it: rank 1 given up on after step_s
            return group.gather(b"keys")
        finally:
            others_failed.set()

    results = _on_threads(2, body, Deadlines(rank_s=1.0, step_s=1.5))
    assert results[1] is True
    said = str(results[0])
    assert isinstance(results[0], RankFailedError) and results[0].ranks == (1,), said
    assert "no sign of life" not in said and "given up on in an earlier step" in said, said
    assert "not calling this save or load: every rank calls each" in said, said


class _Clock:
    """A monotonic clock that moves only when told (stands for liveness.time)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_never_seen_alive_is_not_dead_but_silent_after_beating_is(monkeypatch):
    from ckptio.distributed import liveness

    clock = _Clock()
    monkeypatch.setattr(liveness, "time", clock)
    store = dist.HashStore()
    watch = Watch(store, deadline_s=0.5)  # times in halves and quarters: exact in binary
    store.add(key_of(1), 3)  # rank 1 beat; rank 2 never did
    clock.now += 0.5
    assert watch.stale([1, 2]) == []  # silent for the deadline exactly: not yet
    clock.now += 0.25
    assert watch.stale([1, 2]) == [1]  # silent past it; never seen alive is never stale
    store.add(key_of(1), 1)  # it moved: alive again, from now on
    assert watch.stale([1]) == []
    clock.now += 0.5
    assert watch.stale([1]) == []
    clock.now += 0.25
    assert watch.stale([1]) == [1]


class _Recording:
    """One rank's view of a store: every call goes through, its name and key recorded."""

    def __init__(self, store: Any) -> None:
        self.store, self.calls = store, []

    def __getattr__(self, name: str) -> Any:
        call = getattr(self.store, name)

        def recorded(*args: Any) -> Any:
            self.calls.append((name, args[0] if args else None))
            return call(*args)

        return recorded


def test_reading_the_coordinators_answer_is_each_ranks_last_store_call():
    """Once every rank has said it read an answer, the coordinator returns, and its process
    (which holds the store without torchrun) may exit: a rank's store call after saying so
    failed a save that rank 0 had committed ("store stopped answering... Nothing was
    committed"). So saying it is the last thing a rank does in the store, for a scatter's
    answer and for a broadcast."""
    views: dict[int, _Recording] = {}

    def view(rank: int, store: Any) -> _Recording:
        views[rank] = _Recording(store)
        return views[rank]

    def body(group: StoreGroup) -> Any:
        calls = views[group.rank].calls
        _gather_then_scatter(group)
        after_scatter = calls[-1]
        calls.clear()
        group.broadcast(b"b" if group.rank == 0 else None)
        return after_scatter, calls[-1]

    results = _on_threads(3, body, Deadlines(rank_s=30), view=view)
    for rank in (1, 2):
        assert results[rank] == (("add", "ckptio/test/0/out/read"),
                                 ("add", "ckptio/test/0/b/1/read")), results[rank]


def test_pack_round_trips_and_refuses_damage():
    parts = [b"", b"abc", bytes(range(256)) * 3]
    assert unpack(pack(parts)) == parts
    damaged = bytearray(pack(parts))
    damaged[-1] ^= 1
    with pytest.raises(RankFailedError, match="damaged"):
        unpack(bytes(damaged))


@pytest.mark.parametrize("fields", [{"rank_timeout_s": 0}, {"rank_timeout_s": -1},
                                    {"rank_timeout_s": 100, "step_timeout_s": 10}])
def test_deadline_options_are_checked(fields):
    import ckptio

    with pytest.raises(ckptio.CkptError, match="rank_timeout_s"):
        ckptio.Options(**fields)


def test_deadline_options_come_from_the_environment(monkeypatch):
    import ckptio

    monkeypatch.setenv("CKPTIO_RANK_TIMEOUT_S", "7.5")
    assert ckptio.Options.from_env().rank_timeout_s == 7.5
    assert Deadlines(7.5).beat_s == 0.75 and Deadlines(3600).beat_s == 1.0


def test_a_process_beats_at_once_and_then_on_its_own():
    """The first beat happens before beat() returns (a rank killed right after its first
    ckptio call has been seen alive, so it is judged by rank_timeout_s), then a thread beats
    (it is not stopped by destroy_process_group: only at exit, or when the store is gone)."""
    from ckptio.distributed import liveness

    store = dist.HashStore()
    liveness.beat(store, 5, 0.05)
    assert int(store.add(key_of(5), 0)) >= 1
    give_up = time.monotonic() + 30  # only so that a thread that never beats fails the test
    while int(store.add(key_of(5), 0)) < 3 and time.monotonic() < give_up:
        time.sleep(0.01)
    assert int(store.add(key_of(5), 0)) >= 3


def test_published_parts_are_stored_once_and_a_missing_one_is_an_error():
    """Ranks publishing equal bytes under one name store them once (the first claimer); the
    coordinator fetches them after the gather. A name nobody stored fails at once with a
    CkptError (no blocking get); a claimer whose store write failed gives the claim back."""
    from ckptio.errors import CkptError

    def body(group: StoreGroup) -> Any:
        group.publish("fp-a", b"layout bytes")
        group.publish(f"fp-{group.rank}", b"mine %d" % group.rank)
        if group.gather(b"") is None:
            return None
        fetched = group.fetch(["fp-a", "fp-0", "fp-2"])
        with pytest.raises(CkptError, match="plan part fp-missing was named by a rank but never"):
            group.fetch(["fp-a", "fp-missing"])
        return fetched

    out = _on_threads(3, body, Deadlines(rank_s=5, step_s=30))
    assert out[0] == [b"layout bytes", b"mine 0", b"mine 2"]

    store = dist.HashStore()
    group = StoreGroup(store, store, (0,), 0, "ckptio/t/0", Deadlines())

    class Refusing:  # a store whose writes fail: the claim is given back
        def __getattr__(self, name: str) -> Any:
            return getattr(store, name)

        def set(self, key: str, value: bytes) -> None:
            raise RuntimeError("store write failed")

    group.store = Refusing()
    with pytest.raises(RankFailedError):
        group.publish("fp-b", b"x")
    group.store = store
    group.publish("fp-b", b"x")  # claimed anew, stored this time
    assert group.fetch(["fp-b"]) == [b"x"]


class _SleepClock(_Clock):
    """A clock that moves only by the waiter's own sleeps (stands for storegroup.time)."""

    def __init__(self) -> None:
        super().__init__()
        self.pauses: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.now += seconds


def _waited(monkeypatch: pytest.MonkeyPatch, size: int, ready_after_s: float) -> _SleepClock:
    """Rank 1 of ``size`` waits for a step that becomes ready ``ready_after_s`` into the wait,
    on a clock only its sleeps move (no wall-clock time in the test)."""
    from ckptio.distributed import storegroup

    clock = _SleepClock()
    monkeypatch.setattr(storegroup, "time", clock)
    store = dist.HashStore()
    group = StoreGroup(store, store, tuple(range(size)), 1, "ckptio/t/0", Deadlines(rank_s=60))
    ready_at = clock.now + ready_after_s
    group._wait(lambda: clock.now >= ready_at, lambda: [], "a test step")
    return clock


@pytest.mark.parametrize("ready_after_s", [0.003, 0.011, 0.05, 0.11, 0.23, 0.6, 1.7])
def test_a_waiting_rank_sees_a_ready_step_within_a_sixteenth_of_its_wait(
        monkeypatch, ready_after_s):
    """A 2-rank save's commit waits ~0.01-0.5 s for the other rank; pauses that doubled
    (0.2 ms, 0.4 ms, ... up to 50 ms) saw the step up to the whole wait so far late (0.11 s:
    42 ms late, 38 %). A pause of 1/16 of the wait so far sees it at most ~6 % late."""
    clock = _waited(monkeypatch, 2, ready_after_s)
    late_s = clock.now - (1000.0 + ready_after_s)
    assert 0 <= late_s <= ready_after_s / 16 + 0.0002, (late_s, clock.pauses)


def test_four_thousand_waiting_ranks_poll_the_store_under_20k_times_a_second(monkeypatch):
    """The pause's floor grows with the group: 4096 ranks waiting at once poll at most 20k
    times a second in all, from the first poll (doubling pauses began at 0.2 ms each)."""
    clock = _waited(monkeypatch, 4096, 3.0)
    assert min(clock.pauses) >= 4096 / 20000 and len(clock.pauses) <= 3.0 / (4096 / 20000) + 1
    assert clock.now - 1003.0 <= 0.2 + 1e-9  # and never later than one pause
