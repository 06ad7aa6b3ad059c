"""One tier of a tiered CheckpointManager, as the user declares it: Tier.

    ckptio.Tier("shm://run-7", keep_last=2)                       # host memory, every step
    ckptio.Tier("/nvme/ckpt", every=10, keep_last=2)              # local disk
    ckptio.Tier("s3://bucket/run-7", every=100, keep_every=1000)  # the durable copy

Tiers are listed fastest first. The first tier takes every save (``every`` is its interval,
the old ``save_every``); each later tier receives, by the background drain, the committed steps
divisible by its own ``every``, which must be a multiple of the first tier's (a step reaches a
slower tier only through a faster one). ``keep`` is that tier's retention policy
(ckptio/policies/: KeepLatest(2), AnyOf(...), or a class of your own), or spelled
``keep_last`` / ``keep_every`` (sugar for KeepLatest / KeepEvery; default keep_last=2); the
manager's keep_best / monitor / mode apply to the first tier. ``save``: the first tier's save
policy (SaveEvery, ..., or your own), instead of ``every``.

The first tier, when it is ``shm://``, may be protected across hosts by
``redundancy=ckptio.Partners(n)`` or ``ckptio.Parity(k)`` (redundancy/redundancy.py).

A memory tier (``shm://``, or ``mem://`` within one process) is bounded by ``max_bytes``: a save
into it is refused, before anything is written, when the steps it holds plus the new one would
exceed it (or exceed the free space of its tmpfs), with a message saying how to fit.

Owns: the declaration, its validation, which tiers are host memory, the memory budget check.
Does not own: saving, draining, restoring (managing/manager.py, managing/, managing/drain.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ckptio.distributed.dist import Group
from ckptio.errors import CkptError
from ckptio.format.flatten import flatten
from ckptio.options import GiB
from ckptio.planning.sharding import local_tensor
from ckptio.policies import RetentionPolicy, SavePolicy, check_keep, check_save
from ckptio.redundancy.redundancy import Parity, Partners, check_redundancy
from ckptio.redundancy.topology import host_id
from ckptio.storage.local.slots import slot_nbytes
from ckptio.storage.select import checkpoint_path, scheme_of

__all__ = ["MEMORY_SCHEMES", "Tier", "check_budget", "check_tiers", "is_memory", "newest_size",
           "one_host", "state_nbytes", "step_sizes"]

log = logging.getLogger("ckptio")

MEMORY_SCHEMES = ("shm", "mem")


class _Default(int):
    """keep_last's default (2), told apart from a keep_last=2 given beside keep=."""


_KEEP_LAST = _Default(2)


@dataclass(frozen=True)
class Tier:
    """Where a tiered CheckpointManager keeps steps, how often, and how many (module doc)."""

    location: str
    every: int = 1
    keep_last: int | None = _KEEP_LAST
    keep_every: int | None = None
    max_bytes: int | None = None
    redundancy: Partners | Parity | None = None  # redundancy/redundancy.py; the first tier only
    keep: RetentionPolicy | None = None  # ckptio/policies/; None: keep_last / keep_every
    save: SavePolicy | None = None  # the first tier's; None: every (and the manager's options)

    def __post_init__(self) -> None:
        if not isinstance(self.location, (str, os.PathLike)):
            raise CkptError(f"Tier({self.location!r}): the location is a directory path or a "
                            "URL (shm://NAME, s3://bucket/prefix)")
        object.__setattr__(self, "location", os.fspath(self.location))
        _positive(self, "every", self.every)
        for name in ("keep_last", "keep_every", "max_bytes"):
            if getattr(self, name) is not None:
                _positive(self, name, getattr(self, name))
        check_redundancy(self.location, self.redundancy, scheme_of(self.location) == "shm")
        self._policies()

    def _policies(self) -> None:
        """keep= replaces keep_last / keep_every (then both None); save= replaces every."""
        if self.keep is not None:
            check_keep(self.keep, f"Tier({self.location!r}, keep")
            given = [n for n in ("keep_last", "keep_every") if getattr(self, n) is not None
                     and not isinstance(getattr(self, n), _Default)]
            if given:
                raise CkptError(f"Tier({self.location!r}, keep=..., {given[0]}=...): give one "
                                f"of them (keep_last=n is ckptio.KeepLatest(n), keep_every=N "
                                "ckptio.KeepEvery(steps=N); join rules with ckptio.AnyOf)")
            object.__setattr__(self, "keep_last", None)
        if self.save is not None:
            check_save(self.save, f"Tier({self.location!r}, save")
            if self.every != 1:
                raise CkptError(f"Tier({self.location!r}, save=..., every={self.every}): give one "
                                "of them (every=N is ckptio.SaveEvery(steps=N))")


