"""ckptio.deepspeed_engine under model parallelism: a real DeepSpeed engine (CPU accelerator,
four gloo ranks) given a user's model-parallel unit (``deepspeed.initialize(mpu=...)``: two
model-parallel ranks by two data-parallel ranks, over torch.distributed groups), ZeRO 0, 1
and 2 (ZeRO 2 saved decoupled).
DeepSpeed writes one model file per model-parallel rank (``mp_rank_XX_model_states.pt``) and
loads, on every rank, the first of them (its SDLoader's check of the list) and then its own;
ckptio loads each over the loading rank's data-parallel group. Checked: a fresh job resumes
bitwise; each model file is read once per data-parallel group that loads it (not once per
rank), and a rank reads no other model-parallel rank's file than the one DeepSpeed asks for;
a load_checkpoint on some ranks only ends, the lone rank loading alone after
Options.rank_timeout_s, warned."""

from __future__ import annotations

import os
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")
pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install --no-deps "
                    "deepspeed==0.19.8 and the deepspeed extra's needs)")
import deepspeed_cases as cases  # noqa: E402 - after the skip

from ckptio.testing.rank_processes import run_ranks  # noqa: E402

WORLD, MP = 4, 2  # model-parallel rank = rank % MP, data-parallel rank = rank // MP
STAGES = (0, 1, 2)
LIMIT_S = 240
TIMEOUT_S = 3.0  # Options.rank_timeout_s of the load on some ranks only


class Mpu:
    """A user's model-parallel unit over torch.distributed groups (as Megatron's mpu): the
    model-parallel groups {0, 1}, {2, 3}, the data-parallel groups {0, 2}, {1, 3}."""

    def __init__(self) -> None:
        dist = torch.distributed
        rank = dist.get_rank()
        self._mp = self._dp = None
        for first in range(0, WORLD, MP):  # every rank makes every group, in one order
            group = dist.new_group(list(range(first, first + MP)))
            if rank in range(first, first + MP):
                self._mp = group
        for mp_rank in range(MP):
            group = dist.new_group(list(range(mp_rank, WORLD, MP)))
            if rank % MP == mp_rank:
                self._dp = group

    def get_model_parallel_rank(self) -> int:
        return torch.distributed.get_rank(self._mp)

    def get_model_parallel_world_size(self) -> int:
        return MP

    def get_model_parallel_group(self) -> Any:
        return self._mp

    def get_data_parallel_rank(self) -> int:
        return torch.distributed.get_rank(self._dp)

    def get_data_parallel_world_size(self) -> int:
        return WORLD // MP

    def get_data_parallel_group(self) -> Any:
        return self._dp


_MPU: list[Mpu] = []


def _engine(stage: int, mpu: bool = True) -> Any:
    """A fresh DeepSpeed engine (ZeRO ``stage``) given this process's Mpu (``mpu``; else none:
    model-parallel size one), seeded alike."""
    os.environ.setdefault("LOCAL_RANK", str(torch.distributed.get_rank()))
    import importlib

    import deepspeed

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    if mpu and not _MPU:
        _MPU.append(Mpu())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    from deepspeed_cases import config_for

    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config_for(stage), mpu=_MPU[0] if mpu else None)
    return engine


def _per_file() -> Counter[str]:
    """The data bytes this process reads from now on, by the ckptio checkpoint (the DeepSpeed
    file) they are of."""
    from ckptio.storage.files import StoreFiles

    counted: Counter[str] = Counter()
    submit, submit_many = StoreFiles.submit_read, StoreFiles.submit_reads

    def submit_read(self: StoreFiles, fh: Any, offset: int, into: memoryview) -> Any:
        counted[os.path.basename(os.path.dirname(str(fh.path)))] += len(into)
        return submit(self, fh, offset, into)

    def submit_reads(self: StoreFiles, fh: Any, reads: Any, each: Any) -> Any:
        counted[os.path.basename(os.path.dirname(str(fh.path)))] += sum(
            len(into) for _offset, into in reads)
        return submit_many(self, fh, reads, each)

    StoreFiles.submit_read = submit_read  # type: ignore[method-assign]
    StoreFiles.submit_reads = submit_reads  # type: ignore[method-assign]
    return counted


def _watched(ours: Any) -> dict[str, list[str]]:
    """Wrap ``ours.load`` -> for each file loaded, the other files whose loaded tensors were
    still alive (held by someone) when it was loaded."""
    import gc
    import weakref

    loaded = ours.load
    refs: list[tuple[str, Any]] = []
    held: dict[str, list[str]] = {}

    def load(path: str, map_location: Any = None) -> Any:
        gc.collect()
        name = os.path.basename(path)
        held[name] = sorted({n for n, ref in refs if n != name and ref() is not None})
        out = loaded(path, map_location)
        refs.extend((name, weakref.ref(t)) for t in _tensors(out))
        return out

    ours.load = load
    return held


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return [value] if isinstance(value, torch.Tensor) else []


