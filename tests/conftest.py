"""Shared fixtures: a checkpoint directory under pytest's tmp_path and a small staging pool;
the checkout's Python compiled once before the run (``pytest_configure``)."""

from __future__ import annotations

import compileall
import os
import re
import sys
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptio
from ckptio.testing.faultfs import FaultFS

# Tests never pick up a tuned profile of the machine they run on (`ckptio tune` writes one to
# ~/.cache/ckptio): each run starts with an empty profile file of its own. Subprocesses inherit it.
os.environ["CKPTIO_PROFILE_PATH"] = os.path.join(tempfile.mkdtemp(prefix="ckptio-profiles-"),
                                                 "profiles.json")

MiB = 1 << 20
HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_configure(config: pytest.Config) -> None:
    """The controller, once: the checkout's packages compiled to ``__pycache__`` before any case
    runs. Where the environment sets PYTHONDONTWRITEBYTECODE (this project's development and CI
    machines do), no interpreter writes them, so each of the suite's fresh interpreters (rank
    agents, examples, the CLI, benchmark smoke runs) compiled ckptio's modules from source again
    (docs/TESTS.md, "What was cut")."""
    if hasattr(config, "workerinput") or not sys.dont_write_bytecode:
        return  # a worker (the controller compiles), or interpreters write them themselves
    root = os.path.dirname(HERE)
    for package in ("ckptio", "tests", "benchmarks", "examples"):
        if os.path.isdir(os.path.join(root, package)):
            compileall.compile_dir(os.path.join(root, package), quiet=1,
                                   rx=re.compile(r"[/\\]fixtures[/\\]"))  # data, listed

# 1 MiB buffers in a 4 MiB pool: a tensor of a few MiB crosses several buffer boundaries, so
# save and load both exercise splitting one tensor over several buffers and reads.
# every dtype people train with; shared by the round-trip and property tests
ALL_DTYPES = [
    torch.float32, torch.float16, torch.float64, torch.bfloat16,
    torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint8, torch.uint16, torch.uint32, torch.uint64,
    torch.bool, torch.complex64, torch.complex128,
]

SMALL_OPTIONS = ckptio.Options(buffer_bytes=1 * MiB, pool_bytes=4 * MiB)


@pytest.fixture
def ckpt_dir(tmp_path):
    """A path (not yet existing) to save a checkpoint into."""
    return tmp_path / "ckpt"


@pytest.fixture
def small_options() -> ckptio.Options:
    return SMALL_OPTIONS


def _float_bits(x: float) -> bytes:
    import struct

    return struct.pack("<d", x)


def tensor_bytes(t):
    """The elements' bytes in row-major order (a fresh dense copy: .contiguous() may keep odd
    strides on size-1 dims, which .view(uint8) refuses)."""
    import torch

    dense = torch.empty(tuple(t.shape), dtype=t.dtype).copy_(t.detach())
    return dense.reshape(-1).view(torch.uint8)


class CountingReads:
    """A backend wrapper (Resources.wrap_backend) that adds up the bytes and the requests of
    every read it is asked for, then does it."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.nbytes, self.requests = inner, 0, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def submit_read(self, fh: Any, offset: int, into: memoryview) -> Any:
        self.nbytes += len(into)
        self.requests += 1
        return self.inner.submit_read(fh, offset, into)


def assert_same(got, want, where: str = "state") -> None:
    """Exact equality: same structure, same Python types, same bits (NaN and -0.0 included)."""
    import numpy as np
    import torch

    assert type(got) is type(want), f"{where}: type {type(got)} != {type(want)}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype, f"{where}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{where}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert torch.equal(tensor_bytes(got), tensor_bytes(want)), f"{where}: tensor bytes differ"
    elif isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and got.shape == want.shape, f"{where}: {got.dtype}{got.shape}"
        assert got.tobytes() == want.tobytes(), f"{where}: array bytes differ"
    elif isinstance(want, np.generic):
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), f"{where}: {got!r} != {want!r}"
    elif isinstance(want, float):
        assert _float_bits(got) == _float_bits(want), f"{where}: {got!r} != {want!r} (bits)"
    elif isinstance(want, complex):
        assert _float_bits(got.real) == _float_bits(want.real), f"{where}: {got!r} != {want!r}"
        assert _float_bits(got.imag) == _float_bits(want.imag), f"{where}: {got!r} != {want!r}"
    elif isinstance(want, dict):
        assert list(got.keys()) == list(want.keys()), f"{where}: keys {list(got)} != {list(want)}"
        assert [type(k) for k in got] == [type(k) for k in want], f"{where}: key types differ"
        for k in want:
            assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)) and not isinstance(want, torch.Size):
        assert len(got) == len(want), f"{where}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


@pytest.fixture(name="assert_same")
def assert_same_fixture():
    """The exact-equality checker above (structure, types and bits)."""
    return assert_same


@pytest.fixture(params=["auto", "on", "off"])
def direct_io(request: pytest.FixtureRequest, tmp_path) -> str:
    """Each direct_io mode for backend conformance tests; "on" skips where O_DIRECT is refused."""
    from ckptio.testing import accepts_o_direct

    if request.param == "on" and not accepts_o_direct(os.fspath(tmp_path)):
        pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT; direct_io='on' cannot be tested here")
    return request.param


@pytest.fixture
def hosts_base() -> Any:
    """A fresh /dev/shm root for simulated hosts' memories (tests/redundancy_cases.host_dir),
    removed afterwards."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    root = os.path.join("/dev/shm", f"ckptio-test-hosts-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def shm_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``shm://`` locations in a folder of this test (CKPTIO_SHM_DIR), not the host's."""
    root = tmp_path / "shm"
    root.mkdir()
    monkeypatch.setenv("CKPTIO_SHM_DIR", str(root))
    return root


@pytest.fixture
def shm(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A fresh shared-memory root for shm:// tiers ($CKPTIO_SHM_DIR), removed afterwards."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    root = os.path.join("/dev/shm", f"ckptio-test-shm-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    monkeypatch.setenv("CKPTIO_SHM_DIR", root)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def fs(tmp_path: Path) -> Iterator[FaultFS]:
    """A fault file system (ckptio.testing.faultfs): ``fs.mountpoint`` shows
    ``tmp_path/backing``; unmounted afterwards. A test module using it skips itself where
    /dev/fuse is unusable (``fuse_unusable``)."""
    with FaultFS(tmp_path / "backing", tmp_path / "mnt") as mounted:
        yield mounted
