"""Policies as objects (issue 68, item 1): a user's own retention class (``kept``) and save
trigger (``due``), defined here as a user defines them in their own file, drive a real
manager's saves and the steps left on disk; time-based retention over commit times; every
keyword spelling builds its built-in (and keeps the same steps as it); a policy returning
garbage is refused naming it; no policy can drop the newest step or a kept delta's base.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import ckptio
from ckptio import (AnyOf, CkptError, DeltaPolicy, KeepAll, KeepBest, KeepEvery, KeepLatest,
                    KeepRecent, Options, SaveEvery, SaveMoment, SaveOnPreemption, StepInfo, Tier)
from ckptio.format.manifest import MANIFEST_NAME, bases_of, decode
from ckptio.storage.local.runlease import LEASE_NAME
from ckptio.storage.select import store_for
from ckptio.testing.rank_processes import run_ranks

import policy_cases as cases

OPTS = Options(buffer_bytes=1 << 20, pool_bytes=4 << 20)


def _state(step: int) -> dict[str, object]:
    return {"w": torch.full((256,), float(step)), "step": step}


def _on_disk(directory: Path) -> list[int]:
    """The step directories a run directory holds (real files, not the manager's view)."""
    names = [n for n in os.listdir(directory) if n != LEASE_NAME and n.startswith("step-")]
    return sorted(int(n.removeprefix("step-")) for n in names)


# ------------------------------------------------------------------ a user's own policies


class KeepOdd:
    """A user's retention rule: keep the odd steps."""

    def kept(self, steps, now):
        return {s.step for s in steps if s.step % 2}


class KeepLowLoss:
    """A user's retention rule reading the metrics stored with each step."""

    def kept(self, steps, now):
        return {s.step for s in steps if s.metrics.get("loss", 1.0) < 0.5}


class Primes:
    """A user's save trigger."""

    def due(self, moment):
        return moment.step in (2, 3, 5, 7, 11)


class ThreeAfterLast:
    """A user's save trigger reading the last save: three steps after it."""

    def due(self, moment):
        return moment.last_step is None or moment.step - moment.last_step >= 3


def test_a_users_retention_class_decides_which_steps_remain(tmp_path: Path) -> None:
    d = tmp_path / "run"
    with ckptio.CheckpointManager(tiers=[Tier(d, keep=KeepOdd())], options=OPTS) as mgr:
        for step in range(1, 7):
            mgr.save(step, _state(step))
            assert _on_disk(d) == sorted({s for s in range(1, step + 1) if s % 2} | {step})
    assert _on_disk(d) == [1, 3, 5, 6]  # the newest (6) is always kept
    # a fresh manager's policy reads the metrics back from the manifests
    losses = {7: 0.9, 8: 0.1, 9: 0.8}
    with ckptio.CheckpointManager(d, keep=KeepLowLoss(), options=OPTS) as again:
        for step, loss in losses.items():
            again.save(step, _state(step), metrics={"loss": loss})
    assert _on_disk(d) == [8, 9]
    assert ckptio.load(str(d / "step-8"))["step"] == 8


def test_a_users_save_trigger_decides_when_the_manager_saves(tmp_path: Path) -> None:
    with ckptio.CheckpointManager(tmp_path / "a", save=Primes(), keep=KeepAll(),
                                  options=OPTS) as mgr:
        saved = [s for s in range(1, 13) if mgr.save(s, _state(s)) is not None]
    assert saved == [2, 3, 5, 7, 11] and _on_disk(tmp_path / "a") == saved
    assert mgr.save_every is None and isinstance(mgr.save_policy, Primes)
    # the moment carries the last save: a trigger three steps after it; force=True counts
    with ckptio.CheckpointManager(tiers=[Tier(tmp_path / "b", save=ThreeAfterLast(),
                                              keep=KeepAll())], options=OPTS) as mgr:
        saved = []
        for s in range(1, 12):
            if mgr.save(s, _state(s), force=s == 5) is not None:
                saved.append(s)
    assert saved == [1, 4, 5, 8, 11]


@pytest.mark.parametrize("sleeper", [0, 1])
def test_two_ranks_ask_a_users_save_policy_with_rank_0s_moment(tmp_path: Path,
                                                               sleeper: int) -> None:
    """Rank ``sleeper`` sleeps before asking: its own clock would say due, the other's not;
    both get rank 0's answer (tests/policy_cases.py holds the user's class)."""
    out = run_ranks(2, cases.users_policy_on_rank_0s_moment, str(tmp_path / "run"), sleeper)
    want = sleeper == 0
    assert [got["due"] for got in out] == [[want], [want]]
    assert [got["saved"] for got in out] == [want, want]


# ------------------------------------------------------------------ time-based retention


def _infos(times: dict[int, float]) -> list[StepInfo]:
    return [StepInfo(step, committed_at=at) for step, at in sorted(times.items())]


def test_time_based_retention_over_commit_times() -> None:
    times = {1: 0.0, 2: 100.0, 3: 3700.0, 4: 3800.0, 5: 7400.0, 6: 7500.0, 7: 7600.0}
    hourly = KeepEvery(seconds=3600)
    assert hourly.kept(_infos(times), now=8000.0) == {1, 3, 5}
    # stable: dropping the steps it did not keep keeps the same ones
    assert hourly.kept(_infos({s: times[s] for s in (1, 3, 5, 7)}), now=9e9) == {1, 3, 5}
    assert KeepRecent(seconds=600).kept(_infos(times), now=8000.0) == {5, 6, 7}
    assert KeepRecent(seconds=500).kept(_infos(times), now=20000.0) == set()
    both = AnyOf(hourly, KeepLatest(2))
    assert both.kept(_infos(times), now=8000.0) == {1, 3, 5, 6, 7}
    unknown = [StepInfo(1), StepInfo(2, committed_at=50.0)]  # saved before commit times
    assert hourly.kept(unknown, now=100.0) == {2}


def test_time_based_retention_with_a_real_manager(tmp_path: Path) -> None:
    """The commit times come from the steps' manifests: saves within seconds keep the oldest
    by the hour, and the newest two."""
    d = tmp_path / "run"
    keep = AnyOf(KeepEvery(seconds=3600), KeepLatest(2))
    with ckptio.CheckpointManager(tiers=[Tier(d, keep=keep)], options=OPTS) as mgr:
        for step in range(1, 6):
            mgr.save(step, _state(step))
    assert _on_disk(d) == [1, 4, 5]
    assert ckptio.read_metadata(str(d / "step-1"))["created_unix"] is not None


# ------------------------------------------------------------------ the keywords are sugar


@pytest.mark.parametrize("kwargs, keep", [
    ({}, KeepLatest(3)),
    ({"keep_last": None}, KeepAll()),
    ({"keep_last": 2, "keep_every": 4}, AnyOf(KeepLatest(2), KeepEvery(steps=4))),
    ({"keep_last": 1, "keep_best": 2, "monitor": "loss", "mode": "max"},
     AnyOf(KeepLatest(1), KeepBest(2, "loss", "max"))),
    ({"keep_last": 1, "keep_best": 1, "monitor": "loss", "keep_without_metric": True},
     AnyOf(KeepLatest(1), KeepBest(1, "loss", "min", True))),
])
def test_each_retention_keyword_builds_its_builtin_and_keeps_the_same_steps(
        tmp_path: Path, kwargs: dict, keep: object) -> None:
    losses = {1: 0.5, 2: 0.1, 3: 0.9, 5: 0.2, 6: 0.7, 7: 0.3, 9: 0.4}
    kept = []
    for name, how in (("words", kwargs), ("policy", {"keep": keep})):
        with ckptio.CheckpointManager(tmp_path / name, options=OPTS, **how) as mgr:
            assert mgr.keep_policies == [keep]
            for step in range(1, 11):
                metrics = {"loss": losses[step]} if step in losses else {}
                mgr.save(step, _state(step), metrics=metrics)
        kept.append(_on_disk(tmp_path / name))
    assert kept[0] == kept[1]


@pytest.mark.parametrize("kwargs, save", [
    ({}, SaveEvery(steps=1)),
    ({"save_every": 5}, SaveEvery(steps=5)),
    ({"save_interval_s": 60}, SaveEvery(seconds=60)),
    ({"save_every": 5, "save_interval_s": 60}, AnyOf(SaveEvery(steps=5), SaveEvery(seconds=60))),
    ({"save_every": 5, "preemption": True}, AnyOf(SaveEvery(steps=5), SaveOnPreemption())),
])
def test_each_save_keyword_builds_its_builtin(tmp_path: Path, kwargs: dict, save: object) -> None:
    due = []
    for name, how in (("words", kwargs), ("policy", {"save": save})):
        with ckptio.CheckpointManager(tmp_path / name, options=OPTS, **how) as mgr:
            assert mgr.save_policy == save
            due.append([s for s in range(1, 11) if mgr.should_save(s)])
    every = kwargs.get("save_every", 1 if "save_interval_s" not in kwargs else 100)
    assert due[0] == due[1] == list(range(every, 11, every))


def test_tier_keywords_build_their_builtins(tmp_path: Path) -> None:
    tiers = [Tier(tmp_path / "fast", keep_last=2), Tier(tmp_path / "slow", every=2,
                                                       keep_last=1, keep_every=4)]
    with ckptio.CheckpointManager(tiers=tiers, options=OPTS) as mgr:
        assert mgr.keep_policies == [KeepLatest(2), AnyOf(KeepLatest(1), KeepEvery(steps=4))]


def test_save_moment_is_what_the_builtins_read() -> None:
    moment = SaveMoment(step=10, now=100.0, last_step=4, last_time=30.0)
    assert SaveEvery(steps=5).due(moment) and not SaveEvery(steps=3).due(moment)
    assert SaveEvery(seconds=70).due(moment) and not SaveEvery(seconds=71).due(moment)
    assert not SaveOnPreemption().due(moment)
    assert SaveOnPreemption().due(SaveMoment(10, 100.0, 4, 30.0, preempted=True))


# ------------------------------------------------------------------ refusals and guarantees


class ReturnsList:
    def kept(self, steps, now):
        return [s.step for s in steps]


class ReturnsAStranger:
    def kept(self, steps, now):
        return {999}


class SaysYes:
    def due(self, moment):
        return "yes"


@pytest.mark.parametrize("policy, said", [(ReturnsList(), "returned list"),
                                          (ReturnsAStranger(), "returned steps [999]")])
def test_a_policy_returning_garbage_is_refused_naming_it(tmp_path: Path, policy: object,
                                                          said: str) -> None:
    d = tmp_path / "run"
    mgr = ckptio.CheckpointManager(d, keep=policy, options=OPTS)
    with pytest.raises(CkptError, match=type(policy).__name__) as caught:
        mgr.save(1, _state(1))
    assert said in str(caught.value)
    assert _on_disk(d) == [1] and ckptio.load(str(d / "step-1"))["step"] == 1  # intact
    mgr.close()


def test_what_is_not_a_policy_or_clashes_is_refused_at_construction(tmp_path: Path) -> None:
    d = tmp_path / "run"
    with pytest.raises(CkptError, match=r"keep=.*not a retention policy.*kept"):
        Tier(d, keep=object())
    with pytest.raises(CkptError, match=r"save=.*KeepOdd.*not a save policy.*due"):
        Tier(d, save=KeepOdd())
    with pytest.raises(CkptError, match=r"keep=.*not a retention policy"):
        ckptio.CheckpointManager(d, keep=AnyOf(KeepLatest(1), Primes()), options=OPTS)
    with pytest.raises(CkptError, match="keep_last"):
        ckptio.CheckpointManager(d, keep=KeepOdd(), keep_last=2, options=OPTS)
    with pytest.raises(CkptError, match="keep_last"):
        Tier(d, keep=KeepOdd(), keep_last=2)
    with pytest.raises(CkptError, match="save_every"):
        ckptio.CheckpointManager(d, save=Primes(), save_every=2, options=OPTS)
    with pytest.raises(CkptError, match="only the first tier"):
        ckptio.CheckpointManager(tiers=[Tier(d), Tier(tmp_path / "slow", save=Primes())],
                                 options=OPTS)
    with pytest.raises(CkptError, match="KeepLatest"):
        KeepLatest(0)
    with pytest.raises(CkptError, match="steps=N"):
        KeepEvery()
    mgr = ckptio.CheckpointManager(d, save=SaysYes(), options=OPTS)
    with pytest.raises(CkptError, match="SaysYes.*returned str"):
        mgr.should_save(1)
    mgr.close()


class KeepNothing:
    """A user's rule that would drop everything, a delta's base included."""

    def kept(self, steps, now):
        return set()


class KeepThird:
    """Keeps step 3 only: a delta whose base is step 1."""

    def kept(self, steps, now):
        return {s.step for s in steps if s.step == 3}


def _bases(path: Path) -> list[str]:
    store = store_for(str(path))
    return list(bases_of(decode(store.read_manifest(), store.path_of(MANIFEST_NAME))))


@pytest.mark.parametrize("policy, left", [(KeepNothing(), [1, 6]), (KeepThird(), [1, 3, 6])])
def test_a_users_policy_cannot_drop_the_newest_step_or_a_kept_deltas_base(
        tmp_path: Path, policy: object, left: list[int]) -> None:
    d = tmp_path / "run"
    with ckptio.CheckpointManager(d, keep=policy, delta=DeltaPolicy(full_every=10),
                                  options=OPTS) as mgr:
        for step in range(1, 7):
            mgr.save(step, {"frozen": torch.ones(4096), "w": torch.full((64,), float(step)),
                            "step": step})
    assert _on_disk(d) == left
    assert _bases(d / "step-6") == ["step-1"]  # the newest is a delta against step 1
    state = {"frozen": torch.zeros(4096), "w": torch.zeros(64), "step": 0}
    with ckptio.CheckpointManager(d, keep=policy, options=OPTS) as fresh:
        assert fresh.restore(state) == 6
    assert state["step"] == 6 and torch.equal(state["w"], torch.full((64,), 6.0))


def test_step_info_reads_what_a_policy_asks_for(tmp_path: Path) -> None:
    seen: list[tuple[int, int, int | None, tuple[int, ...]]] = []

    class Spy:
        def kept(self, steps, now):
            seen[:] = [(s.step, s.tier, s.nbytes, s.bases) for s in steps]
            assert all(abs(now - s.committed_at) < 600 for s in steps)
            return set()

    d = tmp_path / "run"
    with ckptio.CheckpointManager(d, keep=Spy(), delta=True, options=OPTS) as mgr:
        for step in (1, 2):
            mgr.save(step, {"frozen": torch.ones(4096), "step": step})
    steps = {s: (t, n, b) for s, t, n, b in seen}
    assert steps[1][0] == 0 and steps[1][1] > 0 and steps[1][2] == ()
    assert steps[2][2] == (1,)


# ------------------------------------------------------------------ the delta-base policy


class AgainstTheFirst:
    """A user's delta-base rule: every save a delta against the oldest full step."""

    def base(self, step, steps):
        full = [s.step for s in steps if s.is_full]
        return full[0] if full else None


class AgainstTheNewest:
    """Returns the newest step, a delta once there is one: refused (chains have depth 1)."""

    def base(self, step, steps):
        return steps[-1].step if steps else None


def _delta_state(step: int) -> dict[str, object]:
    return {"frozen": torch.ones(4096), "w": torch.full((64,), float(step)), "step": step}


def test_a_users_delta_base_policy_chooses_the_base(tmp_path: Path) -> None:
    d = tmp_path / "run"
    with ckptio.CheckpointManager(d, keep=KeepAll(), delta=AgainstTheFirst(),
                                  options=OPTS) as mgr:
        for step in range(1, 5):
            mgr.save(step, _delta_state(step))
    assert [_bases(d / f"step-{s}") for s in range(1, 5)] == [[], ["step-1"], ["step-1"],
                                                               ["step-1"]]
    assert ckptio.load(str(d / "step-4"))["step"] == 4
    mgr = ckptio.CheckpointManager(tmp_path / "bad", delta=AgainstTheNewest(), options=OPTS)
    mgr.save(1, _delta_state(1))
    mgr.save(2, _delta_state(2))  # a delta against 1
    with pytest.raises(CkptError, match=r"AgainstTheNewest.*base\(3, \.\.\.\) returned int 2"):
        mgr.save(3, _delta_state(3))
    assert _on_disk(tmp_path / "bad") == [1, 2]
    mgr.close()


def test_each_manager_counts_its_own_deltas(tmp_path: Path) -> None:
    """One DeltaPolicy given to two managers: each holds its own copy of the saves it counts
    (full_every=3: full, delta, delta, full, ... in each run)."""
    policy = DeltaPolicy(full_every=3)
    for name in ("a", "b"):
        with ckptio.CheckpointManager(tmp_path / name, keep=KeepAll(), delta=policy,
                                      options=OPTS) as mgr:
            for step in range(1, 5):
                mgr.save(step, _delta_state(step))
        assert [bool(_bases(tmp_path / name / f"step-{s}")) for s in range(1, 5)] == [
            False, True, True, False]
    steps = [StepInfo(1, nbytes=100), StepInfo(2, nbytes=10, bases=(1,))]
    assert DeltaPolicy(full_every=3).base(3, steps) == 1  # a policy asked with built StepInfo
    assert DeltaPolicy(full_every=3, max_ratio=0.05).base(3, steps) is None  # 10 > 5 % of 100


def test_a_wall_clock_jump_neither_fires_nor_holds_back_a_save_interval(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """save_interval_s counts on the monotonic clock: the wall clock jumping a day forward
    (an NTP step, a VM resumed) does not make a SaveEvery(seconds=60) due; the moment's
    ``now`` is still the wall clock (what StepInfo.committed_at is compared with)."""
    import time as real_time

    from ckptio.distributed.dist import Solo
    from ckptio.managing.triggers import Preemption, Triggers

    triggers = Triggers(Preemption())
    triggers.saved(0)
    wall = real_time.time()
    monkeypatch.setattr("ckptio.managing.triggers.time.time", lambda: wall + 86400.0)
    moment = triggers.at(1, Solo())
    assert moment["now"] == wall + 86400.0
    assert moment["now"] - moment["last"] < 60.0
    assert not ckptio.SaveEvery(seconds=60).due(ckptio.SaveMoment(
        step=1, now=moment["now"], last_step=0, last_time=moment["last"], preempted=False))
