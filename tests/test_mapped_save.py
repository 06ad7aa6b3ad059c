"""Mapped saves into tmpfs (issue 45, "one copy into the memory tier"): storage/local/mapped.py,
saving/mapped_regions.py, the mapped mode of saving/persist.py, the slots of local_root.py.

Covers, with real files under /dev/shm (``shm://`` with $CKPTIO_SHM_DIR) and real managers: a
memory tier's async saves round-trip bit for bit and verify, the first ones through the pool
and, once a dropped step's slot of the same size is mapped ahead, with data files never
written through the I/O backend (the capture copied into their pages); a plain save into
tmpfs with no slots, a disk directory and
Options(memory_mapped="off") keep the backend's writes; a manager's memory tier makes the next
step's data file from a dropped step's (the same inode: a ring of keep_last + 1), sync and
async, and once the ring is warm no file is mapped afresh; a smaller, then larger, differently
laid out state saved into a reused slot loads bit for bit with every byte outside its entries
zero (no stale bytes); a training process killed (SIGKILL) at random moments of an every-step
save loop, again and again (each new process taking the slots the killed one left), leaves at
least keep_last committed steps that verify, load bit for bit and hold no stale bytes; the
slots go with the manager's close().
"""

from __future__ import annotations

import os
import random
import signal
import time
from typing import Any

import pytest
import torch

import ckptio
from ckptio import CkptError, Tier
from ckptio.format import manifest as manifest_format
from ckptio.format.manifest import MANIFEST_NAME
from ckptio.storage.local.local_store import LocalStore
from ckptio.storage.local.local_root import LocalRoot
from ckptio.storage.local.mapped import on_tmpfs
from ckptio.storage.files import mappings_of
from ckptio.storage.local.slots import SLOTS_DIR, warm_fit
from ckptio.storage.select import checkpoint_path
from ckptio.testing.cli_process import start_script
from tests.conftest import assert_same
from tests.write_counting import WriteCounting

MiB = 1 << 20
OPTS = ckptio.Options(buffer_bytes=MiB, pool_bytes=4 * MiB)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def state_of(step: int, scale: int = 1) -> dict[str, Any]:
    """A deterministic state of ``step``: large and small tensors of several dtypes, odd sizes
    (padding between entries), a view with a storage offset and a strided one; its layout
    changes with ``step`` % 2 (files of another size, in a ring of 3)."""
    g = torch.Generator().manual_seed(1000 + step)
    big = torch.randn(scale * (300_000 + 7_777 * (step % 2)), generator=g)
    base = torch.randn(64, 33, generator=g)
    return {
        "big": big,
        "small": torch.randn(37, generator=g),
        "ints": torch.randint(-2**40, 2**40, (1001,), generator=g, dtype=torch.int64),
        "half": torch.randn(513, generator=g).to(torch.bfloat16),
        "flags": torch.rand(77, generator=g) > 0.5,
        "offset_view": base[3:9],
        "strided": base.t(),
        "step": step,
    }


def _data_files(path: str) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.startswith("data-"))


def _inodes(path: str) -> set[int]:
    return {os.stat(os.path.join(path, n)).st_ino for n in _data_files(path)}


def _assert_no_stale_bytes(path: str) -> None:
    """Every byte of every data file outside the manifest's entries is zero (padding)."""
    with open(os.path.join(path, MANIFEST_NAME), "rb") as f:
        manifest = manifest_format.decode(f.read(), path)
    covered: dict[str, list[tuple[int, int]]] = {}
    for entry in manifest.tensors:
        covered.setdefault(entry.file, []).append((entry.offset, entry.offset + entry.nbytes))
    for name in _data_files(path):
        data = bytearray(open(os.path.join(path, name), "rb").read())
        for start, end in covered.get(name, []):
            data[start:end] = bytes(end - start)
        assert not any(data), f"{path}/{name}: bytes outside the entries are not zero"


