"""CheckpointManager delta checkpoints on an s3:// prefix, against a real SeaweedFS server:
a real model trained with AdamW, saved every step as full steps and deltas (a frozen block
referenced, never uploaded again), with compression; retention keeping each kept delta's base
(the objects left on the server are exactly the kept steps and their bases); every kept step
loading bit-exact; ``ckptio ls`` of the prefix showing each step's base; restore falling back
past a delta whose base was deleted from the bucket, naming it; and a tiered manager draining
deltas from a local disk to S3, base first.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from typing import Any

import pytest
import torch

import ckptio
from ckptio import DeltaPolicy, Tier
from ckptio.format.manifest import MANIFEST_NAME, bases_of, decode
from ckptio.storage.s3.s3path import S3Path
from ckptio.storage.select import store_for

from s3.s3_models import build, train
from s3.test_manager_s3 import _holding, _keys

SMALL = ckptio.Options(buffer_bytes=5 << 20, pool_bytes=20 << 20)


def _bases(url: str) -> list[str]:
    store = store_for(url, SMALL)
    return list(bases_of(decode(store.read_manifest(), store.path_of(MANIFEST_NAME))))


def _state(model: Any, opt: Any, frozen: torch.Tensor, step: int) -> dict[str, Any]:
    return {"model": model, "optim": opt, "frozen": frozen, "step": step}


def _stored(s3_client: Any, url: str) -> int:
    where = S3Path.parse(url)
    return sum(o["Size"] for page in s3_client.get_paginator("list_objects_v2").paginate(
        Bucket=where.bucket, Prefix=where.dir_prefix) for o in page.get("Contents", []))


def test_manager_deltas_on_s3_keep_their_bases_and_load_bit_exact(s3_env, s3_client,
                                                                   assert_same):
    url = f"{s3_env}/delta-run"
    model, opt, sched = build()
    frozen = torch.randn(512, 512, generator=torch.Generator().manual_seed(1))  # 1 MiB
    mgr = ckptio.CheckpointManager(url, keep_last=2, options=SMALL, compression="zstd",
                                   delta=DeltaPolicy(full_every=3, max_ratio=1.0))
    saved: dict[int, dict[str, Any]] = {}
    seen: dict[int, list[str]] = {}
    for step in range(1, 8):  # 1 F, 2-3 d1, 4 F, 5-6 d4, 7 F
        train(model, opt, sched, 1)
        mgr.save(step, _state(model, opt, frozen, step))
        saved[step] = copy.deepcopy({"model": model.state_dict(), "optim": opt.state_dict()})
        seen[step] = _bases(mgr.path(step))
        kept = mgr.steps()
        for s in kept:
            assert all(int(b.split("-")[1]) in kept for b in _bases(mgr.path(s)))
    assert seen == {1: [], 2: ["step-1"], 3: ["step-1"], 4: [], 5: ["step-4"], 6: ["step-4"],
                    7: []}
    full, delta = _stored(s3_client, mgr.path(4)), _stored(s3_client, mgr.path(6))
    assert delta < full - (900 << 10)  # the frozen MiB (zstd: ~0.93) is referenced
    mgr.close()
    assert mgr.steps() == [4, 6, 7]  # 6 keeps its base 4
    assert _holding(s3_client, url) == {"step-4", "step-6", "step-7"}  # removals finished
    for s in mgr.steps():
        out = ckptio.load(mgr.path(s), options=SMALL)
        assert torch.equal(out["frozen"], frozen) and out["step"] == s
        assert_same(dict(out["model"]), dict(saved[s]["model"]))
        assert_same(out["optim"]["state"], saved[s]["optim"]["state"])

    listing = subprocess.run([sys.executable, "-m", "ckptio", "ls", "--json", url],
                             capture_output=True, text=True, timeout=120, check=False)
    assert listing.returncode == 0, listing.stderr
    steps = {s["step"]: s["bases"] for s in json.loads(listing.stdout)["steps"]}
    assert steps[6] == ["step-4"] and steps[7] == []


def test_restore_from_s3_passes_a_delta_whose_base_was_deleted(s3_env, s3_client):
    url = f"{s3_env}/gone-base"
    frozen = torch.arange(65536.0)
    mgr = ckptio.CheckpointManager(url, keep_last=None, options=SMALL,
                                   delta=DeltaPolicy(full_every=2))
    for step in range(1, 5):  # 1 F, 2 d1, 3 F, 4 d3
        mgr.save(step, {"frozen": frozen, "w": torch.full((64,), float(step))})
    mgr.close()
    where = S3Path.parse(mgr.path(3))
    for key in _keys(s3_client, mgr.path(3)):
        s3_client.delete_object(Bucket=where.bucket, Key=where.dir_prefix + key)
    mgr = ckptio.CheckpointManager(url, keep_last=None, options=SMALL)
    state = {"frozen": torch.zeros(65536), "w": torch.zeros(64)}
    with pytest.warns(UserWarning, match=r"step 4 \(a delta against base step 3\)"):
        assert mgr.restore(state) == 2
    assert torch.equal(state["w"], torch.full((64,), 2.0))
    mgr.close()


def test_a_disk_tier_drains_deltas_to_s3_base_first(tmp_path, s3_env, s3_client):
    url = f"{s3_env}/tiered-delta"
    frozen = torch.arange(65536.0)
    mgr = ckptio.CheckpointManager(
        tiers=[Tier(str(tmp_path / "disk"), keep_last=2), Tier(url, every=2, keep_last=1)],
        options=SMALL, delta=DeltaPolicy(full_every=10))
    for step in range(1, 5):
        mgr.save(step, {"frozen": frozen, "w": torch.full((64,), float(step))})
        assert mgr.drained(timeout=120)
    mgr.close()
    assert _holding(s3_client, url) == {"step-1", "step-4"}  # base 1 copied before 2, kept for 4
    assert _bases(f"{url}/step-4") == ["step-1"]
    out = ckptio.load(f"{url}/step-4", options=SMALL)
    assert torch.equal(out["frozen"], frozen) and torch.equal(out["w"], torch.full((64,), 4.0))
