"""ckptio.deepspeed_engine with real DeepSpeed engines (its CPU accelerator, 2 gloo ranks, a
small model with Adam and a WarmupLR scheduler): ZeRO stage 1, 2 and 3, sync and decoupled,
saved through ckptio and resumed by a fresh job bitwise (parameters, optimizer and scheduler
state, the losses that follow); a job killed during a save resumes from the tag DeepSpeed's
'latest' names; loading on fewer ranks is what DeepSpeed allows. Skipped where DeepSpeed is not
installed (pip install --no-deps deepspeed==0.19.8 and its needs: the deepspeed extra).
The DeepSpeed jobs of the file run once (a module fixture); each test checks one thing."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptio

os.environ.setdefault("DS_ACCELERATOR", "cpu")
pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install --no-deps "
                    "deepspeed==0.19.8 and the deepspeed extra's needs)")
import deepspeed_cases as cases  # noqa: E402 - after the skip
from deepspeed.runtime.checkpoint_engine import CheckpointCommitInfo  # noqa: E402

from ckptio.deepspeed_engine import CkptioCheckpointEngine, use  # noqa: E402
from ckptio.testing.faultfs import fuse_unusable  # noqa: E402
from ckptio.testing.rank_processes import run_ranks  # noqa: E402

RUNS = [(1, False), (2, True), (3, False), (3, True)]  # (ZeRO stage, decoupled)
KILLED = [(2, True), (3, False)]
IDS = [f"zero{s}-{'decoupled' if d else 'sync'}" for s, d in RUNS]
LIMIT_S = 300


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The saving jobs (one uninterrupted per RUNS entry; one killed per KILLED entry, at the
    same time), then one fresh job resuming all of them, then one on a single rank."""
    root = tmp_path_factory.mktemp("deepspeed")
    killed = cases.start_killed_job(str(root / "killed"), KILLED)
    try:
        saved = run_ranks(2, cases.save_each, str(root / "runs"), RUNS, timeout_s=LIMIT_S)
    finally:
        codes = [p.wait(timeout=LIMIT_S) for p in killed]
    logs = [(root / f"killed.rank{r}.log").read_text(errors="replace")[-3000:] for r in (0, 1)]
    assert codes == [-9, -9], f"the killed job ended with {codes}, not SIGKILL:\n{logs}"
    resumes = ([(str(root / "runs" / str(i)), s, None) for i, (s, _) in enumerate(RUNS)]
               + [(str(root / "killed" / str(i)), s, None) for i, (s, _) in enumerate(KILLED)]
               + [(str(root / "killed" / "1"), KILLED[1][0], "global_step5")])
    resumed = run_ranks(2, cases.resume_each, resumes, timeout_s=LIMIT_S)
    one = run_ranks(1, cases.resume_each, resumes[:len(RUNS)], timeout_s=LIMIT_S)[0]
    return {"root": root, "saved": saved, "resumed": resumed, "one": one}


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["losses"] == b["losses"]
    assert a["step"] == b["step"] == cases.SAVE_AT + cases.MORE
    assert len(a["params"]) == len(b["params"])
    for x, y in zip(a["params"], b["params"]):
        assert torch.equal(x, y)
    assert [k for k, _ in a["optimizer"]] == [k for k, _ in b["optimizer"]]
    for (key, x), (_, y) in zip(a["optimizer"], b["optimizer"]):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, key
    assert a["scheduler"] == b["scheduler"]


@pytest.mark.parametrize("i", range(len(RUNS)), ids=IDS)
def test_resume_is_bitwise(jobs: dict[str, Any], i: int) -> None:
    """A fresh job loads the tag through ckptio and trains on exactly as the saving job did."""
    for rank in (0, 1):
        got = jobs["resumed"][rank][i]
        assert not isinstance(got, str), got
        assert "global_step3" in got["loaded"]
        _same(jobs["saved"][rank][i], got)


@pytest.mark.parametrize("i", range(len(RUNS)), ids=IDS)
def test_files_are_ckptio_checkpoints(jobs: dict[str, Any], i: int) -> None:
    """Every file DeepSpeed wrote for the tag is a committed ckptio checkpoint (a directory)
    whose tensors load without unpickling anything: only DeepSpeed's loss scaler and
    param_slice_mappings (small Python objects) are stored pickled."""
    tag = jobs["root"] / "runs" / str(i) / "global_step3"
    files = sorted(tag.iterdir())
    assert len(files) == (4 if RUNS[i][0] == 3 else 3)
    pickled = ("optimizer_state_dict.loss_scaler", "optimizer_state_dict.param_slice_mappings")
    for path in files:
        assert path.is_dir() and (path / "manifest.json").is_file(), path
        ckptio.Checkpointer().verify(path)
        state = ckptio.load(path, keys=lambda k: not k.startswith(pickled))
        assert any(isinstance(v, torch.Tensor) for _, v in cases.flat(state)), path


