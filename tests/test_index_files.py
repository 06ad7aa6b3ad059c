"""Manifest version 3 on a real 4-rank save of FSDP x TP-like DTensors (gloo processes): a
loading rank reads only the index files of the ranks that wrote the chunks it needs; damaged,
stale or missing index files are refused naming the file and rank; version 2 still loads."""

from __future__ import annotations

import dataclasses
import os
import shutil

import pytest
import torch
import xxhash

import ckptio
from ckptio.errors import CkptError, ManifestError
from ckptio.format import manifest, regular_section
from ckptio.format.check import Check
from ckptio.format.types import Chunk, RegularTensor
from ckptio.loading import resolve_regular as resolve
from ckptio.loading.opening import committed
from ckptio.loading.load_session import read_fn
from ckptio.storage.local.local_store import LocalStore
from ckptio.testing.rank_processes import run_ranks

import dist_cases as cases


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    """A checkpoint of cases.grid_state saved by 4 ranks (and loaded back by them in place)."""
    path = str(tmp_path_factory.mktemp("v3") / "ck")
    run_ranks(4, cases.grid_roundtrip, path)
    return path


def _copy(saved: str, tmp_path) -> str:
    path = str(tmp_path / "ck")
    shutil.copytree(saved, path)
    return path


def _reader(path: str, seen: list[str]):
    """The read a load uses for index files (unverified: expand checks them), recording which
    files it reads."""
    plain = read_fn(ckptio.Checkpointer().resources(), LocalStore(path))

    def read(reads):
        seen.extend(r.entries[0].file for r in reads)
        return plain(reads)
    return read


def _expected(saved: str) -> dict[str, torch.Tensor]:
    return {key: torch.arange(n * 1000, n * 1000 + torch.Size(shape).numel(),
                              dtype=torch.float32).reshape(shape)
            for n, (key, (shape, _kinds)) in enumerate(cases.GRID_LAYOUTS.items())}


def test_a_rank_reads_only_the_index_files_of_the_writers_it_needs(saved):
    record = committed(LocalStore(saved))
    assert record.version == 3 and record.regular and len(record.indexes) == 4
    regions = {"row": Chunk((0, 0), (2, 8))}  # rows 0-1 of an 8 x 8 Shard(0) over the mesh
    grid = record.grids[next(r.grid for r in record.regular if r.key == "row")]
    writers = {rank for rank, _chunk in resolve.overlapping(
        grid, next(r for r in record.regular if r.key == "row"), regions["row"])}
    seen: list[str] = []
    expanded = resolve.expand(record, regions, _reader(saved, seen))
    assert sorted(seen) == sorted(regular_section.index_name(record.save_id, r) for r in writers)
    assert len(writers) < 4  # the point: not every rank's index
    rows = [e for e in expanded.tensors if e.key == "row"]
    assert rows and all(e.chunk.offsets[0] < 2 for e in rows)
    # every chunk: every index file, and the chunks tile each tensor
    seen.clear()
    everything = resolve.expand_all(record, _reader(saved, seen))
    assert len(set(seen)) == 4 and not everything.regular
    for key, (shape, _kinds) in cases.GRID_LAYOUTS.items():
        chunks = [e.chunk for e in everything.tensors if e.key == key]
        assert sum(c.numel for c in chunks) == torch.Size(shape).numel(), key


def test_fresh_load_and_cli_see_every_regular_key(saved):
    whole = ckptio.load(saved)
    for key, want in _expected(saved).items():
        assert torch.equal(whole[key], want), key
    keys = {t.key for t in ckptio.Checkpointer().manifest(saved).tensors}
    assert set(cases.GRID_LAYOUTS) <= keys
    assert ckptio.Checkpointer().verify(saved) > 0


def _index_path(path: str, rank: int) -> str:
    record = committed(LocalStore(path))
    return os.path.join(path, next(i.name for i in record.indexes if i.rank == rank))


