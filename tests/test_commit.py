"""The commit protocol: a checkpoint exists only once its manifest is committed, a failed or
killed save never harms the checkpoint already at that path, and leftovers are cleaned later.

(1) kill -9 in the middle of a save (a real subprocess, SIGKILLed while its data file is being
    written): into a directory holding checkpoint A -> A loads bitwise; into a new directory ->
    refused as incomplete; a later save into the killed directory removes the partial files.
(2) an I/O fault (ckptio.testing.faults) at any write, the preallocation of a later file, or the
    fsync: save raises an error naming the file, nothing is committed, the old checkpoint loads
    bitwise, no new file is left, every staging buffer and file handle is released, and the same
    Checkpointer then saves successfully. Faults on load release everything too.
(3) while a save over an existing checkpoint runs, the old manifest and all its files stay.
(4) the order of durable steps: data fsynced -> manifest temp fsynced -> rename -> directory
    fsynced; afterwards manifest.json exists and no .manifest-*.tmp remains.
(5) a failed save whose cleanup fails too (unlink refused) raises the save's own error, with the
    cleanup's failure as a note and a log line; the old checkpoint loads.
(6) messages: a one-process commit error names no coordinator; a path that is a file is refused
    as such before mkdir.
(7) a directory without manifest.json is described as what it is (DCP, torch.save files,
    safetensors, a parent of checkpoints, a ckptio save interrupted, empty or unknown), and no
    message advises deleting it.
(Saves into one path from several processes: test_concurrent.py.)
"""

from __future__ import annotations

import errno
import gc
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch

import ckptio
from ckptio.storage.local.local_store import LocalStore
from ckptio import (CheckpointNotFoundError, Checkpointer, IncompleteCheckpointError, Options, StorageIOError)
from ckptio.testing.faults import FaultyBackend, inject

MiB = 1 << 20

# State A is built by the same code in the killed child and in this process.
A_SRC = """
def state_a():
    g = torch.Generator().manual_seed(1234)
    return {"model": {"w": torch.randn(256, 256, generator=g),
                      "b": torch.randn(256, generator=g, dtype=torch.float64)},
            "emb": torch.randn(3 << 18, generator=g), "step": 41, "name": "A"}
"""
_ns: dict = {"torch": torch}
exec(A_SRC, _ns)
state_a = _ns["state_a"]

CHILD = r"""
import sys, torch, ckptio
path, save_a, a_src = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
# small buffers, one write in flight: saving B takes long enough to be killed in the middle
ck = ckptio.Checkpointer(ckptio.Options(buffer_bytes=1 << 20, pool_bytes=2 << 20, io_depth=1))
if save_a:
    exec(a_src)
    ck.save(state_a(), path)
big = {f"layer{i}": torch.full((4 << 20,), float(i)) for i in range(24)}  # 384 MiB
print("saving-B", flush=True)
ck.save(big, path)
print("saved-B", flush=True)
"""


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same(got, want, where="state") -> None:
    """Equal structure, equal values; tensors bitwise (dtype and shape too)."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: {type(got).__name__}, not a tensor"
        assert got.dtype == want.dtype and got.shape == want.shape, f"{where}: dtype/shape differ"
        assert torch.equal(_bits(got), _bits(want)), f"{where}: bytes differ"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), f"{where}: keys differ"
        for k in want:
            assert_same(got[k], want[k], f"{where}.{k}")
    else:
        assert type(got) is type(want) and got == want, f"{where}: {got!r} != {want!r}"


def _listing(path) -> set[str]:
    return set(os.listdir(path))


def _manifest_bytes(path) -> bytes:
    with open(os.path.join(path, "manifest.json"), "rb") as f:
        return f.read()


def _wchar(pid: int) -> int:
    """The bytes ``pid`` has sent to storage (/proc/<pid>/io write_bytes: counted for io_uring's
    writes too, which wchar, the bytes of write system calls, never sees)."""
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            if line.startswith("write_bytes:"):
                return int(line.split()[1])
    raise RuntimeError("no write_bytes")


def _close(ck: Checkpointer) -> None:
    gc.collect()  # errors kept by pytest.raises still view staging buffers (see test_corruption)
    ck.close()


# -- (1) kill -9 in the middle of a save -----------------------------------------------------

def _kill_mid_save(path, *, save_a: bool) -> tuple[set[str], bytes | None]:
    """Run the child; SIGKILL it once B's first data file exists and the child has written
    16 MiB more. -> (names of B's partial files, manifest bytes when B started)."""
    try:
        _wchar(os.getpid())
    except (OSError, RuntimeError):
        pytest.skip("/proc/<pid>/io is not readable here")
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(path), "1" if save_a else "0", A_SRC],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        if line.strip() != "saving-B":
            proc.wait(60)
            pytest.fail(f"child failed before saving B: {line!r} {proc.stderr.read()}")
        manifest_before = _manifest_bytes(path) if save_a else None
        # B's data files: those A's manifest does not name (B may have created one already)
        before = ({f["name"] for f in json.loads(manifest_before.split(b"\n", 1)[1])["files"]}
                  if save_a else set())
        deadline = time.monotonic() + 300  # a guard against hanging, not a timing check
        partial: set[str] = set()
        while not partial:
            assert proc.poll() is None, "the child finished before B's data file appeared"
            assert time.monotonic() < deadline
            if os.path.isdir(path):
                partial = {n for n in _listing(path) if n.startswith("data-")} - before
            time.sleep(0.001)
        start = _wchar(proc.pid)
        while _wchar(proc.pid) < start + 16 * MiB:
            assert proc.poll() is None, "the child finished B before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.001)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(60)
        out = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"child exit status {proc.returncode}"
    assert "saved-B" not in out
    assert partial <= _listing(path), "B's partial data files should still be on disk"
    return partial, manifest_before


