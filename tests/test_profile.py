"""I/O profiles: stored and found per filesystem, never in the way of a save; tune's choice."""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import pytest
import torch

import ckptio
from ckptio import cli
from ckptio.tuning import profile
from ckptio.tuning.tune import Candidate, choose, choose_mode

MiB = 1 << 20


@pytest.fixture(autouse=True)
def profile_file(tmp_path, monkeypatch):
    path = tmp_path / "cache" / "profiles.json"
    monkeypatch.setenv(profile.PATH_ENV, str(path))
    return path


def make_profile(directory, **changes) -> profile.Profile:
    device, fs_type = profile.filesystem_key(directory)
    p = profile.Profile(io_backend="posix", direct_io="auto", buffer_bytes=16 * MiB, io_depth=4,
                        fs_type=fs_type, device=device, measured_at="2026-01-01T00:00:00+00:00",
                        write_gbps=1.5, read_gbps=1.2)
    return dataclasses.replace(p, **changes)


def test_store_then_lookup_round_trip(tmp_path, profile_file):
    data = tmp_path / "data"
    data.mkdir()
    p = make_profile(data)
    assert profile.store(p) == str(profile_file)
    assert profile.lookup(data) == p
    assert profile.lookup(data / "ckpt" / "step-100") == p  # a save path that does not exist yet
    assert [f.name for f in profile_file.parent.iterdir()] == ["profiles.json"]  # no temp left


def test_store_replaces_the_profile_of_the_same_filesystem_only(tmp_path):
    profile.store(make_profile(tmp_path, io_depth=2))
    other = make_profile(tmp_path, device=12345, fs_type="xfs")
    profile.store(other)
    profile.store(make_profile(tmp_path, io_depth=8))
    assert profile.lookup(tmp_path).io_depth == 8
    assert profile.read_all()["xfs:12345"] == other


def test_filesystem_key_names_the_mount_type(tmp_path):
    device, fs_type = profile.filesystem_key(tmp_path)
    assert device == os.stat(tmp_path).st_dev
    assert fs_type != "unknown" and " " not in fs_type


def test_another_filesystem_does_not_match(tmp_path):
    shm = "/dev/shm"
    if not os.path.isdir(shm) or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("no second filesystem to compare with")
    profile.store(make_profile(tmp_path))
    assert profile.lookup(shm) is None
    assert profile.filesystem_key(shm)[1] == "tmpfs"


def test_missing_or_unreadable_file_is_no_profile(tmp_path, profile_file):
    assert profile.lookup(tmp_path) is None
    profile_file.mkdir(parents=True)  # a directory where the file should be: read fails
    assert profile.lookup(tmp_path) is None


@pytest.mark.parametrize("text", ["{not json", '{"version": 99, "profiles": {}}', "\xff\xfe", "[1]",
                                  '{"version": 1, "profiles": {"k": {"io_backend": "posix"}}}'])
def test_corrupt_file_warns_once_and_is_no_profile(tmp_path, profile_file, caplog, text):
    profile_file.parent.mkdir(parents=True)
    profile_file.write_text(text, encoding="latin-1")
    with caplog.at_level(logging.WARNING, logger="ckptio"):
        assert profile.lookup(tmp_path) is None
        assert profile.lookup(tmp_path) is None
    assert len([r for r in caplog.records if "profile" in r.getMessage()]) == 1


def test_invalid_values_are_corrupt(tmp_path, profile_file):
    profile.store(make_profile(tmp_path))
    profile_file.write_text(profile_file.read_text().replace("16777216", "1000"))
    assert profile.lookup(tmp_path) is None
    with pytest.raises(profile.ProfileError):
        profile.store(make_profile(tmp_path, buffer_bytes=1000))


def test_store_over_a_corrupt_file_replaces_it(tmp_path, profile_file):
    profile_file.parent.mkdir(parents=True)
    profile_file.write_text("garbage")
    profile.store(make_profile(tmp_path))
    assert profile.lookup(tmp_path) == make_profile(tmp_path)


def test_corrupt_profile_does_not_break_save_and_load(tmp_path, profile_file):
    profile_file.parent.mkdir(parents=True)
    profile_file.write_text("{corrupt")
    state = {"w": torch.arange(1000, dtype=torch.float32), "step": 3}
    ckptio.save(state, str(tmp_path / "ckpt"))
    assert torch.equal(ckptio.load(str(tmp_path / "ckpt"))["w"], state["w"])


def test_tune_show_without_profile_says_so(tmp_path, capsys, profile_file):
    assert cli.main(["tune", "--show"]) == 0
    out = capsys.readouterr().out
    assert "no ckptio I/O profile stored" in out and "ckptio tune DIR" in out
    profile.store(make_profile(tmp_path, device=1, fs_type="xfs"))
    assert cli.main(["tune", "--show", str(tmp_path)]) == 0
    assert "no profile for" in capsys.readouterr().out


