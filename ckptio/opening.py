"""Which checkpoint a path names, and how it opens as a Manifest whatever its format.

Owns: a path -> (Store, file name or None) (a local file is a torch.save or safetensors file in
its directory's store); the committed ckptio manifest (decoded, values checked, data files
present); the dispatch, when a location holds no ckptio manifest, to the foreign formats
ckptio reads: a DCP directory (loading/foreign.py), a torch.save file (loading/torchsave.py), a
safetensors file or Hugging Face folder (loading/safetensors.py). Does not own: reading bytes
(the caller passes the read function, through its pool and backend), decoding any format
(format/, loading/), or loading into a state (api, loading/fill.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from ckptio.errors import CheckpointNotFoundError, CkptError
from ckptio.format import manifest
from ckptio.format.types import Manifest, Read
from ckptio.io.s3client import is_s3
from ckptio.loading import foreign, safetensors, torchsave
from ckptio.options import Options
from ckptio.storage import steps
from ckptio.storage.base import Store
from ckptio.storage.local import LocalStore
from ckptio.storage.select import checkpoint_path, store_for

__all__ = ["committed", "data_dir", "open_manifest", "target"]

ReadFn = Callable[[list[Read]], int]


def target(path: str | os.PathLike[str], options: Options) -> tuple[Store, str | None]:
    """The store of checkpoint ``path`` and None; for a local file (a ``torch.save`` or
    safetensors file), the store of its directory and its name."""
    text = checkpoint_path(path)
    if not is_s3(text) and os.path.isfile(text):
        return LocalStore(os.path.dirname(os.path.abspath(text))), os.path.basename(text)
    return store_for(text, options), None


def open_manifest(store: Store, file: str | None, read: ReadFn, *,
                  allow_pickle: bool) -> Manifest:
    """The committed manifest of ``store``; for a DCP checkpoint (a ``.metadata``, no
    manifest) the Manifest loading/foreign.py makes of it, for a torch.save ``file`` in it the
    one loading/torchsave.py makes, and for a safetensors file or a Hugging Face folder (an
    index or model.safetensors) loading/safetensors.py's. ``read`` fills unverified Reads."""
    hf = file is not None and safetensors.is_safetensors_name(file)
    if file is None:
        try:
            return committed(store)
        except CheckpointNotFoundError:
            hf = not foreign.holds_dcp(store)
            if hf and not safetensors.holds_hf(store):
                raise
    if hf:
        record = safetensors.open_safetensors(store, read, file)
    elif file is not None:
        record = torchsave.open_torch_save(store, file, read)
    else:
        record = foreign.open_dcp(store, read, allow_pickle=allow_pickle)
    data_dir(store, record)
    return record


def committed(store: Store) -> Manifest:
    """The committed manifest of ``store``, decoded, its inline values checked, and every
    data file it names there and long enough (what every read relies on)."""
    where = store.path_of(manifest.MANIFEST_NAME)
    record = manifest.decode(store.read_manifest(), where)
    manifest.check_values(record, where)
    steps.check_files(store, record)
    return record


def data_dir(store: Store, record: Manifest) -> str:
    """The ``directory`` loading/read.py and saving/persist.py take: they reach a data file as
    ``os.path.join(directory, name)``, which must be the store's ``path_of(name)``."""
    for info in record.files:
        if os.path.join(store.location, info.name) != store.path_of(info.name):
            raise CkptError(f"{store.location}: its data files are not reached by directory and "
                            f"name ({store.path_of(info.name)}), which loading needs until it "
                            "takes path_of; load it from a local directory")
    return store.location
