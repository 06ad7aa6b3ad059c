"""Known suspected defects, reproduced through the public API and pinned: a slower tier's drain
copy that fails leaves no empty step directory behind (listed as an incomplete step); a failed
first save into a new directory leaves none either; a DCP checkpoint whose values include
objects only unpickling loads opens (its tensors load, the pickled keys are named with the
opt-in, and with it every value is exact), through the API and the CLI; and close(timeout=...)
on three gloo ranks while one rank's async save is held at an fsync (found sound, pinned): every
rank raises SaveTimeoutError within the time, none hangs in a collective, and the save commits
once the fsync returns."""

from __future__ import annotations

import datetime
import fractions
import os
import time
import warnings
from typing import Any

import pytest
import torch

import ckptio
from ckptio import Tier
from ckptio.storage.local.local_store import LocalStore
from ckptio.testing.cli_process import run_cli
from ckptio.testing.faults import FaultyBackend, inject
from ckptio.testing.rank_processes import run_ranks

MiB = 1 << 20


def _tree(path: str) -> dict[str, list[str]]:
    return {os.path.relpath(root, path): sorted(files) for root, _dirs, files in os.walk(path)}


@pytest.mark.parametrize("fault", ["fail_write", "fail_close"])
def test_a_failed_drain_copy_leaves_no_empty_step_in_the_slower_tier(tmp_path, fault):
    fast, slow = str(tmp_path / "fast"), str(tmp_path / "slow")
    mgr = ckptio.CheckpointManager(tiers=[Tier(fast, keep_last=3), Tier(slow, keep_last=3)])
    try:
        mgr.save(1, {"w": torch.ones(MiB)})
        assert mgr.drained(timeout=60) is True
        faulty = mgr._drain._resources[1].wrap_backend(  # tier 1's drain staging, backend
            LocalStore("."), lambda b: FaultyBackend(b, **{fault: 1}, match=slow,
                                                     error="enospc"))
        mgr.save(2, {"w": torch.full((MiB,), 2.0)})
        with pytest.raises(ckptio.StorageIOError, match="step-2.*No space left") as caught:
            mgr.drained(timeout=60)
        assert faulty.injected, "the fault was not reached"
        assert "free space" in str(caught.value)
        assert "step-2" not in os.listdir(slow), _tree(slow)
        mgr.save(3, {"w": torch.full((MiB,), 3.0)})
    finally:
        mgr.close()
    assert sorted(n for n in os.listdir(slow) if n.startswith("step-")) == ["step-1", "step-3"]
    out = {"w": torch.zeros(MiB)}
    ckptio.load(os.path.join(slow, "step-3"), out)
    assert torch.equal(out["w"], torch.full((MiB,), 3.0))


def test_a_failed_first_save_into_a_new_directory_leaves_no_empty_directory(tmp_path):
    target = str(tmp_path / "ckpt" / "step-5")
    ck = ckptio.Checkpointer()
    try:
        inject(ck, fail_write=1, error="enospc")
        with pytest.raises(ckptio.StorageIOError, match="No space left"):
            ck.save({"w": torch.ones(MiB)}, target)
        assert not os.path.exists(target)
        ck.save({"w": torch.ones(MiB)}, target)  # the fault fired once: the retry lands
    finally:
        ck.close()
    out = {"w": torch.zeros(MiB)}
    ckptio.load(target, out)
    assert torch.equal(out["w"], torch.ones(MiB))


# ------------------------------------------------------------------ DCP values that are pickled


def _dcp_state() -> dict[str, Any]:
    """A DCP state whose values include objects torch.load(weights_only=True) refuses (an
    importable class's instances: DCP pickles every non-tensor value)."""
    return {"w": torch.arange(12.0).reshape(3, 4), "step": 7, "name": "run-a",
            "lrs": {"g0": 0.1, "g1": 0.25}, "frac": fractions.Fraction(1, 3),
            "nested": {"t": torch.ones(2), "when": datetime.timedelta(seconds=5), "n": 5}}


def _empty() -> dict[str, Any]:
    return {"w": torch.zeros(3, 4), "step": 0, "name": "", "lrs": {"g0": 0.0, "g1": 0.0},
            "frac": None, "nested": {"t": torch.zeros(2), "when": None, "n": 0}}


