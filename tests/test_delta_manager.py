"""CheckpointManager with delta checkpoints (issue 28, the policy side), with real saves:
the cadence of full and delta steps (full_every, max_ratio, keep_every, a damaged base) with
sync, async and lazy saves; every committed step loading bit-exact at every moment of a
retention with chains (a base kept while a kept delta needs it, dropped one pass after its last
delta); restore() falling back past a delta whose base is damaged or missing, with a warning
naming the step and its base; a tiered manager whose drain copies a delta's base first; the
``ckptio`` command's view of chains (ls, ls --storage, ls RUN, verify of a chain, status); and
a real process (forked from the warm forkserver of ckptio.testing.rank_processes) SIGKILLed
at random moments of a delta-saving loop (saves and retention),
after which every committed step loads bit-exact and the run resumes.
The policy's rules on their own: tests/test_delta_policy.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import time
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptio
from ckptio import CorruptCheckpointError, DeltaPolicy, Options, Tier
from ckptio.format.manifest import MANIFEST_NAME, bases_of, decode
from ckptio.managing.manager import CheckpointManager
from ckptio.storage.select import store_for
from ckptio.testing.cli_process import run_cli
from ckptio.testing.rank_processes import warm_context

OPTS = Options(buffer_bytes=1 << 20, pool_bytes=4 << 20)
ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def state_at(step: int) -> dict:
    """A frozen fp32 block that never changes and bf16 weights whose first rows move."""
    g = torch.Generator().manual_seed(0)
    frozen = torch.randn(256, 256, generator=g)
    w = torch.randn(128, 128, generator=g).to(torch.bfloat16)
    w[: step % 128] += step
    return {"frozen": frozen, "w": w, "step": step}


def _bases(path: str) -> list[str]:
    store = store_for(path)
    return list(bases_of(decode(store.read_manifest(), store.path_of(MANIFEST_NAME))))


def _stored(path: str) -> int:
    return sum(p.stat().st_size for p in Path(path).iterdir() if p.name != MANIFEST_NAME)


def _loads_exact(path: str, step: int) -> None:
    out = ckptio.load(path)
    want = state_at(step)
    assert out["step"] == step
    for key in ("frozen", "w"):
        assert torch.equal(out[key].view(torch.uint8), want[key].view(torch.uint8)), (path, key)


def _manager(directory, **kwargs) -> CheckpointManager:
    return CheckpointManager(directory, options=OPTS, **kwargs)


_OPT = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))])  # what a lazy save hooks


def _save(mgr, step: int, how: str, state=None) -> None:
    mgr.save(step, state_at(step) if state is None else state, asynchronous=how == "async",
             lazy=how == "lazy", optimizers=[_OPT] if how == "lazy" else ())


def _ckptio(*args: str) -> subprocess.CompletedProcess[str]:
    """``ckptio ARGS`` in a process of its own forked from a warm interpreter
    (ckptio.testing.cli_process; tests/test_cli_ls.py checks it against ``python -m ckptio``)."""
    return run_cli(*args, env=ENV)


# ------------------------------------------------------------------ the cadence


@pytest.mark.parametrize("how", ["sync", "async", "lazy"])
def test_deltas_follow_full_every_and_load_bit_exact(tmp_path, how):
    mgr = _manager(tmp_path / "run", keep_last=None, delta=DeltaPolicy(full_every=3))
    for step in range(1, 8):
        _save(mgr, step, how)
    mgr.close()
    assert {s: _bases(mgr.path(s)) for s in mgr.steps()} == {
        1: [], 2: ["step-1"], 3: ["step-1"], 4: [], 5: ["step-4"], 6: ["step-4"], 7: []}
    assert _stored(mgr.path(2)) * 5 < _stored(mgr.path(1))  # the frozen block is referenced
    for step in mgr.steps():
        _loads_exact(mgr.path(step), step)


def test_a_delta_that_stopped_paying_makes_the_next_saves_full(tmp_path):
    """A delta storing more than max_ratio of its base: the next save is a new base, and the
    policy stops trying deltas for full_every saves (each such delta would pin its base)."""
    def noisy(step: int) -> dict:  # a small frozen part, referenced; the rest all changes
        return {"frozen": torch.arange(4096.0),
                "x": torch.randn(64 * 1024, generator=torch.Generator().manual_seed(step))}

    mgr = _manager(tmp_path / "run", keep_last=None,
                   delta=DeltaPolicy(full_every=100, max_ratio=0.5))
    for step in range(1, 5):
        mgr.save(step, noisy(step))
    mgr.close()
    assert [_bases(mgr.path(s)) for s in mgr.steps()] == [[], ["step-1"], [], []]
    for step in mgr.steps():
        assert torch.equal(ckptio.load(mgr.path(step))["x"], noisy(step)["x"])


def test_keep_every_steps_are_saved_full_and_compression_reaches_the_saves(tmp_path):
    mgr = _manager(tmp_path / "run", keep_last=2, keep_every=4, delta=DeltaPolicy(),
                   compression="zstd")
    for step in range(1, 10):
        mgr.save(step, state_at(step))
    mgr.close()
    assert mgr.steps() == [4, 8, 9]  # 8 full (keep_every), 9 a delta against it
    assert _bases(mgr.path(4)) == [] and _bases(mgr.path(8)) == []
    assert _bases(mgr.path(9)) == ["step-8"]
    doc = json.loads(_ckptio("ls", "--json", mgr.path(8)).stdout)
    codecs = {c for leaf in doc["tree"]["children"] for c in leaf.get("storage", [])}
    assert "zstd" in codecs
    for step in mgr.steps():
        _loads_exact(mgr.path(step), step)


# ------------------------------------------------------------------ retention with chains


@pytest.mark.parametrize("how", ["sync", "async"])
def test_retention_keeps_each_kept_deltas_base_and_every_step_loads(tmp_path, how):
    mgr = _manager(tmp_path / "run", keep_last=2, delta=DeltaPolicy(full_every=4))
    seen = []
    for step in range(1, 10):
        _save(mgr, step, how)
        mgr.wait()  # retention of this step has run
        committed = mgr.steps()
        seen.append(committed)
        for s in committed:  # at every moment: every committed step loads
            for name in _bases(mgr.path(s)):
                assert int(name.split("-")[1]) in committed, (step, s, name)
            _loads_exact(mgr.path(s), s)
    mgr.close()
    # 1 F, 2-4 d1, 5 F, 6-8 d5, 9 F: base 1 stays while 4 is kept, and goes one pass later
    assert seen[3] == [1, 3, 4] and seen[4] == [1, 4, 5] and seen[5] == [1, 5, 6]
    assert seen[6] == [5, 6, 7] and seen[8] == [5, 8, 9]


def test_close_drops_a_base_kept_back_one_pass(tmp_path):
    mgr = _manager(tmp_path / "run", keep_last=2, delta=DeltaPolicy(full_every=3))
    for step in range(1, 6):  # 1 F, 2-3 d1, 4 F, 5 d4: at 5, 3 goes and 1 waits for its removal
        mgr.save(step, state_at(step))
    assert mgr.steps() == [1, 4, 5]
    mgr.close()
    assert sorted(os.listdir(tmp_path / "run")) == ["step-4", "step-5"]


def test_restore_falls_back_past_a_delta_whose_base_is_damaged_or_missing(tmp_path):
    mgr = _manager(tmp_path / "run", keep_last=None, delta=DeltaPolicy(full_every=2))
    for step in range(1, 5):  # 1 F, 2 d1, 3 F, 4 d3
        mgr.save(step, state_at(step))
    mgr.close()
    data = next(p for p in Path(mgr.path(3)).iterdir() if p.name != MANIFEST_NAME)
    raw = bytearray(data.read_bytes())
    raw[1000] ^= 0xFF  # in the frozen block, which step 4 references
    data.write_bytes(bytes(raw))
    mgr = _manager(tmp_path / "run", keep_last=None, delta=DeltaPolicy(full_every=2))
    state = state_at(0)
    with pytest.warns(UserWarning, match=r"step 4 \(a delta against base step 3\)") as record:
        assert mgr.restore(state) == 2
    assert "step 3:" in str(record[0].message)
    assert torch.equal(state["w"], state_at(2)["w"])
    mgr.save(5, state_at(5))  # the newest full step is damaged: the next save is full
    assert _bases(mgr.path(5)) == []
    mgr.close()

    shutil.rmtree(mgr.path(5))
    shutil.rmtree(mgr.path(3))  # a delta's base gone (removed by hand)
    mgr = _manager(tmp_path / "run", keep_last=None)
    with pytest.warns(UserWarning, match=r"step 4 \(a delta against base step 3\)"):
        assert mgr.restore(state_at(0)) == 2
    mgr.close()


def test_saves_below_steps_a_restore_found_damaged_are_kept(tmp_path):
    """A damaged base makes the newest steps (it and its deltas) unloadable: restore() falls
    back to an older kept step and the run saves again below them (allowed: damaged steps do
    not count). The retention counted the damaged steps as the newest, so keep_last=3 kept
    only them and dropped each new save at once: a crash then lost every step since."""
    kwargs = {"keep_last": 3, "keep_every": 5, "delta": DeltaPolicy(full_every=10)}
    mgr = _manager(tmp_path / "run", **kwargs)
    for step in range(1, 13):  # 5 F and 10 F (keep_every), 11-12 d10
        mgr.save(step, state_at(step))
    mgr.close()
    assert mgr.steps() == [5, 10, 11, 12] and _bases(mgr.path(12)) == ["step-10"]
    data = next(p for p in Path(mgr.path(10)).iterdir() if p.name != MANIFEST_NAME)
    raw = bytearray(data.read_bytes())
    raw[1000] ^= 0xFF  # in the frozen block, which steps 11 and 12 reference
    data.write_bytes(bytes(raw))
    mgr = _manager(tmp_path / "run", **kwargs)
    with pytest.warns(UserWarning, match=r"step 12 \(a delta against base step 10\)"):
        assert mgr.restore(state_at(0)) == 5
    for step in range(6, 9):
        mgr.save(step, state_at(step))
        assert step in mgr.steps(), (step, mgr.steps())
    assert mgr.steps() == [5, 6, 7, 8, 10, 11, 12]  # the damaged ones wait to be saved over
    assert sorted(mgr.status()[0]["pinned"]) == [10, 11, 12]
    mgr.close()  # the next job resumes from step 8, not 5
    mgr = _manager(tmp_path / "run", **kwargs)
    with pytest.warns(UserWarning, match="step 12"):
        assert mgr.restore(state_at(0)) == 8
    mgr.close()


def test_a_retried_save_that_comes_out_a_delta_keeps_its_base(tmp_path):
    """A full save that failed (a bad value in the state), retried as the same step once the
    policy's pause after a costly delta ran out: the retry is a delta, but the manager still
    took it for the full save it had first chosen, so retention dropped its base and the
    newest (with keep_last=1, the only) step could not be loaded."""
    mgr = _manager(tmp_path / "run", keep_last=1, delta=DeltaPolicy(full_every=2, max_ratio=0.001))
    for step in (1, 2, 3):  # 1 F, 2 d1 (costly: the next 2 saves are full), 3 F
        mgr.save(step, state_at(step))
    with pytest.raises(ckptio.UnsupportedStateError):
        mgr.save(4, {**state_at(4), "bad": object()})  # chosen full, refused
    mgr.save(4, state_at(4))  # the pause ran out: a delta against step 3
    assert _bases(mgr.path(4)) == ["step-3"]
    mgr.close()
    assert mgr.steps() == [3, 4]
    _loads_exact(mgr.path(4), 4)


def _open_under(directory: Path) -> list[str]:
    """The data files under ``directory`` this process holds open (by /proc/self/fd; not the
    directories a background removal walks)."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, gone
            continue
        if target.startswith(str(directory)) and os.path.basename(target).startswith("data-"):
            held.append(target)
    return held


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="no /proc/self/fd here")
def test_delta_saves_leave_no_base_file_open(tmp_path):
    """Each delta save opened its base's data file to XOR against and never closed it: a long
    run held one more descriptor per save, and a base retention removed kept its disk space
    (open, deleted) until the process exited."""
    mgr = CheckpointManager(tmp_path / "run", keep_last=2, delta=DeltaPolicy(full_every=3),
                            options=dataclasses.replace(OPTS, compression="zstd"))  # XORs
    for step in range(1, 10):
        mgr.save(step, state_at(step), asynchronous=step % 2 == 0)
        mgr.wait()
        assert _open_under(tmp_path) == [], step
    assert any(_bases(mgr.path(s)) for s in mgr.steps())  # deltas were saved
    mgr.close()
    assert _open_under(tmp_path) == []
    for step in mgr.steps():
        _loads_exact(mgr.path(step), step)


