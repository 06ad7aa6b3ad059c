"""Locations by scheme (storage/select.py): mem:// and file:// through the public API, a store a
user registers for a scheme of their own, and the refusals that keep a typo from becoming a
local folder. Every save and load here goes through ckptio.save / ckptio.load / ckptio.verify.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptio
from user_steproot import DirRoot
from ckptio.options import Options
from ckptio.storage.local.local_store import LocalStore
from ckptio.storage.memory.host_memory import HOST
from ckptio.storage.select import checkpoint_path, registered_schemes, store_for

OPTS = ckptio.Options(buffer_bytes=1 << 20, pool_bytes=4 << 20)


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {"w": torch.randn(300, 70), "b": torch.arange(11, dtype=torch.int64),
            "h": torch.randn(5, 3).bfloat16(), "step": 12, "name": "run"}


def _same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and torch.equal(
                got[key].view(torch.uint8), value.view(torch.uint8)), key
        else:
            assert got[key] == value, key


def test_mem_locations_save_load_and_verify_through_the_api() -> None:
    state, path = _state(), "mem://test-registry/run/step-12"
    ckptio.save(state, path, options=OPTS)
    assert any(p.startswith(path + "/") for p in HOST.files), "nothing was stored in host memory"
    _same(ckptio.load(path, options=OPTS), state)
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v
              for k, v in state.items()}
    ckptio.load(path, target, options=OPTS)
    _same(target, state)
    assert ckptio.verify(path) > 0
    with pytest.raises(ckptio.CheckpointNotFoundError, match="mem://test-registry/other"):
        ckptio.load("mem://test-registry/other", options=OPTS)


def test_mem_async_save_and_a_damaged_byte_is_caught() -> None:
    state, path = _state(), "mem://test-registry/async"
    ckptio.async_save(state, path, options=OPTS).wait()
    name = next(p for p in HOST.files if p.startswith(path + "/data-"))
    data = bytearray(HOST.files[name])
    data[100] ^= 0x20
    HOST.files[name] = bytes(data)
    with pytest.raises(ckptio.CorruptCheckpointError):
        ckptio.load(path, options=OPTS)


def test_file_urls_are_their_local_path(tmp_path: Path) -> None:
    state = _state()
    url = "file://" + str(tmp_path / "ck")
    ckptio.save(state, url, options=OPTS)
    assert (tmp_path / "ck" / "manifest.json").is_file()
    _same(ckptio.load(tmp_path / "ck", options=OPTS), state)
    _same(ckptio.load(url, options=OPTS), state)
    assert checkpoint_path("file://localhost/x/y") == "/x/y"
    with pytest.raises(ckptio.UnsupportedPathError, match="absolute path"):
        checkpoint_path("file://relative/dir")


class _Counting(LocalStore):
    """A user's store: a local directory under a root of its own, counting what it opens."""

    opened: list[str] = []

    def __init__(self, location: str, root: Path) -> None:
        super().__init__(str(root / location.split("://", 1)[1]))
        self.user_location = location

    @property
    def backend_kind(self) -> str:
        return "counting"

    def path_of(self, name: str) -> str:
        path = super().path_of(name)
        _Counting.opened.append(name)
        return path


def test_a_user_registered_scheme_serves_save_load_and_a_manager(tmp_path: Path) -> None:
    ckptio.register_store("countfs", lambda location, options: _Counting(location, tmp_path))
    assert "countfs" in registered_schemes()
    state = _state()
    _Counting.opened.clear()
    ckptio.save(state, "countfs://job/step-1", options=OPTS)
    assert any(n.startswith("data-") for n in _Counting.opened), "data files bypassed the store"
    assert (tmp_path / "job" / "step-1" / "manifest.json").is_file()
    _same(ckptio.load("countfs://job/step-1", options=OPTS), state)
    with pytest.raises(ckptio.CkptError, match="registered already"):
        ckptio.register_store("countfs", lambda location, options: _Counting(location, tmp_path))
    ckptio.register_store("countfs", lambda location, options: LocalStore(str(tmp_path / "x")),
                          replace=True)
    assert isinstance(store_for("countfs://a", OPTS), LocalStore)


def test_registry_refusals_name_the_registered_schemes() -> None:
    with pytest.raises(ckptio.UnsupportedPathError) as info:
        ckptio.save({"a": torch.ones(1)}, "hdfs://bucket/x", options=OPTS)
    for scheme in ("file://", "mem://", "s3://", "gs://"):
        assert scheme in str(info.value)
    assert "register_store" in str(info.value)
    for built_in in ("s3", "mem", "file", "MEM"):
        with pytest.raises(ckptio.CkptError, match="built in"):
            ckptio.register_store(built_in, lambda location, options: LocalStore("."))
    for bad in ("", "9x", "a/b", "x://"):
        with pytest.raises(ckptio.CkptError, match="scheme"):
            ckptio.register_store(bad, lambda location, options: LocalStore("."))
    with pytest.raises(ckptio.CkptError, match="callable"):
        ckptio.register_store("notcallable", "LocalStore")  # type: ignore[arg-type]
    ckptio.register_store("notastore", lambda location, options: object(), replace=True)
    with pytest.raises(ckptio.CkptError, match="not a ckptio Store"):
        ckptio.save({"a": torch.ones(1)}, "notastore://x", options=OPTS)


