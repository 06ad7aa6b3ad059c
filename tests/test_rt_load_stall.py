"""A load or restore whose storage stops answering, faults from outside the process: a FUSE file
system (ckptio.testing.faultfs) whose read (or the manifest's) blocks in the kernel under
ckptio.load and CheckpointManager.restore, and a fault proxy (ckptio.testing.s3proxy) that
black-holes the data GETs of a load or restore from S3.

What each test checks: a stalled read is warned about on the ``ckptio`` logger as a save's
write is (the rank, the file, the seconds; repeated while it lasts, one line when it goes on)
within a bounded time of Options.io_stall_warn_s, and the load then completes bit for bit; a
black-holed GET ends in a CkptError within the retry deadline and a slack, naming the object
and the setting to raise, with no older step restored in its place.

The FUSE tests are skipped only where /dev/fuse is unusable, the S3 ones where boto3 or the
``weed`` binary is missing.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptio
from ckptio.testing.faultfs import FaultFS, fuse_unusable
from ckptio.testing.rank_processes import run_ranks
from ckptio.testing.s3proxy import FaultProxy

from s3.conftest import s3_env, s3_live, s3_proxy, s3_server  # noqa: F401 - the S3 fixtures
from s3.test_silent_s3 import DEADLINE_S, SLACK_S
from stall_cases import BOUND_S, WARN_S, Behind, warned

fuse = pytest.mark.skipif(fuse_unusable() is not None, reason=str(fuse_unusable()))

MiB = 1 << 20


def _state(value: float, n: int = 4096) -> dict[str, torch.Tensor]:
    return {"w": torch.arange(float(n)) + value, "b": torch.full((16,), value)}


def _zeros(n: int = 4096) -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(n), "b": torch.zeros(16)}


def _assert_state(got: dict[str, torch.Tensor], value: float, n: int = 4096) -> None:
    want = _state(value, n)
    assert all(torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want)


def _stalled_then_released(fs: FaultFS, caplog: pytest.LogCaptureFixture, behind: Behind,
                           file: str, location: str) -> None:
    """While ``behind``'s load waits on the stalled read of ``file``: warned about within a
    bounded time, naming the rank, the load's location, the file and the seconds, again while
    it lasts; then released, one line says the load goes on."""
    try:
        assert fs.wait_stalled(BOUND_S).endswith(file)
        began = time.monotonic()
        # the load's own warnings (a slow fsync of the saves before it may be warned about too)
        said = warned(caplog, f"the load from {location} has made no progress", count=2)
        assert len(said) >= 2, f"no repeated stall warning within {BOUND_S} s: {said}"
        assert time.monotonic() - began < BOUND_S
        first = said[0]
        assert first.startswith(f"ckptio: rank 0: the load from {location} has made no "
                                "progress for "), first
        assert f"the read of {location}/{file} has not returned" in first, first
        assert f"Options.io_stall_warn_s={WARN_S:g}" in first, first
        assert behind.thread.is_alive()  # it waits: nothing is given up, nothing half-filled
    finally:  # (a failed check lets the load go on too: the test fails, it does not hang)
        fs.release()
    went_on = warned(caplog, "goes on")
    assert went_on and went_on[0].startswith(f"ckptio: rank 0: the load from {location} goes "
                                             "on (its I/O had made no progress for "), went_on


# ------------------------------------------------------------------------------ ckptio.load


@fuse
@pytest.mark.parametrize("file", ["data", "manifest"])
def test_a_load_whose_read_hangs_is_warned_about_naming_the_file_then_completes_bitwise(
        fs: FaultFS, caplog: pytest.LogCaptureFixture, file: str) -> None:
    """ckptio.load from the mount, its data file's read (or the manifest's) blocked in the
    kernel: a warning within a bounded time naming rank 0, the checkpoint, the file and the
    seconds, repeated while it lasts (before: nothing said, however long); released, the load
    completes bit for bit and one line says it went on."""
    caplog.set_level("WARNING", logger="ckptio")
    path = fs.mountpoint / "ck"
    ckptio.save(_state(1.0), path)
    name = "manifest.json" if file == "manifest" else next(
        p.name for p in path.iterdir() if p.name.startswith("data-"))
    fs.stall("read", f"^/ck/{name}$")
    state = _zeros()
    options = ckptio.Options(io_stall_warn_s=WARN_S)
    behind = Behind(lambda: ckptio.load(path, state, options=options))
    _stalled_then_released(fs, caplog, behind, name, str(path))
    assert set(behind.joined().loaded) == {"w", "b"}
    _assert_state(state, 1.0)


@fuse
def test_a_load_with_no_stall_and_warnings_off_says_nothing(
        fs: FaultFS, caplog: pytest.LogCaptureFixture) -> None:
    """A load that is not stalled says nothing; io_stall_warn_s=0 keeps a stalled one quiet."""
    caplog.set_level("WARNING", logger="ckptio")
    path = fs.mountpoint / "ck"
    ckptio.save(_state(2.0), path)
    state = _zeros()
    ckptio.load(path, state, options=ckptio.Options(io_stall_warn_s=WARN_S))
    _assert_state(state, 2.0)
    fs.stall("read", r"^/ck/data-")
    state = _zeros()
    behind = Behind(lambda: ckptio.load(path, state, options=ckptio.Options(io_stall_warn_s=0)))
    fs.wait_stalled(BOUND_S)
    time.sleep(4 * WARN_S)
    fs.release()
    behind.joined()
    _assert_state(state, 2.0)
    assert not [r for r in caplog.records if r.name == "ckptio"], caplog.text


def ranks_save(rank: int, world: int, path: str) -> None:
    ckptio.save({"mine": torch.full((4096,), float(rank + 1))}, path)


def ranks_load(rank: int, world: int, path: str) -> dict[str, Any]:
    """Load this rank's tensor, the ``ckptio`` warnings said meanwhile kept."""
    said: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("ckptio").addHandler(handler)
    state = {"mine": torch.zeros(4096)}
    ckptio.load(path, state, options=ckptio.Options(io_stall_warn_s=WARN_S))
    return {"same": torch.equal(state["mine"], torch.full((4096,), float(rank + 1))),
            "said": said}