# ------------------------------------------------------------------ tiers


@pytest.mark.parametrize("memory", [False, True])
def test_the_drain_copies_a_deltas_base_first(tmp_path, shm, memory):
    fast, slow = "shm://fast" if memory else str(tmp_path / "fast"), str(tmp_path / "slow")
    mgr = ckptio.CheckpointManager(
        tiers=[Tier(fast, keep_last=2), Tier(slow, every=2, keep_last=1)], options=OPTS,
        delta=DeltaPolicy(full_every=10))
    for step in range(1, 5):  # 1 F, 2-4 d1; the slow tier takes 2 and 4
        mgr.save(step, state_at(step))
        assert mgr.drained(timeout=60)
    mgr.close()
    slow_mgr = _manager(slow, keep_last=None)
    assert slow_mgr.steps() == [1, 4]  # base 1 copied before 2; 2 dropped, 1 kept for 4
    assert _bases(slow_mgr.path(4)) == ["step-1"]
    shutil.rmtree(os.path.join(shm, "fast") if memory else fast)
    _loads_exact(slow_mgr.path(4), 4)
    slow_mgr.close()
    data = next(p for p in Path(slow, "step-1").iterdir() if p.name != MANIFEST_NAME)
    data.write_bytes(data.read_bytes()[:4096])  # the slow tier's base cut short
    again = ckptio.CheckpointManager(tiers=[Tier(fast), Tier(slow, every=2)], options=OPTS)
    with pytest.raises(CorruptCheckpointError, match=rf"step 4 \(a delta against base step 1\) "
                                                     rf"in {slow}"):
        again.restore(state_at(0))
    again.close()
    status = _ckptio("status", slow)
    assert status.returncode == 0, status.stderr
    assert "committed 1 4(base 1)" in status.stdout
    doc = json.loads(_ckptio("status", slow, "--json").stdout)
    assert doc["tiers"][0]["bases"] == {"4": [1]}


