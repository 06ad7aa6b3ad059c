"""Every tunable of ckptio in one frozen dataclass: defaults, CKPTIO_* variables, the caller's.

Owns: defaults, validation of option values (ckptio/environment.py reads the variables), and
the constants every layer shares: the byte units (KiB, MiB, GiB), the I/O backend names
(IO_BACKENDS; ckptio.io builds them) and the direct_io modes (DIRECT_IO_MODES).
Also owns Options.storage, each scheme's settings object by scheme name (what a scheme's
registry entry reads: storage/select.settings_for), and the ``s3_*`` fields, the older spelling
that builds the S3 scheme's settings (storage/s3/settings.S3Settings.of).
Does not own: what the options do (stage, io, layout and restore read them), the block size
(ckptio/alignment.py), what a scheme's settings hold (its own folder), the read-only mapping
Options.storage is made into (scheme_settings.py).
"""

from __future__ import annotations

import dataclasses
import numbers
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, get_args

from ckptio import environment
from ckptio.alignment import BLOCK, is_aligned
from ckptio.errors import CkptError
from ckptio.scheme_settings import SchemeSettings

__all__ = ["CODECS", "COMPRESSION_MODES", "DIRECT_IO_MODES", "IO_BACKENDS",
           "MAX_IO_DEPTH", "MEMORY_MAPPED_MODES", "SAVE_CHECKSUMS", "GiB", "KiB", "MiB", "Options",
           "check_s3"]

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
IO_BACKENDS = ("auto", "posix", "uring")  # Options.io_backend; ckptio.io.create builds each
CODECS = ("zstd", "bytegroup+zstd")  # lossless codecs a save may name (ckptio/format/codec.py)
COMPRESSION_MODES = ("off", "auto", *CODECS)  # Options.compression
# Options.checksum: what a save may record (format/checksum.py also knows "crc32", the
# checksum of the foreign records of DCP and torch.save files ckptio reads, never writes)
SAVE_CHECKSUMS = ("xxh3_64_tree", "xxh3_64")
MEMORY_MAPPED_MODES = ("auto", "off")  # Options.memory_mapped
# Options.io_depth's bound: far above any disk's useful depth, below io_uring's ring limit
# (the ring holds slots for the writes and reads of io_depth) and a thread pool's sane size
MAX_IO_DEPTH = 1024

DirectIO = Literal["auto", "on", "off"]
DIRECT_IO_MODES: tuple[str, ...] = get_args(DirectIO)
IfLocked = Literal["wait", "raise"]
S3Conditional = Literal["require", "off"]
T = TypeVar("T")
# The fields that spell the S3 scheme's settings in Options (S3Settings' fields, ``s3_`` first)
_S3_FIELDS = ("s3_endpoint_url", "s3_region", "s3_profile", "s3_concurrency", "s3_read_bytes",
             "s3_retry_deadline_s", "s3_lock_lease_s", "s3_conditional")
_SUGAR = {"s3": _S3_FIELDS}  # a scheme -> the Options fields that also spell its settings
# A field's annotation -> the types its value may have, and what the error asks for instead
# (a switch given as text is refused: "false" is true)
_KINDS: dict[str, tuple[type, str]] = {"int": (numbers.Integral, "an int"),
                                        "float": (numbers.Real, "a number")}


