"""Read once on a restart through the framework integrations (issue 67, many ranks on shared
storage): a Megatron-Core ``dist_checkpointing.load`` with the ckptio strategy reads the
committed manifest once per rank (it read it in its common-state check, for the padded
vocabulary's shapes, and again for the objects' load), its replicated tensors once in all on
two ranks, and a later load in the same process of a newer save there sees the newer save;
a DeepSpeed ``load_checkpoint`` (ZeRO 1, 2, 3) reads each file's manifest and data once.
Each rank counts its store's manifest reads and the bytes it submits to the store's files."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core.dist_checkpointing",
                    reason="megatron-core is not installed (the test extra has it)")
from megatron.core import dist_checkpointing as mdc  # noqa: E402
from megatron.core.dist_checkpointing.validation import StrictHandling  # noqa: E402

from ckptio.megatron_strategy import (  # noqa: E402
    CkptioLoadShardedStrategy,
    CkptioSaveShardedStrategy,
)
from ckptio.testing.rank_processes import run_ranks  # noqa: E402
from test_megatron import gpt_model  # noqa: E402  (the same small GPTModel)

SAVE, LOAD = CkptioSaveShardedStrategy, CkptioLoadShardedStrategy


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def _counting() -> tuple[Counter[str], Any]:
    """This process's manifest reads (counted from now on) and a counter of its data reads."""
    from ckptio.testing.readcount import count_manifest_reads, count_store_reads

    manifests = count_manifest_reads()
    manifests.clear()
    return manifests, count_store_reads()


def _load_counted(rank: int, world: int, root: str, tp: int) -> dict[str, Any]:
    """Save a GPTModel at TP ``tp``, load it into another -> this rank's manifest reads and
    data bytes read in the load, the data's size, whether it loaded bitwise, and the manifest
    reads of a strict load's metadata step (load_sharded_metadata)."""
    where = Path(root) / "gpt"
    where.mkdir(exist_ok=True)
    saved = gpt_model(tp, 0)
    mdc.save(saved.sharded_state_dict(), str(where), sharded_strategy=SAVE())
    counted, data_read = _counting()
    model = gpt_model(tp, 1)
    before = data_read()
    model.load_state_dict(mdc.load(model.sharded_state_dict(), str(where),
                                   sharded_strategy=LOAD()))
    out = {"manifest": counted.total(), "read": data_read() - before,
           "equal": all(torch.equal(v, _tensors(saved)[k]) for k, v in _tensors(model).items())}
    counted.clear()
    LOAD().load_sharded_metadata(where)
    out["metadata_manifest"] = counted.total()
    out["data"] = sum(f.stat().st_size for f in (where / "ckptio").iterdir()
                      if f.name != "manifest.json")
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_a_megatron_load_reads_the_manifest_once_per_rank(tmp_path: Path, world: int) -> None:
    """TP ``world``: one manifest read per rank per load (four before on the rank that
    read it for the tensors' load, three on the others), one in the metadata step (two)."""
    got = run_ranks(world, _load_counted, str(tmp_path), world, timeout_s=240)
    assert all(g["equal"] for g in got), got
    assert [g["manifest"] for g in got] == [1] * world, got
    assert [g["metadata_manifest"] for g in got] == [1] * world, got


def test_a_replicated_megatron_load_reads_each_byte_once_across_ranks(tmp_path: Path) -> None:
    """TP 1 on two ranks: every tensor is a replica on both; ckptio's read-once broadcast
    reads each of its bytes once in all, not once per rank."""
    got = run_ranks(2, _load_counted, str(tmp_path), 1, timeout_s=240)
    assert all(g["equal"] for g in got), got
    data = got[0]["data"]
    assert 0.9 * data <= sum(g["read"] for g in got) <= 1.25 * data, got
    assert [g["manifest"] for g in got] == [1, 1], got


def _save_load_save_load(rank: int, world: int, root: str) -> list[Any]:
    """One strategy object of each kind for the whole run, as a trainer keeps them: save,
    load, save a newer state over the same directory, load again -> what each load found."""
    where = Path(root) / "gpt"
    where.mkdir(exist_ok=True)
    save, load = SAVE(), LOAD()
    found = []
    for seed in (0, 2):
        saved = gpt_model(world, seed)
        mdc.save(saved.sharded_state_dict(), str(where), sharded_strategy=save)
        model = gpt_model(world, 1)
        model.load_state_dict(mdc.load(model.sharded_state_dict(), str(where),
                                       sharded_strategy=load, strict=StrictHandling.RAISE_ALL))
        want = _tensors(saved)
        found.append(sorted(k for k, v in _tensors(model).items() if not torch.equal(v, want[k])))
    return found