@pytest.mark.parametrize("k", range(len(KILLED)), ids=["decoupled-uncommitted", "sync-mid-tag"])
def test_killed_job_resumes_from_latest(jobs: dict[str, Any], k: int) -> None:
    """Killed while saving global_step5 (decoupled: after save_checkpoint returned, before the
    next step committed it; sync: between two files of the tag): 'latest' still names
    global_step3, and a fresh job resumes from it bitwise."""
    root = jobs["root"] / "killed" / str(k)
    assert (root / "latest").read_text() == "global_step3"
    assert (root / "global_step5").is_dir()
    reference = RUNS.index(KILLED[k])
    for rank in (0, 1):
        got = jobs["resumed"][rank][len(RUNS) + k]
        assert not isinstance(got, str), got
        assert "global_step3" in got["loaded"]
        _same(jobs["saved"][rank][reference], got)


def test_partial_tag_is_refused(jobs: dict[str, Any]) -> None:
    """Asking for the tag the kill cut short: ckptio's CheckpointNotFoundError naming the file
    that was never written, on every rank."""
    for rank in (0, 1):
        said = jobs["resumed"][rank][-1]
        assert said.startswith("ckptio.errors.CheckpointNotFoundError"), said
        assert f"global_step5/zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" in said


@pytest.mark.parametrize("i", range(len(RUNS)), ids=IDS)
def test_fewer_ranks_is_deepspeeds_refusal(jobs: dict[str, Any], i: int) -> None:
    """2 ranks -> 1: DeepSpeed itself refuses ZeRO's partitioned optimizer state on another
    data-parallel size (with any engine; its universal checkpointing is the way). ZeRO-3 (a
    model file per rank) is refused by use()'s load guard first, alike on every rank (on more
    ranks DeepSpeed's own check fails on a rank without a file as an empty AssertionError)."""
    said = jobs["one"][i]
    if RUNS[i][0] == 3:
        assert said.startswith("UnsupportedStateError"), said
        assert "saved by 2 data-parallel ranks" in said and "this job has 1" in said, said
        return
    assert isinstance(said, str) and "ZeRORuntimeException" in said, said
    assert "DP world size of 2 but the current world size is 1" in said


@pytest.mark.parametrize("i", [i for i, (_, d) in enumerate(RUNS) if d],
                         ids=[n for n, (_, d) in zip(IDS, RUNS) if d])
def test_commit_now_commits_a_last_decoupled_save(jobs: dict[str, Any], i: int) -> None:
    """A decoupled save after the last step, then commit_now: 'latest' names it (DeepSpeed's
    destroy() alone would leave it uncommitted), and every file of it is committed."""
    final = jobs["root"] / "runs" / f"{i}-final"
    tag = f"global_step{cases.SAVE_AT + cases.MORE}"
    assert (final / "latest").read_text() == tag
    assert all((f / "manifest.json").is_file() for f in (final / tag).iterdir())


