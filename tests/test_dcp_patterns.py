"""The patterns of PyTorch's own DCP test suite, through every way ckptio meets them.

Each pattern goes through ckptio.save/load (fresh and in place), dcp.save into
ckptio.DcpWriter, dcp.load from ckptio.DcpReader, a stock DCP directory (FileSystemWriter) and a
torch.save file, as it applies: zero-element tensors; tensors whose strides are not row-major
(transposed, channels-last, expanded, stepped); ``bytes`` and ``io.BytesIO`` values (DCP's
end-to-end ``TrainState`` keeps its losses in a BytesIO); lists whose length differs between
the state and the checkpoint; namedtuples and defaultdicts. Then what ckptio cannot store:
sparse, quantized and nested tensors, each refused with an UnsupportedStateError naming the key,
the layout and the fix, before anything is written (legacy ShardedTensors are stored:
tests/test_sharded_tensor.py).
Every round trip is checked bitwise (torch.equal, dtype, shape, strides where they matter).
"""

from __future__ import annotations

import collections
import io
import json
import os
import pickle
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptio
from ckptio.errors import ManifestError, StateMismatchError, UnsupportedStateError
from ckptio.format import manifest
from ckptio.testing.rank_processes import run_ranks

Pair = collections.namedtuple("Pair", "first second")


def _dcp_save(state: dict[str, Any], path: Path, *, ours: bool = False) -> None:
    """dcp.save from one process with no process group: FileSystemWriter, or ckptio's."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        if ours:
            dcp.save(state, storage_writer=ckptio.DcpWriter(str(path)))
        else:
            dcp.save(state, checkpoint_id=str(path))


def _dcp_load(state: dict[str, Any], path: Path, **kwargs: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=ckptio.DcpReader(str(path), **kwargs))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same(got: torch.Tensor, want: torch.Tensor, *, strides: bool = True) -> None:
    """Bitwise equal (NaN payloads and -0.0 too), same dtype and shape; with ``strides``,
    row-major as a fresh load makes it."""
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(_bits(got), _bits(want))
    if strides:
        assert got.stride() == torch.empty(want.shape).stride()


def _kinds(path: Path) -> dict[str, str]:
    record = manifest.decode((path / "manifest.json").read_bytes(), str(path))
    return {t.key: t.kind for t in record.tensors}


# ------------------------------------------------------------------------------------------------
# zero-element tensors


def _empties() -> dict[str, torch.Tensor]:
    base = torch.arange(12.0).reshape(3, 4)
    return {"e3": torch.empty(3, 0, 2), "e1": torch.empty(0, dtype=torch.int64),
            "bf": torch.empty(0, 5, dtype=torch.bfloat16), "view": base[:, :0],
            "t": torch.empty(2, 0).t(), "base": base}


def _check_empties(got: dict[str, Any]) -> None:
    for key, want in _empties().items():
        _same(got[key], want)


def test_zero_element_tensors_through_save_and_load(tmp_path: Path) -> None:
    ckptio.save(_empties(), tmp_path / "c")
    _check_empties(ckptio.load(tmp_path / "c"))
    into = {k: torch.ones(v.shape, dtype=v.dtype) for k, v in _empties().items()}
    ckptio.load(tmp_path / "c", into)
    _check_empties(into)
    into = {k: torch.ones(v.shape, dtype=v.dtype) for k, v in _empties().items()}
    _dcp_load(into, tmp_path / "c")
    _check_empties(into)


def test_zero_element_tensors_from_dcp_directories(tmp_path: Path) -> None:
    for name, ours in (("dcp", False), ("ours", True)):
        _dcp_save(_empties(), tmp_path / name, ours=ours)
        _check_empties(ckptio.load(tmp_path / name))
        assert ckptio.verify(tmp_path / name) >= 12 * 4
        into = {k: torch.ones(v.shape, dtype=v.dtype) for k, v in _empties().items()}
        _dcp_load(into, tmp_path / name)
        _check_empties(into)


def test_zero_element_tensors_from_a_torch_save_file(tmp_path: Path) -> None:
    torch.save(_empties(), tmp_path / "e.pt")  # "view" shares base's storage: no bytes of it
    _check_empties(ckptio.load(tmp_path / "e.pt"))
    into = {k: torch.ones(v.shape, dtype=v.dtype) for k, v in _empties().items()}
    ckptio.load(tmp_path / "e.pt", into)
    _check_empties(into)


# ------------------------------------------------------------------------------------------------
# strides that are not row-major


def _strided() -> dict[str, torch.Tensor]:
    grid = torch.arange(24.0).reshape(4, 6)
    return {
        "t": grid.t(),  # a transposed view of all of its storage
        "cl": torch.arange(120, dtype=torch.int16).reshape(2, 3, 4, 5).contiguous(
            memory_format=torch.channels_last),
        "bf": (torch.arange(35.0).reshape(5, 7) / 7).to(torch.bfloat16).t(),
        "nan": torch.tensor([[float("nan"), -0.0], [float("inf"), 1.0]]).t(),
    }


def test_any_strides_save_bitwise_and_load_row_major(tmp_path: Path) -> None:
    """ckptio.save stores any strided tensor's elements (transposed, channels-last, expanded
    with stride 0, stepped, offset into a larger storage); a fresh load is row-major, an
    in-place load keeps the caller's strides."""
    base = torch.arange(30.0)
    state = {**_strided(), "expanded": torch.arange(3.0).expand(4, 3),
             "stepped": base[1::3], "offset": base.view(5, 6)[1:3, 2:5]}
    ckptio.save(state, tmp_path / "c")
    got = ckptio.load(tmp_path / "c")
    for key, want in state.items():
        _same(got[key], want)
    into = {k: torch.zeros_like(v) for k, v in _strided().items()}  # same strides as saved
    ckptio.load(tmp_path / "c", into, strict=False)
    for key, want in _strided().items():
        _same(into[key], want, strides=False)
        assert into[key].stride() == want.stride(), key