def test_a_tiers_keep_every_makes_full_steps(tmp_path):
    mgr = ckptio.CheckpointManager(
        tiers=[Tier(str(tmp_path / "a"), keep_last=2), Tier(str(tmp_path / "b"), every=3,
                                                           keep_last=1, keep_every=3)],
        options=OPTS, delta=DeltaPolicy(full_every=10))
    for step in range(1, 7):
        mgr.save(step, state_at(step))
    mgr.close()
    slow = _manager(str(tmp_path / "b"), keep_last=None)
    assert slow.steps() == [3, 6] and all(_bases(slow.path(s)) == [] for s in (3, 6))
    slow.close()


# ------------------------------------------------------------------ the command


def test_ckptio_ls_and_verify_show_and_check_a_chain(tmp_path):
    mgr = _manager(tmp_path / "run", keep_last=None, delta=DeltaPolicy())
    for step in (1, 2):
        mgr.save(step, state_at(step))
    mgr.close()
    delta = mgr.path(2)
    text = _ckptio("ls", delta).stdout
    assert "a delta against step-1" in text.splitlines()[0]
    storage = _ckptio("ls", "--storage", delta).stdout
    assert any(line.split()[0] == "frozen" and line.endswith("ref step-1")
               for line in storage.splitlines()[2:])
    doc = json.loads(_ckptio("ls", "--json", delta).stdout)
    assert doc["bases"] == ["step-1"] and doc["stored_nbytes"] < doc["nbytes"] // 4
    frozen = doc["tree"]["children"][0]
    assert frozen["storage"] == ["ref step-1"] and frozen["stored_nbytes"] == 0
    run = json.loads(_ckptio("ls", "--json", str(tmp_path / "run")).stdout)
    assert [(s["step"], s["bases"]) for s in run["steps"]] == [(1, []), (2, ["step-1"])]
    assert run["steps"][1]["logical_nbytes"] == run["steps"][0]["logical_nbytes"]

    ok = _ckptio("verify", delta)
    assert ok.returncode == 0 and "(base step-1 of" in ok.stdout, ok.stdout + ok.stderr
    data = next(p for p in Path(mgr.path(1)).iterdir() if p.name != MANIFEST_NAME)
    raw = bytearray(data.read_bytes())
    raw[1000] ^= 0xFF
    data.write_bytes(bytes(raw))
    bad = _ckptio("verify", delta)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert f"{delta}: DAMAGED, its base step-1" in bad.stdout and "frozen" in bad.stdout
    shutil.rmtree(mgr.path(1))
    gone = _ckptio("verify", delta)
    assert gone.returncode in (1, 2) and "step-1" in gone.stdout + gone.stderr