@dataclass(frozen=True)
class Options:
    """How a save or load runs. Change with ``dataclasses.replace``.

    The environment: each field but storage is also a variable, CKPTIO_ and the field's name
    in capitals (CKPTIO_IO_DEPTH, CKPTIO_VERIFY), read where no options are given (a save,
    load or Checkpointer without ``options``) or by ``Options.from_env(**fields)``, whose
    fields win over the variables. An ``Options(...)`` made directly reads none of them: pass
    ``Options.from_env(verify=False)`` to keep the variables and change one field. A variable
    that nearly spells a field (CKPTIO_IO_DEPHT) is named in a warning; its value is ignored.

    buffer_bytes: size of one staging buffer, and of one write or coalesced read.
    pool_bytes: total staging memory (buffer_bytes x number of buffers); allocated once, reused.
    host_budget_bytes: how far an async save may grow the staging pool so that async_save
        returns at memory-copy speed. After an async save (eager or lazy) of a state larger than
        the pool, the pool grows (on the save's thread, once the save is committed and before
        its wait() returns) to hold this rank's whole state, up to its share of this budget; it is
        pre-faulted once, in the background, and reused by every later save and load
        (Checkpointer.close frees it). The budget is the host's (per node, not per process):
        the ranks of one host (LOCAL_WORLD_SIZE as torchrun sets it, else Open MPI's or
        MPICH's local size; 1 without a launcher) each grow to an equal share, so their pools
        together stay within it. Beyond its share a rank's state streams through the pool
        and async_save waits for the disk for the rest (logged once). A pool never shrinks
        below pool_bytes (what a save streams through, the largest tensor too): where a share
        is smaller the host holds up to ranks x pool_bytes. None (default): half of the host
        memory available when the pool grows (MemAvailable); 0: never beyond pool_bytes.
        Synchronous saves never grow the pool (ckptio/io/hostbudget.py).
    io_depth: writes or reads in flight at once.
    max_file_bytes: a data file is closed and a new one begun past this size.
    direct_io: "auto" uses O_DIRECT where the filesystem accepts it, else buffered (logged once).
    verify: check every loaded byte against its checksum.
    checksum: the algorithm recorded in the manifest: "xxh3_64_tree" (an entry's whole
        checksum derived from its block checksums: each byte hashed once; docs/FORMAT.md) or
        "xxh3_64" (the whole checksum of the bytes, as before issue 29: each byte hashed twice).
    io_backend: name of the IOBackend: "auto" (default: io_uring where this process can use
        it and pin the staging pool, with CAP_IPC_LOCK or under a memlock limit of 1 GiB or
        more, else the POSIX thread pool, silently), "posix" (thread pool) or "uring"
        (io_uring; falls back to posix, logged once, where io_uring is unavailable). io_uring
        pins the staging pool once (fixed buffers) where POSIX I/O pins every request's pages
        again, which made a save slower (docs/BENCH_LIMIT.md, "the save's gap to the disk was
        page pinning"). Under "auto", saves that persist behind the caller (async, lazy) and
        every transfer of a store in host memory (tmpfs) take the POSIX threads
        (docs/BENCH_LOOP.md: they hold the interpreter less, and spread tmpfs copies over the
        cores).
    use_profile: let a tuned profile (``ckptio tune DIR``) of the target filesystem set
        io_backend, direct_io, buffer_bytes and io_depth where these are left at their defaults
        (a save behind the caller still takes the POSIX threads where io_backend is "auto").
    if_locked: what a save does when another save (another process, job or machine sharing the
        filesystem) is saving into the same path: "wait" until it has finished (logged), or
        "raise" CheckpointLockedError at once (from wait() for an async save).
    compression: "off" (default), "auto" or a codec ("bytegroup+zstd", "zstd"): lossless
        compression of each saved chunk, in frames of the block checksums' size, on the save's
        I/O threads (``pip install zstandard``). "auto" compresses a chunk only when a
        sample of it (its first frame) shrinks by >= 1.1x and either the store is an object store
        or the codec, on ``compress_threads`` threads, outruns the disk's measured write rate
        (``ckptio tune``; no profile: not compressed); a codec compresses every chunk that
        shrinks. Loads decode whatever a checkpoint holds.
    memory_mapped: "auto" (default): a manager's memory tier (a directory on tmpfs,
        ``shm://``) keeps the data files of the step its retention drops as slots, mapped into
        the process ahead; the next save whose files have those sizes, neither compressed nor
        a delta, copies the state straight into their pages (no second copy through the
        staging pool, no write, no page allocated again; storage/local/mapped.py). Other saves, and
        saves before a slot exists, go through the staging pool and the I/O backend.
        "off": no slots, every save through the pool and the backend like any other.
    compress_threads: threads that encode frames during a compressed or delta save, and decode
        them during a load (the bound on the cores compression takes; the training thread never
        compresses).
    rank_timeout_s: with torch.distributed, a rank that shows no sign of life for this long
        while the others wait for it at a step of a save or load, or where the ranks of a
        restore from other hosts' memory meet (killed, crashed, frozen, cut off) makes every
        live rank raise RankFailedError naming it; nothing is committed.
    step_timeout_s: the longest a rank that is alive may keep the others waiting at one step
        (e.g. while it still writes its share); then the same RankFailedError. Give every rank
        the same two deadlines.
    peer_timeout_s: with ``Tier(..., redundancy=...)``, the longest one transfer of the
        protection across hosts (a copy, a parity piece, the exchange of a step's metadata,
        the listing of steps() / latest(), a restore's transfers from peers) may wait for a
        peer: a peer that died or stopped
        answering makes the protection fail with RankFailedError naming it (stored: raised by
        protected() and close(), shown in status(); steps() raises it) instead of waiting. It
        must exceed the skew between the ranks' commits of one step (every rank's protection
        thread meets the others at each step).

    broadcast_replicated: with torch.distributed, an in-place load reads each stored tensor
        that several ranks need identically (a replicated one: plain DDP, HSDP's replicas,
        TP-replicated norms) from storage on one rank only, and sends it to the others over a
        gloo group of the load's own (each receiver checks it against the manifest's checksum,
        or a DCP item's CRC-32, when ``verify``); the ranks share the reading out by bytes. A rank whose sender dies or
        does not answer within rank_timeout_s reads those tensors from storage instead
        (warned). The committed manifest, likewise, is read (and its data files checked) by
        one rank and sent to the others. False: every rank reads all it needs. Give every rank
        the same value.
    io_stall_warn_s: a save whose local I/O (a write, an fsync, the commit), or a load or
        restore whose reads (the manifest's, an open, a data file's read) make no progress
        for this many seconds is said: a warning on the ``ckptio`` logger naming the rank, the
        file and the seconds waited, repeated every io_stall_warn_s while it lasts, and one
        line when it goes on (a hung NFS or Lustre server, a FUSE file system that stopped
        answering, a dying disk: the call is in the kernel and cannot be cancelled).
        The save keeps waiting: ``wait(timeout=...)`` and ``close(timeout=...)`` stop waiting
        for it. A load keeps waiting too, and fills the state once the read returns: it has
        no give-up (a read blocked in the kernel would write into its buffer later). An
        object store's load is bounded by s3_retry_deadline_s instead (a CkptError naming
        the object). 0: never warned.
    For ``s3://bucket/prefix`` paths (``pip install boto3``); left at None, each comes
    the way AWS tools take it (AWS_ENDPOINT_URL(_S3), AWS_REGION, AWS_PROFILE, ~/.aws/config,
    the standard credential chain):
    s3_endpoint_url: an S3-compatible endpoint (MinIO, SeaweedFS, Ceph RGW), e.g.
        "http://127.0.0.1:8333".
    s3_region, s3_profile: the region and the named profile of ~/.aws/config.
    s3_concurrency: parts uploaded in flight per process; a load keeps 2 x io_depth ranged
        GETs in flight, on threads of their own.
    s3_read_bytes: bytes of one ranged GET of a load: a read of a larger staging buffer is
        several GETs of this size (filling one buffer, in flight side by side), so a load reads
        in the ranges the store serves best while saves upload parts of buffer_bytes. 0
        (default): one GET per read, as large as the buffer.
    s3_retry_deadline_s: how long a request is retried (throttling, 5xx, resets), and waits
        for answers (a silent network), before the save or load fails naming the object and
        the endpoint; a failed save's cleanup adds a few seconds (storage/s3/timeouts.py).
    s3_lock_lease_s: a save's claim on a prefix expires this long after its holder stopped
        renewing it (a killed save delays the next one by at most this).
    s3_conditional: "require" refuses a store without conditional writes (If-None-Match /
        If-Match), which the commit relies on; "off" commits without them (last writer wins).
    These eight fields (and their CKPTIO_S3_* variables) are the older spelling of
    ``storage={"s3": S3Settings(...)}``, which they build; give one spelling, not both.

    storage: each scheme's settings by scheme name, the primary spelling of a store's settings:
        a settings object of the class its registry entry names (``{"s3":
        ckptio.S3Settings(endpoint_url=..., region=...)}``), or a mapping of that class's
        fields (``{"s3": {"endpoint_url": ...}}``). A scheme left out takes its defaults (S3:
        from the ``s3_*`` fields). ckptio.register_store(..., settings=MySettings) names a
        scheme's class; its store factory reads them with ckptio.settings_for(location, options).
    """

    buffer_bytes: int = 16 * MiB
    pool_bytes: int = 256 * MiB
    host_budget_bytes: int | None = None
    io_depth: int = 4
    max_file_bytes: int = 16 * GiB
    direct_io: DirectIO = "auto"
    verify: bool = True
    checksum: str = "xxh3_64_tree"
    io_backend: str = "auto"
    use_profile: bool = True
    if_locked: IfLocked = "wait"
    s3_endpoint_url: str | None = None
    s3_region: str | None = None
    s3_profile: str | None = None
    s3_concurrency: int = 16
    s3_read_bytes: int = 0
    s3_retry_deadline_s: float = 120.0
    s3_lock_lease_s: float = 30.0
    s3_conditional: S3Conditional = "require"
    rank_timeout_s: float = 60.0
    step_timeout_s: float = 1800.0
    peer_timeout_s: float = 60.0
    io_stall_warn_s: float = 60.0
    broadcast_replicated: bool = True
    compression: str = "off"
    compress_threads: int = 2
    memory_mapped: str = "auto"
    storage: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._check_types()
        if self.buffer_bytes < MiB or not is_aligned(self.buffer_bytes):
            raise CkptError(
                f"Options.buffer_bytes={self.buffer_bytes}: must be >= 1 MiB and a multiple of "
                f"{BLOCK}; writes smaller than 1 MiB waste the disk's bandwidth"
            )
        if self.pool_bytes < 2 * self.buffer_bytes:
            raise CkptError(
                f"Options.pool_bytes={self.pool_bytes}: must hold at least two buffers of "
                f"buffer_bytes={self.buffer_bytes} so staging overlaps writing"
            )
        if self.host_budget_bytes is not None and self.host_budget_bytes < 0:
            raise CkptError(f"Options.host_budget_bytes={self.host_budget_bytes}: must be >= 0 "
                            "(0: the pool never grows beyond pool_bytes; None: automatic)")
        if not 1 <= self.io_depth <= MAX_IO_DEPTH:
            raise CkptError(f"Options.io_depth={self.io_depth}: must be >= 1 and <= "
                            f"{MAX_IO_DEPTH} (writes or reads in flight at once)")
        if self.max_file_bytes < self.buffer_bytes:
            raise CkptError(
                f"Options.max_file_bytes={self.max_file_bytes}: must be >= buffer_bytes"
            )
        if self.io_backend not in IO_BACKENDS:
            raise CkptError(f"Options.io_backend={self.io_backend!r}: use "
                            + " or ".join(map(repr, IO_BACKENDS)))
        if self.direct_io not in DIRECT_IO_MODES:
            raise CkptError(f"Options.direct_io={self.direct_io!r}: use 'auto', 'on' or 'off'")
        if self.if_locked not in ("wait", "raise"):
            raise CkptError(f"Options.if_locked={self.if_locked!r}: use 'wait' (until the other "
                            "save into the path has finished) or 'raise'")
        if not 0 < self.rank_timeout_s <= self.step_timeout_s:
            raise CkptError(f"Options.rank_timeout_s={self.rank_timeout_s}, step_timeout_s="
                            f"{self.step_timeout_s}: need 0 < rank_timeout_s <= step_timeout_s")
        if not self.peer_timeout_s > 0:
            raise CkptError(f"Options.peer_timeout_s={self.peer_timeout_s}: seconds > 0")
        if not self.io_stall_warn_s >= 0:
            raise CkptError(f"Options.io_stall_warn_s={self.io_stall_warn_s}: seconds >= 0 "
                            "(0: never warned)")
        if self.compression not in COMPRESSION_MODES:
            raise CkptError(f"Options.compression={self.compression!r}: use "
                            + ", ".join(map(repr, COMPRESSION_MODES)))
        if self.checksum not in SAVE_CHECKSUMS:
            raise CkptError(f"Options.checksum={self.checksum!r}: use "
                            + " or ".join(map(repr, SAVE_CHECKSUMS)))
        if self.memory_mapped not in MEMORY_MAPPED_MODES:
            raise CkptError(f"Options.memory_mapped={self.memory_mapped!r}: use "
                            + " or ".join(map(repr, MEMORY_MAPPED_MODES)))
        if self.compress_threads < 1:
            raise CkptError(f"Options.compress_threads={self.compress_threads}: must be >= 1")
        check_s3("Options.s3_", {name[3:]: getattr(self, name) for name in _S3_FIELDS})
        self._check_storage()

    def _check_types(self) -> None:
        """Each number and switch of the kind its field takes: a float byte count, a string
        "false" (always true) or a count given as text would otherwise fail deep inside a save,
        or be obeyed wrongly. One pass with no Python call per field (Options are made per
        save: tests/test_save_call_counts.py): values checked once are remembered."""
        values = _TYPED_VALUES(self)
        values = (values, tuple(map(type, values)))  # 4.0 == 4: the types are part of it
        if values in _CHECKED:
            return
        odd = [(name, kind) for name, kind, optional in _TYPED
               if not (optional and getattr(self, name) is None)
               and (isinstance(getattr(self, name), (str, bytes)) if kind == "bool" else
                    isinstance(getattr(self, name), bool)
                    or not isinstance(getattr(self, name), _KINDS[kind][0]))]
        for name, kind in odd:
            wrong = _wrong_kind(getattr(self, name), kind)
            if wrong:
                raise CkptError(f"Options.{name}={getattr(self, name)!r}: {wrong}")
        if len(_CHECKED) < _CHECKED_MAX:
            _CHECKED.add(values)

    def _check_storage(self) -> None:
        if not isinstance(self.storage, Mapping):
            raise CkptError(f"Options.storage={self.storage!r}: a mapping of scheme name to its "
                            "settings, e.g. {'s3': ckptio.S3Settings(endpoint_url=...)}")
        object.__setattr__(self, "storage", SchemeSettings(self.storage))
        defaults = Options.__dataclass_fields__
        for scheme, names in _SUGAR.items():
            set_too = [n for n in names if getattr(self, n) != defaults[n].default]
            if scheme in self.storage and set_too:
                raise CkptError(
                    f"Options: storage[{scheme!r}] and {', '.join(set_too)} both give the "
                    f"{scheme}:// settings; give them once, in storage[{scheme!r}] (e.g. "
                    f"S3Settings(endpoint_url=...)), and unset {set_too[0]} (also its CKPTIO_"
                    f"{set_too[0].upper()} environment variable)")

    def settings(self, scheme: str, kind: type[T]) -> T | None:
        """The settings ``storage`` gives ``scheme``, as a ``kind``: the object itself, or
        ``kind(**mapping)``; None where storage names none for it."""
        given = self.storage.get(scheme.lower())
        if given is None or isinstance(given, kind):
            return given
        if not isinstance(given, Mapping):
            raise CkptError(f"Options.storage[{scheme!r}]={given!r}: give a {kind.__name__} "
                            f"(the {scheme}:// settings) or a mapping of its fields")
        try:
            return kind(**given)
        except TypeError as exc:
            raise CkptError(f"Options.storage[{scheme!r}]={dict(given)!r}: {exc}; the fields of "
                            f"{kind.__name__} are the {scheme}:// settings") from None

    def with_settings(self, scheme: str, settings: object) -> Options:
        """These options with ``settings`` as ``scheme``'s (its older Options spelling unset)."""
        unset: dict[str, Any] = {n: Options.__dataclass_fields__[n].default
                                 for n in _SUGAR.get(scheme, ())}
        return dataclasses.replace(self, storage={**self.storage, scheme: settings}, **unset)

    @property
    def nbuffers(self) -> int:
        return self.pool_bytes // self.buffer_bytes

    @classmethod
    def from_env(cls, **overrides: object) -> Options:
        """Defaults, then CKPTIO_* environment variables, then explicit ``overrides``."""
        fields = {each.name: each.type for each in dataclasses.fields(cls) if each.name != "storage"}
        env = environment.read(fields)  # storage: objects, not spelt in the environment
        spelt = [n for n in env if overrides.get(n) is None]
        env.update({k: v for k, v in overrides.items() if v is not None})
        environment.warn_misspelt(fields)
        try:
            return cls(**env)  # type: ignore[arg-type]
        except CkptError as exc:
            raise environment.restated(exc, spelt) from None


