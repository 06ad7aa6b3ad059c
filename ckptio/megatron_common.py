"""The common state of a Megatron checkpoint the ckptio strategies write: ``common.pt`` (what
Megatron's ``load_common_state_dict`` reads) and its digest in ckptio's manifest, so a load
refuses a ``common.pt`` of another save; where ckptio's checkpoint lies in Megatron's
directory, and the error for a directory that holds none; the run lease of a training
job's save directory (``leased``: one job saving there at a time, dir_leases.py); and the
check, every rank together before any read, that the ShardedObjects asked for were saved.

Owns: ``common.pt``'s bytes, its atomic replacement and its digest check; the process's
leases; MissingInCheckpointError; ckptio's pickle advice in the strategies' terms
(PICKLE_TERMS). Does not own: the strategies (megatron_strategy.py) or what the common state
holds (Megatron's).
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import re
from collections.abc import Iterator
from typing import Any

import torch
import xxhash

from megatron.core.dist_checkpointing.core import CheckpointingException, maybe_load_config

from ckptio.dir_leases import DirectoryLeases, taken_on_rank_0
from ckptio.distributed.dist import job_ranks
from ckptio.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StateMismatchError,
)
from ckptio.format.types import Manifest
from ckptio.options import Options

__all__ = ["BACKEND", "MissingInCheckpointError", "NotCkptioCheckpointError", "check_common",
           "ckptio_dir", "common_bytes", "data_path", "digest_meta", "leased",
           "missing_objects", "object_keys", "PICKLE_TERMS", "write_common", "written_common_meta"]

BACKEND = "ckptio"  # metadata.json's backend for checkpoints the ckptio strategies write

_DIR = "ckptio"  # ckptio's checkpoint inside Megatron's checkpoint directory
_COMMON = "common.pt"  # the file Megatron's load_common_state_dict reads
_DIGEST = "megatron_common_xxh3"
_ITERATION = re.compile(r"iter_\d+")  # Megatron's training saves: <--save>/iter_0000100
# ckptio's allow_pickle advice (ckptio.save / ckptio.load's arguments) -> the strategies'
PICKLE_TERMS = (
    ("pass allow_pickle=True (loading it will then need allow_pickle=True too)",
     "pass CkptioSaveShardedStrategy(allow_pickle=True) (loading it will then need "
     "CkptioLoadShardedStrategy(allow_pickle=True) too)"),
    ("load(..., allow_pickle=True) for a file you trust (or exclude them with keys=...)",
     "CkptioLoadShardedStrategy(allow_pickle=True) for a checkpoint you trust"))
_LEASES = DirectoryLeases("this Megatron job", "pass CkptioSaveShardedStrategy(take_over=True)")
atexit.register(_LEASES.release)  # held until the process ends (its lock goes with it anyway)


class MissingInCheckpointError(StateMismatchError, CheckpointingException):
    """A load asks for keys the checkpoint lacks: a ckptio.StateMismatchError that is also the
    CheckpointingException Megatron's callers catch."""


class NotCkptioCheckpointError(CheckpointNotFoundError, CheckpointingException):
    """The directory holds no ckptio checkpoint (another backend's, or none): a
    ckptio.CheckpointNotFoundError that is also Megatron's CheckpointingException."""


def data_path(checkpoint_dir: str | os.PathLike[str]) -> str:
    """Where ckptio's checkpoint lies inside Megatron's ``checkpoint_dir``."""
    return os.path.join(os.fspath(checkpoint_dir), _DIR)


def common_bytes(common: Any) -> bytes:
    """The common state as ``torch.save`` writes it (what ``common.pt`` holds)."""
    buffer = io.BytesIO()
    torch.save(common, buffer)
    return buffer.getvalue()


def write_common(checkpoint_dir: str, data: bytes | None) -> None:
    """``common.pt`` replaced atomically (written beside it, synced, renamed); None: none to
    write (Megatron wrote it itself, or another rank does)."""
    if data is None:
        return
    target = os.path.join(checkpoint_dir, _COMMON)
    partial = f"{target}.partial-{os.getpid()}"
    with open(partial, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, target)


def _digest(data: bytes) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def digest_meta(data: bytes | None) -> dict[str, Any] | None:
    """The manifest's metadata recording the digest of the common state ``data``."""
    return None if data is None else {_DIGEST: _digest(data)}


