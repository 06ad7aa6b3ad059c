"""A new user following the guides (README, Megatron-Core, DeepSpeed, TorchTitan, resume):
what they do as written and meet, checked here where ckptio's behaviour had to change.

DeepSpeed: the guide's loop with ``use(engine, decoupled=True)`` saves at its last step and
calls ``engine.destroy()``: the tag's files are written, but DeepSpeed commits a decoupled tag
only at the next ``step()`` (or ``commit_now``), so ``latest`` still names the tag before and a
resume silently loads it. The engine's cleanup now says so, naming the tag and the fix.
A mistyped ``load_checkpoint`` directory (``ckpst`` beside ``ckpts``) trained from step 0 with
DeepSpeed's generic "Unable to find latest file"; the guard now names the run spelled alike,
as CheckpointManager.restore does.

TorchTitan: a mistyped ``--checkpoint.folder`` (``checkpiont`` beside ``checkpoint``) trained
from step 0 without a word (the manager's restore, which logs a fresh start and names a run
spelled alike, was not called on an empty folder); now it is.
"""

from __future__ import annotations

import importlib
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptio


def _needs(module: str) -> Any:
    return pytest.importorskip(module, reason=f"{module} is not installed (its guide says how)")


def _saved(tmp_path: Path, decoupled: bool, latest: bool = True) -> tuple[Any, Any, str]:
    CheckpointCommitInfo = _needs("deepspeed.runtime.checkpoint_engine").CheckpointCommitInfo
    engine = _needs("ckptio.deepspeed_engine").CkptioCheckpointEngine(decoupled=decoupled)
    info = CheckpointCommitInfo(tag="global_step6", save_dir=str(tmp_path), save_latest=latest)
    engine.create(info)
    path = str(tmp_path / "global_step6" / "mp_rank_00_model_states.pt")
    engine.save({"module": {"w": torch.arange(8.0)}, "global_steps": 6}, path)
    return engine, info, path


def test_destroy_with_a_decoupled_tag_not_committed_says_latest_does_not_name_it(
        tmp_path: Path) -> None:
    engine, _info, path = _saved(tmp_path, decoupled=True)
    with pytest.warns(UserWarning) as caught:
        engine.cleanup()  # what DeepSpeed's engine.destroy() calls
    text = " ".join(str(w.message) for w in caught)
    assert "global_step6" in text and str(tmp_path) in text, text
    assert "commit_now" in text and "tag=" in text, text  # the fix, and the way to load it now
    loaded = type(engine)().load(path)  # the files are durable all the same
    assert torch.equal(loaded["module"]["w"], torch.arange(8.0))


