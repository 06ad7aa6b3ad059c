"""`ckptio tune s3://bucket/prefix` against a real SeaweedFS server (issue 29, item 6): a tiny
study writes the endpoint's profile and leaves no object behind; saves and loads then run with
its requests in flight and part size; explicit options and use_profile=False win; a closed port,
a missing bucket and missing credentials fail within seconds as one line naming the fix; the
reads in flight of a load come from the study's reads alone (not the write side's choice); a
load reads a buffer with several GETs of the profile's read range (round four)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ckptio
from ckptio import Checkpointer, Options
from ckptio.storage.s3 import client as s3client
from ckptio.storage.s3.s3path import S3Path
from ckptio.storage.s3.settings import S3Settings
from ckptio.storage.s3.store import S3Store
from ckptio.tuning import profile

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20
FAST_S = 15.0  # "within seconds", with the interpreter's start on a loaded 2-core box


@pytest.fixture(autouse=True)
def _own_profiles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A profile file of this test's own: the endpoint's profile must not steer other tests."""
    path = tmp_path / "profiles.json"
    monkeypatch.setenv(profile.PATH_ENV, str(path))
    s3client._reached.clear()
    s3client.timeouts.reset()
    return path


def _tune(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptio", "tune", *args], capture_output=True,
                          text=True, timeout=300, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def _keys(s3_client, url: str) -> list[str]:
    where = S3Path.parse(url)
    listed = s3_client.list_objects_v2(Bucket=where.bucket, Prefix=where.dir_prefix)
    return [o["Key"] for o in listed.get("Contents", [])]


def _backend_of(ck: Checkpointer, url: str):
    _pool, files = ck.resources().files(S3Store(url, S3Settings.of(ck.options)))
    return _pool, files.backend


def test_tune_stores_the_endpoint_profile_saves_use_it_and_nothing_is_left(s3_env, s3_client):
    s3_client.put_object(Bucket="ckpt", Key=f"{s3_env[len('s3://ckpt/'):]}/keep", Body=b"mine")
    done = _tune(s3_env, "--total", "10M", "--sizes", "5M,10M", "--concurrency", "1,2",
                 "--reps", "1")
    assert done.returncode == 0, done.stderr
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    found = profile.lookup_s3(endpoint)
    assert found is not None and found.key == f"s3:{endpoint}", done.stdout
    assert (found.buffer_bytes, found.s3_concurrency) in {(5 * MiB, 1), (5 * MiB, 2),
                                                          (10 * MiB, 1), (10 * MiB, 2)}
    assert found.write_gbps > 0 and found.read_gbps > 0 and done.stdout.count(" in flight ") == 4
    assert _keys(s3_client, s3_env) == [S3Path.parse(s3_env).child("keep").key]
    shown = _tune("--show", s3_env)
    assert f"S3 {endpoint}: s3_concurrency={found.s3_concurrency}" in shown.stdout, shown.stdout

    ck = Checkpointer()
    state = {"w": torch.randn(6 * MiB // 4)}
    ck.save(state, f"{s3_env}/ck")
    pool, backend = _backend_of(ck, f"{s3_env}/ck")
    assert backend.settings.concurrency == found.s3_concurrency != Options().s3_concurrency
    assert backend.buffer_nbytes == pool.buffer_bytes == found.buffer_bytes != Options().buffer_bytes
    assert ck.resources().io_depth == found.option_fields()["io_depth"]
    assert backend.settings.readers == 2 * ck.resources().io_depth  # GETs a load keeps in flight
    assert backend.parts_uploaded_whole >= 1  # parts went up straight from tuned-size buffers
    assert torch.equal(ck.load(f"{s3_env}/ck")["w"], state["w"])
    ck.close()
    assert torch.equal(ckptio.load(f"{s3_env}/ck")["w"], state["w"])


def test_explicit_options_and_use_profile_false_win(s3_env):
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    profile.store(profile.S3Profile(endpoint, 3, 6 * MiB, "2026-11-24T00:00:00Z", 0.1, 0.2))
    state = {"w": torch.randn(1 << 20)}
    for options, expected in ((Options(), (3, 6 * MiB, 3)),
                              (Options(s3_concurrency=5, buffer_bytes=8 * MiB), (5, 8 * MiB, 3)),
                              (Options(io_depth=7), (3, 6 * MiB, 7)),
                              (Options(use_profile=False), (16, 16 * MiB, 4))):
        ck = Checkpointer(options)
        url = f"{s3_env}/c{options.s3_concurrency}-{options.io_depth}-{options.use_profile}"
        ck.save(state, url)
        _pool, backend = _backend_of(ck, url)
        got = (backend.settings.concurrency, backend.buffer_nbytes, ck.resources().io_depth)
        assert got == expected, options
        assert torch.equal(ck.load(url)["w"], state["w"])
        ck.close()


def _refused(target: str, *phrases: str, env: dict[str, str] | None = None) -> str:
    began = time.monotonic()
    done = _tune(target, "--total", "5M", "--sizes", "5M", "--concurrency", "1", "--reps", "1",
                 env=env)
    assert time.monotonic() - began < FAST_S, done.stderr
    line, = done.stderr.strip().splitlines()[-1:]
    assert done.returncode == 2 and line.startswith("ckptio: error: "), done.stderr
    for phrase in phrases:
        assert phrase in line, line
    assert not profile.profile_path().exists()
    return line


def test_a_closed_port_a_missing_bucket_and_no_credentials_fail_fast(s3_env, tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    _refused(s3_env, f"nothing answers at {closed}", "AWS_ENDPOINT_URL",
             env={"AWS_ENDPOINT_URL": closed})
    _refused("s3://no-such-bucket-29/p", "'no-such-bucket-29' does not exist", "create it")
    none = str(tmp_path / "none")
    _refused(s3_env, "no S3 credentials", "AWS_ACCESS_KEY_ID",
             env={"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "",
                  "AWS_SHARED_CREDENTIALS_FILE": none, "AWS_CONFIG_FILE": none,
                  "AWS_EC2_METADATA_DISABLED": "true"})


def test_bad_sizes_are_refused_before_any_request(s3_env):
    for args, phrase in ((("--sizes", "1M"), ">= 5M"), (("--reps", "0"), "--reps >= 1"),
                         (("--sizes", "abc"), "--sizes 8M,16M")):
        done = _tune(s3_env, *args)
        assert done.returncode == 2 and phrase in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_a_study_that_fails_half_way_removes_what_it_wrote(s3_env, s3_proxy, s3_client):
    """The second cell's read is refused (403, not retried): the error names it, and both
    cells' objects are gone; an object of the caller's under the prefix stays."""
    from ckptio.tuning import s3_tune

    where = S3Path.parse(s3_env)
    s3_client.put_object(Bucket=where.bucket, Key=where.child("keep").key, Body=b"mine")
    refused = s3_proxy.fail(403, "AccessDenied", times=None, op="GetObject", key=r"-c2-")
    settings = S3Settings(endpoint_url=s3_proxy.endpoint)
    with pytest.raises(ckptio.CkptError, match="access denied"):
        s3_tune.study(s3_env, settings, 10 * MiB, [5 * MiB], [1, 2], 1)
    assert refused.fired >= 1
    assert _keys(s3_client, s3_env) == [where.child("keep").key]


def test_the_read_depth_is_chosen_from_the_reads_not_the_writes(s3_env, s3_proxy, s3_client):
    """Behind the proxy, every GET waits 0.2 s (more in flight reads faster) and the parts of
    the 4-in-flight cell's upload wait 2 s (it writes slowest): the writes choose 1
    upload in flight, the reads 4 GETs in flight (io_depth 2), not the write side's 1. A load
    with that profile then keeps 4 GETs in flight, and reads another cell's object, not the
    one just written."""
    from ckptio.tuning import s3_tune

    gets = s3_proxy.delay(0.2, times=None, op="GetObject")
    s3_proxy.delay(2.0, times=None, op="UploadPart", key=r"-c4-")
    settings = S3Settings(endpoint_url=s3_proxy.endpoint)
    candidates = s3_tune.study(s3_env, settings, 20 * MiB, [5 * MiB], [1, 4], 1)
    by_depth = {c.io_depth: c for c in candidates}
    assert by_depth[4].read_gbps > 1.3 * by_depth[1].read_gbps, candidates
    assert by_depth[1].write_gbps > 3 * by_depth[4].write_gbps, candidates
    assert gets.fired == 2 * 4 * s3_tune.READS  # each cell read READS objects of 4 parts
    chosen = s3_tune.to_profile(candidates, s3_proxy.endpoint)
    assert (chosen.s3_concurrency, chosen.io_depth) == (1, 2), chosen
    assert chosen.read_gbps == round(by_depth[4].read_gbps, 3)
    assert not _keys(s3_client, s3_env)  # every object of the study is gone

    profile.store(chosen)
    state = {"w": torch.randn(12 * MiB // 4)}
    ck = Checkpointer(Options(s3_endpoint_url=s3_proxy.endpoint))
    ck.save(state, f"{s3_env}/ck")
    _pool, backend = _backend_of(ck, f"{s3_env}/ck")
    assert (backend.settings.concurrency, backend.settings.readers) == (1, 4)
    assert torch.equal(ck.load(f"{s3_env}/ck")["w"], state["w"])
    ck.close()


def test_reads_that_tie_keep_the_default_io_depth():
    """The read choice ignores the write column: a read column within TIE of the default's
    cell keeps Options().io_depth whatever the writes chose; a clearly faster one wins."""
    from ckptio.tuning import s3_tune
    from ckptio.tuning.tune import Candidate

    def cell(depth: int, write: float, read: float) -> Candidate:
        return Candidate("s3", "s3", 16 * MiB, depth, write, read)

    tie = [cell(2, 0.20, 1.31), cell(8, 0.15, 1.30), cell(16, 0.14, 1.32)]
    chosen = s3_tune.to_profile(tie, "http://x")
    assert (chosen.s3_concurrency, chosen.io_depth) == (2, Options().io_depth)
    assert chosen.option_fields()["io_depth"] == Options().io_depth != chosen.s3_concurrency
    faster = [cell(2, 0.20, 1.31), cell(8, 0.15, 1.30), cell(16, 0.14, 1.60)]
    assert s3_tune.to_profile(faster, "http://x").io_depth == 8


# ---------------------------------------------------------------- round four: the read range


def _data_gets(proxy) -> list[int]:
    """Bytes asked for by each ranged GET of a data file the proxy forwarded."""
    from ckptio.testing.s3wire import range_nbytes

    return [range_nbytes(r.range) or 0 for r in proxy.requests
            if r.op == "GetObject" and r.range and "/data-" in f"/{r.key}"]


def _load_through(proxy, url: str, state: dict[str, torch.Tensor], options: Options) -> list[int]:
    """Load ``url`` (saved from ``state``) through the proxy with ``options``: the data GETs."""
    proxy.reset_counters()
    ck = Checkpointer(options)
    try:
        got = ck.load(url)
    finally:
        ck.close()
    assert all(torch.equal(got[k], v) for k, v in state.items())
    return _data_gets(proxy)


def test_a_load_fills_one_buffer_with_several_ranged_gets(s3_env, s3_proxy):
    """8 MiB staging buffers, s3_read_bytes 2 MiB: every data GET asks for 2 MiB at most, each
    full buffer is 4 of them, and the state loads bitwise. Without the option a buffer is one
    GET of up to 8 MiB (what a load did before: the read range was the part size)."""
    state = {"a": torch.randn(16 * MiB // 4), "b": torch.randn(3 * MiB // 4)}
    url = f"{s3_env}/ranges"
    base = Options(s3_endpoint_url=s3_proxy.endpoint, buffer_bytes=8 * MiB, pool_bytes=32 * MiB,
                   use_profile=False)
    ckptio.save(state, url, options=base)
    split = _load_through(s3_proxy, url, state, dataclasses.replace(base, s3_read_bytes=2 * MiB))
    assert max(split) <= 2 * MiB and sum(split) >= 19 * MiB, split
    assert split.count(2 * MiB) >= 4 * 2, split  # two full 8 MiB buffers at least, 4 GETs each
    whole = _load_through(s3_proxy, url, state, base)
    assert max(whole) > 2 * MiB and len(whole) < len(split) / 2, whole


def test_a_failed_range_of_a_buffer_fails_the_load_naming_it(s3_env, s3_proxy):
    """One of a buffer's GETs refused (403, not retried): the load raises CkptError naming the
    bytes and the object, once its other GETs are done; the next load succeeds."""
    state = {"a": torch.randn(8 * MiB // 4)}
    url = f"{s3_env}/refused"
    options = Options(s3_endpoint_url=s3_proxy.endpoint, buffer_bytes=8 * MiB,
                      pool_bytes=32 * MiB, use_profile=False, s3_read_bytes=2 * MiB)
    ckptio.save(state, url, options=options)
    refused = s3_proxy.fail(403, "AccessDenied", times=1, op="GetObject", key=r"/data-")
    with pytest.raises(ckptio.CkptError, match=r"reading bytes \d+-\d+ of s3://.*access denied"):
        ckptio.load(url, options=options)
    assert refused.fired == 1
    assert torch.equal(ckptio.load(url, options=options)["a"], state["a"])


def test_a_profile_without_read_bytes_still_loads_one_get_per_buffer(s3_env, s3_proxy):
    """A profile file as rounds two and three wrote it (no read_bytes field) is read, applies
    its settings, and its loads read each buffer with one GET; a profile with read_bytes makes
    the same load read 2 MiB ranges."""
    import json

    endpoint = s3_proxy.endpoint
    old = {"endpoint": endpoint, "s3_concurrency": 2, "buffer_bytes": 8 * MiB,
           "measured_at": "2026-11-25T01:26:00+00:00", "write_gbps": 0.15, "read_gbps": 1.1,
           "io_depth": 1}
    profile.profile_path().write_text(json.dumps({"version": 1,
                                                  "profiles": {f"s3:{endpoint}": old}}))
    found = profile.lookup_s3(endpoint)
    assert found is not None and found.read_bytes == 0 and found.io_depth == 1
    state = {"a": torch.randn(16 * MiB // 4)}
    url = f"{s3_env}/old-profile"
    ckptio.save(state, url, options=Options(s3_endpoint_url=endpoint))
    options = Options(s3_endpoint_url=endpoint)
    whole = _load_through(s3_proxy, url, state, options)
    assert max(whole) == 8 * MiB, whole  # the profile's 8 MiB buffer, one GET each
    profile.store(dataclasses.replace(found, read_bytes=2 * MiB))
    assert max(_load_through(s3_proxy, url, state, options)) == 2 * MiB


def test_a_tuned_load_makes_one_client(s3_env, s3_proxy, monkeypatch):
    """The store (untuned settings) and the tuned backend (other requests in flight) share one
    boto3 client: a second cost 0.07-0.14 s of every fresh process's tuned load."""
    made: list[tuple[int, int]] = []
    make = s3client._make_client

    def counted(settings):
        made.append((settings.concurrency, settings.readers))
        return make(settings)

    endpoint = s3_proxy.endpoint
    profile.store(profile.S3Profile(endpoint, 2, 8 * MiB, "2026-11-25T00:00:00Z", 0.1, 0.2,
                                    io_depth=1, read_bytes=4 * MiB))
    state = {"a": torch.randn(MiB)}
    url = f"{s3_env}/one-client"
    ckptio.save(state, url, options=Options(s3_endpoint_url=endpoint))
    monkeypatch.setattr(s3client, "_clients", {})
    monkeypatch.setattr(s3client, "_make_client", counted)
    assert torch.equal(ckptio.load(url, options=Options(s3_endpoint_url=endpoint))["a"],
                       state["a"])
    assert made == [(Options().s3_concurrency, 2 * Options().io_depth)], made
    ck = Checkpointer(Options(s3_endpoint_url=endpoint))
    _pool, backend = _backend_of(ck, url)
    assert (backend.settings.concurrency, backend.settings.readers,
            backend.settings.read_bytes) == (2, 2, 4 * MiB)
    ck.close()


def test_bad_read_bytes_are_refused():
    for bad in (1000, -4096):
        with pytest.raises(ckptio.CkptError, match=f"s3_read_bytes={bad}"):
            Options(s3_read_bytes=bad)
    with pytest.raises(profile.ProfileError, match="read_bytes=4097"):
        profile.store(profile.S3Profile("http://x", 2, 8 * MiB, "t", 0.1, 0.2, 1, 4097))


def _cell(part_mib: int, depth: int, write: float, read: float):
    from ckptio.tuning.tune import Candidate

    return Candidate("s3", "s3", part_mib * MiB, depth, write, read)


def test_the_read_range_is_chosen_from_the_read_column():
    """Writes choose 2 x 64 MiB parts; the reads' best cell, 4 GETs of 16 MiB, is well over
    the default's (8 GETs of 16 MiB): the profile reads 16 MiB ranges, 4 in flight, into its
    64 MiB buffers. A read cell larger than the buffer is never chosen."""
    from ckptio.tuning import s3_tune

    study = [_cell(64, 2, 0.184, 0.70), _cell(64, 4, 0.150, 0.72), _cell(16, 4, 0.120, 1.30),
             _cell(16, 8, 0.110, 1.00), _cell(32, 4, 0.100, 0.90)]
    chosen = s3_tune.to_profile(study, "http://x")
    assert (chosen.s3_concurrency, chosen.buffer_bytes) == (2, 64 * MiB), chosen
    assert (chosen.read_bytes, chosen.io_depth, chosen.read_gbps) == (16 * MiB, 2, 1.3), chosen
    assert chosen.option_fields()["s3_read_bytes"] == 16 * MiB
    big_reads = [_cell(16, 2, 0.30, 0.80), _cell(16, 8, 0.20, 0.80), _cell(64, 2, 0.10, 1.60)]
    small = s3_tune.to_profile(big_reads, "http://x")
    assert (small.buffer_bytes, small.read_bytes, small.io_depth) == (16 * MiB, 16 * MiB, 4)


def test_reads_within_ten_percent_of_the_default_keep_the_default_reads():
    """READ_TIE: a read cell 7.7 % faster than the default's (a margin the write side's 3 %
    would take) is a tie: loads read like the defaults (16 MiB GETs, io_depth 4) under the
    64 MiB parts the writes chose; 15 % faster wins."""
    from ckptio.tuning import s3_tune

    assert s3_tune.READ_TIE >= 0.10
    study = [_cell(64, 2, 0.184, 1.40), _cell(16, 8, 0.150, 1.30), _cell(16, 2, 0.120, 1.20)]
    tie = s3_tune.to_profile(study, "http://x")
    assert (tie.buffer_bytes, tie.read_bytes, tie.io_depth) == (64 * MiB, 16 * MiB, 4), tie
    assert tie.read_gbps == 1.3
    study[0] = _cell(64, 2, 0.184, 1.50)
    won = s3_tune.to_profile(study, "http://x")
    assert (won.read_bytes, won.io_depth) == (64 * MiB, 1), won
