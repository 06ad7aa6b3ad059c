"""``dcp.save(state, storage_writer=ckptio.DcpWriter(path))`` writes an ordinary ckptio checkpoint.

Real DCP (torch 2.13) on real gloo ranks (ckptio.testing.rank_processes.run_ranks), real files:

* FSDP2 (``fully_shard`` MLP + AdamW after one step, uneven dims 12-30-17-5) saved on 2 ranks
  three ways (dcp.save; dcp.async_save with the THREAD executor; a DCP ``Stateful`` app state
  using get_state_dict/set_state_dict) and tensor parallel (Colwise/Rowwise, hidden dim 16);
  each loaded with ``ckptio.load`` in place into freshly built, differently initialised models
  on 2 ranks (the same layout) and on 1 rank (a plain module): every parameter and optimizer
  tensor bitwise equal to what was saved (FSDP2 also on 4 ranks); ``ckptio.verify`` passes; a fresh ``ckptio.load``
  (no target) returns the nested state.
* dcp.async_save with the PROCESS executor (2 ranks as plain subprocesses: run_ranks' ranks are
  daemons, which may not start DCP's checkpoint daemon), loaded bitwise; the writer pickles to
  its path, options and if_locked only.
* Faults: a write error on rank 1 commits nothing and leaves the previous checkpoint bitwise, the
  next save (a new writer, if_locked="raise": the failed save's claim was let go) commits and
  its cleanup removes the failed save's files; use_collectives=False is refused; a held claim
  with if_locked="raise" refuses a second save.
* One process without a process group.
"""

from __future__ import annotations

import gc
import itertools
import os
import pickle
import pickletools
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import ckptio
from ckptio.testing.rank_processes import free_port, run_ranks
from dist_cases import SPECIALS, fully_shard_linears, special_leaf, special_reference
from special_values import bits_equal, rand

DIMS = (12, 30, 17, 5)  # FSDP2 MLP: 17 and 5 do not divide by 2
# tensor parallel: an even hidden dim (Colwise's plain local output, 9 + 8 rows of 17, is read
# back by Rowwise as 2 x 9 columns: DCP aside, uneven TP does not run forward in torch 2.13)
TP_DIMS = (12, 16, 5)
RANKS_TIMEOUT_S = 300

# dcp.save without a process group says so once per call; that is the case under test
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


# ------------------------------------------------------------------------------------------------
# what the ranks run (module level: the ranks import this module)


def _mlp(dims: tuple[int, ...], seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(dims)):
        layers.append(torch.nn.Linear(a, b))
        if i < len(dims) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def _build(layout: str, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """``fsdp``: every Linear and the root fully_shard-ed; ``tp``: Colwise then Rowwise over
    every rank; ``plain``: an ordinary module (the ``tp`` or ``fsdp`` dims by ``seed``'s model)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dims = TP_DIMS if layout in ("tp", "plain_tp") else DIMS
    model = _mlp(dims, seed)
    if layout == "fsdp":
        fully_shard_linears(model)
    elif layout == "tp":
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, dims: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(7)
    x, y = torch.randn(4, dims[0], generator=gen), torch.randn(4, dims[-1], generator=gen)
    (model(x) - y).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _whole(value: Any) -> np.ndarray:
    full = value.full_tensor() if hasattr(value, "full_tensor") else value
    return full.detach().numpy().copy()


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, np.ndarray]:
    """Every parameter and optimizer state tensor, whole, by FQN (collective when sharded)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    out = {f"model.{k}": _whole(v) for k, v in msd.items()}
    for fqn, slots in osd["state"].items():
        for name, value in slots.items():
            out[f"optim.{fqn}.{name}"] = _whole(value)
    return out


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """FQN-keyed model and optimizer state dicts (on a fresh optimizer, get_state_dict first
    creates its state, so a load has tensors of the right layout to fill), and a step."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "step": 0}


class AppState:
    """A DCP ``Stateful`` app state, as DCP's own tutorial writes it."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.opt)
        return {"model": msd, "optim": osd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])


