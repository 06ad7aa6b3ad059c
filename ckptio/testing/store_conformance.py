"""The conformance suite every Store passes (the contract is ckptio/storage/store_contract.py).

Two ways to use it, as io_conformance.py does for backends:

* pytest: subclass ``StoreConformance`` and give it a ``store_factory`` fixture returning a
  callable ``make(key)`` that builds a store at a fresh, unused location for ``key``; the same
  key twice gives two handles of one location (as two processes would have). Optionally a
  ``refuse_removal`` fixture: ``refuse(store, name)``, a context manager in which removing
  ``name`` fails (a read-only filesystem, a denied DELETE); without it that check is skipped.
* plain functions: each ``check_*(make)`` runs one group of checks and raises AssertionError
  (or the store's own error) on a failure; ``run_all`` runs them all.

Every check asserts a rule a broken store would fail: a store that lists foreign files, raises
on a missing file, shows a half-replaced manifest or lets two claims coexist fails here.

Owns: the list of checks and the pytest class (an example on it). Does not own: the checks
(store_checks_commit.py, store_checks_files.py, tree_conformance.py), their helpers
(store_check_tools.py: data files through the store's own backend), the stores.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from ckptio.storage.store_contract import TreeStore
from ckptio.testing import tree_conformance as tree
from ckptio.testing.store_check_tools import Factory, Refuser, data_name, read_file, write_file
from ckptio.testing.store_checks_commit import (
    check_commit_is_conditional,
    check_commit_replaces_atomically,
    check_commit_round_trip,
    check_exclusive_serialises,
    check_never_committed_is_not_found,
)
from ckptio.testing.store_checks_files import (
    check_files_by_name,
    check_names_only_ours,
    check_prepare,
    check_protocol,
    check_read_file,
    check_remove_never_raises,
    check_remove_returns_failures,
    check_sizes,
)

__all__ = [
    "CHECKS", "Factory", "Refuser", "StoreConformance", "check_files_by_name",
    "check_read_file", "data_name", "read_file", "write_file",
    "check_commit_is_conditional", "check_commit_replaces_atomically",
    "check_commit_round_trip", "check_exclusive_serialises", "check_names_only_ours",
    "check_never_committed_is_not_found", "check_prepare", "check_protocol",
    "check_remove_never_raises", "check_remove_returns_failures", "check_sizes", "run_all",
]


CHECKS: dict[str, Callable[[Factory], None]] = {
    "protocol": check_protocol,
    "prepare": check_prepare,
    "never_committed_is_not_found": check_never_committed_is_not_found,
    "commit_round_trip": check_commit_round_trip,
    "commit_replaces_atomically": check_commit_replaces_atomically,
    "commit_is_conditional": check_commit_is_conditional,
    "exclusive_serialises": check_exclusive_serialises,
    "names_only_ours": check_names_only_ours,
    "remove_never_raises": check_remove_never_raises,
    "sizes": check_sizes,
    "files_by_name": check_files_by_name,
    "read_file": check_read_file,
}


def run_all(make: Factory, refuse: Refuser | None = None) -> None:
    """Every check (the removal failure one only with ``refuse``; the TreeStore ones,
    tree_conformance.py, only for a TreeStore)."""
    for check in CHECKS.values():
        check(make)
    if isinstance(make("protocol"), TreeStore):
        for check in tree.TREE_CHECKS.values():
            check(make)
    if refuse is not None:
        check_remove_returns_failures(make, refuse)


# -- pytest ----------------------------------------------------------------------------------

class StoreConformance:
    """Subclass as ``TestSomething(StoreConformance)`` and provide ``store_factory``::

        class TestMyStore(StoreConformance):
            @pytest.fixture
            def store_factory(self, tmp_path):
                return lambda key: MyStore(tmp_path / key)
    """

    @pytest.fixture
    def store_factory(self) -> Factory:
        raise NotImplementedError("a conformance test class must define the store_factory fixture")

    @pytest.fixture
    def refuse_removal(self) -> Refuser | None:
        return None

    def test_protocol(self, store_factory: Factory) -> None:
        check_protocol(store_factory)

    def test_prepare(self, store_factory: Factory) -> None:
        check_prepare(store_factory)

    def test_never_committed_is_not_found(self, store_factory: Factory) -> None:
        check_never_committed_is_not_found(store_factory)

    def test_commit_round_trip(self, store_factory: Factory) -> None:
        check_commit_round_trip(store_factory)

    def test_commit_replaces_atomically(self, store_factory: Factory) -> None:
        check_commit_replaces_atomically(store_factory)

    def test_commit_is_conditional(self, store_factory: Factory) -> None:
        check_commit_is_conditional(store_factory)

    def test_exclusive_serialises(self, store_factory: Factory) -> None:
        check_exclusive_serialises(store_factory)

    def test_names_only_ours(self, store_factory: Factory) -> None:
        check_names_only_ours(store_factory)

    def test_remove_never_raises(self, store_factory: Factory) -> None:
        check_remove_never_raises(store_factory)

    def test_remove_returns_failures(self, store_factory: Factory,
                                     refuse_removal: Refuser | None) -> None:
        if refuse_removal is None:
            pytest.skip("no refuse_removal fixture: this store cannot be made to fail a removal")
        check_remove_returns_failures(store_factory, refuse_removal)

    def test_sizes(self, store_factory: Factory) -> None:
        check_sizes(store_factory)

    def test_read_file(self, store_factory: Factory) -> None:
        check_read_file(store_factory)

    def test_files_by_name(self, store_factory: Factory) -> None:
        check_files_by_name(store_factory)

    def test_tree_write_file(self, store_factory: Factory) -> None:
        tree.check_tree_write_file(store_factory)

    def test_tree_read_into(self, store_factory: Factory) -> None:
        tree.check_tree_read_into(store_factory)

    def test_tree_child_and_entries(self, store_factory: Factory) -> None:
        tree.check_tree_child_and_entries(store_factory)

    def test_tree_remove_tree(self, store_factory: Factory) -> None:
        tree.check_tree_remove_tree(store_factory)

    def test_tree_move_to(self, store_factory: Factory) -> None:
        tree.check_tree_move_to(store_factory)
