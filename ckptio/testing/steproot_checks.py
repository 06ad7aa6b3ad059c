"""The StepRoot checks: an empty root, step paths that are store locations, steps listed in
ascending order and only real step names, hiding then removing steps (one, or finished by
another handle), hiding a missing step, a location holding nothing of ckptio, the steps
holding a torch_checkpointing checkpoint found, and a refused hide or removal that warns,
names the path and is found due again.

Call order: each ``check_*(roots)`` runs one group of checks and raises AssertionError (or
the root's own error); steproot_conformance.py runs them all, or as pytest tests.

Owns: these checks. Does not own: their helpers (steproot_check_tools.py), the roots
(ckptio/storage/), the policy of which steps a manager keeps (ckptio/managing/).
"""

from __future__ import annotations

from ckptio.format.manifest import MANIFEST_NAME
from ckptio.storage.steproot import foreign_steps
from ckptio.testing.steproot_check_tools import (
    EMPTY,
    NOT_STEPS,
    Refuser,
    Roots,
    assert_gone,
    assert_no_deletion_advice,
    assert_nothing_left,
    assert_warned_about,
    child_path,
    commit_at,
    commit_step,
    manifest_at,
    put_file,
    recorded_warnings,
    start_step,
)

__all__ = [
    "check_empty_root",
    "check_hide_missing_step",
    "check_hide_refused",
    "check_hide_then_removal",
    "check_non_step_names_never_listed",
    "check_nothing_here",
    "check_other_handle_finishes_removal",
    "check_path_is_a_store_location",
    "check_removal_of_one_step",
    "check_removal_refused",
    "check_scan_lists_steps_ascending",
    "check_torch_checkpointing_steps_found",
]


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
    assert_no_deletion_advice(message)


def check_path_is_a_store_location(roots: Roots) -> None:
    """path(step) is distinct per step, under the root, and a location the matching Store
    serves: a checkpoint committed there is the step, as another handle sees it too."""
    root = roots.make("paths")
    paths = [root.path(step) for step in (0, 1, 10, 2**40)]
    assert len(set(paths)) == len(paths), paths
    for step, path in zip((0, 1, 10, 2**40), paths):
        assert path.startswith(root.location) and path.endswith(f"step-{step}"), path
    manifest = commit_step(roots, root, 10)
    assert roots.store_at(root.path(10)).read_manifest() == manifest
    again = roots.make("paths")
    assert again.path(10) == root.path(10)
    assert again.is_committed(10) and again.scan() == {"committed": [10], "incomplete": []}


def check_scan_lists_steps_ascending(roots: Roots) -> None:
    """scan() lists committed and incomplete steps apart, each ascending by number (not as
    text); is_committed says which; a step that is not there is not committed."""
    root = roots.make("ascending")
    for step in (10, 2, 33):
        commit_step(roots, root, step)
    for step in (100, 7):
        start_step(roots, root, step)
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
        commit_at(roots, child_path(root, name))
    for name in ("step-4", "notes.txt", ".metadata", "__0_0.distcp", "model.pt"):
        put_file(roots, root.location, name)
    for name in ("config.json", "pytorch_model.bin"):
        put_file(roots, child_path(root, "checkpoint-500"), name)
    assert root.scan() == EMPTY, f"non-step names listed: {root.scan()}"
    assert not any(root.is_committed(s) for s in (0, 1, 3, 4, 5, 6, 500))
    commit_step(roots, root, 8)
    assert root.scan() == {"committed": [8], "incomplete": []}


def check_hide_then_removal(roots: Roots) -> None:
    """hide() takes a committed step out of every handle's listing at once and it is no longer
    committed; the removal then deletes it, and only it: the other committed and incomplete
    steps stay whole; afterwards no removal is due."""
    root = roots.make("hide")
    manifests = {step: commit_step(roots, root, step) for step in (1, 2, 3)}
    start_step(roots, root, 7)
    assert root.hide(2) is True
    want = {"committed": [1, 3], "incomplete": [7]}
    assert root.scan() == want and not root.is_committed(2)
    assert roots.make("hide").scan() == want, "another handle still lists the hidden step"
    finish = root.removal()
    assert finish is not None, "no removal was due after a hide"
    finish()
    assert_gone(roots, root, 2)
    assert root.scan() == want
    for step in (1, 3):
        assert manifest_at(roots, root.path(step)) == manifests[step], f"step {step} was touched"
    assert roots.store_at(root.path(7)).names(), "the removal touched an incomplete step"
    assert_nothing_left(roots.make("hide"))


def check_removal_of_one_step(roots: Roots) -> None:
    """removal(step) finishes only that step's pending removal (before a save into it): the
    other hidden step stays hidden and due; a checkpoint then saved as that step is listed and
    survives the later removal of the rest."""
    root = roots.make("one")
    for step in (1, 2, 3):
        commit_step(roots, root, step)
    assert root.hide(1) and root.hide(2)
    again = commit_step(roots, root, 1)  # runs root.removal(1) first
    assert root.scan() == {"committed": [1, 3], "incomplete": []}
    rest = root.removal()
    assert rest is not None, "removal(1) took step 2's removal with it"
    rest()
    assert root.scan() == {"committed": [1, 3], "incomplete": []}
    assert manifest_at(roots, root.path(1)) == again, "the removal took the new step 1"
    assert_gone(roots, root, 2)
    assert_nothing_left(root)


