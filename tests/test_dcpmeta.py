"""format/dcpmeta.py and format/torchzip.py: DCP's .metadata and item heads, decoded torch-free
and treated as hostile input.

Real inputs come from torch 2.13's own ``dcp.save`` at test time; hostile ones are real
Metadata objects pickled after a field was broken, or pickles made by hand. Every refusal must
name what it refused, and nothing named by a refused global may run.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                   Metadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)

from ckptio.errors import CkptError, CorruptCheckpointError, ManifestError, PickleRefusedError
from ckptio.format import dcpmeta, torchzip

ROOT = Path(__file__).resolve().parents[1]


def _dcp_save(state: dict[str, object], path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(path))


def _varied_state() -> dict[str, object]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    opt = torch.optim.AdamW(model.parameters(), betas=(0.9, 0.95))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": 3,
            "misc": {"f": 1.5, "s": "x", "n": None, "l": [1, 2], "t": (1, "a")},
            "bf": torch.ones(3, 2, dtype=torch.bfloat16), "i8": torch.zeros(5, dtype=torch.int8),
            "u16": torch.arange(4).to(torch.uint16), "f8": torch.zeros(2, dtype=torch.float8_e4m3fn),
            "scalar": torch.tensor(3.0), "empty": torch.zeros(0, 3)}


def test_real_metadata_decodes(tmp_path: Path) -> None:
    state = _varied_state()
    _dcp_save(state, tmp_path)
    meta = dcpmeta.decode((tmp_path / ".metadata").read_bytes(), "m")
    tensors = {t.fqn: t for t in meta.tensors}
    assert tensors["model.0.weight"].shape == (6, 4) and tensors["model.0.weight"].dtype == "float32"
    assert tensors["bf"].dtype == "bfloat16" and tensors["f8"].dtype == "float8_e4m3fn"
    assert tensors["u16"].dtype == "uint16" and tensors["scalar"].shape == ()
    assert tensors["empty"].shape == (0, 3)
    assert {v.fqn for v in meta.values} >= {"step", "misc.f", "misc.l", "misc.t",
                                            "optim.param_groups.0.betas"}
    assert meta.paths["optim.state.0.exp_avg"] == ("optim", "state", "0", "exp_avg")
    assert meta.paths["optim.param_groups.0.lr"] == ("optim", "param_groups", 0, "lr")
    # every tensor item's head parses, and its data is the tensor's bytes (CRC-32 and all)
    raw = (tmp_path / "__0_0.distcp").read_bytes()
    flat = {"model.0.weight": state["model"]["0.weight"], "bf": state["bf"], "u16": state["u16"],
            "f8": state["f8"], "scalar": state["scalar"]}
    for fqn, tensor in flat.items():
        (_chunk, item), = tensors[fqn].chunks
        head = raw[item.offset:item.offset + torchzip.HEAD_NBYTES]
        record = torchzip.parse_head(head, item.length, fqn)
        assert record.dtype == tensors[fqn].dtype and record.size == tuple(tensor.shape)
        start = item.offset + record.data_offset
        data = raw[start:start + record.storage_nbytes]
        assert data == tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        end = start + record.storage_nbytes
        crc = torchzip.parse_descriptor(raw[end:end + torchzip.DESCRIPTOR_NBYTES],
                                        record.storage_nbytes, fqn)
        import zlib
        assert crc == zlib.crc32(data)


def test_decoding_never_imports_torch(tmp_path: Path) -> None:
    """In a fresh interpreter, with ckptio's package __init__ bypassed (it imports torch), both
    modules decode a real checkpoint and torch is never imported."""
    _dcp_save(_varied_state(), tmp_path)
    code = textwrap.dedent(f"""
        import sys, types
        for name in ("ckptio", "ckptio.format"):
            module = types.ModuleType(name)
            module.__path__ = [{str(ROOT)!r} + "/" + name.replace(".", "/")]
            sys.modules[name] = module
        from ckptio.format import dcpmeta, torchzip
        meta = dcpmeta.decode(open({str(tmp_path / ".metadata")!r}, "rb").read(), "m")
        raw = open({str(tmp_path / "__0_0.distcp")!r}, "rb").read()
        for t in meta.tensors:
            for chunk, item in t.chunks:
                torchzip.parse_head(raw[item.offset:item.offset + 4096], item.length, t.fqn)
        assert len(meta.tensors) > 5, meta
        print("torch" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == "False", out


# ------------------------------------------------------------------------------------------------
# hostile .metadata


def _metadata(chunks: list[tuple[tuple[int, ...], tuple[int, ...]]] | None = None,
              shape: tuple[int, ...] = (4, 3), dtype: torch.dtype = torch.float32,
              infos: list[_StorageInfo] | None = None) -> Metadata:
    chunks = [((0, 0), (4, 3))] if chunks is None else chunks
    infos = infos or [_StorageInfo("__0_0.distcp", 2000 * i, 1000) for i in range(len(chunks))]
    storage = {MetadataIndex("w", torch.Size(o)): info for (o, _s), info in zip(chunks, infos)}
    storage[MetadataIndex("v")] = _StorageInfo("__0_0.distcp", 100_000, 900)
    return Metadata(
        state_dict_metadata={
            "w": TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape),
                                       [ChunkStorageMetadata(torch.Size(o), torch.Size(s))
                                        for o, s in chunks]),
            "v": BytesStorageMetadata()},
        planner_data={"w": ("w",), "v": ("v",)}, storage_data=storage)


