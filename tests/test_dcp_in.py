"""ckptio.load and ckptio.verify on checkpoints written by torch.distributed.checkpoint (DCP).

As users meet them: a directory saved by ``dcp.save`` (FileSystemWriter) from one process with
no process group, and from 2 gloo ranks holding FSDP2 (DTensor) state; loaded by ckptio in a
fresh process into freshly built model, AdamW (empty state) and LR scheduler, or into another
number of ranks. Checked bitwise against what was saved; then the refusals: a flipped data byte,
a hostile .metadata (nothing it names runs), a missing data file, layouts ckptio does not read.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import pickle
import shutil
import struct
import warnings
import zipfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptio
from ckptio.testing.rank_processes import run_ranks
from dist_cases import fully_shard_linears

DIMS = (12, 30, 17, 5)  # 17 and 5 rows do not divide by 2 ranks: uneven FSDP2 shards
K = 3  # training steps before the save
BETAS = (0.9, 0.95)


def _build(seed: int, fsdp: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(zip(DIMS, DIMS[1:])):
        layers += [torch.nn.Linear(a, b)] + ([torch.nn.ReLU()] if i < len(DIMS) - 2 else [])
    model = torch.nn.Sequential(*layers)
    if fsdp:
        fully_shard_linears(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=BETAS, weight_decay=0.05)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, step: int) -> None:
    gen = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(8, DIMS[0], generator=gen), torch.randn(8, DIMS[-1], generator=gen)
    (model(x) - y).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()


def _numpy(value: Any) -> Any:
    """Tensors as numpy copies (bitwise comparable, and they travel between processes)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone().numpy()
    if isinstance(value, dict):
        return {k: _numpy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_numpy(v) for v in value)
    return value


def _assert_same(got: Any, want: Any, where: str = "") -> None:
    """Equal values of equal types; arrays bit for bit."""
    assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and got.shape == want.shape, where
        assert got.tobytes() == want.tobytes(), f"{where}: bytes differ"
    elif isinstance(want, dict):
        assert list(got) == list(want), f"{where}: keys {list(got)} != {list(want)}"
        for k in want:
            _assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_same(g, w, f"{where}.{i}")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def _dcp_save(state: dict[str, Any], path: Path | str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(path))


def _trained() -> tuple[dict[str, Any], torch.nn.Module, torch.optim.Optimizer, Any]:
    model, opt, sched = _build(0)
    for step in range(K):
        _step(model, opt, sched, step)
    state = {"model": model.state_dict(), "optim": opt.state_dict(),
             "sched": sched.state_dict(), "step": K}
    return state, model, opt, sched


def _objects(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any) -> dict[str, Any]:
    return _numpy({"model": model.state_dict(), "optim": opt.state_dict(),
                   "sched": sched.state_dict()})


def load_fresh(path: str) -> bytes:
    """In a fresh process: new model (other init), AdamW with no state, scheduler; load in
    place; then one more training step. -> pickled results."""
    model, opt, sched = _build(1)
    assert not opt.state_dict()["state"]
    state = {"model": model, "optim": opt, "sched": sched, "step": 0}
    report = ckptio.load(path, state)
    loaded = _objects(model, opt, sched)
    _step(model, opt, sched, K)
    return pickle.dumps({"loaded": loaded, "step": state["step"], "after": _objects(model, opt, sched),
                         "report": (report.missing, report.unexpected, report.mismatched)})


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("dcp") / "ckpt"
    state, model, opt, sched = _trained()
    _dcp_save(state, path)
    want = _objects(model, opt, sched)
    _step(model, opt, sched, K)
    return {"path": path, "want": want, "after": _objects(model, opt, sched)}


def _copy(saved: dict[str, Any], tmp_path: Path) -> Path:
    path = tmp_path / "copy"
    shutil.copytree(saved["path"], path)
    return path


def test_load_into_fresh_model_optimizer_scheduler(saved: dict[str, Any]) -> None:
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        got = pickle.loads(pool.submit(load_fresh, str(saved["path"])).result(timeout=300))
    assert got["report"] == ((), (), ()), got["report"]
    assert got["step"] == K
    want = saved["want"]
    assert sorted(want["optim"]["state"]) == list(range(6))  # Adam moments of every parameter
    _assert_same(got["loaded"], want, "loaded")
    assert got["loaded"]["optim"]["param_groups"][0]["betas"] == BETAS
    # a model built from another seed and an empty AdamW would not pass: the load did it all
    model, opt, sched = _build(1)
    with pytest.raises(AssertionError):
        _assert_same(_objects(model, opt, sched)["model"], want["model"])
    # and training goes on exactly as it would have (optimizer and scheduler state in effect)
    _assert_same(got["after"], saved["after"], "after one more step")


