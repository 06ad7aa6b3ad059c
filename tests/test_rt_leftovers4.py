"""Leftovers of earlier rounds, played as a user would (real processes, the public API):

* a DeepSpeed ZeRO-3 tag holding files of two saves (one rank's file copied in from an older
  tag), or missing one rank's file, on 2 gloo ranks: the rank whose own files were whole went
  on into ZeRO-3's all-gather of its persistent parameters (stage3 checkpoint_event_epilogue)
  while the other refused, and ended on gloo's "connection closed" (a RuntimeError); now every
  rank refuses alike, before DeepSpeed reads anything, naming the tag, the other save's files
  (or the missing file) and the fix.
* a local checkpoint whose save lock a process on another host holds (shared storage): a load
  said "interrupted ... or still running" and advised an earlier checkpoint; now it names that
  host and pid, when the lock was taken and its file last written, and to check that job.
* torch_checkpointing's steps under a root a user registers (register_store(step_root=...)):
  a CheckpointManager's restore started fresh, warning of "interrupted saves", and a save of
  that step would put ckptio's files beside them; which steps hold one is now asked in one
  place (steproot.foreign_steps) for every root, and the StepRoot conformance suite checks it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
import warnings
from pathlib import Path

import pytest
import torch

import ckptio
from ckptio.options import Options
from ckptio.storage.local.local_store import LocalStore
from ckptio.testing.steproot_check_tools import Roots
from user_steproot import DirRoot

os.environ.setdefault("DS_ACCELERATOR", "cpu")

LIMIT_S = 240
LOAD_BOUND_S = 60  # a refusal before DeepSpeed reads anything: seconds, not gloo's timeout

# ------------------------------------------------------------------ DeepSpeed, on the ranks


def zero3_two_saves(rank: int, world_size: int, root: str) -> None:
    """ZeRO-3: tags global_step3 and global_step5 (deepspeed_cases' engine) through ckptio."""
    import deepspeed_cases as cases

    import ckptio.deepspeed_engine

    engine = cases.engine_for(3, world_size)
    ckptio.deepspeed_engine.use(engine, allow_pickle=True)
    cases.train(engine, 3)
    engine.save_checkpoint(root)
    cases.train(engine, 2)
    engine.save_checkpoint(root)
    engine.destroy()


def zero3_loads(rank: int, world_size: int, root: str, tags: list[str]) -> list[str]:
    """A fresh ZeRO-3 engine's load_checkpoint(root, tag) for each tag -> what it raised
    (``module.Type: message``, with the seconds it took) or 'loaded'. The rank stays alive
    after an error (a job catching it): a peer left in a collective would wait for it."""
    import deepspeed_cases as cases

    import ckptio.deepspeed_engine

    out = []
    for tag in tags:
        engine = cases.engine_for(3, world_size)
        ckptio.deepspeed_engine.use(engine, allow_pickle=True)
        began = time.monotonic()
        try:
            engine.load_checkpoint(root, tag=tag)
            said = "loaded"
        except Exception as exc:  # noqa: BLE001 - the test reads which error it was
            said = f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
        out.append(f"[{time.monotonic() - began:.1f} s] {said}")
    torch.distributed.barrier()
    return out


def test_deepspeed_zero3_tag_of_two_saves_is_refused_alike_on_every_rank(
        tmp_path: Path) -> None:
    """ZeRO-3 on 2 gloo ranks, tags global_step3 and global_step5; copies of global_step5 with
    one file put back from global_step3 (rank 1's optimizer file; rank 0's model file), and
    with rank 1's optimizer file missing, or never committed (its manifest gone). Every rank
    raises an IncompleteCheckpointError within seconds naming the tag, the other save's file
    (or the missing one) and the fix. Before, the rank whose own files were whole went on into
    ZeRO-3's all-gather: gloo's 'Connection closed by peer' RuntimeError once the refusing
    rank exited, or a wait for gloo's timeout while it lived on (here, its next engine)."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    from ckptio.testing.rank_processes import run_ranks

    root = tmp_path / "ds"
    run_ranks(2, zero3_two_saves, str(root), timeout_s=LIMIT_S)
    swapped = {"mixed-optim1": "zero_pp_rank_1_mp_rank_00_optim_states.pt",
               "mixed-model0": "zero_pp_rank_0_mp_rank_00_model_states.pt"}
    for tag, name in swapped.items():
        shutil.copytree(root / "global_step5", root / tag)
        shutil.rmtree(root / tag / name)
        shutil.copytree(root / "global_step3" / name, root / tag / name)
    cut = {"missing-optim1": "", "uncommitted-optim1": "manifest.json"}  # the file, its manifest
    for tag, part in cut.items():
        shutil.copytree(root / "global_step5", root / tag)
        gone = root / tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt" / part
        shutil.rmtree(gone) if gone.is_dir() else gone.unlink()
    said = run_ranks(2, zero3_loads, str(root), [*swapped, *cut, "global_step5"],
                     timeout_s=LIMIT_S)
    for rank in (0, 1):
        for i, tag in enumerate([*swapped, *cut]):
            text = said[rank][i]
            seconds = float(text[1:text.index(" s]")])
            assert "ckptio.errors.IncompleteCheckpointError" in text, (rank, text)
            assert seconds < LOAD_BOUND_S, (rank, text)
            assert f"DeepSpeed tag {tag!r}" in text and "tag=..." in text, (rank, text)
            assert "global_step3" in text, (rank, text)  # the tags there, named
            if tag in swapped:
                assert f"['{swapped[tag]}'] from the one at global_steps=3" in text, text
                assert "global_steps=5" in text and "put back" in text, (rank, text)
            else:
                assert f"{tag}/zero_pp_rank_1_mp_rank_00_optim_states.pt is missing" in text \
                    or "was never committed" in text, (rank, text)
        assert said[rank][-1].endswith("loaded"), said[rank][-1]


# ------------------------------------------------------------------ a lock held on another host


def _leftovers(where: Path) -> None:
    """A save's files without its commit, as a save cut short (or still running) leaves."""
    ckptio.save({"w": torch.ones(64), "step": 2}, where)
    (where / "manifest.json").unlink()


def test_load_beside_a_save_lock_of_another_host_names_that_host_pid_and_age(
        tmp_path: Path) -> None:
    """Shared storage: a save by another host (its lock file records that host and its pid,
    taken 90 s ago) has written files and no manifest. The load names the host, the pid, the
    lock's age and its file's, and says to check that job there; it neither calls the save
    interrupted nor advises deleting. A save into the path (no lock held: that host's save
    ended) replaces the files."""
    ck = tmp_path / "ck"
    _leftovers(ck)
    host = f"{socket.gethostname()}-other-node"
    since = time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(time.time() - 90))
    lock = ck / ".ckptio.lock"
    lock.write_text(json.dumps({"host": host, "boot": "b0", "pid": 4242, "start": 77,
                                "since": since}))
    os.utime(lock, (time.time() - 90, time.time() - 90))
    with pytest.raises(ckptio.IncompleteCheckpointError) as caught:
        ckptio.load(ck)
    said = str(caught.value)
    assert f"a save by host {host}, pid 4242" in said, said
    for part in ("took the lock 9", "last written 9", "check that job on that host",
                 "load an earlier checkpoint", str(ck)):
        assert part in said, (part, said)
    assert "interrupted before its commit, or is still running" not in said, said
    assert not any(w in said.lower() for w in ("delete", "rm -", "remove it")), said
    ckptio.save({"w": torch.zeros(64), "step": 3}, ck)
    assert ckptio.load(ck)["step"] == 3


