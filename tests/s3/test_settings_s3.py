"""The S3 scheme's settings in their primary spelling, ``Options(storage={"s3":
ckptio.S3Settings(...)})``, against the local SeaweedFS: the settings object alone names the
endpoint of a save, a load and a CheckpointManager's steps (the environment points elsewhere)."""

from __future__ import annotations

import os
import socket

import torch

import ckptio
from ckptio.options import MiB


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_the_settings_object_alone_names_the_endpoint(s3_env: str, monkeypatch) -> None:
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    monkeypatch.setenv("AWS_ENDPOINT_URL", _closed_port())  # only the settings reach the server
    options = ckptio.Options(buffer_bytes=MiB, pool_bytes=2 * MiB, storage={
        "s3": ckptio.S3Settings(endpoint_url=endpoint, retry_deadline_s=30)})
    state = {"w": torch.randn(256, 64), "step": 3}
    ckptio.save(state, f"{s3_env}/one", options=options)
    got = ckptio.load(f"{s3_env}/one", options=options)
    assert torch.equal(got["w"], state["w"]) and got["step"] == 3
    with ckptio.CheckpointManager(f"{s3_env}/run", keep_last=1, options=options) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": torch.full((64,), float(step))})
        mgr.wait()
        assert mgr.steps() == [2]
    target = {"w": torch.zeros(64)}
    with ckptio.CheckpointManager(f"{s3_env}/run", options=options) as again:
        assert again.restore(target) == 2 and torch.equal(target["w"], torch.full((64,), 2.0))