def test_handmade_metadata_decodes() -> None:
    meta = dcpmeta.decode(pickle.dumps(_metadata([((0, 0), (2, 3)), ((2, 0), (2, 3))])), "m")
    (w,) = meta.tensors
    assert [c.offsets for c, _i in w.chunks] == [(0, 0), (2, 0)]
    assert [i.offset for _c, i in w.chunks] == [0, 2000]
    assert meta.values[0].fqn == "v" and meta.values[0].offsets is None


class _Call:
    def __init__(self, fn: object, *args: object) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return self.fn, self.args


@pytest.mark.parametrize("fn, name", [(os.system, f"{os.name == 'nt' and 'nt' or 'posix'}.system"),
                                      (eval, "builtins.eval")])
def test_a_global_off_the_list_is_refused_and_never_called(tmp_path: Path, fn: object,
                                                          name: str) -> None:
    marker = tmp_path / "ran"
    arg = f"touch {marker}" if fn is os.system else f"open({str(marker)!r}, 'w')"
    md = _metadata()
    md.planner_data = {"w": ("w",), "v": _Call(fn, arg)}  # type: ignore[dict-item]
    with pytest.raises(PickleRefusedError, match=rf"the-file.*{name}"):
        dcpmeta.decode(pickle.dumps(md), "the-file")
    assert not marker.exists()


def test_a_persistent_id_is_refused() -> None:
    class Pickler(pickle.Pickler):
        def persistent_id(self, obj: object) -> object:
            return "storage-7" if obj == "hook" else None

    out = io.BytesIO()
    md = _metadata()
    md.version = "hook"
    Pickler(out).dump(md)
    with pytest.raises(PickleRefusedError, match="persistent id"):
        dcpmeta.decode(out.getvalue(), "m")


def test_an_unknown_dtype_is_refused() -> None:
    with pytest.raises(PickleRefusedError, match="torch.qint8"):
        dcpmeta.decode(pickle.dumps(_metadata(dtype=torch.qint8)), "m")


def _broken(mutate: object) -> bytes:
    md = _metadata([((0, 0), (2, 3)), ((2, 0), (2, 3))])
    mutate(md)  # type: ignore[operator]
    return pickle.dumps(md)


def _chunk(md: Metadata, i: int) -> ChunkStorageMetadata:
    return md.state_dict_metadata["w"].chunks[i]  # type: ignore[union-attr]


def _info(md: Metadata, fqn: str = "w") -> _StorageInfo:
    return next(v for k, v in md.storage_data.items() if k.fqn == fqn)


