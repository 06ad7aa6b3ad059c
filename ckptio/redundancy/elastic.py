"""A restart on another number of ranks, restored from the memory tier with redundancy: the
previous job's pieces (each rank's own one-rank step, its shards placed in their global
tensors: ``meta.piece``) gathered from the hosts' memory and resharded into this job's layout.

Call order (collective over the Guard's control group, every rank; managing/agreed.py):
``Restart(ctx, skipped)`` -> ``next(only)`` -> ``fetch(choice, state, load_kwargs)`` (None: a
piece failed, ``next`` again) -> ``write(fetched)`` -> the caller loads that piece (this rank's
of this job) and removes it.

1. survey: the first rank of each host lists the pieces its host's memory holds (``r<k>/step-N``
   and partner copies) with the rank count of the job that saved them; a piece held nowhere
   is rebuilt from parity first where its group allows (regrow.py), then surveyed again;
2. plan (pieces.py): the newest step of another rank count whose every piece is held somewhere,
   each sent by the first rank of a host holding it, which shares its manifest;
3. fetch: each rank works out the entries its state needs (pieces.py); each holder reads them,
   checks each against its checksum (a piece that fails is passed over, the plan made again)
   and sends every rank its section of that rank's file, received in place;
4. write: committed as this rank's piece of this job in ``.redundancy/step-N/elastic-r<rank>``.
Steps the plan does not offer (more pieces lost than parity rebuilds, deltas): docs/BEHAVIOUR.md.

Owns: the survey, the exchange and the assembled piece. Does not own: the plan and which
entries a rank needs (pieces.py, pure), the load (the caller's tier), the same-world recovery
(rebuild.py), the names on each host (marks.py).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch

from ckptio.alignment import BLOCK, align_up
from ckptio.errors import CkptError, StateMismatchError, StorageIOError
from ckptio.format.checksum import entry_checksum
from ckptio.format.manifest import MANIFEST_NAME, decode, encode, version_for
from ckptio.format.types import FileInfo, ObjectEntry
from ckptio.redundancy import marks, peers
from ckptio.redundancy.pieces import Choice, Found, Source, item_id, merged, needed, plan
from ckptio.redundancy.regrow import regrow
from ckptio.redundancy.topology import Topology
from ckptio.storage.store_contract import TreeStore, new_save_id

__all__ = ["Context", "Fetched", "Restart", "survey"]

log = logging.getLogger("ckptio")
MAX_ROUNDS = 16


@dataclass
class Context:
    """What the restart needs of the Guard on this rank."""

    group: Any  # the gloo control group
    rank: int
    world: int
    topology: Topology  # this job's hosts
    root: str  # the memory tier's local directory


def _store(root: str, step: int, k: int, kind: str) -> TreeStore:
    tree = marks.tree_of(root)
    if kind == "own":
        return tree.child(marks.rank_name(k)).child(f"step-{step}")
    return marks.held(tree, step).child(marks.copy_name(k))


def _piece(store: TreeStore, step: int, k: int, kind: str) -> list[Found]:
    try:
        record = decode(store.read_manifest(), store.path_of(MANIFEST_NAME))
    except CkptError:
        return []  # incomplete, removed meanwhile or unreadable: not a piece to offer
    piece = record.meta.get("piece")
    if not isinstance(piece, dict) or piece.get("rank") != k or record.bases:
        return []
    return [[step, k, int(piece["world_size"]), kind]]


def survey(ctx: Context) -> list[Found]:
    """Step 1: the pieces this host's memory holds (reported by its first rank only)."""
    topo = ctx.topology
    if topo.hosts[topo.host_of(ctx.rank)][0] != ctx.rank:
        return []
    tree, found = marks.tree_of(ctx.root), []
    for k in marks.rank_dirs(tree):
        for step, store in marks.step_dirs(tree.child(marks.rank_name(k))).items():
            found += _piece(store, step, k, "own")
    for step, held in marks.held_steps(tree).items():
        for k in marks.copies(held):
            found += _piece(held.child(marks.copy_name(k)), step, k, "copy")
    return found


def _manifest(ctx: Context, step: int, k: int, kind: str) -> dict[str, Any]:
    """A holder's manifest of one piece (decoded: CRC and fields checked), or why not."""
    store = _store(ctx.root, step, k, kind)
    try:
        data = store.read_manifest()
        decode(data, store.path_of(MANIFEST_NAME))
        return {"ok": True, "manifest": data.decode()}
    except (CkptError, OSError, UnicodeDecodeError) as exc:
        return {"ok": False, "why": f"{store.location}: {type(exc).__name__}: {exc}"}