# ------------------------------------------------------------------ a kill anywhere

def _saving_loop(err: str, ready: Any, make: Callable[[], CheckpointManager],
                 asynchronous: bool = False) -> None:
    """A training job until it is killed (a process of its own, forked from the warm
    forkserver of ckptio.testing.rank_processes): restore, say so, then save every step."""
    os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), 2)
    mgr = make()
    start = (mgr.restore(state_at(0)) or 0) + 1 if mgr.latest() is not None else 1
    ready.set()
    for step in range(start, start + 100000):
        mgr.save(step, state_at(step), asynchronous=asynchronous)


def _one_tier(run: str) -> CheckpointManager:
    return CheckpointManager(run, keep_last=2, options=OPTS, delta=DeltaPolicy(full_every=3))


def _start_job(tmp_path: Path, make: Callable[[], CheckpointManager],
               asynchronous: bool = False) -> tuple[Any, str]:
    """Start _saving_loop and wait until it has restored -> (the process, its stderr file)."""
    ctx = warm_context()
    ready, err = ctx.Event(), str(tmp_path / "job.stderr")
    proc = ctx.Process(target=_saving_loop, args=(err, ready, make, asynchronous), daemon=True)
    proc.start()
    assert ready.wait(120), Path(err).read_text() if os.path.exists(err) else "no stderr"
    return proc, err


