"""The checkpoint's side of a load: its keys as this rank sees them, and a stored entry's value.

A load's first stage (matching.py) asks ``Sources`` for each key's stored chunks or object:
chunks of one global tensor, or the value a saved rank kept as its own (RNG, data-loader state),
taken from the saved rank ``per_rank_from`` chooses (``source_rank``). ``selector`` turns a
load's ``keys=`` into a test; ``stored_value`` and ``decode_object`` turn what was read back
into the Python value that was saved; ``refuse_pickles`` is the pickle opt-in.

Owns: these lookups and their errors. Does not own: which keys a load takes (matching.py),
which bytes fill which destination (fill_plan.py), reading (read.py).
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ckptio.errors import CkptError, ManifestError, PickleRefusedError, StateMismatchError
from ckptio.format import values
from ckptio.format.types import PICKLED_KINDS, Manifest, ObjectEntry, TensorEntry
from ckptio.format.param_names import is_marker
from ckptio.loading.foreign_common import TORCH_PICKLE, torch_load_value, unpicklable

__all__ = ["KeyFilter", "RankPolicy", "Sources", "TensorSource", "checked_keys", "decode_object",
           "named_nothing", "refuse_pickles", "selector", "source_rank", "stored_value",
           "typo_refusal"]

KeyFilter = None | str | Iterable[str] | Callable[[str], bool]
RankPolicy = None | int | Mapping[int, int] | Callable[[int], int]


def selector(keys: KeyFilter) -> Callable[[str], bool]:
    """A test for the keys ``keys=`` selects: every key, a callable's, or the keys named and
    those under them (CkptError for ``keys=`` of another kind, or naming nothing)."""
    if keys is None:
        return lambda _k: True
    if callable(keys):
        return keys
    wanted = _names(keys)
    return lambda k: any(k == w or k.startswith(w + ".") for w in wanted)


def checked_keys(keys: KeyFilter) -> KeyFilter:
    """``keys=`` as a load keeps it: None, a callable, or its names as a tuple (checked:
    CkptError otherwise), so an iterator's names are read once."""
    return keys if keys is None or callable(keys) else _names(keys)


def _names(keys: str | Iterable[str]) -> tuple[str, ...]:
    """``keys=``'s names, checked: a str, or an iterable of at least one str."""
    names = (keys,) if isinstance(keys, str) else (
        tuple(keys) if isinstance(keys, Iterable) and not isinstance(keys, bytes) else None)
    if names is None or not all(isinstance(w, str) for w in names):
        raise CkptError(f"keys={keys!r}: keys= takes a key's name ('model', or a dotted key "
                        "such as 'model.0.weight'), a list of names, or a callable "
                        "(key -> bool)")
    if not names:
        raise CkptError("keys=[] selects no key: leave keys= out to load every key")
    return names


def named_nothing(keys: KeyFilter, *key_sets: Iterable[str]) -> list[str]:
    """The names in ``keys=`` (not a callable) that select no key of ``key_sets``: a typo."""
    if keys is None or callable(keys):
        return []
    known = [k for ks in key_sets for k in ks]
    return [w for w in _names(keys) if not any(k == w or k.startswith(w + ".") for k in known)]


def typo_refusal(unknown: list[str], sources: Sources, where: str) -> str:
    """What a load says of ``keys=`` names that select no key (``where``: of what)."""
    tops = sorted({k.split(".", 1)[0] for k in sources.keys() if not is_marker(k)})
    dotted = [w for w in unknown if w.endswith(".")]  # export_hf's keys= is a prefix, load's a name
    return (f"keys=: {unknown} select(s) no key of {where} (the checkpoint's top-level keys: "
            f"{tops[:10]}{' ...' if len(tops) > 10 else ''}); check the spelling"
            + (f"; keys= names entries, with no '.' after the name: "
               f"keys={[w.rstrip('.') for w in dotted]}" if dotted else ""))


@dataclass(frozen=True)
class TensorSource:
    """A key's stored chunks: parts of one global tensor, or one rank's own value."""

    key: str
    entries: tuple[TensorEntry, ...]

    @property
    def head(self) -> TensorEntry:
        return self.entries[0]


