"""Opening a DCP directory: which items' heads are read, in how many rounds, on each rank.

One process (``ckptio.load`` on one rank, ``ckptio.verify``, ``ckptio ls``) opens every item at
the open: two rounds of reads, the ``.metadata``, then every item's head and tail together with
the value items (an item's tail holds the data descriptor with data/0's CRC-32; it and the next
item's head coalesce into one read). Checked on a real ``dcp.save`` directory with items larger
than a head: the rounds are counted at the read function the open is given, the load is
bitwise, and a flipped byte of a large tensor (or of an item's head) is still named by key and
file. When a tail does not hold the descriptor (TAIL_NBYTES made smaller than the records after
data/0), the descriptors take one more round, and load and verify are the same.

A rank of a many-rank load opens only the items its reads need, just before its data pass (the
``.metadata`` and the values at the open, then those items' heads and tails in one round). On 2
real gloo ranks holding Shard(0) DTensors of a 2-rank ``dcp.save`` directory, each rank opens
exactly the items its shards (and the replicated tensor) overlap, through ``ckptio.load``
(``ckptio.DcpReader`` opens every item in ``read_metadata``: opening only a rank's measured
slower, docs/BENCH_INTEROP.md round four): every byte it reads before its data pass lies in the
``.metadata``, a value item, or an item it needs. A damaged item that only rank 1 needs (a
flipped byte of its head, or of its data) fails rank 1's load naming the key and file, and rank
0's naming rank 1.
"""

from __future__ import annotations

import io
import pickle
import re
import shutil
import struct
import warnings
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptio
from ckptio.format import torchzip
from ckptio.loading import dcpdir
from ckptio.testing.rank_processes import run_ranks


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


Rounds = list[tuple[str, list[tuple[str, int, int]]]]  # ("open" | "items", [(file, offset, n)])


def _counting(monkeypatch: pytest.MonkeyPatch) -> Rounds:
    """Record each round of reads the DCP open ("open") and the opening of items a load needs
    ("items") make: the file, offset and length of every read in it."""
    rounds: Rounds = []

    def counted(phase: str, read: Any) -> Any:
        def reads_of(reads: Any) -> int:
            rounds.append((phase, [(r.entries[0].file, r.entries[0].offset, r.entries[0].nbytes)
                                   for r in reads]))
            return read(reads)
        return reads_of

    real_open, real_resolve = dcpdir.open_dcp, dcpdir.resolve_reads
    monkeypatch.setattr(dcpdir, "open_dcp", lambda store, read, **kw: real_open(
        store, counted("open", read), **kw))
    monkeypatch.setattr(dcpdir, "resolve_reads", lambda store, read, reads: real_resolve(
        store, counted("items", read), reads))
    return rounds


def _sizes(rounds: Rounds) -> list[tuple[str, int]]:
    return [(phase, len(reads)) for phase, reads in rounds]


def _check(loaded: dict[str, Any]) -> None:
    want = _state()
    for key, t in want["w"].items():
        assert torch.equal(loaded["w"][key], t), key
    assert torch.equal(loaded["b"], want["b"]) and torch.equal(loaded["small"], want["small"])
    assert loaded["step"] == 12


