"""The tools the StepRoot checks share: what the suite needs of one kind of root (Roots),
committing a checkpoint at a location (through its Store, or a real ``ckptio.save``), an
interrupted save, what a step's location holds, and the rules a message must keep (it names
the path; it never advises deleting).

Call order: a check makes its root with ``roots.make(key)``, commits a step with
``commit_step`` (the step's pending removal finished first, as the manager does), then asserts
with ``assert_gone`` / ``assert_nothing_left`` / ``manifest_at``.

Owns: these helpers, the names no root may list as steps. Does not own: the checks
(steproot_checks.py), the suite's entry points (steproot_conformance.py), the roots and stores
(ckptio/storage/).
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

from ckptio.alignment import BLOCK
from ckptio.format.manifest import MANIFEST_NAME
from ckptio.storage.steproot import StepRoot
from ckptio.storage.store_contract import Store, new_save_id
from ckptio.testing.store_check_tools import data_name, write_file

__all__ = [
    "ADVICE",
    "EMPTY",
    "NOT_STEPS",
    "Refuser",
    "Roots",
    "assert_gone",
    "assert_no_deletion_advice",
    "assert_nothing_left",
    "assert_warned_about",
    "child_path",
    "commit_at",
    "commit_by_ckptio",
    "commit_by_store",
    "commit_step",
    "manifest_at",
    "put_file",
    "random_bytes",
    "recorded_warnings",
    "start_step",
]

Refuser = Callable[[StepRoot, int], AbstractContextManager[Any]]
EMPTY: dict[str, list[int]] = {"committed": [], "incomplete": []}
NOT_STEPS = ("step-01", "step-00", "step-x", "step-", "step--1", "step-1a", "Step-3",
             "step-3.bak", "xstep-4", "step-0x5", "step-+6")
ADVICE = ("delete", "rm -", "rmtree", "remove it", "remove the", "erase", "wipe")


@dataclass(frozen=True)
class Roots:
    """What the suite needs of one kind of root.

    ``make(key)`` builds a root at a fresh, unused location for ``key`` (the same key twice
    gives two handles of one root, as a restarted manager would have); ``store_at(location)``
    the Store that serves a location of that kind; ``commit(location)``, optional, commits a
    checkpoint there (default: through ``store_at``: prepare, a data file, commit; or
    ``commit_by_ckptio``, a real ``ckptio.save``)."""

    make: Callable[[str], StepRoot]
    store_at: Callable[[str], Store]
    commit: Callable[[str], None] | None = None


def commit_by_store(store_at: Callable[[str], Store]) -> Callable[[str], None]:
    """Committing a checkpoint at a location through its Store: a data file, then a manifest
    naming it (its bytes are not a real manifest: roots never read one)."""
    def commit(location: str) -> None:
        store = store_at(location)
        store.prepare()
        name = data_name()
        write_file(store, name, random_bytes(BLOCK, location))
        store.commit(f'{{"suite": "steproot", "files": ["{name}"]}}'.encode(), new_save_id())
    return commit


def commit_by_ckptio(location: str) -> None:
    """Committing a checkpoint at a location with ``ckptio.save`` (a real save)."""
    import torch

    import ckptio

    ckptio.save({"x": torch.zeros(2)}, location)


def random_bytes(nbytes: int, seed: str) -> bytes:
    return random.Random(seed).randbytes(nbytes)


def commit_step(roots: Roots, root: StepRoot, step: int) -> bytes:
    """Commit a checkpoint as ``step`` (its pending removal finished first, as the manager
    does) -> its manifest's bytes."""
    finish = root.removal(step)
    if finish is not None:
        finish()
    return commit_at(roots, root.path(step))


def commit_at(roots: Roots, location: str) -> bytes:
    (roots.commit or commit_by_store(roots.store_at))(location)
    return roots.store_at(location).read_manifest()


def put_file(roots: Roots, location: str, name: str) -> None:
    """A file ``name`` at ``location`` (a data file without a manifest: an interrupted save; or
    anything else, a user's or another library's)."""
    store = roots.store_at(location)
    store.prepare()
    write_file(store, name, random_bytes(BLOCK, f"{location}/{name}"))


def start_step(roots: Roots, root: StepRoot, step: int) -> None:
    """An interrupted save as ``step``: a data file, no manifest."""
    put_file(roots, root.path(step), data_name())


def child_path(root: StepRoot, name: str) -> str:
    return f"{root.location}/{name}"


def manifest_at(roots: Roots, location: str) -> bytes | None:
    store = roots.store_at(location)
    return store.read_manifest() if MANIFEST_NAME in store.sizes([MANIFEST_NAME]) else None


def assert_gone(roots: Roots, root: StepRoot, step: int) -> None:
    """Nothing is left of ``step``: no manifest, no file of a save."""
    store = roots.store_at(root.path(step))
    assert store.sizes([MANIFEST_NAME]) == {}, f"step {step}'s manifest is still there"
    assert store.names() == [], f"step {step}'s files are still there: {store.names()}"


def assert_nothing_left(root: StepRoot) -> None:
    """After a scan, no removal is due: every hidden step is gone."""
    root.scan()
    assert root.removal() is None, f"{root!r}: a removal is still due after it finished"


def assert_no_deletion_advice(message: str) -> None:
    for word in ADVICE:
        assert word not in message.lower(), f"a message must never advise deleting: {message}"


@contextmanager
def recorded_warnings() -> Iterator[list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def assert_warned_about(caught: list[warnings.WarningMessage], path: str) -> None:
    texts = [str(w.message) for w in caught]
    assert any(path in text for text in texts), f"no warning names {path}: {texts}"
    for text in texts:
        assert_no_deletion_advice(text)
