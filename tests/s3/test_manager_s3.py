"""CheckpointManager on an s3:// prefix, against a real SeaweedFS server, as users run it: a
model, AdamW and an LR scheduler saved every step with keep_last=2 and resumed bitwise in a
fresh process; only the kept steps left on the server; falling back past a damaged newest step;
a retention killed half-way (markers and objects left) finished by the next one; a save into
a step whose removal is pending; incomplete steps listed, passed over and never deleted; what a
prefix without steps holds; two gloo ranks agreeing on steps, retention and fallback."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import textwrap
import warnings
from typing import Any

import pytest
import torch

import ckptio
from ckptio.storage.s3.s3path import S3Path
from ckptio.managing.manager import CheckpointManager
from ckptio.testing.rank_processes import run_ranks

import dist_cases as cases
from s3.s3_models import build, train

SMALL = ckptio.Options(buffer_bytes=5 << 20, pool_bytes=20 << 20)
HERE = os.path.dirname(os.path.abspath(__file__))


# ------------------------------------------------------------------ helpers


def _keys(s3_client: Any, url: str) -> list[str]:
    """Every object under ``url``, relative to it (straight from the server)."""
    where = S3Path.parse(url)
    out: list[str] = []
    for page in s3_client.get_paginator("list_objects_v2").paginate(
            Bucket=where.bucket, Prefix=where.dir_prefix):
        out += [o["Key"][len(where.dir_prefix):] for o in page.get("Contents", [])]
    return sorted(out)


def _holding(s3_client: Any, url: str) -> set[str]:
    """The first parts of the names under ``url`` that hold an object (SeaweedFS keeps listing
    emptied prefixes, so this is from the objects, not from CommonPrefixes)."""
    return {key.split("/", 1)[0] for key in _keys(s3_client, url)}


def _put(s3_client: Any, url: str, body: bytes = b"partial") -> None:
    where = S3Path.parse(url)
    s3_client.put_object(Bucket=where.bucket, Key=where.key, Body=body)


def _delete(s3_client: Any, url: str) -> None:
    where = S3Path.parse(url)
    s3_client.delete_object(Bucket=where.bucket, Key=where.key)


def _data_keys(s3_client: Any, url: str) -> list[str]:
    return [k for k in _keys(s3_client, url) if k.startswith("data-")]


def _state(step: int, numel: int = 4096) -> dict[str, Any]:
    return {"w": torch.full((numel,), float(step)), "b": torch.arange(100) + step, "step": step}


def _blank(numel: int = 4096) -> dict[str, Any]:
    return {"w": torch.zeros(numel), "b": torch.zeros(100, dtype=torch.int64), "step": -1}


def _manager(url: str, **kwargs: Any) -> CheckpointManager:
    return CheckpointManager(url, options=SMALL, **kwargs)


def _saved(url: str, steps: list[int]) -> None:
    with _manager(url, keep_last=None) as mgr:
        for step in steps:
            mgr.save(step, _state(step))


def _same(a: Any, b: Any, where: str = "") -> None:
    """Bitwise equality of nested state dicts (tensors, lists, numbers)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            _same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


# ------------------------------------------------------------------ a training run


RESTORE = textwrap.dedent("""
    import sys, torch, ckptio
    sys.path.insert(0, sys.argv[2])
    from s3_models import build, train
    from ckptio.managing.manager import CheckpointManager
    model, opt, sched = build()
    state = {"model": model, "opt": opt, "sched": sched, "rng": ckptio.RNGState(), "step": 0}
    options = ckptio.Options(buffer_bytes=5 << 20, pool_bytes=20 << 20)
    with CheckpointManager(sys.argv[1], keep_last=2, options=options) as mgr:
        steps = mgr.steps()
        restored = mgr.restore(state)
    snapshot = {"steps": steps, "restored": restored, "step": state["step"],
                "model": model.state_dict(), "opt": opt.state_dict(),
                "sched": sched.state_dict()}
    torch.save(snapshot, sys.argv[3])
    train(model, opt, sched, 2)
    torch.save(model.state_dict(), sys.argv[4])
""")