def test_fresh_load_and_verify(saved: dict[str, Any]) -> None:
    out = ckptio.load(saved["path"])
    want = saved["want"]
    assert sorted(out["optim"]["state"]) == list(range(6))  # DCP's "0" keys come back as ints
    group = out["optim"]["param_groups"][0]
    assert group["betas"] == BETAS and type(group["betas"]) is tuple
    assert group["params"] == list(range(6))
    _assert_same(_numpy(out["model"]), want["model"], "model")
    _assert_same(_numpy(out["optim"]), want["optim"], "optim")
    _assert_same(out["sched"], want["sched"], "sched")
    assert out["step"] == K
    assert ckptio.verify(saved["path"]) > 0


def _data_offset(path: Path, fqn: str, record_name: str = "/data/0") -> tuple[Path, int]:
    """(data file, offset of the first data byte of ``fqn``'s item's record), found with
    torch's own unpickler and zipfile (trusted: the test wrote it)."""
    meta = pickle.loads((path / ".metadata").read_bytes())
    info = next(v for k, v in meta.storage_data.items() if k.fqn == fqn)
    file = path / info.relative_path
    item = file.read_bytes()[info.offset:info.offset + info.length]
    record = next(i for i in zipfile.ZipFile(io.BytesIO(item)).infolist()
                  if i.filename.endswith(record_name))
    nlen, elen = struct.unpack_from("<HH", item, record.header_offset + 26)
    return file, info.offset + record.header_offset + 30 + nlen + elen


def test_a_flipped_value_byte_is_caught(saved: dict[str, Any], tmp_path: Path) -> None:
    path = _copy(saved, tmp_path)
    file, offset = _data_offset(path, "optim.param_groups.0.betas", "/data.pkl")
    raw = bytearray(file.read_bytes())
    raw[offset + 5] ^= 0x01
    file.write_bytes(bytes(raw))
    message = r"'optim.param_groups.0.betas'.*data.pkl' fails its CRC-32"
    for attempt in (lambda: ckptio.load(path), lambda: ckptio.verify(path)):
        with pytest.raises(ckptio.CorruptCheckpointError, match=message):
            attempt()


def test_a_flipped_data_byte_is_caught(saved: dict[str, Any], tmp_path: Path) -> None:
    path = _copy(saved, tmp_path)
    file, offset = _data_offset(path, "model.2.weight")
    raw = bytearray(file.read_bytes())
    raw[offset + 37] ^= 0x10
    file.write_bytes(bytes(raw))
    message = r"checksum mismatch for key 'model.2.weight' in .*__0_0.distcp"
    with pytest.raises(ckptio.CorruptCheckpointError, match=message):
        ckptio.verify(path)
    with pytest.raises(ckptio.CorruptCheckpointError, match=message):
        ckptio.load(path)
    model, opt, sched = _build(1)
    with pytest.raises(ckptio.CorruptCheckpointError, match=message):
        ckptio.load(path, {"model": model, "optim": opt, "sched": sched, "step": 0})


class _Call:
    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.fn, self.args


def test_a_hostile_metadata_is_refused_and_nothing_runs(saved: dict[str, Any],
                                                        tmp_path: Path) -> None:
    path = _copy(saved, tmp_path)
    marker = tmp_path / "it-ran"
    (path / ".metadata").write_bytes(pickle.dumps(_Call(os.system, f"touch {marker}")))
    model, opt, sched = _build(1)
    for attempt in (lambda: ckptio.load(path, {"model": model, "optim": opt, "sched": sched}),
                    lambda: ckptio.verify(path)):
        with pytest.raises(ckptio.PickleRefusedError, match=r"\.metadata refers to .*system"):
            attempt()
    assert not marker.exists()


def test_a_missing_data_file_is_named(saved: dict[str, Any], tmp_path: Path) -> None:
    path = _copy(saved, tmp_path)
    (path / "__0_0.distcp").unlink()
    with pytest.raises(ckptio.CorruptCheckpointError, match=r"copy/__0_0\.distcp .*is missing"):
        ckptio.load(path)


