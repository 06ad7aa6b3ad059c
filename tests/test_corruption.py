"""Damaged checkpoints are refused with an error that says what and where; nothing damaged is
ever handed back as if it had loaded.

Covers: a flipped byte in a data file (tensor, numpy array, bytes value; an entry inside one
read and one spanning several staging buffers), caught by load and by verify; verify=False
skipping the check (documented below); a truncated or deleted data file; a missing manifest
(an interrupted save); a damaged manifest (every single-bit flip, every truncation, garbage,
schema violations under a valid CRC); a path holding no checkpoint; verify raising exactly
when load does, for every one of those; a wrong block checksum, which only verify and a load of
part of a tensor read.
"""

from __future__ import annotations

import gc
import json
import os
import threading
import zlib

import numpy as np
import pytest
import torch

import ckptio
from ckptio.storage.local.local_store import LocalStore
from ckptio import (CheckpointNotFoundError, Checkpointer, CkptError, CorruptCheckpointError,
                    IncompleteCheckpointError, ManifestError, Options)

MiB = 1 << 20
BUFFER = MiB  # staging buffer (and largest read) in these tests
BIG_NUMEL = (3 * MiB + MiB // 2) // 4 + 123  # float32: ~3.5 MiB, spans 4-5 buffer-sized reads


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _make_state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "w": torch.randn(64, 64, generator=g),
            "b": torch.randn(64, generator=g, dtype=torch.float64),
            "big": torch.randn(BIG_NUMEL, generator=g),
        },
        "extra": {
            "arr": np.arange(3000, dtype=np.int32),
            "blob": bytes(range(256)) * 40,
            "step": 7,
        },
    }


def _manifest(path: os.PathLike[str] | str) -> dict:
    with open(os.path.join(path, "manifest.json"), "rb") as f:
        return json.loads(f.read().split(b"\n", 1)[1])


def _entry(path: os.PathLike[str] | str, key: str) -> dict:
    (entry,) = [t for t in _manifest(path)["tensors"] if t["key"] == key]
    return entry


def _flip(file: str, offset: int, mask: int = 0x01) -> None:
    with open(file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ mask]))


@pytest.fixture(scope="module")
def ck():
    """One Checkpointer for the module, as in a training job: each refused load must leave it
    fit for the next test."""
    c = Checkpointer(Options(buffer_bytes=BUFFER, pool_bytes=4 * BUFFER))
    yield c
    # pytest.raises keeps each error (and its traceback's frames, which still view staging
    # buffers) in a reference cycle; collect it first, or close() trips over the bug shown by
    # test_close_after_failed_load_while_its_error_is_alive.
    gc.collect()
    c.close()


@pytest.fixture
def saved(tmp_path, ck):
    state = _make_state()
    path = tmp_path / "ckpt"
    ck.save(state, path)
    return path, state


def _pool_idle(ck: Checkpointer) -> bool:
    pool, _files = ck.resources().files(LocalStore("."))
    return pool.idle()


# -- flipped bytes in data files -------------------------------------------------------------

