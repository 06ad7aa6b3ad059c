"""The registry of storage schemes: one entry per scheme names its Store, its I/O backend, its
settings and the StepRoot a CheckpointManager keeps steps in.

A location is a local (or mounted) directory path, or a URL of a registered scheme: ``file://``
(a local path), ``shm://NAME`` (a local directory under the shared-memory root, outliving the
process), ``mem://`` (this process's memory), ``s3://`` / ``gs://`` / ``az://`` (storage/s3/,
gcs/, azure/; extras s3, gcs, azure), or one a user registers, as in fsspec:

    ckptio.register_store("myfs", lambda location, options: MyStore(location,
                          ckptio.settings_for(location, options)), settings=MySettings,
                          step_root=lambda location, options: MyRoot(location))

A scheme's settings come as ``Options(storage={"myfs": MySettings(...)})``; settings_for()
resolves them for a location (defaults where none given): no module outside its folder reads them.

Call order: checkpoint_path() turns a user's path into the location (refusing an unregistered
scheme, or one missing a slash, rather than taking ``hdfs:`` or ``s3:`` for a folder); store_for()
makes one checkpoint's Store (store_contract.py); root_for() a manager's StepRoot (steproot.py).
Built-in factories import their modules on first use, so the torch-free ``ckptio`` command
pays only for the schemes it reads.

Owns: the entries, which store and file a local file names, which settings a location takes.
Does not own: what a scheme's settings hold (its folder), what a store or root does (their
modules), the directory a file:// or shm:// URL names (local/local_urls.py), the backends'
lifetime (resources.py).
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptio.errors import CkptError, UnsupportedPathError
from ckptio.options import Options
from ckptio.storage.local.local_store import LocalStore
from ckptio.storage.local.local_urls import file_path, shm_path
from ckptio.storage.steproot import StepRoot
from ckptio.storage.location_text import location_text, refuse_unexpanded
from ckptio.storage.store_contract import Store

__all__ = [
    "Scheme",
    "StepRootFactory",
    "StoreFactory",
    "capped",
    "checkpoint_path",
    "compared",
    "is_checkpoint_id",
    "local_path",
    "register_store",
    "registered_schemes",
    "root_for",
    "scheme_for",
    "scheme_of",
    "settings_for",
    "store_and_file",
    "store_for",
]

StoreFactory = Callable[[str, Options], Store]  # (location as written, options) -> its Store
StepRootFactory = Callable[[str, Options], StepRoot]  # (a manager's location, options) -> root
SettingsOf = Callable[[Options], Any]  # options -> the scheme's settings object

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")
_SLASH_MISSING = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):(?!//)")  # "s3:/bucket", "gs:bucket"
_lock = threading.Lock()


@dataclass(frozen=True)
class Scheme:
    """One scheme's entry. ``store`` makes the Store of one checkpoint location; ``backend``
    names the kind of I/O backend those stores make (Store.backend(); resources.py keeps one per
    Store.backend_kind, which is this kind or starts with it; None: the store's own); ``step_root``
    makes a manager's StepRoot (None: a manager is refused, naming what to register); ``local``
    turns a URL into the local directory it names (file://, shm://), served as that path;
    ``settings`` resolves the scheme's settings from Options (None: the scheme has none)."""

    name: str
    store: StoreFactory
    backend: str | None = None
    step_root: StepRootFactory | None = None
    local: Callable[[str], str] | None = None
    settings: SettingsOf | None = None


# -- the built-in schemes (each imports its modules on first use) ---------------------------------


def _local_store(location: str, options: Options) -> Store:
    return LocalStore(location)


def _local_root(location: str, options: Options) -> StepRoot:
    from ckptio.storage.local.local_root import LocalRoot

    return LocalRoot(location, slots=options.memory_mapped != "off")


def _memory_store(location: str, options: Options) -> Store:
    from ckptio.storage.memory.memory_store import MemoryStore

    return MemoryStore(location)


def _memory_root(location: str, options: Options) -> StepRoot:
    from ckptio.storage.memory.memory_root import MemoryRoot

    return MemoryRoot(location)


def _s3_settings(options: Options) -> Any:
    from ckptio.storage.s3.settings import S3Settings

    return S3Settings.of(options)


def _s3_store(location: str, options: Options) -> Store:
    from ckptio.storage.s3.settings import S3Settings
    from ckptio.storage.s3.store import S3Store

    return S3Store(location, S3Settings.of(options))


def _s3_root(location: str, options: Options) -> StepRoot:
    from ckptio.storage.s3.root import S3Root
    from ckptio.storage.s3.settings import S3Settings

    return S3Root(location, S3Settings.of(options))


def _gcs_settings(options: Options) -> Any:
    from ckptio.storage.gcs.gcs_settings import GcsSettings

    return GcsSettings.of(options)


def _gcs_store(location: str, options: Options) -> Store:
    from ckptio.storage.gcs.gcs_settings import GcsSettings
    from ckptio.storage.gcs.gcs_store import GcsStore

    return GcsStore(location, GcsSettings.of(options))


def _gcs_root(location: str, options: Options) -> StepRoot:
    from ckptio.storage.gcs.gcs_root import GcsRoot
    from ckptio.storage.gcs.gcs_settings import GcsSettings

    return GcsRoot(location, GcsSettings.of(options))


def _az_settings(options: Options) -> Any:
    from ckptio.storage.azure.az_settings import AzureSettings

    given = options.settings("az", AzureSettings)
    return AzureSettings() if given is None else given


def _az_store(location: str, options: Options) -> Store:
    from ckptio.storage.azure.az_store import AzureStore

    return AzureStore(location, _az_settings(options))


def _az_root(location: str, options: Options) -> StepRoot:
    from ckptio.storage.azure.az_root import AzureRoot

    return AzureRoot(location, _az_settings(options))


_LOCAL = Scheme("file", _local_store, "local", _local_root, local=file_path)  # and plain paths
_SCHEMES: dict[str, Scheme] = {entry.name: entry for entry in (
    _LOCAL,
    Scheme("shm", _local_store, "local", _local_root, local=shm_path),
    Scheme("mem", _memory_store, "memory", _memory_root),
    Scheme("s3", _s3_store, "s3", _s3_root, settings=_s3_settings),
    Scheme("gs", _gcs_store, "gs", _gcs_root, settings=_gcs_settings),
    Scheme("az", _az_store, "azure", _az_root, settings=_az_settings),
)}
_BUILT_IN = frozenset(_SCHEMES)


# -- registering ---------------------------------------------------------------------------------


def register_store(scheme: str, factory: StoreFactory, *, replace: bool = False,
                   step_root: StepRootFactory | None = None,
                   settings: type | None = None) -> None:
    """Serve locations ``<scheme>://...`` with the Store ``factory(location, options)`` makes
    (ckptio.save, load, verify); with ``step_root``, a CheckpointManager keeps its steps there
    too, in the StepRoot ``step_root(location, options)`` makes (the protocol of
    ckptio/storage/steproot.py; ckptio/testing/steproot_conformance.py checks one). With
    ``settings`` (a class whose no-argument instance is the defaults), ``Options(storage={scheme:
    settings(...)})`` gives the scheme its settings and the factories read them with
    settings_for(location, options). A scheme already registered is refused unless ``replace``
    (which replaces its whole entry); the built-in ones (file, shm, mem, s3, gs, az) are never replaced."""
    if not isinstance(scheme, str) or not _NAME.fullmatch(scheme):
        raise CkptError(f"register_store({scheme!r}): a scheme is a letter, then letters, "
                        "digits, '+', '-' or '.' (e.g. 'myfs'), without '://'")
    if not callable(factory):
        raise CkptError(f"register_store({scheme!r}, {factory!r}): the factory must be "
                        "callable as factory(location, options) -> Store")
    if step_root is not None and not callable(step_root):
        raise CkptError(f"register_store({scheme!r}, step_root={step_root!r}): the step root "
                        "must be callable as step_root(location, options) -> StepRoot")
    if settings is not None and not isinstance(settings, type):
        raise CkptError(f"register_store({scheme!r}, settings={settings!r}): give the settings' "
                        "class (its instance with no arguments holds the defaults)")
    key = scheme.lower()
    with _lock:
        if key in _BUILT_IN:
            raise CkptError(f"register_store({scheme!r}): {key}:// is built in and cannot be "
                            "replaced; register another scheme")
        if key in _SCHEMES and not replace:
            raise CkptError(f"register_store({scheme!r}): {key}:// is registered already; "
                            "pass replace=True to replace it")
        _SCHEMES[key] = Scheme(key, factory, step_root=step_root,
                               settings=None if settings is None else _settings_of(key, settings))


def _settings_of(scheme: str, kind: type) -> SettingsOf:
    def resolve(options: Options) -> Any:
        given = options.settings(scheme, kind)
        return kind() if given is None else given

    return resolve


def registered_schemes() -> list[str]:
    """Every scheme served, ``file`` included, sorted."""
    with _lock:
        return sorted(_SCHEMES)


def scheme_of(location: str) -> str | None:
    """The lower-case URL scheme of ``location``, or None for a plain path."""
    match = _URL.match(location)
    return match.group(1).lower() if match else None


def _unsupported(text: str, scheme: str) -> UnsupportedPathError:
    served = ", ".join(f"{s}://" for s in registered_schemes())
    return UnsupportedPathError(
        f"{text}: ckptio serves no {scheme}:// locations (served: local paths, {served}); pass "
        "a directory path (e.g. a mounted bucket), or register a store for the scheme with "
        "ckptio.register_store")


def checkpoint_path(path: str | os.PathLike[str]) -> str:
    """The location as a string: a URL of a registered scheme, or a local path (``file://``
    and ``shm://`` URLs become their path). Another scheme is refused, naming the registered
    ones."""
    text = location_text(path)
    if scheme_of(text) is None:
        _refuse_slash_missing(text)
        refuse_unexpanded(text)
        return text
    entry = scheme_for(text)
    return text if entry.local is None else entry.local(text)


def _refuse_slash_missing(text: str) -> None:
    """A relative path whose first part is a served scheme and a colon is that scheme's URL
    with a slash missing: refused rather than made a local folder ``s3:`` on the node's disk."""
    match = _SLASH_MISSING.match(text)
    with _lock:
        served = match is not None and match.group(1).lower() in _SCHEMES
    if match is not None and served:
        url = f"{match.group(1).lower()}://{text[match.end():].lstrip('/')}"
        raise UnsupportedPathError(
            f"{text}: a slash is missing after {match.group(0)!r} (ckptio would write a local "
            f"folder {match.group(0)!r}); write {url}, or ./{text} for a local folder so named")


def scheme_for(location: str) -> Scheme:
    """The registry entry serving ``location`` (the ``file`` entry for a plain path);
    UnsupportedPathError for an unregistered scheme, naming the registered ones."""
    scheme = scheme_of(location)
    if scheme is None:
        return _LOCAL
    with _lock:
        entry = _SCHEMES.get(scheme)
    if entry is None:
        raise _unsupported(location, scheme)
    return entry


def local_path(path: str | os.PathLike[str]) -> str:
    """The location as a local directory; any URL but ``file://`` is refused rather than taken
    for a local folder named ``s3:``."""
    text = checkpoint_path(path)
    scheme = scheme_of(text)
    if scheme is not None:
        raise UnsupportedPathError(f"{text}: this needs a local (or mounted) directory, not a "
                                   f"{scheme}:// location")
    return text


def compared(location: str) -> str:
    """``location`` as ranks compare theirs: a local path made absolute ("ck", "./ck/" and
    "/run/ck" alike where that is the working directory), a URL as it is."""
    return location if scheme_of(location) is not None else os.path.abspath(location)


def store_for(path: str | os.PathLike[str], options: Options | None = None) -> Store:
    """The Store of checkpoint ``path``: its scheme's entry's, or a local directory's."""
    text = checkpoint_path(path)
    entry = scheme_for(text)
    store = entry.store(text, options or Options.from_env())
    if not isinstance(store, Store):
        raise CkptError(f"the store registered for {entry.name}:// returned {store!r}, which is "
                        "not a ckptio Store (storage/store_contract.py); fix its factory")
    return store


def settings_for(location: str | os.PathLike[str], options: Options | None = None) -> Any:
    """The settings of ``location``'s scheme (what a store or root of it is made with):
    ``options.storage[scheme]``, else the scheme's defaults (S3: from Options' ``s3_*``
    fields); None for a scheme without settings (local paths, shm://, mem://). A storage
    entry naming no registered scheme with settings is refused, naming the ones there are."""
    text = checkpoint_path(location)
    entry = scheme_for(text)
    options = options or Options.from_env()
    with _lock:
        takes = sorted(name for name, each in _SCHEMES.items() if each.settings is not None)
    for named in options.storage:
        if named not in takes:
            raise CkptError(f"Options.storage[{named!r}]: no registered scheme {named}:// takes "
                            f"settings (those that do: {', '.join(takes)}); fix the name, or "
                            "register the scheme with ckptio.register_store(..., settings=)")
    return None if entry.settings is None else entry.settings(options)


def capped(location: str | os.PathLike[str], options: Options, deadline_s: float) -> Options:
    """``options`` whose settings for ``location``'s scheme retry a request for at most
    ``deadline_s`` (a settings dataclass with a ``retry_deadline_s`` field; else unchanged)."""
    settings = settings_for(location, options)
    current = getattr(settings, "retry_deadline_s", None)
    if not dataclasses.is_dataclass(settings) or current is None or current <= deadline_s:
        return options
    name = scheme_for(checkpoint_path(location)).name
    return options.with_settings(name, dataclasses.replace(  # type: ignore[type-var]
        settings, retry_deadline_s=deadline_s))


def root_for(location: str | os.PathLike[str], options: Options) -> StepRoot:
    """The StepRoot a CheckpointManager keeps its steps in at ``location``: its scheme's
    entry's. A scheme registered without one is refused (UnsupportedPathError naming what to
    register): the Store contract serves one checkpoint, it cannot list or hide steps."""
    text = checkpoint_path(location)
    entry = scheme_for(text)
    if entry.step_root is None:
        raise UnsupportedPathError(
            f"{text}: a CheckpointManager keeps its steps in a root that lists, hides and "
            f"removes them, and {entry.name}:// has none (its store serves ckptio.save and "
            "ckptio.load, one checkpoint at a time): register one with ckptio.register_store("
            f"{entry.name!r}, factory, step_root=lambda location, options: MyRoot(location), "
            "replace=True), MyRoot having the methods path, scan, is_committed, hide, removal "
            "and nothing_here of ckptio/storage/steproot.py's StepRoot (ckptio/testing/"
            "steproot_conformance.py checks one); or save each step with ckptio.save")
    root = entry.step_root(text, options)
    if not isinstance(root, StepRoot):
        raise CkptError(f"the step root registered for {entry.name}:// returned {root!r}, which "
                        "lacks the StepRoot methods (location, path, scan, is_committed, hide, "
                        "removal, nothing_here; ckptio/storage/steproot.py); fix its factory")
    return root


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