def _set(model: torch.nn.Module, opt: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def save_all(rank: int, world: int, root: str) -> dict[str, Any]:
    """On 2 ranks: FSDP2 saved by dcp.save, by dcp.async_save (THREAD) and as a Stateful; TP
    by dcp.save. -> the snapshots of what was saved."""
    import torch.distributed.checkpoint as dcp

    import ckptio

    torch.set_num_threads(1)
    model, opt = _build("fsdp", 0)
    _train_step(model, opt, DIMS)
    state = _state(model, opt)
    state["step"] = 1
    dcp.save(state, storage_writer=ckptio.DcpWriter(f"{root}/fsdp"))
    writer = ckptio.DcpWriter(f"{root}/fsdp_thread")
    dcp.async_save(state, storage_writer=writer).result()
    dcp.save({"app": AppState(model, opt)}, storage_writer=ckptio.DcpWriter(f"{root}/app"))
    fsdp = _snapshot(model, opt)

    tp_model, tp_opt = _build("tp", 0)
    _train_step(tp_model, tp_opt, TP_DIMS)
    tp_state = _state(tp_model, tp_opt)
    tp_state["step"] = 1
    dcp.save(tp_state, storage_writer=ckptio.DcpWriter(f"{root}/tp"))
    tp_local = {k: tuple(v.to_local().shape) for k, v in tp_state["model"].items()}
    return {"fsdp": fsdp, "tp": _snapshot(tp_model, tp_opt), "tp_local": tp_local,
            "writer_state": writer.__getstate__()}


def load_all(rank: int, world: int, root: str) -> dict[str, Any]:
    """On 2 ranks: each checkpoint of save_all loaded in place with ckptio.load into freshly
    built models of the saving layout (seed 1: another initialisation)."""
    import ckptio

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for name, layout in (("fsdp", "fsdp"), ("fsdp_thread", "fsdp"), ("tp", "tp")):
        model, opt = _build(layout, 1)
        state = _state(model, opt)
        report = ckptio.load(f"{root}/{name}", state)
        assert not report.missing and not report.unexpected, report
        _set(model, opt, state)
        out[name] = (_snapshot(model, opt), state["step"])
    model, opt = _build("fsdp", 1)
    ckptio.load(f"{root}/app", {"app": AppState(model, opt)})
    out["app"] = (_snapshot(model, opt), None)
    return out


def load_fsdp(rank: int, world: int, path: str) -> dict[str, np.ndarray]:
    """On another number of ranks: a fresh FSDP2 model loaded in place (resharded)."""
    import ckptio

    torch.set_num_threads(1)
    model, opt = _build("fsdp", 1)
    state = _state(model, opt)
    report = ckptio.load(path, state)
    assert not report.missing and not report.unexpected, report
    _set(model, opt, state)
    assert state["step"] == 1
    return _snapshot(model, opt)


def _load_plain(path: str, layout: str, app: bool = False) -> tuple[dict[str, np.ndarray], Any]:
    """In this process, no process group: a plain module of the saved dims loaded in place."""
    import ckptio

    model, opt = _build(layout, 1)
    if app:
        ckptio.load(path, {"app": AppState(model, opt)})
        return _snapshot(model, opt), None
    state = _state(model, opt)
    report = ckptio.load(path, state)
    assert not report.missing and not report.unexpected, report
    _set(model, opt, state)
    return _snapshot(model, opt), state["step"]


def _assert_bitwise(got: dict[str, np.ndarray], want: dict[str, np.ndarray], what: str) -> None:
    assert sorted(got) == sorted(want), what
    for key, value in want.items():
        assert got[key].dtype == value.dtype and got[key].shape == value.shape, (what, key)
        assert got[key].tobytes() == value.tobytes(), (what, key)  # the bytes, NaNs and -0.0 too


# ------------------------------------------------------------------------------------------------
# FSDP2, TP, Stateful, async THREAD


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("dcpw"))
    saved = run_ranks(2, save_all, root, timeout_s=RANKS_TIMEOUT_S)
    loaded = run_ranks(2, load_all, root, timeout_s=RANKS_TIMEOUT_S)
    return {"root": root, "saved": saved, "loaded": loaded}