def _kill(proc: Any) -> None:
    proc.kill()  # SIGKILL
    proc.join(30)


def _committed_after(run: str, last: int, timeout_s: float = 60.0) -> None:
    """Wait until a step after ``last`` has its manifest in ``run``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for step in Path(run).glob("step-*"):
            if int(step.name.split("-")[1]) > last and (step / MANIFEST_NAME).exists():
                return
        time.sleep(0.01)
    raise AssertionError(f"no step after {last} was committed in {run} within {timeout_s} s")


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_kill_during_delta_saves_and_retention_leaves_every_committed_step_loadable(
        tmp_path, asynchronous):
    run = str(tmp_path / "run")
    last = 0
    for delay in (0.3, 0.45, 0.6, 0.75):
        proc, err = _start_job(tmp_path, partial(_one_tier, run), asynchronous)
        _committed_after(run, last)  # the kill lands among later saves, however slow the host
        time.sleep(delay)
        _kill(proc)
        mgr = _manager(run, keep_last=2)
        committed = mgr.steps()
        assert committed and committed[-1] > last, (committed, Path(err).read_text())
        last = committed[-1]
        for step in committed:
            for name in _bases(mgr.path(step)):
                assert int(name.split("-")[1]) in committed
            _loads_exact(mgr.path(step), step)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an interrupted newest step is passed over
            assert mgr.restore(state_at(0)) == last
        mgr.close()


# ------------------------------------------------------------------ two ranks


def test_two_ranks_save_deltas_against_rank_0s_choice(tmp_path):
    from ckptio.testing.rank_processes import run_ranks

    import policy_cases as cases

    out = run_ranks(2, cases.deltas_on_two_ranks, str(tmp_path / "run"))
    for rank, got in enumerate(out):
        assert got["bases"] == {1: [], 2: ["step-1"], 3: ["step-1"], 4: [], 5: ["step-4"]}, (
            rank, got)
        # 1 outlives its last delta (3, dropped at 5) by one pass: dropped by close()
        assert got["kept"] == [1, 4, 5] and got["exact"] == [True] * 3, (rank, got)
        assert got["after_close"] == [4, 5], (rank, got)
        assert got["restored"] == 5 and got["w"], (rank, got)


def _two_tiers(fast: str, slow: str) -> CheckpointManager:
    return CheckpointManager(
        tiers=[Tier(fast, keep_last=2), Tier(slow, every=2, keep_last=1)],
        options=OPTS, delta=DeltaPolicy(full_every=4))


def test_a_kill_during_the_drain_of_deltas_leaves_every_tiers_steps_loadable(tmp_path):
    fast, slow = str(tmp_path / "fast"), str(tmp_path / "slow")
    for delay in (0.4, 0.7, 1.0):
        proc, _ = _start_job(tmp_path, partial(_two_tiers, fast, slow))
        time.sleep(delay)
        _kill(proc)
        for where in (fast, slow):
            mgr = _manager(where, keep_last=None)
            committed = mgr.steps()
            for step in committed:
                for name in _bases(mgr.path(step)):
                    assert int(name.split("-")[1]) in committed, (where, step, name)
                _loads_exact(mgr.path(step), step)
            mgr.close()
    check = _manager(slow, keep_last=None)
    assert check.steps()  # the drain got somewhere
    check.close()


def _footprint(directory: Path) -> int:
    """Bytes of the committed steps' files (a dropped step still being removed not counted)."""
    return sum(p.stat().st_size for d in directory.glob("step-*") for p in d.iterdir())


