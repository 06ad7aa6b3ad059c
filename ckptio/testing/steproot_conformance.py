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

Owns: the list of checks and the pytest class. Does not own: the checks (steproot_checks.py),
their helpers and Roots (steproot_check_tools.py), the roots (ckptio/storage/: local/local_root.py,
memory_root.py, s3/root.py), the policy of which steps a manager keeps (ckptio/managing/).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from ckptio.testing.steproot_check_tools import Refuser, Roots, commit_by_ckptio, commit_by_store
from ckptio.testing.steproot_checks import (
    check_empty_root,
    check_hide_missing_step,
    check_hide_refused,
    check_hide_then_removal,
    check_non_step_names_never_listed,
    check_nothing_here,
    check_other_handle_finishes_removal,
    check_path_is_a_store_location,
    check_removal_of_one_step,
    check_removal_refused,
    check_scan_lists_steps_ascending,
    check_torch_checkpointing_steps_found,
)

__all__ = [
    "CHECKS", "Refuser", "Roots", "StepRootConformance", "check_empty_root",
    "check_hide_missing_step", "check_hide_refused", "check_hide_then_removal",
    "check_non_step_names_never_listed", "check_nothing_here",
    "check_other_handle_finishes_removal", "check_path_is_a_store_location",
    "check_removal_of_one_step", "check_removal_refused", "check_scan_lists_steps_ascending",
    "check_torch_checkpointing_steps_found", "commit_by_ckptio", "commit_by_store", "run_all",
]


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
    "torch_checkpointing_steps_found": check_torch_checkpointing_steps_found,
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

    def test_torch_checkpointing_steps_found(self, roots: Roots) -> None:
        check_torch_checkpointing_steps_found(roots)

    def test_hide_refused(self, roots: Roots, refuse_hide: Refuser | None) -> None:
        if refuse_hide is None:
            pytest.skip("no refuse_hide fixture: this root cannot be made to fail a hide")
        check_hide_refused(roots, refuse_hide)

    def test_removal_refused(self, roots: Roots, refuse_removal: Refuser | None) -> None:
        if refuse_removal is None:
            pytest.skip("no refuse_removal fixture: a removal here cannot fail")
        check_removal_refused(roots, refuse_removal)