def _save_counting(tmp_or_shm: str, options: ckptio.Options) -> tuple[WriteCounting, str]:
    """An async save of state_of(1) into ``tmp_or_shm`` through a counting backend; checked
    back bit for bit and verified -> (the backend, the path)."""
    ck = ckptio.Checkpointer(options)
    try:
        os.makedirs(tmp_or_shm, exist_ok=True)
        counting = ck.resources().wrap_backend(LocalStore(tmp_or_shm), WriteCounting)
        path = os.path.join(tmp_or_shm, "ckpt")
        ck.async_save(state_of(1), path).wait()
        ckptio.verify(path)
        assert_same(ckptio.load(path), state_of(1))
        _assert_no_stale_bytes(path)
        return counting, path  # type: ignore[return-value]
    finally:
        ck.close()


# ------------------------------------------------------------------ the mode


def test_mapped_async_save_round_trips_with_no_write(shm):
    """A memory tier's ring: the saves before a step is dropped go through the pool (nothing
    is mapped ahead for them); from keep_last + 1 on, each copies into a slot's pages and
    writes no data through the backend, and round-trips bit for bit."""
    keep_last = 1
    ck = ckptio.Checkpointer(OPTS)
    root = checkpoint_path("shm://one")
    os.makedirs(root, exist_ok=True)
    counting = ck.resources().wrap_backend(LocalStore(root), WriteCounting)
    with ckptio.CheckpointManager(tiers=[Tier("shm://one", keep_last=keep_last)],
                                  checkpointer=ck) as mgr:
        for step in range(keep_last + 4):
            before = len(counting.written)
            handle = mgr.save(step, state_of(step), asynchronous=True)
            assert handle is not None
            handle.wait()
            wrote = [n for n in counting.written[before:] if n.startswith("data-")]
            path = mgr.path(step)
            if step <= keep_last:
                assert wrote, f"step {step}: no slot yet, yet no write through the pool"
            else:
                assert _data_files(path) and not wrote, (
                    f"step {step}: a save into a warm ring wrote its data through the backend: "
                    f"{wrote}")
            ckptio.verify(path)
            assert_same(ckptio.load(path), state_of(step))
            _assert_no_stale_bytes(path)
    ck.close()


def _slots_warm(ck: ckptio.Checkpointer, mgr: ckptio.CheckpointManager, sizes: list[int],
                sets: int) -> bool:
    """Whether ``sets`` slots of each of ``sizes`` beside the memory tier's steps are mapped
    here and idle (the background thread of prepare() has made them)."""
    mappings = mappings_of(ck.resources().served(LocalStore(mgr.path(0))))
    assert mappings is not None, "the memory tier's step store carries no mappings"
    return warm_fit(mgr.path(0), sorted(sizes * sets), mappings)


@pytest.mark.parametrize("via", ["prepare", "restore"])
def test_prepare_makes_the_first_saves_mapped(shm, via):
    """A manager that knows its state (prepare(), or a restore that found nothing) makes its
    memory tier's slots for the first saves in the background: every save from the first
    copies into mapped pages and writes no data through the backend; bit for bit, no stale
    byte; close() removes the slots no save took."""
    ck = ckptio.Checkpointer(OPTS)
    root = checkpoint_path("shm://ahead")
    os.makedirs(root, exist_ok=True)
    counting = ck.resources().wrap_backend(LocalStore(root), WriteCounting)
    mgr = ckptio.CheckpointManager(tiers=[Tier("shm://ahead", keep_last=2)], checkpointer=ck)
    with mgr:
        if via == "prepare":
            mgr.prepare(state_of(0), wait=True)
            assert _slots_warm(ck, mgr, ck.prepare(None, state=state_of(0))[0], 3)
        else:
            assert mgr.restore(state_of(0)) is None
        sizes, _cuda = ck.prepare(None, state=state_of(0))
        deadline = time.monotonic() + 30
        while not _slots_warm(ck, mgr, sizes, 3):
            assert time.monotonic() < deadline, f"no slots mapped ahead: {os.listdir(root)}"
            time.sleep(0.05)
        for step in range(5):
            handle = mgr.save(step, state_of(2 * step), asynchronous=True)
            assert handle is not None
            handle.wait()
            wrote = [n for n in counting.written if n.startswith("data-")]
            assert not wrote, f"step {step} wrote its data through the backend: {wrote}"
            ckptio.verify(mgr.path(step))
            assert_same(ckptio.load(mgr.path(step)), state_of(2 * step))
            _assert_no_stale_bytes(mgr.path(step))
    assert not os.path.exists(os.path.join(root, SLOTS_DIR)) or not os.listdir(
        os.path.join(root, SLOTS_DIR))
    ck.close()


