"""``export_hf``: any checkpoint ckptio loads, written as a Hugging Face safetensors directory.

    ckptio.export_hf("ckpts/step-1000", "hf/", keys="model.", copy_from="configs/")

Steps (one process, or every rank of a process group together):

1. open the source as a load does and plan the export (planning/export_plan.py, pure): names,
   files, offsets; files go to ranks by bytes. One collective step: every rank planned; the
   coordinator checks ``dst`` (empty, or ``overwrite``) and hands out the temp-file token.
2. each rank streams its files (saving/stream.py): every window's flat element ranges read by
   loading/read.py (resharded, checksums verified), cast when ``dtype`` asks, written aligned
   into ``.<name>.ckptio-<token>.tmp``, cut to size and fsynced.
3. one collective step "every file written"; its decision on the coordinator is the commit:
   ``copy_from`` copied, the temp files renamed, stale shards removed, the index written last.
   A failure on any rank removes every temp file and raises on every rank.
What the commit does in detail and the memory an export holds: on ``export_hf``.

Owns: the order of those steps and the commit. Does not own: the plan (planning/export_plan.py), the
header bytes (format/safetensors.py), a window's bytes (export_fill.py), reading (loading/read.py
via Checkpointer.reader), the write loop (saving/stream.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ckptio.alignment import BLOCK, align_down
from ckptio.api import Checkpointer
from ckptio.distributed import wire
from ckptio.distributed.dist import Group, Solo, current_group, over_torch
from ckptio.distributed.step import coordinate, listed
from ckptio.errors import CkptError, StorageIOError, UnsupportedPathError
from ckptio.format import safetensors as st
from ckptio.destination import held_at
from ckptio.export_fill import Scratch, fill_window
from ckptio.format.types import Manifest, Read
from ckptio.io.buffers import Buffer
from ckptio.io.stage import StagingPool
from ckptio.options import Options
from ckptio.planning.export_plan import (
    ExportFile,
    ExportPlan,
    Window,
    assign,
    plan_export,
    windows,
)
from ckptio.saving.stream import write_windows
from ckptio.storage.folder import check_parents, files_under, make_parents
from ckptio.storage.local.durable import fsync_path, write_durably
from ckptio.storage.s3.s3path import is_s3
from ckptio.storage.select import compared, local_path, store_for

__all__ = ["HFExport", "export_hf"]

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")
_WINDOWS = 2  # window buffers: one being filled while the other is written


@dataclass(frozen=True)
class HFExport:
    """What ``export_hf`` wrote: the directory, its safetensors files (all ranks'), the index
    totals, the alias keys left out (tied weights), bytes this rank wrote, seconds."""

    path: str
    files: tuple[str, ...]
    total_size: int
    total_parameters: int
    dropped: tuple[str, ...]
    nbytes_written: int
    seconds: float


def export_hf(src: str | os.PathLike[str], dst: str | os.PathLike[str], *,
              keys: str | None = "model.", rename: Callable[[str], str | None] | None = None,
              dtype: torch.dtype | str | None = None, max_shard_bytes: int = 5 * 10**9,
              copy_from: str | os.PathLike[str] | None = None, overwrite: bool = False,
              metadata: dict[str, str] | None = None, options: Options | None = None,
              verify: bool | None = None, process_group: Any = None,
              progress: Callable[[int, int], None] | None = None) -> HFExport:
    """Write the tensors of checkpoint ``src`` under ``keys`` (a prefix, stripped; None: all)
    as Hugging Face safetensors shards of at most ``max_shard_bytes`` plus
    ``model.safetensors.index.json`` in the local directory ``dst``.

    rename: maps each (stripped) key to its exported name, or None to leave it out.
    dtype: convert floating tensors (float64/32/16, bfloat16) to this one, e.g. torch.bfloat16.
    copy_from: a directory whose other files (config.json, tokenizer files) and subfolders
    (sentence-transformers' ``1_Pooling/``) are copied along; a symlink out of it is refused.
    overwrite: replace what ``dst`` holds (refused otherwise when it is not empty).
    metadata: extra ``__metadata__`` strings for every file (``format: pt`` is always there).
    verify: check the source's checksums as it is read (default Options.verify). A DCP or
    torch.save source has one checksum per whole entry: a tensor of it that windows cut is
    verified whole once before the export, then read in parts unchecked.
    progress: called with (bytes written, bytes in all) of this rank's files after each window.
    With torch.distributed initialised (or ``process_group``), every rank calls this together
    and the files are split between the ranks by bytes.

    The source is anything a load opens (ckptio manifest, DCP dir, torch.save file,
    safetensors), read from whatever chunks, DTensor shards or flat partitions it holds.
    Memory: the read pool plus two windows (plus, when ``dtype`` converts, a scratch of up to
    the window's saved bytes). The commit copies the files and subfolders of ``copy_from``,
    renames the temp files, removes stale shards of an overwritten export, and writes
    ``model.safetensors.index.json`` last (tmp + rename, directory fsynced; a single
    ``model.safetensors`` has no index). The directory is complete once the index (or the
    single file) exists.
    """
    started = time.perf_counter()
    out = _destination(dst)
    out_dtype = None if dtype is None else str(dtype).removeprefix("torch.")
    options = options or Options.from_env()
    group: Group = Solo() if (g := current_group(process_group)) is None else over_torch(g, options)
    window_bytes = _window_bytes(options)
    # the staging pool, split: half for the source's reads, half for the windows written (a
    # pool of under four buffers still gets two read buffers: what a Checkpointer needs)
    checkpointer = Checkpointer(dataclasses.replace(
        options, pool_bytes=max(2 * options.buffer_bytes,
                                options.pool_bytes - _WINDOWS * window_bytes)))
    try:
        plan: ExportPlan | None = None
        error: BaseException | None = None
        try:
            record = checkpointer.manifest(src)
            source = _Source(checkpointer, src, record,
                             checkpointer.options.verify if verify is None else verify)
            plan = plan_export(record, keys=keys, rename=rename, dtype=out_dtype,
                               max_shard_bytes=max_shard_bytes, align=BLOCK, metadata=metadata)
        except Exception as exc:  # noqa: BLE001 - raised on every rank by the step below
            error = exc
        token = _agree(group, plan, error, out, overwrite, copy_from)
        assert plan is not None  # internal: _agree raised otherwise
        mine = assign(plan.files, group.size)[group.rank]
        written, error = 0, None
        try:
            written = _write_files(source, [plan.files[i] for i in mine], out, token,
                                   window_bytes, progress)
        except Exception as exc:  # noqa: BLE001 - raised on every rank by the step below
            error = exc
        _commit(group, plan, error, out, token, copy_from, overwrite)
    finally:
        checkpointer.close()
    return HFExport(out, tuple(f.name for f in plan.files), plan.total_size,
                    plan.total_parameters, plan.dropped, written, time.perf_counter() - started)


def _destination(dst: str | os.PathLike[str]) -> str:
    text = os.fsdecode(os.fspath(dst))
    if not text:
        raise CkptError("export_hf(dst=''): the destination is empty (an unset variable?); "
                        "give the Hugging Face directory to write")
    if is_s3(text):
        raise UnsupportedPathError(f"export_hf(dst={text!r}): the export goes to a local (or "
                                   "mounted) directory; copy it to object storage afterwards")
    return os.path.abspath(local_path(text))


def _failed(what: str) -> Callable[[list[str]], str]:
    return lambda failures: f"export_hf: {what} failed on another rank ({listed(failures)})"


def _agree(group: Group, plan: ExportPlan | None, error: BaseException | None, out: str,
           overwrite: bool, copy_from: str | os.PathLike[str] | None) -> str:
    """Step 1: every rank planned the same files; ``dst`` is usable; -> the temp-file token."""
    mine = b"" if plan is None else wire.with_location(
        compared(out), repr([(f.name, f.nbytes) for f in plan.files]).encode())

    def decide(sent: list[bytes]) -> list[bytes]:
        split = [wire.split_location(message) for message in sent]
        outs, plans = [where for where, _ in split], [body for _, body in split]
        if len(set(outs)) > 1:
            raise CkptError(
                "export_hf: ranks disagree on the destination: " + "; ".join(
                    f"rank {r}: {o}" for r, o in enumerate(outs)) + ". Every rank writes its "
                "share of one export: pass the same dst on every rank")
        if any(p != plans[0] for p in plans):
            raise CkptError("export_hf: the ranks planned different files (was the source "
                            "checkpoint changing, or were the arguments different?)")
        if copy_from is not None:
            _check_copy_from(os.fspath(copy_from), out)
        _check_destination(out, overwrite)
        return [uuid.uuid4().hex[:12].encode()] * len(plans)

    answer = coordinate(group, mine, error, decide, _failed("planning"))
    if answer is None:
        assert error is not None  # internal: coordinate's contract
        raise error
    return answer.decode()


def _check_copy_from(source: str, out: str) -> None:
    """A folder, not holding ``out``, whose walk finds nothing it refuses, and no symlink in
    ``out`` where its subfolders go: checked before any write."""
    if not os.path.isdir(source):
        raise CkptError(f"export_hf(copy_from={source!r}): not a directory (the folder whose "
                        "config and tokenizer files go along)")
    real = os.path.realpath(source)
    if os.path.commonpath([real, os.path.realpath(out)]) == real:
        raise CkptError(f"export_hf(copy_from={source!r}): the destination {out} is inside it; "
                        "export to a folder outside the one copied from")
    for rel in files_under(source):
        check_parents(out, rel)


def _check_destination(out: str, overwrite: bool) -> None:
    if os.path.exists(out) and not os.path.isdir(out):
        raise CkptError(f"export_hf: {out} exists and is not a directory")
    held = held_at(out) if os.path.isdir(out) else None
    if held not in (None, "a Hugging Face folder"):  # overwrite replaces an export only
        raise CkptError(f"export_hf: {out} holds {held}; an export writes its files beside "
                        "that one's (overwrite replaces an export only), so the directory would "
                        "hold both: remove it first or choose another directory")
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
        raise CkptError(f"export_hf: {out} is not empty; choose an empty or new directory, or "
                        "pass overwrite=True (ckptio export --overwrite) to replace its export")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as exc:
        raise StorageIOError(f"export_hf: cannot create {out}: {exc}") from None


def _tmp(out: str, name: str, token: str) -> str:
    return os.path.join(out, f".{name}.ckptio-{token}.tmp")


def _remove_temps(out: str, token: str) -> None:
    """Every temp file of this export (shards, copied files, the index): ``_tmp``'s names
    with this export's token."""
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(out):
            if name.startswith(".") and name.endswith(f".ckptio-{token}.tmp"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(out, name))


def _window_bytes(options: Options) -> int:
    """How much of an output file one window holds: a quarter of the pool (two windows, one
    filled while the other is written, and half the pool for the reads that fill them), so
    each window's reads run io_depth deep; at least one buffer, a multiple of BLOCK."""
    quarter = align_down(options.pool_bytes // (2 * _WINDOWS))
    return max(options.buffer_bytes, quarter)


@dataclass
class _Source:
    """The checkpoint exported, and how its reads are checked."""

    checkpointer: Checkpointer
    path: str | os.PathLike[str]
    record: Manifest
    verify: bool
    checked: frozenset[str] = frozenset()  # keys verified whole up front: read unchecked

    def check_cut(self, files: list[ExportFile], window_bytes: int) -> None:
        """Where one checksum covers a whole entry (DCP, torch.save: ``block_nbytes`` beyond a
        window), a verified read of part of it reads all of it, once per window that cuts the
        tensor; instead, those entries are verified once here (read through the pool, copied
        nowhere), and their parts then read unchecked."""
        if not self.verify or self.record.block_nbytes <= window_bytes:
            return
        cut = {p.tensor.source.key: p.tensor.source.entries for f in files
               for w in windows(f, window_bytes) for p in w.parts
               if p.count != p.tensor.source.numel}
        if cut:
            self.checkpointer.read(self.path, self.record,
                                   [Read.of(e) for entries in cut.values() for e in entries])
            self.checked = frozenset(cut)

    def read(self, reads: list[Read]) -> int:
        checked = [r for r in reads if r.key in self.checked]
        rest = [r for r in reads if r.key not in self.checked]
        nbytes = 0
        for batch, verify in ((rest, self.verify), (checked, False)):
            if batch:
                nbytes += self.checkpointer.read(self.path, self.record, batch, verify=verify)
        return nbytes


def _write_files(source: _Source, files: list[ExportFile], out: str, token: str,
                 window_bytes: int, progress: Callable[[int, int], None] | None) -> int:
    """Step 2: this rank's files, each streamed into its temp file (``progress`` told after
    each window is filled)."""
    if not files:
        return 0
    total, filled = sum(f.nbytes for f in files), [0]
    source.check_cut(files, window_bytes)
    checkpointer = source.checkpointer
    backend = store_for(out, checkpointer.options).backend(checkpointer.options)
    pool = StagingPool(_WINDOWS, window_bytes, prefault=False)  # faults overlap the reads
    scratch = Scratch()
    written = 0
    try:
        for file in files:
            def fill(window: Window, buffer: Buffer, file: ExportFile = file) -> None:
                fill_window(window, buffer, file.header, source.read, scratch)
                if progress is not None:
                    filled[0] += window.nbytes
                    progress(filled[0], total)

            written += write_windows(backend, pool, _tmp(out, file.name, token), file.nbytes,
                                     windows(file, window_bytes), fill)
    finally:
        pool.close()
        backend.shutdown()
    return written


def _commit(group: Group, plan: ExportPlan, error: BaseException | None, out: str, token: str,
            copy_from: str | os.PathLike[str] | None, overwrite: bool) -> None:
    """Step 3: every file written; the coordinator commits. Any failure removes the temp files
    (those of this export's token) and raises on every rank."""
    def decide(messages: list[bytes]) -> list[bytes]:
        try:
            _publish(plan, out, token, copy_from, overwrite)
        except BaseException:
            _remove_temps(out, token)
            raise
        return [b""] * len(messages)

    try:
        answer = coordinate(group, b"", error, decide, _failed("writing"))
    except BaseException:
        _remove_temps(out, token)
        raise
    if answer is None:
        _remove_temps(out, token)
        assert error is not None  # internal: coordinate's contract
        raise error


def _publish(plan: ExportPlan, out: str, token: str, copy_from: str | os.PathLike[str] | None,
             overwrite: bool) -> None:
    """Copy ``copy_from``'s files, rename the temp files, drop stale shards, write the index."""
    index = os.path.join(out, st.INDEX_NAME)
    try:
        if overwrite:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(index)  # the old export is incomplete from here on
        if copy_from is not None:
            _copy_files(os.fspath(copy_from), out, token)
        names = {f.name for f in plan.files}
        for name in names:
            os.replace(_tmp(out, name, token), os.path.join(out, name))
        for name in os.listdir(out):
            if overwrite and st.is_shard_name(name) and name not in names:
                os.unlink(os.path.join(out, name))
        if len(plan.files) > 1:
            tmp = _tmp(out, st.INDEX_NAME, token)
            write_durably(tmp, st.encode_index(plan.weight_map, plan.total_size,
                                                {"total_parameters": plan.total_parameters}))
            os.replace(tmp, index)
        fsync_path(out)
    except OSError as exc:
        raise StorageIOError(f"export_hf: committing {out}: {exc}") from None


def _copy_files(source: str, out: str, token: str) -> None:
    """``copy_from``'s files and subfolders (storage/folder.py walks it safely); weights and
    an index are left out at the top level only (a subfolder's, such as sentence-transformers'
    ``2_Dense/model.safetensors``, belong to another module and go along)."""
    for i, rel in enumerate(files_under(source)):
        if "/" not in rel and (rel.endswith(_WEIGHT_SUFFIXES) or rel == st.INDEX_NAME):
            continue
        target = os.path.join(out, *rel.split("/"))
        make_parents(out, rel)
        tmp = _tmp(out, f"copy-{i}", token)  # at the top: _remove_temps finds it
        shutil.copyfile(os.path.join(source, *rel.split("/")), tmp)
        fsync_path(tmp)
        os.replace(tmp, target)
        if "/" in rel:
            fsync_path(os.path.dirname(target))

