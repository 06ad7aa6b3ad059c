"""A demanding user against ckptio's large-framework integrations: DeepSpeed's engine
(ckptio.deepspeed_engine, real DeepSpeed engines on gloo ranks, its CPU accelerator) and the
TorchTitan checkpoint manager (ckptio.torchtitan_manager, driven as tests/test_torchtitan.py
drives it). Each test is a defect found and fixed:

* a DeepSpeed rank killed while it saves: ``latest`` stays on the whole tag before (rank 0
  moved it to the tag missing that rank's file), every live rank raising a RankFailedError;
* a DeepSpeed tag saved again under the same name and cut short mixes two saves' files, and
  ``latest`` names it: refused at load naming both files, not resumed from silently;
* a tag with no files (named, or an empty or stale ``latest``): a CkptError naming the folder
  and the tags there, not DeepSpeed's empty AssertionError;
* a ZeRO-3 checkpoint on another number of ranks: the same refusal on every rank, naming both
  sizes (one rank raised an empty AssertionError);
* a model changed since the save, under ZeRO: a StateMismatchError naming the parameter, not a
  tensor size RuntimeError from inside DeepSpeed (ZeRO-3) or torch's (ZeRO 1);
* DeepSpeed's destroy() after a failed background write frees the staging pool and threads;
* ``use(engine)`` again frees the ckptio engine it replaces;
* TorchTitan with the newest step's manifest damaged: resumed from the step before, as the
  guide says (a ManifestError before);
* TorchTitan relaunched with ckptio on a folder of TorchTitan's own DCP steps: refused naming
  them and initial_load_path, not a silent start from step 0;
* TorchTitan's ``exclude_from_loading`` loads the other states, leaving those untouched;
* TorchTitan resuming into a changed model: the message names the TorchTitan options;
* TorchTitan's last step in Hugging Face format with an s3:// folder: refused when built, not
  failing at the end of training with the final model saved nowhere.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")

LIMIT_S = 300


# ------------------------------------------------------------------ DeepSpeed, on the rank


def _said(call: Any) -> str:
    """What ``call()`` raised, as ``module.Type: message``, or 'loaded'."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test reads which error it was
        return f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
    return "loaded"


def _engine(stage: int, widths: tuple[int, ...] = (8, 32, 32, 4)) -> Any:
    """A DeepSpeed engine (ZeRO ``stage``, deepspeed_cases' configuration) on a model of
    Linear layers of ``widths``."""
    import importlib

    import deepspeed

    os.environ.setdefault("LOCAL_RANK", str(torch.distributed.get_rank()))
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # as cases do
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:])])
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1000,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)
    return engine


def _fresh(stage: int, widths: tuple[int, ...] = (8, 32, 32, 4)) -> Any:
    import ckptio.deepspeed_engine

    engine = _engine(stage, widths)
    ckptio.deepspeed_engine.use(engine, allow_pickle=True)
    return engine


def deepspeed_scenarios(rank: int, world_size: int, root: str) -> dict[str, str]:
    """Each scenario on one rank -> what the load said."""
    import deepspeed_cases as cases

    out: dict[str, str] = {}
    ckpts = os.path.join(root, "same")
    engine = _fresh(1)
    cases.train(engine, 3)
    engine.save_checkpoint(ckpts, tag="x")
    cases.train(engine, 2)
    ours = engine.checkpoint_engine
    calls, save = [0], ours.save

    def dies_at_second(state_dict: Any, path: str) -> None:  # a kill between two files
        calls[0] += 1
        if calls[0] == 2:
            raise KeyboardInterrupt("killed")
        save(state_dict, path)

    ours.save = dies_at_second
    try:
        engine.save_checkpoint(ckpts, tag="x")
    except KeyboardInterrupt:
        pass
    out["same_tag"] = _said(lambda: _fresh(1).load_checkpoint(ckpts))
    ours.save = save
    engine.save_checkpoint(ckpts, tag="x")  # saved whole again: loads
    out["same_tag_whole"] = _said(lambda: _fresh(1).load_checkpoint(ckpts))

    for stage in (1, 3):
        ckpts = os.path.join(root, f"zero{stage}")
        engine = _fresh(stage)
        cases.train(engine, 2)
        engine.save_checkpoint(ckpts)
        engine.destroy()
        out[f"resized{stage}"] = _said(
            lambda: _fresh(stage, (8, 32, 48, 4)).load_checkpoint(ckpts))
        out[f"added{stage}"] = _said(
            lambda: _fresh(stage, (8, 32, 32, 4, 4)).load_checkpoint(ckpts))
    ckpts = os.path.join(root, "zero1")
    out["no_such_tag"] = _said(lambda: _fresh(1).load_checkpoint(ckpts, tag="global_step9"))
    Path(ckpts, "latest").write_text("")
    out["empty_latest"] = _said(lambda: _fresh(1).load_checkpoint(ckpts))
    Path(ckpts, "latest").write_text("global_step7")
    out["stale_latest"] = _said(lambda: _fresh(1).load_checkpoint(ckpts))
    return out


