"""Red-team cases of asynchronous and lazy saves as training loops use them: a state changed in
place behind a lazy save, DataLoader workers forked while a save is in flight, a disk that
fills up under a background save, and odd tensors (dtypes, views, shared storage) restored
in a fresh process. Each save is held open by a gate on its writes where the case needs it in
flight, so no timing races the test."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import ckptio
from ckptio import Checkpointer, CkptError, Options
from ckptio.testing.faults import inject

MiB = 1 << 20
SMALL_POOL = Options(buffer_bytes=MiB, pool_bytes=2 * MiB, io_depth=2)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Gate:
    """Holds a Checkpointer's writes until open(): its save stays in flight, and a capture
    larger than the pool waits for them (the state's tensors not copied yet)."""

    def __init__(self, ck: Checkpointer) -> None:
        self.opened = threading.Event()
        backend = inject(ck)
        passing = backend.submit_write

        def held(*args: object, **kwargs: object) -> object:
            self.opened.wait(60)
            return passing(*args, **kwargs)

        backend.submit_write = held

    def open(self) -> None:
        self.opened.set()


@pytest.fixture
def held_ck() -> Iterator[tuple[Checkpointer, _Gate]]:
    ck = Checkpointer(SMALL_POOL)
    gate = _Gate(ck)
    yield ck, gate
    gate.open()
    ck.close()


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024)  # 4 MiB of weights: more than the pool holds
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 1024)).sum().backward()
    opt.step()
    return model, opt


def _holds(ck: Checkpointer, path: Any, values: dict[str, torch.Tensor]) -> None:
    """The checkpoint at ``path`` holds ``values`` (the model's at the save's call) bitwise."""
    loaded = ck.load(path)["model"]
    assert all(torch.equal(loaded[k], v) for k, v in values.items())


def test_lazy_save_of_params_changed_in_place_fails_naming_them(tmp_path, held_ck) -> None:
    """A lazy save, then ``p.mul_()`` under no_grad before the optimizer's step (a weight
    decay or a clamp written by hand): the background capture copied the changed values and
    the save committed weights the model never had at the call, silently. Now it fails,
    naming the keys and the fix, once; the next save commits the values at its call."""
    ck, gate = held_ck
    model, opt = _trained()
    state = {"model": model, "optim": opt}
    at_call = {k: v.clone() for k, v in model.state_dict().items()}
    handle = ck.async_save(state, tmp_path / "lazy", lazy=True, optimizers=[opt])
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2)
    gate.open()
    try:
        handle.wait()
    except CkptError as raised:
        message = str(raised)
        assert "'model.weight'" in message and "'model.bias'" in message, message
        assert "lazy=False" in message and "step()" in message, message
        assert not os.path.exists(tmp_path / "lazy" / "manifest.json")
    else:  # a busy machine: the pool grew and the capture ran before the change; its values
        _holds(ck, tmp_path / "lazy", at_call)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    ck.async_save(state, tmp_path / "next", lazy=True, optimizers=[opt])  # not raised again
    opt.step()  # waits for the capture: the step's values are not in it
    ck.settle()
    loaded = ck.load(tmp_path / "next")["model"]
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())


def test_lazy_save_change_unseen_by_wait_is_raised_once_by_the_next_save(tmp_path,
                                                                         held_ck) -> None:
    """The same change with nobody waiting: the next save raises it (naming the key), the
    one after it works, and close() raises nothing more."""
    ck, gate = held_ck
    model, opt = _trained()
    state = {"model": model, "optim": opt}
    at_call = {k: v.clone() for k, v in model.state_dict().items()}
    ck.async_save(state, tmp_path / "a", lazy=True, optimizers=[opt])
    with torch.no_grad():
        model.weight.copy_(torch.zeros_like(model.weight))
    gate.open()
    try:
        ck.async_save(state, tmp_path / "b", lazy=True, optimizers=[opt])
    except CkptError as raised:
        assert "'model.weight'" in str(raised)
        made = ["c"]
    else:  # a busy machine: the pool grew and the capture ran before the change; its values,
        # or (the change racing the copy itself, which the version counter cannot see until
        # copy_ ends: docs/guides/async.md) each weight its value at the call or the new zero
        ck.settle()
        loaded = ck.load(tmp_path / "a")["model"]
        assert torch.equal(loaded["bias"], at_call["bias"])
        weight = loaded["weight"]
        assert bool(((weight == at_call["weight"]) | (weight == 0)).all())
        made = ["a", "b", "c"]
    ck.async_save(state, tmp_path / "c", lazy=True, optimizers=[opt]).wait()
    assert torch.equal(ck.load(tmp_path / "c")["model"]["weight"], model.weight)
    assert sorted(os.listdir(tmp_path)) == made