def test_training_resumes_the_latest_step_in_a_fresh_process_and_only_two_are_kept(
        s3_env, s3_client, tmp_path):
    url = f"{s3_env}/run-7"
    model, opt, sched = build()
    with _manager(url, keep_last=2) as mgr:
        for step in range(1, 6):
            train(model, opt, sched, 1)
            state = {"model": model, "opt": opt, "sched": sched, "rng": ckptio.RNGState(),
                     "step": step}
            mgr.save(step, state, asynchronous=step % 2 == 0)  # 2, 4: async, retained later
        assert mgr.path(5) == f"{url}/step-5"
        expected = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(),
                                  "sched": sched.state_dict()})  # they hold live tensors
    assert _holding(s3_client, url) == {"step-4", "step-5"}
    assert not [k for k in _keys(s3_client, url) if k.endswith(".deleting")]
    train(model, opt, sched, 2)  # the uninterrupted run

    snapshot, after = tmp_path / "restored.pt", tmp_path / "after.pt"
    subprocess.run([sys.executable, "-c", RESTORE, url, HERE, str(snapshot), str(after)],
                   check=True, env=os.environ.copy(), timeout=180)
    got = torch.load(snapshot)
    assert got["steps"] == [4, 5] and got["restored"] == 5 and got["step"] == 5
    for part in ("model", "opt", "sched"):
        _same(got[part], expected[part], part)
    for key, value in torch.load(after).items():  # the RNG came back too: same batches
        assert torch.equal(value, model.state_dict()[key]), key


def test_restore_falls_back_past_a_damaged_newest_step_and_the_step_can_be_saved_again(
        s3_env, s3_client):
    url = f"{s3_env}/run"
    with _manager(url, keep_last=2) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step))
    (data,) = _data_keys(s3_client, f"{url}/step-3")
    _delete(s3_client, f"{url}/step-3/{data}")

    mgr = _manager(url, keep_last=2)
    state = _blank()
    with pytest.warns(UserWarning, match=r"restored step 2 from .*, not a newer one: step 3:"):
        assert mgr.restore(state) == 2
    _same(state, _state(2))
    assert mgr.steps() == [2, 3]  # the damaged step is left in place
    mgr.save(3, _state(3))  # found damaged in this process: replaced
    state = _blank()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mgr.restore(state) == 3
    _same(state, _state(3))
    mgr.close()
    assert _holding(s3_client, url) == {"step-2", "step-3"}


# ------------------------------------------------------------------ removal


KILLED = textwrap.dedent("""
    import os, signal, sys, torch, ckptio
    from ckptio.managing.manager import CheckpointManager
    from ckptio.storage.s3.root import S3Root

    real = S3Root._delete

    def killed_half_way(self, keys, url):
        if any("/data-" in k for k in keys):  # the first step's data: delete one, then die
            real(self, keys[:1], url)
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, keys, url)

    S3Root._delete = killed_half_way
    mgr = CheckpointManager(sys.argv[1], keep_last=1,
                            options=ckptio.Options(buffer_bytes=5 << 20, pool_bytes=20 << 20))
    mgr.save(4, {"w": torch.full((4096,), 4.0), "b": torch.arange(100) + 4, "step": 4})
    mgr.close()  # joins the removal, which dies half-way
    print("not killed")
""")


def test_a_retention_killed_half_way_is_finished_by_the_next_one(s3_env, s3_client):
    url = f"{s3_env}/run"
    _saved(url, [1, 2, 3])
    proc = subprocess.run([sys.executable, "-c", KILLED, url], capture_output=True, text=True,
                          check=False, env=os.environ.copy(), timeout=180)
    assert proc.returncode == -signal.SIGKILL, proc.stderr + proc.stdout
    keys = _keys(s3_client, url)
    for step in (1, 2, 3):  # all marked and uncommitted before any removal began
        assert f"step-{step}/.deleting" in keys and f"step-{step}/manifest.json" not in keys
    assert _data_keys(s3_client, f"{url}/step-1") == []  # half-way: step 1's data went,
    assert all(_data_keys(s3_client, f"{url}/step-{s}") for s in (2, 3))  # not 2's and 3's

    mgr = _manager(url, keep_last=1)
    assert mgr.steps() == [4] and mgr.incomplete() == []  # nothing half-deleted is listed
    state = _blank()
    assert mgr.restore(state) == 4 and state["step"] == 4
    mgr.save(5, _state(5))  # the next retention finishes the leftovers
    mgr.close()
    assert mgr.steps() == [4, 5]  # 4: restored, so kept as verified
    assert _holding(s3_client, url) == {"step-4", "step-5"}
    assert not [k for k in _keys(s3_client, url) if k.endswith(".deleting")]


