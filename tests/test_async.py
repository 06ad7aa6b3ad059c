"""Asynchronous and lazy saves: what is captured, when the caller may go on, errors, memory.

The central invariant, in both modes: a value changed after the point where ckptio hands the
state back (async_save returning in eager mode; the optimizer's step in lazy mode) never reaches
the checkpoint. The saves are held open (a backend whose writes or fsyncs wait for the test to
let them go, a pool smaller than the state) so that the save is still running when the state
changes, however fast or loaded the machine: no delay races the test.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator

import pytest
import torch

import ckptio
from ckptio.storage.local.local_store import LocalStore
from ckptio import Checkpointer, CkptError, Options, StorageIOError
from ckptio.testing.faults import inject

MiB = 1 << 20
SMALL_POOL = Options(buffer_bytes=MiB, pool_bytes=2 * MiB, io_depth=2)


class _Gate:
    """Holds every write (``hold="write"``) or every fsync (``hold="fsync"``: the files' closing
    once all their bytes are written) of a Checkpointer's saves until ``open()``: the save
    stays in flight for as long as the test needs."""

    LIMIT_S = 120  # a gate nobody opens lets go after this (the test has failed by then)

    def __init__(self, ck: Checkpointer, hold: str) -> None:
        self.opened = threading.Event()
        backend = inject(ck)  # a pass-through wrapper: its methods are held here
        method = {"write": "submit_write", "fsync": "close"}[hold]
        passing = getattr(backend, method)

        def held(*args: object, **kwargs: object) -> object:
            if hold == "write" or kwargs.get("sync"):
                self.opened.wait(self.LIMIT_S)
            return passing(*args, **kwargs)

        setattr(backend, method, held)

    def open(self, *_hook_args: object) -> None:
        """Let everything through from now on (also an optimizer step pre-hook)."""
        self.opened.set()


@pytest.fixture
def gate() -> Iterator[Callable[[Checkpointer, str], _Gate]]:
    """_Gate(ck, hold) for a test; every gate is opened at teardown, so a failed test leaves no
    save waiting."""
    made: list[_Gate] = []

    def make(ck: Checkpointer, hold: str) -> _Gate:
        made.append(_Gate(ck, hold))
        return made[-1]

    yield make
    for each in made:
        each.open()


def _state(nbytes: int = 8 * MiB, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = nbytes // 4 // 4
    return {f"t{i}": torch.randn(n, generator=g) for i in range(4)} | {"small": torch.arange(7.0)}


def _clone(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.items()}


def _assert_bitwise(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert loaded.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(loaded[key].view(torch.uint8), value.view(torch.uint8)), key


def test_eager_mutation_after_return_never_leaks(tmp_path: os.PathLike[str], gate) -> None:
    """The state (8 MiB) is 4x the pool: async_save returns once the last byte is copied, while
    the save is held before its fsync; the state is then overwritten in place."""
    ck = Checkpointer(SMALL_POOL)
    state = _state()
    expected = _clone(state)
    fsync = gate(ck, "fsync")
    handle = ck.async_save(state, tmp_path / "ck")
    assert handle.staged()
    assert not handle.done(), "the save must still be in flight while the state changes"
    for value in state.values():
        value.add_(1.0)
    fsync.open()
    result = handle.wait()
    assert result.nbytes == sum(v.numel() * 4 for v in expected.values())
    assert 0 <= result.blocked_s <= result.seconds and result.persist_s > 0
    _assert_bitwise(ckptio.load(tmp_path / "ck"), expected)
    progress = handle.progress()
    assert progress.nbytes_staged == progress.nbytes_written == progress.nbytes_total
    ck.close()


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.nn.Linear]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.BatchNorm1d(512),
                                torch.nn.Linear(512, 256))
    frozen = torch.nn.Linear(256, 256)  # parameters outside any optimizer
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _train_step(model, opt)  # AdamW state exists
    return model, opt, frozen


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(32, 256)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def _full_state(model: torch.nn.Module, opt: torch.optim.Optimizer, frozen: torch.nn.Module) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict(), "frozen": frozen.state_dict()}


def _flat_tensors(tree: object, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    if isinstance(tree, dict):
        out: dict[str, torch.Tensor] = {}
        for key, value in tree.items():
            out |= _flat_tensors(value, f"{prefix}.{key}")
        return out
    if isinstance(tree, (list, tuple)):
        out = {}
        for i, value in enumerate(tree):
            out |= _flat_tensors(value, f"{prefix}.{i}")
        return out
    return {}


def test_lazy_step_waits_for_capture_and_nothing_leaks(tmp_path: os.PathLike[str], gate) -> None:
    """Lazy: returns before the optimizer-owned tensors are copied (3 MiB of them against a
    2 MiB pool, with every write held: the capture cannot finish); a forward/backward runs
    meanwhile (BatchNorm running stats change in forward: they are not optimizer-owned, so they
    were copied before return); the writes are let go only as the step begins, so the step
    must wait for the capture; frozen parameters changed right after return and everything the
    step changed stay out of the checkpoint."""
    model, opt, frozen = _model_and_optimizer()
    ck = Checkpointer(SMALL_POOL)
    expected = _flat_tensors({k: v for k, v in _full_state(model, opt, frozen).items()})
    expected = {k: v.clone() for k, v in expected.items()}
    writes = gate(ck, "write")
    opt.register_step_pre_hook(writes.open)  # before the save's own hook: runs first
    handle = ck.async_save(_full_state(model, opt, frozen), tmp_path / "ck", lazy=True, optimizers=[opt])
    assert not handle.staged(), "lazy capture finished before return: the test proves nothing"
    with torch.no_grad():
        frozen.weight.add_(1.0)
    _train_step(model, opt)  # forward changes BatchNorm stats; step() waits, then changes params
    assert handle.staged()
    result = handle.wait()
    assert result.blocked_s > 0  # the step waited for the capture
    loaded = _flat_tensors(ckptio.load(tmp_path / "ck"))
    assert loaded.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(loaded[key], value), key
    after = _flat_tensors(_full_state(model, opt, frozen))
    assert not torch.equal(after[".model.0.weight"], expected[".model.0.weight"])  # the step ran
    ck.close()


def test_lazy_with_two_optimizers(tmp_path: os.PathLike[str], gate) -> None:
    torch.manual_seed(1)
    a, b = torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=1.0), torch.optim.Adam(b.parameters(), lr=1.0)
    state = {"a": a.state_dict(), "b": b.state_dict()}
    expected = {k: v.clone() for k, v in _flat_tensors(state).items()}
    ck = Checkpointer(SMALL_POOL)
    writes = gate(ck, "write")  # 8 MiB against a 2 MiB pool: the capture waits for them
    opt_b.register_step_pre_hook(writes.open)  # let go as the first step begins
    handle = ck.async_save(state, tmp_path / "ck", lazy=True, optimizers=[opt_a, opt_b])
    assert not handle.staged()
    for model, opt in ((b, opt_b), (a, opt_a)):  # the second optimizer steps first
        model(torch.randn(4, 1024)).sum().backward()
        opt.step()
    handle.wait()
    loaded = _flat_tensors(ckptio.load(tmp_path / "ck"))
    for key, value in expected.items():
        assert torch.equal(loaded[key], value), key
    ck.close()


def test_lazy_after_step_defers_mixed_precision_weights(tmp_path: os.PathLike[str], gate) -> None:
    """Mixed precision: bf16 weights are copied from fp32 masters after the step. With
    after_step=[model] they are captured in the background too: the call returns while every
    write is held (4 MiB of bf16 weights could not pass a 2 MiB pool before it returns: without
    after_step it waits for the gate's 120 s), and the checkpoint holds the pre-step values."""
    torch.manual_seed(2)
    model = torch.nn.Linear(1024, 2048, bias=False).to(torch.bfloat16)
    master = model.weight.detach().float().clone().requires_grad_()
    opt = torch.optim.SGD([master], lr=0.5)
    state = {"model": model.state_dict(), "master": master, "optim": opt.state_dict()}
    expected = {"w": model.weight.detach().clone(), "m": master.detach().clone()}
    ck = Checkpointer(SMALL_POOL)
    writes = gate(ck, "write")
    opt.register_step_pre_hook(writes.open)
    t0 = time.perf_counter()
    handle = ck.async_save(state, tmp_path / "ck", lazy=True, optimizers=[opt], after_step=[model])
    assert time.perf_counter() - t0 < 30, "the bf16 weights were copied before the call returned"
    assert not handle.staged()
    model(torch.randn(4, 1024, dtype=torch.bfloat16)).float().sum().backward()
    master.grad = model.weight.grad.float()
    opt.step()  # waits for the capture
    with torch.no_grad():
        model.weight.copy_(master)
    assert handle.wait().blocked_s > 0
    loaded = ckptio.load(tmp_path / "ck")
    assert torch.equal(loaded["model"]["weight"], expected["w"])
    assert torch.equal(loaded["master"], expected["m"])
    assert not torch.equal(model.weight, expected["w"])  # the step and the copy-back ran
    ck.close()


def test_after_step_is_for_lazy_saves_of_modules_or_tensors(tmp_path: os.PathLike[str]) -> None:
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = Checkpointer(SMALL_POOL)
    with pytest.raises(CkptError, match="pass lazy=True"):
        ck.async_save({"m": model.state_dict()}, tmp_path / "a", after_step=[model])
    with pytest.raises(CkptError, match="item 0 is a str"):
        ck.async_save({"m": model.state_dict()}, tmp_path / "b", lazy=True, optimizers=[opt],
                      after_step=["model"])  # type: ignore[list-item]
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    ck.close()


def test_lazy_needs_optimizers(tmp_path: os.PathLike[str]) -> None:
    with pytest.raises(CkptError, match="needs optimizers"):
        Checkpointer(SMALL_POOL).async_save(_state(MiB), tmp_path / "ck", lazy=True)


def test_background_failure_raises_on_wait_and_commits_nothing(tmp_path: os.PathLike[str]) -> None:
    ck = Checkpointer(SMALL_POOL)
    first = _state(seed=1)
    ck.save(first, tmp_path / "ck")
    faulty = inject(ck, fail_write=3)
    handle = ck.async_save(_state(seed=2), tmp_path / "ck")
    with pytest.raises(StorageIOError, match=r"writing .*data-.*\.bin at byte \d+"):
        handle.wait()
    assert faulty.injected
    _assert_bitwise(ckptio.load(tmp_path / "ck"), first)  # the previous checkpoint, intact
    ck.save(_state(seed=3), tmp_path / "ck")  # reported once: the next save goes ahead
    _assert_bitwise(ckptio.load(tmp_path / "ck"), _state(seed=3))
    ck.close()


def test_unwaited_failure_is_raised_by_the_next_save_once(tmp_path: os.PathLike[str]) -> None:
    ck = Checkpointer(SMALL_POOL)
    inject(ck, fail_write=1)
    handle = ck.async_save(_state(seed=1), tmp_path / "a")
    with pytest.raises(StorageIOError, match="injected fault"):
        ck.async_save(_state(seed=2), tmp_path / "b")  # never waited for: raised here
    assert handle.done()
    assert not os.path.exists(tmp_path / "a" / "manifest.json")
    ck.save(_state(seed=2), tmp_path / "b")  # only once
    _assert_bitwise(ckptio.load(tmp_path / "b"), _state(seed=2))
    ck.close()


def test_second_save_waits_or_skips(tmp_path: os.PathLike[str], gate) -> None:
    ck = Checkpointer(SMALL_POOL)
    fsync = gate(ck, "fsync")
    first = ck.async_save(_state(seed=1), tmp_path / "a")  # in flight until the gate opens
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        skipped = ck.async_save(_state(seed=2), tmp_path / "b", if_busy="skip")
    assert skipped.done() and skipped.wait().skipped
    assert any("skipped" in str(w.message) for w in caught)
    assert not os.path.exists(tmp_path / "b" / "manifest.json")
    assert not first.done()
    fsync.open()
    second = ck.async_save(_state(seed=3), tmp_path / "c")  # default: waits for the first
    assert first.done()
    second.wait()
    _assert_bitwise(ckptio.load(tmp_path / "a"), _state(seed=1))
    _assert_bitwise(ckptio.load(tmp_path / "c"), _state(seed=3))
    with pytest.raises(CkptError, match="if_busy"):
        ck.async_save(_state(), tmp_path / "d", if_busy="maybe")
    ck.close()


def test_module_level_async_save(tmp_path: os.PathLike[str]) -> None:
    state = _state(MiB)
    handle = ckptio.async_save(state, tmp_path / "ck")
    assert isinstance(handle.wait(), ckptio.AsyncSaveResult)
    _assert_bitwise(ckptio.load(tmp_path / "ck"), state)


SOAK = r"""
import json, os, sys, threading, torch, ckptio
MiB = 1 << 20
def status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
path, saves = sys.argv[1], int(sys.argv[2])
state = {f"w{i}": torch.randn(1 << 20) for i in range(6)}  # 24 MiB
opt_free = ckptio.Checkpointer(ckptio.Options(buffer_bytes=4 * MiB, pool_bytes=32 * MiB))
rows = []
for i in range(saves):
    handle = opt_free.async_save(state, os.path.join(path, "ck"))
    state["w0"].add_(1.0)
    handle.wait()
    rows.append((status("VmRSS"), len(os.listdir("/proc/self/fd")), threading.active_count()))
opt_free.close()
print(json.dumps(rows))
"""


def test_soak_100_saves_flat_rss_fds_threads(tmp_path: os.PathLike[str]) -> None:
    """100 consecutive async saves in a fresh process: resident memory, open descriptors and
    threads after save 100 are those after save 10 (the pool is pre-faulted and reused)."""
    done = subprocess.run([sys.executable, "-c", SOAK, str(tmp_path), "100"], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    (rss10, fds10, threads10), (rss100, _fds100, _threads100) = rows[9], rows[99]
    assert rss100 - rss10 < 8 * MiB, f"RSS grew {(rss100 - rss10) / MiB:.1f} MiB over 90 saves"
    # The previous save's cleanup thread may hold a directory descriptor at the moment of a
    # reading: allow one; a leak would add one or more per save (90 here).
    assert max(r[1] for r in rows[9:]) <= fds10 + 1, f"file descriptors {[r[1] for r in rows]}"
    assert max(r[2] for r in rows[9:]) <= threads10 + 1, f"threads {[r[2] for r in rows]}"


def test_pool_is_prefaulted_and_reused(tmp_path: os.PathLike[str]) -> None:
    """A pool of unknown use (a load's first read, prepare()) is faulted in whole in the
    background; a save's pool, sized to its state (issue 29), is faulted in by its own copies;
    either way later saves reuse those pages: RSS never grows beyond the pool."""
    code = r"""
import os, sys, time, torch, ckptio
from ckptio.storage.local.local_store import LocalStore
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))
options = ckptio.Options(buffer_bytes=1 << 20, pool_bytes=64 << 20)
ck = ckptio.Checkpointer(options)
before = rss()
with ck.resources().lock:
    ck.resources().files(LocalStore(sys.argv[1]))  # unknown size: the whole pool_bytes
give_up = time.monotonic() + 60  # only so that a pool never faulted in fails the test
while time.monotonic() < give_up:  # faulted in the background, buffer by buffer
    whole = rss() - before
    if whole >= 60 << 20:
        break
    time.sleep(0.05)
ck.close()
saver = ckptio.Checkpointer(options)
state = {"x": torch.ones(8 << 20)}  # 32 MiB: a pool of its size, half of pool_bytes
before = rss()
saver.save(state, os.path.join(sys.argv[1], "a"))
first = rss() - before
for name in "bcde":
    saver.save(state, os.path.join(sys.argv[1], name))
print(whole, first, rss() - before, saver.staging_nbytes)
"""
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    whole, first, total, staging = (int(x) for x in done.stdout.split()[-4:])
    assert whole >= 60 * MiB  # all 64 MiB faulted in, not 1 buffer
    assert staging == 32 * MiB
    assert first >= 2 * MiB  # the buffers the save used are resident
    assert total <= staging + 4 * MiB  # five saves: pages reused, at most the pool's faulted


def test_reused_plan_never_writes_stale_values(tmp_path: os.PathLike[str]) -> None:
    """Later saves of an unchanged layout reuse the plan (NeMo-RL#3312 wrote the first save's
    weights into every later checkpoint that way): each checkpoint holds its own save's values,
    including for a fresh state_dict() each time, a tensor swapped for a new one of the same
    shape, and a Python value that changed."""
    model = torch.nn.Linear(64, 64)
    ck = Checkpointer(SMALL_POOL)
    expected = []
    for step in range(4):
        with torch.no_grad():
            model.weight.add_(1.0)
        if step == 2:
            model.bias = torch.nn.Parameter(torch.full((64,), 7.0))  # new storage, same shape
        state = {"model": model.state_dict(), "step": step}
        expected.append({k: v.clone() for k, v in state["model"].items()})
        ck.save(state, tmp_path / f"s{step}")
    assert ck._plan_cache.hits >= 2, "the layout was re-planned every time: reuse is untested"
    for step in range(4):
        loaded = ckptio.load(tmp_path / f"s{step}")
        assert loaded["step"] == step
        for key, value in expected[step].items():
            assert torch.equal(loaded["model"][key], value), (step, key)
    ck.close()


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    return model, opt


def test_the_first_save_reuses_the_plan_that_prepare_made(tmp_path: os.PathLike[str]) -> None:
    """prepare(state=) plans the state as its save does, an optimizer's parameter names
    included (before, its plan lacked them, so the first save planned again: the cost
    prepare is called to take out of the loop)."""
    model, opt = _trained()
    state = {"model": model, "optim": opt}
    ck = Checkpointer(SMALL_POOL)
    try:
        ck.prepare(tmp_path, state=state)
        assert ck._plan_cache.hits == 0
        ck.async_save(state, tmp_path / "s1").wait()
        assert ck._plan_cache.hits == 1, "the first save planned the state again"
    finally:
        ck.close()
    assert torch.equal(ckptio.load(tmp_path / "s1")["model"]["0.weight"], model[0].weight)


def test_a_resumed_managers_first_save_reuses_the_plan_of_its_restore(
        tmp_path: os.PathLike[str]) -> None:
    """restore() plans the restored state (its optimizer's state loaded) as a save does: the
    first save of the resumed job reuses that plan instead of planning inside the loop."""
    model, opt = _trained()
    with ckptio.CheckpointManager(os.path.join(tmp_path, "run")) as mgr:
        mgr.save(1, {"model": model, "optim": opt})
    fresh = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16))
    state = {"model": fresh, "optim": torch.optim.AdamW(fresh.parameters())}
    ck = Checkpointer(SMALL_POOL)
    try:
        with ckptio.CheckpointManager(os.path.join(tmp_path, "run"), checkpointer=ck) as again:
            assert again.restore(state) == 1
            hits = ck._plan_cache.hits
            again.save(2, state, asynchronous=True).wait()
            assert ck._plan_cache.hits == hits + 1, "the resumed job's first save planned again"
    finally:
        ck.close()
    assert torch.equal(ckptio.load(os.path.join(tmp_path, "run", "step-2"))["model"]["0.weight"],
                       model[0].weight)