@pytest.mark.parametrize("name", ["fsdp", "fsdp_thread", "app"])
def test_fsdp2_saved_by_dcp_loads_bitwise_on_2_ranks_and_1(runs: dict[str, Any], name: str):
    want = runs["saved"][0]["fsdp"]
    assert runs["saved"][1]["fsdp"].keys() == want.keys()
    fresh, _ = _load_plain(f"{runs['root']}/{name}", "plain", app=name == "app")
    for rank in (0, 1):
        got, step = runs["loaded"][rank][name]
        _assert_bitwise(got, want, f"{name}, 2 ranks, rank {rank}")
        assert step in (1, None), step
    _assert_bitwise(fresh, want, f"{name}, 1 rank, plain module")


def test_fsdp2_saved_on_2_ranks_loads_bitwise_on_4(runs: dict[str, Any]):
    """4 ranks: the last layer's 5 rows are 2, 2, 1, 0 (one rank's shard is empty)."""
    want = runs["saved"][0]["fsdp"]
    for rank, got in enumerate(run_ranks(4, load_fsdp, f"{runs['root']}/fsdp",
                                         timeout_s=RANKS_TIMEOUT_S)):
        _assert_bitwise(got, want, f"fsdp, 4 ranks, rank {rank}")


def _fresh_snapshot(layout: str) -> dict[str, np.ndarray]:
    model, opt = _build(layout, 1)
    _state(model, opt)
    return _snapshot(model, opt)


def test_the_loads_were_not_vacuous(runs: dict[str, Any]):
    """A fresh model differs from the saved one: equality above comes from the load."""
    fresh, want = _fresh_snapshot("plain"), runs["saved"][0]["fsdp"]
    assert any(not np.array_equal(fresh[k], want[k]) for k in want if k.startswith("model."))


def test_tensor_parallel_saved_by_dcp_loads_bitwise(runs: dict[str, Any]):
    want = runs["saved"][0]["tp"]
    # Colwise splits the hidden rows, Rowwise the columns: really sharded
    assert runs["saved"][1]["tp_local"]["0.weight"] == (8, 12)
    assert runs["saved"][1]["tp_local"]["2.weight"] == (5, 8)
    for rank in (0, 1):
        got, step = runs["loaded"][rank]["tp"]
        _assert_bitwise(got, want, f"tp, 2 ranks, rank {rank}")
        assert step == 1
    got, step = _load_plain(f"{runs['root']}/tp", "plain_tp")
    _assert_bitwise(got, want, "tp, 1 rank, plain module")
    assert step == 1


def test_an_ordinary_ckptio_checkpoint(runs: dict[str, Any]):
    """manifest.json and data files of both ranks, no .metadata; verify reads every byte;
    a fresh load returns the nested state with DCP's values decoded."""
    import ckptio
    from ckptio.format import manifest

    path = Path(runs["root"]) / "fsdp"
    names = sorted(os.listdir(path))
    assert "manifest.json" in names and ".metadata" not in names
    assert {n.split("-r")[1][:5] for n in names if n.startswith("data-")} == {"00000", "00001"}
    record = manifest.decode((path / "manifest.json").read_bytes(), str(path))
    assert record.world_size == 2 and record.meta["dcp"] == {"version": "1.0.0"}
    # DCP's values (step, param_groups) are ckptio inline values, as ckptio.save stores them
    assert {t.kind for t in record.tensors} == {"tensor"}
    assert {"step", "optim.param_groups.0.lr", "optim.param_groups.0.betas.1"} <= {
        o.key for o in record.objects}
    assert ckptio.verify(str(path)) >= sum(t.nbytes for t in record.tensors)
    fresh = ckptio.load(str(path))
    want = runs["saved"][0]["fsdp"]
    assert fresh["step"] == 1
    assert torch.equal(fresh["model"]["0.weight"], torch.from_numpy(want["model.0.weight"]))
    assert torch.equal(fresh["optim"]["state"]["4.bias"]["exp_avg_sq"],
                       torch.from_numpy(want["optim.4.bias.exp_avg_sq"]))
    group = fresh["optim"]["param_groups"][0]
    assert group["betas"] == (0.9, 0.999) and group["lr"] == 1e-2
    assert group["params"] == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]


def test_verify_finds_a_flipped_byte(runs: dict[str, Any], tmp_path: Path):
    import shutil

    import ckptio
    from ckptio.format import manifest

    path = tmp_path / "copy"
    shutil.copytree(Path(runs["root"]) / "tp", path)
    record = manifest.decode((path / "manifest.json").read_bytes(), str(path))
    entry = next(t for t in record.tensors if t.kind == "tensor" and t.nbytes > 16)
    with open(path / entry.file, "r+b") as f:
        f.seek(entry.offset + 5)
        byte = f.read(1)
        f.seek(entry.offset + 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ckptio.CorruptCheckpointError, match=entry.file):
        ckptio.verify(str(path))