def _flipped(saved: Path, tmp_path: Path, key: str, in_head: bool = False, row0: int = 0) -> Path:
    """A copy of ``saved`` with one byte of ``key``'s item (its chunk starting at row ``row0``)
    flipped: in the middle of its data/0 bytes, or (``in_head``) of its data.pkl record (found
    with torch's own unpickler and zipfile: the test wrote it)."""
    path = tmp_path / "copy"
    shutil.copytree(saved, path)
    meta = pickle.loads((path / ".metadata").read_bytes())
    info = next(v for k, v in meta.storage_data.items()
                if k.fqn == key and (not k.offset or k.offset[0] == row0))
    file = path / info.relative_path
    raw = bytearray(file.read_bytes())
    item = bytes(raw[info.offset:info.offset + info.length])
    name = "/data.pkl" if in_head else "/data/0"
    record = next(i for i in zipfile.ZipFile(io.BytesIO(item)).infolist()
                  if i.filename.endswith(name))
    nlen, elen = struct.unpack_from("<HH", item, record.header_offset + 26)
    raw[info.offset + record.header_offset + 30 + nlen + elen + record.file_size // 2] ^= 0x04
    file.write_bytes(bytes(raw))
    return path


def _refused(path: Path, key: str) -> None:
    message = rf"checksum mismatch for key {key!r} in .*__0_0.distcp"
    for attempt in (lambda: ckptio.load(str(path)), lambda: ckptio.verify(str(path))):
        with pytest.raises(ckptio.CorruptCheckpointError, match=message):
            attempt()


def _large() -> int:
    return sum(1 for t in _state()["w"].values() if t.nbytes > torchzip.HEAD_NBYTES)


def test_a_one_rank_load_and_verify_open_every_item_with_the_values(
        saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rounds = _counting(monkeypatch)
    _check(ckptio.load(str(saved)))
    # .metadata; then 7 tensors' heads, the large ones' tails and the value together
    assert _sizes(rounds) == [("open", 1), ("open", 7 + _large() + 1)], rounds
    rounds.clear()
    assert ckptio.verify(str(saved)) > 0
    assert _sizes(rounds) == [("open", 1), ("open", 7 + _large() + 1)], rounds


def test_a_flipped_byte_of_a_large_tensor_is_named(saved: Path, tmp_path: Path) -> None:
    _refused(_flipped(saved, tmp_path, "w.t3"), "w.t3")


def test_a_flipped_head_byte_is_named_by_load_and_verify(saved: Path, tmp_path: Path) -> None:
    path = _flipped(saved, tmp_path, "w.t2", in_head=True)
    message = r"__0_0\.distcp \(item of key 'w\.t2'\).*data\.pkl"
    for attempt in (lambda: ckptio.load(str(path)), lambda: ckptio.verify(str(path))):
        with pytest.raises(ckptio.CorruptCheckpointError, match=message):
            attempt()


def test_descriptors_beyond_the_tail_take_one_more_round(
        saved: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torchzip, "TAIL_NBYTES", 8)  # too short to reach any descriptor
    rounds = _counting(monkeypatch)
    for attempt in (lambda: _check(ckptio.load(str(saved))), lambda: ckptio.verify(str(saved))):
        rounds.clear()
        attempt()
        assert _sizes(rounds) == [("open", 1), ("open", 7 + _large() + 1), ("open", _large())]
    _refused(_flipped(saved, tmp_path, "w.t1"), "w.t1")


# ------------------------------------------------------------------------------------------------
# 2 ranks: each opens the items it needs


FULL = {"v": (10, 300), "w": (16, 40), "bias": (40,)}  # v's half is 6000 bytes: past a head


def _full() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return {k: torch.randn(shape, generator=gen) for k, shape in FULL.items()}


def _rows(n: int, rank: int, world: int) -> tuple[int, int]:
    """(start, length) of rank's Shard(0) piece of ``n`` rows (torch.chunk's cut)."""
    full = -(-n // world)
    start = min(full * rank, n)
    return start, min(n, full * (rank + 1)) - start


def _dtensors(rank: int, world: int, fill: bool) -> dict[str, Any]:
    """Shard(0) DTensors of the 2-D tensors, the 1-D one replicated; zeros unless ``fill``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {}
    for key, t in _full().items():
        if t.dim() == 2:
            start, n = _rows(t.shape[0], rank, world)
            local, placement = t[start:start + n], Shard(0)
        else:
            local, placement = t, Replicate()
        local = local.clone() if fill else torch.zeros_like(local)
        out[key] = DTensor.from_local(local, mesh, [placement], run_check=False,
                                      shape=t.shape, stride=t.stride())
    return out


def sharded_save(rank: int, world: int, path: str) -> None:
    dcp.save({"model": _dtensors(rank, world, fill=True), "step": 5}, checkpoint_id=path)


def sharded_load(rank: int, world: int, path: str, engine: str,
                 tail: int | None = None) -> dict[str, Any]:
    """Load into zeroed DTensors of the saving layout, counting what this rank reads before
    its data pass; -> those reads and the local tensors (or the error, by type and text)."""
    import pytest as pt

    with pt.MonkeyPatch.context() as mp:
        if tail is not None:
            mp.setattr(torchzip, "TAIL_NBYTES", tail)
        rounds = _counting(mp)
        state = {"model": _dtensors(rank, world, fill=False), "step": -1}
        try:
            if engine == "ckptio":
                report = ckptio.load(path, state)
                assert not report.missing and not report.unexpected, report
            else:
                dcp.load(state, storage_reader=ckptio.DcpReader(path))
        except Exception as exc:  # noqa: BLE001 - returned for the test to check
            cause = exc
            if not isinstance(exc, ckptio.CkptError):  # DCP's CheckpointException: rank's own
                cause = next(iter(exc.failures.values()))  # type: ignore[attr-defined]
            return {"error": type(cause).__name__, "text": str(cause)}
    return {"rounds": rounds, "step": state["step"],
            "local": {k: v.to_local().numpy().copy() for k, v in state["model"].items()}}


@pytest.fixture(scope="module")
def two_rank_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("dcp2") / "ckpt"
    run_ranks(2, sharded_save, str(path), timeout_s=240)
    return path


def _items(path: Path) -> dict[tuple[str, int], tuple[str, Any, int]]:
    """(file, offset) of each item -> (key, chunk offsets or None for a value, length), from
    the .metadata (torch's own unpickler: the test wrote it)."""
    meta = pickle.loads((path / ".metadata").read_bytes())
    return {(info.relative_path, info.offset): (index.fqn, index.offset, info.length)
            for index, info in meta.storage_data.items()}


def _needed(items: dict[tuple[str, int], tuple[str, Any, int]], rank: int) -> set[tuple[str, int]]:
    """The tensor items rank ``rank`` of 2 needs: those its row block overlaps, and the
    replicated tensor's."""
    out = set()
    for place, (fqn, offsets, _length) in items.items():
        key = fqn.split(".", 1)[1] if offsets is not None else ""
        if key in ("v", "w"):  # saved by the same cut: the chunk at the rank's own rows
            if offsets[0] == _rows(FULL[key][0], rank, 2)[0]:
                out.add(place)
        elif key == "bias":
            out.add(place)
    return out


@pytest.mark.parametrize("tail", [None, 8], ids=["tail", "short-tail"])
def test_each_rank_opens_only_the_items_its_shards_need(two_rank_dir: Path,
                                                        tail: int | None) -> None:
    """(short-tail: TAIL_NBYTES too short to reach a descriptor: one more round of them)"""
    items = _items(two_rank_dir)
    results = run_ranks(2, sharded_load, str(two_rank_dir), "ckptio", tail, timeout_s=240)
    full = _full()
    values = {place for place, (_fqn, offsets, _n) in items.items() if offsets is None}
    for rank, got in enumerate(results):
        assert "error" not in got, got
        assert got["step"] == 5
        for key, local in got["local"].items():
            want = full[key] if key == "bias" else full[key][slice(*_span(key, rank))]
            assert np.array_equal(local, want.numpy()), (rank, key)
        needed = _needed(items, rank)
        assert 0 < len(needed) < len(items) - len(values), needed  # some items are not its
        opened_items = [reads for phase, reads in got["rounds"] if phase == "items"]
        # one round of heads and tails (and one of the descriptors the tails miss)
        assert len(opened_items) == (1 if tail is None else 2), got["rounds"]
        heads = {(f, o) for f, o, _n in opened_items[0] if (f, o) in items}
        assert heads == needed, (rank, sorted(heads), sorted(needed))
        for phase, reads in got["rounds"]:  # every byte read before the data pass
            allowed = needed | values if phase == "items" else values
            for file, offset, n in reads:
                assert file == ".metadata" or any(
                    f == file and o <= offset and offset + n <= o + items[(f, o)][2]
                    for f, o in allowed), (rank, phase, file, offset, n)


def _span(key: str, rank: int) -> tuple[int, int]:
    start, n = _rows(FULL[key][0], rank, 2)
    return start, start + n


@pytest.mark.parametrize("in_head", [True, False], ids=["head", "data"])
def test_a_damaged_item_one_rank_needs_fails_that_rank_by_key_and_file(
        two_rank_dir: Path, tmp_path: Path, in_head: bool) -> None:
    key, row0 = "model.v", _rows(FULL["v"][0], 1, 2)[0]  # rank 1's rows: its item alone
    items = _items(two_rank_dir)
    place = next(p for p, (fqn, offs, _n) in items.items() if fqn == key and offs[0] == row0)
    assert place in _needed(items, 1) and place not in _needed(items, 0)
    path = _flipped(two_rank_dir, tmp_path, key, in_head=in_head, row0=row0)
    mine, peer = reversed(run_ranks(2, sharded_load, str(path), "ckptio", timeout_s=240))
    assert mine["error"] == "CorruptCheckpointError", mine
    what = "data\\.pkl" if in_head else "checksum mismatch"
    assert re.search(rf"'{key}'", mine["text"]) and "__1_0.distcp" in mine["text"], mine
    assert re.search(what, mine["text"]), mine
    assert peer["error"] in ("CkptError", "RankFailedError", "CorruptCheckpointError"), peer
    assert "rank 1" in peer["text"] and key in peer["text"], peer