def test_transposed_tensors_from_dcp_directories(tmp_path: Path) -> None:
    """DCP writes a transposed or channels-last tensor over its whole storage as is: ckptio
    reads it in its stored order and permutes it back, fresh, in place, through DcpReader and
    into a region of it (a TensorShard and a FlatShard)."""
    _dcp_save(_strided(), tmp_path / "dcp")
    got = ckptio.load(tmp_path / "dcp")
    for key, want in _strided().items():
        _same(got[key], want)
    into = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in _strided().items()}
    ckptio.load(tmp_path / "dcp", into)
    for key, want in _strided().items():
        _same(into[key], want)
    into = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in _strided().items()}
    _dcp_load(into, tmp_path / "dcp")
    for key, want in _strided().items():
        _same(into[key], want)
    box = ckptio.TensorShard(torch.zeros(2, 4), global_shape=(6, 4), offsets=(3, 0))
    flat = ckptio.FlatShard(torch.zeros(7), global_shape=(6, 4), start=9)
    ckptio.load(tmp_path / "dcp", {"t": box}, strict=False)
    ckptio.load(tmp_path / "dcp", {"t": flat}, strict=False)
    want = _strided()["t"]
    assert torch.equal(box.local, want[3:5]) and torch.equal(flat.local, want.reshape(-1)[9:16])
    assert ckptio.verify(tmp_path / "dcp") > 0


def test_transposed_tensors_export_to_safetensors(tmp_path: Path) -> None:
    """export_hf reads a transposed DCP or torch.save tensor in windows (small shards) and in
    another dtype: the same values as the tensor itself."""
    from safetensors.torch import load_file

    state = {"model": _strided()}
    _dcp_save(state, tmp_path / "dcp")
    torch.save(state, tmp_path / "s.pt")
    for name in ("dcp", "s.pt"):
        for dtype in (None, torch.float32):
            out = tmp_path / f"hf-{name}-{dtype}"
            ckptio.export_hf(tmp_path / name, out, dtype=dtype, max_shard_bytes=256)
            got: dict[str, torch.Tensor] = {}
            for file in out.glob("*.safetensors"):
                got.update(load_file(file))
            for key, want in _strided().items():
                cast = want if dtype is None or not want.is_floating_point() else want.to(dtype)
                _same(got[key], cast)