def _save(rank: int, world_size: int, root: str) -> list[dict[str, Any]]:
    """Per stage: train, save through ckptio (ZeRO 2: decoupled, committed at the next step),
    train on (the uninterrupted run)."""
    import ckptio.deepspeed_engine

    out = []
    for stage in STAGES:
        engine = _engine(stage)
        ckptio.deepspeed_engine.use(engine, allow_pickle=True, decoupled=stage == 2)
        cases.train(engine, cases.SAVE_AT)
        engine.save_checkpoint(os.path.join(root, str(stage)))
        losses = cases.train(engine, cases.MORE)
        engine.destroy()
        out.append({**cases.snapshot(engine), "losses": losses})
    return out


def _resume(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Per stage: a fresh engine loads the save (its data reads counted by file), trains on.
    Then a load_checkpoint on every rank but the last (Options.rank_timeout_s small)."""
    import ckptio
    import ckptio.deepspeed_engine

    counted, runs = _per_file(), []
    for stage in STAGES:
        engine = _engine(stage)
        held = _watched(ckptio.deepspeed_engine.use(engine, allow_pickle=True))
        counted.clear()
        path, _ = engine.load_checkpoint(os.path.join(root, str(stage)))
        read = dict(counted)
        losses = cases.train(engine, cases.MORE)
        runs.append({**cases.snapshot(engine), "losses": losses, "loaded": path, "read": read,
                     "held": held})
        engine.destroy()
    partial = _partial(os.path.join(root, "1"), skip=rank == WORLD - 1, late=False)
    late = _partial(os.path.join(root, "1"), skip=False, late=rank == WORLD - 1)
    return {"runs": runs, "partial": partial, "late": late}


def _partial(where: str, skip: bool, late: bool) -> dict[str, Any]:
    """A fresh ZeRO 1 engine (Options.rank_timeout_s=TIMEOUT_S) loads ``where`` unless
    ``skip``, ``late``: after sleeping past the others' wait -> how long the load took, what
    it warned of, the step and parameters it resumed."""
    import ckptio
    import ckptio.deepspeed_engine

    engine = _engine(1)
    ckptio.deepspeed_engine.use(engine, allow_pickle=True,
                                options=ckptio.Options(rank_timeout_s=TIMEOUT_S))
    out: dict[str, Any] = {"skipped": skip}
    if not skip:
        time.sleep(1.5 * TIMEOUT_S if late else 0)
        started = time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            path, _ = engine.load_checkpoint(where)
        out.update(seconds=time.monotonic() - started, loaded=path,
                   warned=[str(w.message) for w in caught if "ckptio" in str(w.message)],
                   step=engine.global_steps,
                   params=[p.detach().clone() for p in engine.module.parameters()])
    torch.distributed.barrier()
    engine.destroy()
    return out


def _without_mpu(rank: int, world_size: int, root: str) -> str:
    """A job without an mpu (model-parallel size one) loads the ZeRO 1 save -> what it raised."""
    import ckptio
    import ckptio.deepspeed_engine

    engine = _engine(1, mpu=False)
    ckptio.deepspeed_engine.use(engine, allow_pickle=True)
    try:
        engine.load_checkpoint(os.path.join(root, "1"))
    except Exception as exc:  # noqa: BLE001 - the test reads which exception it was
        return f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
    return "loaded"


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The saving job, then one fresh job resuming it (and loading on some ranks only)."""
    root = tmp_path_factory.mktemp("deepspeed-mp")
    saved = run_ranks(WORLD, _save, str(root), timeout_s=LIMIT_S)
    resumed = run_ranks(WORLD, _resume, str(root), timeout_s=LIMIT_S)
    other = run_ranks(2, _without_mpu, str(root), timeout_s=LIMIT_S)
    return {"root": root, "saved": saved, "resumed": resumed, "other": other}


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["losses"] == b["losses"]
    assert a["step"] == b["step"] == cases.SAVE_AT + cases.MORE
    for x, y in zip(a["params"], b["params"], strict=True):
        assert torch.equal(x, y)
    assert [k for k, _ in a["optimizer"]] == [k for k, _ in b["optimizer"]]
    for (key, x), (_, y) in zip(a["optimizer"], b["optimizer"]):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, key
    assert a["scheduler"] == b["scheduler"]


@pytest.mark.parametrize("i", range(len(STAGES)), ids=[f"zero{s}" for s in STAGES])
def test_resume_with_an_mpu_is_bitwise(jobs: dict[str, Any], i: int) -> None:
    """Every rank of a fresh job with the same mpu resumes exactly as the saving job went on;
    one model file per model-parallel rank was written."""
    names = sorted(os.listdir(jobs["root"] / str(STAGES[i]) / "global_step3"))
    assert [n for n in names if n.startswith("mp_rank_")] == [
        "mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"], names
    for rank in range(WORLD):
        got = jobs["resumed"][rank]["runs"][i]
        assert "global_step3" in got["loaded"]
        _same(jobs["saved"][rank][i], got)


def _data_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.name != "manifest.json")