@fuse
def test_two_ranks_one_of_whose_reads_hangs_name_that_rank_and_its_file(fs: FaultFS) -> None:
    """Two gloo ranks load together; rank 1's data file read blocks for a while. Rank 1 warns,
    naming rank 1 and its file (rank 0, waiting for rank 1 in the load's collective, has no
    I/O in flight and says nothing of its own I/O); released, both load bit for bit."""
    path = str(fs.mountpoint / "ck")
    run_ranks(2, ranks_save, path, timeout_s=120)
    fs.stall("read", r"^/ck/data-.*-r00001-")
    releaser = threading.Thread(target=lambda: (fs.wait_stalled(60), time.sleep(8 * WARN_S),
                                                fs.release()), daemon=True)
    releaser.start()
    try:
        out = run_ranks(2, ranks_load, path, timeout_s=120)
    finally:
        fs.release()
    assert [o["same"] for o in out] == [True, True], out
    assert not [m for m in out[0]["said"] if "made no progress" in m], out[0]["said"]
    stalls = [m for m in out[1]["said"] if "made no progress" in m]
    assert stalls and stalls[0].startswith(f"ckptio: rank 1: the load from {path} has made no "
                                           "progress"), out[1]["said"]
    assert f"the read of {path}/data-" in stalls[0] and "-r00001-" in stalls[0], stalls[0]


# ------------------------------------------------------------------ CheckpointManager.restore


@fuse
def test_a_manager_restore_whose_read_hangs_is_warned_about_then_restores_the_newest_step(
        fs: FaultFS, caplog: pytest.LogCaptureFixture) -> None:
    """A run on the mount with steps 1 and 2; a new manager's restore, step 2's data read
    blocked: warned about naming step 2's data file (before: silence); released, it restores
    step 2 bit for bit (not step 1)."""
    caplog.set_level("WARNING", logger="ckptio")
    run = fs.mountpoint / "run"
    options = ckptio.Options(io_stall_warn_s=WARN_S)
    with ckptio.CheckpointManager(run, options=options) as mgr:
        for step in (1, 2):
            mgr.save(step, _state(float(step)))
    name = next(p.name for p in (run / "step-2").iterdir() if p.name.startswith("data-"))
    fs.stall("read", f"^/run/step-2/{name}$")
    state = _zeros()
    with ckptio.CheckpointManager(run, options=options) as again:
        behind = Behind(lambda: again.restore(state))
        _stalled_then_released(fs, caplog, behind, name, str(run / "step-2"))
        assert behind.joined() == 2
    _assert_state(state, 2.0)


