"""ckptio.load and ckptio.verify on files written by ``torch.save(obj, path)``.

As users meet them: a small model (Linear + LayerNorm), AdamW after some steps and a StepLR,
saved with ``torch.save({"model": ..., "optim": ..., "sched": ..., "step": 7}, path)``; loaded by
ckptio in a fresh process into freshly built objects (AdamW with no state yet), checked bitwise,
then one more training step matches the reference's. Then the refusals: a flipped byte in a
tensor record (its zip CRC-32), a pickle naming a disallowed global (nothing runs), a truncated
file, a legacy-format file, and ``ckptio ls``.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import subprocess
import sys
import zipfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptio
from ckptio.errors import (CheckpointNotFoundError, CkptError, CorruptCheckpointError,
                           PickleRefusedError, UnsupportedStateError)
from conftest import assert_same

K = 3  # training steps before the save
BETAS = (0.9, 0.95)


def _build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(12, 30), torch.nn.LayerNorm(30), torch.nn.GELU(),
                                torch.nn.Linear(30, 5))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=BETAS, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, i: int) -> None:
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randn(8, 12, generator=g)
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
    sched.step()


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any) -> dict[str, Any]:
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "optim": pickle.loads(pickle.dumps(opt.state_dict())),
            "sched": dict(sched.state_dict())}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("tsave") / "model.pt"
    model, opt, sched = _build(0)
    for i in range(K):
        _train_step(model, opt, sched, i)
    torch.save({"model": model.state_dict(), "optim": opt.state_dict(),
                "sched": sched.state_dict(), "step": 7}, path)
    want = _snapshot(model, opt, sched)
    _train_step(model, opt, sched, K)
    return {"path": path, "want": want, "after": _snapshot(model, opt, sched)}


def load_fresh(path: str) -> bytes:
    """In a fresh process: build fresh objects, load in place, snapshot, train one step."""
    model, opt, sched = _build(1)
    state = {"model": model, "optim": opt, "sched": sched, "step": 0}
    report = ckptio.load(path, state)
    got = _snapshot(model, opt, sched)
    got["step"] = state["step"]
    got["report"] = (report.missing, report.unexpected, report.mismatched)
    _train_step(model, opt, sched, K)
    got["after"] = _snapshot(model, opt, sched)
    return pickle.dumps(got)


def test_load_in_place_fresh_process_bitwise(saved: dict[str, Any]) -> None:
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        got = pickle.loads(pool.submit(load_fresh, str(saved["path"])).result(timeout=300))
    assert got["report"] == ((), (), ()), got["report"]
    assert got["step"] == 7
    want = saved["want"]
    assert_same(got["model"], want["model"], "model")
    assert_same(got["optim"], want["optim"], "optim")  # exp_avg, exp_avg_sq, step, betas tuple
    assert got["optim"]["param_groups"][0]["betas"] == BETAS
    assert len(got["optim"]["state"]) == 6 and got["optim"]["state"][0]["step"].item() == K
    assert_same(got["sched"], want["sched"], "sched")
    assert_same(got["after"], saved["after"], "after one more step")


def test_verify_and_fresh_load(saved: dict[str, Any]) -> None:
    size = saved["path"].stat().st_size
    assert 0 < ckptio.verify(saved["path"]) <= size
    fresh = ckptio.load(saved["path"])
    assert_same(dict(fresh["model"]), dict(saved["want"]["model"]), "model")
    assert fresh["step"] == 7 and fresh["optim"]["param_groups"][0]["betas"] == BETAS


def _record_offset(path: Path, name: str) -> int:
    with zipfile.ZipFile(path) as z:
        info = z.getinfo(name)
    raw = path.read_bytes()
    nlen, elen = int.from_bytes(raw[info.header_offset + 26:info.header_offset + 28], "little"), \
        int.from_bytes(raw[info.header_offset + 28:info.header_offset + 30], "little")
    return info.header_offset + 30 + nlen + elen


def test_flipped_byte_in_tensor_record_is_caught(saved: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "bad.pt"
    raw = bytearray(saved["path"].read_bytes())
    at = _record_offset(saved["path"], "model/data/0") + 5
    raw[at] ^= 0x10
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        ckptio.verify(path)
    model, opt, sched = _build(1)
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        ckptio.load(path, {"model": model, "optim": opt, "sched": sched, "step": 0})


class Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        import os
        return (os.system, (f"touch {MARKER[0]}",))


MARKER: list[str] = [""]


def test_disallowed_global_is_refused_and_nothing_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    MARKER[0] = str(marker)
    path = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(3), "x": Evil()}, path)  # torch.save pickles os.system
    assert not marker.exists()
    with pytest.raises(PickleRefusedError, match="system"):
        ckptio.load(path, {"w": torch.zeros(3), "x": 0})
    with pytest.raises(PickleRefusedError):
        ckptio.verify(path)
    with pytest.raises(CkptError, match="not in place"):
        ckptio.load(path, {"w": torch.zeros(3), "x": 0}, allow_pickle=True)
    assert not marker.exists()
    # a trusted file: allow_pickle=True with no state falls back to torch.load(weights_only=False)
    ckptio.load(path, allow_pickle=True)
    assert marker.exists()


class Custom:
    def __init__(self) -> None:
        self.a = 1


def test_custom_class_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "custom.pt"
    torch.save({"c": Custom()}, path)
    with pytest.raises(PickleRefusedError, match="Custom"):
        ckptio.load(path)


def test_truncated_file_names_it(saved: dict[str, Any], tmp_path: Path) -> None:
    raw = saved["path"].read_bytes()
    for cut in (len(raw) - 10, len(raw) // 2, 100):
        path = tmp_path / f"cut{cut}.pt"
        path.write_bytes(raw[:cut])
        with pytest.raises(CkptError, match=str(path)):
            ckptio.load(path)


def test_record_offset_past_the_end_names_it(saved: dict[str, Any], tmp_path: Path) -> None:
    """A central-directory entry whose local-header offset points past the end of the file is
    a CorruptCheckpointError naming the record, not a torch error about a negative size."""
    raw = bytearray(saved["path"].read_bytes())
    name = b"model/data/0"
    at = next(i for i in range(len(raw)) if raw[i:i + 4] == b"PK\x01\x02"
              and raw[i + 46:i + 46 + len(name)] == name)
    raw[at + 42:at + 46] = (len(raw) + 5000).to_bytes(4, "little")
    path = tmp_path / "bad.pt"
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match="'model/data/0' starts at byte .* past the end"):
        ckptio.load(path)


def test_legacy_format_is_refused_with_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(3)}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(CkptError, match="legacy torch.save file.*re-save"):
        ckptio.load(path, {"w": torch.zeros(3)})


def test_tied_weights_alias_and_views(tmp_path: Path) -> None:
    emb = torch.arange(12.0).view(4, 3)
    path = tmp_path / "tied.pt"
    torch.save({"emb": emb, "head": emb, "n": None, "size": torch.Size([2, 3]),
                "dt": torch.bfloat16, "half": torch.arange(4, dtype=torch.float16)}, path)
    state = {"emb": torch.zeros(4, 3), "head": torch.zeros(4, 3), "n": 1, "size": None,
             "dt": None, "half": torch.zeros(4, dtype=torch.float16)}
    ckptio.load(path, state)
    assert torch.equal(state["emb"], emb) and torch.equal(state["head"], emb)
    assert state["n"] is None and state["size"] == torch.Size([2, 3])
    assert state["dt"] is torch.bfloat16 and torch.equal(state["half"], torch.arange(4.0).half())
    view = tmp_path / "view.pt"  # a row-major view of part of its storage loads (its CRC-32
    torch.save({"t": emb[1:3]}, view)  # derived from its storage's and the bytes around it)
    assert torch.equal(ckptio.load(view)["t"], emb[1:3])
    with open(view, "r+b") as f:  # a flipped byte of the part is caught
        data = f.read()
        at = data.index(emb[1:3].numpy().tobytes()) + 5
        f.seek(at)
        f.write(bytes([data[at] ^ 0x10]))
    with pytest.raises(ckptio.CorruptCheckpointError, match="'t'"):
        ckptio.load(view)
    torch.save({"t": emb[:, 1]}, view)  # a view with gaps: refused
    with pytest.raises(CkptError, match="key 't'.*view of part of a storage.*contiguous"):
        ckptio.load(view)


def test_ls_shows_the_file(saved: dict[str, Any]) -> None:
    out = subprocess.run([sys.executable, "-m", "ckptio", "ls", "--flat", str(saved["path"])],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "torch.save file" in out.stdout and "optim.state.0.exp_avg_sq" in out.stdout


def test_not_a_torch_save_file(tmp_path: Path) -> None:
    path = tmp_path / "junk.pt"
    path.write_bytes(b"hello world, not a zip")
    with pytest.raises(CheckpointNotFoundError, match="nor a torch.save file"):
        ckptio.load(path)


def test_a_dotted_key_colliding_with_a_nested_one_is_named_not_called_damage(
        tmp_path: Path) -> None:
    """{"a.b": t, "a": {"b": t2}}: both are key 'a.b' once joined with '.'. The file is not
    damaged: the error says which key collides and the fix (before: "stores the same chunk
    twice ... damaged")."""
    path = tmp_path / "dotted.pt"
    torch.save({"a.b": torch.ones(3), "a": {"b": torch.zeros(3)}}, path)
    for call in (lambda: ckptio.load(path), lambda: ckptio.load(path, {"a.b": torch.empty(3)})):
        with pytest.raises(UnsupportedStateError, match=r"key 'a\.b' names two different values "
                           r".*not damaged: load it with torch\.load"):
            call()