def test_a_plain_save_into_tmpfs_maps_nothing_in_its_call(shm):
    """No slots (a Checkpointer's own directory): the capture copies into the staging pool and
    the backend writes, as on a disk, rather than allocating fresh pages inside the call."""
    counting, path = _save_counting(checkpoint_path("shm://plain"), OPTS)
    assert set(_data_files(path)) <= set(counting.written) and _data_files(path)


def test_memory_mapped_off_writes_through_the_backend(shm):
    counting, path = _save_counting(checkpoint_path("shm://off"),
                                    ckptio.Options(buffer_bytes=MiB, pool_bytes=4 * MiB,
                                                   memory_mapped="off"))
    assert set(_data_files(path)) <= set(counting.written) and _data_files(path)


def test_a_disk_directory_is_never_mapped(tmp_path):
    if on_tmpfs(str(tmp_path)):
        pytest.skip(f"{tmp_path} is on tmpfs here: no disk directory to try")
    counting, path = _save_counting(str(tmp_path / "disk"), OPTS)
    assert set(_data_files(path)) <= set(counting.written) and _data_files(path)


def test_memory_mapped_is_validated():
    with pytest.raises(CkptError, match="memory_mapped"):
        ckptio.Options(memory_mapped="on")


# ------------------------------------------------------------------ slots


@pytest.mark.parametrize("asynchronous", [True, False])
def test_a_dropped_steps_data_file_is_the_next_steps(shm, asynchronous):
    keep_last = 2
    removed: set[int] = set()
    with ckptio.CheckpointManager(tiers=[Tier("shm://ring", keep_last=keep_last)],
                                  options=OPTS) as mgr:
        inodes: dict[int, set[int]] = {}
        for step in range(keep_last + 3):  # one layout: every slot fits the next step
            handle = mgr.save(step, state_of(2 * step), asynchronous=asynchronous)
            if asynchronous:
                assert handle is not None
                handle.wait()
            inodes[step] = _inodes(mgr.path(step))
            if step > keep_last:  # its retention dropped step - keep_last - 1 before it began
                removed |= inodes[step - keep_last - 1]
                assert inodes[step] and inodes[step] <= removed, (
                    f"step {step}'s data files {inodes[step]} are not those of a dropped step "
                    f"{removed}: the pages were allocated afresh")
        mgr.wait()
        for step in mgr.steps():
            ckptio.verify(mgr.path(step))
            assert_same(ckptio.load(mgr.path(step)), state_of(2 * step))
            _assert_no_stale_bytes(mgr.path(step))
        root = checkpoint_path("shm://ring")
        assert len(os.listdir(os.path.join(root, SLOTS_DIR))) <= 1, "more than a step kept"
    assert not os.path.exists(os.path.join(root, SLOTS_DIR)), "slots left after close()"


def _mappings_under(root: str) -> set[tuple[str, str]]:
    """(address range, inode) of this process's mappings of files under ``root``."""
    with open("/proc/self/maps") as f:
        return {(line.split()[0], line.split()[4]) for line in f if root in line}


