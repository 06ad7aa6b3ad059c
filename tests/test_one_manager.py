"""One CheckpointManager for every configuration (issue 44).

Covers, through the public API with real files: ``CheckpointManager(tiers=[...])`` is a
CheckpointManager (one class; a directory is a manager with one tier); a tiered manager (a
memory tier on this test's own $CKPTIO_SHM_DIR, then a disk tier) with ``keep_best=2,
monitor="loss"``, ``save_interval_s``, ``delta=`` and ``compression="zstd"`` keeps exactly the
expected steps in its first tier and restores bitwise in a fresh process, from either tier;
``save_interval_s`` alone makes a tiered manager save by time; ``ckptio.save`` and
``ckptio.async_save`` store ``metrics=`` / ``metadata=`` (read back by ckptio.read_metadata);
the manager's modules (managing/, redundancy/) reach no other object's private member, and
redundancy/ imports nothing of managing/ (ast over the source).
"""

from __future__ import annotations

import ast
import copy
import json
import os
from pathlib import Path
import subprocess
import sys
import textwrap
import time
from typing import Any

import torch

import ckptio
from ckptio import Tier

MiB = 1 << 20
OPTS = ckptio.Options(buffer_bytes=MiB, pool_bytes=4 * MiB)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# step -> the loss saved with it: the best two (lowest) are steps 3 and 5
LOSSES = {1: 9.0, 2: 8.0, 3: 1.0, 4: 7.0, 5: 2.0, 6: 6.0, 7: 5.0, 8: 4.0}


