"""CheckpointManager policies of issue 30: the best k steps by a metric, a time interval, a
preemption hook, per-step metrics and metadata, and retention that keeps exactly what it says.

Covers: keep_best with mode min / max, ties (the newer step ranks first), NaN (worst), steps
saved without the metric, the union with keep_last / keep_every, metrics read back from the
manifests by a new manager; metadata stored in the manifest, read without the data files,
refused when it is not JSON, damaged manifests refused; save_interval_s alone and with
save_every; SIGTERM to a real training subprocess (async saves) -> the final step committed
and restorable; async retention leaving exactly keep_last steps and its peak disk use; bad
options; two gloo ranks agreeing on preemption seen by one rank, on rank 0's clock and on
rank 0's metrics.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import ckptio
from ckptio.storage.local.runlease import LEASE_NAME
from ckptio import CheckpointNotFoundError, Checkpointer, CkptError, ManifestError, Options
from ckptio.managing.manager import CheckpointManager
from ckptio.testing.rank_processes import run_ranks

import policy_cases as cases

MiB = 1 << 20
OPTS = Options(buffer_bytes=MiB, pool_bytes=4 * MiB)


def _state(step: int) -> dict:
    return {"w": torch.full((256,), float(step)), "step": step}


def _manager(directory, **kwargs) -> CheckpointManager:
    return CheckpointManager(directory, options=OPTS, **kwargs)


def _entries(directory) -> list[str]:
    """What a run directory holds, less the run lease of the manager open on it."""
    names = os.listdir(directory) if os.path.isdir(directory) else []
    return sorted(n for n in names if n != LEASE_NAME)


# ------------------------------------------------------------------ keep the best k


@pytest.mark.parametrize("mode, losses, best", [
    # min: 2 and 4 tie at 1.0 (both kept: k=2); 8 ties too, newer ranks first -> {4, 8}
    ("min", {1: 5.0, 2: 1.0, 3: 4.0, 4: 1.0, 5: 3.0, 6: 6.0, 8: 1.0}, [4, 8]),
    # max: NaN ranks worst, though a NaN compares as neither; 6 and 5 are the best two
    ("max", {1: 5.0, 2: math.nan, 3: 4.0, 4: 1.0, 5: 6.0, 6: 7.0, 8: 2.0}, [5, 6]),
])
def test_keep_best_by_metric(tmp_path, mode, losses, best):
    d = tmp_path / "run"
    mgr = _manager(d, keep_last=1, keep_best=2, monitor="loss", mode=mode)
    for step in range(1, 9):
        metrics = {"loss": losses[step], "lr": 0.1} if step in losses else {"lr": 0.1}
        mgr.save(step, _state(step), metrics=metrics)  # 7: no "loss": kept only while newest
    mgr.close()
    assert mgr.steps() == sorted(set(best) | {8})
    assert _entries(d) == [f"step-{s}" for s in sorted(set(best) | {8}, key=str)]
    # a new manager reads the metrics back from the manifests (nothing held in memory)
    again = _manager(d, keep_last=1, keep_best=1, monitor="loss", mode=mode)
    again.save(9, _state(9), metrics={"loss": 100.0 if mode == "min" else -100.0})
    again.close()
    winner = best[-1] if mode == "min" else 6  # min: 8 (newer of the ties); max: 6 (7.0)
    assert again.steps() == [winner, 9]


def test_keep_best_union_with_keep_last_keep_every_and_without_metric(tmp_path):
    """Kept = last keep_last ∪ multiples of keep_every ∪ best keep_best ∪ (with
    keep_without_metric) every step saved without the metric."""
    d = tmp_path / "run"
    mgr = _manager(d, keep_last=2, keep_every=4, keep_best=1, monitor="val", mode="max",
                   keep_without_metric=True)
    vals = {1: 0.9, 2: 0.1, 3: 0.2, 5: 0.3, 6: 0.4, 7: 0.5, 9: 0.6, 10: 0.7}
    for step in range(1, 11):
        mgr.save(step, _state(step), metrics={"val": vals[step]} if step in vals else None)
    mgr.close()
    # last 2: 9, 10; every 4: 4, 8; best: 1; without "val": 4, 8
    assert mgr.steps() == [1, 4, 8, 9, 10]


@pytest.mark.parametrize("kwargs, match", [
    (dict(keep_best=2), "give both"),
    (dict(monitor="loss"), "give both"),
    (dict(keep_best=2, monitor="loss", mode="avg"), "mode='avg'"),
    (dict(keep_best=0, monitor="loss"), "keep_best=0"),
    (dict(keep_best=2, monitor="loss", keep_last=None), "keep_last=None keeps every step"),
    (dict(keep_best=2, monitor="", mode="min"), "monitor=''"),
    (dict(keep_without_metric=1), "keep_without_metric=1"),
    (dict(save_interval_s=0), "save_interval_s=0"),
    (dict(save_interval_s=math.inf), "save_interval_s=inf"),
    (dict(save_every=None), "save_every=None"),
    (dict(preemption="yes"), "preemption='yes'"),
])
def test_bad_policy_options_are_refused(tmp_path, kwargs, match):
    with pytest.raises(CkptError, match=match.replace("(", r"\(")):
        _manager(tmp_path / "run", **kwargs)
    assert not os.path.exists(tmp_path / "run")


# ------------------------------------------------------------------ metrics and metadata


def test_metrics_and_metadata_stored_with_the_step(tmp_path):
    d = tmp_path / "run"
    mgr = _manager(d, keep_last=None)
    config = {"lr": 3e-4, "layers": [4, 8], "pair": (1, "a"), "name": "gpt", "seed": None,
              "big": 2 ** 70, "nested": {"ok": True}}
    mgr.save(1, _state(1), metrics={"loss": torch.tensor(0.25), "acc": 1, "bad": math.nan,
                                    "top": -math.inf}, metadata={"config": config})
    mgr.save(2, _state(2))  # without: empty dicts, as a checkpoint from before issue 30
    got = mgr.metadata(1)
    assert got["metrics"]["loss"] == 0.25 and got["metrics"]["acc"] == 1
    assert math.isnan(got["metrics"]["bad"]) and got["metrics"]["top"] == -math.inf
    assert got["metadata"] == {"config": config | {"pair": [1, "a"]}}
    assert abs(got["created_unix"] - time.time()) < 600
    assert mgr.metadata() == mgr.metadata(2)  # the newest
    assert mgr.metadata(2)["metrics"] == {} and mgr.metadata(2)["metadata"] == {}
    with pytest.raises(CheckpointNotFoundError, match=r"no committed step 3 .*holds \[1, 2\]"):
        mgr.metadata(3)  # never saved (or removed by retention): the steps there are named
    # readable with nothing but the manifest: the data files gone
    for name in os.listdir(mgr.path(1)):
        if name.startswith("data-"):
            os.unlink(os.path.join(mgr.path(1), name))
    assert ckptio.read_metadata(mgr.path(1))["metadata"] == got["metadata"]
    # it is in the manifest's meta (the CRC covers it: an altered byte is refused)
    manifest = os.path.join(mgr.path(2), "manifest.json")
    with open(manifest, "rb") as f:
        _header, body = f.read().split(b"\n", 1)
    assert "metadata" not in json.loads(body)["meta"]
    with open(os.path.join(mgr.path(1), "manifest.json"), "rb") as f:
        data = f.read()
    assert json.loads(data.split(b"\n", 1)[1])["meta"]["metrics"]["bad"] == "nan"
    with open(os.path.join(mgr.path(1), "manifest.json"), "wb") as f:
        f.write(data.replace(b'"gpt"', b'"gpu"'))
    with pytest.raises(ManifestError, match="CRC-32"):
        ckptio.read_metadata(mgr.path(1))
    with pytest.raises(CkptError, match="no committed checkpoint|does not exist|no checkpoint"):
        ckptio.read_metadata(tmp_path / "nowhere")
    mgr.close()


def test_checkpointer_save_takes_metadata_too(tmp_path):
    ck = Checkpointer(OPTS)
    ck.save(_state(1), tmp_path / "a", metrics={"loss": 1.5}, metadata={"epoch": 3})
    ck.async_save(_state(2), tmp_path / "b", metadata={"epoch": 4}).wait()
    ck.close()
    assert ckptio.read_metadata(tmp_path / "a") | {"created_unix": 0} == {
        "metrics": {"loss": 1.5}, "metadata": {"epoch": 3}, "created_unix": 0}
    assert ckptio.read_metadata(str(tmp_path / "b"))["metadata"] == {"epoch": 4}
    loaded = ckptio.load(tmp_path / "a")  # the checkpoint itself loads as ever
    assert loaded["step"] == 1 and torch.equal(loaded["w"], torch.full((256,), 1.0))


@pytest.mark.parametrize("kwargs, match", [
    (dict(metrics={"loss": "low"}), r"metrics\['loss'\] = 'low' is not a number"),
    (dict(metrics={"loss": True}), r"metrics\['loss'\] = True is not a number"),
    (dict(metrics={"loss": torch.ones(3)}), r"metrics\['loss'\]"),
    (dict(metrics={1: 0.5}), "key 1 is not a str"),
    (dict(metrics=[("loss", 1.0)]), "a dict of str keys"),
    (dict(metadata={"cfg": {"lr": math.nan}}), r"metadata\['cfg'\]\['lr'\] = nan"),
    (dict(metadata={"cfg": {2: 1}}), r"metadata\['cfg'\] has key 2"),
    (dict(metadata={"path": {1, 2}}), r"metadata\['path'\] is a set"),
    (dict(metadata={"blob": "x" * (2 << 20)}), "more than 1048576"),
    (dict(metadata={"n": [10 ** 5000]}), r"metadata\['n'\]\[0\] is an int of 16610 bits"),
    (dict(metrics={"n": 1 << 300}), r"metrics\['n'\] is an int of 301 bits"),
])
def test_bad_metrics_and_metadata_are_refused_before_anything_is_written(tmp_path, kwargs, match):
    mgr = _manager(tmp_path / "run")
    mgr.save(1, _state(1))
    with pytest.raises(CkptError, match=match):
        mgr.save(2, _state(2), **kwargs)
    with pytest.raises(CkptError, match=match):
        Checkpointer(OPTS).save(_state(2), tmp_path / "direct", **kwargs)
    assert _entries(tmp_path / "run") == ["step-1"] and not os.path.exists(tmp_path / "direct")
    assert mgr.restore({"w": torch.zeros(256), "step": -1}) == 1
    mgr.close()


# ------------------------------------------------------------------ a time interval


def test_save_interval_s_alone_and_with_save_every(tmp_path):
    mgr = _manager(tmp_path / "run", save_interval_s=0.4, keep_last=None)  # time only
    assert mgr.save_every is None
    assert not mgr.should_save(1) and mgr.save(1, _state(1)) is None
    time.sleep(0.5)
    assert mgr.should_save(2)
    assert mgr.save(2, _state(2)) is not None  # the clock restarts when a save starts
    assert not mgr.should_save(3) and not mgr.should_save(100)
    time.sleep(0.5)
    assert mgr.save(4, _state(4)) is not None  # save() asks the clock itself
    mgr.close()
    assert mgr.steps() == [2, 4]
    both = _manager(tmp_path / "both", save_every=5, save_interval_s=3600)
    assert [s for s in range(1, 12) if both.should_save(s)] == [5, 10]
    both.close()


# ------------------------------------------------------------------ preemption

CHILD = r"""
import os, sys, time, torch
from ckptio import Options
from ckptio.managing.manager import CheckpointManager