def test_a_store_gets_the_options_in_force(tmp_path: Path) -> None:
    seen: list[Options] = []

    def factory(location: str, options: Options) -> LocalStore:
        seen.append(options)
        return LocalStore(str(tmp_path / "o"))

    ckptio.register_store("optfs", factory, replace=True)
    ckptio.save({"a": torch.ones(3)}, "optfs://o", options=OPTS)
    assert seen and all(o.buffer_bytes == OPTS.buffer_bytes for o in seen)
    assert os.path.isfile(tmp_path / "o" / "manifest.json")


# -- a scheme of one's own under a CheckpointManager ----------------------------------------------


def test_a_user_scheme_registered_with_a_step_root_gets_a_manager(tmp_path: Path) -> None:
    """save, steps, retention and restore, through ckptio.CheckpointManager on a scheme of the
    user's own: every data byte through its Store, every step operation through its root."""
    roots: list[DirRoot] = []

    def step_root(location: str, options: Options) -> DirRoot:
        roots.append(DirRoot(location, tmp_path))
        return roots[-1]

    ckptio.register_store("dirfs", lambda location, options: _Counting(location, tmp_path),
                          step_root=step_root, replace=True)
    with ckptio.CheckpointManager("dirfs://job/run", keep_last=2, options=OPTS) as mgr:
        assert mgr.restore({"w": torch.zeros(4)}) is None  # nothing there yet: not an error
        _Counting.opened.clear()
        for step in (1, 2, 3):
            mgr.save(step, {"w": torch.full((64,), float(step)), "step": step})
        mgr.wait()
        assert any(n.startswith("data-") for n in _Counting.opened), "data bypassed the store"
        assert mgr.steps() == [2, 3]
        assert mgr.path(3) == "dirfs://job/run/step-3"
    assert roots[0].hidden == [1], "retention did not go through the registered step root"
    on_disk = sorted(p.name for p in (tmp_path / "job" / "run").iterdir())
    assert on_disk == ["step-2", "step-3"], on_disk  # step 1 hidden, then removed
    again = ckptio.CheckpointManager("dirfs://job/run", options=OPTS)
    state = {"w": torch.zeros(64), "step": 0}
    assert again.restore(state) == 3
    assert torch.equal(state["w"], torch.full((64,), 3.0)) and state["step"] == 3
    assert again.restore(state, step=2) == 2 and torch.equal(state["w"], torch.full((64,), 2.0))
    again.close()


def test_a_user_scheme_without_a_step_root_names_what_to_register(tmp_path: Path) -> None:
    ckptio.register_store("nostepfs", lambda location, options: _Counting(location, tmp_path),
                          replace=True)
    ckptio.save({"a": torch.ones(3)}, "nostepfs://one/step-1", options=OPTS)  # a store serves
    with pytest.raises(ckptio.CkptError) as info:
        ckptio.CheckpointManager("nostepfs://job/run", options=OPTS)
    message = str(info.value)
    for needed in ("nostepfs://", "register_store('nostepfs'", "step_root=", "path, scan, "
                   "is_committed, hide, removal and nothing_here", "steproot_conformance"):
        assert needed in message, (needed, message)
    assert "delete" not in message.lower()
    ckptio.register_store("badrootfs", lambda location, options: _Counting(location, tmp_path),
                          step_root=lambda location, options: object(), replace=True)
    with pytest.raises(ckptio.CkptError, match="badrootfs://.*lacks the StepRoot methods"):
        ckptio.CheckpointManager("badrootfs://job/run", options=OPTS)
    with pytest.raises(ckptio.CkptError, match="step_root.*callable"):
        ckptio.register_store("worsefs", lambda location, options: _Counting(location, tmp_path),
                              step_root="MyRoot")  # type: ignore[arg-type]


def test_every_built_in_scheme_names_its_store_backend_and_step_root(tmp_path: Path) -> None:
    """One entry per scheme (storage/select.py): the store, its backend kind and the root of a
    manager's steps come from the same place."""
    from ckptio.storage.select import root_for, scheme_for

    local = str(tmp_path / "run")
    cases = {local: ("file", "LocalStore", "local", "LocalRoot"),
             f"file://{local}": ("file", "LocalStore", "local", "LocalRoot"),
             "mem://scheme-test/run": ("mem", "MemoryStore", "memory", "MemoryRoot")}
    for location, (name, store, backend, root) in cases.items():
        entry = scheme_for(location)
        assert entry.name == name and entry.backend == backend
        made = store_for(location, OPTS)
        assert type(made).__name__ == store and made.backend_kind == backend
        assert type(root_for(location, OPTS)).__name__ == root
    assert scheme_for("shm://x").backend == "local" and scheme_for("s3://b/p").backend == "s3"
    assert {"file", "shm", "mem", "s3"} <= set(registered_schemes())


def test_arguments_swapped_get_a_ckpt_error_naming_the_order(tmp_path: Path) -> None:
    """ckptio.save(path, state) / ckptio.load(state, path), a common slip (torch.save takes the
    object first, DCP's load the state first): a CkptError saying which goes where, and
    nothing written."""
    state = {"w": torch.ones(3)}
    with pytest.raises(ckptio.CkptError, match=r"not a dict: the state goes first in ckptio\.save"):
        ckptio.save(str(tmp_path / "ck"), state)  # type: ignore[arg-type]
    with pytest.raises(ckptio.CkptError, match=r"second in ckptio\.load\(path, state\)"):
        ckptio.load(state, str(tmp_path / "ck"))  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []
