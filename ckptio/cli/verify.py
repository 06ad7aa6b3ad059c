"""``ckptio verify PATH``: check every stored byte, and report every damaged tensor.

A delta checkpoint (docs/FORMAT.md version 4) is checked with its chain: each base it
references (a sibling step, chains have depth 1) is verified too, and a damaged or missing base
is named ("its base step-10 (...) fails verification"), exit status 1.

The tensors are verified a batch at a time (``Checkpointer.verify`` on the part of the manifest
each batch holds); a batch that fails is verified again key by key, so the report names every
damaged key, not only the first, each with what is wrong (checksum mismatch, missing file),
and the keys that verified; a truncated data file is one line: where it ends and the tensors
stored past that. Exit status: 0 every byte matches, 1 damage found
(the report on stdout), 2 the checkpoint could not be checked at all (one line on stderr).

Owns: the batches, the per-key report and verify's advice (which is about the checkpoint, not a
load in progress). Does not own: reading and checking bytes (ckptio.Checkpointer.verify).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ckptio.cli.ls import human_size
from ckptio.cli.progress import Bar
from ckptio.errors import CkptError, CorruptCheckpointError, StorageIOError
from ckptio.format.checksum import NO_CHECKSUM
from ckptio.format.types import Manifest, TensorEntry

if TYPE_CHECKING:
    from ckptio.api import Checkpointer

__all__ = ["BATCH_NBYTES", "Damage", "fact", "run", "run_steps"]

BATCH_NBYTES = 64 << 20  # verified together; a failing batch is verified again key by key
# where a read error's own advice (written for a load that stopped) begins: verify says its own
_ADVICE = re.compile(r"[.;:]?\s*(The data file is corrupt|the checkpoint is damaged|The manifest "
                     r"is damaged|load an earlier|Load an earlier)", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Damage:
    key: str
    what: str  # the fact, without a load's advice


def fact(message: str) -> str:
    """A read error's message without the advice it gives a load ("load an earlier ...")."""
    found = _ADVICE.search(message)
    return (message[:found.start()] if found else message).rstrip(" .;:")


def _by_key(record: Manifest) -> dict[str, list[TensorEntry]]:
    out: dict[str, list[TensorEntry]] = {}
    for entry in record.tensors:
        out.setdefault(entry.key, []).append(entry)
    return out


def _batches(keys: dict[str, list[TensorEntry]]) -> Iterator[list[str]]:
    batch: list[str] = []
    held = 0
    for key, entries in keys.items():
        size = sum(e.nbytes for e in entries)
        if batch and held + size > BATCH_NBYTES:
            yield batch
            batch, held = [], 0
        batch.append(key)
        held += size
    if batch:
        yield batch


def _check(checkpointer: Checkpointer, path: str, record: Manifest,
           keys: dict[str, list[TensorEntry]], batch: list[str],
           damage: tuple[type[Exception], ...]) -> list[Damage]:
    """Verify the tensors of ``batch``; on a failure, each key alone -> the damaged ones.
    ``damage``: the errors that mean damage (the others, e.g. a store that went away, are
    raised)."""
    def one(names: list[str]) -> None:
        part = dataclasses.replace(record, tensors=tuple(e for n in names for e in keys[n]))
        checkpointer.verify(path, record=part)

    try:
        one(batch)
        return []
    except damage:
        pass
    damaged = []
    for key in batch:
        try:
            one([key])
        except damage as exc:
            damaged.append(Damage(key, fact(str(exc))))
    return damaged


def _manifest(checkpointer: Checkpointer, path: str) -> tuple[Manifest, bool]:
    """The manifest of ``path``, as a load opens it, and whether its data files are all there;
    a ckptio checkpoint whose data files are missing or short is still opened (from its
    manifest alone), so that every tensor in them is named."""
    from ckptio.cli.source import manifest_of, open_manifest
    from ckptio.errors import ManifestError

    try:
        return manifest_of(checkpointer, path), True
    except CorruptCheckpointError as exc:
        if isinstance(exc, ManifestError):
            raise
        opened = open_manifest(path)
        if opened.format != "ckptio":
            raise
        return opened.record, False


def _verified(checkpointer: Checkpointer, path: str,
              progress: bool) -> tuple[Manifest, int, list[Damage]]:
    """-> (the manifest of ``path``, its keys, the damaged ones)."""
    damaged: list[Damage] = []
    record, whole = _manifest(checkpointer, path)
    # a file that cannot be opened is damage only where the manifest check found files
    # missing: otherwise (a store gone away) it is an error, raised
    damage = (CorruptCheckpointError,) if whole else (CorruptCheckpointError, StorageIOError)
    keys = _by_key(record)
    with Bar(sum(t.nbytes for t in record.tensors), "verify", progress) as bar:
        for batch in _batches(keys):
            damaged += _check(checkpointer, path, record, keys, batch, damage)
            bar.update(sum(e.nbytes for k in batch for e in keys[k]))
    return record, len(keys), damaged