def is_memory(tier: Tier) -> bool:
    """Whether ``tier`` keeps its steps in host memory (shm://, mem://)."""
    return scheme_of(tier.location) in MEMORY_SCHEMES


def check_tiers(tiers: object) -> list[Tier]:
    """The tiers as a list, or CkptError: at least one, each a Tier, distinct locations, every
    later ``every`` a multiple of the first's."""
    if not isinstance(tiers, (list, tuple)) or not tiers:
        raise CkptError("CheckpointManager(tiers=...): give a list of ckptio.Tier, fastest first")
    out = list(tiers)
    for tier in out:
        if not isinstance(tier, Tier):
            raise CkptError(f"CheckpointManager(tiers=...): {tier!r} is not a ckptio.Tier; write "
                            "ckptio.Tier('shm://run', keep_last=2)")
    seen: dict[str, str] = {}
    for tier in out:
        where = checkpoint_path(tier.location)
        if where in seen:
            raise CkptError(f"CheckpointManager(tiers=...): {tier.location} and {seen[where]} "
                            "are the same place; give each tier its own location")
        seen[where] = tier.location
    for tier in out[1:]:
        if tier.save is not None:
            raise CkptError(f"Tier({tier.location!r}, save=...): only the first tier takes "
                            "saves; a slower tier receives the steps divisible by its every=")
        if tier.redundancy is not None:
            raise CkptError(f"Tier({tier.location!r}, redundancy=...): only the first tier (host "
                            "memory) takes redundancy; the slower tiers are its fallback")
    first = out[0].every
    for tier in out[1:]:
        if tier.every % first:
            raise CkptError(
                f"Tier({tier.location!r}, every={tier.every}): a slower tier receives steps from "
                f"the first one, which saves every {first}; use a multiple of {first}")
    return out