def test_kill_during_save_over_checkpoint_keeps_it(tmp_path):
    path = tmp_path / "ckpt"
    partial, manifest_before = _kill_mid_save(path, save_a=True)

    assert _manifest_bytes(path) == manifest_before, "the committed manifest changed"
    ck = Checkpointer(Options(buffer_bytes=MiB, pool_bytes=4 * MiB))
    try:
        assert_same(ck.load(path), state_a())
        assert ck.verify(path) > 0
        dest = state_a()
        for t in (dest["model"]["w"], dest["model"]["b"], dest["emb"]):
            t.zero_()
        ck.load(path, dest)
        assert_same(dest, state_a())

        # a later successful save cleans B's partial files (and A's, now superseded)
        c = {"c": torch.arange(1000, dtype=torch.int64), "step": 42}
        result = ck.save(c, path)
        assert not (partial & set(result.files))
    finally:
        _close(ck)  # joins the background cleanup
    assert _listing(path) == set(result.files) | {"manifest.json"}
    assert_same(ckptio.load(path), c)


@pytest.mark.parametrize("overwrite, level", [(None, logging.WARNING), (True, logging.INFO)])
def test_a_save_over_a_committed_checkpoint_is_said_as_loudly_as_the_caller_left_it(
        tmp_path, caplog, overwrite, level):
    """Left to the default, replacing a committed checkpoint is a warning; asked for
    (overwrite=True: Lightning's last.ckpt every epoch) it is logged at INFO, not warned;
    overwrite=False refuses and keeps it."""
    path = str(tmp_path / "ckpt")
    with Checkpointer() as ck:  # closed at the end, as a CheckpointManager is
        ck.save({"w": torch.zeros(4)}, path)
        with caplog.at_level(logging.INFO, logger="ckptio"):
            kwargs = {} if overwrite is None else {"overwrite": overwrite}
            handle = ck.async_save({"w": torch.ones(4)}, path, **kwargs)
            handle.wait()
        said = [r.levelno for r in caplog.records if "replaced the checkpoint" in r.getMessage()]
        assert said == [level]
        with pytest.raises(ckptio.CheckpointLockedError, match="overwrite=False"):
            ck.save({"w": torch.full((4,), 2.0)}, path, overwrite=False)
        ck.async_save({"w": torch.full((4,), 3.0)}, str(tmp_path / "other"))
    assert ckptio.load(tmp_path / "other")["w"][0] == 3.0  # the exit waited for it
    assert torch.equal(ckptio.load(path)["w"], torch.ones(4))