@pytest.mark.parametrize("writer", ["dcp", "ckptio"])
def test_a_dcp_checkpoint_with_pickled_values_opens_and_names_them(tmp_path, writer):
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: no process group, one process assumed
        if writer == "dcp":
            dcp.save(_dcp_state(), checkpoint_id=path)
        else:
            dcp.save(_dcp_state(), storage_writer=ckptio.DcpWriter(path))
    # the tensors (and the plain values) load without unpickling anything
    out = {"w": torch.zeros(3, 4), "step": 0, "nested": {"t": torch.zeros(2)}}
    ckptio.load(path, out, strict=False)
    assert torch.equal(out["w"], _dcp_state()["w"]) and out["step"] == 7
    assert torch.equal(out["nested"]["t"], torch.ones(2))
    # the pickled ones are named, with the opt-in
    with pytest.raises(ckptio.PickleRefusedError) as caught:
        ckptio.load(path, _empty())
    assert "'frac'" in str(caught.value) and "'nested.when'" in str(caught.value)
    assert "allow_pickle=True" in str(caught.value)
    # with the opt-in, every value exact
    state = _empty()
    ckptio.load(path, state, allow_pickle=True)
    want = _dcp_state()
    assert torch.equal(state.pop("w"), want.pop("w"))
    assert torch.equal(state["nested"].pop("t"), want["nested"].pop("t"))
    assert state == want
    assert ckptio.verify(path) > 0


def test_the_cli_on_a_dcp_checkpoint_with_pickled_values(tmp_path):
    import torch.distributed.checkpoint as dcp

    path, out = str(tmp_path / "dcp"), str(tmp_path / "out")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_dcp_state(), checkpoint_id=path)
    listed = run_cli("ls", path)
    assert listed.returncode == 0 and "frac" in listed.stdout, listed.stderr
    assert run_cli("verify", path).returncode == 0
    refused = run_cli("convert", path, out)
    assert refused.returncode != 0 and "'frac'" in refused.stderr
    assert "allow_pickle" in refused.stderr
    done = run_cli("convert", "--allow-pickle", path, out)
    assert done.returncode == 0, done.stderr
    state = ckptio.load(out, allow_pickle=True)
    assert state["frac"] == fractions.Fraction(1, 3) and state["nested"]["n"] == 5
    assert state["nested"]["when"] == datetime.timedelta(seconds=5)


# ------------------------------------------------------------------ close(timeout) with a rank stuck


def _close_with_one_rank_stuck(rank: int, world: int, root: str, use_manager: bool) -> dict[str, Any]:
    """Save step 1, then save step 2 in the background with rank 1's first data fsync held;
    close(timeout=2) on every rank -> what each close raised and how long it took; then rank
    1's fsync goes on, every rank closes again and lists the committed steps."""
    import threading

    from ckptio.testing.faults import FsyncGate

    opts = ckptio.Options(buffer_bytes=MiB, pool_bytes=4 * MiB)
    reached, go = threading.Event(), threading.Event()
    state = {"w": torch.full((MiB // 4,), float(rank))}
    out: dict[str, Any] = {}
    if use_manager:
        saver = ckptio.CheckpointManager(root, options=opts)
        saver.save(1, state)
        ck = saver._ck
    else:
        saver = ck = ckptio.Checkpointer(options=opts)
        ck.save(state, os.path.join(root, "step-1"))
    if rank == 1:
        ck.resources().wrap_backend(LocalStore("."), lambda b: FsyncGate(b, reached, go, 60))
    if use_manager:
        saver.save(2, state, asynchronous=True)
    else:
        ck.async_save(state, os.path.join(root, "step-2"))
    began = time.monotonic()
    try:
        saver.close(timeout=2)
        out["first"] = "returned"
    except ckptio.CkptError as exc:
        out["first"] = f"{type(exc).__name__}: {exc}"
    out["first_s"] = time.monotonic() - began
    go.set()
    saver.close(timeout=60)
    out["steps"] = sorted(n for n in os.listdir(root) if n.startswith("step-")
                          and os.path.exists(os.path.join(root, n, "manifest.json")))
    return out


@pytest.mark.parametrize("use_manager", [True, False], ids=["manager", "checkpointer"])
def test_close_with_a_timeout_while_one_rank_is_stuck_returns_on_every_rank(tmp_path,
                                                                           use_manager):
    root = str(tmp_path / "ckpts")
    outs = run_ranks(3, _close_with_one_rank_stuck, root, use_manager, timeout_s=120)
    for rank, out in enumerate(outs):
        assert out["first_s"] < 15, (rank, out)
        assert out["first"].startswith("SaveTimeoutError"), (rank, out)
        assert out["steps"] == ["step-1", "step-2"], (rank, out)
    assert "rank 1" in outs[1]["first"] and "fsync" in outs[1]["first"], outs[1]