# --------------------------------------------------------------------- S3: a black-holed GET


def _s3_options(endpoint: str) -> ckptio.Options:
    return ckptio.Options(buffer_bytes=5 * MiB, pool_bytes=20 * MiB, s3_endpoint_url=endpoint,
                          s3_retry_deadline_s=DEADLINE_S, s3_lock_lease_s=2.0)


def _in_time(began: float) -> None:
    took = time.monotonic() - began
    assert took < DEADLINE_S + SLACK_S, f"took {took:.1f} s"


def _assert_names_the_data_get(said: str, where: str, proxy: FaultProxy) -> None:
    assert f"{where}/data-" in said and proxy.endpoint in said, said
    assert "s3_retry_deadline_s" in said, said


def test_a_load_from_s3_whose_data_get_is_black_holed_fails_in_time_naming_the_key(
        s3_env: str, s3_proxy: FaultProxy) -> None:  # noqa: F811 - the S3 fixtures
    """ckptio.load from S3, the manifest read but every GET of a data file black-holed: a
    CkptError within the retry deadline and a slack, naming the data object, the endpoint and
    the setting to raise, and saying the state may be partly filled; healed, the same call
    loads bit for bit."""
    url, options, n = f"{s3_env}/ck", _s3_options(s3_proxy.endpoint), 3 * MiB
    ckptio.save(_state(3.0, n), url, options=options)
    s3_proxy.black_hole(op="GetObject", key=r"/data-", times=None)
    state, began = _zeros(n), time.monotonic()
    with pytest.raises(ckptio.CkptError) as caught:
        ckptio.load(url, state, options=options)
    _in_time(began)
    _assert_names_the_data_get(str(caught.value), url, s3_proxy)
    assert str(caught.value).startswith("load() stopped on a storage error; the state it fills "
                                        "in place may hold some"), caught.value
    s3_proxy.clear()
    ckptio.load(url, state, options=options)
    _assert_state(state, 3.0, n)


def test_a_restore_from_an_s3_tier_whose_data_get_is_black_holed_fails_in_time_not_older(
        s3_env: str, s3_proxy: FaultProxy) -> None:  # noqa: F811 - the S3 fixtures
    """A run on S3 with steps 1 and 2; a new manager restores while step 2's data GETs are
    black-holed: a CkptError within the retry deadline and a slack naming step 2's data object
    and the setting to raise; step 1 is not restored in its place (an unreachable object is
    not a damaged step). Healed, step 2 is restored bit for bit."""
    url, options, n = f"{s3_env}/run", _s3_options(s3_proxy.endpoint), 3 * MiB
    with ckptio.CheckpointManager(url, options=options) as mgr:
        for step in (1, 2):
            mgr.save(step, _state(float(step), n))
    s3_proxy.black_hole(op="GetObject", key=r"/step-2/data-", times=None)
    state, began = _zeros(n), time.monotonic()
    with ckptio.CheckpointManager(url, options=options) as again:
        with pytest.raises(ckptio.CkptError) as caught:
            again.restore(state)
        _in_time(began)
        _assert_names_the_data_get(str(caught.value), f"{url}/step-2", s3_proxy)
        assert str(caught.value).startswith("restore() stopped on a storage error; the state "
                                            "it fills in place may hold some"), caught.value
        assert "load() stopped" not in str(caught.value), caught.value
        s3_proxy.clear()
        assert again.restore(state) == 2
    _assert_state(state, 2.0, n)