def test_a_tag_without_its_optimizer_files_names_what_it_holds_and_the_weights_only_load(
        tmp_path: Path) -> None:
    """A tag folder holding its model file but no optimizer states (copied in part): the load
    of ZeRO's optimizer file said "did you mean mp_rank_00_model_states.pt?" (another kind of
    file, spelled alike); now it names what the folder holds and the weights-only load."""
    engine, info, path = _saved(tmp_path, decoupled=False)
    engine.commit(info)
    optim = str(tmp_path / "global_step6" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(ckptio.CheckpointNotFoundError) as caught:
        engine.load(optim)
    said = str(caught.value)
    assert f"asked for {optim}, which its tag folder does not hold" in said, said
    assert "it holds: mp_rank_00_model_states.pt)" in said, said
    assert "load_optimizer_states=False" in said and "did you mean" not in said, said
    assert torch.equal(engine.load(path)["module"]["w"], torch.arange(8.0))


@pytest.mark.parametrize("case", ["committed", "sync", "no_latest", "refused"])
def test_destroy_after_a_commit_or_a_sync_save_is_silent(tmp_path: Path, case: str) -> None:
    engine, info, _path = _saved(tmp_path, decoupled=case != "sync", latest=case != "no_latest")
    if case == "committed":
        assert engine.commit(info) is True  # DeepSpeed's next step(), or commit_now
    if case == "refused":  # a save refused (no pickle opt-in) wrote nothing: nothing to commit
        assert engine.commit(info) is True
        engine.create(info)
        with pytest.raises(ckptio.CkptError, match="allow_pickle"):
            engine.save({"scaler": object()}, str(tmp_path / "global_step6" / "optim.pt"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.cleanup()


class _Engine:
    """What the guard asks of a DeepSpeed engine, for a load that finds no ``latest``."""

    def load_universal_checkpoint(self) -> bool:
        return False

    def load_checkpoint(self, load_dir: str, tag: str | None = None,
                        load_optimizer_states: bool = True) -> tuple[None, None]:
        return None, None  # DeepSpeed: "Unable to find latest file", a fresh start


@pytest.mark.parametrize("given", ["ckpst", "ckpts2"])
def test_a_mistyped_load_dir_names_the_run_spelled_alike(tmp_path: Path, given: str) -> None:
    for run in ("ckpts", "ckpts1"):
        (tmp_path / run / "global_step6").mkdir(parents=True)
        (tmp_path / run / "latest").write_text("global_step6")
    engine = _Engine()
    load = _needs("ckptio.deepspeed_guard").guarded_load(engine.load_checkpoint, engine)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert load(str(tmp_path / given)) == (None, None)  # still DeepSpeed's fresh start
    text = " ".join(str(w.message) for w in caught)
    if given == "ckpst":  # a typo: the run beside it is named, with its latest tag
        assert str(tmp_path / "ckpts") in text and "global_step6" in text, text
    else:  # a numbered series (ckpts2 beside ckpts1): a new run, not a typo
        assert not caught, text


@pytest.mark.parametrize("latest", ["", "global_step9999"])
def test_a_missing_tag_names_the_newest_tags_in_step_order(tmp_path: Path, latest: str) -> None:
    """A long run's ``latest`` emptied by a kill, or naming a removed tag: the error listed
    every tag there, in text order (global_step1, global_step10, global_step100, ...; a run
    saving every 100 steps for a day named hundreds); now the newest few, in step order."""
    for step in range(1, 13):
        (tmp_path / f"global_step{step}").mkdir()
        (tmp_path / f"global_step{step}" / "mp_rank_00_model_states.pt").mkdir()
    (tmp_path / "latest").write_text(latest)
    engine = _Engine()
    load = _needs("ckptio.deepspeed_guard").guarded_load(engine.load_checkpoint, engine)
    with pytest.raises(ckptio.CheckpointNotFoundError) as caught:
        load(str(tmp_path))
    newest = [f"global_step{step}" for step in range(7, 13)]
    assert f"{newest} (and 6 earlier)" in str(caught.value), caught.value


def _titan(base: Path, folder: str) -> Any:
    """TorchTitan's checkpointer as its Trainer builds it (ckptio's, by configuration)."""
    _needs("torchtitan")
    optimizer = importlib.import_module("torchtitan.components.optimizer")
    from ckptio.torchtitan_manager import CkptioCheckpointManager

    model = torch.nn.Linear(4, 2)
    optimizers = optimizer.optimizer.default_adamw(lr=1e-2).build(model_parts=[model])
    schedulers = optimizer.LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=4)
    config = CkptioCheckpointManager.Config(enable=True, folder=folder, interval=2,
                                            async_mode="disabled", last_save_model_only=False)
    return config.build(dataloader=None, model_parts=[model], optimizers=optimizers,
                        lr_schedulers=schedulers, states={}, sd_adapter=None,
                        base_folder=str(base))


def test_torchtitan_a_mistyped_folder_names_the_run_spelled_alike(tmp_path: Path) -> None:
    run = _titan(tmp_path, "checkpoint")
    run.save(2, last_step=False)
    run.close()
    typo = _titan(tmp_path, "checkpiont")
    with pytest.warns(UserWarning, match="did you mean .*checkpoint.* step 2"):
        assert typo.load() is False  # still a fresh start, as TorchTitan's own manager's
    typo.close()
    first = _titan(tmp_path / "new", "checkpoint")  # a first run: nothing near, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert first.load() is False
    first.close()
    assert ckptio.CheckpointManager(tmp_path / "checkpoint").steps() == [2]
    (tmp_path / "other").mkdir()
    torch.save({"w": torch.ones(2)}, tmp_path / "other" / "model.pt")
    other = _titan(tmp_path, "other")  # another library's files: not trained beside, silently
    with pytest.raises(ckptio.CheckpointNotFoundError) as refused:
        other.load()
    assert "new folder" in str(refused.value) and "model.pt" in str(refused.value)
    other.close()