def test_full_training_with_deltas_takes_no_more_room_than_full_saves(tmp_path):
    """Every entry changes each step (AdamW on a whole model): a delta stores every entry
    whole and needs no base, so it is a full step, keeps no base, and the run takes the same
    room as one without deltas, step after step (before: each delta kept its base too)."""
    sizes: dict[str, list[int]] = {}
    for name, delta in (("plain", None), ("delta", True)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                    torch.nn.Linear(128, 64))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with _manager(tmp_path / name, keep_last=2, delta=delta) as mgr:
            sizes[name] = []
            for step in range(1, 9):
                model(torch.randn(4, 64)).square().mean().backward()
                opt.step()
                opt.zero_grad()
                mgr.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})
                sizes[name].append(_footprint(tmp_path / name))
            assert mgr.steps() == [7, 8]
            assert all(_bases(mgr.path(s)) == [] for s in mgr.steps())
    # the same files; the manifests differ by a few bytes (times, the policy's fields)
    assert all(d <= p + 1024 for d, p in zip(sizes["delta"], sizes["plain"])), sizes



def test_status_names_a_kept_deltas_base(tmp_path):
    with _manager(tmp_path / "run", keep_last=2, delta=DeltaPolicy(full_every=10)) as mgr:
        for step in range(1, 5):
            mgr.save(step, state_at(step))  # 1 full, 2-4 deltas against it (the frozen block)
        assert mgr.steps() == [1, 3, 4]
        assert mgr.status()[0]["pinned"] == {1: "the base of a kept delta"}