def written_common_meta(checkpoint_dir: str) -> dict[str, Any] | None:
    """Where Megatron wrote ``common.pt`` itself before calling the strategy (before 0.19 its
    ``save`` does, on rank 0; the strategy sees no common state): as digest_meta of that file,
    so a load refuses it beside tensors of another save (a save killed while ckptio wrote)."""
    try:
        with open(os.path.join(checkpoint_dir, _COMMON), "rb") as f:
            return digest_meta(f.read())
    except FileNotFoundError:
        return None


def check_common(checkpoint_dir: str, record: Manifest) -> None:
    """Refuse a ``common.pt`` that is not the one this ckptio checkpoint (its manifest
    ``record``, as the load read it) was saved with (a save killed between ckptio's commit and
    ``common.pt``'s replacement or, where Megatron writes ``common.pt`` first, before ckptio's
    commit)."""
    meta = record.meta.get("metadata")
    want = meta.get(_DIGEST) if isinstance(meta, dict) else None
    if want is None:
        return
    path = os.path.join(checkpoint_dir, _COMMON)
    try:
        with open(path, "rb") as f:
            have = _digest(f.read())
    except FileNotFoundError:
        have = None
    if have != want:
        raise CorruptCheckpointError(
            f"{path}: not the common state saved with {data_path(checkpoint_dir)} (a save "
            "into this directory stopped part way, so the two are of different saves); load "
            "an earlier checkpoint or save this one again")


@contextlib.contextmanager
def ckptio_dir(checkpoint_dir: Any) -> Iterator[None]:
    """A missing ckptio checkpoint raised as NotCkptioCheckpointError naming the backend that
    ``metadata.json`` names (torch_dist's: load without the ckptio strategy)."""
    try:
        yield
    except CheckpointNotFoundError as exc:
        config = maybe_load_config(os.fspath(checkpoint_dir))
        backend = None if config is None else config.sharded_backend
        if backend in (None, BACKEND):
            raise NotCkptioCheckpointError(f"{exc} (no ckptio checkpoint in {checkpoint_dir}: "
                                           "was its save finished?)") from exc
        raise NotCkptioCheckpointError(
            f"{checkpoint_dir} holds a {backend!r} checkpoint (its metadata.json), not one the "
            "ckptio strategy wrote; load it without sharded_strategy= (Megatron's own "
            "strategy for that backend), or convert it by saving it again with "
            "CkptioSaveShardedStrategy") from exc


def leased(checkpoint_dir: str, take_over: bool, options: Options | None) -> None:
    """Before a save into Megatron's ``<save>/iter_NNNNNNN``: the run lease of ``<save>``,
    taken by rank 0 at the job's first save there and held until the process ends; another
    job's save there is refused on every rank (CheckpointLockedError naming this job) before
    any rank writes, unless made with ``take_over``. A directory of another name (a save of the
    program's own) is not leased."""
    name = os.path.basename(os.path.normpath(checkpoint_dir))
    if not _ITERATION.fullmatch(name):
        return
    _LEASES.take_over = take_over  # this save's strategy's, not an earlier one's
    taken_on_rank_0(_LEASES, job_ranks(options), os.path.dirname(os.path.abspath(checkpoint_dir)),
                    f"iteration {name}")


def object_keys(tree: Any, name: str) -> list[str]:
    """The saved ShardedObjects' unique keys: the keys of the manifest tree's dict ``name``."""
    top = dict(tree.get("d", [])) if isinstance(tree, dict) else {}
    objects = top.get(name)
    return [str(k) for k, _node in objects.get("d", [])] if isinstance(objects, dict) else []


def missing_objects(path: str, saved: list[str], wanted: list[str],
                    options: Options | None) -> str | None:
    """Every rank together, before anything is read: the ShardedObjects (unique keys) that
    some rank asks for and the checkpoint at ``path`` lacks (``saved``: those it holds) -> the
    same error message on every rank naming each rank's, or None where none lacks any."""
    have = set(saved)
    mine = json.dumps([key for key in wanted if key not in have]).encode()
    ranks = job_ranks(options)
    got = [json.loads(b) for b in ([mine] if ranks is None else ranks.all_gather(mine))]
    missing = {rank: keys[:5] for rank, keys in enumerate(got) if keys}
    if not missing:
        return None
    return (f"{path}: ShardedObjects the checkpoint lacks, asked for by rank(s) {missing}; "
            "nothing was loaded. Build the state as it was saved, or pass a StrictHandling to "
            "dist_checkpointing.load (e.g. strict='log_all', or 'return_all' to get the keys "
            "back) to leave out keys the checkpoint lacks")
