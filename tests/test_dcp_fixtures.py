"""DCP directories written by ``dcp.save`` on torch 2.13, 2.14 and 2.15 (tests/fixtures/dcp,
made by its make.py), loaded by ckptio on the torch CI pins: each gives back make.py's state
exactly. torch 2.15 pickles DCP's TensorProperties with a sixth field (``strides``); these
catch the next such change in every run, not only where a newer torch is installed.
"""

from __future__ import annotations

import importlib.util
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (Metadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata, ChunkStorageMetadata)
from torch.distributed.checkpoint.filesystem import _StorageInfo

import ckptio
from ckptio.errors import ManifestError
from ckptio.format import dcpmeta

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "dcp"
VERSIONS = ("2.13.0", "2.14.1", "2.15.0")


def _expected() -> dict[str, Any]:
    spec = importlib.util.spec_from_file_location("dcp_fixture_make", FIXTURES / "make.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.state()


def _same(got: Any, want: Any, where: str = "") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert got.dtype == want.dtype and got.shape == want.shape, where
        assert torch.equal(got, want), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), (where, got)
        for k in want:
            _same(got[k], want[k], f"{where}.{k}")
    else:
        assert type(got) is type(want) and got == want, (where, got, want)


def test_every_torch_version_has_its_fixture() -> None:
    made = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())
    assert made == [f"torch-{v}" for v in VERSIONS]
    for version in VERSIONS:
        assert {p.name for p in (FIXTURES / f"torch-{version}").iterdir()} == {
            ".metadata", "__0_0.distcp"}


@pytest.mark.parametrize("version", VERSIONS)
def test_a_dcp_directory_of_each_torch_loads_exactly(version: str) -> None:
    path = FIXTURES / f"torch-{version}"
    _same(ckptio.load(path), _expected())
    state = {"model": {k: torch.zeros_like(v) for k, v in _expected()["model"].items()}}
    ckptio.load(path, state, keys=["model"])  # in place, too
    _same(state["model"], _expected()["model"])
    ckptio.verify(path)


@pytest.mark.parametrize("version", VERSIONS)
def test_dcp_load_through_ckptio_reads_each_torchs_directory(version: str) -> None:
    want = _expected()
    target = {"model": {k: torch.zeros_like(v) for k, v in want["model"].items()}, "step": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one process, no process group
        dcp.load(target, storage_reader=ckptio.DcpReader(FIXTURES / f"torch-{version}"))
    _same(target, {"model": want["model"], "step": 7})


def _metadata_with_strides(monkeypatch: pytest.MonkeyPatch, strides: Any) -> bytes:
    """A .metadata whose TensorProperties pickle as torch 2.15's do: a sixth field."""
    five = TensorProperties.__getstate__
    monkeypatch.setattr(TensorProperties, "__getstate__", lambda self: (*five(self)[:5], strides))
    md = Metadata(state_dict_metadata={"w": TensorStorageMetadata(
        TensorProperties(dtype=torch.float32), torch.Size((4, 3)),
        [ChunkStorageMetadata(torch.Size((0, 0)), torch.Size((4, 3)))])},
        storage_data={MetadataIndex("w", torch.Size((0, 0))): _StorageInfo("__0_0.distcp", 0, 900)})
    return pickle.dumps(md)


@pytest.mark.parametrize("strides", [(3, 1), None, (0, 0), ()])
def test_strides_are_read(monkeypatch: pytest.MonkeyPatch, strides: Any) -> None:
    (w,) = dcpmeta.decode(_metadata_with_strides(monkeypatch, strides), "m").tensors
    assert w.dtype == "float32" and w.shape == (4, 3)


@pytest.mark.parametrize("strides", ["3,1", (3.0, 1), (-1, 1), [3, 1]])
def test_malformed_strides_are_refused(monkeypatch: pytest.MonkeyPatch, strides: Any) -> None:
    with pytest.raises(ManifestError, match="key 'w': TensorProperties.strides"):
        dcpmeta.decode(_metadata_with_strides(monkeypatch, strides), "m")


def test_a_seventh_field_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    five = TensorProperties.__getstate__
    monkeypatch.setattr(TensorProperties, "__getstate__", lambda self: (*five(self)[:5], None, 1))
    md = Metadata(state_dict_metadata={"w": TensorStorageMetadata(
        TensorProperties(dtype=torch.float32), torch.Size((1,)),
        [ChunkStorageMetadata(torch.Size((0,)), torch.Size((1,)))])},
        storage_data={MetadataIndex("w", torch.Size((0,))): _StorageInfo("__0_0.distcp", 0, 9)})
    with pytest.raises(ManifestError, match=r"pin_memory\[, strides\]\), got a tuple of 7"):
        dcpmeta.decode(pickle.dumps(md), "m")