def test_a_marker_left_before_the_manifest_went_hides_the_step_until_finished(
        s3_env, s3_client):
    """A kill between the marker's PUT and the manifest's DELETE: still committed underneath,
    hidden all the same, and removed whole by the next retention."""
    url = f"{s3_env}/run"
    _saved(url, [1, 2])
    _put(s3_client, f"{url}/step-1/.deleting")
    mgr = _manager(url, keep_last=5)
    assert mgr.steps() == [2] and mgr.incomplete() == []
    mgr.save(3, _state(3))
    mgr.close()
    assert _holding(s3_client, url) == {"step-2", "step-3"}


def test_a_save_into_a_step_whose_removal_is_pending_finishes_the_removal_first(
        s3_env, s3_client):
    url = f"{s3_env}/run"
    _saved(url, [1])
    (old,) = _data_keys(s3_client, f"{url}/step-1")
    _put(s3_client, f"{url}/step-1/.deleting")  # a retention killed right after marking it
    with _manager(url, keep_last=None) as mgr:
        assert mgr.steps() == []
        mgr.save(1, _state(11))  # not refused as committed, and not hidden by the marker
        assert mgr.steps() == [1]
    keys = _keys(s3_client, f"{url}/step-1")
    assert ".deleting" not in keys and f"{old}" not in keys and "manifest.json" in keys
    assert ckptio.load(f"{url}/step-1")["step"] == 11


def test_incomplete_steps_are_listed_passed_over_and_never_deleted(s3_env, s3_client):
    url = f"{s3_env}/run"
    partial = "data-0-r00000-0000.bin"
    _put(s3_client, f"{url}/step-1/{partial}")  # an interrupted save
    for name in ("step-007/x", "steps/x", "step-x/x", "step-8"):  # not steps (step-8: a file)
        _put(s3_client, f"{url}/{name}")
    mgr = _manager(url, keep_last=2)
    assert mgr.steps() == [] and mgr.incomplete() == [1]
    for step in (2, 3, 4, 5):
        mgr.save(step, _state(step))
    assert mgr.steps() == [4, 5] and mgr.incomplete() == [1]
    with pytest.raises(ckptio.CkptError, match="step 5 already has a committed checkpoint"):
        mgr.save(5, _state(99))
    _put(s3_client, f"{url}/step-9/{partial}")  # newer, and incomplete
    state = _blank()
    with pytest.warns(UserWarning, match="restored step 5 .* step 9: incomplete"):
        assert mgr.restore(state) == 5
    assert state["step"] == 5 and mgr.incomplete() == [1, 9]
    mgr.save(6, _state(6))
    mgr.close()
    assert _holding(s3_client, url) == {"step-1", "step-9", "step-8", "step-5", "step-6",
                                        "step-007", "steps", "step-x"}
    assert _keys(s3_client, f"{url}/step-1") == [partial]
    assert _keys(s3_client, f"{url}/step-9") == [partial]
    assert _manager(url).steps() == [5, 6]


@pytest.mark.parametrize("holds", ["nothing", "other"])
def test_nothing_to_restore_under_a_prefix_returns_none(s3_env, s3_client, holds):
    """Nothing ever committed (an empty prefix, or only unrelated objects): restore() says so
    with None, the loop starts from scratch, and the unrelated object is left alone."""
    url = f"{s3_env}/run"
    if holds == "other":
        _put(s3_client, f"{url}/notes.txt")
    with _manager(url) as mgr:
        assert mgr.restore(_blank()) is None and mgr.latest() is None
    if holds == "other":
        assert _holding(s3_client, url) == {"notes.txt"}