def test_the_writer_pickles_to_its_arguments(runs: dict[str, Any], tmp_path: Path):
    """What crosses to DCP's checkpoint daemon: the path, options, if_locked and overwrite,
    nothing of the save (claim, store, pool, backend, threads), also right after a save."""
    import torch.distributed.checkpoint as dcp

    import ckptio

    assert set(runs["saved"][0]["writer_state"]) == {"path", "options", "if_locked", "overwrite"}
    path = str(tmp_path / "ckpt")
    writer = ckptio.DcpWriter(path)
    dcp.save({"a": torch.ones(3), "n": 2}, storage_writer=writer)
    data = pickle.dumps(writer)
    strings = {arg for _op, arg, _pos in pickletools.genops(data) if isinstance(arg, str)}
    assert strings == {"ckptio.dcp.writer", "DcpWriter", "path", path, "options", "if_locked",
                       "wait", "overwrite"}, strings
    options = ckptio.Options(io_depth=2)
    back = pickle.loads(pickle.dumps(ckptio.DcpWriter(path, options=options, if_locked="raise",
                                                      overwrite=False)))
    assert (back.path, back.options, back.if_locked, back.overwrite) == (path, options, "raise",
                                                                         False)
    dcp.save({"a": torch.zeros(3), "n": 3}, storage_writer=pickle.loads(data))
    assert ckptio.load(path)["n"] == 3


# ------------------------------------------------------------------------------------------------
# async_save with the PROCESS executor


def process_rank(rank: int, world: int, port: int, root: str) -> None:
    """One rank of the PROCESS executor test, in a plain (non-daemon) process: DCP's checkpoint
    daemon receives each save's writer pickled and serves two saves in a row."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    import ckptio

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        model, opt = _build("fsdp", 0)
        _train_step(model, opt, DIMS)
        state = _state(model, opt)
        state["step"] = 1
        for name in ("process", "process2"):
            dcp.async_save(state, storage_writer=ckptio.DcpWriter(f"{root}/{name}"),
                           async_checkpointer_type=AsyncCheckpointerType.PROCESS).result()
        want = _snapshot(model, opt)
        for name in ("process", "process2"):
            fresh, fresh_opt = _build("fsdp", 1)
            loaded = _state(fresh, fresh_opt)
            ckptio.load(f"{root}/{name}", loaded)
            _set(fresh, fresh_opt, loaded)
            _assert_bitwise(_snapshot(fresh, fresh_opt), want, f"{name}, rank {rank}")
            assert loaded["step"] == 1
        print(f"rank {rank} ok", flush=True)
    finally:
        dist.destroy_process_group()


def test_async_save_with_the_process_executor_loads_bitwise(tmp_path: Path):
    here = os.path.dirname(os.path.abspath(__file__))
    port = free_port()
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {here!r})
        import test_dcp_writer as t
        t.process_rank(int(sys.argv[1]), 2, {port}, {str(tmp_path)!r})
    """)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(rank)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(2)]
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=RANKS_TIMEOUT_S)
            outputs.append((proc.returncode, out))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for rank, (code_, out) in enumerate(outputs):
        assert code_ == 0 and f"rank {rank} ok" in out, out[-4000:]


# ------------------------------------------------------------------------------------------------
# faults, refusals, the claim


def _sharded(mesh: Any, seed: int) -> tuple[dict[str, Any], torch.Tensor]:
    """A Shard(0) DTensor (both ranks write) and a BYTE_IO value."""
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.randn(9, 6, generator=torch.Generator().manual_seed(seed))
    return {"w": distribute_tensor(full, mesh, [Shard(0)]), "meta": {"seed": seed}}, full