def test_deepspeeds_offline_tools_read_a_converted_copy(jobs: dict[str, Any],
                                                        tmp_path: Path) -> None:
    """to_torch_save: a copy with torch.save files, which zero_to_fp32 (torch.load inside)
    consolidates: the ZeRO-3 run's weights at step 3, within float rounding of the ZeRO-1 run's
    (the same training, other reduction order)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from ckptio.deepspeed_engine import to_torch_save

    zero3 = RUNS.index((3, False))
    out = to_torch_save(jobs["root"] / "runs" / str(zero3), tmp_path / "torch")
    assert (Path(out) / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").is_file()
    whole = get_fp32_state_dict_from_zero_checkpoint(out)
    zero1 = jobs["root"] / "runs" / str(RUNS.index((1, False))) / "global_step3"
    reference = ckptio.load(zero1 / "mp_rank_00_model_states.pt", allow_pickle=True)["module"]
    assert whole.keys() == reference.keys()
    for key, value in whole.items():
        torch.testing.assert_close(value, reference[key], rtol=0, atol=1e-6)
    with pytest.raises(ckptio.CkptError, match="exists"):
        to_torch_save(jobs["root"] / "runs" / str(zero3), out)


def _info(tmp_path: Path, tag: str = "t1") -> CheckpointCommitInfo:
    return CheckpointCommitInfo(tag=tag, save_dir=str(tmp_path), save_latest=True)


@pytest.mark.parametrize("decoupled", [False, True], ids=["sync", "decoupled"])
def test_engine_contract_in_one_process(tmp_path: Path, decoupled: bool) -> None:
    """create / save / commit / load as DeepSpeed calls them: a view is stored as its own bytes
    (no clone needed: preserves_storage_sharing is False), a decoupled tag is reported by
    get_commit_info until committed, and the state comes back equal."""
    engine = CkptioCheckpointEngine(decoupled=decoupled)
    big = torch.arange(1 << 20, dtype=torch.float32)
    state = {"module": {"w": big[:16].view(4, 4)}, "step": 3, "ds_version": "0.19.8"}
    info = _info(tmp_path)
    engine.create(info)
    path = str(tmp_path / "t1" / "mp_rank_00_model_states.pt")
    engine.save(state_dict=state, path=path)
    assert engine.is_decoupled() is decoupled and not engine.preserves_storage_sharing()
    assert engine.get_commit_info() == (info if decoupled else None)
    assert engine.commit(info) is True and engine.get_commit_info() is None
    stored = sum(f.stat().st_size for f in Path(path).iterdir())
    assert stored < big.numel() * 4 // 16, stored
    loaded = engine.load(path, map_location=torch.device("cpu"))
    assert torch.equal(loaded["module"]["w"], big[:16].view(4, 4))
    assert loaded["step"] == 3 and loaded["ds_version"] == "0.19.8"
    engine.cleanup()


def test_reads_deepspeeds_torch_engine_files(tmp_path: Path) -> None:
    """A tag DeepSpeed's default engine wrote (torch.save, zip format) loads through ours, so a
    job can switch engines between tags."""
    path = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.ones(3)}, "global_steps": 7}, path)
    loaded = CkptioCheckpointEngine().load(str(path), map_location="cpu")
    assert torch.equal(loaded["module"]["w"], torch.ones(3)) and loaded["global_steps"] == 7


def test_pickle_refused_names_the_fix(tmp_path: Path) -> None:
    """Without the caller's opt-in (allow_pickle, off by default) a DeepSpeed object (here a
    dataclass like its loss scaler) is refused with a CkptError naming the key and the switch;
    nothing is committed. Sync, as DeepSpeed calls it: the refusal is raised by the tag's
    commit (once every rank knows), and the tag's later files are not written."""
    engine = CkptioCheckpointEngine()
    engine.create(_info(tmp_path, "t"))
    path = tmp_path / "t" / "optim_states.pt"
    engine.save({"loss_scaler": _info(tmp_path), "w": torch.ones(2)}, str(path))
    engine.save({"w": torch.ones(2)}, str(tmp_path / "t" / "later.pt"))
    with pytest.raises(ckptio.UnsupportedStateError, match=r"loss_scaler[\s\S]*allow_pickle"):
        engine.commit(_info(tmp_path, "t"))
    assert not (path / "manifest.json").exists() and not (tmp_path / "t" / "later.pt").exists()


def test_use_takes_a_deepspeed_engine() -> None:
    with pytest.raises(ckptio.CkptError, match="deepspeed.initialize"):
        use(torch.nn.Linear(2, 2))


def test_zero3_weights_without_optimizer_states_load_straight_and_from_a_copy(
        tmp_path: Path) -> None:
    """ZeRO-3 load_checkpoint(load_optimizer_states=False) is read by DeepSpeed's zero_to_fp32
    (torch.load of each file, not the checkpoint engine): ckptio's files are read through
    ckptio for it, and the weights load bitwise, as from a to_torch_save copy
    (tests/test_rt_dsown.py: two ranks, load_module_only)."""
    got = run_ranks(1, cases.zero3_weights_only, str(tmp_path / "z3"), timeout_s=LIMIT_S)[0]
    assert got["straight"] is True, got
    assert got["from_copy"] is True, got


