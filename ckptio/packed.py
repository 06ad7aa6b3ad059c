"""What a save's ``compression`` option and ``base=`` argument make of it: a packed save
(format version 4, saving/packing.py) or a plain one.

Owns: resolving the option ("off", "auto", a codec) against what is installed (a codec that is
not: CkptError naming ``pip install 'ckptio[compress]'``; "auto" without it: off, logged once),
the store's measured write rate for "auto" (the tuner's profile, tuning/profile.py; an object
store is known to be slow), and opening the base of a delta save (a sibling checkpoint of the
same kind of store, self-contained). Does not own: the frames and their files (saving/packing.py),
reading a base's bytes (storage/coded.py).
"""

from __future__ import annotations

import logging
import os

from ckptio.errors import CkptError
from ckptio.format import codec
from ckptio.options import Options
from ckptio.saving.packing import Compression
from ckptio.saving.session import Packing
from ckptio.storage.base import Store
from ckptio.storage.coded import Base, Bases, sibling_location
from ckptio.storage.select import checkpoint_path, store_for
from ckptio.tuning import profile

__all__ = ["AUTO_CODEC", "packing_for"]

log = logging.getLogger("ckptio")
AUTO_CODEC = "bytegroup+zstd"  # docs/PROBES.md: the best ratio at zstd-1's cost
_warned = False


def packing_for(options: Options, store: Store, base: str | os.PathLike[str] | None, *,
                block_nbytes: int) -> Packing | None:
    """The Packing of a save into ``store`` with these options and ``base`` (None: plain)."""
    compression = _compression(options, store)
    opened = None if base is None else _open_base(store, base, options, block_nbytes)
    if compression.codec is None and opened is None:
        return None
    return Packing(compression, opened)


def _compression(options: Options, store: Store) -> Compression:
    mode = options.compression
    codec_name: str | None = None
    if mode == "auto":
        codec_name = AUTO_CODEC if _installed() else None
    elif mode != "off":
        codec.check_available(mode)
        codec_name = mode
    filesystem = store.capabilities.filesystem
    measured = profile.lookup(filesystem) if filesystem is not None else None
    return Compression(codec_name, auto=mode == "auto",
                       object_store=store.capabilities.remote,
                       write_bps=None if measured is None else measured.write_gbps * 1e9,
                       threads=options.compress_threads)


def _installed() -> bool:
    global _warned
    try:
        codec.check_available(AUTO_CODEC)
    except CkptError as exc:
        if not _warned:
            _warned = True
            log.warning("ckptio: compression='auto' saves uncompressed: %s", exc)
        return False
    return True


def _open_base(store: Store, base: str | os.PathLike[str], options: Options,
               block_nbytes: int) -> Base:
    """The base checkpoint of a delta save: a sibling of the checkpoint being written."""
    text = checkpoint_path(base)
    name = text.rstrip("/").rpartition("/")[2]
    base_store = store_for(text, options)
    if (sibling_location(store.location, name) != base_store.location
            or base_store.location == store.location):
        raise CkptError(f"save(base={text!r}): a base must be another checkpoint in the same "
                        f"directory (prefix) as {store.location}, e.g. "
                        f"{sibling_location(store.location, 'step-00000100')}")
    bases = Bases(store.location, lambda where: store_for(where, options),
                  block_nbytes=block_nbytes)
    try:
        return bases.get(name)
    except CkptError as exc:
        raise CkptError(f"save(base={text!r}) cannot use that base: {exc}") from None
