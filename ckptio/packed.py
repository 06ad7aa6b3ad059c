"""What a save's ``compression`` option and ``base=`` argument make of it: a packed save
(format version 4, saving/packing.py) or a plain one.

Owns: resolving the option ("off", "auto", a codec) against what is installed (a codec that is
not: CkptError naming ``pip install zstandard``; "auto" without it: off, logged once),
the store's measured write rate for "auto" (the tuner's profile, tuning/profile.py; an object
store is known to be slow; a local store with no profile, or one faster than the codec's speed
measured once per process, and no base: a plain save, exactly "off"), and opening the base of
a delta save (a sibling checkpoint of the same kind of store, self-contained). Does not own:
the frames and their files (saving/packing.py), reading a base's bytes (storage/entry_reader.py).
"""

from __future__ import annotations

import functools
import logging
import os
import time

import torch

from ckptio.errors import CkptError, restated
from ckptio.format import codec
from ckptio.options import Options
from ckptio.saving.packing import SPEED_MARGIN, Compression
from ckptio.saving.save_context import Packing
from ckptio.storage.entry_reader import Base, Bases, sibling_location
from ckptio.storage.select import checkpoint_path, store_for
from ckptio.storage.store_contract import Store
from ckptio.tuning import profile

__all__ = ["AUTO_CODEC", "codec_speed", "packing_for"]

log = logging.getLogger("ckptio")
AUTO_CODEC = "bytegroup+zstd"  # docs/PROBES.md: the best ratio at zstd-1's cost
_warned = False


def packing_for(options: Options, store: Store, base: str | os.PathLike[str] | None, *,
                block_nbytes: int) -> Packing | None:
    """The Packing of a save into ``store`` with these options and ``base`` (None: plain)."""
    compression = _compression(options, store, delta=base is not None)
    opened = None if base is None else _open_base(store, base, options, block_nbytes)
    if compression.codec is None and opened is None:
        return None
    return Packing(compression, opened)


def _compression(options: Options, store: Store, *, delta: bool) -> Compression:
    mode = options.compression
    codec_name: str | None = None
    if mode == "auto":
        codec_name = AUTO_CODEC if _installed() else None
    elif mode != "off":
        codec.check_available(mode)
        codec_name = mode
    filesystem = store.capabilities.filesystem
    # the tuned write rate decides only whether a codec pays: no codec, nothing to look up
    measured = (profile.lookup(filesystem) if filesystem is not None and codec_name is not None
                else None)
    write_bps = None if measured is None else measured.write_gbps * 1e9
    remote = store.capabilities.remote
    if mode == "auto" and codec_name is not None and not (delta or remote) and not _codec_pays(
            codec_name, write_bps, options.compress_threads):
        codec_name = None  # decided without a sample: the plain path, exactly "off"'s cost
    return Compression(codec_name, auto=mode == "auto", object_store=remote,
                       write_bps=write_bps, threads=options.compress_threads)


def _codec_pays(name: str, write_bps: float | None, threads: int) -> bool:
    """Whether "auto" may compress on a local store: its tuned write rate is known and below
    the codec's speed on ``threads`` threads (saving/packing.py SPEED_MARGIN)."""
    return write_bps is not None and codec_speed(name) * threads >= SPEED_MARGIN * write_bps


@functools.cache
def codec_speed(name: str) -> float:
    """Bytes/s of codec ``name`` on one thread over 1 MiB of fp32 weights (measured once per
    process, a few milliseconds: what "auto" expects before it samples an entry)."""
    sample = torch.randn(1 << 18, generator=torch.Generator().manual_seed(0)).numpy().tobytes()
    stored = codec.stored_name(name, 4)
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        codec.encode_frame(stored, sample)
        best = min(best, time.perf_counter() - started)
    return len(sample) / max(best, 1e-9)


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
    except CkptError as exc:  # its class kept: an I/O error is not a damaged base
        raise restated(exc, f"save(base={text!r}) cannot use that base: ") from None
