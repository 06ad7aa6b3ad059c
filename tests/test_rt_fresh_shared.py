"""A fresh load (no state) shared by the ranks that load the same file (issue 67, every byte
read from storage once): ``ckptio.load(path, process_group=G)`` with G of many ranks reads the
manifest once and each stored entry on one rank, sent to the others, checked where received;
its final agreement raises on every rank; with no process_group it stays a load of this rank
alone. Through the integrations: a DeepSpeed ZeRO 1/2 model file (every data-parallel rank
loads the same one) and a Lightning DDP resume read it once in all. Real gloo ranks; each rank
counts the data bytes it submits to its store's files (ckptio.testing.readcount)."""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptio
from ckptio.testing.rank_processes import run_ranks

DEADLINE_S = 3.0  # Options.rank_timeout_s of these loads
NOT_HUNG_S = 60.0


def _options(**changes: Any) -> ckptio.Options:
    return dataclasses.replace(ckptio.Options(buffer_bytes=1 << 20, pool_bytes=4 << 20),
                               rank_timeout_s=DEADLINE_S, step_timeout_s=120.0, **changes)


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {"big": torch.randn(512, 1024, generator=g),
            "mid": torch.randn(1000, 300, generator=g).to(torch.bfloat16),
            "ids": torch.randint(0, 1 << 40, (70000,), generator=g),
            "norm": {f"n{i}": torch.randn(33 + i, generator=g) for i in range(12)},
            "step": 7, "name": "run"}


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    return bool(a == b)


def _data_nbytes(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).iterdir() if f.name != "manifest.json")


def _saved(tmp_path: Path) -> str:
    path = str(tmp_path / "ck")
    ckptio.save(_state(), path, options=_options())
    return path


def _load(rank: int, world: int, path: str, how: str = "", victim: int = 1,
          mark: str = "") -> dict[str, Any]:
    """A fresh load of ``path`` on this rank (``how``: what differs) -> bytes read, the
    error (type, message), whether it is the saved state, when it ended, the warnings."""
    from ckptio.testing.readcount import count_store_reads

    count = count_store_reads()
    group: Any = torch.distributed.group.WORLD
    kwargs: dict[str, Any] = {}
    if how == "keys":
        kwargs["keys"] = ["big", "norm"]
    if how == "alone":
        group = None
    if how == "other" and rank == 1:
        path += "-other"
    if how == "saved_alone" and rank == 0:  # as Lightning's saves on rank 0
        from ckptio.distributed.dist import rank_alone_group

        ckptio.save({"x": torch.ones(3)}, path + f"-{rank}", process_group=rank_alone_group())
    if how == "user_group" and rank == 0:  # a program's own group, made on rank 0 only
        torch.distributed.new_group([0], use_local_synchronization=True)
    if how == "die" and rank == victim:
        _die_sending(mark)
    options = _options(broadcast_replicated=how != "off")
    before, error, got = count(), None, None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            got = ckptio.load(path, options=options, process_group=group, **kwargs)
        except ckptio.CkptError as exc:
            error = (type(exc).__name__, str(exc))
    want = _state()
    if how == "keys":
        want = {k: want[k] for k in ("big", "norm")}
    if how == "torch":
        want = {k: v for k, v in want.items() if isinstance(v, (torch.Tensor, dict))}
    return {"read": count() - before, "error": error, "equal": _equal(got, want),
            "ended": time.time(), "warnings": [str(w.message) for w in caught]}


def _die_sending(mark: str) -> None:
    """This rank exits as it is about to send its first message (its peer already waits)."""
    from ckptio.distributed import sendreads

    def die(sources: Any, pieces: Any) -> torch.Tensor:
        Path(mark).write_text(repr(time.time()))
        os._exit(1)

    sendreads._send_buffer = die  # type: ignore[attr-defined]


def test_a_fresh_load_over_a_group_reads_each_byte_once_in_all(tmp_path: Path) -> None:
    """2 ranks, a checkpoint one process saved: about once in all (before: once per rank),
    bitwise on both (which rank reads what is planning/shared_reads.py's)."""
    path = _saved(tmp_path)
    data = _data_nbytes(path)
    got = run_ranks(2, _load, path)
    read = [g["read"] for g in got]
    assert all(g["equal"] and g["error"] is None and not g["warnings"] for g in got), got
    assert 0.9 * data <= sum(read) <= 1.25 * data, (read, data)