@pytest.mark.parametrize("i", range(len(STAGES)), ids=[f"zero{s}" for s in STAGES])
def test_each_model_file_is_read_once_per_data_parallel_group(jobs: dict[str, Any],
                                                              i: int) -> None:
    """mp_rank_00 is loaded by every rank (DeepSpeed checks the list with it, and the ranks of
    model-parallel rank 0 load it): read once by each data-parallel group, {0, 2} and {1, 3};
    mp_rank_01 only by {1, 3}, once; the ranks of model-parallel rank 0 never read mp_rank_01."""
    tag = jobs["root"] / str(STAGES[i]) / "global_step3"
    reads = [jobs["resumed"][rank]["runs"][i]["read"] for rank in range(WORLD)]
    for mp_rank in range(MP):
        name = f"mp_rank_{mp_rank:02d}_model_states.pt"
        size = _data_size(tag / name)
        for first in range(MP):  # the data-parallel group of model-parallel rank ``first``
            group = range(first, WORLD, MP)
            asked = mp_rank in (0, first)  # DeepSpeed loads mp_rank_00 and its own
            total = sum(reads[r].get(name, 0) for r in group)
            assert total == (size if asked else 0), (name, list(group), reads)


def test_a_load_on_some_ranks_only_ends_warned(jobs: dict[str, Any]) -> None:
    """load_checkpoint on every rank but rank 3: every rank waits Options.rank_timeout_s once
    (the tag check over every rank), not once more per model file (rank 1 waited three times:
    mp_rank_00, then mp_rank_01, each shared with rank 3); rank 1, whose data-parallel partner
    is missing, loads both files alone, warned, naming each file and global rank 3 (the
    warning named its data-parallel rank, 1: the rank that did come); all resume step 3."""
    partial = [jobs["resumed"][rank]["partial"] for rank in range(WORLD)]
    assert partial[WORLD - 1]["skipped"]
    for rank in range(WORLD - 1):
        got = partial[rank]
        assert got["step"] == cases.SAVE_AT and "global_step3" in got["loaded"], got
        assert TIMEOUT_S <= got["seconds"] < 2 * TIMEOUT_S, got
    alone = [w for w in partial[1]["warned"] if "loaded by this rank alone" in w]
    for name, said in zip(["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"], alone,
                          strict=True):
        assert name in said and "rank(s) [3]" in said and "[1, 3]" in said, said
    for rank in (0, 2):  # their group came whole: loaded together, no warning of it
        assert not [w for w in partial[rank]["warned"] if "alone" in w], partial[rank]


@pytest.mark.parametrize("i", range(len(STAGES)), ids=[f"zero{s}" for s in STAGES])
def test_the_first_model_file_is_let_go_on_other_model_parallel_ranks(jobs: dict[str, Any],
                                                                     i: int) -> None:
    """DeepSpeed loads mp_rank_00 on model-parallel rank 1 only to check the file list, then
    drops it: ckptio kept its tensors for a second load that never came, a whole model shard
    held through the load of the rank's own file (and of the rest of the checkpoint)."""
    own = "mp_rank_01_model_states.pt"
    for rank in range(1, WORLD, MP):
        held = jobs["resumed"][rank]["runs"][i]["held"]
        assert held[own] == [], (rank, held)


def test_a_rank_that_comes_late_loads_alone_and_resumes_alike(jobs: dict[str, Any]) -> None:
    """Rank 3 calls load_checkpoint after the others gave up waiting for it: it waits
    Options.rank_timeout_s once more, alone, loads alone, warned, and resumes the same step
    and the same parameters as its data-parallel partner, rank 1."""
    late = [jobs["resumed"][rank]["late"] for rank in range(WORLD)]
    for rank in range(WORLD):
        assert late[rank]["step"] == cases.SAVE_AT, late[rank]
        assert late[rank]["seconds"] < 2 * TIMEOUT_S, late[rank]
    for x, y in zip(late[1]["params"], late[3]["params"], strict=True):
        assert torch.equal(x, y)
    assert [w for w in late[3]["warned"] if "mp_rank_01_model_states.pt is loaded by this "
            "rank alone" in w], late[3]["warned"]


def test_another_model_parallel_size_is_refused_naming_both(jobs: dict[str, Any]) -> None:
    """A job without the mpu loads the save: DeepSpeed merged the two model files as Megatron's
    and failed with a bare AssertionError naming a Megatron key; refused on every rank as an
    UnsupportedStateError naming both model-parallel sizes and the ways on."""
    for said in jobs["other"]:
        assert said.startswith("ckptio.errors.UnsupportedStateError"), said
        assert "model-parallel size 2" in said and "this job's is 1" in said, said
        assert "mpu=" in said and "load_module_only=True" in said, said
