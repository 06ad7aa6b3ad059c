"""Red team of the tuner and its profiles as a new user meets them: `ckptio tune` given bad
options, an unwritable or newer profile file, a path that does not exist yet, SIGTERM mid-run;
a hand-edited profile with an absurd io_depth; a tuned buffer the user's max_file_bytes cannot
hold; an io_depth beyond any backend's reach."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import ckptio
from ckptio import cli, io
from ckptio.tuning import profile

MiB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent
QUICK = ["--total", "2M", "--sizes", "1M", "--pool-depths", "1", "--uring-depths", "4",
         "--reps", "1"]


@pytest.fixture(autouse=True)
def profile_file(tmp_path, monkeypatch):
    path = tmp_path / "cache" / "profiles.json"
    monkeypatch.setenv(profile.PATH_ENV, str(path))
    return path


def make_profile(directory: Path, **changes: object) -> profile.Profile:
    device, fs_type = profile.filesystem_key(directory)
    p = profile.Profile(io_backend="posix", direct_io="off", buffer_bytes=16 * MiB, io_depth=4,
                        fs_type=fs_type, device=device, measured_at="2026-01-01T00:00:00+00:00",
                        write_gbps=1.5, read_gbps=1.2)
    return dataclasses.replace(p, **changes)


def write_raw(path: Path, doc: object) -> None:
    """A profile file as a hand edit (or another ckptio) leaves it, settled (older than the
    re-read window) so a lookup keeps what it parsed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))
    old = time.time() - 60
    os.utime(path, (old, old))


@pytest.mark.parametrize("bad", [["--sizes", "abc"], ["--pool-depths", "x"],
                                 ["--pool-depths", "0"], ["--uring-depths", "100000"],
                                 ["--reps", "0"], ["--total", "1K"], ["--sizes", ","]])
def test_tune_refuses_bad_options_in_one_line_before_measuring(tmp_path, capsys, bad):
    data = tmp_path / "data"
    assert cli.main(["tune", str(data), *QUICK, *bad]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ckptio: error: ckptio tune: ") and err.count("\n") == 1
    assert "e.g. --" in err  # names an example of the option written right
    assert not data.exists()  # nothing measured, nothing made


def test_tune_never_replaces_a_profile_file_of_a_newer_ckptio(tmp_path, profile_file, capsys):
    doc = {"version": profile.VERSION + 1, "profiles": {"s3:http://x": {"anything": 1}}}
    write_raw(profile_file, doc)
    before = profile_file.read_bytes()
    assert cli.main(["tune", str(tmp_path / "data"), *QUICK]) == 2
    err = capsys.readouterr().err
    assert str(profile_file) in err and "newer ckptio" in err and profile.PATH_ENV in err
    assert profile_file.read_bytes() == before
    with pytest.raises(ckptio.CkptError, match="newer ckptio"):
        profile.store(make_profile(tmp_path))
    assert profile_file.read_bytes() == before
    assert not (tmp_path / "data").exists()


def test_tune_says_the_profile_file_cannot_be_written_before_measuring(tmp_path, monkeypatch,
                                                                      capsys):
    folder = tmp_path / "a-folder"
    folder.mkdir()
    monkeypatch.setenv(profile.PATH_ENV, str(folder))  # a directory, not a file
    assert cli.main(["tune", str(tmp_path / "data"), *QUICK]) == 2
    err = capsys.readouterr().err
    assert str(folder) in err and "directory" in err and profile.PATH_ENV in err
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(profile.PATH_ENV, str(blocker / "profiles.json"))  # its folder is a file
    assert cli.main(["tune", str(tmp_path / "data"), *QUICK]) == 2
    err = capsys.readouterr().err
    assert "cannot write the profile file" in err and profile.PATH_ENV in err
    assert not (tmp_path / "data").exists()


def test_tune_of_a_path_that_does_not_exist_leaves_no_folder_behind(tmp_path, profile_file):
    target = tmp_path / "not" / "yet" / "there"
    assert cli.main(["tune", str(target), *QUICK]) == 0
    assert not (tmp_path / "not").exists()  # every folder the run made is gone
    assert profile.lookup(target) is not None


def test_sigterm_mid_tune_removes_its_scratch_and_keeps_the_profile(tmp_path, profile_file):
    data = tmp_path / "data"
    data.mkdir()
    profile.store(make_profile(data))
    before = profile_file.read_bytes()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "ckptio", "tune", str(data), "--total", "256M", "--sizes",
            "1M,4M", "--pool-depths", "1,2", "--uring-depths", "4", "--reps", "3"]
    with subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True) as proc:
        assert proc.stderr is not None
        proc.stderr.readline()  # the first cell measured: the scratch folder exists
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert list(data.iterdir()) == []  # the study's scratch files are gone
    assert profile_file.read_bytes() == before