def _bases_damaged(checkpointer: Checkpointer, path: str, record: Manifest,
                   progress: bool) -> bool:
    """Verify each base of the delta checkpoint ``record`` (the whole chain: chains have
    depth 1); print what is wrong with a damaged or missing one, naming it -> any damaged."""
    from ckptio.cli.chain import base_location
    from ckptio.errors import CheckpointNotFoundError, IncompleteCheckpointError
    from ckptio.format.manifest import bases_of

    bad = False
    for name in bases_of(record):
        where = base_location(path, name)
        try:
            base, total, damaged = _verified(checkpointer, where, progress)
        except (CorruptCheckpointError, CheckpointNotFoundError,
                IncompleteCheckpointError) as exc:
            print(f"{path}: DAMAGED, its base {name} ({where}) cannot be read: {fact(str(exc))}")
            bad = True
            continue
        if damaged:
            print(f"{path}: DAMAGED, its base {name} ({where}) fails verification:")
            _report(where, base, total, damaged)
            bad = True
        else:
            print(f"{where}: OK (base {name} of {path})")
    return bad


def run(path: str, *, progress: bool) -> int:
    from ckptio.api import Checkpointer
    from ckptio.options import Options

    checkpointer = Checkpointer(Options.from_env())
    try:
        record, total, damaged = _verified(checkpointer, path, progress)
        bad_base = _bases_damaged(checkpointer, path, record, progress)
    finally:
        checkpointer.close()
    nbytes = sum(t.nbytes for t in record.tensors)
    if damaged:
        _report(path, record, total, damaged)
    if damaged or bad_base:
        return 1
    if record.checksum_algorithm == NO_CHECKSUM:  # safetensors: nothing stored to check against
        print(f"{path}: OK, every entry read and its header valid ({human_size(nbytes)} read; "
              "safetensors files store no checksums, so the data itself is not verified)")
    else:
        print(f"{path}: OK, every entry matches its {record.checksum_algorithm} checksum "
              f"({human_size(nbytes)} read)")
    return 0


def run_steps(run_dir: str, steps: list[tuple[int, str]], incomplete: list[int], *,
              progress: bool) -> int:
    """``ckptio verify RUN``: every committed step (``(step, path)``, ascending), each reported
    as ``run`` does; one that cannot be checked at all is named and counted as damaged. -> 1 if
    any step is damaged, else 0; a summary line last."""
    bad: list[int] = []
    for step, path in steps:
        try:
            failed = run(path, progress=progress) != 0
        except CkptError as exc:  # unreadable: said, and the other steps still checked
            print(f"{path}: CANNOT BE CHECKED: {exc}")
            failed = True
        if failed:
            bad.append(step)
    left = f"; incomplete steps {incomplete} not checked (no committed manifest)" if incomplete \
        else ""
    print(f"{run_dir}: {len(steps)} committed step(s) checked, "
          + (f"{len(bad)} damaged: steps {bad}" if bad else "every one OK") + left)
    return 1 if bad else 0


_TRUNCATED = re.compile(r"^data file (?P<file>.+?) is truncated: .*file ends at "
                        r"(?:or before )?(?P<end>\d+)")


def _truncations(damaged: list[Damage]) -> tuple[dict[str, tuple[int, list[str]]],
                                                  list[Damage]]:
    """The damage of short data files, per file: (where it ends, the keys past that), and the
    rest. Where a file ends: the least offset reported (a tensor wholly past the end reports
    its own start)."""
    truncated: dict[str, tuple[int, list[str]]] = {}
    others = []
    for d in damaged:
        found = _TRUNCATED.match(d.what)
        if found is None:
            others.append(d)
            continue
        end, keys = truncated.get(found["file"], (int(found["end"]), []))
        truncated[found["file"]] = (min(end, int(found["end"])), [*keys, d.key])
    return truncated, others


def _span(keys: list[str]) -> str:
    return keys[0] if len(keys) == 1 else f"{keys[0]} ... {keys[-1]}" if len(keys) > 3 else \
        ", ".join(keys)


def _report(path: str, record: Manifest, total: int, damaged: list[Damage]) -> None:
    width = min(60, max(len(d.key) for d in damaged))
    rest = total - len(damaged)
    print(f"{path}: DAMAGED, {len(damaged)} of {total} tensor(s) fail verification"
          + (f" (the other {rest} match their {record.checksum_algorithm} checksums)" if rest
             else "") + ":")
    truncated, others = _truncations(damaged)
    for d in others:
        print(f"  {d.key:{width}s}  {d.what}")
    for name, (end, keys) in truncated.items():
        wanted = next((f" of the {f.nbytes} bytes the manifest records" for f in record.files
                       if name.endswith(f.name)), "")
        print(f"  data file {name} is truncated: it ends at byte {end}{wanted}; the "
              f"{len(keys)} tensor(s) stored past that fail ({_span(keys)})")
    if rest:
        print(f"{path} does not load whole: restore an earlier checkpoint or another copy of "
              "this one; the other keys read correctly (ckptio.load(path, state, keys=...) "
              "loads only those)")
    else:
        print(f"{path} does not load: restore an earlier checkpoint or another copy of this one")