def check_budget(tier: Tier, directory: str, sizes: list[int], estimate: Callable[[], int],
                 others: Callable[[int], tuple[int, int]] | None = None) -> None:
    """Refuse (CkptError) a save into memory tier ``tier`` (at local ``directory``, holding
    steps of ``sizes`` bytes, oldest first) beyond its max_bytes or its filesystem's free
    space. A step's size is the newest held one's, else ``estimate()``. During a save the tier
    holds its kept steps plus the new one. ``others(step_nbytes)``: with redundancy, (the
    bytes held now for other hosts, those the new step's protection adds)."""
    held_nbytes, step_nbytes = sum(sizes), sizes[-1] if sizes else estimate()
    held_others, step_others = (0, 0) if others is None else others(step_nbytes)
    need = held_nbytes + step_nbytes + held_others + step_others
    fits = step_nbytes * ((tier.keep_last or 1) + 1) + 2 * step_others
    if tier.max_bytes is not None and need > tier.max_bytes:
        extra = (f" and {_amount(held_others)} of copies/parity for other hosts, "
                 f"{_amount(step_others)} more with this step (redundancy="
                 f"{tier.redundancy.describe()}; the older protection is removed once this "
                 "step is protected)" if tier.redundancy is not None else "")
        raise CkptError(
            f"memory tier {tier.location}: a step of {_amount(step_nbytes)} does not fit: "
            f"it holds {_amount(held_nbytes)}{extra} and its budget is max_bytes="
            f"{_amount(tier.max_bytes)}. It holds keep_last={tier.keep_last} steps plus the "
            f"one being saved ({_amount(fits)}): raise max_bytes or lower keep_last; the "
            "steps it holds are kept")
    if tier.max_bytes is not None and not sizes and fits > tier.max_bytes:
        log.warning("ckptio: memory tier %s: max_bytes=%s holds fewer than keep_last=%s steps "
                    "of %s plus the one being saved (%s): a save will be refused once it "
                    "holds %s steps, unless its steps get smaller (deltas). Raise max_bytes or "
                    "lower keep_last", tier.location, _amount(tier.max_bytes), tier.keep_last,
                    _amount(step_nbytes), _amount(fits), tier.keep_last or 1)
    free = _free_nbytes(directory)
    if free is not None:  # the dropped step's pages kept for the new one are free for it
        free += slot_nbytes(directory)
    if free is not None and step_nbytes + step_others > free:
        raise CkptError(
            f"memory tier {tier.location}: a step of {_amount(step_nbytes)} does not fit in "
            f"the {_amount(free)} free on the filesystem of {directory} (a tmpfs is bounded "
            "by its size= mount option): free host memory there, or lower keep_last; the steps "
            "it holds are kept")


def _amount(nbytes: int) -> str:
    """A size in a budget message: GiB, or MiB below a tenth of one (a small state's step read
    "0.00 GiB")."""
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB // 10 else f"{nbytes / (1 << 20):.1f} MiB"


def one_host(tiers: list[Tier], group: Group) -> None:
    """Collective: a memory tier without redundancy needs every rank of ``group`` on one host
    (each host's memory holds only its own ranks' files), else CkptError."""
    if not any(is_memory(t) for t in tiers) or group.size == 1:
        return
    hosts = sorted({h.decode() for h in group.all_gather(host_id().encode())})
    if len(hosts) > 1:
        raise CkptError(
            f"memory tier {tiers[0].location}: the ranks run on {len(hosts)} hosts "
            f"({', '.join(hosts[:4])}); a memory tier needs them on one (each host's "
            "memory holds only its own ranks' files): give the memory tier redundancy="
            "ckptio.Partners(1) or ckptio.Parity(k=...) (rank-local, protected across "
            "hosts), or use a shared disk as the first tier")


def state_nbytes(state: Any) -> int:
    """The bytes of ``state``'s tensors (this rank's part: a DTensor's local shard): a first
    save's size estimate."""
    tensors = [local_tensor(value) for value in flatten(state).leaves.values()]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def step_sizes(paths: Iterable[str]) -> list[int]:
    """Bytes each step directory of ``paths`` (local, in order) holds, every file counted (the
    manifest and index files too); one removed meanwhile is left out."""
    sizes = []
    for path in paths:
        try:
            sizes.append(sum(e.stat().st_size for e in os.scandir(path) if e.is_file()))
        except OSError:
            continue
    return sizes


def newest_size(newest_first: Iterable[str]) -> list[int]:
    """``step_sizes`` of the first of ``newest_first`` (local step directories, newest first)
    that is still there, as a list of one (none there: empty): all check_budget reads of the
    held steps without a max_bytes."""
    for size in map(_size_or_none, newest_first):
        if size is not None:
            return [size]
    return []


def _size_or_none(path: str) -> int | None:
    found = step_sizes([path])
    return found[0] if found else None


def _free_nbytes(directory: str) -> int | None:
    path = directory
    while path and not os.path.isdir(path):
        path = os.path.dirname(path)
    try:
        stats = os.statvfs(path or "/")
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


def _positive(tier: Tier, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CkptError(f"Tier({tier.location!r}, {name}={value!r}): must be an integer >= 1")