def test_transposed_tensors_from_a_torch_save_file(tmp_path: Path) -> None:
    torch.save(_strided(), tmp_path / "s.pt")
    got = ckptio.load(tmp_path / "s.pt")
    for key, want in _strided().items():
        _same(got[key], want)
    square = torch.arange(9.0).reshape(3, 3)  # the same storage, the same size, two views
    torch.save({"a": square, "b": square.t()}, tmp_path / "two.pt")
    with pytest.raises(ckptio.CkptError, match="'a' and 'b' are different views.*torch.load"):
        ckptio.load(tmp_path / "two.pt")
    torch.save({"a": square.t(), "b": square.t()}, tmp_path / "tied.pt")  # one view twice
    got = ckptio.load(tmp_path / "tied.pt")
    _same(got["a"], square.t())
    _same(got["b"], square.t())


def test_strided_views_in_a_torch_save_file_are_refused(tmp_path: Path) -> None:
    base = torch.arange(10.0)
    torch.save({"x": base[2:6]}, tmp_path / "slice.pt")  # row-major part: read (a slice)
    _same(ckptio.load(tmp_path / "slice.pt")["x"], base[2:6])
    torch.save({"x": base[::2]}, tmp_path / "step.pt")
    with pytest.raises(ckptio.CkptError, match="key 'x'.*view of part of a storage.*"
                                               "contiguous\\(\\).clone\\(\\)"):
        ckptio.load(tmp_path / "step.pt")


# ------------------------------------------------------------------------------------------------
# bytes and io.BytesIO: DCP's TrainState


@dataclass
class TrainState:
    """PyTorch's e2e DCP test's train state: its losses torch.save'd into a BytesIO."""

    step: int = 0
    current_loss: float = -1.0
    losses: list[float] = field(default_factory=list)

    def state_dict(self) -> dict[str, Any]:
        buffer = io.BytesIO()
        torch.save(self.losses, buffer)
        return {"step": torch.tensor(self.step, dtype=torch.int32),
                "current_loss": torch.tensor(self.current_loss, dtype=torch.float32),
                "losses": buffer}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"].item())
        self.current_loss = float(state["current_loss"].item())
        state["losses"].seek(0)
        self.losses = torch.load(state["losses"])  # weights_only: a list of floats


def _trained_state() -> TrainState:
    # current_loss goes through a float32 tensor, as in the e2e test: one float32 holds exactly
    return TrainState(step=3, current_loss=0.375, losses=[0.5, 0.25, 0.1 + 0.2])


def _payloads() -> dict[str, Any]:
    return {"raw": b"\x00\xff\x80 bytes", "empty": b"", "buf": io.BytesIO(b"\x01\x02\x03"),
            "none_buf": io.BytesIO()}


def _check_payloads(got: dict[str, Any]) -> None:
    assert got["raw"] == b"\x00\xff\x80 bytes" and type(got["raw"]) is bytes
    assert got["empty"] == b""
    for key, want in (("buf", b"\x01\x02\x03"), ("none_buf", b"")):
        assert type(got[key]) is io.BytesIO and got[key].getvalue() == want
        assert got[key].tell() == 0  # at its start: read as it comes


def test_train_state_bytesio_through_save_and_load(tmp_path: Path) -> None:
    saved = _trained_state()
    ckptio.save({"train_state": saved, **_payloads()}, tmp_path / "c")
    assert _kinds(tmp_path / "c")["train_state.losses"] == "bytesio"
    assert _kinds(tmp_path / "c")["raw"] == "bytes"
    loaded = TrainState()
    state = {"train_state": loaded, **{k: None for k in _payloads()}}
    ckptio.load(tmp_path / "c", state)  # no allow_pickle: nothing is unpickled
    assert loaded == saved
    _check_payloads(state)
    _check_payloads(ckptio.load(tmp_path / "c"))
    loaded = TrainState()
    _dcp_load({"train_state": loaded}, tmp_path / "c")
    assert loaded == saved


