"""gs:// through the public API against a real GCS server (the gcp-storage-emulator), as users
run it: ckptio.save to a gs:// prefix and ckptio.load in a fresh process; a CheckpointManager
on a gs:// prefix keeping the last two steps and restoring the newest in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import torch

import ckptio
from ckptio.managing.manager import CheckpointManager
from ckptio.storage.gcs.gcs_store import GcsStore

SETTINGS = """
    from ckptio.storage.gcs.gcs_settings import GcsSettings
    options = ckptio.Options(storage={"gs": GcsSettings(
        endpoint_url=sys.argv[2], credentials="anonymous", conditional="off")})
"""

LOAD = textwrap.dedent("""
    import sys, torch, ckptio
""") + textwrap.dedent(SETTINGS) + textwrap.dedent("""
    state = {"w": torch.zeros(300_000), "n": torch.zeros(7, dtype=torch.int64), "epoch": 0}
    ckptio.load(sys.argv[1], state, options=options)
    torch.save(state, sys.argv[3])
""")

RESTORE = textwrap.dedent("""
    import sys, torch, ckptio
    from ckptio.managing.manager import CheckpointManager
""") + textwrap.dedent(SETTINGS) + textwrap.dedent("""
    state = {"w": torch.zeros(1000), "step": -1}
    with CheckpointManager(sys.argv[1], keep_last=2, options=options) as mgr:
        steps, restored = mgr.steps(), mgr.restore(state)
    torch.save({"steps": steps, "restored": restored, "state": state}, sys.argv[3])
""")


def _fresh(script: str, url: str, endpoint: str, out: str) -> dict:
    done = subprocess.run([sys.executable, "-c", script, url, endpoint, out],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out, weights_only=False)


def test_save_then_load_in_a_fresh_process(gcs_url, gcs_options, gcs_server, tmp_path):
    state = {"w": torch.randn(300_000), "n": torch.arange(7), "epoch": 3}
    url = f"{gcs_url}/ckpt"
    ckptio.save(state, url, options=gcs_options)
    loaded = _fresh(LOAD, url, gcs_server.endpoint, str(tmp_path / "out.pt"))
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["n"], state["n"])
    assert loaded["epoch"] == 3


def test_a_manager_keeps_the_last_steps_and_restores_the_newest(gcs_url, gcs_options,
                                                                gcs_server, tmp_path):
    with CheckpointManager(gcs_url, keep_last=2, options=gcs_options) as mgr:
        for step in range(1, 5):
            mgr.save(step, {"w": torch.full((1000,), float(step)), "step": step})
    got = _fresh(RESTORE, gcs_url, gcs_server.endpoint, str(tmp_path / "out.pt"))
    assert got["steps"] == [3, 4] and got["restored"] == 4
    assert got["state"]["step"] == 4 and torch.equal(got["state"]["w"], torch.full((1000,), 4.0))
    root = GcsStore(gcs_url, gcs_options.storage["gs"])
    assert [n for n in root.entries() if n.startswith("step-")] == ["step-3", "step-4"], \
        "the dropped steps' objects were not removed"


def test_the_command_lists_a_run_on_gs(gcs_url, gcs_options, gcs_server):
    """``ckptio ls gs://bucket/run`` lists the manager's steps, as it does for s3:// runs."""
    with CheckpointManager(gcs_url, keep_last=None, options=gcs_options) as mgr:
        mgr.save(1, {"w": torch.ones(1000)})
        mgr.save(2, {"w": torch.ones(1000)})
    env = {**os.environ, "STORAGE_EMULATOR_HOST": gcs_server.endpoint}
    listed = subprocess.run([sys.executable, "-m", "ckptio", "ls", "--json", gcs_url],
                            capture_output=True, text=True, env=env, timeout=120)
    assert listed.returncode == 0, listed.stdout + listed.stderr
    doc = json.loads(listed.stdout)
    assert doc["schema"] == "ckptio.run/1"
    assert [(s["step"], s["state"]) for s in doc["steps"]] == [(1, "committed"),
                                                               (2, "committed")]
    assert all(s["nbytes"] >= 4000 and s["files"] >= 2 for s in doc["steps"])
