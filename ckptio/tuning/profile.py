"""Tuned I/O profiles, one per filesystem and one per object-store endpoint, in a small JSON file.

Owns: the Profile record (a filesystem, by its key: tuning/mounts.py), the S3Profile record
(an S3 endpoint), the file they live in ($CKPTIO_PROFILE_PATH or
~/.cache/ckptio/profiles.json), its versions and its validation. Does not own: how the file is
written (profile_file.py: whole, under a lock), measuring (tune.py) or deciding when a profile
applies over explicit options (options/api). lookup() is called on every save and load, so it never raises: a missing
or unreadable file is "no profile", a corrupt one is logged once and is "no profile" too; and
it is cheap: the file is parsed again only when its identity (inode, size, times) changed, and
the filesystem's key (the mount table) is worked out only when the file holds a filesystem's
profile. store() never replaces a file of a newer version, and keeps an unusable one aside.

File format (version 1): {"version": 1, "profiles": {"<fs_type>:<st_dev>": {Profile fields},
"s3:<endpoint URL>": {S3Profile fields}}}. A key starting with "s3:" holds an S3Profile. A field
a record lacks (a newer ckptio's) is warned about once and left out; store() writes the other
entries back as they were.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptio.alignment import BLOCK, is_aligned
from ckptio.errors import CkptError
from ckptio.options import DIRECT_IO_MODES, IO_BACKENDS, MAX_IO_DEPTH, MiB, Options
from ckptio.storage.s3.settings import S3Settings
from ckptio.tuning import profile_file
from ckptio.tuning.mounts import filesystem_key

__all__ = ["PATH_ENV", "S3_KEY", "Profile", "ProfileError", "S3Profile", "check_storable",
           "filesystem_key",
           "io_fields", "lookup", "lookup_s3", "profile_path", "read_all", "store",
           "tuned_options", "tuned_s3_options"]

log = logging.getLogger("ckptio")

VERSION = 1
S3_KEY = "s3:"  # the key of an endpoint's profile: "s3:" + the endpoint as S3Settings names it
PATH_ENV = "CKPTIO_PROFILE_PATH"
# Paths already warned about, so a corrupt file is logged once per process, not on every save.
_warned: set[str] = set()


class ProfileError(ValueError):
    """The profile file exists but cannot be used (bad JSON, wrong version or field)."""


@dataclass(frozen=True)
class Profile:
    io_backend: str  # "posix" | "uring"
    direct_io: str  # "auto" (O_DIRECT measured best and accepted) | "off" (buffered best)
    buffer_bytes: int  # bytes of one staging buffer = one write; >= 1 MiB, multiple of BLOCK
    io_depth: int  # writes or reads in flight
    fs_type: str
    device: int  # st_dev of the tuned directory
    measured_at: str  # ISO 8601, UTC
    write_gbps: float  # durable write throughput of the chosen settings (1 GB = 1e9 bytes)
    read_gbps: float  # cold read throughput of the chosen settings

    @property
    def key(self) -> str:
        return f"{self.fs_type}:{self.device}"

    def option_fields(self) -> dict[str, object]:
        """The Options fields this profile sets (for dataclasses.replace / Options(**...))."""
        return {"io_backend": self.io_backend, "direct_io": self.direct_io,
                "buffer_bytes": self.buffer_bytes, "io_depth": self.io_depth}


@dataclass(frozen=True)
class S3Profile:
    """The tuned settings of one S3 endpoint (``ckptio tune s3://bucket/prefix``)."""

    endpoint: str  # the endpoint URL as S3Settings.endpoint() names it
    s3_concurrency: int  # uploads in flight (parts of a multipart upload)
    buffer_bytes: int  # staging buffer = one multipart part = one ranged GET; >= 5 MiB
    measured_at: str  # ISO 8601, UTC
    write_gbps: float  # multipart upload throughput of the chosen settings (1 GB = 1e9 bytes)
    read_gbps: float  # ranged-GET throughput of the chosen read setting
    # A load's io_depth (2 x io_depth ranged GETs in flight), chosen from the study's reads
    # alone; 0 in a profile written before it was (before "the read side of the tuner",
    # docs/BENCH_S3.md): io_depth = s3_concurrency.
    io_depth: int = 0
    # Bytes of one ranged GET of a load (Options.s3_read_bytes: a buffer is filled by several
    # GETs of this size), chosen from the study's reads alone; 0 in a profile written before it
    # was (rounds two and three): one GET per buffer, as then.
    read_bytes: int = 0

    @property
    def key(self) -> str:
        return f"{S3_KEY}{self.endpoint}"

    def option_fields(self) -> dict[str, object]:
        """What this profile sets: uploads in flight, the part size (= the staging buffer), a
        load's reads in flight (io_depth) and the bytes of each GET (the first and last are
        the S3 settings' concurrency and read_bytes: S3_SETTINGS)."""
        return {"s3_concurrency": self.s3_concurrency,
                "io_depth": self.io_depth or self.s3_concurrency,
                "buffer_bytes": self.buffer_bytes, "s3_read_bytes": self.read_bytes}


def profile_path() -> Path:
    override = os.environ.get(PATH_ENV)
    return Path(override) if override else Path.home() / ".cache" / "ckptio" / "profiles.json"


_paths: dict[tuple[str | None, str], str] = {}  # ($CKPTIO_PROFILE_PATH, $HOME) -> the file


def _profile_file() -> str:
    """profile_path() as text, kept per value of the two variables it follows ($HOME decides
    Path.home(); without it the password database does: then it is worked out every time)."""
    override, home = os.environ.get(PATH_ENV), os.environ.get("HOME")
    if home is None:
        return str(profile_path())
    found = _paths.get((override, home))
    if found is None:
        found = _paths[override, home] = str(profile_path())
    return found


# ---------------------------------------------------------------- reading and writing


def lookup(directory: str | os.PathLike[str]) -> Profile | None:
    """The stored profile of the filesystem holding ``directory``, or None. Never raises. The
    filesystem's key (and the mount table) is read only when the file holds a filesystem's
    profile: without the file, a save reads neither."""
    path = _profile_file()
    try:
        profiles = _read_cached(path)
        if not profiles.filesystems:
            return None
        device, kind = filesystem_key(directory)
    except ProfileError as exc:
        _warn_once(path, exc)
        return None
    except OSError:
        return None  # no file, unreadable file or directory: run on the defaults
    found = profiles.by_key.get(f"{kind}:{device}")
    return found if isinstance(found, Profile) else None


def lookup_s3(endpoint: str) -> S3Profile | None:
    """The stored profile of the S3 endpoint ``endpoint``, or None. Never raises."""
    path = _profile_file()
    try:
        found = _read_cached(path).by_key.get(f"{S3_KEY}{endpoint}")
    except ProfileError as exc:
        _warn_once(path, exc)
        return None
    except OSError:
        return None
    return found if isinstance(found, S3Profile) else None


@dataclass(frozen=True)
class _Read:
    """The file's profiles as last read, and the file's identity then."""

    identity: tuple[int, ...]  # (st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns)
    by_key: dict[str, Profile | S3Profile]
    filesystems: bool  # whether any of them is a filesystem's


_read_last: dict[str, _Read] = {}  # the profile file's path -> what it held when last read
_SETTLED_NS = 2_000_000_000  # a file changed this recently is read again (timestamps' grain)


def _read_cached(path: str) -> _Read:
    """read_all(path), read again only when the file's identity (device, inode, size,
    modification and change times) differs from the last read, or it changed so recently that
    a rewrite within the timestamps' grain could hide. store() replaces the file by a rename (a
    new inode). Raises as read_all does; a failed read is not kept."""
    stat = os.stat(path)
    identity = (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
    last = _read_last.get(path)
    if last is not None and last.identity == identity:
        return last
    profiles = read_all(Path(path))
    read = _Read(identity, profiles, any(isinstance(p, Profile) for p in profiles.values()))
    if time.time_ns() - stat.st_mtime_ns > _SETTLED_NS:
        _read_last[path] = read
    return read


def read_all(path: Path | None = None) -> dict[str, Profile | S3Profile]:
    """Every profile in the file. Raises OSError (missing, unreadable) or ProfileError."""
    path = profile_path() if path is None else path
    try:
        doc = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProfileError(f"{path} is not valid JSON: {exc}; run `ckptio tune DIR` to "
                           "rewrite it") from None
    profiles = doc.get("profiles") if isinstance(doc, dict) else None
    newer = _newer_version(doc)
    if newer is not None:
        raise ProfileError(f"{path} is version {newer}, written by a newer ckptio (this one "
                           f"reads version {VERSION}); its profiles are not used here")
    if not isinstance(profiles, dict) or doc.get("version") != VERSION:
        raise ProfileError(f"{path} is not a version {VERSION} ckptio profile file; run "
                           "`ckptio tune DIR` to rewrite it")
    return {key: _from_dict(value, path, S3Profile if key.startswith(S3_KEY) else Profile)
            for key, value in profiles.items()}


def _from_dict(value: Any, path: Path, record: type[Profile | S3Profile]) -> Profile | S3Profile:
    fields = {f.name: f.type for f in dataclasses.fields(record)}
    optional = {f.name for f in dataclasses.fields(record) if f.default is not dataclasses.MISSING}
    if not isinstance(value, dict) or not set(fields) - optional <= set(value):
        raise ProfileError(f"{path}: a profile must have the fields "
                           f"{sorted(set(fields) - optional)} and may have {sorted(optional)}")
    unknown = sorted(set(value) - set(fields))
    if unknown:  # a newer ckptio's added field (as io_depth and read_bytes once were), or a typo
        _say_once(f"{path}:{unknown}", f"ckptio: the I/O profile file {path}: fields {unknown} "
                  f"are unknown to this ckptio (a newer one's, or misspelt: the fields are "
                  f"{sorted(fields)}); the rest of the profile is used")
        value = {name: v for name, v in value.items() if name in fields}
    fields = {name: kind for name, kind in fields.items() if name in value}
    kinds: dict[str, type | tuple[type, ...]] = {"str": str, "int": int, "float": (int, float)}
    for name, kind in fields.items():
        if not isinstance(value[name], kinds[str(kind)]) or isinstance(value[name], bool):
            raise ProfileError(f"{path}: profile field {name}={value[name]!r} is not a {kind}")
    profile = record(**value)
    problem = _invalid(profile)
    if problem:
        raise ProfileError(f"{path}: {problem}")
    return profile


def _invalid(p: Profile | S3Profile) -> str | None:
    if isinstance(p, S3Profile):
        if (p.buffer_bytes < 5 * MiB or not is_aligned(p.buffer_bytes) or p.s3_concurrency < 1
                or p.io_depth < 0 or (p.io_depth or p.s3_concurrency) > MAX_IO_DEPTH
                or p.read_bytes < 0
                or not is_aligned(p.read_bytes)):
            return (f"buffer_bytes={p.buffer_bytes} (a multiple of {BLOCK}, >= 5 MiB), "
                    f"s3_concurrency={p.s3_concurrency} (>= 1), io_depth={p.io_depth} "
                    f"(0 to {MAX_IO_DEPTH}) "
                    f"or read_bytes={p.read_bytes} (a multiple of {BLOCK}, >= 0) "
                    "is invalid")
        return None
    if p.direct_io not in DIRECT_IO_MODES:
        return f"direct_io={p.direct_io!r} is not auto, on or off"
    if p.buffer_bytes < MiB or not is_aligned(p.buffer_bytes):
        return f"buffer_bytes={p.buffer_bytes} is not a multiple of {BLOCK} of at least 1 MiB"
    if not 1 <= p.io_depth <= MAX_IO_DEPTH or p.io_backend not in IO_BACKENDS:
        return (f"io_depth={p.io_depth} (1 to {MAX_IO_DEPTH}) / io_backend={p.io_backend!r} "
                "is invalid")
    return None


def store(profile: Profile | S3Profile) -> str:
    """Add or replace the profile of its filesystem or endpoint; the file is rewritten atomically (temp file,
    fsync, rename) so a concurrent lookup sees the old file or the new one. Returns its path."""
    problem = _invalid(profile)
    if problem:
        raise ProfileError(problem)
    path = profile_path()
    check_storable(path)
    with profile_file.locked(path):  # two tunes at once: each keeps the other's profile
        try:
            read_all(path)  # usable: its entries are kept as they are, fields of newer ckptios too
            profiles = json.loads(path.read_bytes())["profiles"]
        except FileNotFoundError:
            profiles = {}
        except ProfileError as exc:  # kept aside: a hand edit gone wrong can be mended from it
            kept = path.with_name(path.name + ".unusable")
            os.replace(path, kept)
            log.warning("ckptio: replacing the unusable profile file (%s); it is kept as %s",
                        exc, kept)
            profiles = {}
        profiles[profile.key] = dataclasses.asdict(profile)
        doc = {"version": VERSION, "profiles": dict(sorted(profiles.items()))}
        profile_file.atomic_write(path, json.dumps(doc, indent=1).encode() + b"\n")
    return str(path)


def check_storable(path: Path | None = None) -> None:
    """Raise CkptError, naming the file and the fix, where store() could not write the profile
    file: one written by a newer ckptio (never replaced: its profiles would be lost), a
    directory, or a folder this process cannot write. ``ckptio tune`` asks before measuring."""
    path = profile_path() if path is None else path
    fix = f"or set {PATH_ENV} to another file"
    try:
        newer = _newer_version(json.loads(path.read_bytes()))
    except (OSError, ValueError, UnicodeDecodeError):
        newer = None  # none, or unusable: store() replaces it
    if newer is not None:
        raise CkptError(f"the profile file {path} is version {newer}, written by a newer ckptio "
                        f"(this one writes version {VERSION}); tune with that ckptio, {fix}")
    if path.is_dir():
        raise CkptError(f"the profile file {path} is a directory; remove it, {fix}")
    problem = profile_file.unwritable(path)
    if problem:
        raise CkptError(f"cannot write the profile file {path} ({problem}); make its folder "
                        f"writable, {fix}")


def _newer_version(doc: object) -> int | None:
    """The version of a profile file's parsed ``doc`` where it is above VERSION, else None."""
    version = doc.get("version") if isinstance(doc, dict) else None
    newer = isinstance(version, int) and not isinstance(version, bool) and version > VERSION
    return version if newer else None


def _warn_once(path: Path | str, exc: Exception) -> None:
    _say_once(str(path), f"ckptio: ignoring the I/O profile file: {exc}")


def _say_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning("%s", message)


IO_FIELDS = ("io_backend", "direct_io", "buffer_bytes", "io_depth")
S3_FIELDS = ("io_depth", "buffer_bytes")  # the Options fields an endpoint's profile sets
S3_SETTINGS = {"s3_concurrency": "concurrency", "s3_read_bytes": "read_bytes"}  # -> S3Settings


def io_fields(options: Options) -> tuple[object, ...]:
    """The fields a pool and its backends are made for (a change makes them again): the I/O
    fields and the schemes' settings (a tuned endpoint's S3 settings among them)."""
    return (*(getattr(options, name) for name in IO_FIELDS), options.storage)


def _defaulted(options: Options, fields: dict[str, object], names: tuple[str, ...]) -> Options:
    """``options`` with those of ``fields`` (named in ``names``) it leaves at their defaults."""
    defaults = Options()
    chosen: dict[str, Any] = {k: v for k, v in fields.items()
                              if k in names and getattr(options, k) == getattr(defaults, k)}
    tuned = int(chosen.get("buffer_bytes", 0))
    if 2 * tuned > options.pool_bytes or tuned > options.max_file_bytes:
        chosen.pop("buffer_bytes")  # the pool holds two buffers, a file one: keep those given
    return dataclasses.replace(options, **chosen)


def tuned_options(options: Options, path: str) -> Options:
    """``options`` with the I/O fields it leaves at their defaults taken from the tuned profile of
    ``path``'s filesystem (``ckptio tune``); unchanged without a profile or with use_profile off."""
    if not options.use_profile:
        return options
    found = lookup(path)
    return options if found is None else _defaulted(options, found.option_fields(), IO_FIELDS)


def tuned_s3_options(options: Options, endpoint: str) -> Options:
    """``options`` with io_depth and buffer_bytes, and the S3 settings' concurrency and
    read_bytes, where it leaves them at their defaults, taken from the tuned profile of the S3
    endpoint ``endpoint`` (``ckptio tune s3://...``); unchanged without a profile or with
    use_profile off."""
    if not options.use_profile:
        return options
    found = lookup_s3(endpoint)
    if found is None:
        return options
    fields = found.option_fields()
    tuned = _defaulted(options, fields, S3_FIELDS)
    settings, defaults = S3Settings.of(options), S3Settings()
    chosen: dict[str, Any] = {name: fields[key] for key, name in S3_SETTINGS.items()
              if getattr(settings, name) == getattr(defaults, name) != fields[key]}
    return tuned.with_settings("s3", dataclasses.replace(settings, **chosen)) if chosen else tuned