# Options' fields checked by _check_types: (name, "int" / "float" / "bool", None allowed)
_TYPED = tuple((f.name, str(f.type).removesuffix(" | None"), str(f.type).endswith(" | None"))
               for f in dataclasses.fields(Options)
               if str(f.type).removesuffix(" | None") in ("int", "float", "bool"))
_TYPED_VALUES = operator.attrgetter(*(name for name, _kind, _none in _TYPED))
_CHECKED: set[tuple[object, ...]] = set()  # the typed fields' values found right
_CHECKED_MAX = 256


def _wrong_kind(value: object, kind: str) -> str | None:
    """What ``value`` should have been, where it is not of the annotation ``kind`` ("int",
    "float", "bool"; other annotations are not checked here); None where it is."""
    if kind == "bool":
        return "True or False, not a string" if isinstance(value, (str, bytes)) else None
    wanted = _KINDS.get(kind)
    if wanted is None or (isinstance(value, wanted[0]) and not isinstance(value, bool)):
        return None
    return f"{wanted[1]}, not a {type(value).__name__}"


def check_s3(prefix: str, settings: Mapping[str, Any]) -> None:
    """The rules of the S3 settings (concurrency, read_bytes, retry_deadline_s, lock_lease_s,
    conditional), for Options' ``s3_*`` fields and S3Settings alike; errors name
    ``prefix + field``."""
    for name, kind in (("concurrency", "int"), ("read_bytes", "int"),
                       ("retry_deadline_s", "float"), ("lock_lease_s", "float")):
        wrong = _wrong_kind(settings[name], kind)
        if wrong:
            raise CkptError(f"{prefix}{name}={settings[name]!r}: {wrong}")
    if settings["concurrency"] < 1:
        raise CkptError(f"{prefix}concurrency={settings['concurrency']}: must be >= 1")
    read = settings["read_bytes"]
    if read < 0 or not is_aligned(read):
        raise CkptError(f"{prefix}read_bytes={read}: must be 0 (one GET per buffer) or a "
                        f"multiple of {BLOCK}, e.g. 16 MiB")
    if not settings["retry_deadline_s"] >= 0:
        raise CkptError(f"{prefix}retry_deadline_s={settings['retry_deadline_s']}: must be >= 0 "
                        "seconds")
    if not settings["lock_lease_s"] >= 2:  # a lock's age comes from 1-second HTTP dates
        raise CkptError(f"{prefix}lock_lease_s={settings['lock_lease_s']}: must be >= 2 seconds "
                        "(the store dates a lock to the second, so a shorter lease could let a "
                        "waiter take a live holder's lock)")
    if settings["conditional"] not in ("require", "off"):
        raise CkptError(f"{prefix}conditional={settings['conditional']!r}: use 'require' or 'off'")
