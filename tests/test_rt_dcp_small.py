"""A DCP directory of small items is read about once (issue 67, "replicas read once").

Opening a DCP directory reads every tensor item's head and tail (the zip framing around its
bytes); on local storage that round must read only those, not through each item's bytes
between them (a load then reads the bytes again, by O_DIRECT not from the page cache). Counted
at the store's backend (every byte a load asks storage for), through ``ckptio.Checkpointer``'s
``resources().wrap_backend``: one process, and 2 gloo ranks loading a replicated state with
shared reads, each read at most 1.3 times the directory's bytes in all, and every tensor bitwise
what ``dcp.load`` gives. A directory of large items reads as before (about once). A store
that says it is remote (an object store, where a request costs more than the bytes through a
gap), or says nothing of itself, still opens the directory in a few wide requests, not one per
item, as before. A torch.save file of small tensors is read about once too (its records'
headers are probed the same way)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptio
from ckptio.loading import load_session
from ckptio.storage.local.local_store import LocalStore
from ckptio.storage.store_contract import Capabilities
from ckptio.testing.rank_processes import run_ranks
from tests.conftest import CountingReads

SMALL = (100, 50_000)  # tensors, float32 elements each: items of 200 KB, a 20 MB directory
LARGE = (4, 1_100_000)  # items of 4.4 MB


class _RemoteLike(LocalStore):
    """A local directory that says it is across a network, as S3, GCS and Azure stores do."""

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(direct_io=True, remote=True)


class _Plain(LocalStore):
    """A local directory that says nothing of itself, as a user's store may (no O_DIRECT)."""

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities()


def _state(shape: tuple[int, int]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(67)
    return {f"layer{i}.weight": torch.randn(shape[1], generator=gen) for i in range(shape[0])}


def _zeroed(shape: tuple[int, int]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in _state(shape).items()}


def _data_nbytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.name != ".metadata")


def _counted_load(path: str, shape: tuple[int, int]) -> tuple[int, dict[str, torch.Tensor]]:
    """ckptio's load of ``path`` into a zeroed state, in place -> (bytes asked of storage,
    the state)."""
    ck = ckptio.Checkpointer()
    try:
        counting = ck.resources().wrap_backend(LocalStore(path), CountingReads)
        state = _zeroed(shape)
        report = ck.load(path, state)
        assert not report.missing and not report.unexpected, report
        return counting.nbytes, state
    finally:
        ck.close()


def _dcp_loaded(path: str, shape: tuple[int, int]) -> dict[str, torch.Tensor]:
    state = _zeroed(shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        dcp.load(state, checkpoint_id=path)
    return state


def _bits(state: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {k: bytes(v.reshape(-1).view(torch.uint8).numpy()) for k, v in state.items()}


def _saved(path: Path, shape: tuple[int, int]) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(_state(shape), checkpoint_id=str(path))
    return path


@pytest.mark.parametrize("shape", [SMALL, LARGE], ids=["small-items", "large-items"])
def test_one_process_reads_a_dcp_directory_about_once(tmp_path: Path,
                                                      shape: tuple[int, int]) -> None:
    path = _saved(tmp_path / "ckpt", shape)
    nbytes, loaded = _counted_load(str(path), shape)
    data = _data_nbytes(path)
    assert data >= shape[0] * shape[1] * 4
    assert nbytes <= 1.3 * data, f"read {nbytes / data:.2f}x the directory's {data} bytes"
    assert _bits(loaded) == _bits(_dcp_loaded(str(path), shape)) == _bits(_state(shape))


def replicated_save(rank: int, world: int, path: str) -> None:
    dcp.save(_state(SMALL), checkpoint_id=path)  # the same on every rank: written once


def replicated_load(rank: int, world: int, path: str) -> dict[str, Any]:
    nbytes, loaded = _counted_load(path, SMALL)
    state = _zeroed(SMALL)
    dcp.load(state, checkpoint_id=path)
    return {"nbytes": nbytes, "same": _bits(loaded) == _bits(state) == _bits(_state(SMALL))}


def test_two_ranks_read_a_dcp_directory_of_small_items_about_once(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    run_ranks(2, replicated_save, str(path), timeout_s=240)
    results = run_ranks(2, replicated_load, str(path), timeout_s=240)
    data = _data_nbytes(path)
    assert all(r["same"] for r in results), "a tensor differs from dcp.load's"
    total = sum(r["nbytes"] for r in results)
    assert total <= 1.3 * data, (f"2 ranks read {total / data:.2f}x the directory's {data} "
                                 f"bytes ({[r['nbytes'] for r in results]} per rank)")


@pytest.mark.parametrize("store", [LocalStore, _RemoteLike, _Plain], ids=["local", "remote", "plain"])
def test_the_open_reads_item_framing_alone_locally_and_few_wide_requests_remotely(
        tmp_path: Path, store: type[LocalStore]) -> None:
    path = _saved(tmp_path / "ckpt", SMALL)
    ck = ckptio.Checkpointer()
    try:
        counting = ck.resources().wrap_backend(store(path), CountingReads)
        opened = load_session.open_checkpoint(ck.resources(), store(path), None,
                                              allow_pickle=False)
    finally:
        ck.close()
    assert len(opened.record.tensors) == SMALL[0]
    data = _data_nbytes(path)
    if store is LocalStore:  # heads and tails: a few blocks of each item
        assert counting.nbytes <= 0.1 * data, (counting.nbytes, counting.requests)
    else:  # read through the items: one request per pool buffer, not one per item
        assert counting.nbytes >= 0.9 * data and counting.requests < SMALL[0] // 4, counting.requests


def test_a_torch_save_file_of_small_tensors_is_read_about_once(tmp_path: Path) -> None:
    """The same probe opens a torch.save file: each record's local header, not the bytes
    between them."""
    torch.save(_state(SMALL), tmp_path / "model.pt")
    ck = ckptio.Checkpointer()
    try:
        counting = ck.resources().wrap_backend(LocalStore(tmp_path), CountingReads)
        state = _zeroed(SMALL)
        ck.load(tmp_path / "model.pt", state)
    finally:
        ck.close()
    size = (tmp_path / "model.pt").stat().st_size
    assert counting.nbytes <= 1.3 * size, f"read {counting.nbytes / size:.2f}x the file"
    assert _bits(state) == _bits(torch.load(tmp_path / "model.pt", weights_only=True))