@pytest.mark.parametrize("decoupled", [False, True], ids=["sync", "decoupled"])
def test_save_16bit_model_writes_the_torch_save_file_its_readers_expect(
        tmp_path: Path, decoupled: bool) -> None:
    """``engine.save_16bit_model(dir)`` (an export for torch.load and from_pretrained, outside
    any tag folder): ``dir/pytorch_model.bin`` is a torch.save file of the module's weights, as
    DeepSpeed's own engine writes it; it was a ckptio directory, which they cannot read. The
    folder holds that file alone: it also got the run lease (.ckptio-run.lease, held until
    destroy) that a save_checkpoint's directory gets, which went along into uploads."""
    assert run_ranks(1, cases.save_16bit, str(tmp_path / "export"), decoupled,
                     timeout_s=LIMIT_S) == [True]


def test_a_second_job_on_one_save_dir_is_refused_on_every_rank(tmp_path: Path) -> None:
    """A job (this process) holds save_dir's run lease from its first save_checkpoint: a second
    job's save_checkpoint there raises CheckpointLockedError on both its ranks, naming this
    process, before any rank writes a file; with take_over=True it saves, and this job's next
    save there is refused, naming the one that took over."""
    holder = CkptioCheckpointEngine()
    holder.create(_info(tmp_path, "mine"))
    try:
        got = run_ranks(2, cases.second_job, str(tmp_path), False, timeout_s=LIMIT_S)
        for rank, result in enumerate(got):
            kind, message = result["error"]
            assert kind == "CheckpointLockedError", result
            assert f"pid {os.getpid()}" in message and "take_over=True" in message, message
            assert message.startswith("rank 0: ") == (rank == 1), message
            assert not [t for t in result["there"] if t.startswith("global_step")], result
        taken = run_ranks(1, cases.second_job, str(tmp_path), True, timeout_s=LIMIT_S)[0]
        assert taken["error"] is None and "global_step1" in taken["there"], taken
        with pytest.raises(ckptio.CheckpointLockedError, match="taken over"):
            holder.create(_info(tmp_path, "mine2"))
    finally:
        holder.cleanup()


def test_a_url_as_save_or_load_dir_is_refused_on_every_rank_and_makes_no_local_folder(
        tmp_path: Path) -> None:
    """DeepSpeed reaches 'latest' and its tag folders with local file calls: ``s3://bucket/run``
    wrote the tensors to the bucket and 'latest' into a local folder ``s3:/bucket/run``, where a
    restart elsewhere finds nothing. Now both calls raise UnsupportedPathError on every rank
    naming the URL, and nothing is made in the working directory; ``shm://`` names its folder."""
    got = run_ranks(2, cases.url_dirs, str(tmp_path), timeout_s=LIMIT_S)
    for result in got:
        for (kind, message), call in zip(result, ("save_checkpoint", "load_checkpoint")):
            assert kind == "UnsupportedPathError", result
            assert message.startswith(f"{call} s3://bucket/run: ") and "NFS" in message, message
    assert not list(tmp_path.iterdir())
    with pytest.raises(ckptio.UnsupportedPathError, match=r"give the folder it names, /dev/shm"):
        CkptioCheckpointEngine().create(CheckpointCommitInfo(tag="t", save_dir="shm://run",
                                                             save_latest=True))


@pytest.mark.skipif(fuse_unusable() is not None, reason=str(fuse_unusable()))
def test_a_write_failing_on_one_rank_fails_the_save_on_every_rank_at_once(fs: Any) -> None:
    """ZeRO 1, sync, 2 ranks: the kernel fails rank 1's fsync of its optimizer file (EIO, a
    FUSE file system). Rank 1's save_checkpoint raises the StorageIOError and rank 0's a
    RankFailedError naming rank 1 and it, within seconds (before: rank 1 raised at once and,
    training on, left rank 0 waiting in the commit for Options.step_timeout_s); 'latest' is
    not moved to the failed tag, and the next save of both goes through."""
    fs.fail("fsync", r"zero_pp_rank_1_mp_rank_00_optim_states\.pt/data-")
    got = run_ranks(2, cases.save_into_faults, str(fs.mountpoint / "run"), timeout_s=LIMIT_S)
    (kind0, said0), (kind1, said1) = got[0]["error"], got[1]["error"]
    assert kind1 == "StorageIOError" and "Input/output error" in said1, said1
    assert kind0 == "RankFailedError" and "rank(s) [1]" in said0 and "Input/output" in said0
    assert "'latest' still names the tag before" in said0
    assert max(g["seconds"] for g in got) < 30, got
    assert [g["latest"] for g in got] == ["global_step2"] * 2
    assert len(fs.fired()) == 1