def test_a_rank_that_saved_alone_first_still_shares_the_reads(tmp_path: Path) -> None:
    """Rank 0 saved alone first (rank_alone_group, as Lightning's plugin does on every save):
    the wire group is still made alike on both ranks (before: that save made a torch group of
    rank 0 alone, and the wire group's name, a hash counting the groups each process holds,
    then differed; each rank waited rank_timeout_s for the other's, then read from storage
    what it was to receive, with a warning)."""
    path = _saved(tmp_path)
    data = _data_nbytes(path)
    got = run_ranks(2, _load, path, "saved_alone")
    assert all(g["equal"] and g["error"] is None and not g["warnings"] for g in got), got
    assert sum(g["read"] for g in got) <= 1.25 * data, ([g["read"] for g in got], data)


def test_a_group_the_program_made_on_one_rank_does_not_stop_the_sharing(
        tmp_path: Path) -> None:
    """The program made a torch group on rank 0 alone (torch names the groups it registers by
    how many each process holds): the load's wire group, kept out of torch's registry
    (distributed/wiregroup.py), is made alike on both ranks all the same: no warning, no wait,
    read once in all (before: the receiver waited Options.rank_timeout_s for the sender and
    read from storage what it was to receive, warned)."""
    path = _saved(tmp_path)
    data = _data_nbytes(path)
    started = time.time()
    got = run_ranks(2, _load, path, "user_group")
    assert all(g["equal"] and g["error"] is None and not g["warnings"] for g in got), got
    assert sum(g["read"] for g in got) <= 1.25 * data, ([g["read"] for g in got], data)
    assert max(g["ended"] for g in got) - started < NOT_HUNG_S, got


def test_without_a_process_group_a_fresh_load_stays_alone(tmp_path: Path) -> None:
    """No process_group: each rank reads all of it, and a rank loading alone never waits."""
    path = _saved(tmp_path)
    data = _data_nbytes(path)
    got = run_ranks(2, _load, path, "alone")
    assert all(g["equal"] and g["error"] is None for g in got), got
    assert all(g["read"] >= 0.9 * data for g in got), ([g["read"] for g in got], data)
    started = time.time()
    got = run_ranks(2, _load_on_rank_0_only, path)
    assert got[0]["equal"] and got[0]["error"] is None, got
    assert time.time() - started < NOT_HUNG_S


def _load_on_rank_0_only(rank: int, world: int, path: str) -> dict[str, Any] | None:
    if rank == 0:
        return _load(rank, world, path, "alone")
    return None


