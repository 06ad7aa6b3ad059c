"""Match a manifest to what a load should produce: fresh objects, or the caller's own state.

Owns: key selection, the strict/missing/unexpected/mismatch rules, dtype and shape checks,
building fresh tensors and Python values, assigning immutable values back into the caller's
containers, the pickle opt-in on load, and the LoadReport. Does not own: reading bytes (it is
handed a ``read`` function, see read.py).
"""

from __future__ import annotations

import functools
import io
import pickle
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from ckptio.errors import CkptError, ManifestError, PickleRefusedError, StateMismatchError
from ckptio.format import values
from ckptio.format.flatten import FlatState, unflatten
from ckptio.format.param_names import is_marker, without_names
from ckptio.format.types import Chunk, Manifest, ObjectEntry, Read, TensorEntry
from ckptio.io.stage import torch_dtype
from ckptio.loading import by_name, merge, param_check
from ckptio.loading.foreign_common import unpicklable
from ckptio.loading.resolve_regular import held_leaf
from ckptio.planning.sharding import check_dense, held

__all__ = ["AgreeFn", "KeyFilter", "LoadReport", "RankPolicy", "Sources", "TensorSource", "fill_fresh",
           "fill_in_place", "selector", "source_rank", "stored_value"]

KeyFilter = None | str | Iterable[str] | Callable[[str], bool]
ReadFn = Callable[[list[Read]], int]


@dataclass(frozen=True)
class LoadReport:
    """What an in-place load did. ``missing``: in the state, not in the checkpoint;
    ``unexpected``: in the checkpoint, not in the state; ``mismatched``: in both but not
    loadable (dtype, shape, type), one "key: why" line each. All three stay empty under
    strict=True, which raises instead."""

    loaded: tuple[str, ...]
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    nbytes_read: int
    mismatched: tuple[str, ...] = ()
    seconds: float = 0.0


def selector(keys: KeyFilter) -> Callable[[str], bool]:
    if keys is None:
        return lambda _k: True
    if callable(keys):
        return keys
    wanted = (keys,) if isinstance(keys, str) else tuple(keys)
    return lambda k: any(k == w or k.startswith(w + ".") for w in wanted)


RankPolicy = None | int | Mapping[int, int] | Callable[[int], int]


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
    if policy is None:
        return rank if world_size == saved_world else None
    if isinstance(policy, Mapping):
        chosen = policy.get(rank)
    elif callable(policy):
        chosen = policy(rank)
    else:
        chosen = policy
    if type(chosen) is not int or not 0 <= chosen < saved_world:
        raise StateMismatchError(
            f"per_rank_from gave saved rank {chosen!r} for rank {rank}; the checkpoint was saved "
            f"by ranks 0..{saved_world - 1}")
    return chosen


def _refuse_pickles(entries: Iterable[TensorEntry], allow_pickle: bool) -> None:
    pickled = sorted(e.key for e in entries if e.kind == "pickle")
    if pickled and not allow_pickle:
        raise PickleRefusedError(
            f"keys {pickled[:10]} were saved pickled; unpickling runs arbitrary code, so it needs "
            "load(..., allow_pickle=True) for a file you trust (or exclude them with keys=...)")


def _decode_object(entry: ObjectEntry) -> Any:
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
    if entry.kind != "pickle":
        return raw
    try:
        return pickle.loads(raw)
    except (ImportError, AttributeError) as exc:  # a class the unpickler cannot find
        raise unpicklable(f"key {entry.key!r}", exc) from None


def _empty(entry: TensorEntry, sizes: tuple[int, ...] | None = None) -> torch.Tensor:
    return torch.empty(entry.chunk.sizes if sizes is None else sizes, dtype=torch_dtype(entry.dtype))


