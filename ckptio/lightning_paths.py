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
- Two training jobs started on one checkpoint directory would interleave their saves (each
  replacing the other's ``last.ckpt``). ``RunLeases`` takes the run lease a
  CheckpointManager takes (storage/local/runlease.py) on each local directory the plugin saves
  into, at the first save there, and holds it until the plugin's teardown: a second job's first
  save there is refused, naming the holder, before it writes anything; a job started with
  ``take_over=True`` goes on, and the holder's next save there is refused, naming it.

Call order: ``refuse_in_fsspec()`` once, at ``import ckptio.lightning``; a plugin's saves call
``check_path(path)`` and ``RunLeases.take(path)``, its teardown ``RunLeases.release()``.

Owns: those fsspec registrations and their wording, which directories the plugin leases and
when. Does not own: the lease itself (storage/local/runlease.py), the plugins (lightning.py).
"""

from __future__ import annotations

import importlib
import os
import re
from typing import Any

from ckptio.errors import CheckpointLockedError, CkptError
from ckptio.storage.local import runlease
from ckptio.storage.select import checkpoint_path, registered_schemes, scheme_of

__all__ = ["RunLeases", "check_path", "refuse_in_fsspec"]


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


class RunLeases:
    """The run leases of the local directories one plugin saved into (module docstring).
    ``take_over``: a job whose earlier run's processes linger goes on past their lease (it
    warns), as CheckpointManager(take_over=True) does."""

    def __init__(self, take_over: bool = False) -> None:
        self.take_over = take_over
        self._held: dict[str, runlease.RunLease] = {}

    def take(self, path: str) -> None:
        """The lease of the directory holding checkpoint ``path`` (local paths, ``shm://``),
        at this plugin's first save there; CheckpointLockedError naming the job holding it, or,
        at a later save, the job that took it over since."""
        location = checkpoint_path(path)
        if scheme_of(location) is not None:  # an object store's: not leased here
            return
        directory = os.path.dirname(os.path.abspath(location))
        held = self._held.get(directory)
        if held is not None:
            taker = held.lost
            if taker is not None:
                raise CheckpointLockedError(
                    f"the run directory {directory} was taken over by another job ({taker}, "
                    f"started with take_over=True): this Lightning job did not save {path}, "
                    "and saves no more there; that job saves there now")
            return
        lease = runlease.take(directory, self.take_over, create=True, refusal=(
            f"this Lightning job did not save {path}",
            "pass ckptio.lightning.CheckpointIO(take_over=True)"))
        if lease is not None:
            self._held[directory] = lease

    def release(self) -> None:
        """Let go of every lease (never raises)."""
        held, self._held = self._held, {}
        for lease in held.values():
            lease.release()