def test_a_same_host_dead_holder_still_says_interrupted(tmp_path: Path) -> None:
    """The record of a process of this host and boot that is gone: still 'interrupted before
    its commit', naming how it is known (not the other-host wording)."""
    from ckptio.storage.holder import me

    ck = tmp_path / "ck"
    _leftovers(ck)
    record = {**me(), "pid": 2 ** 22 + 17, "start": 1}
    (ck / ".ckptio.lock").write_text(json.dumps(record))
    with pytest.raises(ckptio.IncompleteCheckpointError, match=r"interrupted before its commit "
                                                               r"\(its holder, pid \d+ on host"):
        ckptio.load(ck)


# ------------------------------------------------------------------ a root a user registers


def _register(scheme: str, base: Path) -> None:
    ckptio.register_store(scheme, lambda location, options: LocalStore(
        str(base / location.split("://", 1)[1])), replace=True,
        step_root=lambda location, options: DirRoot(location, base))


def test_user_root_conformance_finds_torch_checkpointing_steps(tmp_path: Path) -> None:
    """The conformance check (steproot.foreign_steps) on a user's root without ``foreign``:
    the steps holding torch_checkpointing's files are found through their Stores."""
    from ckptio.testing.steproot_checks import check_torch_checkpointing_steps_found

    def store_at(location: str) -> LocalStore:
        return LocalStore(str(tmp_path / location.split("://", 1)[1]))

    check_torch_checkpointing_steps_found(Roots(
        make=lambda key: DirRoot(f"conffs://{key}", tmp_path), store_at=store_at))


def test_torch_checkpointing_steps_under_a_user_root_are_named_not_started_over(
        tmp_path: Path) -> None:
    """torch_checkpointing saved step-200 through ckptio.tc_storage under a scheme the user
    registered with a step root: restore() names it and how to load or convert it (it
    returned None, warning of interrupted saves: a silent start from step 0); save(200) is
    refused (ckptio's files would go beside its own, deleted with the step by retention);
    restore(state, step=200) loads it."""
    pytest.importorskip("torch_checkpointing")
    from torch_checkpointing.checkpoint_manager import CheckpointManager
    from torch_checkpointing.config import SyncCheckpointSaverConfig

    from ckptio.tc_storage import CkptioStorageConfig

    _register("leftfs", tmp_path)
    run = "leftfs://job/run"
    torch.manual_seed(3)
    saved = {"model": torch.nn.Linear(4, 2).state_dict()}
    tc = CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig(),
                                                    storage_config=CkptioStorageConfig(run)))
    try:
        tc.save("step-200", saved)
    finally:
        tc.close()
    state = {"model": torch.nn.Linear(4, 2)}
    options = Options(buffer_bytes=1 << 20, pool_bytes=4 << 20)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "interrupted saves" warning either
        with ckptio.CheckpointManager(run, options=options) as mgr:
            with pytest.raises(ckptio.CheckpointNotFoundError) as caught:
                mgr.restore(state)
            said = str(caught.value)
            assert f"{run}/step-200 holds a torch_checkpointing checkpoint" in said, said
            assert "ckptio convert" in said and "restore(state, step=200)" in said, said
            with pytest.raises(ckptio.CkptError, match="holds a torch_checkpointing"):
                mgr.save(200, {"model": state["model"].state_dict()})
            assert mgr.restore(state, step=200) == 200
    assert torch.equal(state["model"].weight, saved["model"]["weight"])
    assert sorted(os.listdir(tmp_path / "job" / "run" / "step-200")) == ["model_0.pt"]
