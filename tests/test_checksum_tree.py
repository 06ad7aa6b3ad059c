"""Checksums hash every byte once (issue 29): under ``xxh3_64_tree``, the default, an entry's
block checksums are of its bytes and its whole checksum is of its block checksums, so a save and
a load hash each byte once; checkpoints of the earlier ``xxh3_64`` (whole checksum of the bytes)
still load and verify, and a delta over such a base still saves."""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterator

import pytest
import torch
import xxhash

import ckptio
from ckptio import CkptError, CorruptCheckpointError, Options

MiB = 1 << 20


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"big": torch.randn(3 * MiB // 4 + 17, generator=g),  # 3 MiB + 68 bytes: 4 blocks
            "mid": torch.randn(MiB // 4, generator=g),  # exactly one block
            "small": torch.arange(10, dtype=torch.int64)}


def nbytes(s: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in s.values())


def body(path: str) -> dict:
    with open(os.path.join(path, "manifest.json"), "rb") as f:
        return json.loads(f.read().split(b"\n")[1])


class Counting:
    """xxh3_64 that adds the bytes it hashes to a shared count."""

    total = 0

    def __init__(self) -> None:
        self.inner = REAL()

    def update(self, data) -> None:
        Counting.total += memoryview(data).nbytes
        self.inner.update(data)

    def hexdigest(self) -> str:
        return self.inner.hexdigest()


REAL = xxhash.xxh3_64
REAL_DIGEST = xxhash.xxh3_64_hexdigest


def counting_digest(data) -> str:
    """xxh3_64's one-shot digest (a save hashes a small entry's bytes with it), counted."""
    Counting.total += memoryview(data).nbytes
    return REAL_DIGEST(data)


@pytest.fixture
def counted(monkeypatch) -> Iterator[type[Counting]]:
    monkeypatch.setattr(xxhash, "xxh3_64", Counting)
    monkeypatch.setattr(xxhash, "xxh3_64_hexdigest", counting_digest)
    Counting.total = 0
    yield Counting


@pytest.mark.parametrize("algorithm, passes", [("xxh3_64_tree", 1), ("xxh3_64", 2)])
def test_every_byte_is_hashed_once_on_save_and_on_load(tmp_path, counted, algorithm, passes):
    s = state()
    ck = ckptio.Checkpointer(Options(checksum=algorithm, use_profile=False))
    ck.save(s, str(tmp_path / "c"))
    # xxh3_64's save hashes the bytes of an entry of several blocks twice (whole + block),
    # an entry of one block or less once (its one block checksum is its whole one); the tree
    # hashes every byte once (+ the 64 hex digits of the 4-block entry's block checksums); a
    # whole load hashes each byte once
    tree = nbytes(s) + 4 * 16
    big = s["big"].numel() * s["big"].element_size()
    assert counted.total == (tree if passes == 1 else nbytes(s) + big)
    counted.total = 0
    out = ck.load(str(tmp_path / "c"))
    assert counted.total == (tree if passes == 1 else nbytes(s))
    assert all(torch.equal(out[k], s[k]) for k in s)


def test_the_tree_checksums_are_what_the_format_says(tmp_path):
    """Recomputed from the data file with xxhash alone: blocks of the bytes, the whole of the
    blocks' hex digits (docs/FORMAT.md)."""
    s = state()
    path = str(tmp_path / "c")
    ckptio.save(s, path)
    record = body(path)
    assert record["checksum_algorithm"] == "xxh3_64_tree"
    block = record["block_nbytes"]
    for row in record["tensors"]:
        with open(os.path.join(path, row["file"]), "rb") as f:
            f.seek(row["offset"])
            data = f.read(row["nbytes"])
        if row["nbytes"] > block:
            blocks = [xxhash.xxh3_64_hexdigest(data[i:i + block])
                      for i in range(0, len(data), block)]
            assert row["blocks"] == blocks, row["key"]
            assert row["checksum"] == xxhash.xxh3_64_hexdigest("".join(blocks).encode()), row["key"]
        else:
            assert "blocks" not in row and row["checksum"] == xxhash.xxh3_64_hexdigest(data)


@pytest.mark.parametrize("algorithm", ["xxh3_64_tree", "xxh3_64"])
def test_a_flipped_byte_is_caught_under_either_algorithm(tmp_path, algorithm):
    path = str(tmp_path / "c")
    ckptio.Checkpointer(Options(checksum=algorithm)).save(state(), path)
    row = next(r for r in body(path)["tensors"] if r["key"] == "big")
    with open(os.path.join(path, row["file"]), "r+b") as f:
        f.seek(row["offset"] + 2 * MiB + 5)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(CorruptCheckpointError, match="'big'"):
        ckptio.load(path)


def test_a_tampered_tree_whole_checksum_is_refused(tmp_path):
    """Blocks that match their bytes do not excuse a whole checksum that is not theirs."""
    path = str(tmp_path / "c")
    ckptio.save(state(), path)
    manifest_path = os.path.join(path, "manifest.json")
    with open(manifest_path, "rb") as f:
        head, text, tail = f.read().split(b"\n", 2)
    record = json.loads(text)
    row = next(r for r in record["tensors"] if r["key"] == "big")
    row["checksum"] = "0" * 16
    new = json.dumps(record, separators=(",", ":")).encode()
    header = json.loads(head)
    header.update(body_nbytes=len(new), body_crc32=zlib.crc32(new))
    with open(manifest_path, "wb") as f:
        f.write(json.dumps(header).encode() + b"\n" + new + b"\n" + tail)
    with pytest.raises(CorruptCheckpointError, match="'big'"):
        ckptio.load(path)


def test_a_delta_over_a_base_of_the_earlier_algorithm_saves_and_loads(tmp_path):
    """A ref must carry its base entry's whole checksum, which a base of xxh3_64 computed
    otherwise: such a base gets no refs (the delta stores the chunk), never a failed save."""
    s = state()
    base, delta = str(tmp_path / "step-1"), str(tmp_path / "step-2")
    ckptio.Checkpointer(Options(checksum="xxh3_64")).save(s, base)
    ckptio.Checkpointer(Options(compression="bytegroup+zstd")).save(s, delta, base=base)
    out = ckptio.load(delta)
    assert all(torch.equal(out[k], s[k]) for k in s)
    refs = {r["key"] for r in body(delta)["tensors"] if "ref" in r}
    assert "big" not in refs
    # the same delta over a base of the tree algorithm refers to it
    ckptio.save(s, str(tmp_path / "step-3"))
    ckptio.Checkpointer(Options(compression="bytegroup+zstd")).save(
        s, str(tmp_path / "step-4"), base=str(tmp_path / "step-3"))
    refs = {r["key"] for r in body(str(tmp_path / "step-4"))["tensors"] if "ref" in r}
    assert "big" in refs


@pytest.mark.parametrize("name", ["crc32", "md5", ""])
def test_options_refuse_a_checksum_a_save_cannot_record(name: str) -> None:
    # crc32 is known to the format (DCP's and torch.save's records) but a manifest written
    # with it would not load: Options must refuse it before anything is written
    with pytest.raises(CkptError, match="Options.checksum"):
        ckptio.Options(checksum=name)


@pytest.mark.parametrize("algorithm", ["xxh3_64_tree", "xxh3_64", "crc32"])
def test_entry_hashers_give_what_a_block_hasher_gives(algorithm):
    """EntryHashers (a save's checksums by entry) hash an entry of one block or less that
    arrives in one piece at once, keeping only its digest: the digests are a BlockHasher's,
    for every size around the block size, in one piece or several, and for an empty entry."""
    from ckptio.format.checksum import BlockHasher, EntryHashers

    block = 64
    sizes = [1, block - 1, block, block + 1, 3 * block + 5, 0]
    data = [bytes(range(n % 256)) * (n // 256 + 1) for n in sizes]
    data = [d[:n] for d, n in zip(data, sizes)]
    for pieces in (1, 3):
        hashes = EntryHashers(algorithm, block, sizes)
        for index, d in enumerate(data):
            step = max(1, -(-len(d) // pieces))
            for start in range(0, len(d), step):
                hashes.update(index, memoryview(d)[start:start + step])
        for index, d in enumerate(data):
            want = BlockHasher(algorithm, block)
            want.update(memoryview(d))
            assert hashes.digests(index) == want.digests(), (pieces, sizes[index])