def test_the_warm_ring_maps_nothing_new(shm):
    """Once every slot has gone round, a save maps no file afresh: the mappings kept are the
    same address ranges of the same inodes, step after step."""
    root = checkpoint_path("shm://warm")
    with ckptio.CheckpointManager(tiers=[Tier("shm://warm", keep_last=2)], options=OPTS) as mgr:
        seen = []
        for step in range(12):
            handle = mgr.save(step, state_of(2 * step), asynchronous=True)  # one layout
            assert handle is not None
            handle.wait()
            if step >= 6:
                seen.append(_mappings_under(root))
        assert seen[0] and all(s == seen[0] for s in seen), seen


def _renamed(state: dict[str, Any], key: str, new: str) -> dict[str, Any]:
    """``state`` with ``key`` renamed: the same data file size, another layout."""
    return {(new if k == key else k): v for k, v in state.items()}


def test_a_reused_slot_holds_no_stale_bytes(shm):
    """States of one file size and four layouts (entries moved by their keys' order) go round
    the slots, each copied into a dropped step's pages; then states of other sizes (the pool's
    way, no slot fits) and back."""
    same = [state_of(0, scale=4), _renamed(state_of(2, scale=4), "big", "zz_big"),
            _renamed(state_of(4, scale=4), "ints", "aa_ints"),
            _renamed(state_of(6, scale=4), "half", "zz_half")]
    other = [state_of(5, scale=1),
             {"other": torch.full((1234,), -1.0), "x": torch.arange(999, dtype=torch.int16)},
             state_of(7, scale=6)]
    with ckptio.CheckpointManager(tiers=[Tier("shm://stale", keep_last=1)],
                                  options=OPTS) as mgr:
        seen: set[int] = set()
        for step, state in enumerate(same + other + same):
            mgr.save(step, state)
            inodes = _inodes(mgr.path(step))
            if 2 <= step < len(same):  # a dropped step of the same size: its pages reused
                assert inodes <= seen, f"step {step} did not reuse a dropped step's file"
            seen |= inodes
            ckptio.verify(mgr.path(step))
            assert_same(ckptio.load(mgr.path(step)), state)
            _assert_no_stale_bytes(mgr.path(step))


def _slot_inodes(root: str) -> set[int]:
    slots = os.path.join(root, SLOTS_DIR)
    return {os.stat(os.path.join(slots, n)).st_ino for n in os.listdir(slots)}


def test_two_steps_dropped_at_once_both_become_slots(shm):
    """A drain pins a step, so that no step drops in one pass and two in a later one: both
    steps' data files are kept (so the ring has a slot for the next pin too; one step's were
    kept before, and the next pin found none: a save through the pool into fresh pages), and
    never more than SLOT_STEPS steps' worth."""
    root = LocalRoot(os.path.join(shm, "pinned"), slots=True)
    files: dict[int, int] = {}
    for step in range(1, 7):
        os.makedirs(root.path(step))
        path = os.path.join(root.path(step), "data-00000.bin")
        with open(path, "wb") as f:
            f.write(bytes([step]) * MiB)
        files[step] = os.stat(path).st_ino

    def drop(*steps: int) -> None:
        for step in steps:
            assert root.hide(step)
        removal = root.removal()
        assert removal is not None
        removal()

    drop(1, 2)  # the pinned step 1 released together with step 2
    assert _slot_inodes(root.location) == {files[1], files[2]}
    drop(3)
    assert _slot_inodes(root.location) == {files[2], files[3]}  # the oldest went
    drop(4, 5, 6)
    assert _slot_inodes(root.location) == {files[5], files[6]}
    assert not any(os.path.exists(root.path(s)) for s in files)


