"""Tiered CheckpointManager with an object-store tier on a real SeaweedFS server: host memory
(``shm://``, every step) drained to an ``s3://`` prefix (every 2 steps); the steps retention
keeps are the objects left on the server; with the memory gone (the shm directory removed), a
new manager restores the newest step from S3, bit for bit, into a freshly built model and AdamW.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from typing import Any

import pytest
import torch

import ckptio
from ckptio import Tier

from s3.s3_models import build, train
from s3.test_manager_s3 import _holding, _keys

SMALL = ckptio.Options(buffer_bytes=5 << 20, pool_bytes=20 << 20)


def test_memory_drained_to_s3_then_restored_from_s3(shm, s3_env, s3_client, capsys,
                                                    assert_same):
    url = f"{s3_env}/run"
    tiers = [Tier("shm://run", keep_last=2), Tier(url, every=2, keep_last=2)]
    model, opt, sched = build()
    saved: dict[int, dict[str, Any]] = {}
    mgr = ckptio.CheckpointManager(tiers=tiers, options=SMALL)
    for step in range(1, 7):
        train(model, opt, sched, 1)
        mgr.save(step, {"model": model, "optim": opt, "sched": sched, "step": step})
        saved[step] = copy.deepcopy({"model": model.state_dict(), "optim": opt.state_dict(),
                                     "sched": sched.state_dict(), "step": step})
        assert mgr.drained(timeout=120)  # each copy lands before the next save's retention
    mgr.close()

    status = mgr.status()
    assert [t["committed"] for t in status] == [[5, 6], [4, 6]]
    assert [c["step"] for c in status[1]["copied"]] == [2, 4, 6] and status[1]["error"] is None
    assert _holding(s3_client, url) == {"step-4", "step-6"}  # step 2 removed by retention
    assert "manifest.json" in _keys(s3_client, f"{url}/step-6")
    assert mgr.path(6, 1) == f"{url}/step-6"
    assert ckptio.verify(f"{url}/step-6") > 0

    from ckptio.cli import main

    assert main(["status", "shm://run", url, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["tiers"]
    assert [(t["committed"], t["copying"], t["incomplete"]) for t in listed] == [
        ([5, 6], [], []), ([4, 6], [], [])]

    shutil.rmtree(shm)  # host memory lost: the newest step left is the one on S3
    fresh, fopt, fsched = build()
    torch.manual_seed(99)
    for p in fresh.parameters():
        torch.nn.init.normal_(p)
    assert not torch.equal(fresh[0].weight, saved[6]["model"]["0.weight"])
    state = {"model": fresh, "optim": fopt, "sched": fsched, "step": -1}
    with ckptio.CheckpointManager(tiers=tiers, options=SMALL) as again:
        assert again.steps() == [4, 6]
        assert again.restore(state) == 6
        assert again.last_restore["tier"] == 1 and again.last_restore["location"] == url
    assert state["step"] == 6
    assert_same({"model": fresh.state_dict(), "optim": fopt.state_dict(),
                 "sched": fsched.state_dict(), "step": state["step"]}, saved[6])


def test_an_unreachable_object_store_tier_fails_at_construction(shm, s3_env, monkeypatch):
    """A wrong endpoint is a clear CkptError naming the tier within seconds, before any save
    (not the first drain's error hours later); nothing is created in the memory tier."""
    import socket
    import time

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    started = time.monotonic()
    with pytest.raises(ckptio.CkptError, match=r"tier s3://.* cannot be reached.*leave it out"):
        ckptio.CheckpointManager(tiers=[Tier("shm://run"), Tier(f"{s3_env}/run", every=2)],
                                 options=SMALL)
    assert time.monotonic() - started < 30
    assert not os.path.exists(os.path.join(shm, "run"))


def test_restore_passes_over_an_object_store_tier_that_went_away(shm, s3_env, s3_live,
                                                                 assert_same):
    """The server dies after the manager started: restore still comes from memory, with a
    warning naming the tier it could not list."""
    url = f"{s3_env}/run"
    tiers = [Tier("shm://run", keep_last=2), Tier(url, every=2)]
    model, opt, sched = build()
    mgr = ckptio.CheckpointManager(tiers=tiers, options=SMALL)
    for step in range(1, 3):
        train(model, opt, sched, 1)
        mgr.save(step, {"model": model, "optim": opt, "sched": sched, "step": step})
    mgr.close()
    fresh, fopt, fsched = build()
    state = {"model": fresh, "optim": fopt, "sched": fsched, "step": -1}
    again = ckptio.CheckpointManager(tiers=tiers, options=SMALL)
    s3_live.kill()
    try:
        with pytest.warns(UserWarning, match=r"tier s3://.* cannot be listed"):
            assert again.restore(state) == 2
        assert again.last_restore["tier"] == 0
        assert_same(fresh.state_dict(), model.state_dict())
    finally:
        again.close()
