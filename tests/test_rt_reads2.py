"""Read once, continued (issue 67), and object-store URLs spelled in capitals:

* TorchTitan's CkptioCheckpointManager reads a step's manifest once per load on rank 0 (it read
  it twice: the kind of step, then the restore) and not at all on the other ranks, with a
  partial newer step passed over (the warning kept), a final model-only step, and a damaged
  newest manifest falling back to the step before as it did;
* ``S3://``, ``GS://``, ``Az://`` locations are refused naming the lower-case URL to write, and
  no local folder is made.
"""

from __future__ import annotations

import os
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptio
from ckptio.errors import CkptError
from ckptio.testing.rank_processes import run_ranks
from ckptio.testing.readcount import count_manifest_reads

pytest.importorskip("torchtitan.components.checkpointer.base")
from test_torchtitan import STEPS, Job  # noqa: E402


def _train(job: Job, until: int = STEPS) -> list[float]:
    """Train ``job`` up to step ``until``, then close its checkpointer -> the losses."""
    losses = [job.step() for _ in range(until - job.state.step)]
    job.checkpointer.close()
    return losses


@pytest.fixture
def counted() -> Counter[str]:
    """This process's committed-manifest reads, by directory (clear() to count afresh)."""
    manifests = count_manifest_reads()
    manifests.clear()
    return manifests


def _params(job: Job) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in job.model.state_dict().items()}


def test_a_torchtitan_load_reads_the_manifest_once(tmp_path: Path, counted: Counter[str]) -> None:
    """Resume from step 4 of 5 (the others committed before): one manifest read, and the
    training goes on as an uninterrupted run's."""
    uninterrupted = _train(Job(tmp_path / "a"))
    _train(Job(tmp_path / "b"), until=5)
    counted.clear()
    job = Job(tmp_path / "b")
    assert job.checkpointer.load() and job.state.step == 4
    assert counted.total() == 1
    assert _train(job) == uninterrupted[4:]


def test_a_partial_newer_step_is_still_passed_over_with_a_warning(tmp_path: Path,
                                                                   counted: Counter[str]) -> None:
    _train(Job(tmp_path), until=5)
    partial = tmp_path / "checkpoint" / "step-6"
    shutil.copytree(tmp_path / "checkpoint" / "step-4", partial)
    (partial / "manifest.json").unlink()
    counted.clear()
    job = Job(tmp_path)
    with pytest.warns(UserWarning, match="step 6"):
        assert job.checkpointer.load() and job.state.step == 4
    assert counted.total() == 1
    job.checkpointer.close()


def test_an_explicit_step_and_a_model_only_step_read_it_once(tmp_path: Path,
                                                            counted: Counter[str]) -> None:
    _train(Job(tmp_path, last_save_model_only=True, export_dtype="bfloat16"))
    saved = ckptio.load(tmp_path / "checkpoint" / f"step-{STEPS}")
    counted.clear()
    again = Job(tmp_path, last_save_model_only=True)
    assert again.checkpointer.load() and again.state.step == 0  # model only, as a seed
    assert counted.total() == 1
    assert all(torch.equal(v, saved[k].float()) for k, v in _params(again).items())
    again.checkpointer.close()
    counted.clear()
    older = Job(tmp_path, last_save_model_only=True)
    assert older.checkpointer.load(step=4) and older.state.step == 4
    assert counted.total() == 1
    older.checkpointer.close()


def test_a_damaged_newest_manifest_still_falls_back(tmp_path: Path) -> None:
    """The manifest read first is damaged: the restore passes over that step to the one
    before, saying so, as before (the record is never used for another step)."""
    _train(Job(tmp_path), until=5)
    newest = tmp_path / "checkpoint" / "step-4" / "manifest.json"
    newest.write_bytes(newest.read_bytes()[:40])
    job = Job(tmp_path)
    with pytest.warns(UserWarning, match="step 4"):
        assert job.checkpointer.load() and job.state.step == 2
    job.checkpointer.close()


def _rank_load(rank: int, world: int, folder: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    _train(Job(folder), until=5)  # the same replicated model and steps on both ranks
    counted = count_manifest_reads()
    counted.clear()
    job = Job(folder)
    loaded = job.checkpointer.load()
    out = {"loaded": loaded, "step": job.state.step, "manifest": counted.total()}
    job.checkpointer.close()
    return out


def test_two_ranks_read_the_manifest_once_in_all(tmp_path: Path) -> None:
    got = run_ranks(2, _rank_load, str(tmp_path), timeout_s=90)
    assert [(g["loaded"], g["step"]) for g in got] == [(True, 4), (True, 4)], got
    assert [g["manifest"] for g in got] == [1, 0], got


@pytest.mark.parametrize("url", ["S3://bucket/run", "GS://bucket/run", "Az://account/c/run"])
def test_a_scheme_in_capitals_names_the_lower_case_url(tmp_path: Path, url: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    fixed = url.split("://")[0].lower() + "://" + url.split("://")[1]
    for call in (lambda: ckptio.save({"w": torch.zeros(2)}, url), lambda: ckptio.load(url),
                 lambda: ckptio.CheckpointManager(url).steps()):
        with pytest.raises(CkptError, match=f"write the scheme in lower case: {fixed}$"):
            call()
    assert os.listdir(tmp_path) == []  # no local folder "S3:"


def test_a_restores_record_serves_only_the_copy_it_was_read_from(tmp_path: Path) -> None:
    """restore(record=) with the newest step's manifest and that step's data damaged: the
    fallback to the step before reads its own manifest and restores that step's values."""
    mgr = ckptio.CheckpointManager(tmp_path / "ck")
    for step in (1, 2):
        mgr.save(step, {"w": torch.full((64,), float(step))})
    record = ckptio.Checkpointer().manifest(mgr.path(2))
    data = next(p for p in Path(mgr.path(2)).iterdir() if p.name.startswith("data-"))
    data.write_bytes(bytes(len(data.read_bytes())))  # zeros: its checksum fails
    state = {"w": torch.zeros(64)}
    with pytest.warns(UserWarning, match="step 2"):
        assert mgr.restore(state, record=record) == 1
    assert torch.equal(state["w"], torch.full((64,), 1.0))
    mgr.close()