def test_train_state_bytesio_from_dcp_directories(tmp_path: Path) -> None:
    for name, ours in (("dcp", False), ("ours", True)):
        saved = _trained_state()
        _dcp_save({"train_state": saved, "w": torch.ones(3), **_payloads()}, tmp_path / name,
                  ours=ours)
        loaded = TrainState()
        state = {"train_state": loaded, "w": torch.zeros(3), **{k: None for k in _payloads()}}
        ckptio.load(tmp_path / name, state)
        assert loaded == saved and torch.equal(state["w"], torch.ones(3))
        _check_payloads(state)
        _check_payloads(ckptio.load(tmp_path / name))
        loaded = TrainState()
        _dcp_load({"train_state": loaded}, tmp_path / name)
        assert loaded == saved
    kinds = _kinds(tmp_path / "ours")  # DcpWriter stores their content, as ckptio.save does
    assert kinds["train_state.losses"] == "bytesio" and kinds["raw"] == "bytes"


def test_bytes_inside_dcp_values_and_torch_save_files(tmp_path: Path) -> None:
    """bytes inside a value DCP stores whole (a tuple), bytearrays and BytesIO in a torch.save
    file: no allow_pickle, and the BytesIO's content is not unpickled (it holds a pickle of
    an object no allow-list knows)."""
    hostile = pickle.dumps(Pair(1, 2))  # unpickling it would import this module's class
    state = {"v": (b"\x00\xff", 7), "buf": io.BytesIO(hostile), "w": torch.ones(2)}
    _dcp_save(state, tmp_path / "dcp")
    for got in (ckptio.load(tmp_path / "dcp"),):
        assert got["v"] == (b"\x00\xff", 7) and got["buf"].getvalue() == hostile
    torch.save({**state, "arr": bytearray(b"\x05\x06"), "nested": [b"a", {"b": b""}]},
               tmp_path / "s.pt")
    got = ckptio.load(tmp_path / "s.pt")
    assert got["v"] == (b"\x00\xff", 7) and got["buf"].getvalue() == hostile
    assert got["arr"] == b"\x05\x06" and got["nested"] == [b"a", {"b": b""}]
    assert torch.equal(got["w"], torch.ones(2))


def test_a_pickled_object_in_a_dcp_value_still_needs_allow_pickle(tmp_path: Path) -> None:
    _dcp_save({"p": Pair(io.BytesIO(b"x"), 1), "w": torch.ones(1)}, tmp_path / "dcp")
    with pytest.raises(ckptio.PickleRefusedError, match="'p'.*allow_pickle=True"):
        ckptio.load(tmp_path / "dcp")
    got = ckptio.load(tmp_path / "dcp", allow_pickle=True)
    assert type(got["p"]) is Pair and got["p"].first.getvalue() == b"x"


# ------------------------------------------------------------------------------------------------
# lists of another length in place


class Losses:
    """A Stateful holding a list of Python values that grows during training."""

    def __init__(self, values: list[float]) -> None:
        self.values = values

    def state_dict(self) -> dict[str, Any]:
        return {"values": self.values}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.values = state["values"]