def test_a_draining_memory_tier_takes_no_fresh_pages_after_its_first_drain(shm, tmp_path):
    """Every step into memory, every 6th drained to disk at a bounded rate (the drain pins its
    step for a few saves): once a pinned step and another dropped together, the ring holds a
    slot for every later pin, so past the first steps at most one step's data file is fresh
    (the pin that grew the ring). Before, every pin left the ring a slot short: a fresh file
    each time, written through the pool, then mapped (on a GPU page-locked) in a later call."""
    state = {"w": torch.zeros(2_000_000)}  # 8 MB: 0.2 s to drain at the rate below
    seen: set[int] = set()
    fresh = []
    with ckptio.CheckpointManager(tiers=[Tier("shm://drained", keep_last=2),
                                         Tier(str(tmp_path / "disk"), every=6)],
                                  options=OPTS, drain_rate=40e6) as mgr:
        for step in range(36):
            state["w"].fill_(step)
            handle = mgr.save(step, state, asynchronous=True)
            assert handle is not None
            handle.wait()
            inodes = _inodes(mgr.path(step))
            if not inodes <= seen:
                fresh.append(step)
            seen |= inodes
            time.sleep(0.05)  # the step's work
        assert mgr.drained(timeout=30)
    assert len([s for s in fresh if s > 3]) <= 1, f"fresh data files at steps {fresh}"


# ------------------------------------------------------------------ killed


KILLED_CHILD = r"""
import ckptio
from ckptio import Tier
from tests.test_mapped_save import OPTS, state_of

with ckptio.CheckpointManager(tiers=[Tier("shm://killed", keep_last=2)], options=OPTS) as mgr:
    latest = mgr.latest()
    start = 0 if latest is None else latest + 1
    for step in range(start, start + 100000):
        mgr.save(step, state_of(2 * step, scale=4), asynchronous=True)
        print(step, flush=True)
"""


def _check_killed_root(keep_last: int) -> list[int]:
    """The committed steps the killed job left (listed as a manager would, without one: its
    close() would remove the slots the next child takes) are whole."""
    root = LocalRoot(checkpoint_path("shm://killed"))
    steps = root.scan()["committed"]
    assert len(steps) >= keep_last, f"only {steps} committed after a kill"
    for step in steps:
        ckptio.verify(root.path(step))
        assert_same(ckptio.load(root.path(step)), state_of(2 * step, scale=4))
        _assert_no_stale_bytes(root.path(step))
    return steps


def test_killed_at_random_moments_keeps_keep_last_whole_steps(shm, tmp_path):
    seed = random.randrange(1 << 30)
    rnd = random.Random(seed)
    script = tmp_path / "child.py"
    script.write_text(KILLED_CHILD)
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    reused = False
    owner: dict[int, int] = {}  # inode of a committed step's data file -> the step seen first
    for kill in range(8):
        # a fresh process forked from the warm forkserver (torch and ckptio imported there)
        proc, out_r, err_r = start_script(str(script), env=env)
        with os.fdopen(out_r) as out, os.fdopen(err_r) as err:
            for _ in range(4):  # a few steps in: slots in use, a ring going round
                line = out.readline()
                if not line:
                    proc.join(60)
                    pytest.fail(f"the child ended early: {err.read()[-2000:]}")
            time.sleep(rnd.uniform(0.0, 0.4))
            proc.kill()  # SIGKILL
            proc.join(60)
        assert proc.exitcode == -signal.SIGKILL
        slots = os.path.join(checkpoint_path("shm://killed"), SLOTS_DIR)
        reused |= os.path.isdir(slots) and bool(os.listdir(slots))
        steps = _check_killed_root(keep_last=2)
        assert steps, f"seed {seed}, kill {kill}"
        for step in steps:  # a data file seen under another step before: a slot was taken
            for inode in _data_inodes(step):
                reused |= owner.setdefault(inode, step) != step
    assert reused, "no slot was ever kept or taken: the ring was not exercised"


def _data_inodes(step: int) -> set[int]:
    path = LocalRoot(checkpoint_path("shm://killed")).path(step)
    return {os.stat(os.path.join(path, name)).st_ino for name in os.listdir(path)
            if name.startswith("data-")}
