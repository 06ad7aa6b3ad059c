"""torch_checkpointing's checkpoints in ckptio and ckptio's out to it (issue 47).

In: a directory its CheckpointManager saved (one process, or 2 gloo ranks of FSDP2 DTensors,
with and without its DefaultResharder's metadata.pkl) loads with ``ckptio.load`` into fresh
objects bitwise (in place, on 1, 2 and 4 ranks), ``ckptio ls`` / ``verify`` read it, a
flipped byte is caught, a hostile metadata.pkl is refused with nothing run, a missing rank's
file is named. Out: ``ckptio convert --to torch_checkpointing`` writes a directory its
CheckpointManager reads, every dtype bit for bit, in a process where ckptio cannot be imported.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torch_checkpointing", reason="torch-checkpointing is not installed")

from conftest import ALL_DTYPES  # noqa: E402
from special_values import bits_equal, specials  # noqa: E402
from test_dcp_in import (K, _assert_same, _build, _dcp_state, _objects, _snapshot,  # noqa: E402
                         _step)

import ckptio  # noqa: E402
from ckptio.testing.cli_process import run_cli  # noqa: E402
from ckptio.testing.rank_processes import run_ranks  # noqa: E402
from ckptio.testing.tc_peer import manager  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}


def _cmd(*args: str) -> subprocess.CompletedProcess[str]:
    """``ckptio ARGS`` in a process of its own forked from a warm interpreter
    (ckptio.testing.cli_process; tests/test_cli_ls.py checks it against ``python -m ckptio``)."""
    return run_cli(*args, env=ENV, timeout=180)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A model, AdamW and StepLR trained K steps, saved by its CheckpointManager."""
    path = tmp_path_factory.mktemp("tc") / "step-3"
    model, opt, sched = _build(0)
    for step in range(K):
        _step(model, opt, sched, step)
    tc = manager()
    tc.save(str(path), {"model": model.state_dict(), "optim": opt.state_dict(),
                        "sched": sched.state_dict(), "step": K})
    tc.close()
    want = _objects(model, opt, sched)
    _step(model, opt, sched, K)
    return {"path": path, "want": want, "after": _objects(model, opt, sched)}


def test_its_checkpoint_loads_into_a_fresh_model_optimizer_and_scheduler(saved) -> None:
    assert sorted(os.listdir(saved["path"])) == ["model_0.pt", "optim_0.pt", "sched_0.pt",
                                                 "step_0.pt"]
    model, opt, sched = _build(1)
    state = {"model": model, "optim": opt, "sched": sched, "step": 0}
    report = ckptio.load(saved["path"], state)
    assert not report.missing and not report.unexpected and not report.mismatched, report
    assert state["step"] == K
    _assert_same(_objects(model, opt, sched), saved["want"], "loaded")
    _step(model, opt, sched, K)  # and training goes on exactly as the saving job's did
    _assert_same(_objects(model, opt, sched), saved["after"], "one step later")


def test_ls_and_verify_read_it(saved) -> None:
    listed = _cmd("ls", str(saved["path"]))
    assert listed.returncode == 0, listed.stderr
    assert "torch_checkpointing checkpoint by 1 rank(s)" in listed.stdout, listed.stdout
    assert "exp_avg_sq" in listed.stdout and "last_epoch" in listed.stdout
    checked = _cmd("verify", str(saved["path"]))
    assert checked.returncode == 0 and "every entry matches its crc32" in checked.stdout, checked


def _tensor_record(path: Path) -> tuple[int, int]:
    """(offset, size) of the largest storage record's bytes in torch.save file ``path``."""
    import zipfile

    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = (int.from_bytes(f.read(2), "little") for _ in range(2))
    return info.header_offset + 30 + name_len + extra_len, info.file_size