FLIPS = [
    ("model.w", 0), ("model.w", 64 * 64 * 4 // 2), ("model.w", 64 * 64 * 4 - 1),
    ("model.b", 17),
    ("model.big", 0), ("model.big", BUFFER - 1), ("model.big", BUFFER), ("model.big", 2 * BUFFER + 5),
    ("model.big", BIG_NUMEL * 4 - 1),
    ("extra.arr", 100), ("extra.blob", 10239),
]


@pytest.mark.parametrize("key,pos", FLIPS)
def test_flipped_byte_caught_by_load_and_verify(saved, ck, key, pos):
    path, _state = saved
    entry = _entry(path, key)
    assert pos < entry["nbytes"]
    data_file = os.path.join(path, entry["file"])
    _flip(data_file, entry["offset"] + pos)

    with pytest.raises(CorruptCheckpointError) as info:
        ck.load(path)
    message = str(info.value)
    assert repr(key) in message or key in message, message
    assert data_file in message, message
    assert _pool_idle(ck), "a refused load must hand every staging buffer back"

    with pytest.raises(CorruptCheckpointError) as info:
        ck.verify(path)
    assert key in str(info.value) and data_file in str(info.value)
    with pytest.raises(CorruptCheckpointError):
        ckptio.verify(path)
    assert _pool_idle(ck)


def test_flip_in_one_read_entry_never_reaches_destination(saved, ck):
    """An entry that fits one read is verified before a byte of it is copied out, so an
    in-place load that fails on it leaves that destination untouched."""
    path, state = saved
    entry = _entry(path, "model.w")
    _flip(os.path.join(path, entry["file"]), entry["offset"] + 100)
    dest = _make_state()
    dest["model"]["w"].fill_(-1.0)
    with pytest.raises(CorruptCheckpointError):
        ck.load(path, dest)
    assert torch.equal(dest["model"]["w"], torch.full((64, 64), -1.0))


def test_flipped_byte_spanning_reads_in_place(saved, ck):
    """A tensor larger than one staging buffer, corrupted in its last buffer-sized read: the
    in-place load raises (its destination may hold partial data, as documented)."""
    path, _state = saved
    entry = _entry(path, "model.big")
    assert entry["nbytes"] > 3 * BUFFER
    _flip(os.path.join(path, entry["file"]), entry["offset"] + entry["nbytes"] - 2)
    dest = _make_state()
    with pytest.raises(CorruptCheckpointError, match="model.big"):
        ck.load(path, dest)
    assert _pool_idle(ck)


def test_verify_false_does_not_check(saved, ck):
    """Documented behaviour: load(verify=False) (or Options(verify=False)) does not compute
    checksums, so a flipped byte is NOT detected: the load succeeds and the returned tensor holds
    the flipped byte. Use it only for trusted storage; ckptio.verify() checks a checkpoint on
    demand."""
    path, state = saved
    entry = _entry(path, "model.big")
    pos = 2 * BUFFER + 5
    _flip(os.path.join(path, entry["file"]), entry["offset"] + pos)

    loaded = ck.load(path, verify=False)
    got, want = _bits(loaded["model"]["big"]), _bits(state["model"]["big"])
    diff = (got != want).nonzero().flatten().tolist()
    assert diff == [pos], "verify=False must return exactly the stored bytes, flip included"
    assert got[pos].item() == want[pos].item() ^ 0x01
    assert torch.equal(_bits(loaded["model"]["w"]), _bits(state["model"]["w"]))

    unchecked = Checkpointer(Options(buffer_bytes=BUFFER, pool_bytes=4 * BUFFER, verify=False))
    try:
        loaded = unchecked.load(path)
        assert (_bits(loaded["model"]["big"]) != want).sum().item() == 1
        with pytest.raises(CorruptCheckpointError):  # an explicit verify=True still checks
            unchecked.load(path, verify=True)
    finally:
        unchecked.close()
    with pytest.raises(CorruptCheckpointError):  # and the default (Options.verify=True) checks
        ck.load(path)


# -- truncated and missing data files --------------------------------------------------------

@pytest.mark.parametrize("cut", ["empty", "mid-small", "mid-big-unaligned", "last-byte"])
def test_truncated_data_file(saved, ck, cut):
    path, _state = saved
    entry = _entry(path, "model.big")
    data_file = os.path.join(path, entry["file"])
    size = os.path.getsize(data_file)
    new_size = {"empty": 0, "mid-small": _entry(path, "model.w")["offset"] + 10,
                "mid-big-unaligned": entry["offset"] + BUFFER + 1001, "last-byte": size - 1}[cut]
    os.truncate(data_file, new_size)

    for call in (ck.load, ck.verify, lambda p: ck.load(p, _make_state())):
        with pytest.raises(CorruptCheckpointError) as info:
            call(path)
        assert data_file in str(info.value), str(info.value)
        assert "truncated" in str(info.value)
    assert _pool_idle(ck)


def test_deleted_data_file(saved, ck):
    path, _state = saved
    (name,) = {t["file"] for t in _manifest(path)["tensors"]}
    os.unlink(os.path.join(path, name))
    for call in (ck.load, ck.verify, lambda p: ck.load(p, _make_state())):
        with pytest.raises(CorruptCheckpointError) as info:
            call(path)
        assert os.path.join(path, name) in str(info.value)
        assert "missing" in str(info.value)
    assert _pool_idle(ck)


def test_one_of_several_data_files_deleted(tmp_path):
    """With the data split over several files, the error names the one that is gone."""
    ck = Checkpointer(Options(buffer_bytes=BUFFER, pool_bytes=4 * BUFFER, max_file_bytes=2 * MiB))
    try:
        state = {f"t{i}": torch.full((MiB // 4,), float(i)) for i in range(5)}
        ck.save(state, tmp_path / "c")
        files = sorted({t["file"] for t in _manifest(tmp_path / "c")["tensors"]})
        assert len(files) >= 3
        victim = os.path.join(tmp_path / "c", files[1])
        os.unlink(victim)
        with pytest.raises(CorruptCheckpointError) as info:
            ck.load(tmp_path / "c")
        assert victim in str(info.value)
    finally:
        ck.close()


# -- the manifest ----------------------------------------------------------------------------

def test_missing_manifest_is_incomplete(saved, ck):
    """Data files and no manifest.json: a save that never committed."""
    path, _state = saved
    os.unlink(os.path.join(path, "manifest.json"))
    assert any(n.startswith("data-") for n in os.listdir(path))
    for call in (ck.load, ck.verify, lambda p: ck.load(p, _make_state()), ckptio.load):
        with pytest.raises(IncompleteCheckpointError) as info:
            call(path)
        assert "interrupted" in str(info.value)
        assert str(path) in str(info.value)


def test_directory_of_stray_data_files_is_incomplete(tmp_path, ck):
    path = tmp_path / "partial"
    path.mkdir()
    (path / "data-0123456789a00000000-r00000-0000.bin").write_bytes(b"\0" * 8192)
    with pytest.raises(IncompleteCheckpointError, match="interrupted"):
        ck.load(path)


def _manifest_bytes(path) -> bytes:
    with open(os.path.join(path, "manifest.json"), "rb") as f:
        return f.read()


def _put_manifest(path, data: bytes) -> None:
    with open(os.path.join(path, "manifest.json"), "wb") as f:
        f.write(data)


def _refused(ck: Checkpointer, path) -> None:
    with pytest.raises(ManifestError) as info:
        ck.load(path)
    assert os.path.join(path, "manifest.json") in str(info.value), str(info.value)


def test_every_single_bit_flip_in_manifest_is_refused(saved, ck):
    path, _state = saved
    good = _manifest_bytes(path)
    ck.load(path)  # sanity: the untouched manifest loads
    for pos in range(len(good)):
        for mask in (0x01, 0x80):
            bad = bytearray(good)
            bad[pos] ^= mask
            _put_manifest(path, bytes(bad))
            try:
                with pytest.raises(ManifestError):
                    ck.load(path)
            except pytest.fail.Exception:
                raise AssertionError(f"flipping bit {mask:#x} of byte {pos} "
                                     f"({good[pos:pos + 1]!r}) was not refused") from None
    _put_manifest(path, bytearray(good))
    with pytest.raises(ManifestError):  # and verify refuses one too
        bad = bytearray(good)
        bad[len(good) // 2] ^= 0x04
        _put_manifest(path, bytes(bad))
        ck.verify(path)


def test_every_truncation_of_manifest_is_refused(saved, ck):
    path, _state = saved
    good = _manifest_bytes(path)
    assert good.endswith(b"\n")
    for n in range(len(good) - 1):  # dropping only the final newline loses nothing
        _put_manifest(path, good[:n])
        try:
            with pytest.raises(ManifestError):
                ck.load(path)
        except pytest.fail.Exception:
            raise AssertionError(f"a manifest truncated to {n} of {len(good)} bytes loaded") from None


def _with_valid_crc(body: dict) -> bytes:
    raw = json.dumps(body).encode()
    header = {"magic": "ckptio-manifest", "version": 1, "body_nbytes": len(raw),
              "body_crc32": zlib.crc32(raw)}
    return json.dumps(header).encode() + b"\n" + raw + b"\n"


@pytest.mark.parametrize("kind", ["empty", "zeros", "random", "json-object", "header-only",
                                  "not-json-body", "future-version"])
def test_garbage_manifest_is_refused(saved, ck, kind):
    path, _state = saved
    good = _manifest_bytes(path)
    header, body = good.split(b"\n", 1)
    garbage = {
        "empty": b"",
        "zeros": b"\0" * len(good),
        "random": np.random.default_rng(1).integers(0, 256, len(good), dtype=np.uint8).tobytes(),
        "json-object": b'{"hello": "world"}\n',
        "header-only": header + b"\n",
        "not-json-body": (lambda raw: json.dumps({"magic": "ckptio-manifest", "version": 1,
                                                  "body_nbytes": len(raw),
                                                  "body_crc32": zlib.crc32(raw)}).encode()
                          + b"\n" + raw + b"\n")(b"{not json"),
        "future-version": good.replace(b'"version": 3', b'"version": 99', 1),
    }[kind]
    _put_manifest(path, garbage)
    _refused(ck, path)
    with pytest.raises(ManifestError):
        ck.verify(path)


@pytest.mark.parametrize("damage", ["offset-outside-file", "negative-nbytes", "path-in-name",
                                    "unknown-dtype", "bad-checksum", "tree-mismatch"])
def test_schema_violations_under_valid_crc_are_refused(saved, ck, damage):
    """A manifest whose CRC is right but whose content is wrong (written by something else,
    or edited by hand) is still refused before any byte is read."""
    path, _state = saved
    body = _manifest(path)
    t = next(t for t in body["tensors"] if t["key"] == "model.w")
    if damage == "offset-outside-file":
        t["offset"] = body["files"][0]["nbytes"]
    elif damage == "negative-nbytes":
        t["nbytes"] = -4
    elif damage == "path-in-name":
        body["files"][0]["name"] = "../" + body["files"][0]["name"]
    elif damage == "unknown-dtype":
        t["dtype"] = "float128"
    elif damage == "bad-checksum":
        t["checksum"] = "not-a-checksum"
    elif damage == "tree-mismatch":
        body["tensors"].remove(t)
    _put_manifest(path, _with_valid_crc(body))
    _refused(ck, path)


def test_unreadable_manifest_raises_ckpt_error(saved, ck):
    """manifest.json that cannot be read as a file (here: a directory) is a ckptio error, not a
    raw OSError escaping from open()."""
    path, _state = saved
    os.unlink(os.path.join(path, "manifest.json"))
    os.mkdir(os.path.join(path, "manifest.json"))
    with pytest.raises(CkptError) as info:
        ck.load(path)
    assert str(path) in str(info.value)


# -- no checkpoint at all --------------------------------------------------------------------

def test_path_that_does_not_exist(tmp_path, ck):
    missing = tmp_path / "nope"
    for call in (ck.load, ck.verify, lambda p: ck.load(p, _make_state()), ckptio.load, ckptio.verify):
        with pytest.raises(CheckpointNotFoundError) as info:
            call(missing)
        assert str(missing) in str(info.value)
    assert not missing.exists(), "loading must not create the directory"


def test_path_that_is_a_file(tmp_path, ck):
    f = tmp_path / "file"
    f.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointNotFoundError) as info:
        ck.load(f)
    assert str(f) in str(info.value)


# -- the Checkpointer after a refused load ---------------------------------------------------

def test_close_after_failed_load_while_its_error_is_alive(saved):
    """Keeping the error of a refused load (to log or re-raise it later) must not break the
    Checkpointer: close() succeeds and the next save completes."""
    path, state = saved
    ck = Checkpointer(Options(buffer_bytes=BUFFER, pool_bytes=4 * BUFFER))
    entry = _entry(path, "model.w")
    _flip(os.path.join(path, entry["file"]), entry["offset"])
    kept = None
    try:
        ck.load(path)
    except CorruptCheckpointError as exc:
        kept = exc  # e.g. handed to a logger or an error queue
    assert kept is not None
    ck.close()
    done = threading.Event()

    def save_again() -> None:
        ck.save(state, os.path.join(os.path.dirname(path), "after-close"))
        done.set()

    threading.Thread(target=save_again, daemon=True).start()
    assert done.wait(120), "the save after close() never finished (staging pool left empty)"
    ck.close()


# -- verify agrees with load -----------------------------------------------------------------
# Every corruption above, applied again: verify raises exactly when load does (both a
# CkptError), so "verify OK" means "loads" and a checkpoint that fails to load fails verify.


def _truncate(cut: str):
    def damage(path) -> None:
        entry = _entry(path, "model.big")
        data_file = os.path.join(path, entry["file"])
        size = {"empty": 0, "mid-small": _entry(path, "model.w")["offset"] + 10,
                "mid-big-unaligned": entry["offset"] + BUFFER + 1001,
                "last-byte": os.path.getsize(data_file) - 1}[cut]
        os.truncate(data_file, size)
    return damage


def _flip_entry(key: str, pos: int):
    def damage(path) -> None:
        entry = _entry(path, key)
        _flip(os.path.join(path, entry["file"]), entry["offset"] + pos)
    return damage


def _delete_data_file(path) -> None:
    (name,) = {t["file"] for t in _manifest(path)["tensors"]}
    os.unlink(os.path.join(path, name))


def _garbage(kind: str):
    def damage(path) -> None:
        good = _manifest_bytes(path)
        header, _body = good.split(b"\n", 1)
        raw = b"{not json"
        noise = np.random.default_rng(1).integers(0, 256, len(good), dtype=np.uint8).tobytes()
        _put_manifest(path, {
            "empty": b"", "zeros": b"\0" * len(good), "random": noise,
            "json-object": b'{"hello": "world"}\n', "header-only": header + b"\n",
            "not-json-body": json.dumps({"magic": "ckptio-manifest", "version": 2,
                                         "body_nbytes": len(raw), "body_crc32": zlib.crc32(raw)}
                                        ).encode() + b"\n" + raw + b"\n",
            "future-version": good.replace(b'"version": 3', b'"version": 99', 1),
        }[kind])
    return damage


def _schema(violation: str):
    def damage(path) -> None:
        body = _manifest(path)
        t = next(t for t in body["tensors"] if t["key"] == "model.w")
        if violation == "offset-outside-file":
            t["offset"] = body["files"][0]["nbytes"]
        elif violation == "negative-nbytes":
            t["nbytes"] = -4
        elif violation == "path-in-name":
            body["files"][0]["name"] = "../" + body["files"][0]["name"]
        elif violation == "tree-mismatch":
            body["tensors"].remove(t)
        elif violation == "bad-block-checksum":
            big = next(t for t in body["tensors"] if t["key"] == "model.big")
            big["blocks"][-1] = "0123456789abcdef"
        elif violation == "chunk-short-of-shape":
            t["shape"] = [128, 64]  # the one chunk holds rows 0-63 only
        raw = json.dumps(body).encode()
        header = {"magic": "ckptio-manifest", "version": body["version"], "body_nbytes": len(raw),
                  "body_crc32": zlib.crc32(raw)}
        _put_manifest(path, json.dumps(header).encode() + b"\n" + raw + b"\n")
    return damage


CORRUPTIONS = [
    *(pytest.param(_flip_entry(key, pos), id=f"flip-{key}-{pos}") for key, pos in FLIPS),
    *(pytest.param(_truncate(cut), id=f"truncate-{cut}")
      for cut in ("empty", "mid-small", "mid-big-unaligned", "last-byte")),
    pytest.param(_delete_data_file, id="deleted-data-file"),
    pytest.param(lambda path: os.unlink(os.path.join(path, "manifest.json")), id="no-manifest"),
    *(pytest.param(_garbage(kind), id=f"garbage-{kind}")
      for kind in ("empty", "zeros", "random", "json-object", "header-only", "not-json-body",
                   "future-version")),
    *(pytest.param(_schema(v), id=f"schema-{v}")
      for v in ("offset-outside-file", "negative-nbytes", "path-in-name", "tree-mismatch",
                "chunk-short-of-shape")),
]


def _error(call) -> CkptError | None:
    try:
        call()
    except CkptError as exc:
        return exc
    return None


@pytest.mark.parametrize("damage", CORRUPTIONS)
def test_verify_raises_exactly_when_load_raises(saved, ck, damage):
    path, _state = saved
    assert _error(lambda: ck.verify(path)) is None and _error(lambda: ck.load(path)) is None
    damage(path)
    verify_error = _error(lambda: ck.verify(path))
    for load in (ck.load, lambda p: ck.load(p, _make_state())):
        load_error = _error(lambda: load(path))
        assert load_error is not None, "every case here is damage a load must refuse"
        assert verify_error is not None, f"load raised {load_error!r}, verify passed"
    assert _pool_idle(ck)


def test_verify_agrees_with_load_on_damaged_manifest_bytes(saved, ck):
    """Bit flips and truncations of the manifest (a sample of the positions the tests above
    try every one of): verify and load both refuse each."""
    path, _state = saved
    good = _manifest_bytes(path)
    damaged = [bytes(good[:n]) for n in range(0, len(good) - 1, 37)]
    for pos in range(0, len(good), 11):
        for mask in (0x01, 0x80):
            bad = bytearray(good)
            bad[pos] ^= mask
            damaged.append(bytes(bad))
    for data in damaged:
        _put_manifest(path, data)
        load_error = _error(lambda: ck.load(path))
        verify_error = _error(lambda: ck.verify(path))
        assert (load_error is None) == (verify_error is None), (load_error, verify_error)
        assert isinstance(load_error, ManifestError), f"{data[:80]!r}... loaded"


def test_verify_refuses_a_bad_block_checksum_that_a_partial_load_hits(saved, ck):
    """A block checksum that disagrees with intact bytes: a load of part of the entry (a shard)
    checks the blocks it reads and fails, and so does verify, which checks every block; under
    xxh3_64_tree (the default) a load of the whole entry fails too, its whole checksum being
    of the blocks' (under xxh3_64 it checked only the whole and succeeded)."""
    path, state = saved
    big = state["model"]["big"]
    shard = ckptio.TensorShard(torch.empty(BIG_NUMEL - 1000), (BIG_NUMEL,), (1000,))
    ck.load(path, {"model": {"big": shard}}, strict=False)  # intact: the shard loads
    assert torch.equal(shard.local, big[1000:])
    _schema("bad-block-checksum")(path)
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch for key 'model.big'"):
        ck.load(path, {"model": {"big": shard}}, strict=False)
    with pytest.raises(CorruptCheckpointError, match="block checksum .* of key 'model.big'"):
        ck.verify(path)
    with pytest.raises(CorruptCheckpointError, match="block checksum .* of key 'model.big'"):
        ck.load(path)
    assert _pool_idle(ck)