def test_rank_local_metadata_is_refused(saved: dict[str, Any], tmp_path: Path) -> None:
    path = _copy(saved, tmp_path)
    (path / ".metadata").rename(path / "__0.metadata")  # what use_collectives=False leaves
    with pytest.raises(ckptio.CkptError, match="without collectives.*torch.distributed"):
        ckptio.load(path)


def test_an_item_that_is_not_a_zip_is_refused(saved: dict[str, Any], tmp_path: Path) -> None:
    path = _copy(saved, tmp_path)
    file, _offset = _data_offset(path, "model.0.bias")
    meta = pickle.loads((path / ".metadata").read_bytes())
    start = next(v.offset for k, v in meta.storage_data.items() if k.fqn == "model.0.bias")
    raw = bytearray(file.read_bytes())
    raw[start:start + 4] = b"\x00\x01\x02\x03"
    file.write_bytes(bytes(raw))
    with pytest.raises(ckptio.CkptError, match="'model.0.bias'.* not a torch.save zip"):
        ckptio.load(path)


def test_a_transposed_item_loads(tmp_path: Path) -> None:
    """DCP writes a transposed tensor over its whole storage without copying it: read in its
    stored order and permuted back (more layouts: tests/test_dcp_patterns.py)."""
    t = torch.arange(24.0).reshape(4, 6).t()
    _dcp_save({"t": t}, tmp_path / "c")
    got = ckptio.load(tmp_path / "c")["t"]
    assert torch.equal(got, t) and got.is_contiguous()


class Custom:
    def __init__(self) -> None:
        self.x = 1


def test_a_list_with_a_gap_keeps_each_index(tmp_path: Path) -> None:
    """DCP saves nothing for an empty dict, so ``[{}, t]`` has only ``x.1``: read as a DCP
    directory and written through DcpWriter, the tensor stays at index 1 (a dict {1: t} when
    loaded fresh), never moved to index 0; in place it goes back into the list."""
    state = {"x": [{}, torch.ones(2)], "y": 3}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(tmp_path / "dcp"))
        dcp.save(state, storage_writer=ckptio.DcpWriter(str(tmp_path / "ours")))
    for path in (tmp_path / "dcp", tmp_path / "ours"):
        fresh = ckptio.load(path)
        assert list(fresh["x"]) == [1] and torch.equal(fresh["x"][1], torch.ones(2)), path
        dest = {"x": [{}, torch.zeros(2)], "y": 0}
        assert set(ckptio.load(path, dest).loaded) == {"x.1", "y"}
        assert torch.equal(dest["x"][1], torch.ones(2)) and dest["y"] == 3


def test_values_ckptio_cannot_hold(tmp_path: Path) -> None:
    # (bytes load since issue 30: tests/test_dcp_patterns.py) a tensor inside a tuple value
    _dcp_save({"b": (torch.ones(2), 1), "t": torch.zeros(2)}, tmp_path / "b")
    with pytest.raises(ckptio.CkptError, match="'b.0'.*Tensor.* does not load"):
        ckptio.load(tmp_path / "b")
    _dcp_save({"c": Custom(), "t": torch.zeros(2)}, tmp_path / "c")
    with pytest.raises(ckptio.PickleRefusedError, match="'c'.*allow_pickle=True"):
        ckptio.load(tmp_path / "c")


# ------------------------------------------------------------------------------------------------
# FSDP2 on 2 ranks, loaded on 1 and 2


def _full(value: Any) -> np.ndarray:
    full = value.full_tensor() if hasattr(value, "full_tensor") else value
    return full.detach().clone().numpy()


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict)

    out: dict[str, Any] = {f"model.{k}": _full(v) for k, v in get_model_state_dict(model).items()}
    optim = get_optimizer_state_dict(model, opt)
    for fqn, slots in optim["state"].items():
        for name, value in slots.items():
            out[f"optim.{fqn}.{name}"] = _full(value)
    out["param_groups"] = [{k: v for k, v in g.items()} for g in optim["param_groups"]]
    return out