@dataclass
class _Reads:
    """What a load reads: one Read per destination (a whole entry in the same layout, or a
    region assembled from several chunks or parts of them: one read plan for all, see read.py);
    plus dtype conversions done afterwards."""

    reads: list[Read] = field(default_factory=list)
    casts: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (dest, staged)

    def add(self, source: TensorSource, want: Chunk, dest: torch.Tensor) -> None:
        """Fill ``dest`` (the stored dtype; the region's shape) with region ``want``."""
        self.reads.append(Read(source.key, source.entries, want, dest))

    def entries(self) -> Iterable[TensorEntry]:
        """Every stored entry the reads touch, once each."""
        seen: set[int] = set()
        for read in self.reads:
            for entry in read.entries:
                if id(entry) not in seen:
                    seen.add(id(entry))
                    yield entry

    def run(self, read: ReadFn) -> int:
        with torch.no_grad():
            nbytes = read(self.reads)
            for dest, staged in self.casts:
                dest.copy_(staged)
        return nbytes


def _whole(source: TensorSource) -> torch.Tensor:
    """A new tensor holding the source's whole value."""
    return _empty(source.head, source.head.shape)


def fill_fresh(record: Manifest, read: ReadFn, *, keys: KeyFilter, allow_pickle: bool,
               rank: int = 0, world_size: int = 1, per_rank_from: RankPolicy = None) -> Any:
    """Build the saved state as new CPU tensors and Python values (chunks saved by many ranks
    are assembled into whole tensors)."""
    select = selector(keys)
    sources = Sources(record, rank, world_size, per_rank_from)
    found = {k: sources.get(k) for k in sources.keys() if select(k) and not is_marker(k)}
    sources.check_refused()
    reads = _Reads()
    made: dict[int, torch.Tensor] = {}  # by id of the stored entry
    for source in found.values():
        if isinstance(source, TensorSource) and id(source.head) not in made:
            made[id(source.head)] = tensor = _whole(source)
            reads.add(source, Chunk.whole(source.head.shape), tensor)
    _refuse_pickles(reads.entries(), allow_pickle)
    reads.run(read)
    out: dict[str, Any] = {}
    for key, source in found.items():
        if isinstance(source, ObjectEntry):
            out[key] = _decode_object(source)
        elif source is not None:
            out[key] = stored_value(source.head, made[id(source.head)])
    named = any(is_marker(k) for k in sources.keys())
    return unflatten(without_names(record.tree) if named else record.tree, out,
                     prune=keys is not None)


@dataclass
class _InPlace(_Reads):
    # (key, makes the stored value): values replaced in their container, not copied into
    assign: list[tuple[str, Callable[[], Any]]] = field(default_factory=list)
    create: list[str] = field(default_factory=list)  # keys the state lacks, created in a Stateful
    problems: dict[str, str] = field(default_factory=dict)  # key -> what does not match
    resized: list[str] = field(default_factory=list)  # keys whose saved shape differs


def _tensor_into(plan: _InPlace, key: str, value: Any, source: TensorSource, cast: bool,
                 flat: FlatState | None = None) -> None:
    """Plan filling a state leaf (tensor, DTensor, TensorShard, FlatShard, numpy array) with
    the region of the saved tensor it holds (``flat``'s, known once per load, for its leaf)."""
    region = held(value, key) if flat is None else held_leaf(flat, key)
    if region is None:
        if isinstance(value, torch.Tensor):
            plan.problems[key] = f"{key}: the checkpoint holds a tensor, the state a {type(value).__name__}"
        else:  # a Python value (None, a number) where the checkpoint has a tensor: replaced
            _replace(plan, key, source)
        return
    entry = source.head
    if region.shape != entry.shape:
        plan.problems[key] = (f"{key}: shape {region.shape} in the state, {entry.shape} in the "
                              "checkpoint")
        plan.resized.append(key)
        return
    dest, dtype = region.local, torch_dtype(entry.dtype)
    if dest.is_meta:
        plan.problems[key] = (f"{key}: the state's tensor is on the meta device, with no storage "
                              "to load into; materialise the model first (model.to_empty("
                              "device=...)) or build it on a real device")
    elif dest.dtype == dtype:
        plan.add(source, region.chunk, dest)
    elif cast:
        staged = _empty(entry, tuple(dest.shape))
        plan.add(source, region.chunk, staged)
        plan.casts.append((dest, staged))
    else:
        plan.problems[key] = (f"{key}: dtype {dest.dtype} in the state, {dtype} in the "
                              "checkpoint (pass cast=True to convert)")


