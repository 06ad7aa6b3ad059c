"""Filesystems that refuse O_DIRECT: with direct_io="auto" ckptio falls back to buffered I/O
(with fsync), logs one warning per filesystem, and round trips bitwise; with direct_io="on" the
save fails with a clear StorageIOError and commits nothing.

Two kinds of tests:
* on real tmpfs (/dev/shm). tmpfs refused O_DIRECT until Linux 6.6 and accepts it since; the
  tests probe which is the case and expect the fallback (one warning) or plain O_DIRECT (none).
* on a simulated refusing filesystem (any directory, via a stand-in for the ``os`` module that
  ckptio.io.posix uses), so the fallback is tested on every kernel. It models both ways a kernel
  refuses: before creating the file, and (as Linux does in do_dentry_open, e.g. tmpfs before 6.6
  or FUSE without direct I/O) after creating it, which leaves an empty file behind.
"""

from __future__ import annotations

import errno
import fcntl
import gc
import logging
import os
import shutil
import tempfile
import types

import pytest

from ckptio.testing import accepts_o_direct
import torch

import ckptio.io.posix as posix_module
from ckptio import Checkpointer, IncompleteCheckpointError, Options, StorageIOError
from ckptio.storage.local.local_store import LocalStore

MiB = 1 << 20
OPTS = dict(buffer_bytes=MiB, pool_bytes=4 * MiB)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(512, 1024, generator=g),          # 2 MiB: spans buffers
            "b": torch.randn(1000, generator=g, dtype=torch.float64),
            "i": torch.randint(-5, 5, (333,), generator=g, dtype=torch.int8),
            "step": seed}


def _assert_same(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
            assert torch.equal(_bits(got[k]), _bits(v)), f"{k}: bytes differ"
        else:
            assert got[k] == v


def _refuses_o_direct(directory: str) -> bool:
    return not accepts_o_direct(directory)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """ckptio's warnings, less the one each save over a committed checkpoint logs (the cycles
    save over on purpose; _replaced counts those)."""
    return [r for r in caplog.records if r.name == "ckptio" and r.levelno == logging.WARNING
            and "replaced the checkpoint" not in r.getMessage()]


def _replaced(caplog: pytest.LogCaptureFixture) -> int:
    return sum("replaced the checkpoint" in r.getMessage() for r in caplog.records)


def _close(ck: Checkpointer) -> None:
    gc.collect()  # errors kept by pytest.raises still view staging buffers (see test_corruption)
    ck.close()


def _save_load_cycles(ck: Checkpointer, root: str, n: int = 3) -> None:
    """n saves (into two directories, one saved over) and loads, each bitwise."""
    for i in range(n):
        path = os.path.join(root, f"ckpt-{i % 2}")
        state = _state(i)
        ck.save(state, path)
        _assert_same(ck.load(path), state)
        dest = _state(100 + i)
        ck.load(path, dest)
        _assert_same(dest, state)
        assert ck.verify(path) > 0


# -- real tmpfs ------------------------------------------------------------------------------

@pytest.fixture
def shm():
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm")
    root = tempfile.mkdtemp(prefix="ckptio-test-", dir="/dev/shm")
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_tmpfs_round_trip_warns_at_most_once(shm, caplog):
    refuses = _refuses_o_direct(shm)
    caplog.set_level(logging.WARNING, logger="ckptio")
    ck = Checkpointer(Options(**OPTS))
    try:
        _save_load_cycles(ck, shm, n=4)
    finally:
        _close(ck)
    warnings = _warnings(caplog)
    assert _replaced(caplog) == 2  # saves 3 and 4 went over saves 1 and 2
    if refuses:
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        assert "O_DIRECT" in warnings[0].getMessage() and shm in warnings[0].getMessage()
    else:  # Linux >= 6.6: tmpfs takes O_DIRECT, nothing to warn about
        assert warnings == []


def test_tmpfs_direct_on_fails_clearly(shm):
    if not _refuses_o_direct(shm):
        pytest.skip("tmpfs accepts O_DIRECT on this kernel (Linux >= 6.6); see the simulated tests")
    ck = Checkpointer(Options(**OPTS, direct_io="on"))
    path = os.path.join(shm, "ckpt")
    try:
        with pytest.raises(StorageIOError) as info:
            ck.save(_state(0), path)
    finally:
        _close(ck)
    assert "O_DIRECT" in str(info.value) and path in str(info.value)
    assert not os.path.exists(os.path.join(path, "manifest.json"))


# -- a simulated filesystem that refuses O_DIRECT ---------------------------------------------

def _refusing_os(root: str, *, creates_first: bool) -> types.SimpleNamespace:
    """The ``os`` module, except that open(O_DIRECT) under ``root`` fails with EINVAL.
    creates_first: with O_CREAT the file is created before the refusal (Linux's behaviour)."""
    root = os.path.abspath(root) + os.sep

    def open_(path, flags, mode=0o777, *, dir_fd=None):
        if flags & os.O_DIRECT and os.path.abspath(path).startswith(root):
            if creates_first and flags & os.O_CREAT:
                fd = os.open(path, flags & ~os.O_DIRECT, mode)  # O_EXCL still applies
                os.close(fd)
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)
        return os.open(path, flags, mode, dir_fd=dir_fd)

    stand_in = types.SimpleNamespace(**{k: getattr(os, k) for k in dir(os) if not k.startswith("__")})
    stand_in.open = open_
    return stand_in