def check_other_handle_finishes_removal(roots: Roots) -> None:
    """A step hidden by a handle whose removal never ran (a kill) stays out of the listing; the
    next handle (a restarted manager) finds it after a scan and finishes its removal; the
    first handle's removal, run late, harms nothing."""
    first = roots.make("restart")
    commit_step(roots, first, 1)
    kept = commit_step(roots, first, 2)
    assert first.hide(1)
    second = roots.make("restart")
    assert second.scan() == {"committed": [2], "incomplete": []}
    finish = second.removal()
    assert finish is not None, "a new handle did not find the hidden step to remove"
    finish()
    assert_gone(roots, second, 1)
    late = first.removal()
    if late is not None:
        late()
    assert second.scan() == {"committed": [2], "incomplete": []}
    assert manifest_at(roots, second.path(2)) == kept
    assert_nothing_left(second)


def check_hide_missing_step(roots: Roots) -> None:
    """hide() of a step that is not there (never saved, or hidden already) returns False with a
    warning naming it, never raising, and makes nothing: no removal comes due, nothing is
    listed."""
    root = roots.make("missing")
    commit_step(roots, root, 1)
    with recorded_warnings() as caught:
        assert root.hide(5) is False
    assert_warned_about(caught, root.path(5))
    assert root.hide(1) is True
    with recorded_warnings() as caught:
        assert root.hide(1) is False, "a step hidden already was hidden again"
    assert_warned_about(caught, root.path(1))
    finish = root.removal()
    if finish is not None:
        finish()
    assert root.scan() == EMPTY
    assert_nothing_left(roots.make("missing"))
    assert roots.store_at(root.path(5)).sizes([MANIFEST_NAME]) == {}


def check_nothing_here(roots: Roots) -> None:
    """nothing_here() says what a root holds instead of steps, naming the root and never
    advising deletion: nothing; a checkpoint that is the root itself (load it with
    ckptio.load); ckptio checkpoints not named step-N, a DCP checkpoint, torch.save files."""
    itself = roots.make("itself")
    commit_at(roots, itself.location)
    assert itself.scan() == EMPTY
    message = itself.nothing_here()
    assert "ckptio.load(" in message and itself.location in message, message
    assert_no_deletion_advice(message)
    other = roots.make("other")
    commit_at(roots, child_path(other, "best"))
    for name in (".metadata", "model.pt"):
        put_file(roots, other.location, name)
    assert other.scan() == EMPTY
    message = other.nothing_here()
    for said in (other.location, "best", "step-<N>", ".metadata", "model.pt"):
        assert said in message, f"{said!r} is not in: {message}"
    assert_no_deletion_advice(message)
    emptied = roots.make("emptied")
    commit_step(roots, emptied, 1)
    assert emptied.hide(1)
    finish = emptied.removal()
    if finish is not None:
        finish()
    message = emptied.nothing_here()
    assert message.startswith("no checkpoint to restore") and "step-1" not in message, message
    assert_no_deletion_advice(message)


def check_torch_checkpointing_steps_found(roots: Roots) -> None:
    """A step holding a torch_checkpointing checkpoint (an item's ``<item>_0.pt``, or its
    ``metadata.pkl``) is listed incomplete and found by steproot.foreign_steps, which a
    manager's restore and retention, ``ckptio ls`` and ``ckptio status`` ask (one place for
    every root: a root a user registers too); a ckptio save cut short, or another rank's file
    alone, is not one."""
    root = roots.make("torch-checkpointing")
    commit_step(roots, root, 1)
    for name in ("model_0.pt", "model_1.pt"):
        put_file(roots, root.path(3), name)
    put_file(roots, root.path(5), "metadata.pkl")
    start_step(roots, root, 7)
    put_file(roots, root.path(9), "model_1.pt")
    listing = root.scan()
    assert listing == {"committed": [1], "incomplete": [3, 5, 7, 9]}, listing
    found = foreign_steps(root, listing["incomplete"], roots.store_at)
    assert found == [3, 5], f"torch_checkpointing steps found: {found}, not [3, 5]"


def check_hide_refused(roots: Roots, refuse: Refuser) -> None:
    """A hide that fails returns False with a warning naming the step, never raising; the step
    stays listed, committed and whole, no removal takes it; once the fault is gone it hides."""
    root = roots.make("hide-refused")
    manifest = commit_step(roots, root, 1)
    commit_step(roots, root, 2)
    with refuse(root, 1), recorded_warnings() as caught:
        assert root.hide(1) is False
    assert_warned_about(caught, root.path(1))
    assert root.scan() == {"committed": [1, 2], "incomplete": []} and root.is_committed(1)
    finish = root.removal()
    if finish is not None:
        finish()
    assert manifest_at(roots, root.path(1)) == manifest, "a refused hide lost the step"
    assert root.hide(1) is True


def check_removal_refused(roots: Roots, refuse: Refuser) -> None:
    """A removal that fails does not raise (its failures are logged) and the step stays out of
    the listing; the next handle finds it due again and finishes it; the other step stays."""
    root = roots.make("removal-refused")
    commit_step(roots, root, 1)
    kept = commit_step(roots, root, 2)
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
    assert_gone(roots, again, 1)
    assert manifest_at(roots, again.path(2)) == kept
    assert_nothing_left(again)