def test_a_list_of_values_of_another_length_takes_the_saved_list(tmp_path: Path) -> None:
    ckptio.save({"l": [1, 2.5, "x"], "empty": [], "nested": {"m": [[1], [2, 3]]},
                 "obj": Losses([0.5, 0.25]), "w": torch.ones(2)}, tmp_path / "c")
    mine, nested = [0], [[9]]
    state = {"l": mine, "empty": [4, 5], "nested": {"m": nested}, "obj": Losses([]),
             "w": torch.zeros(2)}
    report = ckptio.load(tmp_path / "c", state)  # strict: the lists are not key mismatches
    assert state["l"] is mine and mine == [1, 2.5, "x"]
    assert state["empty"] == [] and state["nested"]["m"] is nested and nested == [[1], [2, 3]]
    assert state["obj"].values == [0.5, 0.25] and torch.equal(state["w"], torch.ones(2))
    assert "l.2" in report.loaded and not report.missing and not report.unexpected
    longer = {"l": [0, 0, 0, 0, 0], "empty": [], "nested": {"m": []}, "obj": Losses([1.0] * 9),
              "w": torch.zeros(2)}
    ckptio.load(tmp_path / "c", longer)
    assert longer["l"] == [1, 2.5, "x"] and longer["obj"].values == [0.5, 0.25]


def test_a_list_of_tensors_must_keep_its_length(tmp_path: Path) -> None:
    ckptio.save({"layers": [torch.ones(2), torch.full((2,), 2.0)]}, tmp_path / "c")
    with pytest.raises(StateMismatchError, match="missing from the checkpoint \\['layers.2'\\].*"
                                                  "'layers' has 3 items, the checkpoint 2"):
        ckptio.load(tmp_path / "c", {"layers": [torch.zeros(2) for _ in range(3)]})
    state = {"layers": [torch.zeros(2), torch.zeros(2), torch.zeros(2)]}
    report = ckptio.load(tmp_path / "c", state, strict=False)
    assert report.missing == ("layers.2",)
    assert torch.equal(state["layers"][1], torch.full((2,), 2.0))
    assert torch.equal(state["layers"][2], torch.zeros(2))


# ------------------------------------------------------------------------------------------------
# namedtuples and defaultdicts


def _containers() -> dict[str, Any]:
    return {"pair": Pair(torch.arange(3.0), 2),
            "nested": [{"p": Pair(first=Pair(1, 2), second=None)}],
            "counts": collections.defaultdict(int, {"a": 1, 7: torch.ones(1)}),
            "lists": collections.defaultdict(list, {"x": [1, 2]}),
            "milestones": collections.Counter({30: 1, 80: 2}),
            "plain": (1, 2), "d": {"k": 1}}


def test_namedtuples_and_defaultdicts_come_back_as_they_were(tmp_path: Path) -> None:
    ckptio.save(_containers(), tmp_path / "c")
    got = ckptio.load(tmp_path / "c")
    assert type(got["pair"]) is Pair and torch.equal(got["pair"].first, torch.arange(3.0))
    assert got["pair"].second == 2
    inner = got["nested"][0]["p"]
    assert type(inner) is Pair and type(inner.first) is Pair and inner == (Pair(1, 2), None)
    counts = got["counts"]
    assert type(counts) is collections.defaultdict and counts.default_factory is int
    assert counts["a"] == 1 and torch.equal(counts[7], torch.ones(1)) and counts["new"] == 0
    assert got["lists"].default_factory is list and got["lists"]["x"] == [1, 2]
    assert type(got["milestones"]) is collections.Counter  # MultiStepLR's milestones
    assert got["milestones"] == collections.Counter({30: 1, 80: 2})
    assert got["milestones"]["absent"] == 0
    assert type(got["plain"]) is tuple and type(got["d"]) is dict
    state = _containers()  # in place: the caller's containers, values replaced
    state["pair"] = Pair(torch.zeros(3), 0)
    ckptio.load(tmp_path / "c", state)
    assert type(state["pair"]) is Pair and state["pair"].second == 2
    listing = subprocess.run([sys.executable, "-m", "ckptio", "ls", "--json", str(tmp_path / "c")],
                             capture_output=True, text=True, check=True)
    types = {n["name"]: n["type"] for n in json.loads(listing.stdout)["tree"]["children"]}
    assert types["pair"] == "namedtuple" and types["counts"] == "defaultdict"
    assert types["milestones"] == "Counter"