class Restart:
    """One restore's search (collective: construct, then ``next`` / ``fetch`` on every rank).
    Each piece passed over is appended to ``skipped`` (and logged)."""

    def __init__(self, ctx: Context, skipped: list[str]) -> None:
        self.ctx, self.skipped = ctx, skipped
        self.reports = peers.all_gather_json(ctx.group, survey(ctx))
        if regrow(ctx, self.reports, skipped):  # a lost piece rebuilt from parity: now held
            self.reports = peers.all_gather_json(ctx.group, survey(ctx))
        self.bad: set[str] = set()
        self.rounds = 0

    def next(self, only: int | None) -> Choice | None:
        """Step 2: the newest step every piece of which is held (its manifests read), or None."""
        while self.rounds < MAX_ROUNDS:
            self.rounds += 1
            chosen = plan(self.reports, self.ctx.world, self.bad, only)
            if chosen is None:
                return None
            step, old, sources = chosen
            mine = {str(k): _manifest(self.ctx, step, k, kind)
                    for k, (kind, holder) in sources.items() if holder == self.ctx.rank}
            read: dict[str, Any] = {}
            for part in peers.all_gather_json(self.ctx.group, mine):
                read.update(part)
            failed = {int(k): r["why"] for k, r in read.items() if not r["ok"]}
            if not failed:
                return Choice(step, old, sources, {
                    int(k): decode(r["manifest"].encode(), f"rank {k}'s piece of step {step}")
                    for k, r in read.items()})
            self._pass_over(step, sources, failed)
        return None

    def _pass_over(self, step: int, sources: dict[int, Source], failed: dict[int, str]) -> None:
        for k, why in sorted(failed.items()):
            text = f"rank {k}'s piece of step {step} ({sources[k][0]}): {why}"
            self.skipped.append(text)
            log.warning("ckptio: a restart on %d ranks passes over %s", self.ctx.world, text)
            self.bad.add(item_id(step, k, sources[k]))

    def fetch(self, choice: Choice, state: Any, load_kwargs: dict[str, Any]) -> Fetched | None:
        """Steps 3-4: this rank's entries of ``choice``, received (every sent entry checked
        against its checksum by its holder); None when a piece failed (passed over: call
        ``next`` again). A state the step cannot be resharded into: StateMismatchError, on
        every rank."""
        ctx, error, needs = self.ctx, None, []
        objects: list[ObjectEntry] = []
        try:
            kept, objects = merged(choice, ctx.rank, ctx.world, load_kwargs.get("per_rank_from"))
            needs = needed(choice, kept, state, load_kwargs.get("keys"))
        except CkptError as exc:  # said to every rank below: none is left waiting
            error = str(exc) if isinstance(exc, StateMismatchError) else (
                f"{type(exc).__name__}: {exc}")
        every = peers.all_gather_json(ctx.group, {"needs": needs, "error": error})
        errors = [f"rank {r}: {e['error']}" for r, e in enumerate(every) if e["error"]]
        if errors:
            raise StateMismatchError(f"step {choice.step} cannot be resharded from memory into "
                                     f"this state: {errors[0]}")
        wants = [[(int(k), int(i)) for k, i in e["needs"]] for e in every]
        layouts = [_layout(choice, w) for w in wants]
        placed, size = layouts[ctx.rank]
        out = torch.empty(size, dtype=torch.uint8)
        _zero_gaps(out, choice, placed, 0)
        payloads, failed = _read(ctx, choice, layouts, out)
        bad: dict[str, str] = {}
        for part in peers.all_gather_json(ctx.group, {str(k): w for k, w in failed.items()}):
            bad.update(part)
        if bad:
            self._pass_over(choice.step, choice.sources, {int(k): w for k, w in bad.items()})
            return None
        _exchange(ctx, choice, payloads, placed, out)
        return Fetched(choice, placed, objects, out)

    def write(self, fetched: Fetched) -> TreeStore:
        """Commit what this rank received as its piece of this job -> its store (remove it
        after the load)."""
        return _write(self.ctx, fetched)


@dataclass
class Fetched:
    """What a rank received for its piece: its entries (old rank, index, offset in its file),
    objects, and the file's bytes (each holder's section received in place)."""

    choice: Choice
    placed: list[tuple[int, int, int]]
    objects: list[ObjectEntry]
    data: torch.Tensor


# ------------------------------------------------------------------ the exchange


def _extent(choice: Choice, k: int, i: int) -> int:
    return choice.manifests[k].tensors[i].extent_nbytes


def _holder(choice: Choice, k: int) -> int:
    return choice.sources[k][1]


def _layout(choice: Choice, wanted: list[tuple[int, int]]) -> tuple[
        list[tuple[int, int, int]], int]:
    """A receiver's file: its entries by holder (each holder's a contiguous section), each at
    an aligned offset -> ((old rank, index, offset) per entry, the file's size). Holder and
    receiver compute it alike."""
    placed, at = [], 0
    for k, i in sorted(wanted, key=lambda e: _holder(choice, e[0])):
        placed.append((k, i, at))
        at = align_up(at + _extent(choice, k, i))
    return placed, max(at, BLOCK)