def test_a_damaged_index_file_is_refused_naming_it_and_its_rank(saved, tmp_path):
    path = _copy(saved, tmp_path)
    target = _index_path(path, 2)
    with open(target, "r+b") as f:
        f.seek(200)
        byte = f.read(1)
        f.seek(200)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ManifestError, match=r"index-.*rank 2.*checksum|rank 2.*do not match"):
        ckptio.load(path)
    with pytest.raises(ManifestError, match="rank 2"):
        ckptio.Checkpointer().verify(path)


def _rewrite(path: str, rank: int, data: bytes) -> None:
    """Replace rank ``rank``'s index content and its checksum in the manifest (a consistent
    file whose rows are wrong: what only the row checks catch)."""
    store = LocalStore(path)
    record = committed(store)
    target = _index_path(path, rank)
    padded = max(os.path.getsize(target), -(-len(data) // 4096) * 4096)
    with open(target, "wb") as f:
        f.write(data + bytes(padded - len(data)))
    indexes = tuple(dataclasses.replace(i, nbytes=len(data),
                                        checksum=xxhash.xxh3_64_hexdigest(data))
                    if i.rank == rank else i for i in record.indexes)
    files = tuple(dataclasses.replace(f, nbytes=padded)
                  if f.name == os.path.basename(target) else f for f in record.files)
    body = manifest.encode(dataclasses.replace(record, indexes=indexes, files=files))
    with open(os.path.join(path, manifest.MANIFEST_NAME), "wb") as f:
        f.write(body)


def _rows(path: str, rank: int) -> tuple[list[regular_section.IndexRow], str]:
    record = committed(LocalStore(path))
    with open(_index_path(path, rank), "rb") as f:
        data = f.read(next(i.nbytes for i in record.indexes if i.rank == rank))
    tensors = {r.key: r for r in record.regular}
    return regular_section.decode_index(data, Check("x"), record.save_id, rank, tensors), record.save_id


@pytest.mark.parametrize("damage,match", [
    ("beyond", "not inside a data file"),
    ("stale", "belongs to save"),
    ("missing_row", "does not list it"),
    ("foreign_key", "no regular tensor"),
])
def test_consistent_but_wrong_index_rows_are_refused(saved, tmp_path, damage, match):
    path = _copy(saved, tmp_path)
    rows, save_id = _rows(path, 1)
    if damage == "beyond":
        rows = [dataclasses.replace(r, offset=r.offset + (1 << 30)) for r in rows]
    elif damage == "missing_row":
        rows = [r for r in rows if r.key != "col"]
    elif damage == "foreign_key":
        rows = [dataclasses.replace(rows[0], key="not.a.key"), *rows[1:]]
    data = regular_section.encode_index("0" * 8 if damage == "stale" else save_id, 1, rows)
    _rewrite(path, 1, data)
    with pytest.raises(ManifestError, match=match) as err:
        ckptio.load(path)
    assert "rank 1" in str(err.value) and "index" in str(err.value)


def test_a_missing_index_file_fails_clearly(saved, tmp_path):
    path = _copy(saved, tmp_path)
    os.remove(_index_path(path, 3))
    with pytest.raises(CkptError, match="index.bin"):
        ckptio.load(path)


def test_a_version_2_manifest_still_loads(saved, tmp_path):
    """The same checkpoint with every chunk in the manifest, as version 2 wrote it."""
    path = _copy(saved, tmp_path)
    every = ckptio.Checkpointer().manifest(path)
    v2 = dataclasses.replace(every, version=2)
    data = manifest.encode(v2)
    assert b'"version":2' in data and b'"regular"' not in data
    with open(os.path.join(path, manifest.MANIFEST_NAME), "wb") as f:
        f.write(data)
    whole = ckptio.load(path)
    for key, want in _expected(saved).items():
        assert torch.equal(whole[key], want), key


def test_the_manifest_section_refuses_bad_grids_and_rows():
    good = {"grids": [{"shape": [2, 2], "ranks": [0, 1, 2, 3], "dims": [0, -1]}],
            "regular": [{"key": "w", "dtype": "float32", "shape": [4, 4], "grid": 0}],
            "indexes": []}
    grids, rows, _ = regular_section.parse_section(Check("m"), good, 4, {})
    assert rows == (RegularTensor("w", "float32", (4, 4), 0),) and grids[0].replicas == 2
    bad = [
        ({"shape": [2, 2], "ranks": [0, 1, 2], "dims": [0, -1]}, None, "ranks"),
        ({"shape": [2, 2], "ranks": [0, 1, 2, 9], "dims": [0, -1]}, None, "world_size"),
        ({"shape": [2, 2], "ranks": [0, 1, 2, 3], "dims": [0, -2]}, None, "dims"),
        ({"shape": [2, 2], "ranks": [0, 1, 2, 3], "dims": [1, -1]},
         {"key": "w", "dtype": "float32", "shape": [4], "grid": 0}, "shards a dim"),
        (None, {"key": "w", "dtype": "float32", "shape": [4, 4], "grid": 1}, "does not exist"),
    ]
    for grid, row, match in bad:
        raw = {"grids": [grid or good["grids"][0]], "regular": [row or good["regular"][0]],
               "indexes": []}
        with pytest.raises(ManifestError, match=match):
            regular_section.parse_section(Check("m"), raw, 4, {})


def test_manifest_and_index_files_read_without_torch(saved):
    """The manifest and the index files are readable with the standard library (and xxhash):
    a process where importing torch fails decodes both and finds every chunk."""
    import subprocess
    import sys

    code = f"""
import sys
sys.modules["torch"] = None  # any import of torch fails
from ckptio.format import manifest, regular_section
from ckptio.format.check import Check
path = {saved!r}
with open(path + "/manifest.json", "rb") as f:
    record = manifest.decode(f.read(), "m")
tensors = {{r.key: r for r in record.regular}}
rows = 0
for index in record.indexes:
    with open(path + "/" + index.name, "rb") as f:
        data = f.read(index.nbytes)
    rows += len(regular_section.decode_index(data, Check(index.name), record.save_id, index.rank, tensors))
print(rows)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    record = committed(LocalStore(saved))
    every = sum(1 for r in record.regular
                for _ in resolve.overlapping(record.grids[r.grid], r, None))
    assert int(out.stdout) == every > 0


def test_hostile_index_bytes_raise_only_manifest_errors():
    """Flipped bytes, cuts, a header nested past json's recursion, a key column naming one
    tensor twice: decode_index returns rows or raises ManifestError, nothing else."""
    import random

    tensors = {k: RegularTensor(k, "float32", (64,), 0) for k in ("a", "b", "c")}
    rows = [regular_section.IndexRow(k, f"data-f{i % 2}", 256 * i, f"{i:016x}", ("0" * 16,) * i)
            for i, k in enumerate(tensors)]
    good = regular_section.encode_index("s", 5, rows)
    assert regular_section.decode_index(good, Check("x"), "s", 5, tensors) == rows
    start = good.index(b"\n") + 1
    twice = good[:start] + bytes(4) * 2 + good[start + 8:]  # rows 0 and 1 both name "a"
    cases = [twice, b"[" * 100_000 + b"\n", good[:-1], good + b"0", b""]
    rng = random.Random(16)
    for _ in range(500):
        data = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        cases.append(bytes(data[:rng.choice([len(data), rng.randrange(len(data))])]))
    refused = 0
    for data in cases:
        try:
            regular_section.decode_index(data, Check("x"), "s", 5, tensors)
        except ManifestError:
            refused += 1
    assert refused > 400
    for data in cases[:5]:
        with pytest.raises(ManifestError):
            regular_section.decode_index(data, Check("x"), "s", 5, tensors)


# ------------------------------------------------------------------------------------------------
# ckptio ls and diff read the index files without torch


def _cli_without_torch(tmp_path, *args: str):
    """``python -m ckptio ARGS`` in a process where any import of torch fails (a
    sitecustomize first on the path blocks it before ckptio starts)."""
    import subprocess
    import sys
    from pathlib import Path

    blocker = tmp_path / "no-torch"
    blocker.mkdir(exist_ok=True)
    (blocker / "sitecustomize.py").write_text(
        "import sys\nsys.modules['torch'] = None  # any import of torch fails\n")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker), str(root)])}
    return subprocess.run([sys.executable, "-m", "ckptio", *args], capture_output=True,
                          text=True, env=env, timeout=120, check=False)


def _chunks_by_key(record) -> dict[str, int]:
    return {r.key: sum(1 for _ in resolve.overlapping(record.grids[r.grid], r, None))
            for r in record.regular}


def test_ckptio_ls_of_a_version_3_checkpoint_runs_without_torch(saved, tmp_path):
    """Every regular tensor with its dtype, shape, bytes and every chunk, from the index files
    of all 4 ranks, in a process that cannot import torch."""
    import json

    record = committed(LocalStore(saved))
    assert record.version == 3 and len(record.indexes) == 4
    chunks = _chunks_by_key(record)
    assert set(chunks) == set(cases.GRID_LAYOUTS) and max(chunks.values()) > 1
    done = _cli_without_torch(tmp_path, "ls", "--json", saved)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    leaves = {c["key"]: c for c in doc["tree"]["children"] if "key" in c}
    for key, (shape, _kinds) in cases.GRID_LAYOUTS.items():
        leaf = leaves[key]
        assert (leaf["type"], leaf["dtype"], leaf["shape"]) == ("tensor", "float32", list(shape))
        assert leaf["nbytes"] == 4 * torch.Size(shape).numel(), key  # the chunks tile it
        assert leaf["chunks"] == chunks[key] and leaf["ranks"] is None, key
    assert leaves["head"] == {**leaves["head"], "type": "alias", "alias_of": "small"}
    text = _cli_without_torch(tmp_path, "ls", "--flat", saved)
    assert text.returncode == 0, text.stderr
    lines = {line.split()[0]: line for line in text.stdout.splitlines()[2:]}
    for key, (shape, _kinds) in cases.GRID_LAYOUTS.items():
        assert str(list(shape)) in lines[key], lines[key]
        detail = f"{chunks[key]} chunks" if chunks[key] > 1 else ""
        assert lines[key].endswith(detail), lines[key]
    assert f"{len(record.tensors) + sum(chunks.values())} chunks" in text.stdout.splitlines()[0]
    same = _cli_without_torch(tmp_path, "diff", saved, saved)
    assert same.returncode == 0 and "the same" in same.stdout, same.stderr


def test_the_cli_reads_the_same_chunks_as_a_load(saved):
    """cli/source.py's torch-free reading gives the rows ckptio's loader gives (its pool)."""
    from ckptio.cli.source import open_manifest

    ours = open_manifest(saved).record
    theirs = ckptio.Checkpointer().manifest(saved)
    assert not ours.regular and sorted(ours.tensors, key=repr) == sorted(theirs.tensors, key=repr)


@pytest.mark.parametrize("damage,says", [
    ("flipped", ["rank 2", "do not match its checksum"]),
    ("cut", ["truncated", "read 100 of"]),
    ("missing", ["No such file"]),
    ("beyond", ["rank 2", "not inside a data file"]),
])
def test_ckptio_ls_names_a_damaged_index_file_without_torch(saved, tmp_path, damage, says):
    path = _copy(saved, tmp_path)
    target = _index_path(path, 2)
    if damage == "flipped":
        with open(target, "r+b") as f:
            f.seek(200)
            byte = f.read(1)
            f.seek(200)
            f.write(bytes([byte[0] ^ 0xFF]))
    elif damage == "cut":
        os.truncate(target, 100)
    elif damage == "missing":
        os.remove(target)
    else:  # consistent bytes, wrong rows: only the row checks catch it
        rows, save_id = _rows(path, 2)
        rows = [dataclasses.replace(r, offset=r.offset + (1 << 30)) for r in rows]
        _rewrite(path, 2, regular_section.encode_index(save_id, 2, rows))
    done = _cli_without_torch(tmp_path, "ls", path)
    assert done.returncode == 2 and not done.stdout, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and "import of torch" not in done.stderr, done.stderr
    line, = done.stderr.strip().splitlines()
    assert line.startswith("ckptio: error: ") and os.path.basename(target) in line, line
    for phrase in says:
        assert phrase in line, line