def rank_killed_mid_save(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """ZeRO-1, 2 ranks: tag global_step2 saved; at global_step4 rank 1 is killed (SIGKILL) in
    its first file -> what rank 0's save_checkpoint said and what ``latest`` names then."""
    import signal

    import deepspeed_cases as cases

    import ckptio.deepspeed_engine

    engine = _engine(1)
    ours = ckptio.deepspeed_engine.use(
        engine, allow_pickle=True, options=ckptio.Options(rank_timeout_s=2.0))
    cases.train(engine, 2)
    engine.save_checkpoint(root)
    cases.train(engine, 2)
    if rank == 1:
        ours.save = lambda state_dict, path: os.kill(os.getpid(), signal.SIGKILL)
    said = _said(lambda: engine.save_checkpoint(root))
    return {"said": said, "latest": Path(root, "latest").read_text()}


def used_twice(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """use(engine) once (sync), a save, use(engine, decoupled=True) again, a save -> the first
    engine's staging pool and the ckptio threads left."""
    import threading

    import deepspeed_cases as cases

    import ckptio.deepspeed_engine

    engine = _engine(1)
    first = ckptio.deepspeed_engine.use(engine, allow_pickle=True)
    cases.train(engine, 1)
    engine.save_checkpoint(root)
    ckptio.deepspeed_engine.use(engine, allow_pickle=True, decoupled=True)
    cases.train(engine, 1)
    engine.save_checkpoint(root)
    ckptio.deepspeed_engine.commit_now(engine)
    engine.destroy()
    return {"pool": first.checkpointer.staging_nbytes, "latest": Path(root, "latest").read_text(),
            "threads": sorted(t.name for t in threading.enumerate() if t.name != "MainThread")}


def zero3_on_more_ranks(rank: int, world_size: int, root: str) -> str:
    """The 1-rank ZeRO-3 checkpoint of deepspeed_scenarios loaded on ``world_size`` ranks."""
    return _said(lambda: _fresh(3).load_checkpoint(os.path.join(root, "zero3")))


@pytest.fixture(scope="module")
def deepspeed_said(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    from ckptio.testing.rank_processes import run_ranks

    root = tmp_path_factory.mktemp("rt-deepspeed")
    said = dict(run_ranks(1, deepspeed_scenarios, str(root), timeout_s=LIMIT_S)[0])
    more = run_ranks(2, zero3_on_more_ranks, str(root), timeout_s=LIMIT_S)
    return {**said, **{f"zero3_rank{r}": s for r, s in enumerate(more)}}


def test_deepspeed_same_tag_cut_short_is_refused_naming_both_files(
        deepspeed_said: dict[str, str]) -> None:
    """save_checkpoint(tag="x") at step 3, again at step 5 killed between its two files:
    ``latest`` names x, whose model file is step 5's and optimizer file step 3's. The load is
    refused naming both files and the fix, not resumed from a mix; saved whole again, it loads."""
    said = deepspeed_said["same_tag"]
    assert said.startswith("ckptio.errors.IncompleteCheckpointError"), said
    assert "mp_rank_00_model_states.pt" in said and "optim_states.pt" in said, said
    assert "global_steps=3" in said and "global_steps=5" in said, said
    assert "tag=" in said, said
    assert deepspeed_said["same_tag_whole"] == "loaded"


@pytest.mark.parametrize("stage", [1, 3])
def test_deepspeed_changed_model_names_the_parameter(deepspeed_said: dict[str, str],
                                                     stage: int) -> None:
    """A layer resized or added since the save: a StateMismatchError naming the parameter and
    the saved file (ZeRO-3 failed inside DeepSpeed with a bare tensor size RuntimeError)."""
    resized, added = deepspeed_said[f"resized{stage}"], deepspeed_said[f"added{stage}"]
    assert resized.startswith("ckptio.errors.StateMismatchError"), resized
    assert "1.weight: shape [48, 32] in the model, [32, 32] saved" in resized, resized
    assert "model_states.pt" in resized and "build the model as it was saved" in resized
    assert added.startswith("ckptio.errors.StateMismatchError"), added
    assert "3.weight: in the model, not saved" in added, added


@pytest.mark.parametrize("case", ["no_such_tag", "empty_latest", "stale_latest"])
def test_deepspeed_tag_without_files_names_the_tags_there(deepspeed_said: dict[str, str],
                                                          case: str) -> None:
    """A tag that does not exist, or ``latest`` empty (killed while DeepSpeed wrote it) or
    naming a tag that is gone: CheckpointNotFoundError naming the folder and the tags that
    exist, not DeepSpeed's empty AssertionError."""
    said = deepspeed_said[case]
    assert said.startswith("ckptio.errors.CheckpointNotFoundError"), said
    assert "['global_step2']" in said and "tag=" in said, said
    if case == "empty_latest":
        assert "latest is empty" in said, said
    else:
        assert f"global_step{9 if case == 'no_such_tag' else 7}" in said, said


# ------------------------------------------------------------------ TorchTitan


@pytest.fixture()
def titan(monkeypatch: pytest.MonkeyPatch) -> Any:
    pytest.importorskip("torchtitan.components.checkpointer.base")
    import test_torchtitan

    return test_torchtitan


def test_torchtitan_exclude_from_loading_leaves_that_state(titan: Any, tmp_path: Path) -> None:
    """--checkpoint.exclude_from_loading lr_scheduler: the model, optimizer and train state
    load, the scheduler keeps its own state (was a StateMismatchError: the checkpoint's
    lr_scheduler keys were 'not in the state')."""
    job = titan.Job(tmp_path)
    for _ in range(4):
        job.step()
    job.checkpointer.close()
    again = titan.Job(tmp_path, exclude_from_loading=["lr_scheduler"])
    again.schedulers.schedulers[0].last_epoch = 99
    assert again.checkpointer.load() is True
    assert again.state.step == 4 and again.schedulers.schedulers[0].last_epoch == 99
    for key, value in job.model.state_dict().items():
        assert torch.equal(value, again.model.state_dict()[key]), key
    again.checkpointer.close()


def test_torchtitan_changed_model_names_the_key_and_torchtitans_fix(
        titan: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer added since the save: the message names the key and the TorchTitan options
    that help (exclude_from_loading, a new folder), not only load()'s strict=False."""
    import ckptio

    job = titan.Job(tmp_path)
    for _ in range(2):
        job.step()
    job.checkpointer.close()
    monkeypatch.setattr(titan, "DIMS", (12, 30, 17, 5, 5))
    again = titan.Job(tmp_path)
    with pytest.raises(ckptio.StateMismatchError) as caught:
        again.checkpointer.load()
    said = str(caught.value)
    assert "step-2" in said and "6.weight" in said, said
    assert "--checkpoint.exclude_from_loading" in said and "--checkpoint.folder" in said, said
    again.checkpointer.close()


def test_deepspeed_zero3_on_another_rank_count_says_so_on_every_rank(
        deepspeed_said: dict[str, str]) -> None:
    """A ZeRO-3 checkpoint of 1 rank loaded on 2: every rank refuses naming both sizes and the
    way (rank 1, which has no model file of its own, raised DeepSpeed's empty AssertionError)."""
    for rank in (0, 1):
        said = deepspeed_said[f"zero3_rank{rank}"]
        assert said.startswith("ckptio.errors.UnsupportedStateError"), said
        assert "saved by 1 data-parallel ranks" in said and "this job has 2" in said, said
        assert "ds_to_universal" in said, said


def test_deepspeed_rank_reading_only_the_new_files_still_refuses_the_mixed_tag(
        tmp_path: Path) -> None:
    """The save over tag t was cut short after this rank's file: its own files are all of the
    new save, another rank's file of the old one. This rank refuses too (it compares every file
    of a tag saved over), rather than resuming while the other rank fails."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    from deepspeed.runtime.checkpoint_engine import CheckpointCommitInfo

    import ckptio
    from ckptio.deepspeed_engine import CkptioCheckpointEngine

    mine, theirs = str(tmp_path / "t" / "rank1.pt"), str(tmp_path / "t" / "rank0.pt")
    info = CheckpointCommitInfo(tag="t", save_dir=str(tmp_path), save_latest=True)
    for step, paths in ((3, (theirs, mine)), (5, (mine,))):
        engine = CkptioCheckpointEngine()
        engine.training = lambda step=step: f"global_steps={step}"  # as use() sets it
        engine.create(info)
        for path in paths:
            engine.save({"w": torch.full((2,), float(step))}, path)
        engine.commit(info)
        engine.cleanup()
    reader = CkptioCheckpointEngine()
    with pytest.raises(ckptio.IncompleteCheckpointError, match=r"rank0\.pt.*global_steps=3"):
        reader.load(mine)
    reader.cleanup()


def test_torchtitan_hf_last_save_to_an_s3_folder_is_refused_before_training(
        titan: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """folder s3://... with last_save_model_only and last_save_in_hf: ckptio.export_hf writes
    a local directory, so the job's last step failed at its end (UnsupportedPathError, masked
    by fsspec's 'Install s3fs' ImportError while removing the scratch copy, which stayed on
    S3) and the final model was saved nowhere. Refused when the manager is built, naming the
    options; nothing is sent to S3 (the endpoint here is a closed port)."""
    import ckptio

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    with pytest.raises(ckptio.CkptError, match=r"last_save_in_hf with the folder s3://b/run"
                                               r"[\s\S]*set last_save_in_hf=False"):
        titan.Job("s3://b/run", last_save_model_only=True, last_save_in_hf=True,
                  sd_adapter=titan.RenamingAdapter())


def test_deepspeed_destroy_after_a_failed_background_write_frees_the_pool(
        tmp_path: Path) -> None:
    """A decoupled save whose background write fails (EIO), then DeepSpeed's destroy(): the
    error is raised, and the staging pool and ckptio's I/O threads are freed all the same
    (they stayed: 32 MiB and three threads for the rest of the process)."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    import threading

    from deepspeed.runtime.checkpoint_engine import CheckpointCommitInfo

    import ckptio
    from ckptio.deepspeed_engine import CkptioCheckpointEngine
    from ckptio.testing.faults import inject

    ours = {"ckptio-save", "ckptio-hash", "ckptio-cleanup"}
    before = {t for t in threading.enumerate() if t.name in ours}  # other tests' Checkpointers
    engine = CkptioCheckpointEngine(decoupled=True)
    info = CheckpointCommitInfo(tag="t", save_dir=str(tmp_path), save_latest=True)
    engine.create(info)
    engine.save({"w": torch.ones(1 << 16)}, str(tmp_path / "t" / "a.pt"))
    engine.commit(info)
    faulty = inject(engine.checkpointer, fail_write=1)
    engine.create(info)
    engine.save({"w": torch.ones(1 << 16)}, str(tmp_path / "t" / "b.pt"))
    with pytest.raises(ckptio.StorageIOError, match=r"b\.pt"):
        engine.cleanup()
    assert faulty.injected
    assert engine.checkpointer.staging_nbytes == 0
    left = {t for t in threading.enumerate() if t.name in ours} - before
    assert not left, left


def test_deepspeed_rank_killed_mid_save_leaves_latest_on_the_tag_before(tmp_path: Path) -> None:
    """A rank killed while it writes its file of a tag: rank 0 wrote ``latest`` naming that
    tag (its own files were committed), so a restart loaded a tag missing a file. Now every
    rank's files are committed before ``latest`` moves: rank 0 raises a RankFailedError naming
    rank 1, and ``latest`` still names the complete tag before."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    from ckptio.testing.rank_processes import run_ranks

    got = run_ranks(2, rank_killed_mid_save, str(tmp_path), may_die=[1], agent_store=True,
                    timeout_s=LIMIT_S)[0]
    assert got["latest"] == "global_step2", got
    assert got["said"].startswith("ckptio.errors.RankFailedError"), got["said"]
    assert "rank 1" in got["said"] and "global_step4" in got["said"], got["said"]


def test_torchtitan_damaged_newest_manifest_falls_back_to_the_step_before(
        titan: Any, tmp_path: Path) -> None:
    """The newest step's manifest damaged (cut in half): load() resumes from the step before
    with a warning naming the damage, as the guide says (it raised ManifestError reading the
    step's kind before ckptio's restore could fall back)."""
    job = titan.Job(tmp_path)
    for _ in range(4):
        job.step()
    job.checkpointer.close()
    manifest = tmp_path / "checkpoint" / "step-4" / "manifest.json"
    body = manifest.read_bytes()
    manifest.write_bytes(body[:len(body) // 2])
    again = titan.Job(tmp_path)
    with pytest.warns(UserWarning, match=r"restored step 2[\s\S]*step-4[\s\S]*manifest"):
        assert again.checkpointer.load() is True
    assert again.state.step == 2
    again.checkpointer.close()


def test_torchtitan_folder_of_torchtitans_own_steps_is_not_a_silent_fresh_start(
        titan: Any, tmp_path: Path) -> None:
    """A run saved by TorchTitan's own (DCP) manager, relaunched with CkptioCheckpointManager on
    the same folder: load() returned False and the job trained from step 0, failing only at its
    first save (step-2 holds DCP's files). Now load() refuses naming the steps and the options
    that resume them; with initial_load_path set the whole state loads from that step."""
    from torchtitan.components.checkpointer import CheckpointManager

    import ckptio

    own = titan.Job(tmp_path, manager=CheckpointManager)
    for _ in range(4):
        own.step()
    own.checkpointer.close()
    job = titan.Job(tmp_path)
    with pytest.raises(ckptio.CkptError, match=r"steps \[2, 4\] of another manager[\s\S]*"
                                               r"initial_load_path \S*step-4"):
        job.checkpointer.load()
    job.checkpointer.close()
    moved = titan.Job(tmp_path / "new", initial_load_model_only=False,
                      initial_load_path=str(tmp_path / "checkpoint" / "step-4"))
    assert moved.checkpointer.load() is True and moved.state.step == 4
    moved.checkpointer.close()


def test_deepspeed_use_again_frees_the_engine_it_replaces(tmp_path: Path) -> None:
    """use(engine) again (here to switch to decoupled saves): the replaced ckptio engine's
    staging pool and I/O threads are freed (they stayed: 32 MiB and four threads each time)."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    from ckptio.testing.rank_processes import run_ranks

    got = run_ranks(1, used_twice, str(tmp_path), timeout_s=LIMIT_S)[0]
    assert got["pool"] == 0 and got["latest"] == "global_step2", got
    assert not {"ckptio-save", "ckptio-hash", "ckptio-cleanup"} & set(got["threads"]), got


def test_deepspeed_tag_saved_again_whole_loads_in_the_same_engine(tmp_path: Path) -> None:
    """The check above has no false alarm: one engine saves tag t, loads it, saves t again
    whole (another step), loads it again: both loads succeed, with the new values."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    from deepspeed.runtime.checkpoint_engine import CheckpointCommitInfo

    from ckptio.deepspeed_engine import CkptioCheckpointEngine

    engine = CkptioCheckpointEngine()
    info = CheckpointCommitInfo(tag="t", save_dir=str(tmp_path), save_latest=True)
    files = [str(tmp_path / "t" / n) for n in ("model.pt", "optim.pt")]
    for step in (3, 5):
        engine.training = lambda step=step: f"global_steps={step}"  # as use() sets it
        engine.create(info)
        for path in files:
            engine.save({"w": torch.full((2,), float(step))}, path)
        engine.commit(info)
        for path in files:
            assert torch.equal(engine.load(path)["w"], torch.full((2,), float(step)))
    engine.cleanup()