def test_a_second_save_then_load_in_the_same_process_sees_the_newer_checkpoint(
        tmp_path: Path) -> None:
    """No manifest kept from one load to the next: the second load (its metadata step too)
    is of the second save, and its common state matches it (a stale manifest would refuse
    the newer common.pt, or load the older tensors)."""
    got = run_ranks(2, _save_load_save_load, str(tmp_path), timeout_s=240)
    assert got == [[[], []], [[], []]], got


def _deepspeed_once(rank: int, world: int, root: str) -> list[dict[str, Any]]:
    """ZeRO 1, 2 and 3 on these ranks: train, save, and in a fresh engine count one
    load_checkpoint's reads -> per stage: the manifest reads and bytes read of each file
    this rank read, the step it resumed at, the files' sizes; then a second save over the
    same folder (a new tag) loaded by the same engine: the step it resumed at."""
    import deepspeed_cases as cases

    import ckptio.deepspeed_engine

    out = []
    for stage in (1, 2, 3):
        where = os.path.join(root, f"zero{stage}")
        saving = cases.engine_for(stage, world)
        ckptio.deepspeed_engine.use(saving, allow_pickle=True)
        cases.train(saving, 2)
        saving.save_checkpoint(where)
        saving.destroy()
        engine = cases.engine_for(stage, world)
        ckptio.deepspeed_engine.use(engine, allow_pickle=True)
        counted = _per_file()
        engine.load_checkpoint(where)
        got = {"stage": stage, "manifest": dict(counted["manifest"]),
               "read": dict(counted["read"]), "resumed": engine.global_steps,
               "sizes": {f: sum(p.stat().st_size for p in Path(where, d, f).iterdir()
                                if p.name != "manifest.json")
                         for d in os.listdir(where) if os.path.isdir(os.path.join(where, d))
                         for f in os.listdir(os.path.join(where, d))}}
        cases.train(engine, 1)
        engine.save_checkpoint(where)
        engine.load_checkpoint(where)
        got["again"] = engine.global_steps
        torch.distributed.barrier()
        engine.destroy()
        out.append(got)
    return out


def _per_file() -> dict[str, Any]:
    """This process's manifest reads and data bytes read, by the ckptio checkpoint (the
    DeepSpeed file) they are of, counted from now on."""
    from ckptio.storage.files import StoreFiles
    from ckptio.storage.local.local_store import LocalStore

    counted: dict[str, Any] = {"manifest": Counter(), "read": Counter()}
    read_manifest, submit = LocalStore.read_manifest, StoreFiles.submit_read
    submit_many = StoreFiles.submit_reads

    def counted_manifest(self: LocalStore) -> bytes:
        counted["manifest"][os.path.basename(self.location)] += 1
        return read_manifest(self)

    def submit_read(self: StoreFiles, fh: Any, offset: int, into: memoryview) -> Any:
        counted["read"][os.path.basename(os.path.dirname(str(fh.path)))] += len(into)
        return submit(self, fh, offset, into)

    def submit_reads(self: StoreFiles, fh: Any, reads: Any, each: Any) -> Any:
        counted["read"][os.path.basename(os.path.dirname(str(fh.path)))] += sum(
            len(into) for _offset, into in reads)
        return submit_many(self, fh, reads, each)

    LocalStore.read_manifest = counted_manifest  # type: ignore[method-assign]
    StoreFiles.submit_read = submit_read  # type: ignore[method-assign]
    StoreFiles.submit_reads = submit_reads  # type: ignore[method-assign]
    return counted