@pytest.mark.parametrize("mutate, message", [
    (lambda md: setattr(_chunk(md, 0), "sizes", (2.0, 3)), "integer"),
    (lambda md: setattr(_info(md), "offset", "0"), "integer"),
    (lambda md: setattr(_info(md), "length", -1), "integer"),
    (lambda md: setattr(_info(md), "relative_path", "../x.distcp"), "FileSystemWriter file"),
    (lambda md: setattr(md.state_dict_metadata["w"], "size", (4, 3, 1)), "does not fit"),
    (lambda md: setattr(_chunk(md, 1), "offsets", (3, 0)), "does not fit"),
    (lambda md: setattr(_chunk(md, 1), "offsets", (1, 0)), "storage_data"),
    (lambda md: setattr(md.state_dict_metadata["w"], "size", (5, 3)), "do not tile"),
    (lambda md: setattr(md.state_dict_metadata["w"], "size", (2 ** 40, 2 ** 40)), "2\\^62"),
    (lambda md: setattr(md.state_dict_metadata["w"], "size", tuple([1] * 200)), "at most 128"),
    (lambda md: setattr(_info(md, "v"), "offset", 1500), "claim the same bytes"),
    (lambda md: md.storage_data.pop(next(iter(md.storage_data))), "no stored item"),
    (lambda md: setattr(md, "planner_data", {"w": ("x",), "v": ("v",)}), "does not spell"),
    (lambda md: setattr(md, "state_dict_metadata", [1, 2]), "must be a dict"),
])
def test_malformed_fields_are_refused(mutate: object, message: str) -> None:
    with pytest.raises(ManifestError, match=message):
        dcpmeta.decode(_broken(mutate), "m")


def test_stream_transforms_are_refused() -> None:
    data = _broken(lambda md: setattr(_info(md), "transform_descriptors", ["zstd"]))
    with pytest.raises(CkptError, match="stream transforms.*torch.distributed.checkpoint.load"):
        dcpmeta.decode(data, "m")


def test_huge_claimed_lengths_fail_fast() -> None:
    """A pickle claiming a 2^60-byte string, or a frame of 2^60 bytes, in a tiny file."""
    for data in (b"\x80\x04\x8d" + struct.pack("<Q", 1 << 60) + b"abc.",
                 b"\x80\x04\x95" + struct.pack("<Q", 1 << 60) + b"N."):
        with pytest.raises(ManifestError, match="not a readable pickle"):
            dcpmeta.decode(data, "m")
    with pytest.raises(ManifestError, match="more than"):
        dcpmeta.decode(b"\0" * (dcpmeta.MAX_METADATA_NBYTES + 1), "m")


@pytest.mark.parametrize("data", [b"", b"garbage", pickle.dumps([1, 2]), pickle.dumps(None)])
def test_not_metadata_at_all(data: bytes) -> None:
    with pytest.raises(ManifestError):
        dcpmeta.decode(data, "m")


# ------------------------------------------------------------------------------------------------
# item heads


def _item(tensor: torch.Tensor) -> bytes:
    out = io.BytesIO()
    torch.save(tensor, out)
    return out.getvalue()


def test_head_of_a_view_reports_its_strides() -> None:
    item = _item(torch.arange(24.0).reshape(4, 6).t())
    record = torchzip.parse_head(item[:4096], len(item), "x")
    assert record.size == (6, 4) and record.stride == (1, 6)
    assert not torchzip.row_major(record.size, record.stride)


def test_damaged_heads_are_refused() -> None:
    item = bytearray(_item(torch.arange(10.0)))
    with pytest.raises(CorruptCheckpointError, match="local header"):
        torchzip.parse_head(bytes(b"XX" + item[2:]), len(item), "x")
    broken = bytearray(item)
    broken[70] ^= 0xFF  # inside data.pkl (bytes 64-214): its descriptor's CRC-32 no longer matches
    with pytest.raises(CorruptCheckpointError, match="descriptor"):
        torchzip.parse_head(bytes(broken), len(item), "x")
    with pytest.raises(CorruptCheckpointError, match="runs past"):
        torchzip.parse_head(bytes(item), 750, "x")  # data/0: 704 + 40 + 16
    with pytest.raises(CorruptCheckpointError, match="descriptor"):
        torchzip.parse_descriptor(b"PK\x07\x08" + b"\0" * 20, 40, "x")


def test_a_custom_global_in_an_item_is_refused() -> None:
    item = _item({"a": torch.zeros(2)})  # data.pkl builds a dict: not one tensor
    with pytest.raises(CorruptCheckpointError, match="one tensor"):
        torchzip.parse_head(item[:4096], len(item), "x")
    item = _item(torch.nn.Parameter(torch.zeros(2)))  # _rebuild_parameter: not on the list
    with pytest.raises(PickleRefusedError, match="_rebuild_parameter"):
        torchzip.parse_head(item[:4096], len(item), "x")