def test_lazy_save_with_steps_and_replaced_params_commits_the_values_at_the_call(
        tmp_path, held_ck) -> None:
    """What a loop may do behind a lazy save: the optimizer's step (it waits for the capture),
    ``p.data = ...`` (a new tensor: the saved one is the old), zero_grad(set_to_none=False)."""
    ck, gate = held_ck
    model, opt = _trained()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    handle = ck.async_save({"model": model, "optim": opt}, tmp_path / "s", lazy=True,
                           optimizers=[opt])
    model.bias.data = torch.full_like(model.bias, 7.0)
    opt.zero_grad(set_to_none=False)
    threading.Timer(0.2, gate.open).start()
    opt.step()
    handle.wait()
    loaded = ck.load(tmp_path / "s")["model"]
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())


FORK_CHILD = r"""
import multiprocessing, sys, threading, time, torch
import ckptio
from ckptio.testing.faults import inject
ck = ckptio.Checkpointer(ckptio.Options(buffer_bytes=1 << 20, pool_bytes=2 << 20, io_depth=2))
opened = threading.Event()
backend = inject(ck)
passing = backend.submit_write
backend.submit_write = lambda *a, **k: (opened.wait(60), passing(*a, **k))[1]
handle = ck.async_save({"a": torch.randn(1 << 20)}, sys.argv[1])
began = time.monotonic()
child = multiprocessing.get_context("fork").Process(target=int)
child.start()
child.join(15)
print("child", child.exitcode, round(time.monotonic() - began, 1), flush=True)
if child.is_alive():
    child.kill()
began = time.monotonic()
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(40.0)),
                                     batch_size=10, num_workers=2,
                                     multiprocessing_context="fork")
print("loader", sum(1 for _ in loader), round(time.monotonic() - began, 1), flush=True)
opened.set()
handle.wait()
ck.close()
"""


def test_forked_workers_exit_while_a_save_is_in_flight(tmp_path) -> None:
    """A DataLoader's fork workers (or any forked Process) that exit while an async save is in
    flight: each child's exit waited for the parent's save, which never finishes there (its
    threads are the parent's): a plain Process hung forever, and every epoch's DataLoader
    waited its workers' shutdown timeout and then terminated them. Now they exit at once."""
    done = subprocess.run([sys.executable, "-c", FORK_CHILD, str(tmp_path / "s")],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr
    child, loader = (line.split() for line in done.stdout.splitlines())
    assert child[1] == "0" and float(child[2]) < 10, done.stdout
    assert loader[1] == "4" and float(loader[2]) < 6, done.stdout  # was 10 s (2 x 5 s)
    assert "waiting for" not in done.stderr, done.stderr  # no child said it waits for it
    assert ckptio.load(tmp_path / "s")["a"].shape == (1 << 20,)  # the save committed


DISK_FULL_CHILD = r"""
import os, sys, torch
import ckptio
from ckptio import CkptError
d = sys.argv[1]
ck = ckptio.Checkpointer()
small = {"a": torch.randn(1000), "b": torch.randn(10).bfloat16()}
handle = ck.async_save({"a": torch.randn(1 << 20)}, d + "/big")   # 4 MiB, a 2 MiB disk
raised = []
for name in ("s2", "s3"):
    try:
        ck.async_save(small, d + "/" + name).wait()
    except CkptError as exc:
        raised.append((name, type(exc).__name__, str(exc)))
ck.close()
print(repr(raised))
print(sorted(os.listdir(d)))
print(all(torch.equal(v, ckptio.load(d + "/s3")[k]) for k, v in small.items()))
"""


def test_disk_full_under_a_background_save_is_raised_once_and_the_next_save_works(
        tmp_path) -> None:
    """A background save that fills the disk (a 2 MiB tmpfs): the next save raises it once,
    naming the file and the disk, and writes nothing; the save after it commits; close()
    raises nothing more; the failed save left no files."""
    mount = tmp_path / "mnt"
    mount.mkdir()
    probe = ["unshare", "-rm", "mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)]
    if shutil.which("unshare") is None or subprocess.run(probe, capture_output=True).returncode:
        pytest.skip("needs unshare(1) and a user namespace to mount a small tmpfs")
    script = (f"mount -t tmpfs -o size=2m tmpfs {mount} && "
              f"{sys.executable} -c \"$CHILD\" {mount}")
    done = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True,
                          text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT, "CHILD": DISK_FULL_CHILD})
    assert done.returncode == 0, done.stderr
    raised, listing, intact = done.stdout.splitlines()
    errors = eval(raised)  # noqa: S307 - the repr of a list of strings the child printed
    assert [(name, kind) for name, kind, _ in errors] == [("s2", "StorageIOError")], errors
    assert "big" in errors[0][2] and "disk is full" in errors[0][2], errors
    assert listing == "['s3']" and intact == "True", done.stdout