def test_a_deepspeed_resume_reads_each_file_once(tmp_path: Path) -> None:
    """ZeRO 1 / 2 / 3 on two ranks: each file a rank loads has its manifest read once (five
    times before for the model file: the parameter check, DeepSpeed's SDLoader check, its
    load, and a metadata read after each load; twice for an optimizer file) and its data read
    once (the model file twice before); a later load of a newer tag sees that tag. The check
    that the tag's files are of one save reads every file's manifest on rank 0 alone: rank 1
    reads none of rank 0's optimizer files (it read all of them when every rank checked)."""
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (its extra has it)")
    got = run_ranks(2, _deepspeed_once, str(tmp_path), timeout_s=240)
    for r, rank in enumerate(got):
        for stage in rank:
            assert stage["resumed"] == 2 and stage["again"] == 3, stage
            assert set(stage["manifest"].values()) == {1}, stage
            if r == 1:  # (every rank reads the first model file's parameter shapes)
                assert not [f for f in stage["manifest"]
                            if f.startswith("zero_pp_rank_0_") and "optim_states" in f], stage
            assert all(stage["read"][f] <= stage["sizes"][f] for f in stage["read"]), stage


def test_a_hugging_face_trainer_resume_reads_the_manifest_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CkptioTrainer's resume hooks (model, the parts list three times, optimizer and
    scheduler, RNG) each read the manifest before (six reads): now once per resume; a second
    train() in the same process after a newer save resumes that save."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import transformers

    from ckptio.storage.local.local_store import LocalStore
    from tests.integrations.hf_trainer_run import (
        RecordingTrainer,
        TokenData,
        tiny_model,
        training_args,
    )

    def trainer(steps: int) -> Any:
        transformers.set_seed(0)
        return RecordingTrainer(model=tiny_model(), losses=str(tmp_path / "losses.txt"),
                                args=training_args(str(tmp_path), max_steps=steps, save_steps=2),
                                train_dataset=TokenData())

    trainer(2).train()
    reads: list[str] = []
    read_manifest = LocalStore.read_manifest

    def counted(self: LocalStore) -> bytes:
        reads.append(self.location)
        return read_manifest(self)

    monkeypatch.setattr(LocalStore, "read_manifest", counted)
    again = trainer(3)
    again.train(resume_from_checkpoint=True)
    assert [Path(r).parent.name for r in reads] == ["checkpoint-2"], reads
    assert again.state.global_step == 3
    reads.clear()
    again.args.max_steps = 5  # resumes checkpoint-3 (saved at the end), trains on to step 5
    again.train(resume_from_checkpoint=True)
    again.train(resume_from_checkpoint=True)  # the newer save of this process: checkpoint-5
    assert [Path(r).parent.name for r in reads] == ["checkpoint-3", "checkpoint-5"], reads


def _record_given_on(rank: int, world: int, root: str, given: list[int]) -> list[Any]:
    """A replicated state saved by both ranks, loaded in place where the ranks of ``given``
    pass the manifest they read (Checkpointer.load(record=)) and the others do not; then a
    load whose ranks name different checkpoints, each passing its record -> [whether the
    first loaded bitwise, this rank's manifest reads in it, the second's error]."""
    import ckptio

    want = {"w": torch.arange(4096.0), "b": torch.ones(7)}
    for name in ("a", "b"):
        ckptio.save({k: v + (name == "b") for k, v in want.items()}, os.path.join(root, name))
    counted, _read = _counting()
    loader = ckptio.Checkpointer()
    path = os.path.join(root, "a")
    record = loader.manifest(path) if rank in given else None
    into = {k: torch.zeros_like(v) for k, v in want.items()}
    loader.load(path, into, record=record)
    out: list[Any] = [all(torch.equal(into[k], v) for k, v in want.items()), counted.total()]
    other = os.path.join(root, "a" if rank == 0 else "b")
    try:
        loader.load(other, into, record=loader.manifest(other))
        out.append(None)
    except ckptio.CkptError as exc:
        out.append(str(exc))
    loader.close()
    return out


@pytest.mark.parametrize("given", [[0, 1], [0], [1]])
def test_a_load_given_its_manifest_reads_none_and_still_compares_paths(
        tmp_path: Path, given: list[int]) -> None:
    """Checkpointer.load(record=) on some ranks or all: no rank waits for a manifest another
    rank does not send, each given one reads none in the load (its own manifest() read
    only), and ranks that load different checkpoints are still told so, naming both."""
    got = run_ranks(2, _record_given_on, str(tmp_path), given, timeout_s=60)
    assert all(g[0] for g in got), got
    for rank in given:
        assert got[rank][1] == 1, got
    assert all(g[2] is not None and "ranks disagree on the checkpoint" in g[2] for g in got
               if g[2] is not None), got
    assert got[1][2] is not None and str(tmp_path / "b") in got[1][2], got