def _section(choice: Choice, placed: list[tuple[int, int, int]], holder: int) -> tuple[
        list[tuple[int, int, int]], int, int]:
    """``holder``'s entries of a layout and the byte range [lo, hi) they span in the file."""
    mine = [e for e in placed if _holder(choice, e[0]) == holder]
    if not mine:
        return [], 0, 0
    return mine, mine[0][2], mine[-1][2] + _extent(choice, mine[-1][0], mine[-1][1])


def _zero_gaps(data: torch.Tensor, choice: Choice, placed: list[tuple[int, int, int]],
               lo: int) -> None:
    """Zero the bytes of ``data`` (the file's bytes from ``lo`` on) that no entry covers."""
    at = lo
    for k, i, offset in placed:
        data[at - lo:offset - lo].zero_()
        at = offset + _extent(choice, k, i)
    data[at - lo:].zero_()


def _read(ctx: Context, choice: Choice, layouts: list[tuple[list[tuple[int, int, int]], int]],
          out: torch.Tensor) -> tuple[dict[int, torch.Tensor], dict[int, str]]:
    """This rank's sections of every rank's file (its own read in place into ``out``), each
    raw entry checked against its checksum; -> ({receiver: section}, {old rank: why} for a
    piece that fails)."""
    sections: dict[int, torch.Tensor] = {}
    for receiver, (placed, _size) in enumerate(layouts):
        mine, lo, hi = _section(choice, placed, ctx.rank)
        if not mine:
            continue
        if receiver == ctx.rank:
            buffer = out[lo:hi]
        else:
            buffer = torch.empty(hi - lo, dtype=torch.uint8)
            _zero_gaps(buffer, choice, mine, lo)
        view = buffer.numpy().data.cast("B") if buffer.numel() else memoryview(b"")
        for k, i, offset in mine:
            at = offset - lo
            why = _read_entry(ctx, choice, k, i, view[at:at + _extent(choice, k, i)])
            if why is not None:
                return {}, {k: why}
        sections[receiver] = buffer
    return sections, {}


def _read_entry(ctx: Context, choice: Choice, k: int, i: int, into: memoryview) -> str | None:
    """Read entry ``i`` of old rank ``k``'s piece into ``into`` -> None, or why it fails."""
    record = choice.manifests[k]
    t = record.tensors[i]
    store = _store(ctx.root, choice.step, k, choice.sources[k][0])
    try:
        got = store.read_into(t.file, into, t.offset) if len(into) else 0
    except (CkptError, OSError) as exc:
        return f"{store.path_of(t.file)}: {type(exc).__name__}: {exc}"
    if got != len(into):
        return f"{store.path_of(t.file)}: {got} bytes at {t.offset}, key {t.key!r} has {len(into)}"
    if not t.coded and entry_checksum(record.checksum_algorithm, record.block_nbytes,
                                      into) != t.checksum:
        return (f"{store.path_of(t.file)}: key {t.key!r}, bytes [{t.offset}, "
                f"{t.offset + len(into)}) do not match their checksum (corrupted)")
    return None


def _exchange(ctx: Context, choice: Choice, sections: dict[int, torch.Tensor],
              placed: list[tuple[int, int, int]], out: torch.Tensor) -> None:
    """Send every rank its sections; receive each other holder's into ``out`` in place."""
    works = [peers.send(ctx.group, data, r) for r, data in sections.items() if r != ctx.rank]
    for holder in sorted({_holder(choice, k) for k, _i, _o in placed} - {ctx.rank}):
        _mine, lo, hi = _section(choice, placed, holder)
        peers.recv_into(ctx.group, out[lo:hi], holder)
    for work in works:
        if work is not None:
            work.wait()


def _write(ctx: Context, fetched: Fetched) -> TreeStore:
    """Commit what this rank received as its piece of this job; -> its store."""
    choice, save_id = fetched.choice, new_save_id()
    name, size = f"data-{save_id}-r00000-0000.bin", fetched.data.numel()
    tensors = tuple(dataclasses.replace(choice.manifests[k].tensors[i], file=name, offset=offset)
                    for k, i, offset in fetched.placed)
    base = choice.manifests[min(choice.manifests)]
    record = dataclasses.replace(
        base, version=version_for(tensors), save_id=save_id, world_size=1,
        files=(FileInfo(name, size, 0),), tensors=tensors, objects=tuple(fetched.objects),
        meta={**base.meta, "piece": {"rank": ctx.rank, "world_size": ctx.world}})
    scratch = marks.held(ctx.root, choice.step).child(marks.elastic_name(ctx.rank))
    try:
        peers.write_checkpoint(scratch, encode(record), [(name, size)], fetched.data)
    except (CkptError, OSError) as exc:
        scratch.remove_tree()
        raise StorageIOError(f"{scratch.location}: cannot write this rank's piece of step "
                             f"{choice.step}: {exc}") from exc
    return scratch