def _build(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(16, 32)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _committed(directory: str) -> list[int]:
    return sorted(int(name[len("step-"):]) for name in os.listdir(directory)
                  if name.startswith("step-")
                  and os.path.isfile(os.path.join(directory, name, "manifest.json")))


def _manager(disk: str, **kwargs: Any) -> ckptio.CheckpointManager:
    return ckptio.CheckpointManager(
        tiers=[Tier("shm://run", keep_last=1), Tier(disk, every=2, keep_last=None)],
        options=OPTS, keep_best=2, monitor="loss", save_every=1, save_interval_s=3600.0,
        delta=ckptio.DeltaPolicy(full_every=2, max_ratio=1.0), compression="zstd", **kwargs)


def test_a_tiered_manager_is_a_checkpoint_manager(shm, tmp_path):
    with ckptio.CheckpointManager(tiers=[Tier("shm://run")], options=OPTS) as tiered:
        assert isinstance(tiered, ckptio.CheckpointManager)
        assert type(tiered) is ckptio.CheckpointManager
    with ckptio.CheckpointManager(str(tmp_path / "d"), keep_last=3, options=OPTS) as plain:
        assert type(plain) is type(tiered)
        assert [(t.location, t.keep_last, t.every) for t in plain.tiers] == [
            (str(tmp_path / "d"), 3, 1)]


def test_every_feature_with_tiers_keeps_the_best_and_restores_in_a_fresh_process(shm, tmp_path):
    """Tier 0 keeps, after close(): the best 2 steps by loss (3 and 5: full steps, as
    DeltaPolicy(full_every=2) makes every odd step full and every even one a delta against the
    step before it), the newest (keep_last=1: step 8, a delta) and its base (7): exactly
    {3, 5, 7, 8}. The disk tier (every=2, keep_last=None) holds the even steps and, copied
    before each, their bases: 1..8. A fresh process restores step 8 from memory and step 6
    (a delta, only on disk now) bit for bit."""
    disk = str(tmp_path / "disk")
    model, opt = _build()
    saved: dict[int, dict[str, Any]] = {}
    with _manager(disk) as mgr:
        assert mgr.retention.keep_best == 2 and mgr.retention.monitor == "loss"
        for step, loss in LOSSES.items():
            _train(model, opt)
            assert mgr.save(step, {"model": model, "optim": opt, "step": step},
                            metrics={"loss": loss}, metadata={"run": "one"}) is not None
            saved[step] = copy.deepcopy({"model": model.state_dict(), "optim": opt.state_dict(),
                                         "step": step})
            assert mgr.drained(timeout=60)  # the drain's pins then hold nothing back
        assert mgr.metadata(5) == {**mgr.metadata(5), "metrics": {"loss": 2.0}}
    memory = os.path.join(shm, "run")
    assert _committed(memory) == [3, 5, 7, 8]
    assert sorted(os.listdir(memory)) == ["step-3", "step-5", "step-7", "step-8"]
    assert _committed(disk) == [1, 2, 3, 4, 5, 6, 7, 8]
    for step, delta in ((7, False), (8, True)):
        with open(os.path.join(memory, f"step-{step}", "manifest.json")) as f:
            text = f.read()
        assert ("step-7" in text) is delta, f"step {step} a delta: {delta}"  # its base's name
        assert "zstd" in text  # compression="zstd" reached the saves
    assert ckptio.read_metadata(os.path.join(disk, "step-6"))["metadata"] == {"run": "one"}
    expected = str(tmp_path / "expected.pt")
    torch.save({6: saved[6], 8: saved[8]}, expected)
    proc = subprocess.run([sys.executable, "-c", _CHILD, disk, expected], check=False,
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "newest": 8, "tier": 0, "step 6 from tier": 1}


_CHILD = textwrap.dedent("""
    import json, sys
    import torch
    import ckptio
    from tests.test_one_manager import _build, _manager

    def same(got, want, where):
        if isinstance(want, torch.Tensor):
            assert got.dtype == want.dtype and got.shape == want.shape, where
            assert torch.equal(got.reshape(-1).view(torch.uint8),
                               want.reshape(-1).view(torch.uint8)), where
        elif isinstance(want, dict):
            assert sorted(map(str, got)) == sorted(map(str, want)), where
            for k in want:
                same(got[k], want[k], f"{where}.{k}")
        elif isinstance(want, (list, tuple)):
            for i, (g, w) in enumerate(zip(got, want)):
                same(g, w, f"{where}[{i}]")
        else:
            assert got == want, where

    disk, expected = sys.argv[1], torch.load(sys.argv[2], weights_only=False)
    out = {}
    with _manager(disk) as mgr:
        for step in (None, 6):
            model, opt = _build(seed=999)
            state = {"model": model, "optim": opt, "step": -1}
            restored = mgr.restore(state, step=step)
            same({"model": model.state_dict(), "optim": opt.state_dict(),
                  "step": state["step"]}, expected[restored], f"step {restored}")
            if step is None:
                out["newest"], out["tier"] = restored, mgr.last_restore["tier"]
            else:
                out["step 6 from tier"] = mgr.last_restore["tier"]
    print(json.dumps(out))
""")


def test_save_interval_alone_makes_a_tiered_manager_save_by_time(shm, tmp_path):
    tiers = [Tier("shm://run", keep_last=2), Tier(str(tmp_path / "disk"), every=4)]
    with ckptio.CheckpointManager(tiers=tiers, options=OPTS, save_interval_s=0.2) as mgr:
        assert mgr.save_every is None
        assert not mgr.should_save(1) and mgr.save(1, {"x": torch.ones(4)}) is None
        time.sleep(0.3)
        assert mgr.should_save(2)
        assert mgr.save(2, {"x": torch.ones(4)}) is not None
        assert not mgr.should_save(3)  # the clock restarted at step 2's save
    assert mgr.steps() == [2]


def test_module_level_save_stores_metrics_and_metadata(tmp_path):
    path = str(tmp_path / "ckpt")
    ckptio.save({"w": torch.arange(8.0)}, path, options=OPTS, metrics={"loss": 0.25},
                metadata={"config": {"lr": 0.1}})
    meta = ckptio.read_metadata(path)
    assert meta["metrics"] == {"loss": 0.25} and meta["metadata"] == {"config": {"lr": 0.1}}
    later = str(tmp_path / "async")
    ckptio.async_save({"w": torch.arange(8.0)}, later, options=OPTS, metrics={"acc": 0.5},
                      metadata={"epoch": 3}).wait()
    meta = ckptio.read_metadata(later)
    assert meta["metrics"] == {"acc": 0.5} and meta["metadata"] == {"epoch": 3}


def _manager_modules() -> list[Path]:
    package = Path(REPO) / "ckptio"
    return [*sorted((package / "managing").glob("*.py")),
            *sorted((package / "redundancy").glob("*.py"))]


def test_the_manager_reaches_no_private_member_of_another_object():
    reaches = []
    for path in _manager_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
                continue
            own = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            if not node.attr.startswith("__") and not own:
                reaches.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert reaches == []


def test_redundancy_imports_nothing_of_the_manager():
    """The order: managing/ (the manager and its parts) > redundancy/ (no circle between them)."""
    above = ("ckptio.managing",)
    found = []
    for path in _manager_modules():
        if path.parent.name != "redundancy":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.name}:{node.lineno}: {n}" for n in names if n.startswith(above)]
    assert found == []