def test_tune_measures_and_stores_a_profile_for_its_directory(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    argv = ["tune", str(data), "--total", "2M", "--sizes", "1M", "--pool-depths", "1,2",
            "--uring-depths", "2", "--reps", "1"]
    assert cli.main(argv) == 0
    found = profile.lookup(data)
    assert found is not None and found.buffer_bytes == MiB and found.io_backend in ("posix", "uring")
    device, fs_type = profile.filesystem_key(data)
    assert (found.device, found.fs_type) == (device, fs_type)
    assert list(data.iterdir()) == []
    assert cli.main(["tune", "--show", str(data)]) == 0
    assert f"io_depth={found.io_depth}" in capsys.readouterr().out


def cand(engine: str, depth: int, nbytes: int, gbps: float, mode: str = "direct") -> Candidate:
    return Candidate(engine, mode, nbytes, depth, gbps, gbps)


def test_choose_prefers_fewer_threads_then_less_memory_on_a_tie():
    near = [cand("posix", 8, 16 * MiB, 1.50), cand("posix", 2, 16 * MiB, 1.48),
            cand("posix", 2, 4 * MiB, 1.47), cand("posix", 1, 1 * MiB, 1.0)]
    assert choose(near) == near[2]


def test_choose_uring_only_when_measurably_better():
    posix = cand("posix", 4, 16 * MiB, 1.50)
    assert choose([posix, cand("uring", 16, 16 * MiB, 1.53)]) == posix
    assert choose([posix, cand("uring", 16, 16 * MiB, 1.60)]).engine == "uring"
    assert choose([cand("uring", 4, MiB, 1.0)]).engine == "uring"


def test_choose_mode_keeps_o_direct_unless_buffered_wins_clearly():
    assert choose_mode([cand("posix", 4, MiB, 1.0), cand("posix", 4, MiB, 1.02, "buffered")]) == "direct"
    assert choose_mode([cand("posix", 4, MiB, 1.0), cand("posix", 4, MiB, 1.2, "buffered")]) == "buffered"
    assert choose_mode([cand("posix", 4, MiB, 1.0, "buffered")]) == "buffered"


def _old(path, seconds_ago: float) -> None:
    """Give ``path`` modification times ``seconds_ago`` in the past (a settled file)."""
    when = time.time() - seconds_ago
    os.utime(path, (when, when))


def test_no_profile_file_reads_no_filesystem_key(tmp_path, monkeypatch, profile_file):
    """Without the file (most runs), or with only an endpoint's profile in it, a lookup on every
    save neither works out the filesystem's key nor reads the mount table."""
    def refused(*_args):
        raise AssertionError("the filesystem key was worked out")

    monkeypatch.setattr(profile, "filesystem_key", refused)
    assert profile.lookup(tmp_path) is None
    s3 = profile.S3Profile(endpoint="http://e", s3_concurrency=4, buffer_bytes=8 * MiB,
                           measured_at="2026-01-01T00:00:00+00:00", write_gbps=1.0,
                           read_gbps=1.0)
    profile.store(s3)
    assert profile.lookup(tmp_path) is None
    assert profile.lookup_s3("http://e") == s3


def test_a_settled_file_is_parsed_once_and_again_after_any_change(tmp_path, monkeypatch,
                                                                  profile_file):
    """The file is parsed again only when it changed: rewritten in place (same inode, same
    size, another time), replaced by store() (another inode), or changed so recently that its
    times could not tell a rewrite."""
    parsed = []
    read_all = profile.read_all
    monkeypatch.setattr(profile, "read_all", lambda path=None: parsed.append(1) or read_all(path))
    first = make_profile(tmp_path, io_depth=2)
    profile.store(first)
    parsed.clear()  # store() reads the file it replaces
    assert profile.lookup(tmp_path) == first and profile.lookup(tmp_path) == first
    assert len(parsed) == 2  # just written: read each time
    _old(profile_file, 60)
    assert profile.lookup(tmp_path) == first and profile.lookup(tmp_path) == first
    assert len(parsed) == 3  # settled: read once
    text = profile_file.read_text()
    profile_file.write_text(text.replace('"io_depth": 2', '"io_depth": 3'))  # same size
    _old(profile_file, 30)
    assert profile.lookup(tmp_path).io_depth == 3
    profile.store(make_profile(tmp_path, io_depth=5))
    _old(profile_file, 60)
    assert profile.lookup(tmp_path).io_depth == 5
    profile_file.unlink()
    assert profile.lookup(tmp_path) is None
