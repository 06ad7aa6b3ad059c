"""The StepRoot contract (ckptio/storage/steproot.py) on its local and memory implementations (the
S3 one: tests/s3/test_steproot_s3.py).

(1) The StepRoot conformance suite (ckptio/testing/steproot_conformance.py), steps committed by
    real ckptio.save calls: on LocalRoot, with a refused rename and a refused rmtree; on
    MemoryRoot, a save's claim refusing the hide (a removal in memory cannot fail); and the
    suite's plain functions (run_all), steps committed through MemoryStore itself.
(2) root_for: mem:// gives a MemoryRoot (a trailing "/" dropped; a bare scheme refused).
(3) Faults of a directory: a step whose manifest cannot be looked at (a symlink loop) fails
    the scan naming it, rather than being listed as something it is not.
(4) MemoryRoot's own rules: a location a save prepared is an incomplete step until its claim
    is released as failed; a memory location that is a file is named as one.
(5) A CheckpointManager keeping its steps in memory (skipped where ckptio.save does not serve
    mem://).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import secrets
import shutil
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import ckptio
from ckptio.errors import CkptError, StorageIOError, UnsupportedPathError
from ckptio.managing.manager import CheckpointManager
from ckptio.options import MiB, Options
from ckptio.storage.local.local_store import LocalStore
from ckptio.storage.local.local_root import LocalRoot
from ckptio.storage.memory.host_memory import HOST
from ckptio.storage.memory.memory_store import MemoryStore
from ckptio.storage.memory.memory_root import MemoryRoot
from ckptio.storage.select import register_store, root_for
from ckptio.storage.steproot import StepRoot
from ckptio.testing.steproot_conformance import (
    Roots,
    StepRootConformance,
    commit_by_ckptio,
    commit_by_store,
    run_all,
)
from ckptio.testing.store_conformance import data_name, write_file

OPTS = Options(buffer_bytes=MiB, pool_bytes=4 * MiB)

# -- (1) the conformance suite ------------------------------------------------------------------


class TestLocalRoot(StepRootConformance):
    @pytest.fixture
    def roots(self, tmp_path) -> Roots:
        return Roots(make=lambda key: LocalRoot(str(tmp_path / key)), store_at=LocalStore,
                     commit=commit_by_ckptio)

    @pytest.fixture
    def refuse_hide(self, monkeypatch):
        """The rename of the step's directory fails (EACCES: a directory the user may not
        write; monkeypatched, as root ignores permissions)."""

        @contextlib.contextmanager
        def refuse(root: StepRoot, step: int) -> Iterator[None]:
            real = os.rename

            def rename(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
                if os.fspath(src) == root.path(step):
                    raise OSError(errno.EACCES, "Permission denied", os.fspath(src))
                real(src, dst, *args, **kwargs)

            with monkeypatch.context() as patch:
                patch.setattr(os, "rename", rename)
                yield

        return refuse

    @pytest.fixture
    def refuse_removal(self, monkeypatch):
        """Removing the step's hidden directory fails (EROFS: a file system gone read-only)."""

        @contextlib.contextmanager
        def refuse(root: StepRoot, step: int) -> Iterator[None]:
            real = shutil.rmtree

            def rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
                name = os.path.basename(os.fspath(path))
                if name.startswith(f".deleting-step-{step}-"):
                    raise OSError(errno.EROFS, "Read-only file system", os.fspath(path))
                real(path, *args, **kwargs)

            with monkeypatch.context() as patch:
                patch.setattr(shutil, "rmtree", rmtree)
                yield

        return refuse


def _memory_root() -> str:
    return f"mem://steproot-{secrets.token_hex(6)}"


def _forget_under(root: str) -> None:
    prefix = root + "/"
    with HOST.lock:
        for path in [p for p in HOST.files if p.startswith(prefix)]:
            del HOST.files[path]
        for location in [loc for loc in HOST.locations if loc.startswith(prefix)]:
            HOST.locations.discard(location)
        for location in [loc for loc in HOST.commits if loc.startswith(prefix)]:
            del HOST.commits[location]


def _memory_roots(root: str) -> Roots:
    return Roots(make=lambda key: MemoryRoot(f"{root}/{key}"), store_at=MemoryStore,
                 commit=commit_by_store(MemoryStore))


