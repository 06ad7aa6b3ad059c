"""TorchTitan's checkpoints on S3 through ckptio: ``CkptioCheckpointManager`` with
``checkpoint.folder = "s3://..."`` (TorchTitan's torch_checkpointing manager refuses remote
URIs), against the local SeaweedFS server. A job saving every 2 steps asynchronously with
keep_latest_k=2 stops at step 5; a new manager resumes from the newest step on the server and
the losses equal a local uninterrupted run's bit for bit; only the kept steps stay there."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torchtitan.components.checkpointer.base")
from test_torchtitan import Job  # noqa: E402  (tests/test_torchtitan.py: the job's pieces)

from s3.test_manager_s3 import _holding  # noqa: E402


def _train(job: Job, until: int = 8) -> list[float]:
    losses = [job.step() for _ in range(until - job.state.step)]
    job.checkpointer.close()
    return losses


def test_s3_folder_saves_resumes_bitwise_and_keeps_k(s3_env: str, s3_client: Any,
                                                     tmp_path: Path) -> None:
    uninterrupted = _train(Job(tmp_path))
    settings = {"async_mode": "async", "keep_latest_k": 2}
    _train(Job(s3_env, **settings), until=5)
    assert _holding(s3_client, f"{s3_env}/checkpoint") == {"step-2", "step-4"}
    job = Job(s3_env, **settings)  # as a restarted job builds it
    assert job.checkpointer.load() and job.state.step == 4
    assert _train(job) == uninterrupted[4:]
    # the 2 newest, and the step this job resumed from (ckptio keeps the newest step a restore
    # succeeded on: docs/guides/resume.md, "Which steps are kept")
    assert _holding(s3_client, f"{s3_env}/checkpoint") == {"step-4", "step-6", "step-8"}
