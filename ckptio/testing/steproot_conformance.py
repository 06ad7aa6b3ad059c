"""The conformance suite every StepRoot passes (the contract is ckptio/storage/steproot.py).

Call order, as store_conformance.py for stores: pytest: subclass ``StepRootConformance`` and
give it a ``roots`` fixture returning a ``Roots`` (what each field and the optional
``refuse_hide`` / ``refuse_removal`` fixtures are: on Roots and StepRootConformance); plain:
each ``check_*(roots)`` runs one group of checks and raises AssertionError (or the root's own
error) on a failure; ``run_all`` runs them all. Before committing into a step the suite runs
``root.removal(step)``, as the manager does before a save.

Every check asserts a rule a broken root would fail: a root that lists ``step-01`` or a hidden
step, sorts steps as text, hides a step it was never given, removes more than the hidden
steps, or advises deleting anything fails here.

Owns: the checks and their helpers. Does not own: the roots (ckptio/storage/: local/local_root.py,
memory_root.py, s3/root.py), the stores (ckptio/storage/), the policy of which steps a manager
keeps (ckptio/managing/manager.py).
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import pytest

from ckptio.alignment import BLOCK
from ckptio.format.manifest import MANIFEST_NAME
from ckptio.storage.steproot import StepRoot
from ckptio.storage.store_contract import Store, new_save_id
from ckptio.testing.store_check_tools import data_name, write_file

__all__ = [
    "CHECKS", "Refuser", "Roots", "StepRootConformance", "check_empty_root",
    "check_hide_missing_step", "check_hide_refused", "check_hide_then_removal",
    "check_non_step_names_never_listed", "check_nothing_here",
    "check_other_handle_finishes_removal", "check_path_is_a_store_location",
    "check_removal_of_one_step", "check_removal_refused", "check_scan_lists_steps_ascending",
    "commit_by_ckptio", "commit_by_store", "run_all",
]

Refuser = Callable[[StepRoot, int], AbstractContextManager[Any]]
EMPTY: dict[str, list[int]] = {"committed": [], "incomplete": []}
NOT_STEPS = ("step-01", "step-00", "step-x", "step-", "step--1", "step-1a", "Step-3",
             "step-3.bak", "xstep-4", "step-0x5", "step-+6")
_ADVICE = ("delete", "rm -", "rmtree", "remove it", "remove the", "erase", "wipe")


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


# -- helpers ---------------------------------------------------------------------------------

def commit_by_store(store_at: Callable[[str], Store]) -> Callable[[str], None]:
    """Committing a checkpoint at a location through its Store: a data file, then a manifest
    naming it (its bytes are not a real manifest: roots never read one)."""
    def commit(location: str) -> None:
        store = store_at(location)
        store.prepare()
        name = data_name()
        write_file(store, name, _pattern(BLOCK, location))
        store.commit(f'{{"suite": "steproot", "files": ["{name}"]}}'.encode(), new_save_id())
    return commit


def commit_by_ckptio(location: str) -> None:
    """Committing a checkpoint at a location with ``ckptio.save`` (a real save)."""
    import torch

    import ckptio

    ckptio.save({"x": torch.zeros(2)}, location)


def _pattern(nbytes: int, seed: str) -> bytes:
    return random.Random(seed).randbytes(nbytes)


def _commit(roots: Roots, root: StepRoot, step: int) -> bytes:
    """Commit a checkpoint as ``step`` (its pending removal finished first, as the manager
    does) -> its manifest's bytes."""
    finish = root.removal(step)
    if finish is not None:
        finish()
    return _commit_at(roots, root.path(step))


def _commit_at(roots: Roots, location: str) -> bytes:
    (roots.commit or commit_by_store(roots.store_at))(location)
    return roots.store_at(location).read_manifest()


def _put(roots: Roots, location: str, name: str) -> None:
    """A file ``name`` at ``location`` (a data file without a manifest: an interrupted save; or
    anything else, a user's or another library's)."""
    store = roots.store_at(location)
    store.prepare()
    write_file(store, name, _pattern(BLOCK, f"{location}/{name}"))


def _start(roots: Roots, root: StepRoot, step: int) -> None:
    """An interrupted save as ``step``: a data file, no manifest."""
    _put(roots, root.path(step), data_name())


def _child(root: StepRoot, name: str) -> str:
    return f"{root.location}/{name}"


def _manifest(roots: Roots, location: str) -> bytes | None:
    store = roots.store_at(location)
    return store.read_manifest() if MANIFEST_NAME in store.sizes([MANIFEST_NAME]) else None


