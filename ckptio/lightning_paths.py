"""Where Lightning's own path handling meets ckptio's storage, for ckptio/lightning.py.

- Lightning's ModelCheckpoint (and its search for ``last*.ckpt``) reaches a ``dirpath``
  through fsspec, before any CheckpointIO plugin sees a path. fsspec knows none of ckptio's own
  URL schemes (``shm://``, ``mem://``): such a dirpath failed inside fsspec with "Protocol not
  known". ``refuse_in_fsspec()`` registers, for each scheme ckptio serves and fsspec does not
  know, an fsspec filesystem that refuses the URL with a CkptError naming what to pass instead
  (for ``shm://NAME``: the local directory it names).
- A ``file://`` dirpath is one fsspec serves, and ModelCheckpoint makes it absolute with
  ``os.path.realpath``, which takes the URL for a relative path: ``file:///data/run`` became
  ``<cwd>/file:/data/run``, where the checkpoints landed (and a resume from /data/run found
  none). ``check_path`` refuses a path holding a directory named as a scheme (``file:``),
  naming the path meant.

- Where the plugin removes a checkpoint (``remove_directory``: renamed out of Lightning's
  sight first; ``remove_remote``: an object store's manifest first) and which one a resume from
  a never-committed ``last.ckpt`` takes (``committed_instead_of_last``).

Call order: ``refuse_in_fsspec()`` once, at ``import ckptio.lightning``; a plugin's saves call
``check_path(path)``, its removals and loads the others.

Owns: those fsspec registrations and their wording, the removals' order, the fallback from
``last.ckpt``. Does not own: the plugins (lightning.py), the run leases of the directories they
save into (dir_leases.py).
"""

from __future__ import annotations

import importlib
import os
import re
import secrets
import shutil
import warnings
from typing import Any

from ckptio.errors import CkptError, StorageIOError
from ckptio.format.manifest import MANIFEST_NAME
from ckptio.options import Options
from ckptio.shared import load
from ckptio.storage.local.durable import fsync_path
from ckptio.storage.local.local_root import is_committed
from ckptio.storage.select import checkpoint_path, registered_schemes, scheme_of, store_for
from ckptio.storage.store_contract import TreeStore

__all__ = ["check_path", "committed_instead_of_last", "refuse_in_fsspec", "remove_directory",
           "remove_remote"]

_HIDDEN = re.compile(r"\.deleting-.+-[0-9a-f]{8}$")  # a removal's rename, hidden from Lightning


_SCHEME_DIR = re.compile(r"/([A-Za-z][A-Za-z0-9+.-]*):/(.*)\Z", re.DOTALL)


def check_path(path: str) -> None:
    """Refuse a local checkpoint ``path`` with a directory named as a ckptio scheme
    (``.../file:/data/run/last.ckpt``): a URL that Lightning took for a relative path."""
    found = None if scheme_of(path) is not None else _SCHEME_DIR.search(path)
    if found is None or found.group(1).lower() not in registered_schemes():
        return
    scheme, rest = found.group(1), found.group(2)
    raise CkptError(
        f"{path}: a checkpoint path with a directory named {scheme + ':'!r}: Lightning's "
        f"ModelCheckpoint took a {scheme}:// dirpath for a relative path (os.path.realpath) and "
        f"would save under the working directory; pass the directory itself "
        f"(dirpath={'/' + os.path.dirname(rest)!r})")


def _instead(url: str) -> str:
    """What to pass Lightning instead of ckptio's ``url``."""
    if scheme_of(url) == "shm":
        try:
            local = checkpoint_path(url)
        except CkptError as exc:
            return f"a local directory ({exc})"
        return (f"the local directory it names, {local!r} (the same host memory: ckptio saves "
                "there as it would at the URL)")
    if scheme_of(url) == "mem":
        return ("a local directory: mem:// is this process's memory, gone when the job ends; "
                "for host memory that outlives it, a directory under the shared-memory root, "
                f"{checkpoint_path('shm://NAME')!r} (what shm://NAME names)")
    return "a local (or mounted) directory"


