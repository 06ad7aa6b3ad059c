"""Which checkpoint a path names, and how it opens as a Manifest whatever its format.

Owns: the committed ckptio manifest (decoded, values checked, data files present; with peers,
read by one rank and handed to the others: ``ShareManifest``); the dispatch, when a location
holds no ckptio manifest, to the foreign formats ckptio reads: a DCP directory
(loading/dcpdir.py), a torch_checkpointing directory (loading/tcdir.py), a torch.save file
(loading/torchsave_manifest.py), a safetensors file or Hugging Face folder
(loading/safetensors_manifest.py). Does not own: which store and file a path names
(storage/select.py), reading bytes (the caller passes the read function, through its pool and
the store's files), decoding any format (format/, loading/), or loading into a state
(loading/load_session.py, fill.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from ckptio.errors import CheckpointNotFoundError
from ckptio.format import manifest
from ckptio.format.types import Manifest, Read
from ckptio.io.stall import Activity
from ckptio.loading import dcpdir, foreign_common, safetensors_manifest, tcdir, torchsave_manifest
from ckptio.storage import steps
from ckptio.storage.store_contract import Store

__all__ = ["ReadFn", "ShareManifest", "committed", "open_manifest"]

ReadFn = Callable[[list[Read]], int]
# With peers (distributed/loadsteps.SharedManifest): the committed manifest's bytes, produced
# (read and checked) on one rank and handed to every rank; None: read it yourself.
ShareManifest = Callable[[Callable[[], bytes]], bytes | None]


def open_manifest(store: Store, file: str | None, read: ReadFn, *,
                  allow_pickle: bool, every_item: bool = True,
                  shared: ShareManifest | None = None,
                  activity: Activity | None = None) -> Manifest:
    """The committed manifest of ``store``; for a DCP checkpoint (a ``.metadata``, no
    manifest) the Manifest loading/dcpdir.py makes of it (``every_item`` False: its tensor
    items left to be opened where a read needs them), for a torch.save ``file`` in it the
    one loading/torchsave_manifest.py makes, for a torch_checkpointing directory
    loading/tcdir.py's, and for a safetensors file or a Hugging Face folder (an
    index or model.safetensors) loading/safetensors_manifest.py's. ``read`` fills unverified Reads.
    ``shared``: the committed manifest as one rank read it (``committed``). ``activity``: the
    load's (io/stall.py), watching the committed manifest's read."""
    hf = file is not None and safetensors_manifest.is_safetensors_name(file)
    if file is None:
        try:
            return committed(store, shared, activity)
        except CheckpointNotFoundError:
            hf = not foreign_common.holds_dcp(store)
            if hf and tcdir.holds_tc(store):
                return tcdir.open_tc(store, read)
            if hf and not safetensors_manifest.holds_hf(store):
                raise
    if hf:
        record = safetensors_manifest.open_safetensors(store, read, file)
    elif file is not None:
        record = torchsave_manifest.open_torch_save(store, file, read)
    else:
        record = dcpdir.open_dcp(store, read, allow_pickle=allow_pickle, every_item=every_item)
    return record


def committed(store: Store, shared: ShareManifest | None = None,
              activity: Activity | None = None) -> Manifest:
    """The committed manifest of ``store``, decoded, its inline values checked, and every
    data file it names there and long enough (what every read relies on). ``shared``: read
    and its files checked by the rank that produces it; the others decode its bytes (one
    rank's reads of the manifest and of its data files' sizes, not every rank's).
    ``activity``: where those reads are watched (io/stall.py)."""
    where = store.path_of(manifest.MANIFEST_NAME)
    if shared is None:
        return _checked(store, where, activity)[1]
    mine: list[Manifest] = []

    def produce() -> bytes:
        raw, record = _checked(store, where, activity)
        mine.append(record)
        return raw

    raw = shared(produce)
    if mine:
        return mine[0]
    if raw is None:
        return _checked(store, where, activity)[1]
    record = manifest.decode(raw, where)
    manifest.check_values(record, where)
    return record


def _checked(store: Store, where: str, activity: Activity | None) -> tuple[bytes, Manifest]:
    with _call(activity, "read", where):
        raw = store.read_manifest()
    record = manifest.decode(raw, where)
    manifest.check_values(record, where)
    with _call(activity, "size check", f"the data files of {store.location}"):
        steps.check_files(store, record)
    return raw, record


def _call(activity: Activity | None, what: str,
          file: str) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext() if activity is None else activity.call(what, file)