def test_reused_plan_follows_values_that_change_kind_or_size(tmp_path: os.PathLike[str]) -> None:
    """The tensors' layout is unchanged, but a value becomes bytes, a numpy array grows, then
    the value goes back to None: every save writes what it holds, and every one loads."""
    import numpy as np

    weight = torch.arange(16.0)
    ck = Checkpointer(SMALL_POOL)
    values = [None, b"abc", np.arange(3), np.arange(5), None, 0.93]
    for step, value in enumerate(values):
        ck.save({"w": weight, "x": value}, tmp_path / f"s{step}")
    for step, value in enumerate(values):
        loaded = ckptio.load(tmp_path / f"s{step}")
        assert torch.equal(loaded["w"], weight)
        if isinstance(value, np.ndarray):
            assert np.array_equal(loaded["x"], value), step
        else:
            assert loaded["x"] == value, step
    ck.close()


def test_reused_plan_keeps_each_scalar_exact_and_refuses_a_changed_tensor(
        tmp_path: os.PathLike[str]) -> None:
    """The one-pass reuse of a plan (plan.py ``_again``): 1 becoming True, 0.0 becoming -0.0,
    a str becoming None and back come back as they were saved, save after save; a tensor that
    becomes sparse at a key that held a dense one is refused naming the key, as on a first save."""
    weight = torch.arange(16.0)
    ck = Checkpointer(SMALL_POOL)
    values = [1, True, 1, 0.0, -0.0, "a", None, "a", "a"]
    for step, value in enumerate(values):
        ck.save({"w": weight, "x": value, "n": [step, "name"]}, tmp_path / f"s{step}")
    for step, value in enumerate(values):
        loaded = ckptio.load(tmp_path / f"s{step}")
        assert type(loaded["x"]) is type(value) and loaded["x"] == value, step
        assert math.copysign(1.0, loaded["x"]) == math.copysign(1.0, value) if isinstance(
            value, float) else True, step
        assert loaded["n"] == [step, "name"] and torch.equal(loaded["w"], weight)
    with pytest.raises(ckptio.CkptError, match="'w'.*sparse"):
        ck.save({"w": weight.to_sparse(), "x": 1, "n": [0, "name"]}, tmp_path / "sparse")
    assert not os.path.exists(tmp_path / "sparse" / "manifest.json")
    ck.close()


