"""Every script in examples/ runs as a user would run it (a fresh process, its documented
command, a tiny size) and ends with its own check passed: the "ok" line it prints only after
its asserts (bitwise resumes, restored steps, verified checkpoints)."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def _run(*args: str, timeout: float = 240) -> str:
    """The script's output; on a timeout its whole process group (torchrun's ranks) is killed."""
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{args} ran over {timeout} s: {out[-2000:]}{err[-2000:]}")
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    return out


def _needs(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"needs {module} (its extra)")


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


@pytest.mark.parametrize("device", DEVICES)
def test_plain_loop(tmp_path: Path, device: str) -> None:
    out = _run("examples/plain_loop.py", "--dir", str(tmp_path), "--steps", "16",
               "--kill-at", "12", "--device", device)
    # saves every 5 steps, asynchronous: the step-10 save may still be in flight at the kill
    assert re.search(rf"ok \({device}\): killed at step 12, resumed at step (11|6); losses",
                     out), out


@pytest.mark.parametrize("device", DEVICES)
def test_tiers_every_step(tmp_path: Path, device: str) -> None:
    out = _run("examples/tiers_every_step.py", "--disk", str(tmp_path), "--steps", "12",
               "--every", "5", "--device", device)
    assert "memory gone: restored step 10" in out and f"ok ({device}):" in out


def test_fsdp2_two_ranks(tmp_path: Path) -> None:
    _run("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "examples/fsdp2_two_ranks.py", "--dir", str(tmp_path))
    assert "ok: the 2-rank FSDP2 checkpoint loaded into one process" in _run(
        "examples/fsdp2_two_ranks.py", "--dir", str(tmp_path), "--load-on-one")


def test_lightning_trainer(tmp_path: Path) -> None:
    _needs("lightning")
    assert "ok: resumed at epoch 2" in _run("examples/lightning_trainer.py", "--dir",
                                            str(tmp_path), "--epochs", "2")


def test_hf_trainer(tmp_path: Path) -> None:
    _needs("transformers")
    _needs("accelerate")
    assert "ok: resumed from" in _run("examples/hf_trainer.py", "--out", str(tmp_path),
                                      "--steps", "4")


def test_s3_seaweedfs() -> None:
    _needs("boto3")
    from ckptio.testing.s3server import ServerError, weed_binary

    try:
        weed_binary()
    except ServerError as exc:
        pytest.skip(str(exc))
    assert "ok: saved to s3://ckpt/example-run" in _run("examples/s3_seaweedfs.py")


def test_every_example_is_tested() -> None:
    tested = {name.removeprefix("test_") for name in globals() if name.startswith("test_")}
    scripts = {p.stem for p in EXAMPLES.glob("*.py")}
    assert scripts <= tested, f"examples without a test: {sorted(scripts - tested)}"