def _dcp_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict)

    # on a fresh optimizer this creates its state first (the tensors a load fills)
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def fsdp_save(rank: int, world: int, path: str) -> dict[str, Any]:
    model, opt, sched = _build(0, fsdp=True)
    for step in range(K):
        _step(model, opt, sched, step)
    dcp.save(_dcp_state(model, opt), checkpoint_id=path)
    return _snapshot(model, opt)


def load_state(path: str, fsdp: bool) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (set_model_state_dict,
                                                         set_optimizer_state_dict)

    model, opt, _sched = _build(1, fsdp=fsdp)
    state = _dcp_state(model, opt)
    report = ckptio.load(path, state)
    assert not report.missing and not report.unexpected and not report.mismatched, report
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    return _snapshot(model, opt)


def fsdp_load(rank: int, world: int, paths: list[str]) -> list[dict[str, Any]]:
    return [load_state(path, fsdp=True) for path in paths]


def test_fsdp2_dcp_checkpoint_loads_on_1_and_2_ranks(tmp_path: Path) -> None:
    path = str(tmp_path / "fsdp")
    want = run_ranks(2, fsdp_save, path, timeout_s=300)[0]
    assert len(list(Path(path).glob("__*_0.distcp"))) == 2  # each rank wrote its shards
    assert want["param_groups"][0]["betas"] == BETAS
    # one process, no process group, plain (unsharded) model: each tensor from 2 chunks
    _assert_same(load_state(path, fsdp=False), want, "1 process")
    # and the other way: a plain model's DCP checkpoint (one process) into FSDP2 on 2 ranks
    plain = str(tmp_path / "plain")
    model, opt, sched = _build(0)
    for step in range(K):
        _step(model, opt, sched, step)
    _dcp_save(_dcp_state(model, opt), plain)
    want_plain = _snapshot(model, opt)
    # the saving layout (2 ranks, FSDP2 DTensors), and the plain checkpoint resharded into it
    for got, got_plain in run_ranks(2, fsdp_load, [path, plain], timeout_s=300):
        _assert_same(got, want, "2 ranks")
        _assert_same(got_plain, want_plain, "1 process -> 2 ranks")


def test_ckptio_ls_shows_a_dcp_checkpoint(saved: dict[str, Any]) -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "ckptio", "ls", "--flat", str(saved["path"])],
                         capture_output=True, text=True, timeout=120, env=os.environ.copy(), check=False)
    assert out.returncode == 0, out.stderr
    assert "DCP checkpoint by 1 rank(s)" in out.stdout, out.stdout
    lines = {line.split()[0]: line for line in out.stdout.splitlines()[2:]}
    assert "float32" in lines["model.0.weight"] and "[30, 12]" in lines["model.0.weight"]
    assert "0.95" in lines["optim.param_groups.0.betas.1"]


def test_a_pickled_value_whose_class_is_not_importable_is_a_ckpterror_naming_the_key(
        tmp_path: Path) -> None:
    """A namedtuple of a module the loading process lacks, saved by DCP in a process that had
    it (a pickle inside DCP's bytes): loading with allow_pickle=True raises CkptError naming
    the key and the missing module, not the unpickler's ModuleNotFoundError. (ckptio's own
    save keeps a namedtuple as a container: it loads without the module.)"""
    import subprocess
    import sys

    (tmp_path / "gone_module_x.py").write_text(
        "import collections\nPoint = collections.namedtuple('Point', 'x y')\n")
    dcp_dir = str(tmp_path / "dcp")
    code = ("import torch, ckptio, torch.distributed.checkpoint as dcp\n"
            "from gone_module_x import Point\n"
            f"dcp.save({{'w': torch.ones(2), 'p': Point(1, 2)}}, checkpoint_id={dcp_dir!r})\n"
            f"ckptio.save({{'w': torch.ones(2), 'p': Point(1, 2)}}, {str(tmp_path / 'own')!r}, "
            "allow_pickle=True)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, capture_output=True,
                   timeout=120)
    with pytest.raises(ckptio.CkptError, match=r"key 'p'.*pickled value names a class this "
                       r"process cannot find \(ModuleNotFoundError: No module named "
                       r"'gone_module_x'\); import the module"):
        ckptio.load(str(tmp_path / "dcp"), allow_pickle=True)
    own = ckptio.load(str(tmp_path / "own"), allow_pickle=True)  # a container, not a pickle:
    assert own["p"] == (1, 2) and own["p"]._fields == ("x", "y")  # rebuilt without its module