def test_the_option_off_reads_everything_on_every_rank_still_agreeing(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    data = _data_nbytes(path)
    got = run_ranks(2, _load, path, "off")
    assert all(g["equal"] and g["error"] is None for g in got), got
    assert all(g["read"] >= 0.9 * data for g in got), ([g["read"] for g in got], data)


def test_a_damaged_checkpoint_raises_corrupt_on_every_rank(tmp_path: Path) -> None:
    """A flipped byte in a data file: the rank that reads it finds it; the rank it was to be
    sent to reads it from storage itself, so both raise CorruptCheckpointError naming it."""
    path = _saved(tmp_path)
    data = max((f for f in Path(path).iterdir() if f.name != "manifest.json"),
               key=lambda f: f.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 3] ^= 0xFF
    data.write_bytes(bytes(raw))
    got = run_ranks(2, _load, path)
    assert [g["error"][0] if g["error"] else None for g in got] == [
        "CorruptCheckpointError"] * 2, got
    assert all(path in g["error"][1] for g in got), got


def test_a_torch_save_file_is_read_once_in_all(tmp_path: Path) -> None:
    """Its tensors' records once in all (each rank still reads the zip's framing: its tail,
    where the directory lies, and the pickle; about one TAIL_NBYTES each; before: all of the
    file on each rank too)."""
    from ckptio.format.torchsave import TAIL_NBYTES

    path = str(tmp_path / "model.pt")
    torch.save({k: v for k, v in _state().items() if isinstance(v, (torch.Tensor, dict))}, path)
    size = os.path.getsize(path)
    got = run_ranks(2, _load, path, "torch")
    assert all(g["equal"] and g["error"] is None for g in got), got
    framing = TAIL_NBYTES + (64 << 10)
    read = [g["read"] for g in got]
    assert sum(read) <= 1.05 * size + 2 * framing < 2 * size, (read, size)


def test_a_keys_subset_reads_those_keys_once_in_all(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    state = _state()
    wanted = state["big"].nbytes + sum(v.nbytes for v in state["norm"].values())
    got = run_ranks(2, _load, path, "keys")
    assert all(g["equal"] and g["error"] is None for g in got), got
    assert sum(g["read"] for g in got) <= 1.3 * wanted + (64 << 10), [g["read"] for g in got]


def test_a_rank_that_dies_mid_load_is_named_by_the_others_in_bounded_time(
        tmp_path: Path) -> None:
    path, mark = _saved(tmp_path), str(tmp_path / "died")
    got = run_ranks(2, _load, path, "die", 0, mark, may_die=(0,), timeout_s=2 * NOT_HUNG_S,
                   agent_store=True)  # rank 0 reads and sends it all (the store outside it)
    died_at = float(Path(mark).read_text())
    assert got[0] is None
    kind, message = got[1]["error"]
    assert kind == "RankFailedError" and "rank 0" in message, got[1]
    assert got[1]["ended"] - died_at < NOT_HUNG_S


def test_ranks_loading_different_paths_get_a_clear_error(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    ckptio.save(_state(), path + "-other", options=_options())
    got = run_ranks(2, _load, path, "other")
    assert all(g["error"] is not None for g in got), got
    assert any("ranks disagree on the checkpoint" in g["error"][1] for g in got), got


def _reads_by_file() -> dict[str, int]:
    """Data bytes this process submits to its stores' files from now on, by file name (a
    ckptio checkpoint's data files by the checkpoint's name, a plain file by its own)."""
    from ckptio.storage.files import StoreFiles

    counted: dict[str, int] = {}
    one, many = StoreFiles.submit_read, StoreFiles.submit_reads

    def name(fh: Any) -> str:
        path = str(fh.path)
        parent = os.path.basename(os.path.dirname(path))
        return parent if parent.endswith((".pt", ".ckpt")) else os.path.basename(path)

    def submit_read(self: StoreFiles, fh: Any, offset: int, into: memoryview) -> Any:
        counted[name(fh)] = counted.get(name(fh), 0) + len(into)
        return one(self, fh, offset, into)

    def submit_reads(self: StoreFiles, fh: Any, reads: Any, each: Any) -> Any:
        counted[name(fh)] = counted.get(name(fh), 0) + sum(len(into) for _o, into in reads)
        return many(self, fh, reads, each)

    StoreFiles.submit_read = submit_read  # type: ignore[method-assign]
    StoreFiles.submit_reads = submit_reads  # type: ignore[method-assign]
    return counted


MODEL_FILE = "mp_rank_00_model_states.pt"


def _deepspeed_resume(rank: int, world: int, root: str, stages: list[int],
                      shared: bool = True) -> list[dict[str, Any]]:
    """Per ZeRO stage: train, save, train on (the uninterrupted run); a fresh engine loads the
    save through ckptio and trains on -> the model file's bytes this rank read, its size,
    and whether the resumed run matches the uninterrupted one bitwise."""
    import deepspeed_cases as cases

    import ckptio.deepspeed_engine

    out = []
    for stage in stages:
        where = os.path.join(root, f"zero{stage}")
        first = cases.engine_for(stage, world)
        ckptio.deepspeed_engine.use(first, allow_pickle=True)
        cases.train(first, cases.SAVE_AT)
        first.save_checkpoint(where)
        want = {**cases.snapshot(first), "losses": cases.train(first, cases.MORE)}
        first.destroy()
        engine = cases.engine_for(stage, world)
        ours = ckptio.deepspeed_engine.use(engine, allow_pickle=True)
        if not shared:  # as before: each rank loads every file alone
            from ckptio.distributed.dist import rank_alone_group

            ours.load_group = lambda path: rank_alone_group()
        counted = _reads_by_file()
        engine.load_checkpoint(where)
        read = dict(counted)
        got = {**cases.snapshot(engine), "losses": cases.train(engine, cases.MORE)}
        tag = os.path.join(where, f"global_step{cases.SAVE_AT}", MODEL_FILE)
        out.append({"stage": stage, "read": read.get(MODEL_FILE, 0), "size": _data_nbytes(tag),
                    "bitwise": _equal(_flat_snapshot(got), _flat_snapshot(want))})
        torch.distributed.barrier()
        engine.destroy()
    return out


def _flat_snapshot(snap: dict[str, Any]) -> dict[str, Any]:
    out = {f"param{i}": p for i, p in enumerate(snap["params"])}
    out.update({f"optimizer{k}": v for k, v in snap["optimizer"]})
    out["losses"] = torch.tensor(snap["losses"], dtype=torch.float64)
    out["step"] = snap["step"]
    return out


def test_a_deepspeed_zero_0_1_2_resume_reads_the_model_file_once_in_all(tmp_path: Path) -> None:
    """Both data-parallel ranks load mp_rank_00_model_states.pt (ZeRO 0: the optimizer's
    state in it too): read once in all (before: once per rank), and the resume is bitwise
    the uninterrupted run."""
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (its extra has it)")
    got = run_ranks(2, _deepspeed_resume, str(tmp_path), [0, 1, 2], timeout_s=240)
    for stage in (0, 1, 2):
        both = [got[0][stage], got[1][stage]]
        assert all(s["bitwise"] for s in both), both
        size = both[0]["size"]
        assert 0.9 * size <= sum(s["read"] for s in both) <= 1.25 * size, both


def _lightning_resume(rank: int, world: int, root: str, shared: bool = True) -> dict[str, Any]:
    """Lightning DDP (the ranks made here, as under torchrun): fit 3 epochs; fit again from
    the checkpoint of epoch 0 -> the bytes this rank read of it, its size, and whether the
    resumed run ends bitwise where the uninterrupted one did."""
    import sys

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world),
                      RANK=str(rank))  # launched outside Lightning: it starts no process
    sys.path.insert(0, str(Path(__file__).parent / "integrations"))
    import lightning as L
    import lightning_job as job
    from lightning.pytorch.callbacks import ModelCheckpoint

    def fit(into: str, ckpt_path: str | None = None) -> dict[str, torch.Tensor]:
        L.seed_everything(0, verbose=False)
        model = job.Tiny(width=2048)
        trainer = L.Trainer(max_epochs=3, accelerator="cpu", devices=world, strategy="ddp",
                            enable_progress_bar=False, logger=False, deterministic=True,
                            enable_model_summary=False, num_sanity_val_steps=0,
                            plugins=[job.plugin("sync", shared_loads=shared)],
                            default_root_dir=into,
                            callbacks=[ModelCheckpoint(dirpath=into, save_top_k=-1)])
        trainer.fit(model, job.data(32, seed=1), job.data(8, seed=2), ckpt_path=ckpt_path)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    want = fit(os.path.join(root, "a"))
    first = min(Path(root, "a").glob("epoch=0-*.ckpt"))
    counted = _reads_by_file()
    got = fit(os.path.join(root, "b"), str(first))
    return {"read": counted.get(first.name, 0), "size": _data_nbytes(str(first)),
            "bitwise": _equal(got, want)}


def test_a_lightning_ddp_resume_reads_the_checkpoint_once_in_all(tmp_path: Path) -> None:
    """Lightning calls load_checkpoint on every rank at a resume: read once in all (before:
    once per rank), and the resumed run is bitwise the uninterrupted one."""
    pytest.importorskip("lightning")
    got = run_ranks(2, _lightning_resume, str(tmp_path), timeout_s=240)
    assert all(g["bitwise"] for g in got), got
    size = got[0]["size"]
    assert 0.9 * size <= sum(g["read"] for g in got) <= 1.25 * size, got


def _lightning_load_on_rank_0(rank: int, world: int, path: str) -> dict[str, Any]:
    """The plugin's load_checkpoint called on rank 0 only: with its defaults, then with
    shared_loads=False -> the first's error and seconds, whether the second loaded; then on
    both ranks: whether each loaded, the bytes read."""
    import ckptio.lightning

    out = None
    if rank == 0:
        started = time.monotonic()
        try:
            ckptio.lightning.CheckpointIO(_options()).load_checkpoint(path)
            error = None
        except ckptio.CkptError as exc:
            error = (type(exc).__name__, str(exc))
        seconds = time.monotonic() - started
        alone = ckptio.lightning.CheckpointIO(_options(), shared_loads=False)
        out = {"error": error, "seconds": seconds,
               "alone": _equal(alone.load_checkpoint(path), _state())}
    torch.distributed.barrier()
    count = _reads_by_file()
    both = _equal(ckptio.lightning.CheckpointIO(_options()).load_checkpoint(path), _state())
    return {**(out or {}), "both": both, "read": sum(count.values())}


def test_a_lightning_load_on_one_rank_only_ends_in_an_error_naming_the_switch(
        tmp_path: Path) -> None:
    """A call on rank 0 alone (a user's own): a RankFailedError naming rank 1 and
    shared_loads=False within Options.rank_timeout_s (the plugin checks every rank has come
    before the load's steps, which tell a rank that never joins from a slow one only after
    step_timeout_s); with shared_loads=False it loads alone. Then a load on both ranks with
    the same plugin still works (the failed arrival taken back)."""
    pytest.importorskip("lightning")
    path = _saved(tmp_path)
    got = run_ranks(2, _lightning_load_on_rank_0, path, timeout_s=120)
    kind, message = got[0]["error"]
    assert kind == "RankFailedError" and "shared_loads=False" in message, got[0]
    assert "rank(s) [1]" in message, message
    assert DEADLINE_S <= got[0]["seconds"] < 2 * DEADLINE_S, got[0]
    assert got[0]["alone"], got[0]
    assert got[0]["both"] and got[1]["both"], got
    assert sum(g["read"] for g in got) <= 1.25 * _data_nbytes(path), got


@pytest.mark.slow
def test_round_ten_counts(tmp_path: Path) -> None:
    """docs/BENCH_RESTART.md, round ten: the data bytes each of 2 ranks reads, each load as
    before (every rank alone: no process_group, the DeepSpeed engine's files loaded alone,
    shared_loads=False) and now; printed (``pytest -s``) as the table's rows."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("lightning")
    path = _saved(tmp_path)
    rows = [("ckptio.load fresh, process_group=WORLD", _data_nbytes(path),
             [g["read"] for g in run_ranks(2, _load, path, "alone")],
             [g["read"] for g in run_ranks(2, _load, path)])]
    ds = [run_ranks(2, _deepspeed_resume, str(tmp_path / f"ds-{shared}"), [1, 2], shared,
                    timeout_s=240) for shared in (False, True)]
    for i, stage in enumerate((1, 2)):
        rows.append((f"DeepSpeed ZeRO {stage}, {MODEL_FILE}", ds[1][0][i]["size"],
                     [r[i]["read"] for r in ds[0]], [r[i]["read"] for r in ds[1]]))
    pl = [run_ranks(2, _lightning_resume, str(tmp_path / f"pl-{shared}"), shared,
                    timeout_s=240) for shared in (False, True)]
    rows.append(("Lightning DDP resume (Trainer.fit(ckpt_path=))", pl[1][0]["size"],
                 [g["read"] for g in pl[0]], [g["read"] for g in pl[1]]))
    for name, size, before, after in rows:
        print(f"| {name} | {size:,} | {before[0]:,} / {before[1]:,} | "
              f"**{after[0]:,} / {after[1]:,}** |")
        assert sum(before) >= 1.9 * size and sum(after) <= 1.25 * size, (name, before, after)


def _lightning_load_last(rank: int, world: int, root: str) -> dict[str, Any]:
    """Both ranks load an uncommitted last.ckpt through the plugin (shared loads): the newest
    committed checkpoint beside it instead, on both, read once in all."""
    import ckptio.lightning

    count = _reads_by_file()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = ckptio.lightning.CheckpointIO(_options()).load_checkpoint(
            os.path.join(root, "last.ckpt"))
    return {"equal": _equal(got, _state()), "read": count.get("epoch=1.ckpt", 0),
            "warned": any("never committed" in str(w.message) for w in caught)}


def test_a_shared_lightning_load_of_an_uncommitted_last_falls_back_on_every_rank(
        tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    for name in ("epoch=0.ckpt", "epoch=1.ckpt", "last.ckpt"):
        ckptio.save(_state() if name != "epoch=0.ckpt" else {"old": torch.ones(2)},
                    str(tmp_path / name), options=_options())
        time.sleep(0.05)  # distinct commit times
    (tmp_path / "last.ckpt" / "manifest.json").unlink()  # killed before its commit
    got = run_ranks(2, _lightning_load_last, str(tmp_path), timeout_s=120)
    assert all(g["equal"] and g["warned"] for g in got), got
    size = _data_nbytes(str(tmp_path / "epoch=1.ckpt"))
    assert sum(g["read"] for g in got) <= 1.25 * size, got


def _deepspeed_load_on_rank_0(rank: int, world: int, root: str) -> dict[str, Any]:
    """ZeRO 1 on both ranks; then load_checkpoint on rank 0 only (DeepSpeed's ZeRO 1/2 load has
    no collective of its own) -> whether it loaded the saved state, its seconds and warnings."""
    import deepspeed_cases as cases

    import ckptio.deepspeed_engine

    first = cases.engine_for(1, world)
    ckptio.deepspeed_engine.use(first, allow_pickle=True)
    cases.train(first, cases.SAVE_AT)
    first.save_checkpoint(root)
    want = _flat_snapshot({**cases.snapshot(first), "losses": []})
    first.destroy()
    engine = cases.engine_for(1, world)
    ckptio.deepspeed_engine.use(engine, allow_pickle=True, options=_options())
    out: dict[str, Any] = {}
    if rank == 0:
        started = time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.load_checkpoint(root)
        out = {"seconds": time.monotonic() - started, "warnings": [str(w.message) for w in caught],
               "equal": _equal(_flat_snapshot({**cases.snapshot(engine), "losses": []}), want)}
    torch.distributed.barrier()
    engine.destroy()
    return out


def test_a_deepspeed_load_on_one_rank_only_loads_alone_after_the_deadline(tmp_path: Path) -> None:
    """The model file's shared load waits Options.rank_timeout_s for the other rank, then loads
    alone, warning, instead of waiting step_timeout_s and failing."""
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (its extra has it)")
    got = run_ranks(2, _deepspeed_load_on_rank_0, str(tmp_path), timeout_s=240)[0]
    assert got["equal"], got
    assert DEADLINE_S <= got["seconds"] < 4 * DEADLINE_S, got
    assert any("loaded by this rank alone: rank(s) [1]" in w for w in got["warnings"]), got


def _arrivals(rank: int, world: int) -> list[Any]:
    """Checks of one name: rank 0 alone, both, rank 1 alone, both twice -> what each returned
    on this rank (a rank not in a check: "-"), with a barrier between checks."""
    from ckptio.distributed.arrival import arrive

    out: list[Any] = []
    for who in ({0}, {0, 1}, {1}, {0, 1}, {0, 1}):
        got = arrive(torch.distributed.group.WORLD, "test", 1.0) if rank in who else "-"
        out.append(list(got) if isinstance(got, tuple) else got)
        torch.distributed.barrier()
    return out


def test_arrival_checks_missed_by_a_rank_do_not_throw_the_later_ones_out_of_step() -> None:
    """A check one rank made alone fails naming the other; the next check of both passes at
    once on both (the rounds stay in step)."""
    got = run_ranks(2, _arrivals)
    assert got == [[[1], None, "-", None, None], ["-", None, [0], None, None]], got