def _refusal(url: str) -> CkptError:
    return CkptError(
        f"{url}: Lightning reaches a checkpoint directory (ModelCheckpoint's dirpath, the search "
        f"for last.ckpt) through fsspec, which does not serve ckptio's {scheme_of(url)}:// URLs; "
        f"pass {_instead(url)}")


def _refusing_class(scheme: str, base: type) -> type:
    """An fsspec filesystem class for ``scheme`` that refuses every URL of it."""

    def kwargs_from_urls(cls: type, path: str) -> dict[str, Any]:
        raise _refusal(str(path))

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        raise _refusal(f"{scheme}://")

    return type(f"CkptioRefused_{scheme}", (base,), {
        "protocol": scheme, "__init__": init,
        "_get_kwargs_from_urls": classmethod(kwargs_from_urls)})


def refuse_in_fsspec() -> list[str]:
    """Register the refusing filesystem of each scheme ckptio serves that fsspec does not know
    (none where fsspec is not installed) -> the schemes registered."""
    try:
        fsspec_registry = importlib.import_module("fsspec.registry")
        base = importlib.import_module("fsspec").AbstractFileSystem
    except ImportError:
        return []
    done = []
    for scheme in registered_schemes():
        if (scheme in fsspec_registry.known_implementations
                or scheme in fsspec_registry.registry):
            continue
        fsspec_registry.register_implementation(scheme, _refusing_class(scheme, base))
        done.append(scheme)
    return done


def committed_instead_of_last(path: str) -> str | None:
    """For ``ckpt_path="last"`` whose last checkpoint was never committed (the job was killed
    during its first save there): the newest committed checkpoint beside it (the furthest
    ``global_step``, then the latest commit: a copied folder's times say nothing), with a
    warning; None for any other path (the one asked for is the one loaded) or when there is
    none."""
    name, directory = os.path.basename(path.rstrip("/")), os.path.dirname(path.rstrip("/"))
    if not name.startswith("last") or not os.path.isdir(directory):
        return None
    found = []
    for entry in os.scandir(directory):
        manifest = os.path.join(entry.path, MANIFEST_NAME)
        if (entry.name != name and entry.name.endswith(".ckpt") and not _HIDDEN.search(entry.name)
                and entry.is_dir() and is_committed(entry.path)):
            found.append((_global_step(entry.path), os.stat(manifest).st_mtime_ns, entry.path))
    if not found:
        return None
    newest = max(found)[2]
    warnings.warn(f"ckptio.lightning: {path} was never committed (the job stopped during that "
                  f"save); resuming from {newest}, the newest committed checkpoint beside it",
                  stacklevel=3)
    return newest


def _global_step(path: str) -> int:
    """The ``global_step`` Lightning saved in checkpoint ``path`` (-1: none, or unreadable)."""
    try:
        step = load(path, keys=lambda k: k == "global_step").get("global_step")  # may be absent
    except CkptError:  # unreadable: ordered by its commit time alone
        return -1
    return step if isinstance(step, int) else -1


def remove_remote(url: str, options: Options) -> None:
    """Remove the checkpoint at the object-store ``url``: its manifest first, then the rest."""
    store = store_for(url, options)
    problems = store.remove([MANIFEST_NAME])
    if not problems:
        problems = (store.remove_tree() if isinstance(store, TreeStore)
                    else store.remove(store.names()))
    if problems:
        raise StorageIOError(f"cannot remove checkpoint {url}: {problems[0]}; check the "
                             "credentials' delete permission, then remove it by hand")


def remove_directory(path: str) -> None:
    """Rename ``path`` out of Lightning's sight (fsynced), then remove it and any leftover of
    an earlier removal cut short in the same directory."""
    parent, name = os.path.split(os.path.abspath(path))
    hidden = os.path.join(parent, f".deleting-{name}-{secrets.token_hex(4)}")
    os.rename(path, hidden)
    fsync_path(parent)
    for entry in os.scandir(parent):
        if _HIDDEN.match(entry.name) and entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