@fuse
def test_a_drain_whose_read_of_the_first_tier_hangs_is_warned_about_naming_the_file(
        fs: FaultFS, caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    """A first tier on the mount, a second on a plain directory: the drain's read of step 1's
    data file in the first tier blocks. Warned about, naming that file, as the drain's writes
    are (before: only its writes, fsyncs and commit were watched); released, the second tier
    holds step 1, bit for bit."""
    caplog.set_level("WARNING", logger="ckptio")
    first, second = fs.mountpoint / "run", tmp_path / "second"
    options = ckptio.Options(io_stall_warn_s=WARN_S)
    fs.stall("read", r"^/run/step-1/data-")
    with ckptio.CheckpointManager(tiers=[ckptio.Tier(str(first)), ckptio.Tier(str(second))],
                                  options=options) as mgr:
        mgr.save(1, _state(1.0))
        try:
            assert "/run/step-1/data-" in fs.wait_stalled(BOUND_S)
            said = warned(caplog, f"the read of {first}/step-1/data-")  # not the save's fsync
            assert said and "has made no progress" in said[0], said
        finally:
            fs.release()
        assert mgr.drained(timeout=BOUND_S)
    state = _zeros()
    ckptio.load(second / "step-1", state)
    _assert_state(state, 1.0)


@fuse
def test_a_load_in_place_stopped_by_an_io_error_says_the_state_is_partly_filled(
        fs: FaultFS) -> None:
    """ckptio.load in place whose third data file's read fails (EIO) after two were loaded:
    the StorageIOError names the file and says the state may hold some of the checkpoint's
    tensors (before: only the failed read, as if nothing had changed, as a manager's restore
    said until it said so too); loaded again once the storage reads, the state is the
    checkpoint's, bit for bit. A manager's restore says its own words, not both."""
    path = fs.mountpoint / "ck"
    small = ckptio.Options(max_file_bytes=1 << 20, buffer_bytes=1 << 20, pool_bytes=4 << 20)
    saved = {f"k{i}": torch.full((1 << 18,), float(i + 1)) for i in range(8)}  # a file each
    ckptio.save(saved, path, options=small)
    fs.fail("read", r"^/ck/data-", nth=3, times=100)
    state = {k: torch.zeros_like(v) for k, v in saved.items()}
    with pytest.raises(ckptio.StorageIOError, match=r"(?s)^load\(\) stopped on a storage error; "
                       r"the state it fills in place may hold some of the checkpoint's tensors"
                       r".*load again before using it.*/ck/data-.*Input/output") as caught:
        ckptio.load(path, state, options=small)
    assert "restore()" not in str(caught.value)
    assert any(state[k].abs().sum() > 0 for k in state)  # what the message warns of
    fs.clear()
    ckptio.load(path, state, options=small)
    assert all(torch.equal(state[k], saved[k]) for k in saved)
    fresh = fs.mountpoint / "run"
    with ckptio.CheckpointManager(fresh, options=small) as mgr:
        mgr.save(1, saved)
    fs.fail("read", r"^/run/step-1/data-", nth=3, times=100)
    with ckptio.CheckpointManager(fresh, options=small) as mgr:
        with pytest.raises(ckptio.StorageIOError, match=r"^restore\(\) stopped") as caught:
            mgr.restore(state)
    assert "load() stopped" not in str(caught.value), caught.value


EXITS = r"""
import sys, threading, time, torch, ckptio
state = {"w": torch.zeros(4096), "b": torch.zeros(16)}
options = ckptio.Options(io_stall_warn_s=0.1)
threading.Thread(target=ckptio.load, args=(sys.argv[1], state), kwargs={"options": options},
                 daemon=True).start()
time.sleep(1.0)
print("main ends", flush=True)
"""


@fuse
def test_a_process_whose_load_on_a_daemon_thread_hangs_still_exits(fs: FaultFS) -> None:
    """A script loads on a daemon thread; the read hangs; the main thread ends. The process
    exits at once, as it did before loads were watched (the watch of its I/O does not hold the
    interpreter's exit for a load, as it does for a save in flight)."""
    path = fs.mountpoint / "ck"
    ckptio.save(_state(1.0), path)
    fs.stall("read", r"^/ck/data-")
    child = subprocess.Popen([sys.executable, "-c", EXITS, str(path)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        fs.wait_stalled(BOUND_S)
        out, err = child.communicate(timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        pytest.fail("the process did not exit while its load's read hung")
    finally:
        fs.release()
    assert child.returncode == 0 and out == "main ends\n", (child.returncode, out, err)
    assert "has made no progress" in err, err  # warned about, then not waited for