def test_kill_during_first_save_leaves_incomplete(tmp_path):
    path = tmp_path / "new"
    partial, _ = _kill_mid_save(path, save_a=False)

    assert not os.path.exists(os.path.join(path, "manifest.json"))
    ck = Checkpointer(Options(buffer_bytes=MiB, pool_bytes=4 * MiB))
    try:
        for call in (ck.load, ck.verify, ckptio.load):
            with pytest.raises(IncompleteCheckpointError) as info:
                call(path)
            assert "interrupted" in str(info.value) and str(path) in str(info.value)

        c = {"c": torch.randn(300, 300)}
        result = ck.save(c, path)
        other = ck.save({"x": torch.ones(3)}, tmp_path / "other")  # joins the cleanup of `path`
        assert _listing(path) == set(result.files) | {"manifest.json"}, (
            "partial files of the killed save were not removed after the next save")
        assert_same(ck.load(path), c)
        assert other.files
    finally:
        _close(ck)


# -- (2) injected I/O faults -----------------------------------------------------------------

FAULT_OPTIONS = Options(buffer_bytes=MiB, pool_bytes=4 * MiB, max_file_bytes=3 * MiB)


def state_b() -> dict:
    g = torch.Generator().manual_seed(99)
    return {"layers": {f"{i}": torch.randn(MiB // 4, generator=g) for i in range(8)},
            "small": torch.arange(100, dtype=torch.int16), "step": 2, "name": "B"}


@pytest.fixture(scope="module")
def b_profile(tmp_path_factory) -> dict:
    """How saving state_b with FAULT_OPTIONS calls the backend (counts and the order of files)."""
    ck = Checkpointer(FAULT_OPTIONS)
    counting = inject(ck)
    writes: list[str] = []
    real = counting.submit_write
    counting.submit_write = lambda fh, off, data: (writes.append(fh.path), real(fh, off, data))[1]
    result = ck.save(state_b(), tmp_path_factory.mktemp("profile") / "b")
    _close(ck)
    files = list(dict.fromkeys(writes))
    assert len(files) >= 3 and len(files) == len(result.files)
    last_of_file = [i + 1 for i in range(len(writes)) if i + 1 == len(writes) or writes[i + 1] != writes[i]]
    return {"writes": writes, "nwrites": len(writes), "nfiles": len(files),
            "last_of_first_file": last_of_file[0]}


def _commit_a(tmp_path) -> tuple[Checkpointer, str, bytes, set[str]]:
    """A Checkpointer and checkpoint A committed at a path, with its manifest and listing."""
    ck = Checkpointer(FAULT_OPTIONS)
    path = tmp_path / "ckpt"
    ck.save(state_a(), path)
    ck._finish_cleanup()
    return ck, path, _manifest_bytes(path), _listing(path)


@pytest.fixture
def committed(tmp_path):
    ck, path, manifest_a, listing_a = _commit_a(tmp_path)
    yield ck, path, manifest_a, listing_a
    _close(ck)


def _fault_cases(profile: dict) -> dict[str, dict]:
    n = profile["nwrites"]
    return {
        "first-write": {"fail_write": 1},
        "middle-write": {"fail_write": n // 2},
        "last-write": {"fail_write": n},
        "last-write-of-a-file": {"fail_write": profile["last_of_first_file"]},
        "enospc-write": {"fail_write": 2, "error": "enospc"},
        "enospc-preallocating-2nd-file": {"fail_open_write": 2, "error": "enospc"},
        "fsync-of-last-file": {"fail_close": profile["nfiles"]},
        "raise-in-submit-first-write": {"fail_write": 1, "raise_in_submit": True},
    }


FAULTS = ["first-write", "middle-write", "last-write", "last-write-of-a-file", "enospc-write",
          "enospc-preallocating-2nd-file", "fsync-of-last-file", "raise-in-submit-first-write"]


@pytest.mark.parametrize("fault", FAULTS)
def test_failing_save_commits_nothing(committed, b_profile, fault):
    ck, path, manifest_a, listing_a = committed
    faulty = inject(ck, **_fault_cases(b_profile)[fault])

    with pytest.raises(StorageIOError) as info:
        ck.save(state_b(), path)
    assert len(faulty.injected) == 1, "the fault was never reached"
    failed_file = faulty.injected[0].split(" ", 2)[2]
    assert failed_file in str(info.value), f"the error must name {failed_file}: {info.value}"
    if "enospc" in fault:
        assert "No space left on device" in str(info.value)

    assert _manifest_bytes(path) == manifest_a, "the failed save changed the committed manifest"
    assert _listing(path) == listing_a, "the failed save left files behind (or removed A's)"
    pool, _files = ck.resources().files(LocalStore("."))
    assert pool.idle(), "a staging buffer was not handed back after the failure"
    assert not faulty.open_handles, f"file handles left open: {list(faulty.open_handles)}"
    assert_same(ck.load(path), state_a())

    result = ck.save(state_b(), path)  # the same Checkpointer recovers (the fault fired once)
    assert_same(ck.load(path), state_b())
    ck._finish_cleanup()
    assert _listing(path) == set(result.files) | {"manifest.json"}
    assert pool.idle() and not faulty.open_handles


def test_failing_save_raise_in_submit_of_last_write_of_a_file(tmp_path, b_profile):
    ck, path, manifest_a, listing_a = _commit_a(tmp_path)  # not closed: the pool may be short
    faulty = inject(ck, fail_write=b_profile["last_of_first_file"], raise_in_submit=True)
    with pytest.raises(StorageIOError):
        ck.save(state_b(), path)
    assert faulty.injected
    assert _manifest_bytes(path) == manifest_a and _listing(path) == listing_a
    pool, _files = ck.resources().files(LocalStore("."))
    assert pool.idle(), "the buffer of the failed submit was never handed back"


def test_failing_save_into_new_directory_leaves_no_checkpoint(tmp_path, b_profile):
    ck = Checkpointer(FAULT_OPTIONS)
    try:
        inject(ck, fail_write=b_profile["nwrites"] // 2)
        path = tmp_path / "fresh"
        with pytest.raises(StorageIOError):
            ck.save(state_b(), path)
        if os.path.exists(path):  # removing the directory it created is allowed, not required
            assert not [n for n in os.listdir(path) if n.startswith(("data-", ".manifest-"))]
        with pytest.raises((IncompleteCheckpointError, CheckpointNotFoundError)):
            ck.load(path)
    finally:
        _close(ck)


@pytest.mark.parametrize("fault", [{"fail_read": 1}, {"fail_read": 3}, {"fail_read": 2, "error": 5}])
def test_failing_load_releases_everything(committed, fault):
    """A read error on load: StorageIOError naming the file; no buffer or handle kept."""
    ck, path, _manifest_a, _listing_a = committed
    faulty = inject(ck, **fault)
    with pytest.raises(StorageIOError) as info:
        ck.load(path)
    assert faulty.injected
    assert faulty.injected[0].split(" ", 2)[2] in str(info.value)
    pool, _files = ck.resources().files(LocalStore("."))
    assert pool.idle() and not faulty.open_handles
    assert_same(ck.load(path), state_a())


def test_failing_open_on_load_releases_buffers(tmp_path):
    ck, path, _manifest_a, _listing_a = _commit_a(tmp_path)  # not closed: the pool may be short
    faulty = inject(ck, fail_open_read=1)
    with pytest.raises(StorageIOError) as info:
        ck.load(path)
    assert faulty.injected and faulty.injected[0].split(" ", 2)[2] in str(info.value)
    pool, _files = ck.resources().files(LocalStore("."))
    assert pool.idle(), "the buffer taken for the first read was not handed back"


# -- (3) the old checkpoint survives until the new commit ------------------------------------

class _Watching(FaultyBackend):
    """Records, at every backend call during a save, whether checkpoint A is still whole."""

    def __init__(self, inner, path, manifest_a: bytes, files_a: set[str], **faults) -> None:
        super().__init__(inner, **faults)
        self.path, self.manifest_a, self.files_a = path, manifest_a, files_a
        self.seen: list[bool] = []
        self.active = False  # looking only while the save runs

    def _look(self) -> None:
        if self.active:
                self.seen.append(_manifest_bytes(self.path) == self.manifest_a
                             and self.files_a <= _listing(self.path))

    def open_write(self, path, nbytes):
        self._look()
        return super().open_write(path, nbytes)

    def submit_write(self, fh, offset, data):
        self._look()
        return super().submit_write(fh, offset, data)

    def close(self, fh, *, sync):
        self._look()
        return super().close(fh, sync=sync)


@pytest.mark.parametrize("fail", [False, True])
def test_old_checkpoint_whole_until_new_commit(committed, b_profile, fail):
    ck, path, manifest_a, listing_a = committed
    watcher = ck.resources().wrap_backend(LocalStore("."), lambda real: _Watching(
        real, path, manifest_a, {n for n in listing_a if n.startswith("data-")},
        fail_close=b_profile["nfiles"] if fail else None))
    watcher.active = True
    if fail:  # the very last step before the commit (fsync of the last data file) fails
        with pytest.raises(StorageIOError):
            ck.save(state_b(), path)
        watcher.active = False
        assert_same(ck.load(path), state_a())
    else:
        ck.save(state_b(), path)
        watcher.active = False
        assert_same(ck.load(path), state_b())
    assert len(watcher.seen) >= b_profile["nwrites"] and all(watcher.seen), (
        "checkpoint A was changed or removed while the new save was still running")


# -- (4) commit order and leftovers ----------------------------------------------------------

def test_commit_order_and_no_temp_manifest(tmp_path, monkeypatch):
    """Data files fsynced, then the manifest temp file fsynced, renamed onto manifest.json, and
    the directory fsynced; nothing temporary remains."""
    events: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = "?"
        events.append(("fsync", target))
        return real_fsync(fd)

    def rename(src, dst, *args, **kwargs):
        events.append(("rename", f"{os.fspath(src)} -> {os.fspath(dst)}"))
        return real_rename(src, dst, *args, **kwargs)

    ck = Checkpointer(FAULT_OPTIONS)
    path = tmp_path / "ckpt"
    try:
        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "rename", rename)
        result = ck.save(state_b(), path)
        monkeypatch.undo()
        ck._finish_cleanup()
    finally:
        _close(ck)
    assert _listing(path) == set(result.files) | {"manifest.json"}
    assert not [n for n in os.listdir(path) if n.startswith(".manifest-")]
    assert_same(ckptio.load(path), state_b())

    renames = [i for i, (kind, _) in enumerate(events) if kind == "rename"]
    real = os.path.realpath(path)  # /proc/self/fd links name real paths
    assert len(renames) == 1
    commit_at = renames[0]
    tmp, dst = events[commit_at][1].split(" -> ")
    assert os.path.realpath(dst) == os.path.join(real, "manifest.json")
    fsynced_before = [target for kind, target in events[:commit_at] if kind == "fsync"]
    for name in result.files:
        assert os.path.join(real, name) in fsynced_before, f"{name} not fsynced before the commit"
    assert os.path.basename(tmp).startswith(".manifest-") and os.path.realpath(tmp) in fsynced_before, (
        "the manifest must be written to a temporary name and fsynced before the rename")
    fsynced_after = [target for kind, target in events[commit_at:] if kind == "fsync"]
    assert real in fsynced_after, "the directory must be fsynced after the rename"


def test_manifest_is_the_last_file_written(tmp_path):
    """While data is still being written no manifest.json exists in a new directory."""
    ck = Checkpointer(FAULT_OPTIONS)
    path = tmp_path / "ckpt"
    seen: list[bool] = []

    class Look(FaultyBackend):
        def submit_write(self, fh, offset, data):
            seen.append(os.path.exists(os.path.join(path, "manifest.json")))
            return super().submit_write(fh, offset, data)

        def close(self, fh, *, sync):
            seen.append(os.path.exists(os.path.join(path, "manifest.json")))
            return super().close(fh, sync=sync)

    ck.resources().wrap_backend(LocalStore("."), Look)
    try:
        ck.save(state_b(), path)
    finally:
        _close(ck)
    assert seen and not any(seen)
    assert os.path.exists(os.path.join(path, "manifest.json"))


def test_concurrent_cleanup_is_joined_by_close(tmp_path):
    """Superseded files are removed in the background; close() waits for that removal."""
    earlier = set(threading.enumerate())  # another test's Checkpointer is not this one's
    ck = Checkpointer(FAULT_OPTIONS)
    path = tmp_path / "ckpt"
    try:
        first = ck.save(state_a(), path)
        second = ck.save(state_b(), path)
    finally:
        _close(ck)
    assert not set(first.files) & _listing(path)
    assert _listing(path) == set(second.files) | {"manifest.json"}
    assert not [t for t in threading.enumerate()
                if t.name == "ckptio-cleanup" and t.is_alive() and t not in earlier]


# -- (5) a failing cleanup never hides the failure ------------------------------------------

def _refusing_unlink(monkeypatch, prefix: str) -> list[str]:
    """os.unlink fails (read-only filesystem) for names starting with ``prefix``."""
    refused: list[str] = []
    real = os.unlink

    def unlink(target, *args, **kwargs):
        if os.path.basename(os.fspath(target)).startswith(prefix):
            refused.append(os.fspath(target))
            raise OSError(errno.EROFS, "Read-only file system", os.fspath(target))
        return real(target, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)
    return refused


def test_failed_cleanup_after_failed_save_keeps_the_real_error(committed, b_profile, monkeypatch,
                                                                caplog):
    ck, path, manifest_a, _listing_a = committed
    faulty = inject(ck, fail_write=b_profile["nwrites"] // 2)
    refused = _refusing_unlink(monkeypatch, "data-")
    caplog.set_level(logging.WARNING, logger="ckptio")
    with pytest.raises(StorageIOError) as info:
        ck.save(state_b(), path)
    monkeypatch.undo()
    assert faulty.injected and refused, "the write fault or the refused unlink was never reached"
    assert faulty.injected[0].split(" ", 2)[2] in str(info.value), "not the write's own error"
    notes = getattr(info.value, "__notes__", [])
    assert any("could not be removed" in n and str(path) in n for n in notes), notes
    assert "could not be removed" in caplog.text
    assert _manifest_bytes(path) == manifest_a
    assert_same(ck.load(path), state_a())
    result = ck.save(state_b(), path)  # and the next save removes what was left
    ck._finish_cleanup()
    assert _listing(path) == set(result.files) | {"manifest.json"}


# -- (6) messages ----------------------------------------------------------------------------

def test_one_process_commit_error_names_no_coordinator(committed, monkeypatch):
    ck, path, manifest_a, listing_a = committed
    real_rename = os.rename

    def rename(src, dst, *args, **kwargs):
        if os.path.basename(os.fspath(dst)) == "manifest.json":
            raise OSError(errno.EIO, "Input/output error")
        return real_rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", rename)
    refused = _refusing_unlink(monkeypatch, ".manifest-")  # the temp manifest stays, noted
    with pytest.raises(StorageIOError) as info:
        ck.save(state_b(), path)
    monkeypatch.undo()
    message = str(info.value)
    assert str(path) in message and "Input/output error" in message, message
    assert "rank" not in message and "coordinator" not in message, message
    assert refused and any("could not be removed" in n for n in info.value.__notes__)
    assert _manifest_bytes(path) == manifest_a
    assert _listing(path) - listing_a == {os.path.basename(refused[0])}
    assert_same(ck.load(path), state_a())


def test_path_that_is_a_file_is_refused_as_such(tmp_path):
    path = tmp_path / "ckpt"
    path.write_bytes(b"mine")
    ck = Checkpointer(FAULT_OPTIONS)
    try:
        with pytest.raises(StorageIOError) as info:
            ck.save(state_b(), path)
    finally:
        _close(ck)
    assert "exists and is not a directory" in str(info.value) and str(path) in str(info.value)
    assert "File exists" not in str(info.value)
    assert path.read_bytes() == b"mine"


# -- (7) what a directory without a manifest holds -------------------------------------------

def _refusal(path) -> ckptio.CkptError:
    errors = []
    for call in (ckptio.load, ckptio.verify):
        with pytest.raises(ckptio.CkptError) as info:
            call(path)
        errors.append(info.value)
    assert str(errors[0]) == str(errors[1]) and type(errors[0]) is type(errors[1])
    message = str(errors[0])
    assert str(path) in message and "delete" not in message.lower(), message
    return errors[0]


def test_dcp_checkpoint_is_named_as_such(tmp_path):
    import torch.distributed.checkpoint as dcp

    path = tmp_path / "dcp"
    with warnings.catch_warnings():  # no process group: DCP saves as one process, and says so
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(4)}, checkpoint_id=str(path))
    assert ".metadata" in _listing(path)
    # a complete DCP checkpoint is read (tests/test_dcp_in.py); without its .metadata (a
    # dcp.save that did not finish) it is named as such
    assert torch.equal(ckptio.load(path)["w"], torch.ones(4)) and ckptio.verify(path) > 0
    (path / ".metadata").unlink()
    error = _refusal(path)
    assert type(error) is CheckpointNotFoundError
    assert "torch.distributed.checkpoint (DCP) data files but no .metadata" in str(error)
    assert "dcp.save that did not finish" in str(error)


def test_folder_of_torch_save_files_is_named_as_such(tmp_path):
    path = tmp_path / "pt"
    path.mkdir()
    torch.save({"w": torch.ones(2)}, path / "model.pt")
    torch.save({"lr": 0.1}, path / "optim.pth")
    error = _refusal(path)
    assert type(error) is CheckpointNotFoundError
    assert "holds torch.save files (model.pt, optim.pth)" in str(error)
    assert "pass one of the files to ckptio.load" in str(error)
    loaded = ckptio.load(path / "model.pt")  # the file itself now loads (tests/test_torch_save_in.py)
    assert torch.equal(loaded["w"], torch.ones(2))


def test_hugging_face_folder_is_named_as_such(tmp_path):
    path = tmp_path / "hf"
    path.mkdir()
    (path / "config.json").write_text("{}")
    (path / "model-00001-of-00002.safetensors").write_bytes(b"\0" * 16)
    (path / "model-00002-of-00002.safetensors").write_bytes(b"\0" * 16)
    error = _refusal(path)
    assert type(error) is CheckpointNotFoundError
    assert "holds safetensors files (model-00001-of-00002.safetensors" in str(error)
    assert "safetensors.torch.load_file" in str(error)


def test_a_trainer_output_dir_names_the_checkpoint_inside(tmp_path):
    """ckptio.hf_trainer's layout: out/checkpoint-N/ckptio is the checkpoint; out, and other
    parents of checkpoints not named step-<N> (Lightning's epoch=...ckpt), say what to pass."""
    for n in (20, 30):
        ckptio.save({"w": torch.ones(2)}, tmp_path / "out" / f"checkpoint-{n}" / "ckptio")
    error = _refusal(tmp_path / "out")
    assert type(error) is CheckpointNotFoundError
    assert "checkpoint-30/ckptio is one" in str(error)
    ckptio.save({"w": torch.ones(2)}, tmp_path / "lightning" / "epoch=1-step=8.ckpt")
    error = _refusal(tmp_path / "lightning")
    assert str(error).endswith("pass one of them (e.g. .../epoch=1-step=8.ckpt)")


def test_parent_of_checkpoints_is_named_as_such(tmp_path):
    ck = Checkpointer(FAULT_OPTIONS)
    try:
        for step in (300, 100, 200):
            ck.save({"step": step, "w": torch.full((8,), float(step))}, tmp_path / f"step-{step}")
    finally:
        _close(ck)
    error = _refusal(tmp_path)
    assert type(error) is CheckpointNotFoundError
    assert "holds 3 ckptio checkpoints (step-100, step-200, step-300)" in str(error)
    assert "pass one of them (e.g. .../step-300), or use ckptio.CheckpointManager" in str(error)
    for step in (400, 500, 1000):
        (tmp_path / f"step-{step}").mkdir()
        (tmp_path / f"step-{step}" / "manifest.json").write_bytes(b"")
    assert "holds 6 ckptio checkpoints (step-100 ... step-1000)" in str(_refusal(tmp_path))


def test_interrupted_ckptio_save_is_incomplete_and_says_so(tmp_path):
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "data-0123456789a00000000-r00000-0000.bin").write_bytes(b"\0" * 8192)
    error = _refusal(path)
    assert type(error) is IncompleteCheckpointError
    message = str(error)
    assert "data-0123456789a00000000-r00000-0000.bin" in message and "interrupted" in message
    assert "no committed checkpoint exists here" in message
    assert "load an earlier checkpoint" in message.lower()
    assert "saving into this path again replaces the leftovers" in message


@pytest.mark.parametrize("content", [[], ["notes.txt", "sub"]], ids=["empty", "unknown"])
def test_empty_or_unknown_directory_holds_no_checkpoint(tmp_path, content):
    path = tmp_path / "dir"
    path.mkdir()
    for name in content:
        (path / name).mkdir() if name == "sub" else (path / name).write_text("x")
    error = _refusal(path)
    assert type(error) is CheckpointNotFoundError
    assert "holds no ckptio checkpoint (no manifest.json)" in str(error)
    assert ("it is empty" if not content else "notes.txt, sub") in str(error)


def test_cleanup_removes_only_files_a_ckptio_save_creates(tmp_path):
    import torch

    import ckptio

    path = tmp_path / "ck"
    path.mkdir()
    (path / "data-00000-of-00001.arrow").write_bytes(b"a user's dataset")
    (path / "data-notes.txt").write_text("mine")
    ckptio.save({"a": torch.ones(2)}, path)
    ckptio.save({"a": torch.zeros(2)}, path)  # the second save's cleanup removes the first's
    # The removal runs in the background once listed (saving/cleanup.py): under load it may
    # still be deleting when save() returns, so wait for it (bounded).
    deadline = time.monotonic() + 30
    while True:
        names = sorted(p.name for p in path.iterdir())
        bins = [n for n in names if n.endswith(".bin")]
        if len(bins) == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert "data-00000-of-00001.arrow" in names and "data-notes.txt" in names
    assert len(bins) == 1, bins


def test_a_save_over_a_committed_checkpoint_says_it_replaced_it(tmp_path, caplog):
    """ckptio.save onto a committed path replaces it (atomically, as before), and says so;
    the first save into the path, and one into a new path, say nothing."""
    path = tmp_path / "ckpt"
    with caplog.at_level(logging.WARNING, logger="ckptio"):
        ckptio.save({"a": torch.ones(2)}, path)
        assert not [r for r in caplog.records if "replaced" in r.getMessage()]
        ckptio.save({"a": torch.zeros(2)}, path)
    said = [r.getMessage() for r in caplog.records if "replaced" in r.getMessage()]
    assert len(said) == 1 and str(path) in said[0], said
    assert torch.equal(ckptio.load(path)["a"], torch.zeros(2))


def test_a_failed_save_keeps_its_files_when_the_manifest_cannot_be_read(tmp_path, monkeypatch,
                                                                        caplog):
    """After a failed save its files are removed only once the committed manifest, read, does
    not name them. Where that read fails (on S3: a commit whose answer was lost may have
    landed) they are kept with a warning, and the next save there removes them."""
    path = tmp_path / "ckpt"
    ckptio.save({"w": torch.ones(1000)}, path)
    committed = sorted(os.listdir(path))
    ck = ckptio.Checkpointer()
    faulty = inject(ck, fail_write=1)
    real = LocalStore.read_manifest

    def unreadable_once_failed(store: LocalStore) -> bytes:
        if faulty.injected:
            raise ckptio.StorageIOError(f"cannot read {store.location}/manifest.json: I/O error")
        return real(store)

    monkeypatch.setattr(LocalStore, "read_manifest", unreadable_once_failed)
    with caplog.at_level(logging.WARNING, logger="ckptio"), pytest.raises(ckptio.StorageIOError):
        ck.save({"w": torch.zeros(1000)}, path)
    assert "could not be read" in caplog.text and "kept until the next save" in caplog.text
    assert len(os.listdir(path)) > len(committed)  # the failed save's files stay
    monkeypatch.setattr(LocalStore, "read_manifest", real)
    ck.close()
    assert torch.equal(ckptio.load(path)["w"], torch.ones(1000))
    final = ckptio.Checkpointer()
    final.save({"w": torch.full((1000,), 3.0)}, path)
    final.close()  # its removal of superseded files runs in the background: waited for here
    assert len(os.listdir(path)) == len(committed)  # the leftovers removed by the next save