def _refusing_fcntl(root: str) -> types.SimpleNamespace:
    """The ``fcntl`` module, except that F_SETFL adding O_DIRECT to a file under ``root`` fails
    with EINVAL (what Linux does on a filesystem without direct I/O)."""
    root = os.path.abspath(root) + os.sep

    def fcntl_(fd, cmd, arg=0):
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(root):
                raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return fcntl.fcntl(fd, cmd, arg)

    stand_in = types.SimpleNamespace(**{k: getattr(fcntl, k) for k in dir(fcntl) if not k.startswith("__")})
    stand_in.fcntl = fcntl_
    return stand_in


@pytest.fixture
def refusing_fs(tmp_path, monkeypatch, request):
    root = str(tmp_path / "no-o-direct")
    os.makedirs(root)
    monkeypatch.setattr(posix_module, "os",
                        _refusing_os(root, creates_first=getattr(request, "param", False)))
    monkeypatch.setattr(posix_module, "fcntl", _refusing_fcntl(root))
    return root


@pytest.mark.parametrize("refusing_fs", [False], indirect=True, ids=["refuses-before-create"])
def test_simulated_fallback_round_trip_one_warning(refusing_fs, caplog):
    caplog.set_level(logging.WARNING, logger="ckptio")
    ck = Checkpointer(Options(**OPTS))
    try:
        _save_load_cycles(ck, refusing_fs, n=4)
        _pool, files = ck.resources().files(LocalStore("."))
        backend = files.backend
        fh = backend.open_read(os.path.join(refusing_fs, "ckpt-0", "manifest.json"))
        assert fh.direct is False, "the refusing filesystem must be read buffered"
        backend.close(fh, sync=False)
    finally:
        _close(ck)
    warnings = _warnings(caplog)
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "O_DIRECT" in warnings[0].getMessage() and refusing_fs in warnings[0].getMessage()


@pytest.mark.parametrize("refusing_fs", [True], indirect=True, ids=["creates-then-refuses"])
def test_simulated_fallback_when_kernel_creates_before_refusing(refusing_fs, caplog):
    caplog.set_level(logging.WARNING, logger="ckptio")
    ck = Checkpointer(Options(**OPTS))
    try:
        _save_load_cycles(ck, refusing_fs, n=2)
    finally:
        _close(ck)
    assert len(_warnings(caplog)) == 1


@pytest.mark.parametrize("refusing_fs", [False, True], indirect=True,
                         ids=["refuses-before-create", "creates-then-refuses"])
def test_simulated_direct_on_fails_clearly(refusing_fs):
    ck = Checkpointer(Options(**OPTS, direct_io="on"))
    path = os.path.join(refusing_fs, "ckpt")
    try:
        with pytest.raises(StorageIOError) as info:
            ck.save(_state(0), path)
        message = str(info.value)
        assert "O_DIRECT" in message and path in message, message
        if os.path.exists(path):
            assert not [n for n in os.listdir(path) if n.startswith("data-")], "files left behind"
            with pytest.raises(IncompleteCheckpointError):
                ck.load(path)
        pool, _files = ck.resources().files(LocalStore("."))
        assert pool.idle()
    finally:
        _close(ck)


def test_direct_io_off_never_warns(tmp_path, caplog):
    """Buffered by request is not a fallback: no warning, and the round trip is bitwise."""
    caplog.set_level(logging.WARNING, logger="ckptio")
    ck = Checkpointer(Options(**OPTS, direct_io="off"))
    try:
        _save_load_cycles(ck, str(tmp_path), n=2)
        _pool, files = ck.resources().files(LocalStore("."))
        backend = files.backend
        fh = backend.open_read(os.path.join(tmp_path, "ckpt-0", "manifest.json"))
        assert fh.direct is False
        backend.close(fh, sync=False)
    finally:
        _close(ck)
    assert _warnings(caplog) == []
