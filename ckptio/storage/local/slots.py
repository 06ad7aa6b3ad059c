"""The slots of a memory tier's root: data files of dropped steps (and, at a manager's
prepare, files made ahead for its first saves), kept in ``.ckptio-slots`` beside the steps so
that a new save's file is taken from one whose pages are allocated and mapped already.

A LocalRoot on tmpfs (a manager's memory tier) calls ``keep_slots`` in its retention pass (the
data files of the newest dropped steps, at most SLOT_STEPS, become slots; older ones go with a
dropped step), ``warm_slots`` after it (each slot mapped here, populated), ``make_slots`` at
prepare, and ``drop_slots`` at the manager's close. A mapped save's file is taken by
``take_slot`` (renamed into place, never over a file) before storage/local/mapped.py maps it;
``warm_fit`` tells a save whether slots of its files' sizes are mapped ahead (otherwise it goes
through the staging pool: a fresh mapping would allocate and fault pages inside the call).

Owns: the slot directory and which slot a file is taken from. Does not own: the mappings and
their cache (storage/local/mapped.py's Mappings, the root's, passed in), which steps are
dropped (the manager).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
from collections.abc import Callable, Sequence

from ckptio.storage import holder as holders
from ckptio.storage.local.mapped import SLOTS_DIR, MappedFile, Mappings, libc, size_file

__all__ = ["SLOTS_DIR", "SLOT_STEPS", "drop_slots", "keep_slots", "make_slots", "slot_nbytes",
           "take_slot", "warm_fit", "warm_slots"]

log = logging.getLogger("ckptio")
SLOT_STEPS = 2  # the dropped steps whose data files a root keeps as slots, at most
DATA_PREFIX = "data-"  # the data files (planning/layout.py's names): what a slot keeps
_RENAME_NOREPLACE = 1
_AT_FDCWD = -100


def take_slot(path: str, nbytes: int, mappings: Mappings) -> bool:
    """Rename the best-sized slot file of ``path``'s root (two levels up) to ``path`` (of the
    size and mapped idle in ``mappings``, the root's, first)."""
    slots = _slots_of(path)
    try:
        with os.scandir(slots) as it:
            found = [(e.stat(follow_symlinks=False), e.path) for e in it
                     if e.is_file(follow_symlinks=False)]
    except OSError:
        return False
    mapped = mappings.idle_keys()  # the best fit: of the size, mapped already, else the nearest
    found.sort(key=lambda s: (s[0].st_size != nbytes, (s[0].st_dev, s[0].st_ino) not in mapped,
                              s[0].st_size < nbytes, abs(s[0].st_size - nbytes)))
    for _info, source in found:
        code = _rename_noreplace(source, path)
        if code == 0:
            return True
        if code != errno.ENOENT:  # EEXIST (the create says so), or no renameat2: a new file
            return False
    return False


