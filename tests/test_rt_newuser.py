"""A new user following the guides (README, Megatron-Core, DeepSpeed, TorchTitan, resume):
what they do as written and meet, checked here where ckptio's behaviour had to change.

DeepSpeed: the guide's loop with ``use(engine, decoupled=True)`` saves at its last step and
calls ``engine.destroy()``: the tag's files are written, but DeepSpeed commits a decoupled tag
only at the next ``step()`` (or ``commit_now``), so ``latest`` still names the tag before and a
resume silently loads it. The engine's cleanup now says so, naming the tag and the fix.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install --no-deps "
                    "deepspeed==0.19.8; docs/guides/deepspeed.md)")
from deepspeed.runtime.checkpoint_engine import CheckpointCommitInfo  # noqa: E402

from ckptio.deepspeed_engine import CkptioCheckpointEngine  # noqa: E402


def _saved(tmp_path: Path, decoupled: bool, latest: bool = True) -> tuple[
        CkptioCheckpointEngine, CheckpointCommitInfo, str]:
    engine = CkptioCheckpointEngine(decoupled=decoupled)
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
    loaded = CkptioCheckpointEngine().load(path)  # the files are durable all the same
    assert torch.equal(loaded["module"]["w"], torch.arange(8.0))


@pytest.mark.parametrize("case", ["committed", "sync", "no_latest"])
def test_destroy_after_a_commit_or_a_sync_save_is_silent(tmp_path: Path, case: str) -> None:
    engine, info, _path = _saved(tmp_path, decoupled=case != "sync", latest=case != "no_latest")
    if case == "committed":
        assert engine.commit(info) is True  # DeepSpeed's next step(), or commit_now
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.cleanup()
