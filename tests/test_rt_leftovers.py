"""Defects earlier red-team rounds left (rtleft).

(1) A job whose run directory another job took over (``take_over=True``) while it was still
    alive went on reporting successful saves that the other job's retention dropped: its next
    save, its wait() and its close() now raise CheckpointLockedError naming the taker's host
    and pid, saying this job's saves are not kept.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptio
from ckptio import CheckpointManager
from ckptio.errors import CheckpointLockedError
from ckptio.testing.cli_process import run_script

from s3.conftest import s3_env, s3_live, s3_server  # noqa: F401 - the S3 tests' fixtures

DEADLINE_S = 60  # a guard against a hang, not a timing check

TAKER = textwrap.dedent("""
    import os, torch, ckptio
    state = {"w": torch.zeros(64)}
    mgr = ckptio.CheckpointManager("run", save_every=1, keep_last=2, take_over=True)
    for step in range(10, 13):
        mgr.save(step, state)
    mgr.close()
    print("TAKER", os.getpid(), flush=True)
""")


def _take_over(cwd: Path) -> int:
    """Job B, started on ``cwd/run`` with take_over=True, saving three steps -> its pid."""
    script = cwd / "taker.py"
    script.write_text(TAKER)
    done = run_script(str(script), cwd=str(cwd), timeout=DEADLINE_S)
    assert done.returncode == 0 and done.stdout.startswith("TAKER"), done
    return int(done.stdout.split()[1])


@pytest.mark.parametrize("verb", ["save", "wait", "close"])
def test_a_job_taken_over_is_told_at_its_next_save_wait_or_close(tmp_path: Path,
                                                                  verb: str) -> None:
    os.chdir(tmp_path)
    mgr = CheckpointManager("run", save_every=1, keep_last=2)
    state = {"w": torch.ones(64)}
    mgr.save(1, state)
    if verb == "wait":
        mgr.save(2, state, asynchronous=True)
    taker = _take_over(tmp_path)
    try:
        with pytest.raises(CheckpointLockedError) as raised:
            if verb == "save":
                mgr.save(2, state)
            elif verb == "wait":
                mgr.wait()
            else:
                mgr.close()
        message = str(raised.value)
        assert f"pid {taker}" in message and "taken over" in message, message
        assert "not kept" in message, message
        if verb == "save":  # each save refused, not only the first
            with pytest.raises(CheckpointLockedError, match=f"pid {taker}"):
                mgr.save(3, state)
        assert sorted(os.listdir(tmp_path / "run"))[-2:] == ["step-11", "step-12"]
    finally:
        if verb != "close":
            mgr.close()  # told once: close() does not raise it again
    assert ckptio.CheckpointManager("run").steps()[-2:] == [11, 12]


def test_a_reader_made_with_take_over_that_never_saves_leaves_the_trainer_saving(
        tmp_path: Path) -> None:
    """(1) The documented reader of a live run (docs/MANAGER.md: take_over=True, never saves):
    it takes nothing from the training job, whose saves go on."""
    os.chdir(tmp_path)
    script = tmp_path / "reader.py"
    script.write_text(textwrap.dedent("""
        import torch, ckptio
        state = {"w": torch.zeros(64)}
        with ckptio.CheckpointManager("run", take_over=True) as mgr:
            print("READ", mgr.restore(state), flush=True)
    """))
    with CheckpointManager("run", save_every=1, keep_last=2) as mgr:
        mgr.save(1, {"w": torch.ones(64)})
        done = run_script(str(script), cwd=str(tmp_path), timeout=DEADLINE_S)
        assert done.stdout.strip() == "READ 1", done
        mgr.save(2, {"w": torch.ones(64)})
        assert mgr.steps() == [1, 2]


def _flip(step_dir: Path) -> None:
    data = min(step_dir.glob("data-*"))
    with open(data, "r+b") as f:
        f.seek(64)
        byte = f.read(1)
        f.seek(64)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_failing_drain_at_close_still_runs_the_last_retention(shm: str, tmp_path: Path
                                                                 ) -> None:
    """(2) Step 5, due on disk, damaged in memory before the drain copies it: close() raised
    the drain's error before the last retention pass, and the memory tier kept more than
    keep_last steps. Now retention runs, then the error is raised once."""
    tiers = [ckptio.Tier("shm://run", keep_last=2),
             ckptio.Tier(str(tmp_path / "disk"), every=5, keep_last=1)]
    mgr = CheckpointManager(tiers=tiers, drain_rate=1.0)  # a byte a second: step 5 waits
    state = {"w": torch.zeros(1 << 16)}
    for step in range(1, 9):
        state["w"].fill_(step)
        mgr.save(step, state)
        if step == 5:
            _flip(Path(mgr.path(5)))
    with pytest.raises(ckptio.CkptError) as raised:
        mgr.close()
    assert "step 5" in str(raised.value) or "step-5" in str(raised.value), raised.value
    assert sorted(os.listdir(os.path.join(shm, "run"))) == ["step-7", "step-8"]


@pytest.fixture()
def titan() -> Any:
    """tests/test_torchtitan.py's Job (skipped without TorchTitan)."""
    pytest.importorskip("torchtitan.components.checkpointer.base")
    import test_torchtitan

    return test_torchtitan