def _slots_of(path: str) -> str:
    """The slot directory of a step's file ``path`` (its root's)."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(path))), SLOTS_DIR)


def _rename_noreplace(source: str, target: str) -> int:
    """rename(2) that never replaces ``target`` -> 0 or the errno."""
    lib = libc()
    if not hasattr(lib, "renameat2"):
        return errno.ENOSYS
    if lib.renameat2(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(target),
                     _RENAME_NOREPLACE) == 0:
        return 0
    return ctypes.get_errno()


def keep_slots(root: str, dropped: Sequence[tuple[int, str]],
               most_nbytes: int | None = None) -> None:
    """Of the dropped step directories ``dropped`` ((step, directory), oldest first), make the
    data files of the newest steps the slots of ``root``, with the slots held before: the
    newest SLOT_STEPS steps' files are kept (no more than ``most_nbytes`` of them: the tier's
    max_bytes less its steps), the older ones go into the newest dropped directory, removed
    with it. Two steps drop at once where one was pinned (a drain copying it): keeping both
    keeps the ring big enough that the next pin finds a slot too. A failure is logged: the
    removal deletes what is left."""
    if not dropped:
        return
    newest, slots = dropped[-1][1], os.path.join(root, SLOTS_DIR)
    try:
        fresh = [(step, _data_files(directory)) for step, directory in dropped[-SLOT_STEPS:]]
        fresh = [(step, files) for step, files in fresh if files]
        if not fresh:
            return
        os.makedirs(slots, exist_ok=True)
        with os.scandir(slots) as it:
            held = [(e.path, e.name, e.stat(follow_symlinks=False).st_size) for e in it]
        keep = sorted({step for step, _ in fresh} | {_slot_step(n) for _, n, _ in held})
        keep = _within(keep[-SLOT_STEPS:], most_nbytes, fresh, held)
        # files made ahead of sizes no save writes (prepare() saw a state before its
        # optimizer had any: a fresh job's) would hold their pages until two steps dropped
        sizes = {os.path.getsize(source) for _, files in fresh for source in files}
        for source, name, size in held:
            if _slot_step(name) not in keep or (name.startswith("prepared.")
                                                and size not in sizes):
                os.rename(source, os.path.join(newest, f"old-slot-{name}"))
        for step, files in fresh:
            if step in keep:
                for source in files:
                    os.rename(source, os.path.join(slots, f"{step}.{os.path.basename(source)}"))
    except OSError as exc:
        log.warning("ckptio: could not keep the pages of %s for later saves (%s); they are "
                    "removed with it", newest, exc)


def _within(keep: list[int], most_nbytes: int | None, fresh: list[tuple[int, list[str]]],
            held: list[tuple[str, str, int]]) -> list[int]:
    """The newest of the steps ``keep`` whose slot files (``fresh`` ones, ``held`` ones) add up
    to no more than ``most_nbytes`` (None: all of them)."""
    if most_nbytes is None:
        return keep
    nbytes = dict.fromkeys(keep, 0)
    for step, files in fresh:
        nbytes[step] = nbytes.get(step, 0) + sum(map(os.path.getsize, files))
    for _, name, size in held:
        nbytes[_slot_step(name)] = nbytes.get(_slot_step(name), 0) + size
    kept: list[int] = []
    for step in reversed(keep):
        most_nbytes -= nbytes[step]
        if most_nbytes < 0:
            break
        kept.insert(0, step)
    return kept


def _data_files(directory: str) -> list[str]:
    with os.scandir(directory) as it:
        return [e.path for e in it
                if e.name.startswith(DATA_PREFIX) and e.is_file(follow_symlinks=False)]


def _slot_step(name: str) -> int:
    """The dropped step a slot file came from (``<step>.<data file>``; -1: unknown, oldest)."""
    head = name.split(".", 1)[0]
    return int(head) if head.isdigit() else -1


def make_slots(root: str, sizes: Sequence[int], sets: int,
               most_nbytes: int | None = None) -> None:
    """Slot files of ``sizes`` for ``root``'s first ``sets`` saves, every page allocated (a
    manager's prepare: its memory tier's first saves then copy into slots mapped ahead, not
    through the pool), whole sets only, no more than ``most_nbytes`` in all (the tier's
    max_bytes less its steps). Sizes held already count: dropped steps' files and this
    process's own (another rank's are its own). Named as the oldest dropped step
    (``prepared.*``), so a dropped step's files outrank them."""
    slots, mine = os.path.join(root, SLOTS_DIR), f"prepared.{os.getpid()}."
    os.makedirs(slots, exist_ok=True)
    _remove_orphans(slots)
    with os.scandir(slots) as it:
        held = [e.stat(follow_symlinks=False).st_size for e in it
                if e.is_file(follow_symlinks=False)
                and (e.name.startswith(mine) or not e.name.startswith("prepared."))]
    if most_nbytes is not None:  # whole sets (the slots held of those sizes among them)
        sets = min(sets, most_nbytes // max(1, sum(sizes)))
    for index, size in enumerate(sorted(list(sizes) * sets)):
        if size in held:
            held.remove(size)
            continue
        path = os.path.join(slots, f"{mine}{index:04d}.{size}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            size_file(fd, size)
        except OSError:  # a full tmpfs: a slot of the size with pages missing would be taken
            os.unlink(path)  # by a save, whose allocation then fails for want of them
            raise
        finally:
            os.close(fd)


def _remove_orphans(slots: str) -> None:
    """Remove the files made ahead by a process that is gone (``prepared.<pid>.*``: killed
    before its close() removed them). No one takes them but a save of the same sizes, and
    make_slots counts only its own process's: left, each killed start of a job would leave
    its first saves' worth of host memory behind for good. A live process's (another rank's
    on this host) are its own."""
    with os.scandir(slots) as it:
        names = [e.name for e in it if e.name.startswith("prepared.")]
    for name in names:
        pid = name.split(".")[1]
        if pid.isdigit() and not holders.alive(int(pid)):
            try:
                os.unlink(os.path.join(slots, name))
            except FileNotFoundError:
                continue  # taken by a save, or removed by another rank meanwhile
            log.info("ckptio: removed %s, made ahead by process %s, which is gone", name, pid)


def warm_slots(root: str, mappings: Mappings,
               on_mapped: Callable[[MappedFile], object] | None = None) -> None:
    """Map ``root``'s slot files into ``mappings`` (the root's) with every page-table entry
    populated (MAP_POPULATE), so the save that takes one copies into resident, mapped pages
    (the retention's pass, before the next save: only slots written through the staging pool
    cost anything, a mapped save's files are mapped already and left as they are). ``on_mapped``: called with each
    newly mapped slot (page-locking it for device copies). The mappings of files removed
    since (slots an earlier pass rotated out with a dropped step) are unmapped first: only a
    mapped save's open unmaps them otherwise, and a save that never maps (a packed or delta
    one) kept every removed slot's pages mapped, the tmpfs filling step by step."""
    mappings.prune()
    try:
        with os.scandir(os.path.join(root, SLOTS_DIR)) as it:
            paths = [e.path for e in it if e.is_file(follow_symlinks=False)]
    except OSError:
        return
    for path in paths:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue  # taken by a save meanwhile
        entry = mappings.cache_idle(path, fd)
        if entry is not None and on_mapped is not None:
            on_mapped(entry)


def warm_fit(directory: str, sizes: Sequence[int], mappings: Mappings) -> bool:
    """Whether the slot files beside step directory ``directory`` that ``mappings`` (the root's)
    holds idle hold files of exactly ``sizes``, one each: a save of those files then
    copies into resident, mapped pages, never allocating or faulting one (a slot of another
    size would be resized and mapped afresh inside the save's call)."""
    slots = os.path.join(os.path.dirname(os.path.abspath(directory)), SLOTS_DIR)
    try:
        with os.scandir(slots) as it:
            found = [e.stat(follow_symlinks=False) for e in it if e.is_file(follow_symlinks=False)]
    except OSError:
        return False
    warm = sorted(i.st_size for i in found if mappings.idle((i.st_dev, i.st_ino), i.st_size))
    for size in sorted(sizes):
        if size in warm:
            warm.remove(size)
        elif size:
            return False
    return True


def slot_nbytes(root: str) -> int:
    """Bytes of ``root``'s slots: free for its next save, which takes them."""
    try:
        with os.scandir(os.path.join(root, SLOTS_DIR)) as it:
            return sum(e.stat(follow_symlinks=False).st_size for e in it
                       if e.is_file(follow_symlinks=False))
    except OSError:
        return 0


def drop_slots(root: str, mappings: Mappings | None) -> None:
    """Remove ``root``'s slots (no later save of this manager takes them) and unmap the
    mappings (the root's) of files removed: their pages go back to the host. ``mappings``
    None (at interpreter exit, a thread may still hold one): the files alone, their pages
    going back once the process has unmapped them."""
    shutil.rmtree(os.path.join(root, SLOTS_DIR), ignore_errors=True)
    if mappings is not None:
        mappings.prune()
