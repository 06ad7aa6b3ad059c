"""A tuned profile steers save and load on its filesystem; explicit options and use_profile=False
override it; a corrupt profile file never stops a save."""

from __future__ import annotations

import os

import torch

import ckptio
from ckptio import Checkpointer, Options
from ckptio.tuning import profile
from ckptio.tuning.profile import tuned_options
from ckptio.storage.local.local_store import LocalStore

MiB = 1 << 20


def _profile_for(directory: str, **fields: object) -> profile.Profile:
    device, kind = profile.filesystem_key(directory)
    values = dict(io_backend="uring", direct_io="off", buffer_bytes=2 * MiB, io_depth=3, fs_type=kind,
                  device=device, measured_at="2026-11-22T00:00:00Z", write_gbps=1.0, read_gbps=1.0)
    values.update(fields)
    return profile.Profile(**values)  # type: ignore[arg-type]


def test_profile_sets_defaulted_io_fields_and_saves_load_through_it(tmp_path: os.PathLike[str]) -> None:
    profile.store(_profile_for(str(tmp_path)))
    chosen = tuned_options(Options(pool_bytes=32 * MiB), str(tmp_path / "ck"))
    assert (chosen.io_backend, chosen.direct_io, chosen.buffer_bytes, chosen.io_depth) == ("uring", "off", 2 * MiB, 3)
    ck = Checkpointer(Options(pool_bytes=32 * MiB))
    state = {"w": torch.randn(3 * MiB // 4)}
    ck.save(state, tmp_path / "ck")
    pool, files = ck.resources().files(LocalStore(str(tmp_path / "ck")))
    backend = files.backend
    assert pool.buffer_bytes == 2 * MiB and backend.depth == 3
    assert torch.equal(ck.load(tmp_path / "ck")["w"], state["w"])
    ck.close()


def test_explicit_options_and_use_profile_false_win(tmp_path: os.PathLike[str]) -> None:
    profile.store(_profile_for(str(tmp_path)))
    explicit = tuned_options(Options(io_backend="uring", io_depth=7, direct_io="on"), str(tmp_path))
    assert (explicit.io_depth, explicit.direct_io) == (7, "on")
    assert tuned_options(Options(use_profile=False), str(tmp_path)) == Options(use_profile=False)
    small_pool = tuned_options(Options(buffer_bytes=MiB, pool_bytes=2 * MiB), str(tmp_path))
    assert small_pool.buffer_bytes == MiB  # a profile's buffer never breaks an explicit pool


def test_corrupt_profile_file_is_ignored(tmp_path: os.PathLike[str]) -> None:
    with open(profile.profile_path(), "w") as f:
        f.write("{not json")
    ckptio.save({"x": torch.ones(3)}, tmp_path / "ck")
    assert torch.equal(ckptio.load(tmp_path / "ck")["x"], torch.ones(3))
    os.unlink(profile.profile_path())
