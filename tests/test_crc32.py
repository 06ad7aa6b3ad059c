"""The CRC-32 that DCP items' and torch.save files' records are checked with (format/checksum.py).

ISA-L's (the ``isal`` package, the ``fastcrc`` extra, in the test extra) when it is installed,
zlib's otherwise: the same values on every buffer, and a flipped data byte is caught by either,
named by key and file, through ``ckptio.load``, ``dcp.load`` with ``ckptio.DcpReader`` and a
torch.save file. The zlib fallback is forced by replacing the module's choice.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import ckptio
from ckptio.format import checksum

Crc = Callable[[memoryview | bytes, int], int]


def _buffers() -> list[memoryview | bytes]:
    raw = os.urandom((1 << 20) + 5)
    out: list[memoryview | bytes] = [b"", b"a", raw[:3], raw[:7], raw[:4097], raw]
    view = memoryview(bytearray(raw))
    out += [view[1:], view[3:70_001], view[5:5]]  # odd offsets and lengths, an empty slice
    return out


def test_crc32_is_isals_when_installed_and_gives_zlibs_values() -> None:
    isal_zlib = pytest.importorskip("isal.isal_zlib")
    assert checksum.crc32_by() == "isal"
    assert checksum._CRC32[1] is isal_zlib.crc32
    for data in _buffers():
        for start in (0, 1, 0x12345678, 0xFFFFFFFF):
            assert checksum.crc32(data, start) == zlib.crc32(data, start), (len(data), start)
    raw = _buffers()[-4]
    hasher = checksum.Crc32()  # fed in uneven pieces, as reads hand them over
    for lo, hi in ((0, 1), (1, 4000), (4000, 4000), (4000, len(raw))):
        hasher.update(raw[lo:hi])
    assert hasher.hexdigest() == f"{zlib.crc32(raw):08x}"


def test_without_isal_the_crc32_is_zlibs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The choice made at import when ``isal`` cannot be imported (the base install)."""
    monkeypatch.setitem(sys.modules, "isal", None)  # import isal... raises ImportError
    monkeypatch.setitem(sys.modules, "isal.isal_zlib", None)
    assert checksum._fastest_crc32() == ("zlib", zlib.crc32)


@pytest.fixture(params=["isal", "zlib"])
def crc_used(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The CRC-32 of the parameter's implementation, counting the bytes it checks."""
    if request.param == "isal":
        function: Crc = pytest.importorskip("isal.isal_zlib").crc32
    else:
        function = zlib.crc32
    seen: list[int] = []

    def counting(data: memoryview | bytes, value: int = 0) -> int:
        seen.append(len(data))
        return function(data, value)

    monkeypatch.setattr(checksum, "_CRC32", (request.param, counting))
    assert checksum.crc32_by() == request.param
    return seen


def _flip(file: Path, marker: bytes, at: int) -> None:
    raw = bytearray(file.read_bytes())
    start = raw.find(marker)
    assert start > 0
    raw[start + at] ^= 0x04
    file.write_bytes(bytes(raw))


def test_a_flipped_record_byte_is_caught_by_either_crc32(tmp_path: Path,
                                                          crc_used: list[int]) -> None:
    want = {"w": torch.arange(4096, dtype=torch.float32), "b": torch.ones(300)}
    path = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(want, checkpoint_id=str(path))
    back = ckptio.load(path)
    assert all(torch.equal(back[k], v) for k, v in want.items())
    assert sum(crc_used) >= 4096 * 4  # the records' bytes went through this CRC-32
    (data,) = path.glob("*.distcp")
    _flip(data, want["w"].numpy().tobytes()[:64], 5001)
    message = r"checksum mismatch for key 'w' in .*__0_0\.distcp"
    with pytest.raises(ckptio.CorruptCheckpointError, match=message):
        ckptio.load(path)
    with pytest.raises(CheckpointException) as info:  # DCP wraps the rank's error in its own
        dcp.load({k: torch.zeros_like(v) for k, v in want.items()},
                 storage_reader=ckptio.DcpReader(str(path)))
    (error, _trace), = info.value.failures.values()
    assert isinstance(error, ckptio.CorruptCheckpointError)
    assert re.search(message, str(error)), error
    pt = tmp_path / "state.pt"
    torch.save(want, pt)
    _flip(pt, want["w"].numpy().tobytes()[:64], 777)
    with pytest.raises(ckptio.CorruptCheckpointError, match=r"key 'w' in .*state\.pt"):
        ckptio.load(pt)


def test_the_crc32_of_a_part_follows_from_the_whole_and_its_ends() -> None:
    import random
    import zlib

    from ckptio.format.checksum import crc32_of_part

    rng = random.Random(7)
    for _ in range(200):
        head, part, tail = (rng.randbytes(rng.randrange(n)) for n in (40, 3000, 70))
        got = crc32_of_part(zlib.crc32(head + part + tail), zlib.crc32(head), zlib.crc32(tail),
                            len(part), len(tail))
        assert got == zlib.crc32(part)
    assert crc32_of_part(zlib.crc32(b"abcdef"), 0, 0, 6, 0) == zlib.crc32(b"abcdef")
    # a flipped byte of the part changes the whole, and the derived CRC no longer matches it
    damaged = crc32_of_part(zlib.crc32(b"ab" + b"cXef" + b"gh"), zlib.crc32(b"ab"),
                            zlib.crc32(b"gh"), 4, 2)
    assert damaged != zlib.crc32(b"cdef")