@pytest.mark.parametrize("model_only", [True, False])
def test_torchtitan_initial_load_of_a_changed_model_names_torchtitans_options(
        titan: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model_only: bool) -> None:
    """(4) A layer added since the save, the step given as --checkpoint.initial_load_path of a
    new folder: the message suggested only load()'s strict=False, which a TorchTitan user
    cannot pass. Now it names the key and the TorchTitan options that help."""
    job = titan.Job(tmp_path / "a")
    for _ in range(2):
        job.step()
    job.checkpointer.close()
    monkeypatch.setattr(titan, "DIMS", (12, 30, 17, 5, 5))
    again = titan.Job(tmp_path / "b", initial_load_model_only=model_only,
                      initial_load_path=str(tmp_path / "a" / "checkpoint" / "step-2"))
    with pytest.raises(ckptio.StateMismatchError) as caught:
        again.checkpointer.load()
    said = str(caught.value)
    assert "6.weight" in said and "--checkpoint.initial_load_path" in said, said
    assert ("--checkpoint.initial_load_model_only" in said) is not model_only, said
    again.checkpointer.close()


@pytest.mark.parametrize("cut", ["uncommitted", "missing", "two saves"])
def test_deepspeed_to_torch_save_refuses_a_tag_cut_short(tmp_path: Path, cut: str) -> None:
    """(3) A tag whose save was cut short (a file never committed, a rank's file never written,
    files of two saves of the tag): to_torch_save copied it as raw files, a copy DeepSpeed's
    offline tools then read as a checkpoint. Now it is refused as a load refuses it, naming
    the file, and nothing is written."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    from deepspeed.runtime.checkpoint_engine import CheckpointCommitInfo

    from ckptio.deepspeed_engine import CkptioCheckpointEngine, to_torch_save

    run = tmp_path / "ds"
    engine = CkptioCheckpointEngine()
    for at in ("global_steps=3", "global_steps=5"):  # the second over the same tag
        engine.training = lambda at=at: at  # type: ignore[misc]
        info = CheckpointCommitInfo(tag="t", save_dir=str(run), save_latest=False)
        engine.create(info)
        if at.endswith("3"):
            engine.save({"module": {"w": torch.ones(4)}, "dp_world_size": 2},
                        str(run / "t" / "mp_rank_00_model_states.pt"))
        for rank in (0, 1):
            if at.endswith("5") and (cut != "two saves" or rank == 0):
                continue
            engine.save({"w": torch.ones(4)}, str(run / "t" / f"zero_pp_rank_{rank}_mp_rank_00"
                                                            f"_optim_states.pt"))
        engine.commit(info)
    engine.cleanup()
    named = run / "t" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    if cut == "uncommitted":
        (named / "manifest.json").unlink()
    elif cut == "missing":
        import shutil

        shutil.rmtree(named)
    with pytest.raises(ckptio.CkptError) as raised:
        to_torch_save(run, tmp_path / "torch")
    said = str(raised.value)
    assert str(named) in said and ("two saves" in said) is (cut == "two saves"), said
    assert not (tmp_path / "torch").exists()


@pytest.fixture
def s3_client(s3_live: Any) -> Any:  # noqa: F811 - a client of its own
    from ckptio.testing.s3server import make_client

    return make_client(s3_live)


def test_s3_a_step_saved_over_a_killed_attempt_holds_only_its_own_objects(
        s3_env: str, s3_client: Any) -> None:  # noqa: F811 - the fixtures imported above
    """(5) step 6 on S3: a save killed mid-upload left objects of its own under step-6 (a data
    file, and the index file a save of regular shards writes per rank); a new save of step 6
    committed there. The index file stayed for good: the naming rule the cleanup lists by
    (store_contract.is_ours) did not cover it. The committed step holds only its own objects
    (a stray one costs storage for good and counts in `ckptio ls` sizes)."""
    from ckptio.storage.s3.s3path import S3Path

    url = f"{s3_env}/run"
    strays = ["data-0000000000000000001-r00000-0000.bin", "data-0000000000000000001-r00001-index.bin"]
    mgr = CheckpointManager(url, keep_last=3)
    mgr.save(5, {"w": torch.ones(1024)})
    for stray in strays:
        where = S3Path.parse(f"{url}/step-6/{stray}")
        s3_client.put_object(Bucket=where.bucket, Key=where.key, Body=b"half an upload")
    mgr.save(6, {"w": torch.full((1024,), 6.0)})
    mgr.close()
    prefix = S3Path.parse(f"{url}/step-6").dir_prefix
    keys = sorted(o["Key"][len(prefix):] for o in s3_client.list_objects_v2(
        Bucket=where.bucket, Prefix=prefix).get("Contents", []))
    assert not set(strays) & set(keys), keys
    assert torch.equal(ckptio.load(f"{url}/step-6")["w"], torch.full((1024,), 6.0))