EXIT = r"""
import sys, torch, ckptio
state = {f"w{i}": torch.full((4 << 20,), float(i)) for i in range(8)}  # 128 MiB
ck = ckptio.Checkpointer(ckptio.Options(buffer_bytes=1 << 20, pool_bytes=4 << 20))
ck.async_save(state, sys.argv[1])  # no wait(): the program ends with the save in flight
"""


def test_save_in_flight_at_exit_is_finished_and_committed(tmp_path: os.PathLike[str]) -> None:
    done = subprocess.run([sys.executable, "-c", EXIT, str(tmp_path / "ck")], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    loaded = ckptio.load(tmp_path / "ck")
    assert all(torch.equal(loaded[f"w{i}"], torch.full((4 << 20,), float(i))) for i in range(8))


def test_interrupt_during_eager_capture_abandons_the_save(tmp_path: os.PathLike[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while the caller copies: it reaches the caller, nothing is committed, nothing
    hangs, and the next save (an emergency save in an ``except KeyboardInterrupt:``) is made:
    the interrupt was the abandoned save's error, already the caller's, so it is not raised
    again in place of that save (it was, and the emergency checkpoint was lost)."""
    from ckptio.saving import capture_window

    real_put = capture_window.Window.put
    calls = {"n": 0}

    def interrupted_put(self, *args, **kwargs):  # the signal lands in the middle of the copy
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_put(self, *args, **kwargs)

    ck = Checkpointer(SMALL_POOL)
    monkeypatch.setattr(capture_window.Window, "put", interrupted_put)
    with pytest.raises(KeyboardInterrupt):
        ck.async_save(_state(seed=1), tmp_path / "a")
    monkeypatch.setattr(capture_window.Window, "put", real_put)
    ck.save(_state(seed=2), tmp_path / "b")
    assert not os.path.exists(tmp_path / "a" / "manifest.json")
    _assert_bitwise(ckptio.load(tmp_path / "b"), _state(seed=2))
    pool, _files = ck.resources().files(LocalStore("."))
    assert pool.idle()
    ck.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the pool is page-locked when "
                    "made (cudaHostRegister faults every page): there is no background pre-fault")
def test_exit_while_the_pool_is_still_faulting_in(tmp_path: os.PathLike[str]) -> None:
    """A process that saves once and exits at once, its 1 GiB pool still being pre-faulted in
    the background: it exits cleanly (a torch op still running on a daemon thread when the
    interpreter finalizes aborted such a process with 'terminate called without an active
    exception'), and promptly (the pre-fault stops at exit instead of finishing). Through the
    POSIX backend: io_uring pins (faults in) a first use's pool at once, so a pool left faulting
    at exit is POSIX's (or a grown one's, which this same exit hook stops)."""
    code = r"""
import os, sys, torch, ckptio
from ckptio.storage.local.local_store import LocalStore
ck = ckptio.Checkpointer(ckptio.Options(buffer_bytes=1 << 20, pool_bytes=1 << 30,
                                        io_backend="posix"))
with ck.resources().lock:  # the whole pool_bytes, as a use of unknown size makes it (a tiny
    ck.resources().files(LocalStore(sys.argv[1]))  # save alone makes a pool of its own size)
ck.save({"x": torch.zeros(16)}, os.path.join(sys.argv[1], "ck"))
assert ck.resources().pool._faulter.is_alive(), "the pool was faulted before exit: nothing is tested"
"""
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr


def test_fresh_tensors_each_save_reuse_the_plan_and_ties_still_count(
        tmp_path: os.PathLike[str]) -> None:
    """A training state rebuilt each save holds tensors made afresh (torch.get_rng_state(), a
    step tensor): the layout is still the same (the plan is reused: a training loop's save does
    not re-plan 2,500 leaves every time), each checkpoint holds its own save's RNG state; and
    a change of which keys share memory is a new layout (the tie is saved as it now is)."""
    model = torch.nn.Linear(8, 8)
    ck = Checkpointer(SMALL_POOL)
    rngs = []
    for step in range(3):
        torch.rand(3)  # advances the global generator: a new RNG state each save
        rngs.append(torch.get_rng_state())
        ck.save({"model": model.state_dict(), "rng": rngs[-1], "step": torch.tensor(step)},
                tmp_path / f"s{step}")
    assert ck._plan_cache.hits == 2
    for step in range(3):
        loaded = ckptio.load(tmp_path / f"s{step}")
        assert torch.equal(loaded["rng"], rngs[step]) and int(loaded["step"]) == step
    shared = torch.arange(4.0)
    ck.save({"a": shared, "b": shared}, tmp_path / "tied")
    ck.save({"a": shared, "b": shared.clone()}, tmp_path / "untied")
    tied, untied = ckptio.load(tmp_path / "tied"), ckptio.load(tmp_path / "untied")
    assert tied["a"].data_ptr() == tied["b"].data_ptr()
    assert untied["a"].data_ptr() != untied["b"].data_ptr()
    ck.close()


def test_a_failed_async_save_nobody_waited_for_is_said_at_exit(tmp_path) -> None:
    """A script whose last async save fails in the background and that exits without wait()
    or close() used to exit quietly (status 0, the manager's exit line saying its saves
    finished): the exit logs the save's path and error. One whose error was raised says
    nothing more."""
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"x")
    code = ("import sys, torch, ckptio\n"
            "ck = ckptio.Checkpointer()\n"
            "ck.async_save({'w': torch.ones(4)}, sys.argv[1] + '/ok').wait()\n"
            "h = ck.async_save({'w': torch.ones(4)}, sys.argv[2])\n"
            "if sys.argv[3] == 'wait':\n"
            "    try:\n"
            "        h.wait()\n"
            "    except ckptio.StorageIOError:\n"
            "        pass\n")
    target = str(blocker / "step-2")  # under a file: the background save fails
    said = (f"ckptio: the save to {target} failed in the background and nothing waited for "
            "it before exit, so it is not committed: StorageIOError: ")
    for how in ("exit", "wait"):
        done = subprocess.run([sys.executable, "-c", code, str(tmp_path), target, how],
                              capture_output=True, text=True, timeout=120, check=True)
        assert (said in done.stderr) == (how == "exit"), done.stderr
    assert ckptio.load(tmp_path / "ok")["w"].tolist() == [1.0] * 4


def test_an_exit_waiting_for_a_save_in_flight_says_so_and_the_save_commits(tmp_path) -> None:
    """A script that ends with an async save still writing (a slow store) waited at exit in
    silence; after a couple of seconds the exit now names the save it waits for and how to stop
    waiting, and the save commits whole. A save done in time is not mentioned."""
    code = ("import sys, torch, ckptio\n"
            "from ckptio.testing.faults import inject\n"
            "ck = ckptio.Checkpointer()\n"
            "inject(ck, delay_s=float(sys.argv[2]))\n"
            "ck.async_save({'w': torch.ones(4)}, sys.argv[1])\n")
    said = "ckptio: exiting: waiting for 1 save(s) in flight to be committed ("
    for delay, slow in ((3.0, True), (0.0, False)):
        target = tmp_path / f"slow-{slow}"
        done = subprocess.run([sys.executable, "-c", code, str(target), str(delay)],
                              capture_output=True, text=True, timeout=120, check=True)
        assert (f"{said}{target})" in done.stderr) == slow, done.stderr
        assert ckptio.load(target)["w"].tolist() == [1.0] * 4


def test_ctrl_c_before_a_save_is_queued_does_not_hang_the_exit(tmp_path) -> None:
    """Ctrl-C landing after a save's stall watch began and before the save was queued left the
    watch running forever, and the interpreter's exit (which joins the watch's thread) hung: the
    process never ended. The watch ends with the save that never started; the exit is prompt and
    the next save is made."""
    code = ("import sys, torch, ckptio\n"
            "from ckptio.saving import save_session\n"
            "real = save_session._queue\n"
            "def interrupted(*args, **kwargs):\n"
            "    raise KeyboardInterrupt\n"
            "ck = ckptio.Checkpointer()\n"
            "save_session._queue = interrupted\n"
            "try:\n"
            "    ck.async_save({'w': torch.ones(4)}, sys.argv[1] + '/a')\n"
            "except KeyboardInterrupt:\n"
            "    pass\n"
            "save_session._queue = real\n"
            "ck.save({'w': torch.ones(4)}, sys.argv[1] + '/b')\n"
            "print('saved', flush=True)\n")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                          text=True, timeout=60, check=True)
    assert done.stdout.strip() == "saved", done.stderr
    assert ckptio.load(tmp_path / "b")["w"].tolist() == [1.0] * 4
    assert not os.path.exists(tmp_path / "a" / "manifest.json")
