"""The ``ckptio`` command on ``s3://`` prefixes of a real S3 server (SeaweedFS): ls and diff read
the manifest without importing torch, verify reads every byte."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import ckptio

ROOT = Path(__file__).resolve().parents[2]


def _ckptio(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # s3_env set the endpoint and keys here
    return subprocess.run([sys.executable, "-X", "importtime", "-m", "ckptio", *args],
                          capture_output=True, text=True, env=env, timeout=120, check=False)


def _modules(stderr: str) -> set[str]:
    return {line.rsplit("|", 1)[1].strip() for line in stderr.splitlines()
            if line.startswith("import time:") and "|" in line}


def test_ls_diff_and_verify_on_s3(s3_env: str):
    a, b = f"{s3_env}/a", f"{s3_env}/b"
    ckptio.save({"model": {"w": torch.arange(12.0).reshape(3, 4)}, "step": 1}, a)
    ckptio.save({"model": {"w": torch.arange(12.0).reshape(3, 4)}, "step": 2}, b)
    ls = _ckptio("ls", "--json", a)
    assert ls.returncode == 0, ls.stderr[-2000:]
    doc = json.loads(ls.stdout)
    assert (doc["path"], doc["format"], doc["nbytes"]) == (a, "ckptio", 48)
    assert doc["tree"]["children"][0]["children"][0]["key"] == "model.w"
    assert "torch" not in _modules(ls.stderr) and "ckptio.storage.s3" in _modules(ls.stderr)
    diff = _ckptio("diff", a, b)
    assert diff.returncode == 1 and "torch" not in _modules(diff.stderr)
    assert [" ".join(line.split()) for line in diff.stdout.splitlines()] == [
        "~ step value 1 -> value 2", f"{a} vs {b}: 1 difference(s)"]
    verify = _ckptio("verify", a)
    assert verify.returncode == 0 and f"{a}: OK" in verify.stdout, verify.stderr[-2000:]


def test_ls_of_a_run_on_s3_lists_its_steps(s3_env: str, s3_client):
    """A manager's steps under a prefix: committed, incomplete (its manifest never committed),
    and one a retention marked and has not removed yet (``step-N/.deleting``): listed as being
    deleted, never as a checkpoint; torch never imported."""
    from ckptio.storage.s3.settings import S3Settings
    from ckptio.storage.s3.root import S3Root

    manager = ckptio.CheckpointManager(s3_env, keep_last=None)
    for step in (1, 2, 3):
        manager.save(step, {"w": torch.full((1024,), float(step)), "step": step})
    manager.close()
    bucket, _, prefix = s3_env.removeprefix("s3://").partition("/")
    s3_client.delete_object(Bucket=bucket, Key=f"{prefix}/step-3/manifest.json")
    assert S3Root(s3_env, S3Settings.of(ckptio.Options.from_env())).hide(1)  # marked, kept
    done = _ckptio("ls", "--json", s3_env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "torch" not in _modules(done.stderr)
    doc = json.loads(done.stdout)
    assert doc["schema"] == "ckptio.run/1"
    assert [(s["step"], s["state"]) for s in doc["steps"]] == [
        (1, "being deleted"), (2, "committed"), (3, "incomplete")]
    two = doc["steps"][1]
    listed = s3_client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/step-2/")["Contents"]
    assert two["path"] == f"{s3_env}/step-2" and two["files"] == len(listed)
    assert two["nbytes"] == sum(o["Size"] for o in listed)
    text = _ckptio("ls", s3_env).stdout
    assert ".deleting" not in text and text.splitlines()[0].startswith(
        f"{s3_env}: 2 step(s): 1 committed, 1 incomplete; 1 being deleted;")