def test_a_flipped_byte_is_caught_by_load_and_verify(saved, tmp_path: Path) -> None:
    path = tmp_path / "copy"
    shutil.copytree(saved["path"], path)
    offset, size = _tensor_record(path / "optim_0.pt")
    with open(path / "optim_0.pt", "r+b") as f:
        f.seek(offset + size // 2)
        byte = f.read(1)
        f.seek(offset + size // 2)
        f.write(bytes([byte[0] ^ 0x01]))
    model, opt, sched = _build(1)
    with pytest.raises(ckptio.CorruptCheckpointError, match="optim_0.pt") as caught:
        ckptio.load(path, {"model": model, "optim": opt, "sched": sched, "step": 0})
    assert "optim.state." in str(caught.value)
    checked = _cmd("verify", str(path))
    assert checked.returncode != 0 and "optim.state." in checked.stdout + checked.stderr


class _Run:
    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.fn, self.args


def test_a_hostile_metadata_is_refused_and_nothing_runs(saved, tmp_path: Path) -> None:
    path = tmp_path / "copy"
    shutil.copytree(saved["path"], path)
    marker = tmp_path / "ran"
    hostile = {"world_size": 1, "metadata": {}, "x": _Run(os.mkdir, str(marker))}
    (path / "metadata.pkl").write_bytes(pickle.dumps(hostile))
    with pytest.raises(ckptio.PickleRefusedError, match=r"metadata.pkl.*posix.mkdir"):
        ckptio.load(path)
    assert not marker.exists()
    (path / "metadata.pkl").write_bytes(b"\x80\x04garbage")
    with pytest.raises(ckptio.CorruptCheckpointError, match="metadata.pkl"):
        ckptio.load(path)


def test_a_missing_rank_file_is_named(saved, tmp_path: Path) -> None:
    path = tmp_path / "copy"
    shutil.copytree(saved["path"], path)
    shutil.copy(path / "model_0.pt", path / "model_1.pt")  # now model has 2 ranks, optim 1
    with pytest.raises(ckptio.CorruptCheckpointError, match=r"optim_1.pt.*missing"):
        ckptio.load(path)


# ------------------------------------------------------------------------------------------------
# FSDP2 DTensors on 2 gloo ranks


def tc_fsdp_save(rank: int, world: int, path: str, resharded: bool) -> dict[str, Any]:
    model, opt, sched = _build(0, fsdp=True)
    for step in range(K):
        _step(model, opt, sched, step)
    tc = manager(("model", "optim") if resharded else ())
    tc.save(path, {**_dcp_state(model, opt), "step": K})
    tc.close()
    return _snapshot(model, opt)


def tc_fsdp_load(rank: int, world: int, path: str) -> dict[str, Any]:
    """Its own resharding load on the saving layout (a check of the checkpoint itself)."""
    from torch.distributed.checkpoint.state_dict import (set_model_state_dict,
                                                         set_optimizer_state_dict)

    model, opt, _ = _build(1, fsdp=True)
    tc = manager(("model", "optim"))
    got = tc.load(path, into=_dcp_state(model, opt))
    tc.close()
    set_model_state_dict(model, got["model"])
    set_optimizer_state_dict(model, opt, got["optim"])
    return _snapshot(model, opt)


def _load(path: str, fsdp: bool) -> dict[str, Any]:
    """ckptio.load into a fresh model and AdamW (FSDP2 on this job's ranks, or plain)."""
    from torch.distributed.checkpoint.state_dict import (set_model_state_dict,
                                                         set_optimizer_state_dict)

    model, opt, _sched = _build(1, fsdp=fsdp)
    state = {**_dcp_state(model, opt), "step": 0}
    report = ckptio.load(path, state)
    assert not report.missing and not report.unexpected and not report.mismatched, report
    assert state["step"] == K
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    return _snapshot(model, opt)


def ckptio_fsdp_load(rank: int, world: int, paths: list[str]) -> list[dict[str, Any]]:
    return [_load(path, fsdp=True) for path in paths]


@pytest.mark.parametrize("resharded", [False, True], ids=["plain", "resharder"])
def test_fsdp2_checkpoint_of_2_ranks_loads_on_1_2_and_4(tmp_path: Path, resharded) -> None:
    path = str(tmp_path / "fsdp")
    want = run_ranks(2, tc_fsdp_save, path, resharded, timeout_s=300)[0]
    files = sorted(os.listdir(path))
    assert files == (["metadata.pkl"] if resharded else []) + [
        "model_0.pt", "model_1.pt", "optim_0.pt", "optim_1.pt", "step_0.pt", "step_1.pt"]
    if resharded:  # the metadata.pkl is its own: its loader reads the checkpoint back
        for got in run_ranks(2, tc_fsdp_load, path, timeout_s=300):
            _assert_same(got, want, "its own load")
    _assert_same(_load(path, fsdp=False), want, "1 process")
    for world in (2, 4):
        for (got,) in run_ranks(world, ckptio_fsdp_load, [path], timeout_s=300):
            _assert_same(got, want, f"{world} ranks")
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(Path(path) / "model_1.pt", lone / "model_1.pt")
    with pytest.raises(ckptio.CkptError, match="one rank's shard of a DTensor.*directory"):
        ckptio.load(lone / "model_1.pt")


# ------------------------------------------------------------------------------------------------
# out: read by torch_checkpointing in a process without ckptio


_TC_READER = textwrap.dedent("""
    import sys
    sys.modules["ckptio"] = None  # importing ckptio fails from here on
    import torch
    from torch_checkpointing.checkpoint_manager import CheckpointManager
    from torch_checkpointing.config import SyncCheckpointSaverConfig
    from special_values import assert_same_bits as same

    path, expected = sys.argv[1:3]
    want = torch.load(expected, weights_only=False)

    def blank(value):  # what a resuming job holds: zeros, and placeholders for values
        if isinstance(value, dict):
            return {k: blank(v) for k, v in value.items()}
        if isinstance(value, torch.Tensor):
            return torch.zeros_like(value)
        return None

    into = blank(want)
    manager = CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig()))
    got = manager.load(path, into=into)
    same(dict(got), want, "loaded")
    same(into["model"], want["model"], "in place")
    assert not any(m == "ckptio" or m.startswith("ckptio.") for m in sys.modules if sys.modules[m])
    print("read by torch_checkpointing:", sorted(got))
""")


def test_convert_to_torch_checkpointing_is_read_by_it_alone(tmp_path: Path) -> None:
    tensors = {str(d).removeprefix("torch."): specials(d, (5, 9), seed=n)
               for n, d in enumerate(ALL_DTYPES)}
    tensors["empty"] = torch.empty(3, 0, 2)
    want = {"model": tensors, "step": 11, "lr": -0.0, "meta": {"name": "run-7", "epoch": 2}}
    ckptio.save(want, tmp_path / "src")
    done = _cmd("convert", "--to", "torch_checkpointing", str(tmp_path / "src"),
                str(tmp_path / "tc"))
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(tmp_path / "tc")) == ["lr_0.pt", "meta_0.pt", "model_0.pt",
                                                   "step_0.pt"]
    torch.save(want, tmp_path / "expected.pt")
    script = tmp_path / "read_tc.py"
    script.write_text(_TC_READER)
    read = subprocess.run([sys.executable, str(script), str(tmp_path / "tc"),
                           str(tmp_path / "expected.pt")], capture_output=True, text=True,
                          env={**ENV, "PYTHONPATH": str(ROOT / "tests")}, timeout=180,
                          check=False)
    assert read.returncode == 0 and "read by torch_checkpointing" in read.stdout, read.stderr
    back = ckptio.load(tmp_path / "tc")  # and back through ckptio, bit for bit
    for key, tensor in tensors.items():
        assert bits_equal(back["model"][key], tensor), key
    tc = manager()  # and what its own manager writes from the same state
    tc.save(str(tmp_path / "theirs"), want)
    tc.close()
    theirs = ckptio.load(tmp_path / "theirs")
    assert {k: v for k, v in theirs.items() if k != "model"} == {
        k: v for k, v in want.items() if k != "model"} and str(theirs["lr"]) == "-0.0"
    for key, tensor in tensors.items():
        assert bits_equal(theirs["model"][key], tensor), key
    again = _cmd("convert", "--to", "torch_checkpointing", str(tmp_path / "src"),
                 str(tmp_path / "tc"))
    assert again.returncode == 2 and "already holds a torch_checkpointing" in again.stderr
    ckptio.save({"a/b": torch.ones(1)}, tmp_path / "slash")
    refused = _cmd("convert", "--to", "torch_checkpointing", str(tmp_path / "slash"),
                   str(tmp_path / "tc2"))
    assert refused.returncode == 2 and "top-level keys" in refused.stderr, refused.stderr
    assert not (tmp_path / "tc2").exists()


# ------------------------------------------------------------------------------------------------
# DTensor placements on a 2 x 2 mesh, uneven shapes: each shard placed where DTensor put it


def save_2d(rank: int, world: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2))
    full = torch.arange(7 * 5, dtype=torch.float64).reshape(7, 5)
    state = {name: distribute_tensor(full.clone() + i, mesh, placements)
             for i, (name, placements) in enumerate({
                 "rows_cols": [Shard(0), Shard(1)], "rows_twice": [Shard(0), Shard(0)],
                 "cols_replicated": [Replicate(), Shard(1)], "cols_rows": [Shard(1), Shard(0)],
                 "replicated": [Replicate(), Replicate()]}.items())}
    state["tiny"] = distribute_tensor(torch.ones(3), mesh, [Shard(0), Shard(0)])  # empty shard
    torch.save(state, os.path.join(path, f"model_{rank}.pt"))


def test_dtensor_placements_on_a_2d_mesh_land_where_dtensor_put_them(tmp_path: Path) -> None:
    run_ranks(4, save_2d, str(tmp_path), timeout_s=300)
    got = ckptio.load(tmp_path)["model"]
    full = torch.arange(7 * 5, dtype=torch.float64).reshape(7, 5)
    for i, name in enumerate(("rows_cols", "rows_twice", "cols_replicated", "cols_rows",
                              "replicated")):
        assert torch.equal(got[name], full + i), name
    assert torch.equal(got["tiny"], torch.ones(3))
    listed = _cmd("ls", str(tmp_path))
    assert "torch_checkpointing checkpoint by 4 rank(s)" in listed.stdout, listed.stdout