@pytest.mark.parametrize("holds, expect", [
    ("ckptio", "is itself a ckptio checkpoint"),
    ("named", r"ckptio checkpoints not named step-<N> \(best\)"),
    ("torch", r"torch.save files \(model.pt\)"),
])
def test_no_step_to_restore_says_what_the_prefix_holds(s3_env, s3_client, holds, expect):
    url = f"{s3_env}/run"
    if holds == "ckptio":
        ckptio.save(_state(1), url, options=SMALL)
    elif holds == "named":
        ckptio.save(_state(1), f"{url}/best", options=SMALL)
    elif holds == "torch":
        _put(s3_client, f"{url}/model.pt")
    with _manager(url) as mgr, pytest.raises(ckptio.CheckpointNotFoundError, match=expect) as info:
        mgr.restore(_blank())
    assert url in str(info.value)


# ------------------------------------------------------------------ many ranks


def manager_ranks_s3(rank: int, world: int, env: dict[str, str], root: str) -> dict[str, Any]:
    """Both ranks save steps 1-3 (2 and 3 async, keep_last=2) and restore; then rank 0 deletes
    rank 1's data object of step 3 and both restore again: -> what each rank saw."""
    os.environ.update(env)  # ranks fork from a server started before the test set them
    import boto3

    from ckptio.storage.s3.root import S3Root

    hidden: list[int] = []  # steps this rank marked for removal
    hide = S3Root.hide

    def spy(self: S3Root, step: int) -> bool:
        hidden.append(step)
        return hide(self, step)

    S3Root.hide = spy  # type: ignore[method-assign]  # this rank's process only
    try:
        mgr = CheckpointManager(root, keep_last=2, options=SMALL)
        for step in (1, 2, 3):
            mgr.save(step, cases._manager_state(rank, world, step), asynchronous=step > 1)
        mgr.wait()
        steps = mgr.steps()
        restored, same, caught = [], [], []
        for damage in (False, True):
            if damage and rank == 0:
                where = S3Path.parse(mgr.path(3))
                s3 = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"])
                listed = s3.list_objects_v2(Bucket=where.bucket, Prefix=where.dir_prefix)
                (key,) = [o["Key"] for o in listed["Contents"] if "-r00001-" in o["Key"]]
                s3.delete_object(Bucket=where.bucket, Key=key)
            torch.distributed.barrier()
            state = cases._manager_state(rank, world, 0)
            with warnings.catch_warnings(record=True) as record:
                warnings.simplefilter("always")
                restored.append(mgr.restore(state))
            caught += [str(w.message) for w in record]
            want = cases._manager_state(rank, world, restored[-1])
            same.append(state["step"] == restored[-1] and all(
                torch.equal(cases.local(state["model"][n]), cases.local(want["model"][n]))
                for n in cases.SHAPES))
        mgr.close()
    finally:
        S3Root.hide = hide  # type: ignore[method-assign]
    return {"steps": steps, "hidden": hidden, "restored": restored, "same": same,
            "warnings": caught}


def test_two_ranks_agree_on_steps_retention_and_fallback(s3_server, s3_env, s3_client):
    url = f"{s3_env}/ranks"
    out = run_ranks(2, manager_ranks_s3, s3_server.env(), url, timeout_s=240)
    for rank, got in enumerate(out):
        assert got["steps"] == [2, 3], (rank, got)
        assert got["restored"] == [3, 2], (rank, got)  # whole, then past the damaged step 3
        assert got["same"] == [True, True], (rank, got)
        (message,) = got["warnings"]
        assert "restored step 2" in message and "step 3: rank 0: CorruptCheckpointError" in message
        assert "rank 1: CorruptCheckpointError" in message and "-r00001-" in message  # its data
    assert out[0]["hidden"] == [1] and out[1]["hidden"] == []  # only rank 0 removes
    assert _holding(s3_client, url) == {"step-2", "step-3"}