root, progress = sys.argv[1], sys.argv[2]
mgr = CheckpointManager(root, save_every=4, keep_last=2, preemption=True,
                        options=Options(buffer_bytes=1 << 20, pool_bytes=4 << 20))
w = torch.zeros(1 << 16)
for step in range(1, 100_000):
    w += 1  # a training step
    time.sleep(0.01)
    mgr.save(step, {"w": w, "step": step}, asynchronous=True, metrics={"loss": 1.0 / step})
    with open(progress, "w") as f:
        f.write(str(step))
    if mgr.reached_preemption(step):
        mgr.close()   # finishes the async save of this step, applies retention
        print("preempted at", step, flush=True)
        sys.exit(0)
print("never preempted", flush=True)
sys.exit(3)
"""


def test_sigterm_to_a_training_process_commits_the_final_step(tmp_path):
    """A real SIGTERM to a real loop saving asynchronously every 4 steps: it saves the step it
    is at (not a multiple of 4, as it happens), finishes that save, exits 0; the step restores."""
    root, progress = tmp_path / "run", tmp_path / "progress"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(root), str(progress)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if progress.exists() and progress.read_text().strip() not in ("", "1", "2", "3",
                                                                            "4", "5"):
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out + err
    final = int(out.split("preempted at")[1])
    mgr = _manager(root, keep_last=2)
    assert mgr.latest() == final and mgr.incomplete() == []
    assert len(mgr.steps()) == 2  # keep_last=2, after close()
    state = {"w": torch.zeros(1 << 16), "step": -1}
    assert mgr.restore(state) == final
    assert state["step"] == final and torch.equal(state["w"], torch.full((1 << 16,), final * 1.0))
    assert mgr.metadata(final)["metrics"] == {"loss": 1.0 / final}
    mgr.close()


def test_preemption_handler_is_opt_in_and_put_back(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    plain = _manager(tmp_path / "a")
    assert signal.getsignal(signal.SIGTERM) == before and not plain.reached_preemption(1)
    plain.install_preemption_handler()
    assert signal.getsignal(signal.SIGTERM) != before
    plain.close()
    assert signal.getsignal(signal.SIGTERM) == before
    other = _manager(tmp_path / "b")
    for bad, match in (([signal.SIGKILL], "SIGKILL cannot be caught"), ([999], "signal numbers"),
                       ("TERM", "signal numbers")):
        with pytest.raises(CkptError, match=match):
            other.install_preemption_handler(bad)
        assert signal.getsignal(signal.SIGTERM) == before
    other.install_preemption_handler([signal.SIGUSR1])
    os.kill(os.getpid(), signal.SIGUSR1)
    assert other.reached_preemption(1) and other.should_save(1)
    other.close()
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    errors = []  # Python lets only the main thread install handlers: refused, clearly
    thread = threading.Thread(target=lambda: _refused(errors, tmp_path / "c"))
    thread.start()
    thread.join()
    assert len(errors) == 1 and "main thread" in errors[0], errors


def _refused(errors: list, directory) -> None:
    try:
        _manager(directory, preemption=True)
    except CkptError as exc:
        errors.append(str(exc))


# ------------------------------------------------------------------ retention, exactly


@pytest.mark.parametrize("asynchronous", [True, False])
def test_retention_keeps_exactly_keep_last_and_bounds_the_disk(tmp_path, asynchronous):
    """After close(): exactly keep_last committed steps and nothing else. Meanwhile at most
    keep_last + 2 step directories (async: the one being written, the one being dropped) or
    keep_last + 1 (sync), hidden ones included: what the docstring promises."""
    d = tmp_path / "run"
    mgr = _manager(d, keep_last=2)
    peak = 0
    for step in range(1, 9):
        mgr.save(step, _state(step), asynchronous=asynchronous)
        peak = max(peak, len(_entries(d)))
    mgr.wait()  # the last save committed, its retention applied: exactly 2 listed
    assert mgr.steps() == [7, 8] and mgr.incomplete() == []
    mgr.close()  # and the removals finished: nothing else on disk
    assert mgr.steps() == [7, 8] and _entries(d) == ["step-7", "step-8"]
    assert peak <= (4 if asynchronous else 3), peak


def test_status_names_the_steps_kept_beyond_keep_last_and_why(tmp_path):
    """A restored step stays until a newer one is verified, and status() says so; then it
    goes. (A delta's base: tests/test_delta_manager.py shows its row's pin.)"""
    d = tmp_path / "run"
    with _manager(d, keep_last=2) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step))
    with _manager(d, keep_last=2) as mgr:
        state = _state(0)
        assert mgr.restore(state, step=2) == 2
        for step in (4, 5):
            mgr.save(step, _state(step))
        assert mgr.steps() == [2, 4, 5]
        (tier,) = mgr.status()
        assert tier["pinned"] == {2: "restored or verified last (kept until a newer step is)"}
        mgr.verify(5)
        mgr.save(6, _state(6))
        assert mgr.steps() == [5, 6] and mgr.status()[0]["pinned"] == {}


# ------------------------------------------------------------------ two ranks


def test_two_ranks_agree_on_a_preemption_only_one_of_them_received(tmp_path):
    out = run_ranks(2, cases.preempted_by_one_rank, str(tmp_path / "run"))
    for rank, got in enumerate(out):
        assert got["seen"] == [False, False, True], (rank, got)
        assert got["saved"] == [3] and got["steps"] == [3], (rank, got)
        assert got["handler_back"], rank


@pytest.mark.parametrize("sleeper", [0, 1])
def test_two_ranks_take_rank_0s_clock(tmp_path, sleeper):
    out = run_ranks(2, cases.clock_of_rank_0, str(tmp_path / "run"), sleeper)
    want = sleeper == 0  # due only where rank 0's clock says so
    assert [got["due"] for got in out] == [[want], [want]]
    assert [got["saved"] for got in out] == [want, want]


def test_two_ranks_keep_the_best_by_rank_0s_metrics(tmp_path):
    out = run_ranks(2, cases.best_by_rank_0, str(tmp_path / "run"))
    for rank, got in enumerate(out):
        assert got["steps"] == [2, 4], (rank, got)  # rank 0's best loss (1.0) and the newest
        assert got["meta"]["metrics"] == {"loss": 1.0} and got["meta"]["metadata"] == {"rank": 0}
