"""Which Store serves a checkpoint location: a registry of location schemes.

A location is a local (or mounted) directory path, or a URL whose scheme is registered here:
``file://`` (a local path), ``shm://NAME`` (host memory that outlives the process: the
directory NAME under the shared-memory root, ``$CKPTIO_SHM_DIR`` or ``/dev/shm/ckptio``, served
as a local directory), ``mem://`` (host memory of this process only, storage/memory.py),
``s3://`` (a prefix in a bucket, storage/s3.py; needs the ``[s3]`` extra), and any scheme a
user registers, as fsspec and torchsnapshot let one plug a storage in:

    ckptio.register_store("myfs", lambda location, options: MyStore(location))
    ckptio.save(state, "myfs://bucket/run/step-100")

The factory gets the location as the user wrote it and the Options in force, and returns a
Store (storage/base.py's contract; ckptio/testing/store_conformance.py is the suite it should
pass). An unregistered scheme is refused (UnsupportedPathError naming the registered ones)
rather than taken for a local folder named ``gs:``.

Owns: turning a user's path (str, PathLike or bytes) into the location string, the scheme
registry, picking the Store, and which store and file a path names when it is a single local
file (a torch.save or safetensors file: the store of its directory). Torch-free, so the
``ckptio`` command reads manifests without importing torch. Does not own: what a store does
(storage/base.py's contract) nor foreign formats (loading/).
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable

from ckptio.errors import CkptError, UnsupportedPathError
from ckptio.options import Options
from ckptio.storage.base import Store
from ckptio.storage.local import LocalStore

__all__ = [
    "StoreFactory",
    "checkpoint_path",
    "is_checkpoint_id",
    "local_path",
    "register_store",
    "registered_schemes",
    "scheme_of",
    "shm_path",
    "shm_root",
    "store_and_file",
    "store_for",
]

StoreFactory = Callable[[str, Options], Store]  # (location as written, options) -> its Store

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_FILE = "file"  # file://PATH is the local path PATH
_SHM = "shm"  # shm://NAME is the directory NAME under shm_root()
SHM_ROOT = "/dev/shm/ckptio"  # tmpfs: host memory, kept after the process exits
_lock = threading.Lock()


def _s3(location: str, options: Options) -> Store:
    from ckptio.io.s3client import S3Settings
    from ckptio.storage.s3 import S3Store

    return S3Store(location, S3Settings.of(options))


def _memory(location: str, options: Options) -> Store:
    from ckptio.storage.memory import MemoryStore

    return MemoryStore(location)


_SCHEMES: dict[str, StoreFactory] = {"s3": _s3, "mem": _memory}
_BUILT_IN = frozenset({*_SCHEMES, _FILE, _SHM})


def register_store(scheme: str, factory: StoreFactory, *, replace: bool = False) -> None:
    """Serve locations ``<scheme>://...`` with the Store ``factory(location, options)``
    makes. A scheme already registered is refused unless ``replace``; the built-in ones
    (file, shm, mem, s3) are never replaced."""
    if not isinstance(scheme, str) or not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", scheme):
        raise CkptError(f"register_store({scheme!r}): a scheme is a letter, then letters, "
                        "digits, '+', '-' or '.' (e.g. 'myfs'), without '://'")
    if not callable(factory):
        raise CkptError(f"register_store({scheme!r}, {factory!r}): the factory must be "
                        "callable as factory(location, options) -> Store")
    key = scheme.lower()
    with _lock:
        if key in _BUILT_IN:
            raise CkptError(f"register_store({scheme!r}): {key}:// is built in and cannot be "
                            "replaced; register another scheme")
        if key in _SCHEMES and not replace:
            raise CkptError(f"register_store({scheme!r}): {key}:// is registered already; "
                            "pass replace=True to replace it")
        _SCHEMES[key] = factory


def registered_schemes() -> list[str]:
    """Every scheme served, ``file`` included, sorted."""
    with _lock:
        return sorted({*_SCHEMES, _FILE, _SHM})


def scheme_of(location: str) -> str | None:
    """The lower-case URL scheme of ``location``, or None for a plain path."""
    match = _URL.match(location)
    return match.group(1).lower() if match else None


def _text(path: str | os.PathLike[str]) -> str:
    text = os.fspath(path)
    return os.fsdecode(text) if isinstance(text, bytes) else text


def _unsupported(text: str, scheme: str) -> UnsupportedPathError:
    served = ", ".join(f"{s}://" for s in registered_schemes())
    return UnsupportedPathError(
        f"{text}: ckptio serves no {scheme}:// locations (served: local paths, {served}); pass "
        "a directory path (e.g. a mounted bucket), or register a store for the scheme with "
        "ckptio.register_store")


def checkpoint_path(path: str | os.PathLike[str]) -> str:
    """The location as a string: a URL of a registered scheme, or a local path (``file://``
    URLs become their path). Another scheme is refused, naming the registered ones."""
    text = _text(path)
    scheme = scheme_of(text)
    if scheme is None:
        return text
    if scheme == _FILE:
        return _file_path(text)
    if scheme == _SHM:
        return shm_path(text)
    with _lock:
        known = scheme in _SCHEMES
    if not known:
        raise _unsupported(text, scheme)
    return text


def _file_path(text: str) -> str:
    rest = text[len("file://"):]
    if rest.startswith("localhost/"):
        rest = rest[len("localhost"):]
    if not rest.startswith("/"):
        raise UnsupportedPathError(f"{text}: a file:// URL names an absolute path "
                                   "(file:///dir/ckpt); pass the path itself")
    return rest


def shm_root() -> str:
    """Where ``shm://`` locations live: ``$CKPTIO_SHM_DIR``, else /dev/shm/ckptio (a tmpfs on
    Linux: its files are host memory, they outlive the process and go with a reboot)."""
    return os.environ.get("CKPTIO_SHM_DIR") or SHM_ROOT


def shm_path(text: str) -> str:
    """The local directory of ``shm://NAME[/step-N]``: NAME under shm_root(). A name that is
    empty, absolute or climbs out (``..``) is refused."""
    rest = text[len("shm://"):].strip("/")
    parts = rest.split("/")
    if not rest or any(p in ("", ".", "..") for p in parts):
        raise UnsupportedPathError(f"{text}: a shm:// location is shm://NAME (e.g. "
                                   "shm://run-7), a relative name under the shared-memory "
                                   f"root {shm_root()} without '.' or '..' parts")
    root = shm_root()
    if not os.path.isdir(os.path.dirname(root.rstrip("/")) or "/"):
        raise UnsupportedPathError(f"{text}: the shared-memory root {root} cannot be made (its "
                                   "parent is not a directory; no /dev/shm here?): set "
                                   "CKPTIO_SHM_DIR to a directory on a tmpfs")
    return os.path.join(root, *parts)


def local_path(path: str | os.PathLike[str]) -> str:
    """The location as a local directory; any URL but ``file://`` is refused rather than taken
    for a local folder named ``s3:``."""
    text = checkpoint_path(path)
    scheme = scheme_of(text)
    if scheme is not None:
        raise UnsupportedPathError(f"{text}: this needs a local (or mounted) directory, not a "
                                   f"{scheme}:// location")
    return text


def store_for(path: str | os.PathLike[str], options: Options | None = None) -> Store:
    """The Store of checkpoint ``path``: the registered scheme's, or a local directory's."""
    text = checkpoint_path(path)
    scheme = scheme_of(text)
    if scheme is None:
        return LocalStore(text)
    with _lock:
        factory = _SCHEMES[scheme]
    store = factory(text, options or Options.from_env())
    if not isinstance(store, Store):
        raise CkptError(f"the store registered for {scheme}:// returned {store!r}, which is not "
                        "a ckptio Store (storage/base.py); fix its factory")
    return store


def store_and_file(path: str | os.PathLike[str],
                   options: Options | None = None) -> tuple[Store, str | None]:
    """The store of checkpoint ``path`` and None; for a local file (a ``torch.save`` or
    safetensors file), the store of its directory and its name."""
    text = checkpoint_path(path)
    if scheme_of(text) is None and os.path.isfile(text):
        return LocalStore(os.path.dirname(os.path.abspath(text))), os.path.basename(text)
    return store_for(text, options), None


def is_checkpoint_id(path: object) -> bool:
    """Whether ckptio serves ``path`` (a local path or a registered scheme's URL; not another
    scheme nor a non-path): DCP's ``validate_checkpoint_id`` for ckptio's reader and writer."""
    try:
        checkpoint_path(path)  # type: ignore[arg-type]
    except (UnsupportedPathError, TypeError):
        return False
    return True
