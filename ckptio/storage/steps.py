"""The save's and load's steps over any Store: what is built from the contract's few operations.

- attempt(): prepare the location; if the save fails, remove its files, unless a manifest that
  names them was committed before the failure (a failed directory fsync after the rename), and
  the location itself where this attempt created it and it is left empty (a directory).
- remove_unreferenced(): after a commit, delete the files a ckptio save created that neither
  the new manifest nor the manifest committed at that moment names. Where the claim of
  exclusive() is not honoured, another save may have committed meanwhile: its files are kept.
- check_files(): every data file a committed manifest names is there, and long enough, and
  no DCP checkpoint beside it; foreign_there(): no DCP checkpoint or Hugging Face weights
  where a ckptio save would write (it would leave both).
- is_committed(): whether a manifest is committed at a location (without reading it).

Owns: those steps' rules and messages. Does not own: how a store does each operation (local/,
memory/), the order of a save (saving/save_session.py), the manifest's content.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
from collections.abc import Iterable, Iterator
from typing import Protocol, runtime_checkable

from ckptio.errors import CkptError, CorruptCheckpointError, StorageIOError
from ckptio.format.manifest import MANIFEST_NAME
from ckptio.format.types import Manifest
from ckptio.storage.store_contract import Store

__all__ = [
    "attempt",
    "check_files",
    "committed_or_none",
    "foreign",
    "foreign_there",
    "is_committed",
    "named",
    "remove_quietly",
    "remove_unreferenced",
]

log = logging.getLogger("ckptio")
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's: another checkpoint in one place
_NAMED = re.compile(rb'"(data-[^"\\]*)"')  # file names in manifest.json (and any such string)


def named(manifest: bytes) -> set[str]:
    """Every file name the manifest bytes mention (a superset: any "data-..." string)."""
    return {m.decode(errors="replace") for m in _NAMED.findall(manifest)}


def committed_or_none(store: Store) -> bytes | None:
    """The committed manifest's bytes; None if there is none or it cannot be read (the caller
    then keeps every file: nothing is known to be superseded)."""
    try:
        return store.read_manifest()
    except CkptError:
        return None


def is_committed(store: Store) -> bool:
    """Whether a manifest is committed at ``store`` (its size only: the manifest is not read)."""
    return MANIFEST_NAME in store.sizes([MANIFEST_NAME])


@contextlib.contextmanager
def attempt(store: Store, names: list[str]) -> Iterator[None]:
    """Prepare the location; if the body fails, remove the save's files ``names``, and the
    location if this call created it and nothing is left in it (an empty directory would list
    as an incomplete step). Nothing else is touched. A failure of that removal is logged and
    noted on the error, never raised in its place."""
    made = isinstance(store, Made) and store.make()
    if not isinstance(store, Made):
        store.prepare()
    try:
        yield
    except BaseException as exc:
        if not _maybe_committed(store, names, exc):  # else keep its files
            remove_quietly(store, names, exc)
            if made and isinstance(store, Made):
                store.remove_if_empty()
        raise


@runtime_checkable
class Made(Protocol):
    """A store whose location is a directory: prepare() that tells whether it created it."""

    def make(self) -> bool: ...

    def remove_if_empty(self) -> None: ...


def _maybe_committed(store: Store, names: Iterable[str], cause: BaseException) -> bool:
    """Whether the committed manifest names any of ``names``, or cannot be read to tell (a
    commit whose answer was lost may have landed: its files are kept, and the next save
    removes them if it did not)."""
    try:
        text = store.read_manifest()
    except StorageIOError as exc:
        log.warning("ckptio: after this failure the manifest of %s could not be read (%s); the "
                    "failed save's files are kept until the next save there", store.location, exc)
        add_note = getattr(cause, "add_note", None)
        if add_note is not None:
            add_note(f"ckptio: the failed save's files in {store.location} were kept: its "
                     "manifest could not be read to tell whether its commit landed")
        return True
    except CkptError:  # none committed, or not a whole manifest
        return False
    return not named(text).isdisjoint(names)


def remove_quietly(store: Store, names: list[str], cause: BaseException) -> None:
    """store.remove() after a failure: what cannot be removed is logged and noted on ``cause``."""
    failed = store.remove(names)
    if failed:
        note = (f"ckptio: after this failure, {len(failed)} file(s) of the failed save could not "
                f"be removed from {store.location} ({failed[0]}); the next save there removes "
                "them")
        log.warning("%s", note)
        add_note = getattr(cause, "add_note", None)  # Python >= 3.11; the log line suffices before
        if add_note is not None:
            add_note(note)


def remove_unreferenced(store: Store, keep: set[str],
                        listed: threading.Event | None = None) -> list[str]:
    """After a commit: delete data and temporary files the committed manifest does not name.

    ``listed`` is set once the files to remove are chosen: the committing save holds its claim
    on the location until then, so no other save has files there yet (a later save may create
    files from then on: they are not on the list). Before removing, the manifest committed at
    that moment is read again and every file it names is kept as well: where the claim is not
    honoured, another save may have committed since. Failures are logged, not raised: the
    checkpoint is already committed and whole; a leftover file is removed by the next save.
    -> the names chosen for removal.
    """
    try:
        try:
            chosen = [name for name in store.names() if name not in keep]
        finally:
            if listed is not None:
                listed.set()
    except StorageIOError as exc:
        log.warning("ckptio: could not remove superseded files in %s: %s", store.location, exc)
        return []
    if not chosen:  # nothing to remove (or the step is gone: a retention removed it meanwhile)
        return []
    text = committed_or_none(store)
    if text is None:  # no manifest readable: nothing is known to be superseded
        log.warning("ckptio: %s has no readable %s after a commit; removing nothing",
                    store.location, MANIFEST_NAME)
        return []
    superseded = named(text)
    removed = [name for name in chosen if name not in superseded]
    failed = store.remove(removed)
    if failed:
        log.warning("ckptio: could not remove superseded files in %s: %s", store.location,
                    "; ".join(failed))
    return removed


def check_files(store: Store, record: Manifest) -> None:
    """CorruptCheckpointError if a data file ``record`` names is missing or shorter than it says;
    CkptError if a DCP checkpoint shares the location (which of the two is current is unknown)."""
    sizes = store.sizes([*(info.name for info in record.files), DCP_METADATA])
    if DCP_METADATA in sizes:
        raise CkptError(
            f"{store.location} holds two checkpoints: a ckptio one ({MANIFEST_NAME}) and a "
            f"torch.distributed.checkpoint (DCP) one ({DCP_METADATA}): one was saved over the "
            "other (dcp.save into a ckptio checkpoint), and which is current cannot be told. Move "
            f"the stale one's files away (DCP's: {DCP_METADATA} and __<rank>_<i>.distcp; "
            f"ckptio's: {MANIFEST_NAME} and data-*), then load")
    for info in record.files:
        file = store.path_of(info.name)
        size = sizes.get(info.name)
        if size is None:
            raise CorruptCheckpointError(
                f"data file {file} named by the manifest is missing; the checkpoint is damaged: "
                "load an earlier one")
        if size < info.nbytes:
            raise CorruptCheckpointError(
                f"data file {file} is truncated: {size} of {info.nbytes} bytes; the checkpoint is "
                "damaged: load an earlier one")


def foreign(store: Store) -> str | None:
    """What another library's checkpoint ``store`` holds (DCP's, a Hugging Face folder's
    weights), in words, or None."""
    found = _foreign_found(store)
    return None if found is None else found[0]


def foreign_there(store: Store, writer: str) -> None:
    """CkptError if ``store`` holds a DCP checkpoint (its ``.metadata``) or a Hugging Face
    folder's weights: ``writer`` (a ckptio save, with or without overwrite) would leave both,
    and dcp.load, torchtitan's scan or from_pretrained would go on reading the old one."""
    found = _foreign_found(store)
    if found is not None:
        what, reader = found
        raise CkptError(
            f"{store.location} holds {what}: {writer} there would leave both, and {reader} "
            "would go on reading the old one; nothing was written. Save to another path, or "
            "move that checkpoint away first (ckptio.load reads it; ckptio convert copies it "
            "into a ckptio checkpoint)")


def _foreign_found(store: Store) -> tuple[str, str] | None:
    """(what, its reader) of the first of _FOREIGN's files ``store`` holds, or None."""
    found = store.sizes(_FOREIGN)
    return next((kind for name, kind in _FOREIGN.items() if name in found), None)


_FOREIGN = {  # another library's checkpoint a ckptio save must not be written beside
    DCP_METADATA: ("a torch.distributed.checkpoint (DCP) checkpoint (.metadata and "
                   "__<rank>_<i>.distcp files)", "DCP's readers"),
    "model.safetensors": ("a Hugging Face folder's weights (model.safetensors)", "from_pretrained"),
    "model.safetensors.index.json": ("a Hugging Face folder's weights (an index and its shards)",
                                     "from_pretrained"),
}