class TestMemoryRoot(StepRootConformance):
    @pytest.fixture
    def roots(self) -> Iterator[Roots]:
        root = _memory_root()
        yield dataclasses.replace(_memory_roots(root), commit=commit_by_ckptio)
        _forget_under(root)

    @pytest.fixture
    def refuse_hide(self):
        return _claimed


@contextlib.contextmanager
def _claimed(root: StepRoot, step: int) -> Iterator[None]:
    """A save holds the step (its claim): a hide would move its location away under it."""
    claim = MemoryStore(root.path(step)).exclusive("raise")
    try:
        yield
    finally:
        claim.release()


def test_the_suite_runs_as_plain_functions():
    root = _memory_root()
    try:
        run_all(_memory_roots(root), refuse_hide=_claimed)
    finally:
        _forget_under(root)


# -- (2) root_for ------------------------------------------------------------------------------


def test_root_for_gives_memory_roots_for_mem_locations(tmp_path):
    root = root_for("mem://run-a/", OPTS)
    assert isinstance(root, MemoryRoot) and root.location == "mem://run-a"
    assert root.path(7) == "mem://run-a/step-7"
    assert isinstance(root_for(tmp_path / "run", OPTS), LocalRoot)
    for bad in ("mem://", "mem:///"):
        with pytest.raises(CkptError, match="must name something"):
            root_for(bad, OPTS)
    with pytest.raises(UnsupportedPathError):
        root_for("hdfs://bucket/run", OPTS)
    assert isinstance(root_for(f"file://{tmp_path}/run", OPTS), LocalRoot)


def test_a_scheme_with_a_store_but_no_step_root_is_refused_not_taken_for_a_directory():
    register_store("steproottest", lambda location, options: MemoryStore("mem://x/y"),
                   replace=True)
    with pytest.raises(UnsupportedPathError, match="steproottest://") as info:
        root_for("steproottest://bucket/run", OPTS)
    assert "delete" not in str(info.value).lower()


# -- (3) faults of a directory -----------------------------------------------------------------


def test_a_step_whose_manifest_cannot_be_looked_at_fails_the_scan_naming_it(tmp_path):
    root = LocalRoot(str(tmp_path / "run"))
    commit_by_ckptio(root.path(1))
    os.makedirs(root.path(2))
    os.symlink("manifest.json", os.path.join(root.path(2), "manifest.json"))  # ELOOP
    with pytest.raises(StorageIOError, match="step-2") as info:
        root.scan()
    assert "delete" not in str(info.value).lower()
    assert root.is_committed(1)


# -- (4) the memory root's own rules ----------------------------------------------------------


def test_a_prepared_memory_location_is_incomplete_until_its_failed_claim_is_released():
    base = _memory_root()
    try:
        root = MemoryRoot(base)
        store = MemoryStore(root.path(3))
        claim = store.exclusive("raise")  # a save starting: the location exists, still empty
        assert root.scan() == {"committed": [], "incomplete": [3]}
        claim.release(failed=True)  # it failed before writing anything
        assert root.scan() == {"committed": [], "incomplete": []}
        store.prepare()
        write_file(store, data_name(), bytes(4096))
        HOST.write(f"{base}/step-4", b"a file named like a step")
        assert root.scan() == {"committed": [], "incomplete": [3]}
    finally:
        _forget_under(base)


def test_a_memory_root_that_is_a_file_is_named_as_one():
    base = _memory_root()
    try:
        HOST.write(f"{base}/notes", b"not a root")
        root = MemoryRoot(f"{base}/notes")
        assert root.scan() == {"committed": [], "incomplete": []}
        assert "is a file" in root.nothing_here()
    finally:
        _forget_under(base)


# -- (5) a manager in memory ----------------------------------------------------------------


def test_a_manager_keeps_and_restores_steps_in_memory():
    base = _memory_root()
    try:
        try:
            ckptio.save({"x": torch.zeros(2)}, f"{base}/probe")
        except UnsupportedPathError:
            pytest.skip("ckptio.save does not serve mem:// locations yet")
        with CheckpointManager(f"{base}/run", keep_last=2, options=OPTS) as mgr:
            for step in (1, 2, 3, 4):
                mgr.save(step, {"w": torch.full((64,), float(step))})
        again = CheckpointManager(f"{base}/run", options=OPTS)
        assert again.steps() == [3, 4]
        state = {"w": torch.zeros(64)}
        assert again.restore(state) == 4 and torch.equal(state["w"], torch.full((64,), 4.0))
        again.close()
    finally:
        _forget_under(base)
