"""The delta policy and chain-aware retention of issue 28 (managing/delta.py, chains.py), on
manifests carrying the FORMAT4 contract's ``bases`` field (built here as the engine writes
them: a manifest with ``bases`` naming sibling steps, files giving each step's stored bytes).

Covers: DeltaPolicy's checks and defaults; the base choice (first save full, deltas against the
newest full step, a full step every ``full_every`` saves, a full step once the last delta
stored more than ``max_ratio`` of its base, a damaged base, keep_every steps full); the
retention closure (a kept delta's base is kept) and the deferral (a base dropped with its
deltas goes one pass later); unreadable and damaged manifests; bad manager options.
The same rules with real delta saves: tests/test_delta_manager.py.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest

import ckptio
from ckptio import CkptError, ManifestError, StorageIOError
from ckptio.format.manifest import bases_of
from ckptio.format.types import FileInfo, Manifest
from ckptio.managing.chains import Chains, Link, link_of
from ckptio.managing.delta import DeltaPolicy, choose_base
from ckptio.managing.retention import Retention


@dataclasses.dataclass(frozen=True)
class _V4(Manifest):
    """A manifest with the version-4 body field ``bases`` (the contract's spelling)."""

    bases: tuple[str, ...] = ()


def _manifest(stored: int, base: int | None = None) -> Manifest:
    return _V4(version=4 if base is not None else 3, save_id="x", checksum_algorithm="crc32c",
               world_size=1, files=(FileInfo("data-0", stored, 0),), tensors=(), objects=(),
               aliases=(), tree={"d": []}, meta={},
               bases=() if base is None else (f"step-{base}",))


def _chains(table: dict[int, object]) -> Chains:
    """Chains over ``table``: step -> manifest, or an exception its read raises."""
    def read(step: int) -> Link:
        value = table[step]
        if isinstance(value, Exception):
            raise value
        return link_of(value)  # type: ignore[arg-type]
    return Chains(read, "run")


def test_bases_of_reads_the_contract_field():
    assert bases_of(_manifest(10, base=7)) == ("step-7",)
    assert bases_of(_manifest(10)) == ()


def test_policy_defaults_and_checks():
    assert ckptio.DeltaPolicy() == DeltaPolicy(full_every=10, max_ratio=0.5)
    for bad in ({"full_every": 0}, {"full_every": True}, {"full_every": 2.0},
                {"max_ratio": 0}, {"max_ratio": 1.5}, {"max_ratio": True}, {"max_ratio": "x"}):
        with pytest.raises(CkptError, match=next(iter(bad))):
            DeltaPolicy(**bad)


@pytest.mark.parametrize("kwargs, match", [
    ({"delta": "yes"}, "ckptio.DeltaPolicy"), ({"delta": 3}, "DeltaPolicy"),
    ({"compression": 3}, "'auto', 'off'"), ({"compression": ""}, "codec"),
])
def test_bad_manager_options_are_refused(tmp_path, kwargs, match):
    with pytest.raises(CkptError, match=match):
        ckptio.CheckpointManager(tmp_path / "run", **kwargs)
    assert not (tmp_path / "run").exists()


def test_compression_with_a_given_checkpointer_is_refused(tmp_path):
    checkpointer = ckptio.Checkpointer()
    try:
        with pytest.raises(CkptError, match=r"Options\(compression=...\)"):
            ckptio.CheckpointManager(tmp_path / "run", checkpointer=checkpointer,
                                     compression="zstd")
    finally:
        checkpointer.close()


def test_first_save_is_full_then_deltas_against_the_newest_full_step():
    policy = DeltaPolicy(full_every=4, max_ratio=0.5)
    table: dict[int, object] = {}
    assert choose_base(policy, 1, [], _chains(table), (), ()) is None
    table = {1: _manifest(1000), 2: _manifest(100, 1), 3: _manifest(100, 1)}
    assert choose_base(policy, 4, [1, 2, 3], _chains(table), (), ()) == 1
    table[4] = _manifest(100, 1)  # 4 saves since step 1, it included: the 5th is full
    assert choose_base(policy, 5, [1, 2, 3, 4], _chains(table), (), ()) is None
    table[5] = _manifest(1000)  # a newer full step is the next base, the old chain aside
    assert choose_base(policy, 6, [1, 2, 3, 4, 5], _chains(table), (), ()) == 5
    assert choose_base(DeltaPolicy(full_every=1), 6, [1, 2, 3, 4, 5], _chains(table), (),
                       ()) is None


def test_a_delta_that_stopped_paying_makes_the_next_save_full():
    policy = DeltaPolicy(full_every=100, max_ratio=0.5)
    table: dict[int, object] = {10: _manifest(1000), 11: _manifest(200, 10),
                                12: _manifest(500, 10)}
    assert choose_base(policy, 13, [10, 11, 12], _chains(table), (), ()) == 10  # 500: not more
    table[12] = _manifest(501, 10)
    assert choose_base(policy, 13, [10, 11, 12], _chains(table), (), ()) is None


def test_a_damaged_base_or_a_long_kept_step_makes_a_full_save():
    table: dict[int, object] = {10: _manifest(1000), 11: _manifest(10, 10)}
    policy = DeltaPolicy()
    assert choose_base(policy, 12, [10, 11], _chains(table), {10}, ()) is None
    assert choose_base(policy, 20, [10, 11], _chains(table), (), (10,)) is None  # keep_every
    assert choose_base(policy, 21, [10, 11], _chains(table), (), (10,)) == 10
    table[10] = ManifestError("step-10/manifest.json: damaged")  # unreadable: not a base
    assert choose_base(policy, 12, [10, 11], _chains(table), (), ()) is None


def _kept(table, committed, keep_last):
    chains = _chains(table)
    keep = chains.closure(committed, Retention(keep_last=keep_last).kept(committed, {}))
    return keep, chains.doomed(committed, keep)


def test_retention_keeps_the_base_of_every_kept_delta():
    table = {10: _manifest(1000), 11: _manifest(10, 10), 12: _manifest(10, 10),
             20: _manifest(1000), 21: _manifest(10, 20)}
    keep, doomed = _kept(table, [10, 11, 12, 20, 21], keep_last=3)
    assert keep == {10, 12, 20, 21}  # 12 kept by keep_last: its base 10 with it
    assert doomed == [11]


def test_a_base_dropped_with_its_deltas_goes_one_pass_later():
    table = {10: _manifest(1000), 11: _manifest(10, 10), 12: _manifest(10, 10),
             20: _manifest(1000), 21: _manifest(10, 20)}
    keep, doomed = _kept(table, [10, 11, 12, 20, 21], keep_last=2)
    assert keep == {20, 21}
    assert doomed == [11, 12]  # 10 waits until the hiding of 11 and 12 is durable
    keep, doomed = _kept(table, [10, 20, 21], keep_last=2)
    assert doomed == [10]


def test_unreadable_and_damaged_manifests():
    table: dict[int, object] = {10: _manifest(1000), 11: _manifest(10, 10),
                                12: StorageIOError("s3://b/run/step-12: timed out"),
                                20: _manifest(1000)}
    with pytest.warns(UserWarning, match="keeps every step before 12"):
        keep, doomed = _kept(table, [10, 11, 12, 20], keep_last=2)
    assert keep == {10, 11, 12, 20} and doomed == []  # 12's base is not known: all kept
    table[12] = ManifestError("step-12/manifest.json: damaged")  # never loads: needs no base
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        keep, doomed = _kept(table, [10, 11, 12, 20], keep_last=2)
    assert keep == {12, 20} and doomed == [11]  # 10 waits for 11's hiding