def test_a_multisteplr_loaded_fresh_steps_by_epoch_as_the_saved_one(tmp_path: Path) -> None:
    """A fresh load's scheduler state gives MultiStepLR its Counter back: ``step(epoch)``
    (the closed form, which calls ``milestones.elements()``) works after load_state_dict."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 4, 4], gamma=0.5)
    ckptio.save({"sched": sched.state_dict()}, tmp_path / "c")
    fresh_opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0)
    fresh = torch.optim.lr_scheduler.MultiStepLR(fresh_opt, milestones=[1])
    fresh.load_state_dict(ckptio.load(tmp_path / "c")["sched"])
    assert fresh.milestones == collections.Counter({2: 1, 4: 2})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch deprecates step(epoch) but keeps it
        fresh.step(5)
    assert fresh.get_last_lr() == [0.125]


def containers_case(rank: int, world_size: int, tmp: str) -> None:
    """Two pipeline stages: each rank holds its own keys of one defaultdict and one
    namedtuple of its own values per rank."""
    state = {"stage": collections.defaultdict(list, {f"layer{rank}": torch.full((2,), rank)}),
             "pair": Pair(torch.ones(2), 5)}
    ckptio.save(state, os.path.join(tmp, "c"))


def test_containers_saved_by_ranks_holding_different_keys(tmp_path: Path) -> None:
    run_ranks(2, containers_case, str(tmp_path))
    got = ckptio.load(tmp_path / "c")
    assert type(got["stage"]) is collections.defaultdict and got["stage"].default_factory is list
    assert sorted(got["stage"]) == ["layer0", "layer1"]
    assert torch.equal(got["stage"]["layer1"], torch.full((2,), 1))
    assert type(got["pair"]) is Pair and got["pair"].second == 5


def test_a_namedtuple_whose_class_is_not_loaded_gets_a_stand_in(tmp_path: Path) -> None:
    Local = collections.namedtuple("Local", ["alpha", "beta"])  # no module attribute names it
    ckptio.save({"x": Local(1, [2])}, tmp_path / "c")
    first, second = ckptio.load(tmp_path / "c")["x"], ckptio.load(tmp_path / "c")["x"]
    assert type(first) is not Local and type(first).__name__ == "Local"
    assert type(first)._fields == ("alpha", "beta") and first.alpha == 1 and first.beta == [2]
    assert type(first) is type(second) and first == Local(1, [2])


def test_a_defaultdict_with_another_factory_is_refused_at_save(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedStateError, match="key 'opt.dd': a defaultdict whose "
                                                    "default_factory.*dict\\(d\\)"):
        ckptio.save({"opt": {"dd": collections.defaultdict(lambda: 5)}}, tmp_path / "c")
    assert not (tmp_path / "c" / "manifest.json").exists()


@pytest.mark.parametrize("info", [
    ["namedtuple", "os", "system", ["__import__"]],  # not a field name namedtuple takes
    ["namedtuple", "m", "T", ["a", "a"]],
    ["namedtuple", "m", "T", ["a", "b", "c"]],  # three fields for a tuple of two
    ["defaultdict", "os.system"],
    ["frozenset"],
], ids=["dunder-field", "twice", "arity", "factory", "type"])
def test_a_hostile_container_type_is_refused(tmp_path: Path, info: list[Any]) -> None:
    ckptio.save({"t": (1, 2), "d": {"k": 1}}, tmp_path / "c")
    path = tmp_path / "c" / "manifest.json"
    record = manifest.decode(path.read_bytes(), str(path))
    (key, node), other = record.tree["d"][0], record.tree["d"][1]
    if info[0] == "defaultdict":
        key, node = other
    wrapped = {"d": [[key, {"c": [info, node]}], *(p for p in record.tree["d"] if p[0] != key)]}
    path.write_bytes(manifest.encode(record.__class__(**{**record.__dict__, "tree": wrapped})))
    with pytest.raises(ManifestError, match="tree node"):
        ckptio.load(tmp_path / "c")


# ------------------------------------------------------------------------------------------------
# what ckptio cannot store


def _unstorable() -> list[Any]:
    eye = torch.eye(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # beta / prototype / deprecated warnings
        return [
            pytest.param(eye.to_sparse(), "sparse COO tensor.*to_dense", id="coo"),
            pytest.param(eye.to_sparse_csr(), "sparse CSR tensor.*to_dense", id="csr"),
            pytest.param(eye.to_sparse_csc(), "sparse CSC tensor.*to_dense", id="csc"),
            pytest.param(eye.to_sparse_bsr((1, 1)), "sparse BSR tensor.*to_dense", id="bsr"),
            pytest.param(torch.quantize_per_tensor(eye, 0.1, 0, torch.qint8),
                         "quantized tensor \\(dtype torch.qint8, torch.per_tensor_affine\\).*"
                         "dequantize", id="quantized"),
            pytest.param(torch.quantize_per_channel(eye, torch.tensor([0.1, 0.2, 0.3]),
                                                    torch.tensor([0, 0, 0]), 0, torch.quint8),
                         "quantized tensor \\(dtype torch.quint8, torch.per_channel_affine\\)",
                         id="per-channel"),
            pytest.param(torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
                         "nested tensor \\(layout torch.strided\\).*unbind", id="nested"),
            pytest.param(torch.nested.nested_tensor([torch.ones(2, 4), torch.ones(3, 4)],
                                                    layout=torch.jagged),
                         "nested tensor \\(layout torch.jagged\\).*unbind", id="jagged"),
        ]


@pytest.mark.parametrize(("tensor", "message"), _unstorable())
def test_layouts_ckptio_cannot_store_are_refused(tmp_path: Path, tensor: torch.Tensor,
                                                 message: str) -> None:
    with pytest.raises(UnsupportedStateError, match=f"key 'model.w': a {message}"):
        ckptio.save({"model": {"w": tensor, "b": torch.ones(2)}}, tmp_path / "c")
    assert not os.path.exists(tmp_path / "c" / "manifest.json")
    ckptio.save({"model": {"w": torch.ones(3, 3)}}, tmp_path / "ok")
    with pytest.raises(UnsupportedStateError, match=f"key 'model.w': a {message}"):
        ckptio.load(tmp_path / "ok", {"model": {"w": tensor}})


@pytest.mark.parametrize("tagged", [["bytes", "not base64!"], ["bytes", 5], ["bytesio", None],
                                    ["bytes", "YWJ"]], ids=["text", "int", "none", "padding"])
def test_malformed_inline_bytes_are_refused(tagged: list[Any]) -> None:
    from ckptio.format import values

    with pytest.raises(ValueError, match="bytes value"):
        values.decode(tagged)
    every = bytes(range(256))
    assert values.decode(values.encode(every)) == every
    assert values.decode(values.encode(io.BytesIO(every))).getvalue() == every


# ------------------------------------------------------------------------------------------------
# PyTorch's DCP test patterns: a state DCP flattens to nothing, a writer that must not overwrite


class _EmptyStateful:
    """A Stateful whose state_dict() is {} (DCP saves nothing for it)."""

    def __init__(self) -> None:
        self.loaded: Any = None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state


def _empty_states() -> list[tuple[str, Any]]:
    return [("empty", lambda: {}), ("empty_level", lambda: {"foo": {}}),
            ("stateful", lambda: {"s": _EmptyStateful()}),
            ("with_a_tensor", lambda: {"a": torch.arange(3.0), "e": {}})]


@pytest.mark.parametrize("name,make", _empty_states(), ids=[n for n, _ in _empty_states()])
def test_a_state_dcp_flattens_to_nothing_saves_and_loads(tmp_path: Path, name, make) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # the control: DCP's own writer and reader take it
        dcp.save(make(), storage_writer=dcp.FileSystemWriter(str(tmp_path / "dcp")))
        dcp.load(make(), storage_reader=dcp.FileSystemReader(str(tmp_path / "dcp")))
        got = ckptio.load(tmp_path / "dcp")  # a stock DCP directory: a dict, not a list
        assert isinstance(got, dict), got
        # ckptio's writer and reader under dcp.save / dcp.load, the same way
        dcp.save(make(), storage_writer=ckptio.DcpWriter(tmp_path / "ours"))
        target = make()
        dcp.load(target, storage_reader=ckptio.DcpReader(tmp_path / "ours"))
    if name == "with_a_tensor":
        _same(target["a"], torch.arange(3.0))
        assert list(got) == ["a"]
    else:
        assert got == {}
    assert isinstance(ckptio.load(tmp_path / "ours"), dict)


def test_a_writer_made_with_overwrite_false_refuses_a_committed_checkpoint(
        tmp_path: Path) -> None:
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"a": torch.ones(2)}, storage_writer=dcp.FileSystemWriter(str(tmp_path / "d")))
        with pytest.raises(CheckpointException, match="already exists"):  # the control
            dcp.save({"a": torch.zeros(2)},
                     storage_writer=dcp.FileSystemWriter(str(tmp_path / "d"), overwrite=False))
        path = tmp_path / "ours"
        dcp.save({"a": torch.ones(2)}, storage_writer=ckptio.DcpWriter(path, overwrite=False))
        with pytest.raises(CheckpointException, match="CkptError.*overwrite=False"):
            dcp.save({"a": torch.zeros(2)}, storage_writer=ckptio.DcpWriter(path,
                                                                          overwrite=False))
        # PyTorch's own test_overwrite matches DCP's words, through any writer
        with pytest.raises(CheckpointException, match=".*Checkpoint already exists.*") as caught:
            dcp.save({"a": torch.zeros(2)}, storage_writer=ckptio.DcpWriter(path,
                                                                          overwrite=False))
        (cause, _trace), = caught.value.failures.values()
        assert isinstance(cause, ckptio.CkptError)
        _same(ckptio.load(path)["a"], torch.ones(2))  # left as it was
        dcp.save({"a": torch.zeros(2)}, storage_writer=ckptio.DcpWriter(path))  # the default
    _same(ckptio.load(path)["a"], torch.zeros(2))


_PROBE = """
import multiprocessing as mp
import os
import tempfile