def test_a_profile_with_an_absurd_io_depth_is_ignored_naming_the_file(tmp_path, profile_file,
                                                                    caplog):
    data = tmp_path / "data"
    data.mkdir()
    entry = dataclasses.asdict(make_profile(data, io_backend="uring", io_depth=100000))
    write_raw(profile_file, {"version": profile.VERSION, "profiles": {
        f"{entry['fs_type']}:{entry['device']}": entry}})
    with caplog.at_level("WARNING", logger="ckptio"):
        ckptio.save({"w": torch.arange(8.0)}, data / "step", options=ckptio.Options())
    assert torch.equal(ckptio.load(data / "step")["w"], torch.arange(8.0))
    assert any(str(profile_file) in r.getMessage() and "io_depth=100000" in r.getMessage()
               for r in caplog.records)


def test_an_absurd_io_depth_is_refused_naming_the_option():
    with pytest.raises(ckptio.CkptError, match=r"Options.io_depth=100000: .*<= 1024"):
        ckptio.Options(io_depth=100000)


def test_a_tuned_buffer_larger_than_max_file_bytes_leaves_the_users_options_valid(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    profile.store(make_profile(data, buffer_bytes=64 * MiB, io_depth=2))
    options = ckptio.Options(max_file_bytes=16 * MiB)
    state = {"w": torch.arange(1000.0)}
    ckptio.save(state, data / "step", options=options)
    assert torch.equal(ckptio.load(data / "step", options=options)["w"], state["w"])
    tuned = profile.tuned_options(options, str(data))
    assert tuned.io_depth == 2 and tuned.buffer_bytes == options.buffer_bytes


@pytest.mark.parametrize(("given", "said"), [
    ({"buffer_bytes": 16.0 * MiB}, r"Options.buffer_bytes=16777216.0: an int, not a float"),
    ({"io_depth": "4"}, r"Options.io_depth='4': an int, not a str"),
    ({"verify": "false"}, r"Options.verify='false': True or False"),  # "false" is true
    ({"use_profile": "no"}, r"Options.use_profile='no': True or False"),
    ({"rank_timeout_s": "5"}, r"Options.rank_timeout_s='5': a number"),
    ({"host_budget_bytes": 0.5 * (1 << 30)}, r"Options.host_budget_bytes=.*: an int")])
def test_an_option_of_the_wrong_type_is_refused_naming_it(tmp_path, given, said):
    """As a YAML config or argparse without type= gives them: before, a float byte count
    failed inside the save with a bare TypeError and verify='false' verified."""
    with pytest.raises(ckptio.CkptError, match=said):
        ckptio.Options(**given)


def test_s3_settings_of_the_wrong_type_are_refused_naming_them():
    with pytest.raises(ckptio.CkptError, match=r"S3Settings.concurrency='4': an int"):
        ckptio.S3Settings(concurrency="4")
    with pytest.raises(ckptio.CkptError, match=r"S3Settings.read_bytes=16777216.0: an int"):
        ckptio.settings_for("s3://bucket/prefix",
                            ckptio.Options(storage={"s3": {"read_bytes": 16.0 * MiB}}))
    assert ckptio.Options(io_depth=8, verify=False, host_budget_bytes=None).io_depth == 8


def test_a_misspelt_environment_variable_is_named_once_with_the_right_one(monkeypatch, caplog):
    """CKPTIO_IO_DEPHT=16 was ignored without a word: the job ran on io_depth 4."""
    monkeypatch.setenv("CKPTIO_IO_DEPHT", "16")
    monkeypatch.setenv("CKPTIO_SHM_DIR", "/nowhere")  # another of ckptio's variables: not said
    with caplog.at_level("WARNING", logger="ckptio"):
        assert ckptio.Options.from_env().io_depth == 4
        ckptio.Options.from_env()
    said = [r.getMessage() for r in caplog.records if "CKPTIO_" in r.getMessage()]
    assert said == ["ckptio: the environment variable CKPTIO_IO_DEPHT names no option and is "
                    "ignored; did you mean CKPTIO_IO_DEPTH?"]


def test_a_newer_profile_file_is_said_as_such_not_as_corrupt(tmp_path, profile_file, capsys):
    write_raw(profile_file, {"version": profile.VERSION + 1, "profiles": {}})
    assert cli.main(["tune", "--show"]) == 1
    err = capsys.readouterr().err
    assert f"version {profile.VERSION + 1}, written by a newer ckptio" in err
    assert "ckptio tune DIR" not in err  # tune would refuse to rewrite it


def test_an_unusable_profile_file_replaced_by_tune_is_kept_aside(tmp_path, profile_file, caplog):
    """A hand edit with one stray comma: every profile in the file was lost to the next tune."""
    profile_file.parent.mkdir(parents=True)
    edited = b'{"version": 1, "profiles": {"xfs:7": {"io_depth": 8,}}}'
    profile_file.write_bytes(edited)
    with caplog.at_level("WARNING", logger="ckptio"):
        profile.store(make_profile(tmp_path))
    kept = profile_file.with_name(profile_file.name + ".unusable")
    assert kept.read_bytes() == edited
    assert any(str(kept) in r.getMessage() for r in caplog.records)
    assert profile.lookup(tmp_path) == make_profile(tmp_path)


def test_two_tunes_storing_at_once_keep_each_others_profiles(tmp_path, profile_file):
    """Two `ckptio tune` at once (two disks, or nodes sharing a home): each read the file,
    added its profile and replaced it, so the other's profile was lost."""
    code = ("import dataclasses, sys\nfrom ckptio.tuning import profile\n"
            "base = profile.Profile('posix', 'off', 1 << 20, 4, 'xfs', 0, 'x', 1.0, 1.0)\n"
            "for i in range(60):\n"
            "    profile.store(dataclasses.replace(base, device=int(sys.argv[1]) + i))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), profile.PATH_ENV: str(profile_file)}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(first)], env=env)
             for first in (1000, 2000)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    assert len(profile.read_all(profile_file)) == 120
    assert sorted(f.name for f in profile_file.parent.iterdir()) == ["profiles.json"]


def test_tune_of_a_file_says_to_give_a_directory(tmp_path, capsys):
    target = tmp_path / "weights.bin"
    target.write_bytes(b"mine")
    assert cli.main(["tune", str(target), *QUICK]) == 2
    assert f"{target} is a file; give a directory" in capsys.readouterr().err
    assert target.read_bytes() == b"mine"


def _threads(prefix: str, since: set[int]) -> int:
    return sum(t.name.startswith(prefix) and t.ident not in since for t in threading.enumerate())


@pytest.mark.skipif(io.uring_unavailable_reason() is not None, reason="no io_uring here")
def test_a_tuned_uring_profile_leaves_saves_behind_the_caller_on_posix_threads(tmp_path):
    """The tuner measures saves the caller waits for; its "uring" took over the async saves that
    io_backend "auto" (left so by the user) runs on the POSIX threads (docs/BENCH_LOOP.md)."""
    data = tmp_path / "data"
    data.mkdir()
    profile.store(make_profile(data, io_backend="uring", direct_io="off", io_depth=4))
    state = {f"w{i}": torch.randn(1 << 18) for i in range(4)}
    before = {t.ident for t in threading.enumerate() if t.ident is not None}
    ck = ckptio.Checkpointer()
    try:
        ck.async_save(state, data / "async").wait()
        assert _threads("ckptio-io", before) > 0
        assert _threads("ckptio-uring", before) == 0
        ck.save(state, data / "sync")  # a save waited for: the profile's io_uring
        assert _threads("ckptio-uring", before) > 0
    finally:
        ck.close()
    assert torch.equal(ckptio.load(data / "async")["w0"], state["w0"])


def test_a_field_of_a_newer_ckptio_neither_hides_the_file_nor_is_lost_by_a_tune(
        tmp_path, profile_file, caplog):
    """A newer ckptio (another venv sharing ~/.cache) adds a field within version 1, as
    S3Profile's io_depth and read_bytes once were: this one ignored the whole file (every
    profile), and its next tune wrote the file back without the newer one's fields."""
    data = tmp_path / "data"
    data.mkdir()
    mine = make_profile(data, io_depth=2)
    theirs = {**dataclasses.asdict(make_profile(data, device=7, fs_type="xfs")), "numa_node": 1}
    write_raw(profile_file, {"version": profile.VERSION, "profiles": {
        mine.key: dataclasses.asdict(mine), "xfs:7": theirs}})
    with caplog.at_level("WARNING", logger="ckptio"):
        assert profile.lookup(data) == mine
    assert any("['numa_node'] are unknown" in r.getMessage() for r in caplog.records)
    profile.store(make_profile(data, io_depth=8))
    kept = json.loads(profile_file.read_text())["profiles"]
    assert kept["xfs:7"] == theirs and kept[mine.key]["io_depth"] == 8
