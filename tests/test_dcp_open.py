"""Opening a DCP directory costs two rounds of reads: the ``.metadata``, then every item's head
and tail together (an item's tail holds the data descriptor with data/0's CRC-32; it and the
next item's head coalesce into one read). Checked on a real ``dcp.save`` directory with items
larger than a head: the rounds are counted at the read function the open is given, the load is
bitwise, and a flipped byte of a large tensor is still named by key and file. When a tail does
not hold the descriptor (TAIL_NBYTES made smaller than the records after data/0), the open reads
the descriptors in a third round, and loads and verifies the same.
"""

from __future__ import annotations

import io
import pickle
import shutil
import struct
import warnings
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptio
from ckptio.format import torchzip
from ckptio.loading import foreign, opening


def _state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(7)
    return {"w": {f"t{i}": torch.randn(64 + i, 200, generator=gen) for i in range(5)},
            "b": torch.arange(10, dtype=torch.int64), "small": torch.ones(3, dtype=torch.bfloat16),
            "step": 12}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("dcp") / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(_state(), checkpoint_id=str(path))
    return path


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record, for each round of reads the DCP open makes, how many reads it holds."""
    rounds: list[int] = []
    real = foreign.open_dcp

    def open_dcp(store: Any, read: Any, **kwargs: Any) -> Any:
        def counted(reads: Any) -> int:
            rounds.append(len(reads))
            return read(reads)
        return real(store, counted, **kwargs)

    monkeypatch.setattr(opening.foreign, "open_dcp", open_dcp)
    return rounds


def _check(loaded: dict[str, Any]) -> None:
    want = _state()
    for key, t in want["w"].items():
        assert torch.equal(loaded["w"][key], t), key
    assert torch.equal(loaded["b"], want["b"]) and torch.equal(loaded["small"], want["small"])
    assert loaded["step"] == 12


def _flipped(saved: Path, tmp_path: Path, key: str) -> Path:
    """A copy of ``saved`` with one byte in the middle of ``key``'s data/0 bytes flipped (found
    with torch's own unpickler and zipfile: the test wrote it)."""
    path = tmp_path / "copy"
    shutil.copytree(saved, path)
    meta = pickle.loads((path / ".metadata").read_bytes())
    info = next(v for k, v in meta.storage_data.items() if k.fqn == key)
    file = path / info.relative_path
    raw = bytearray(file.read_bytes())
    item = bytes(raw[info.offset:info.offset + info.length])
    record = next(i for i in zipfile.ZipFile(io.BytesIO(item)).infolist()
                  if i.filename.endswith("/data/0"))
    nlen, elen = struct.unpack_from("<HH", item, record.header_offset + 26)
    raw[info.offset + record.header_offset + 30 + nlen + elen + record.file_size // 2] ^= 0x04
    file.write_bytes(bytes(raw))
    return path


def _refused(path: Path, key: str) -> None:
    message = rf"checksum mismatch for key {key!r} in .*__0_0.distcp"
    for attempt in (lambda: ckptio.load(str(path)), lambda: ckptio.verify(str(path))):
        with pytest.raises(ckptio.CorruptCheckpointError, match=message):
            attempt()


def test_opening_reads_in_two_rounds_and_loads_bitwise(saved: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    rounds = _counting(monkeypatch)
    _check(ckptio.load(str(saved)))
    assert len(rounds) == 2, rounds  # .metadata; heads, tails and values together
    large = sum(1 for t in _state()["w"].values() if t.nbytes > torchzip.HEAD_NBYTES)
    assert rounds[1] == 7 + large + 1  # 7 tensors' heads, the large ones' tails, the value


def test_a_flipped_byte_of_a_large_tensor_is_named(saved: Path, tmp_path: Path) -> None:
    _refused(_flipped(saved, tmp_path, "w.t3"), "w.t3")


def test_descriptors_beyond_the_tail_take_a_third_round(
        saved: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torchzip, "TAIL_NBYTES", 8)  # too short to reach any descriptor
    rounds = _counting(monkeypatch)
    _check(ckptio.load(str(saved)))
    assert len(rounds) == 3, rounds
    assert rounds[2] == sum(1 for t in _state()["w"].values() if t.nbytes > torchzip.HEAD_NBYTES)
    _refused(_flipped(saved, tmp_path, "w.t1"), "w.t1")