def _numpy_dest(value: Any) -> torch.Tensor | None:
    if type(value).__module__ == "numpy" and type(value).__name__ == "ndarray" and value.flags.writeable:
        try:
            return torch.from_numpy(value)
        except TypeError:
            return None
    return None


def _replace(plan: _InPlace, key: str, source: TensorSource | ObjectEntry) -> None:
    """Plan reading a stored value whole, to replace the state's leaf in its container."""
    if isinstance(source, TensorSource):
        staged = _whole(source)
        plan.add(source, Chunk.whole(source.head.shape), staged)
        plan.assign.append((key, functools.partial(stored_value, source.head, staged)))
    else:
        plan.assign.append((key, functools.partial(_decode_object, source)))


def _plan_in_place(sources: Sources, flat: FlatState, common: list[str], cast: bool,
                   created: list[str]) -> _InPlace:
    plan = _InPlace()
    for key in common:
        value, source = flat.leaves[key], sources.get(key)
        if source is None:
            continue  # a per-rank key this rank cannot take: reported by check_refused
        kind = source.head.kind if isinstance(source, TensorSource) else None
        if kind == "tensor":
            _tensor_into(plan, key, value, source, cast, flat)  # type: ignore[arg-type]
            continue
        dest = _numpy_dest(value) if kind == "numpy" else None
        if dest is not None:
            _tensor_into(plan, key, dest, source, cast=False)  # type: ignore[arg-type]
        else:  # replaced in its container (tuples rebuilt) once read: merge.put_back
            _replace(plan, key, source)
    for key in created:  # inside a Stateful that lacks them (a fresh optimizer's state)
        source = sources.get(key)
        if source is not None:
            plan.create.append(key)
            _replace(plan, key, source)
    return plan


# many ranks' key step: this rank's unexpected keys, and what to do with those no rank asks
# for once known (at once, or where the read step agrees them: distributed/loadsteps.py)
AgreeFn = Callable[[tuple[str, ...], Callable[[tuple[str, ...]], None]], None]