def fault_rank(rank: int, world: int, path: str) -> dict[str, Any]:
    """A save, then one whose write fails on rank 1, then one more (a fresh writer that must
    get the claim at once: if_locked="raise")."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.device_mesh import init_device_mesh

    import ckptio
    from ckptio.format import manifest
    from ckptio.shared import checkpointer
    from ckptio.testing.faults import inject

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    old, old_full = _sharded(mesh, 1)
    dcp.save(old, storage_writer=ckptio.DcpWriter(path))
    committed = Path(path, "manifest.json").read_bytes()
    old_files = {n: Path(path, n).read_bytes() for n in os.listdir(path) if n.startswith("data-")}

    faulty = inject(checkpointer(), fail_write=1) if rank == 1 else None
    new, _ = _sharded(mesh, 2)
    error = ""
    try:
        dcp.save(new, storage_writer=ckptio.DcpWriter(path))
    except CheckpointException as exc:
        error = str(exc)
    assert error, "the save with a failed write on rank 1 did not raise"
    gc.collect()  # the failed save's writer (held by its traceback) lets go of its claim
    dist.barrier()
    assert Path(path, "manifest.json").read_bytes() == committed
    for name, data in old_files.items():
        assert Path(path, name).read_bytes() == data, name
    target, _ = _sharded(mesh, 3)
    ckptio.load(path, target)
    assert torch.equal(target["w"].full_tensor(), old_full) and target["meta"] == {"seed": 1}
    leftovers = sorted(n for n in os.listdir(path) if n.startswith("data-") and n not in old_files)

    newest, newest_full = _sharded(mesh, 4)
    dcp.save(newest, storage_writer=ckptio.DcpWriter(path, if_locked="raise"))
    checkpointer().resources().cleanup.finish()
    dist.barrier()
    target, _ = _sharded(mesh, 5)
    ckptio.load(path, target)
    assert torch.equal(target["w"].full_tensor(), newest_full) and target["meta"] == {"seed": 4}
    record = manifest.decode(Path(path, "manifest.json").read_bytes(), path)
    return {"error": error, "injected": faulty.injected if faulty else [],
            "leftovers": leftovers, "files": sorted(os.listdir(path)),
            "named": sorted(f.name for f in record.files)}


def test_a_write_error_on_one_rank_commits_nothing_and_the_next_save_succeeds(tmp_path: Path):
    path = str(tmp_path / "ckpt")
    results = run_ranks(2, fault_rank, path, timeout_s=RANKS_TIMEOUT_S)
    assert results[1]["injected"] and results[0]["injected"] == []
    for result in results:
        assert "injected fault" in result["error"] and "RANK 1" in result["error"], result["error"]
    # rank 1 removed its own files; rank 0's (written before the failure was known) are left
    # until the next commit, whose cleanup removes them
    assert results[0]["leftovers"] and all("-r00000-" in n for n in results[0]["leftovers"])
    assert results[0]["files"] == sorted(["manifest.json", *results[0]["named"]])


def test_use_collectives_false_is_refused(tmp_path: Path):
    import torch.distributed.checkpoint as dcp

    import ckptio

    path = tmp_path / "ckpt"
    with pytest.raises(ckptio.CkptError, match="use_collectives=True"):
        dcp.save({"a": torch.ones(3)}, storage_writer=ckptio.DcpWriter(path),
                 use_collectives=False)
    assert not path.exists()


def test_if_locked_raise_refuses_a_concurrent_save(tmp_path: Path):
    """Two saves into one path at once: the second (if_locked="raise") is refused with
    CheckpointLockedError while the first holds the claim; the first commits."""
    import threading

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    import ckptio

    class Slow(ckptio.DcpWriter):
        claimed, go = threading.Event(), threading.Event()

        def prepare_global_plan(self, plans):  # type: ignore[no-untyped-def]
            out = super().prepare_global_plan(plans)
            Slow.claimed.set()
            Slow.go.wait(60)
            return out

    path = str(tmp_path / "ckpt")
    first = {"a": torch.arange(5.0)}
    errors: list[BaseException] = []

    def save_first() -> None:
        try:
            dcp.save(first, storage_writer=Slow(path))
        except BaseException as exc:  # noqa: BLE001 - reported by the assert below
            errors.append(exc)

    thread = threading.Thread(target=save_first)
    thread.start()
    assert Slow.claimed.wait(60)
    try:
        with pytest.raises(CheckpointException) as info:
            dcp.save({"a": torch.zeros(5)}, storage_writer=ckptio.DcpWriter(path, if_locked="raise"))
    finally:
        Slow.go.set()
        thread.join(60)
    (refusal, _trace), = info.value.failures.values()
    assert isinstance(refusal, ckptio.CheckpointLockedError), refusal
    assert not errors, errors
    assert torch.equal(ckptio.load(path)["a"], first["a"])


# ------------------------------------------------------------------------------------------------
# one process, no process group


def test_one_process_without_a_process_group(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import ckptio
    from ckptio import cli

    assert not dist.is_initialized()
    model, opt = _build("plain", 0)
    _train_step(model, opt, DIMS)
    state = _state(model, opt)
    state["step"], state["note"] = 3, ["a", (1, 2.5), None, {"x": True}]
    path = str(tmp_path / "ckpt")
    dcp.save(state, storage_writer=ckptio.DcpWriter(path))
    want = _snapshot(model, opt)

    fresh_model, fresh_opt = _build("plain", 1)
    loaded = _state(fresh_model, fresh_opt)
    loaded["note"] = ["", (0, 0.0), None, {"x": False}]
    report = ckptio.load(path, loaded)
    assert not report.missing and not report.unexpected
    _set(fresh_model, fresh_opt, loaded)
    _assert_bitwise(_snapshot(fresh_model, fresh_opt), want, "one process")
    assert loaded["step"] == 3 and loaded["note"] == ["a", (1, 2.5), None, {"x": True}]

    fresh = ckptio.load(path)
    assert fresh["note"] == ["a", (1, 2.5), None, {"x": True}] and fresh["step"] == 3
    assert ckptio.verify(path) > 0
    assert cli.main(["ls", "--flat", path]) == 0
    out = capsys.readouterr().out
    assert "model.0.weight" in out and "optim.param_groups.0.betas" in out
    assert "dcp.save through ckptio.DcpWriter) by 1 rank(s)" in out.splitlines()[0]


class Custom:
    """A value DCP pickles (torch.save) that torch.load(weights_only=True) refuses."""

    def __init__(self, n: int) -> None:
        self.n = n


def test_a_pickled_object_is_refused_without_allow_pickle(tmp_path: Path):
    import torch.distributed.checkpoint as dcp

    import ckptio

    path = str(tmp_path / "ckpt")
    dcp.save({"a": torch.ones(2), "obj": Custom(3)}, storage_writer=ckptio.DcpWriter(path))
    with pytest.raises(ckptio.PickleRefusedError, match="'obj'.*allow_pickle=True"):
        ckptio.load(path)
    assert ckptio.verify(path) > 0  # verify reads the bytes, decodes nothing


def test_a_fresh_load_gives_back_what_optimizer_load_state_dict_takes(tmp_path: Path):
    """A raw ``optimizer.state_dict()`` (state keyed by int) saved by DCP (which makes every
    dict key a str) comes back from a fresh ckptio.load with int keys, as from a DCP directory,
    so ``load_state_dict`` takes it as it is."""
    import torch.distributed.checkpoint as dcp

    import ckptio

    model, opt = _build("plain", 0)
    _train_step(model, opt, DIMS)
    path = str(tmp_path / "ckpt")
    dcp.save({"optim": opt.state_dict()}, storage_writer=ckptio.DcpWriter(path))
    fresh = ckptio.load(path)["optim"]
    assert sorted(fresh["state"]) == list(range(6)) and fresh["param_groups"][0]["params"] == \
        list(range(6))
    _model, other = _build("plain", 1)
    other.load_state_dict(fresh)
    for index, slots in opt.state_dict()["state"].items():
        for name, value in slots.items():
            assert torch.equal(other.state_dict()["state"][index][name], value), (index, name)


def test_tree_of_planner_data():
    from ckptio.dcp.writeplan import paths_of
    from ckptio.loading.foreign_common import nest

    def tree_of(keys: list[str], planner_data: Any) -> Any:
        return nest({k: {"k": k} for k in keys}, paths_of(keys, planner_data), "test")

    paths = {"o.s.0.m": ("o", "s", "0", "m"), "o.l.0": ("o", "l", 0), "o.l.1": ("o", "l", 1),
             "x": ("x",), "y.z": ("not", "its", "path")}
    assert tree_of(list(paths) + ["w"], paths) == {"d": [
        ["o", {"d": [["s", {"d": [[0, {"d": [["m", {"k": "o.s.0.m"}]]}]]}],
                     ["l", {"l": [{"k": "o.l.0"}, {"k": "o.l.1"}]}]]}],
        ["x", {"k": "x"}], ["y.z", {"k": "y.z"}], ["w", {"k": "w"}]]}
    # a list with a gap (a key left out of the save) stays a dict of indexes
    assert tree_of(["a.1"], {"a.1": ("a", 1)}) == {"d": [["a", {"d": [[1, {"k": "a.1"}]]}]]}
    assert tree_of(["a"], None) == {"d": [["a", {"k": "a"}]]}


def test_a_dtype_ckptio_does_not_store_is_refused_before_anything_is_written(tmp_path: Path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    import ckptio

    path = tmp_path / "ckpt"
    packed = torch.zeros(4, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    with pytest.raises(CheckpointException) as info:
        dcp.save({"q": packed, "a": torch.ones(2)}, storage_writer=ckptio.DcpWriter(path))
    (refusal, _trace), = info.value.failures.values()
    assert isinstance(refusal, ckptio.UnsupportedStateError) and "'q'" in str(refusal)
    assert not path.exists()


def test_dcp_save_through_writer_then_dcp_load_through_reader(tmp_path):
    """The two drivers together: dcp.save(DcpWriter) then dcp.load(DcpReader) into a freshly
    built model and optimizer (get/set_state_dict, as users write it) gives the same weights,
    AdamW state, param_groups (betas a tuple) and plain values."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def build():
        m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        return m, torch.optim.AdamW(m.parameters(), lr=1e-3, betas=(0.8, 0.95))

    torch.manual_seed(0)
    model, opt = build()
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    path = str(tmp_path / "ck")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": msd, "optim": osd, "step": 7, "extra": {"lst": [1, 2.5, "x"]}},
                 storage_writer=ckptio.DcpWriter(path))
        model2, opt2 = build()
        msd2, osd2 = get_state_dict(model2, opt2)
        state = {"model": msd2, "optim": osd2, "step": 0, "extra": {"lst": [0, 0.0, ""]}}
        dcp.load(state, storage_reader=ckptio.DcpReader(path))
        set_state_dict(model2, opt2, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    for (k, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), k
    saved, loaded = opt.state_dict(), opt2.state_dict()
    assert saved["param_groups"] == loaded["param_groups"]
    for index, slots in saved["state"].items():
        for name, value in slots.items():
            assert torch.equal(value, loaded["state"][index][name]), (index, name)
    assert state["step"] == 7 and state["extra"] == {"lst": [1, 2.5, "x"]}


def specials_through_dcp(rank: int, world: int, path: str) -> list[str]:
    """dcp.save(DcpWriter) of special values (NaN payloads, -0.0, subnormals, float8,
    complex64, bool) as Shard(0) DTensors, then dcp.load(DcpReader) into Shard(1) DTensors
    holding other bits; -> the keys whose bytes differ after the load."""
    import torch.distributed.checkpoint as dcp

    import ckptio

    torch.set_num_threads(1)
    saved = {name: special_leaf("shard0", special_reference(name), rank, world) for name in SPECIALS}
    dcp.save({"special": saved}, storage_writer=ckptio.DcpWriter(path))
    into = {name: special_leaf("shard1", rand(dtype, shape, seed=99), rank, world)
            for name, (shape, dtype) in SPECIALS.items()}
    dcp.load({"special": into}, storage_reader=ckptio.DcpReader(path))
    return [name for name in SPECIALS if not bits_equal(
        into[name].to_local(), special_leaf("shard1", special_reference(name), rank, world).to_local())]


def test_special_values_through_dcp_writer_and_reader_bitwise(tmp_path: Path):
    """Saved on 2 ranks by DCP through ckptio.DcpWriter, read back resharded through
    ckptio.DcpReader on those ranks, and whole by ckptio.load in one process: every byte."""
    path = str(tmp_path / "ck")
    differing = run_ranks(2, specials_through_dcp, path, timeout_s=RANKS_TIMEOUT_S)
    assert differing == [[], []]
    whole = ckptio.load(path)["special"]
    for name in SPECIALS:
        assert bits_equal(whole[name], special_reference(name)), name
