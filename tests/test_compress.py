"""Compressed checkpoints (format version 4, issue 28): every dtype with every codec bit for bit
(NaN payloads, infinities, -0.0, subnormals), frames a resharding load decodes alone, a damaged
frame found, "auto" against the store's measured write rate, a codec that is not installed,
and the validator's refusals of malformed version 4 fields."""

from __future__ import annotations

import json
import os
import sys
import zlib
from datetime import datetime, timezone

import pytest
import torch

import ckptio
from conftest import ALL_DTYPES
from special_values import bits_equal, specials
from ckptio.errors import CkptError, CorruptCheckpointError, ManifestError
from ckptio.format import manifest
from ckptio.options import CODECS
from ckptio.tuning import profile

MiB = 1 << 20
SMALL = ckptio.Options(buffer_bytes=1 * MiB, pool_bytes=4 * MiB)  # frames of 256 KiB
FRAME = 256 << 10


def compressible(dtype: torch.dtype, numel: int, seed: int = 0) -> torch.Tensor:
    """Random bits with every special pattern first (specials), then a long stretch of a few
    repeated values: frames of noise (stored raw) and frames that compress, in one tensor."""
    t = specials(dtype, (numel,), seed)
    flat = t.view(torch.uint8) if dtype != torch.bool else t.view(torch.uint8)
    cut = flat.numel() // 3
    pattern = flat[:64].clone()
    rest = flat[cut:]
    rest.copy_(pattern.repeat(-(-rest.numel() // 64))[:rest.numel()])
    if dtype == torch.bool:
        t.view(torch.uint8).clamp_(0, 1)
    return t


def body(path: str) -> dict:
    with open(os.path.join(path, "manifest.json"), "rb") as f:
        return json.loads(f.read().split(b"\n")[1])


def header(path: str) -> dict:
    with open(os.path.join(path, "manifest.json"), "rb") as f:
        return json.loads(f.read().split(b"\n")[0])


def entry(path: str, key: str) -> dict:
    return next(t for t in body(path)["tensors"] if t["key"] == key)


def numel_for(dtype: torch.dtype, nbytes: int) -> int:
    return nbytes // torch.empty((), dtype=dtype).element_size()


@pytest.mark.parametrize("codec", CODECS)
def test_every_dtype_round_trips_bit_exact(tmp_path, codec):
    state = {str(d).removeprefix("torch."): compressible(d, numel_for(d, 3 * FRAME + 4096), i)
             for i, d in enumerate(ALL_DTYPES)}
    state["tiny"] = specials(torch.float32, (7,))  # one short frame
    state["empty"] = torch.empty(0, 3)
    path = str(tmp_path / "ckpt")
    ck = ckptio.Checkpointer(ckptio.Options(buffer_bytes=MiB, pool_bytes=4 * MiB,
                                            compression=codec))
    ck.save(state, path)
    assert header(path)["version"] == manifest.VERSION_CODED
    for d in ALL_DTYPES:
        row = entry(path, str(d).removeprefix("torch."))
        itemsize = torch.empty((), dtype=d).element_size()
        want = f"bytegroup{itemsize}+zstd" if codec == "bytegroup+zstd" and itemsize > 1 else "zstd"
        assert row["stored"]["codec"] == want
        frames = row["stored"]["frames"]
        assert len(frames) == 4 and sum(frames) == row["stored"]["nbytes"] < row["nbytes"]
        if d != torch.bool:  # the noise frame is stored raw; the patterned ones shrink
            assert frames[0] == FRAME and frames[-1] < FRAME
    out = ck.load(path)
    for key, value in state.items():
        assert bits_equal(out[key], value), key
    in_place = {k: torch.zeros_like(v) for k, v in state.items()}
    ck.load(path, in_place)
    assert all(bits_equal(in_place[k], v) for k, v in state.items())
    ck.verify(path)


def test_resharded_load_decodes_only_the_frames_it_needs(tmp_path):
    """A row band of a compressed tensor loads bit-exact while a frame outside it is damaged;
    a whole load of it finds the damage, naming the key and the file."""
    full = compressible(torch.bfloat16, 8 * FRAME // 2).reshape(1024, -1)  # 8 frames
    path = str(tmp_path / "ckpt")
    ck = ckptio.Checkpointer(ckptio.Options(buffer_bytes=MiB, pool_bytes=4 * MiB,
                                            compression="bytegroup+zstd"))
    ck.save({"w": full}, path)
    row = entry(path, "w")
    frames = row["stored"]["frames"]
    assert frames[0] == FRAME and all(f < FRAME for f in frames[3:])  # noise, then compressed
    last = row["offset"] + sum(frames[:-1])  # the last frame's first stored byte
    data = os.path.join(path, row["file"])
    with open(data, "r+b") as f:
        f.seek(last + frames[-1] // 2)
        byte = f.read(1)
        f.seek(last + frames[-1] // 2)
        f.write(bytes([byte[0] ^ 0x40]))
    rows = full.shape[0] // 8  # frame 0 holds the first 128 rows, frame 1 the next 128
    band = ckptio.TensorShard(torch.zeros(rows + 10, full.shape[1], dtype=full.dtype),
                              tuple(full.shape), (100, 0))
    ck.load(path, {"w": band})
    assert bits_equal(band.local, full[100:100 + rows + 10])
    with pytest.raises(CorruptCheckpointError, match=r"'w'.*data-") as info:
        ck.load(path)
    assert "frame 7" in str(info.value)


def test_flat_shards_of_a_compressed_tensor_load_into_another_cut(tmp_path):
    full = compressible(torch.float32, 3 * FRAME // 4 + 13)
    path = str(tmp_path / "ckpt")
    ck = ckptio.Checkpointer(ckptio.Options(buffer_bytes=MiB, pool_bytes=4 * MiB,
                                            compression="zstd"))
    half = full.numel() // 2 + 77
    ck.save({"w": full}, path)
    piece = ckptio.FlatShard(torch.zeros(full.numel() - half), tuple(full.shape), half)
    ck.load(path, {"w": piece})
    assert bits_equal(piece.local, full[half:])


def test_damaged_frame_header_is_a_corrupt_checkpoint(tmp_path):
    full = compressible(torch.float32, FRAME // 4)
    path = str(tmp_path / "ckpt")
    ck = ckptio.Checkpointer(ckptio.Options(buffer_bytes=MiB, pool_bytes=4 * MiB,
                                            compression="zstd"))
    ck.save({"w": full}, path)
    row = entry(path, "w")
    assert row["stored"]["nbytes"] < row["nbytes"]
    with open(os.path.join(path, row["file"]), "r+b") as f:
        f.seek(row["offset"])
        f.write(b"\0\0\0\0")  # the zstd magic number
    with pytest.raises(CorruptCheckpointError, match=r"frame 0 of key 'w'.*damaged"):
        ck.load(path)
    with pytest.raises(CorruptCheckpointError):
        ck.verify(path)


def test_off_writes_version_3_and_old_checkpoints_still_load(tmp_path):
    state = {"w": compressible(torch.float32, FRAME)}
    plain = str(tmp_path / "plain")
    ckptio.Checkpointer(SMALL).save(state, plain)
    assert header(plain)["version"] == 3 and "stored" not in entry(plain, "w")
    assert bits_equal(ckptio.Checkpointer(SMALL).load(plain)["w"], state["w"])


def _profile_for(directory, write_gbps: float) -> None:
    device, fs = profile.filesystem_key(directory)
    profile.store(profile.Profile("posix", "auto", MiB, 4, fs, device,
                                  datetime.now(timezone.utc).isoformat(), write_gbps, 1.0))


def test_auto_compresses_only_where_the_disk_is_slower_than_the_codec(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTIO_PROFILE_PATH", str(tmp_path / "profiles.json"))
    weights = torch.randn(FRAME, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    state = {"w": weights, "noise": specials(torch.float32, (FRAME // 4,))}
    options = ckptio.Options(buffer_bytes=MiB, pool_bytes=4 * MiB, compression="auto")
    unknown = str(tmp_path / "unknown")
    ckptio.Checkpointer(options).save(state, unknown)  # no profile: never slower than "off"
    assert header(unknown)["version"] == 3
    _profile_for(tmp_path, write_gbps=1000.0)  # a disk far faster than any codec here
    fast = str(tmp_path / "fast")
    ckptio.Checkpointer(options).save(state, fast)
    assert "stored" not in entry(fast, "w")
    _profile_for(tmp_path, write_gbps=0.001)  # 1 MB/s: compression pays
    slow = str(tmp_path / "slow")
    ckptio.Checkpointer(options).save(state, slow)
    assert entry(slow, "w")["stored"]["codec"] == "bytegroup2+zstd"
    assert "stored" not in entry(slow, "noise")  # random bits: the sample says it does not pay
    out = ckptio.Checkpointer(options).load(slow)
    assert bits_equal(out["w"], state["w"]) and bits_equal(out["noise"], state["noise"])


def test_a_codec_that_is_not_installed_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "zstandard", None)  # import zstandard -> ImportError
    ck = ckptio.Checkpointer(ckptio.Options(buffer_bytes=MiB, pool_bytes=4 * MiB,
                                            compression="zstd"))
    with pytest.raises(CkptError, match=r"pip install zstandard \(the compress extra"):
        ck.save({"w": torch.zeros(10)}, str(tmp_path / "ckpt"))
    assert not os.path.exists(tmp_path / "ckpt" / "manifest.json")
    auto = ckptio.Checkpointer(ckptio.Options(buffer_bytes=MiB, pool_bytes=4 * MiB,
                                              compression="auto"))
    auto.save({"w": torch.zeros(10)}, str(tmp_path / "auto"))  # auto: saved uncompressed
    assert header(str(tmp_path / "auto"))["version"] == 3


def test_unknown_compression_option_is_refused():
    with pytest.raises(CkptError, match="Options.compression='lz4'"):
        ckptio.Options(compression="lz4")
    with pytest.raises(CkptError, match="compress_threads"):
        ckptio.Options(compress_threads=0)


def test_an_invalid_option_from_the_environment_names_its_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTIO_COMPRESSION", "lz4")
    with pytest.raises(CkptError, match="set by the environment: CKPTIO_COMPRESSION='lz4'"):
        ckptio.save({"w": torch.zeros(3)}, str(tmp_path / "ck"))
    assert not (tmp_path / "ck").exists()
    # an explicit field overrides the variable: nothing to blame on it
    ckptio.save({"w": torch.zeros(3)}, str(tmp_path / "ck"),
                options=ckptio.Options.from_env(compression="off"))


# ------------------------------------------------------------------------------------------------
# the validator


def _saved(tmp_path) -> tuple[str, dict]:
    path = str(tmp_path / "ckpt")
    ckptio.Checkpointer(ckptio.Options(buffer_bytes=MiB, pool_bytes=4 * MiB,
                                       compression="bytegroup+zstd")).save(
        {"w": compressible(torch.float32, FRAME // 2), "v": compressible(torch.float32, 100)},
        path)
    return path, body(path)


def _encoded(raw: dict, version: int = manifest.VERSION_CODED) -> bytes:
    text = json.dumps(raw, separators=(",", ":")).encode()
    head = {"magic": manifest.MAGIC, "version": version, "body_nbytes": len(text),
            "body_crc32": zlib.crc32(text)}
    return json.dumps(head).encode() + b"\n" + text + b"\n"


def _w(raw: dict) -> dict:
    return next(t for t in raw["tensors"] if t["key"] == "w")


def _frames_do_not_sum(raw):
    _w(raw)["stored"]["nbytes"] += 1


def _frame_longer_than_logical(raw):
    s = _w(raw)["stored"]
    s["frames"][0] = FRAME + 1
    s["nbytes"] = sum(s["frames"])


def _frame_count(raw):
    s = _w(raw)["stored"]
    s["frames"].append(1)
    s["nbytes"] += 1


def _unknown_codec(raw):
    _w(raw)["stored"]["codec"] = "lzma"


def _group_mismatch(raw):
    _w(raw)["stored"]["codec"] = "bytegroup2+zstd"


def _ref_not_in_bases(raw):
    _w(raw)["ref"] = {"checkpoint": "step-1"}


def _ref_and_xor(raw):
    _w(raw)["ref"] = {"checkpoint": "step-1"}
    _w(raw)["xor"] = {"checkpoint": "step-1"}
    raw["bases"] = ["step-1"]


def _base_not_plain(raw):
    _w(raw)["xor"] = {"checkpoint": "../step-1"}
    raw["bases"] = ["../step-1"]


def _bases_unsorted(raw):
    for key, name in (("w", "step-2"), ("v", "step-1")):
        next(t for t in raw["tensors"] if t["key"] == key)["xor"] = {"checkpoint": name}
    raw["bases"] = ["step-2", "step-1"]


def _base_unused(raw):
    raw["bases"] = ["step-1"]


def _stored_outside_file(raw):
    s = _w(raw)
    s["offset"] = next(f["nbytes"] for f in raw["files"] if f["name"] == s["file"]) - 8


@pytest.mark.parametrize("damage, message", [
    (_frames_do_not_sum, "sum to"),
    (_frame_longer_than_logical, "stored frame 0 has"),
    (_frame_count, "stored frames for"),
    (_unknown_codec, "codec 'lzma' is unknown"),
    (_group_mismatch, "groups 2 bytes"),
    (_ref_not_in_bases, "not in bases"),
    (_ref_and_xor, "not both"),
    (_base_not_plain, "not a plain name"),
    (_bases_unsorted, "sorted and unique"),
    (_base_unused, "which no entry references"),
    (_stored_outside_file, "outside data file"),
])
def test_malformed_version_4_fields_are_refused(tmp_path, damage, message):
    path, raw = _saved(tmp_path)
    manifest.decode(_encoded(raw), path)  # the saved one is valid
    damage(raw)
    with pytest.raises(ManifestError, match=message):
        manifest.decode(_encoded(raw), path)


def test_version_4_fields_in_a_version_3_manifest_are_refused(tmp_path):
    path, raw = _saved(tmp_path)
    raw["version"] = 3
    with pytest.raises(ManifestError, match="'stored' exists from version 4"):
        manifest.decode(_encoded(raw, version=3), path)


def test_loading_without_the_codec_names_the_extra(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt")
    ck = ckptio.Checkpointer(ckptio.Options(buffer_bytes=MiB, pool_bytes=4 * MiB,
                                            compression="zstd"))
    ck.save({"w": compressible(torch.float32, FRAME // 4)}, path)
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(CkptError, match=r"reading a compressed.*pip install zstandard"):
        ck.load(path)


def test_a_failed_packed_save_leaves_the_previous_checkpoint_and_no_files(tmp_path):
    from ckptio.testing.faults import inject

    path = str(tmp_path / "ckpt")
    options = ckptio.Options(buffer_bytes=MiB, pool_bytes=4 * MiB, compression="zstd",
                             max_file_bytes=MiB)  # segments of 1 MiB: several files per save
    first = {"w": compressible(torch.float32, 2 * FRAME), "v": torch.zeros(3 * FRAME // 4)}
    ck = ckptio.Checkpointer(options)
    ck.save(first, path)
    before = sorted(os.listdir(path))
    faulty = inject(ck, fail_write=2)  # the second segment's write fails
    second = {"w": specials(torch.float32, (3 * FRAME // 4,), 9),
              "v": specials(torch.float32, (3 * FRAME // 4,), 10),
              "x": specials(torch.float32, (3 * FRAME // 4,), 11)}
    with pytest.raises(CkptError, match="injected fault"):
        ck.save(second, path)
    assert faulty.injected
    assert sorted(os.listdir(path)) == before
    out = ck.load(path)
    assert bits_equal(out["w"], first["w"]) and bits_equal(out["v"], first["v"])


def test_a_checkpoint_manager_saves_with_its_options_compression(tmp_path):
    state = {"w": torch.randn(FRAME, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)}
    mgr = ckptio.CheckpointManager(str(tmp_path / "run"), options=ckptio.Options(
        buffer_bytes=MiB, pool_bytes=4 * MiB, compression="bytegroup+zstd"))
    mgr.save(5, state)
    step = str(tmp_path / "run" / "step-5")
    assert entry(step, "w")["stored"]["codec"] == "bytegroup2+zstd"
    fresh = {"w": torch.zeros_like(state["w"])}
    assert mgr.restore(fresh) == 5 and bits_equal(fresh["w"], state["w"])


def test_auto_that_needs_no_sample_takes_the_plain_path(tmp_path, monkeypatch):
    """No tuned profile, or one whose disk outruns the codec, and no base: "auto" is "off"
    (no packer, no frames, version 3); a slow disk or a base still packs."""
    from ckptio import packed
    from ckptio.storage.select import store_for
    monkeypatch.setenv("CKPTIO_PROFILE_PATH", str(tmp_path / "profiles.json"))
    options = ckptio.Options(buffer_bytes=MiB, pool_bytes=4 * MiB, compression="auto")
    store = store_for(str(tmp_path / "ckpt"), options)
    assert packed.packing_for(options, store, None, block_nbytes=FRAME) is None
    _profile_for(tmp_path, write_gbps=1000.0)
    assert packed.packing_for(options, store, None, block_nbytes=FRAME) is None
    _profile_for(tmp_path, write_gbps=0.001)
    slow = packed.packing_for(options, store, None, block_nbytes=FRAME)
    assert slow is not None and slow.compression.codec == "bytegroup+zstd"
    _profile_for(tmp_path, write_gbps=1000.0)
    state = {"w": compressible(torch.float32, FRAME)}
    ckptio.Checkpointer(options).save(state, str(tmp_path / "base"))
    with_base = packed.packing_for(options, store, str(tmp_path / "base"), block_nbytes=FRAME)
    assert with_base is not None and with_base.compression.codec == "bytegroup+zstd"


def test_a_compressed_load_reads_many_small_entries_in_few_reads(tmp_path, monkeypatch):
    """Small compressed entries (and, for a delta, their base entries) are read by spans of
    many entries (storage/spans.py), not by one read each: what an object store's GETs cost."""
    from ckptio.storage.files import StoreFiles
    gen = torch.Generator().manual_seed(3)
    state = {f"w{i}": torch.randn(2048, generator=gen).to(torch.bfloat16) for i in range(60)}
    ck = ckptio.Checkpointer(ckptio.Options(buffer_bytes=MiB, pool_bytes=4 * MiB,
                                            compression="bytegroup+zstd"))
    base, delta = str(tmp_path / "base"), str(tmp_path / "delta")
    ck.save(state, base)
    changed = {k: (v if i % 2 else v + 1) for i, (k, v) in enumerate(state.items())}
    ck.save(changed, delta, base=base)
    reads: list[int] = []
    original = StoreFiles.submit_read

    def counted(self, fh, offset, into):
        reads.append(len(into))
        return original(self, fh, offset, into)

    monkeypatch.setattr(StoreFiles, "submit_read", counted)
    for path, want in ((base, state), (delta, changed)):
        reads.clear()
        out = ckptio.Checkpointer(SMALL).load(path)
        assert all(bits_equal(out[k], want[k]) for k in want)
        assert len(reads) <= 4, f"{path}: {len(reads)} reads for 60 entries"