def fill_in_place(record: Manifest, flat: FlatState, read: ReadFn, *, keys: KeyFilter,
                  strict: bool, cast: bool, allow_pickle: bool, rank: int = 0,
                  world_size: int = 1, per_rank_from: RankPolicy = None,
                  agree_unexpected: AgreeFn | None = None) -> LoadReport:
    """Copy the checkpoint into the tensors of ``flat`` (each leaf gets the region of the saved
    tensor it holds, whatever layout saved it); put other values into their containers,
    rebuilding tuples; create the entries a Stateful lacks; call each Stateful's
    load_state_dict. ``agree_unexpected`` (many ranks) turns this rank's unexpected keys into
    those no rank asks for, before anything is read; every check that refuses the load runs
    then, still before anything is read."""
    chosen = selector(keys)
    sources = Sources(record, rank, world_size, per_rank_from)
    renamed = param_check.differing(flat, sources, chosen)  # the model changed: first
    if renamed and strict:
        raise StateMismatchError(param_check.refusal(renamed[0], sources))
    select = param_check.outside(chosen, renamed)  # those are loaded by name (by_name.py)
    saved = [k for k in sources.keys() if select(k) and not is_marker(k)]
    lists = merge.whole_lists(flat, record.tree)  # replaced whole: their keys are not matched
    lists.keep_selected(select, (*saved, *flat.leaves))
    in_lists = merge.under(lists.whole)
    present = [k for k in flat.leaves if select(k) and not in_lists(k)]
    for key in present:  # before any tensor's storage is asked for (a sparse one has none)
        if isinstance(flat.leaves[key], torch.Tensor):
            check_dense(flat.leaves[key], key)
    saved_set = set(saved)
    common = [k for k in present if k in saved_set]
    tied = _tied(flat, [k for k in present if k not in saved_set], common)
    missing = tuple(k for k in present if k not in saved_set and k not in tied)
    extra = [k for k in saved if k not in flat.leaves or in_lists(k)]
    may_create = merge.creatable(flat)
    created = [k for k in extra if may_create(k) or in_lists(k)]
    unexpected = tuple(k for k in extra if not (may_create(k) or in_lists(k)))
    plan = _plan_in_place(sources, flat, common, cast, created)
    if plan.resized and not strict:  # their optimizer state has the old shape: left out too
        stale = param_check.resized_state(flat, plan.resized)
        dropped = {k: f"{k}: optimizer state of a resized parameter (left out)"
                   for k in (*common, *created) if stale(k)}
        if dropped:
            common = [k for k in common if k not in dropped]
            problems = {**plan.problems, **dropped}
            plan = _plan_in_place(sources, flat, common, cast,
                                  [k for k in created if k not in dropped])
            plan.problems = problems
    by_name_keys = [k for k in sources.keys() if chosen(k) and not is_marker(k)
                    and any(r.reads(k) for r in renamed)]
    by_name_sources = {k: src for k in by_name_keys  # None: per-rank (check_refused says)
                       if (src := sources.get(k)) is not None}
    by_name_keys = list(by_name_sources)
    for key in by_name_keys:
        _replace(plan, key, by_name_sources[key])
    outcome: list[Any] = []  # (missing, unexpected, warnings) once checked

    def check(agreed: tuple[str, ...]) -> None:
        said = _check_keys(flat, missing, agreed, strict, lists.hint())
        outcome[:] = [*_check_plan(plan, sources, missing, strict, allow_pickle), agreed, said]

    if agree_unexpected is None:
        check(unexpected)
    else:  # at once, or (many ranks) in the read step, before its reads
        agree_unexpected(unexpected, check)
    nbytes = plan.run(read)
    if len(outcome) != 4:
        raise CkptError("internal: a load read before its keys were checked")
    missing, plan_said, unexpected, said = outcome
    for text, level in (*said, *plan_said):  # from here: they name the caller's line
        warnings.warn(text, stacklevel=level)
    values = {key: make_value() for key, make_value in plan.assign}
    made = {key: values.pop(key) for key in plan.create}
    saved_by_name = {key: values.pop(key) for key in by_name_keys}
    merge.put_back(flat, record.tree, values, made, lists.whole)
    for r in renamed:
        warnings.warn("strict=False: the model's parameters changed since the save: "
                      + r.summary(by_name.load_into(r, record.tree, saved_by_name)), stacklevel=5)
    skipped = set(sources.absent) | set(sources.refused)
    loaded = tuple(k for k in (*common, *plan.create, *tied, *by_name_keys)
                   if k not in plan.problems and k not in skipped)
    return LoadReport(loaded, missing, unexpected, nbytes, tuple(plan.problems.values()))


Said = list[tuple[str, int]]  # warnings to give: (text, stacklevel from fill_in_place)


def _check_plan(plan: _InPlace, sources: Sources, missing: tuple[str, ...], strict: bool,
                allow_pickle: bool) -> tuple[tuple[str, ...], Said]:
    """The load's refusals after its keys' (per-rank values, dtypes and shapes, pickles) ->
    the missing keys (with the per-rank ones this rank's source lacks) and its warnings."""
    sources.check_refused()
    if sources.absent:
        if strict:
            raise StateMismatchError(
                f"keys {sorted(sources.absent)[:10]} hold each saved rank's own value, and saved "
                f"rank {sources.source_rank} did not save them; choose another rank with "
                "per_rank_from=..., or pass strict=False (or keys=...) to leave them out")
        missing = (*missing, *sources.absent)
    if plan.problems and strict:
        raise _mismatch(plan.problems)
    said: Said = []
    if plan.problems:
        said.append((f"strict=False: {len(plan.problems)} key(s) left as they were, their dtype "
                     "or shape differs (or they hold a resized parameter's optimizer state): "
                     f"{'; '.join(list(plan.problems.values())[:3])} "
                     "(LoadReport.mismatched lists them all)", 5))
    _refuse_pickles(plan.entries(), allow_pickle)
    return missing, said


