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