def _gone(roots: Roots, root: StepRoot, step: int) -> None:
    """Nothing is left of ``step``: no manifest, no file of a save."""
    store = roots.store_at(root.path(step))
    assert store.sizes([MANIFEST_NAME]) == {}, f"step {step}'s manifest is still there"
    assert store.names() == [], f"step {step}'s files are still there: {store.names()}"


def _nothing_left(root: StepRoot) -> None:
    """After a scan, no removal is due: every hidden step is gone."""
    root.scan()
    assert root.removal() is None, f"{root!r}: a removal is still due after it finished"


def _no_deletion_advice(message: str) -> None:
    for word in _ADVICE:
        assert word not in message.lower(), f"a message must never advise deleting: {message}"


@contextmanager
def _warnings() -> Iterator[list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def _warned_about(caught: list[warnings.WarningMessage], path: str) -> None:
    texts = [str(w.message) for w in caught]
    assert any(path in text for text in texts), f"no warning names {path}: {texts}"
    for text in texts:
        _no_deletion_advice(text)


# -- the checks ------------------------------------------------------------------------------

def check_empty_root(roots: Roots) -> None:
    """A never-used root lists nothing, has no committed step and no removal due; its
    nothing_here() names it and says there is nothing to restore."""
    root = roots.make("empty")
    assert isinstance(root.location, str) and root.location, "StepRoot.location: a non-empty str"
    assert root.scan() == EMPTY
    assert not root.is_committed(1)
    assert root.removal() is None and root.removal(1) is None
    message = root.nothing_here()
    assert message.startswith("no checkpoint to restore"), message
    assert root.location in message, message
    _no_deletion_advice(message)


def check_path_is_a_store_location(roots: Roots) -> None:
    """path(step) is distinct per step, under the root, and a location the matching Store
    serves: a checkpoint committed there is the step, as another handle sees it too."""
    root = roots.make("paths")
    paths = [root.path(step) for step in (0, 1, 10, 2**40)]
    assert len(set(paths)) == len(paths), paths
    for step, path in zip((0, 1, 10, 2**40), paths):
        assert path.startswith(root.location) and path.endswith(f"step-{step}"), path
    manifest = _commit(roots, root, 10)
    assert roots.store_at(root.path(10)).read_manifest() == manifest
    again = roots.make("paths")
    assert again.path(10) == root.path(10)
    assert again.is_committed(10) and again.scan() == {"committed": [10], "incomplete": []}


def check_scan_lists_steps_ascending(roots: Roots) -> None:
    """scan() lists committed and incomplete steps apart, each ascending by number (not as
    text); is_committed says which; a step that is not there is not committed."""
    root = roots.make("ascending")
    for step in (10, 2, 33):
        _commit(roots, root, step)
    for step in (100, 7):
        _start(roots, root, step)
    want = {"committed": [2, 10, 33], "incomplete": [7, 100]}
    assert root.scan() == want
    assert roots.make("ascending").scan() == want, "another handle lists the same"
    assert [s for s in (2, 7, 10, 33, 100, 5) if root.is_committed(s)] == [2, 10, 33]


def check_non_step_names_never_listed(roots: Roots) -> None:
    """Only ``step-N`` exactly (no leading zero, no suffix) is a step: committed checkpoints
    named otherwise, a plain file named step-N, the user's and another library's files are
    never listed, nor taken for a step by is_committed."""
    root = roots.make("names")
    for name in NOT_STEPS:
        _commit_at(roots, _child(root, name))
    for name in ("step-4", "notes.txt", ".metadata", "__0_0.distcp", "model.pt"):
        _put(roots, root.location, name)
    for name in ("config.json", "pytorch_model.bin"):
        _put(roots, _child(root, "checkpoint-500"), name)
    assert root.scan() == EMPTY, f"non-step names listed: {root.scan()}"
    assert not any(root.is_committed(s) for s in (0, 1, 3, 4, 5, 6, 500))
    _commit(roots, root, 8)
    assert root.scan() == {"committed": [8], "incomplete": []}


def check_hide_then_removal(roots: Roots) -> None:
    """hide() takes a committed step out of every handle's listing at once and it is no longer
    committed; the removal then deletes it, and only it: the other committed and incomplete
    steps stay whole; afterwards no removal is due."""
    root = roots.make("hide")
    manifests = {step: _commit(roots, root, step) for step in (1, 2, 3)}
    _start(roots, root, 7)
    assert root.hide(2) is True
    want = {"committed": [1, 3], "incomplete": [7]}
    assert root.scan() == want and not root.is_committed(2)
    assert roots.make("hide").scan() == want, "another handle still lists the hidden step"
    finish = root.removal()
    assert finish is not None, "no removal was due after a hide"
    finish()
    _gone(roots, root, 2)
    assert root.scan() == want
    for step in (1, 3):
        assert _manifest(roots, root.path(step)) == manifests[step], f"step {step} was touched"
    assert roots.store_at(root.path(7)).names(), "the removal touched an incomplete step"
    _nothing_left(roots.make("hide"))


def check_removal_of_one_step(roots: Roots) -> None:
    """removal(step) finishes only that step's pending removal (before a save into it): the
    other hidden step stays hidden and due; a checkpoint then saved as that step is listed and
    survives the later removal of the rest."""
    root = roots.make("one")
    for step in (1, 2, 3):
        _commit(roots, root, step)
    assert root.hide(1) and root.hide(2)
    again = _commit(roots, root, 1)  # runs root.removal(1) first
    assert root.scan() == {"committed": [1, 3], "incomplete": []}
    rest = root.removal()
    assert rest is not None, "removal(1) took step 2's removal with it"
    rest()
    assert root.scan() == {"committed": [1, 3], "incomplete": []}
    assert _manifest(roots, root.path(1)) == again, "the removal took the new step 1"
    _gone(roots, root, 2)
    _nothing_left(root)


def check_other_handle_finishes_removal(roots: Roots) -> None:
    """A step hidden by a handle whose removal never ran (a kill) stays out of the listing; the
    next handle (a restarted manager) finds it after a scan and finishes its removal; the
    first handle's removal, run late, harms nothing."""
    first = roots.make("restart")
    _commit(roots, first, 1)
    kept = _commit(roots, first, 2)
    assert first.hide(1)
    second = roots.make("restart")
    assert second.scan() == {"committed": [2], "incomplete": []}
    finish = second.removal()
    assert finish is not None, "a new handle did not find the hidden step to remove"
    finish()
    _gone(roots, second, 1)
    late = first.removal()
    if late is not None:
        late()
    assert second.scan() == {"committed": [2], "incomplete": []}
    assert _manifest(roots, second.path(2)) == kept
    _nothing_left(second)


def check_hide_missing_step(roots: Roots) -> None:
    """hide() of a step that is not there (never saved, or hidden already) returns False with a
    warning naming it, never raising, and makes nothing: no removal comes due, nothing is
    listed."""
    root = roots.make("missing")
    _commit(roots, root, 1)
    with _warnings() as caught:
        assert root.hide(5) is False
    _warned_about(caught, root.path(5))
    assert root.hide(1) is True
    with _warnings() as caught:
        assert root.hide(1) is False, "a step hidden already was hidden again"
    _warned_about(caught, root.path(1))
    finish = root.removal()
    if finish is not None:
        finish()
    assert root.scan() == EMPTY
    _nothing_left(roots.make("missing"))
    assert roots.store_at(root.path(5)).sizes([MANIFEST_NAME]) == {}


def check_nothing_here(roots: Roots) -> None:
    """nothing_here() says what a root holds instead of steps, naming the root and never
    advising deletion: nothing; a checkpoint that is the root itself (load it with
    ckptio.load); ckptio checkpoints not named step-N, a DCP checkpoint, torch.save files."""
    itself = roots.make("itself")
    _commit_at(roots, itself.location)
    assert itself.scan() == EMPTY
    message = itself.nothing_here()
    assert "ckptio.load(" in message and itself.location in message, message
    _no_deletion_advice(message)
    other = roots.make("other")
    _commit_at(roots, _child(other, "best"))
    for name in (".metadata", "model.pt"):
        _put(roots, other.location, name)
    assert other.scan() == EMPTY
    message = other.nothing_here()
    for said in (other.location, "best", "step-<N>", ".metadata", "model.pt"):
        assert said in message, f"{said!r} is not in: {message}"
    _no_deletion_advice(message)
    emptied = roots.make("emptied")
    _commit(roots, emptied, 1)
    assert emptied.hide(1)
    finish = emptied.removal()
    if finish is not None:
        finish()
    message = emptied.nothing_here()
    assert message.startswith("no checkpoint to restore") and "step-1" not in message, message
    _no_deletion_advice(message)


def check_hide_refused(roots: Roots, refuse: Refuser) -> None:
    """A hide that fails returns False with a warning naming the step, never raising; the step
    stays listed, committed and whole, no removal takes it; once the fault is gone it hides."""
    root = roots.make("hide-refused")
    manifest = _commit(roots, root, 1)
    _commit(roots, root, 2)
    with refuse(root, 1), _warnings() as caught:
        assert root.hide(1) is False
    _warned_about(caught, root.path(1))
    assert root.scan() == {"committed": [1, 2], "incomplete": []} and root.is_committed(1)
    finish = root.removal()
    if finish is not None:
        finish()
    assert _manifest(roots, root.path(1)) == manifest, "a refused hide lost the step"
    assert root.hide(1) is True


def check_removal_refused(roots: Roots, refuse: Refuser) -> None:
    """A removal that fails does not raise (its failures are logged) and the step stays out of
    the listing; the next handle finds it due again and finishes it; the other step stays."""
    root = roots.make("removal-refused")
    _commit(roots, root, 1)
    kept = _commit(roots, root, 2)
    assert root.hide(1)
    with refuse(root, 1):
        finish = root.removal()
        assert finish is not None, "no removal was due after a hide"
        finish()
    assert root.scan() == {"committed": [2], "incomplete": []}
    again = roots.make("removal-refused")
    assert again.scan() == {"committed": [2], "incomplete": []}
    finish = again.removal()
    assert finish is not None, "a failed removal was not found due again"
    finish()
    _gone(roots, again, 1)
    assert _manifest(roots, again.path(2)) == kept
    _nothing_left(again)


CHECKS: dict[str, Callable[[Roots], None]] = {
    "empty_root": check_empty_root,
    "path_is_a_store_location": check_path_is_a_store_location,
    "scan_lists_steps_ascending": check_scan_lists_steps_ascending,
    "non_step_names_never_listed": check_non_step_names_never_listed,
    "hide_then_removal": check_hide_then_removal,
    "removal_of_one_step": check_removal_of_one_step,
    "other_handle_finishes_removal": check_other_handle_finishes_removal,
    "hide_missing_step": check_hide_missing_step,
    "nothing_here": check_nothing_here,
}


def run_all(roots: Roots, refuse_hide: Refuser | None = None,
            refuse_removal: Refuser | None = None) -> None:
    """Every check (the fault ones only with their refusers)."""
    for check in CHECKS.values():
        check(roots)
    if refuse_hide is not None:
        check_hide_refused(roots, refuse_hide)
    if refuse_removal is not None:
        check_removal_refused(roots, refuse_removal)


# -- pytest ----------------------------------------------------------------------------------

class StepRootConformance:
    """Subclass as ``TestSomething(StepRootConformance)`` and provide ``roots``.

    Optionally ``refuse_hide`` and ``refuse_removal`` fixtures: ``refuse(root, step)``, a
    context manager in which hiding ``step`` (or removing it once hidden) fails; without them
    those checks are skipped::

        class TestMyRoot(StepRootConformance):
            @pytest.fixture
            def roots(self, tmp_path):
                return Roots(make=lambda key: MyRoot(tmp_path / key), store_at=MyStore)"""

    @pytest.fixture
    def roots(self) -> Roots:
        raise NotImplementedError("a conformance test class must define the roots fixture")

    @pytest.fixture
    def refuse_hide(self) -> Refuser | None:
        return None

    @pytest.fixture
    def refuse_removal(self) -> Refuser | None:
        return None

    def test_empty_root(self, roots: Roots) -> None:
        check_empty_root(roots)

    def test_path_is_a_store_location(self, roots: Roots) -> None:
        check_path_is_a_store_location(roots)

    def test_scan_lists_steps_ascending(self, roots: Roots) -> None:
        check_scan_lists_steps_ascending(roots)

    def test_non_step_names_never_listed(self, roots: Roots) -> None:
        check_non_step_names_never_listed(roots)

    def test_hide_then_removal(self, roots: Roots) -> None:
        check_hide_then_removal(roots)

    def test_removal_of_one_step(self, roots: Roots) -> None:
        check_removal_of_one_step(roots)

    def test_other_handle_finishes_removal(self, roots: Roots) -> None:
        check_other_handle_finishes_removal(roots)

    def test_hide_missing_step(self, roots: Roots) -> None:
        check_hide_missing_step(roots)

    def test_nothing_here(self, roots: Roots) -> None:
        check_nothing_here(roots)

    def test_hide_refused(self, roots: Roots, refuse_hide: Refuser | None) -> None:
        if refuse_hide is None:
            pytest.skip("no refuse_hide fixture: this root cannot be made to fail a hide")
        check_hide_refused(roots, refuse_hide)

    def test_removal_refused(self, roots: Roots, refuse_removal: Refuser | None) -> None:
        if refuse_removal is None:
            pytest.skip("no refuse_removal fixture: a removal here cannot fail")
        check_removal_refused(roots, refuse_removal)