import torch
import torch.distributed.checkpoint as dist_cp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter


def _child(q):
    from torch.distributed.checkpoint import FileSystemWriter as W
    q.put(W.__mro__[1].__name__)


def test_round_trip():
    with tempfile.TemporaryDirectory() as path:
        dist_cp.save({"a": torch.arange(4.0)}, storage_writer=FileSystemWriter(path=path, thread_count=2),
                     no_dist=True)
        out = {"a": torch.zeros(4)}
        dist_cp.load(out, storage_reader=dist_cp.FileSystemReader(path), no_dist=True)
        assert torch.equal(out["a"], torch.arange(4.0))


def test_which_writer_wrote():
    with tempfile.TemporaryDirectory() as path:
        dist_cp.save({"a": torch.ones(2)}, storage_writer=FileSystemWriter(path=path), no_dist=True)
        assert "manifest.json" in os.listdir(path)


def test_a_spawned_child_sees_the_same_writer():
    q = mp.get_context("spawn").Queue()
    p = mp.get_context("spawn").Process(target=_child, args=(q,))
    p.start()
    assert q.get(timeout=120) == "DcpWriter"
    p.join()
"""


def test_the_script_that_runs_pytorchs_dcp_tests_swaps_writer_and_reader(tmp_path: Path) -> None:
    """dev/pytorch_dcp_tests.py (run by hand on PyTorch's own test files) on a probe of ours:
    DCP's run as it is, then ckptio's DcpWriter/DcpReader in place of FileSystemWriter/Reader,
    in the test process and in a process it spawns."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_swap_probe.py").write_text(_PROBE)
    script = Path(__file__).resolve().parents[1] / "dev" / "pytorch_dcp_tests.py"
    done = subprocess.run([sys.executable, str(script), "--from", str(tmp_path / "tests"),
                           "--files", "test_swap_probe.py", "--keep", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "| test_swap_probe.py | 1 / 2 / 0 | 3 / 0 / 0 |" in done.stdout, done.stdout