class Sources:
    """The checkpoint's keys as this rank sees them: each resolved to the chunks or object that
    hold its value; per-rank values taken from the saved rank ``per_rank_from`` chooses (by
    default the same rank, which needs the same world size)."""

    def __init__(self, record: Manifest, rank: int = 0, world_size: int = 1,
                 per_rank_from: RankPolicy = None) -> None:
        chunks: dict[str, list[TensorEntry]] = {}
        own: dict[str, dict[int, TensorEntry | ObjectEntry]] = {}
        for t in record.tensors:
            if t.rank is None:
                chunks.setdefault(t.key, []).append(t)
            else:
                own.setdefault(t.key, {})[t.rank] = t
        self.tensors = {k: TensorSource(k, tuple(v)) for k, v in chunks.items()}
        # regular tensors (version 3) whose chunks the load did not resolve: it reads none
        self.unread = dict.fromkeys(r.key for r in record.regular if r.key not in self.tensors)
        self.objects: dict[str, ObjectEntry] = {}
        for o in record.objects:
            if o.rank is None:
                self.objects[o.key] = o
            else:
                own.setdefault(o.key, {})[o.rank] = o
        self.aliases = dict(record.aliases)
        self.own = own
        self.saved_world = record.world_size
        self.source_rank = source_rank(per_rank_from, rank, world_size, record.world_size)
        self.refused: list[str] = []  # per-rank keys asked for without a rule to pick a rank
        self.absent: list[str] = []  # per-rank keys the chosen saved rank did not save

    def peek(self, key: str) -> ObjectEntry | None:
        """The object saved under ``key`` for this rank, or None (nothing recorded)."""
        if key in self.objects:
            return self.objects[key]
        found = None if self.source_rank is None else self.own.get(key, {}).get(self.source_rank)
        return found if isinstance(found, ObjectEntry) else None

    def keys(self) -> list[str]:
        return [*self.tensors, *self.unread, *self.objects, *self.own, *self.aliases]

    def get(self, key: str) -> TensorSource | ObjectEntry | None:
        """The key's source; None for a per-rank key this rank cannot take (see ``refused``)."""
        key = self.aliases.get(key, key)
        if key in self.objects:
            return self.objects[key]
        if key in self.tensors:
            return self.tensors[key]
        if key in self.unread:
            raise CkptError(f"key {key!r}: its chunks were not resolved before the load planned "
                            "its reads (internal: loading/resolve_regular.py chooses them)")
        if self.source_rank is None:
            self.refused.append(key)
            return None
        value = self.own[key].get(self.source_rank)
        if value is None:
            self.absent.append(key)
            return None
        return value if isinstance(value, ObjectEntry) else TensorSource(key, (value,))

    def check_refused(self) -> None:
        if self.refused:
            raise StateMismatchError(
                f"keys {sorted(self.refused)[:10]} hold each rank's own value (e.g. RNG or "
                f"data-loader state), saved by {self.saved_world} ranks; this load runs on a "
                "different number of ranks, so which rank's value to take is not known. Pass "
                "per_rank_from=0 (take rank 0's), a mapping or function new rank -> saved rank, "
                "or keys=... to leave them out")


def source_rank(policy: RankPolicy, rank: int, world_size: int, saved_world: int) -> int | None:
    """The saved rank whose own values ``rank`` takes (None: no rule picks one)."""
    if policy is None:
        return rank if world_size == saved_world else None
    if isinstance(policy, Mapping):
        if rank not in policy:
            raise StateMismatchError(
                f"per_rank_from (a mapping new rank -> saved rank) has no entry for rank {rank} "
                f"of {world_size}; give every new rank one (the checkpoint was saved by ranks "
                f"0..{saved_world - 1}), or pass a function or one saved rank for all")
        chosen = policy[rank]
    elif callable(policy):
        chosen = policy(rank)
    else:
        chosen = policy
    if type(chosen) is not int or not 0 <= chosen < saved_world:
        raise StateMismatchError(
            f"per_rank_from gave saved rank {chosen!r} for rank {rank}; the checkpoint was saved "
            f"by ranks 0..{saved_world - 1}")
    return chosen


def refuse_pickles(entries: Iterable[TensorEntry], allow_pickle: bool) -> None:
    pickled = sorted({e.key for e in entries if e.kind in PICKLED_KINDS})
    if pickled and not allow_pickle:
        raise PickleRefusedError(
            f"keys {pickled[:10]} were saved pickled; unpickling runs arbitrary code, so it needs "
            "load(..., allow_pickle=True) for a file you trust (or exclude them with keys=...)")


def decode_object(entry: ObjectEntry) -> Any:
    try:
        return values.decode(entry.value)
    except ValueError as exc:
        raise ManifestError(f"key {entry.key!r}: stored value is malformed: {exc}") from None


def stored_value(entry: TensorEntry, tensor: torch.Tensor) -> Any:
    """The stored Python value of a data entry, from the tensor its bytes were read into."""
    if entry.kind == "tensor":
        return tensor
    if entry.kind == "numpy":
        return tensor.numpy()
    if entry.kind == "numpy_scalar":
        return tensor.numpy()[()]
    raw = tensor.numpy().tobytes()
    if entry.kind == "bytesio":
        return io.BytesIO(raw)
    if entry.kind == "bytearray":
        return bytearray(raw)
    if entry.kind == TORCH_PICKLE:  # refuse_pickles let it through: allow_pickle
        return torch_load_value(raw, f"key {entry.key!r}", allow_pickle=True)
    if entry.kind != "pickle":
        return raw
    try:
        return pickle.loads(raw)
    except (ImportError, AttributeError) as exc:  # a class the unpickler cannot find
        raise unpicklable(f"key {entry.key!r}", exc) from None