RESTORE_CHILD = r"""
import sys, torch, ckptio
ref = torch.load(sys.argv[2])
got = ckptio.load(sys.argv[1])
bad = [k for k, v in ref.items() if not (v.dtype == got[k].dtype and v.shape == got[k].shape
       and torch.equal(v.resolve_conj().resolve_neg().contiguous().view(-1).view(torch.uint8),
                       got[k].resolve_conj().resolve_neg().contiguous().view(-1).view(torch.uint8)))]
print(bad)
"""


def test_odd_tensors_changed_after_an_eager_async_save_restore_bitwise_elsewhere(
        tmp_path, held_ck) -> None:
    """bf16, fp8, complex, conjugate and negative views, bool, transposed, sliced, expanded
    and shared tensors, changed in place right after async_save returns (its writes held):
    a fresh process loads each bitwise as torch.save copied it at the call."""
    ck, gate = held_ck
    g = torch.Generator().manual_seed(1)
    base = torch.randn(512, 512, generator=g)  # 1 MiB: the capture fills the pool
    state = {
        "bf16": torch.randn(100, generator=g).bfloat16(),
        "fp8": torch.randn(100, generator=g).to(torch.float8_e4m3fn),
        "fp8b": torch.randn(100, generator=g).to(torch.float8_e5m2),
        "c64": torch.randn(50, dtype=torch.complex64, generator=g),
        "conj": torch.randn(50, dtype=torch.complex64, generator=g).conj(),
        "neg": torch.randn(50, dtype=torch.complex64, generator=g).conj().imag,
        "bool": torch.rand(77, generator=g) > 0.5,
        "base": base, "t": base.t(), "slice": base[3:9, ::3], "row": base[5],
        "expanded": torch.randn(1, 8, generator=g).expand(4, 8),
        "zero_d": torch.tensor(3.5), "empty": torch.empty(0, 3),
        "big": torch.randn(3 * MiB // 4, generator=g),
    }
    torch.save({k: v.clone() for k, v in state.items()}, tmp_path / "ref.pt")
    handle = ck.async_save(state, tmp_path / "s")
    base.mul_(2)
    state["bf16"].mul_(3)
    state["bool"].logical_not_()
    state["big"].zero_()
    gate.open()
    handle.wait()
    done = subprocess.run([sys.executable, "-c", RESTORE_CHILD, str(tmp_path / "s"),
                           str(tmp_path / "ref.pt")], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


def test_meta_tensors_are_refused_naming_the_key_and_the_fix(tmp_path) -> None:
    """A meta-device tensor in an async or lazy save (a module built under torch.device("meta")
    and never materialized) is refused before anything is written, naming the key."""
    with torch.device("meta"):
        ghost = torch.nn.Linear(4, 4)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Checkpointer() as ck:
        for lazy in (False, True):
            with pytest.raises(CkptError, match="'ghost.weight'") as raised:
                ck.async_save({"model": model, "ghost": ghost}, tmp_path / f"m{lazy}",
                              lazy=lazy, optimizers=[opt] if lazy else ())
            assert "to_empty" in str(raised.value), raised.value
        assert not os.listdir(tmp_path)


FORK_SAVER = r"""
import multiprocessing, sys, threading, torch
import ckptio
from ckptio.testing.faults import inject
d = sys.argv[1]
ck = ckptio.Checkpointer(ckptio.Options(buffer_bytes=1 << 20, pool_bytes=2 << 20, io_depth=2))
ck.async_save({"a": torch.arange(10.0)}, d + "/first").wait()
ckptio.save({"a": torch.arange(3.0)}, d + "/shared")  # the module-level Checkpointer's pool
opened = threading.Event()
backend = inject(ck)
passing = backend.submit_write
backend.submit_write = lambda *a, **k: (opened.wait(60), passing(*a, **k))[1]
handle = ck.async_save({"a": torch.randn(1 << 20)}, d + "/parent")

def child():
    assert torch.equal(ck.load(d + "/first")["a"], torch.arange(10.0))
    ck.save({"a": torch.arange(5.0)}, d + "/child")
    ck.async_save({"a": torch.arange(6.0)}, d + "/child_async").wait()
    ckptio.save({"a": torch.arange(7.0)}, d + "/child_shared")

process = multiprocessing.get_context("fork").Process(target=child)
process.start()
process.join(30)
print("child", process.exitcode, flush=True)
if process.is_alive():
    process.kill()
opened.set()
handle.wait()
ck.close()
"""


def test_a_forked_child_saves_and_loads_through_the_parents_checkpointer(tmp_path) -> None:
    """A forked child (a multiprocessing worker) that saves or loads through a Checkpointer its
    parent had used, while the parent's save is in flight: the child touched the parent's
    staging pool, which is not mapped in a child, and died of SIGSEGV. Now it makes its own
    pool and backends, waits for none of the parent's saves, and every save commits."""
    done = subprocess.run([sys.executable, "-c", FORK_SAVER, str(tmp_path)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0 and done.stdout.split() == ["child", "0"], (
        done.stdout + done.stderr)
    for name, n in (("child", 5), ("child_async", 6), ("child_shared", 7)):
        assert torch.equal(ckptio.load(tmp_path / name)["a"], torch.arange(float(n))), name
    assert ckptio.load(tmp_path / "parent")["a"].shape == (1 << 20,)


FORK_UNMAP = r"""
import ctypes, gc, os, sys, torch
import ckptio
ck = ckptio.Checkpointer()
ck.save({"w": torch.ones(1024)}, sys.argv[1])
old = ck.resources().pool  # the parent's pool, still referenced in the child after the fork
view = old.whole_view()
address, nbytes = torch.frombuffer(view, dtype=torch.uint8).data_ptr(), len(view)
del view
pid = os.fork()
if pid == 0:  # the range is free here (MADV_DONTFORK): a mapping of the child's own takes it
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    MAP_FIXED_NOREPLACE = 0x100000
    got = libc.mmap(address, nbytes, 3, 0x02 | 0x20 | MAP_FIXED_NOREPLACE, -1, 0)
    if got != address:
        os._exit(2)
    del old, ck
    gc.collect()  # the parent's objects freed in the child
    mapped = any(int(line.split("-")[0], 16) <= address < int(line.split()[0].split("-")[1], 16)
                 for line in open("/proc/self/maps"))
    os._exit(0 if mapped else 3)
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status), flush=True)
"""


def test_a_forked_child_freeing_the_parents_pool_keeps_its_own_mappings(tmp_path) -> None:
    """The parent's pool is not mapped in a forked child, but its Python objects are there:
    freed in the child (the parent's Checkpointer forgotten, collected some time later), they
    unmapped their range, which the child's own new pool had taken meanwhile; the child's next
    save then died of SIGSEGV in its capture (seen in CI). A mapping of the child's own at
    that range survives the parent's objects being freed now."""
    done = subprocess.run([sys.executable, "-c", FORK_UNMAP, str(tmp_path / "ck")],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0 and done.stdout.split() == ["child", "0"], (
        done.stdout + done.stderr)


FORK_STEPPER = r"""
import multiprocessing, sys, threading, torch
import ckptio
from ckptio.testing.faults import inject
ck = ckptio.Checkpointer(ckptio.Options(buffer_bytes=1 << 20, pool_bytes=2 << 20, io_depth=2))
opened = threading.Event()
backend = inject(ck)
passing = backend.submit_write
backend.submit_write = lambda *a, **k: (opened.wait(60), passing(*a, **k))[1]
model = torch.nn.Linear(1024, 1024)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.randn(2, 1024)).sum().backward()
handle = ck.async_save({"model": model}, sys.argv[1], lazy=True, optimizers=[opt])
def child():  # its own copy of the optimizer; one intra-op thread: a fork while the save's
    torch.set_num_threads(1)  # thread copies may leave the OpenMP pool unusable in the child
    opt.step()

process = multiprocessing.get_context("fork").Process(target=child)
process.start()
process.join(15)
print("child", process.exitcode, flush=True)
if process.is_alive():
    process.kill()
opened.set()
handle.wait()
ck.close()
"""


def test_a_forked_child_steps_its_copy_of_an_optimizer_a_lazy_save_hooked(tmp_path) -> None:
    """A child forked while a lazy save's capture is pending (a search or evaluation process
    that trains its copy of the model): its optimizer's step waited for the parent's capture,
    which never ends in the child, and hung for ever. Now the child's step goes ahead."""
    done = subprocess.run([sys.executable, "-c", FORK_STEPPER, str(tmp_path / "s")],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0 and done.stdout.split() == ["child", "0"], (
        done.stdout + done.stderr)