def _tied(flat: FlatState, absent: list[str], common: list[str]) -> set[str]:
    """Keys absent from the checkpoint whose destination is the very tensor of a key that is
    loaded (tied weights: a Hugging Face export leaves out lm_head.weight, which the model ties
    to the embedding): the load fills them, so they are not missing."""
    def view(leaf: object) -> tuple[object, ...] | None:
        if type(leaf) not in (torch.Tensor, torch.nn.Parameter):
            return None
        t = cast(torch.Tensor, leaf)
        if not t.numel() or t.is_meta:  # every meta tensor's data_ptr is 0
            return None
        return (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype)

    loaded = {v for k in common if (v := view(flat.leaves[k])) is not None}
    return {k for k in absent if (v := view(flat.leaves[k])) is not None and v in loaded}


def _optimizer_hint(flat: FlatState, unexpected: tuple[str, ...]) -> str:
    """A fix for the commonest cause of unexpected keys: a freshly built optimizer's empty
    per-parameter state, passed as opt.state_dict()."""
    for key in unexpected:
        prefix, _, rest = key.partition(".state.")
        if rest and f"{prefix}.param_groups.0.lr" in flat.leaves:
            return (f" Keys such as {key!r} are an optimizer's per-parameter state, which a "
                    "freshly built optimizer does not have until its first step: put the "
                    f"optimizer object itself in the state (e.g. {{{prefix.rsplit('.', 1)[-1]!r}: "
                    "opt}), and ckptio loads it through opt.load_state_dict, creating that "
                    "state.")
    return ""


def _check_keys(flat: FlatState, missing: tuple[str, ...], unexpected: tuple[str, ...],
                strict: bool, lists_hint: str = "") -> Said:
    """StateMismatchError where the keys differ and ``strict``; -> the warnings to give."""
    hint = _optimizer_hint(flat, unexpected)
    if strict and (missing or unexpected):
        differ = "; ".join(f"{what} {_some_keys(keys)}" for what, keys in (
            ("missing from the checkpoint", missing), ("not in the state", unexpected)) if keys)
        rest = " Otherwise pass" if hint or lists_hint else " Pass"
        raise StateMismatchError(
            f"state and checkpoint keys differ: {differ}.{hint}{lists_hint}{rest} "
            "strict=False to load the keys both have, or keys=... to choose which to load")
    if hint:
        return [(f"strict=False: {len(unexpected)} checkpoint keys not loaded.{hint}", 3)]
    if unexpected and not set(flat.leaves) - set(missing):
        return [(
            f"strict=False: the state holds none of the checkpoint's {len(unexpected)} keys "
            f"(e.g. {_some_keys(unexpected[:3])}), so nothing was loaded; an empty container "
            "(a {} or defaultdict) is not filled in place: for new values load with no state "
            "(ckptio.load(path)) or build the state first", 5)]
    return []


def _some_keys(keys: tuple[str, ...]) -> str:
    """The first ten keys as a list, and how many more there are."""
    return f"{list(keys[:10])}{f' and {len(keys) - 10} more' if len(keys) > 10 else ''}"


def _mismatch(problems: dict[str, str]) -> StateMismatchError:
    return StateMismatchError(
        f"{len(problems)} key(s) do not match the checkpoint: "
        + "; ".join(list(problems.values())[:10])
        + ". Fix the state, or pass strict=False to load the rest and skip these")
