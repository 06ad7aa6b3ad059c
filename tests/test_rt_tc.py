"""A torch_checkpointing user moving to ckptio, against its checkpoints as its CheckpointManager
writes them (tests/test_tc_checkpoints.py has the bitwise loads on 1, 2 and 4 ranks).

- A ckptio CheckpointManager pointed at that run's directory (``step-N`` folders of its files,
  no ckptio manifest) lists them as incomplete saves: restore() must not start fresh saying
  nothing was ever committed, but name the step and its load or convert.
- A directory still under its save's temporary name (``tmp_NAME``, renamed at its commit) may
  hold some ranks' or items' files only: ckptio.load and ``ckptio verify`` refuse it, naming the
  final name, while the committed one loads bitwise.
- Damage (a truncated or emptied file, a flipped byte in a record) is a CkptError naming the file.
- The same on an S3 prefix (SeaweedFS, skipped without it): its steps are told apart by the
  listing the manager makes anyway, never a listing per step (a run of many interrupted steps).
"""

from __future__ import annotations

import json
import os
import pickle
import uuid
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torch_checkpointing", reason="torch-checkpointing is not installed")

import ckptio  # noqa: E402
from ckptio.testing.cli_process import run_cli  # noqa: E402
from ckptio.testing.rank_processes import run_ranks  # noqa: E402
from ckptio.testing.s3proxy import FaultProxy  # noqa: E402
from ckptio.testing.s3server import SeaweedServer, ServerError, make_client, weed_binary  # noqa: E402
from ckptio.testing.tc_peer import manager  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}


def _build(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return {"model": model, "optim": opt, "sched": torch.optim.lr_scheduler.StepLR(opt, 2)}


def _train(state: dict[str, Any], steps: int) -> None:
    for _ in range(steps):
        state["model"](torch.randn(2, 8)).sum().backward()
        state["optim"].step()
        state["optim"].zero_grad()
        state["sched"].step()


def _tc_save(paths: list[Path], state: dict[str, Any]) -> None:
    """Its CheckpointManager's synchronous save, as its docs show, of each path."""
    tc = manager()
    try:
        for path in paths:
            tc.save(str(path), {k: v.state_dict() for k, v in state.items()})
    finally:
        tc.close()


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("tcrun")
    state = _build(0)
    _train(state, 3)
    _tc_save([root / "step-100", root / "step-200"], state)
    return {"root": root, "state": state}


def test_manager_restore_over_its_steps_names_them_not_a_fresh_start(run, tmp_path) -> None:
    shutil.copytree(run["root"], tmp_path / "run")
    mgr = ckptio.CheckpointManager(tmp_path / "run")
    state = _build(1)
    try:
        with pytest.raises(ckptio.CkptError) as caught:
            mgr.restore(state)
        said = str(caught.value)
        assert "step-200" in said and "torch_checkpointing" in said, said
        assert "ckptio.load(" in said and "ckptio convert" in said, said
        assert "restore(state, step=200)" in said, said  # the third fix it names works
        assert mgr.restore(state, step=200) == 200
        assert torch.equal(state["model"].weight, run["state"]["model"].weight)
        mgr.save(201, state)
    finally:
        mgr.close()
    for step in (100, 200):  # its files left as they were
        assert sorted(os.listdir(tmp_path / "run" / f"step-{step}")) == [
            "model_0.pt", "optim_0.pt", "sched_0.pt"]


def test_ls_and_status_name_its_steps_not_interrupted_saves(run, tmp_path) -> None:
    shutil.copytree(run["root"], tmp_path / "run")
    os.makedirs(tmp_path / "run" / "step-300")  # an interrupted save beside them
    listed = run_cli("ls", str(tmp_path / "run"), env=ENV, timeout=120)
    assert listed.returncode == 0, listed.stderr
    head, *rows = listed.stdout.splitlines()
    assert "1 incomplete" in head and "2 holding a torch_checkpointing checkpoint" in head, head
    states = {line.split()[0]: line.split()[1] for line in rows[1:]}
    assert states == {"100": "torch_checkpointing", "200": "torch_checkpointing",
                      "300": "incomplete"}, listed.stdout
    status = run_cli("status", str(tmp_path / "run"), "--json", env=ENV, timeout=120)
    assert status.returncode == 0, status.stderr
    tier = json.loads(status.stdout)["tiers"][0]
    assert tier["incomplete"] == [300] and tier["torch_checkpointing"] == [100, 200], tier


def test_loading_the_run_directory_names_its_steps_and_the_ways_to_load_them(run) -> None:
    """ckptio.load(RUN) of a run of its steps said "holds no ckptio checkpoint" and listed the
    names; now it says they are torch_checkpointing checkpoints and how to load them."""
    with pytest.raises(ckptio.CheckpointNotFoundError) as caught:
        ckptio.load(run["root"])
    message = str(caught.value)
    assert "holds 2 torch_checkpointing checkpoints (step-100, step-200)" in message
    assert "e.g. .../step-200; ckptio.load reads its files" in message
    assert "ckptio.CheckpointManager" in message


def test_its_steps_convert_into_a_run_the_manager_restores_bitwise(run, tmp_path) -> None:
    done = run_cli("convert", str(run["root"] / "step-200"), str(tmp_path / "new" / "step-200"),
                   env=ENV, timeout=120)
    assert done.returncode == 0, done.stderr
    state = _build(1)
    with ckptio.CheckpointManager(tmp_path / "new") as mgr:
        assert mgr.restore(state) == 200
    want = run["state"]
    for a, b in zip(state["model"].parameters(), want["model"].parameters()):
        assert torch.equal(a, b)
    assert state["sched"].state_dict() == want["sched"].state_dict()
    got, exp = state["optim"].state_dict()["state"], want["optim"].state_dict()["state"]
    assert all(torch.equal(got[k][n], exp[k][n]) for k in exp for n in exp[k])


def test_a_tmp_dir_of_a_save_not_committed_is_refused(run, tmp_path) -> None:
    """A 2-rank save whose rank 1 has not written yet looks like a whole 1-rank checkpoint."""
    partial = tmp_path / "tmp_step-300"
    shutil.copytree(run["root"] / "step-200", partial)
    (partial / "optim_0.pt").unlink()
    shutil.copytree(run["root"] / "step-200", tmp_path / "tmp_step-400")
    for name in ("tmp_step-300", "tmp_step-400"):
        with pytest.raises(ckptio.CheckpointNotFoundError, match=rf"{name}.*step-{name[-3:]}"
                           r".*rename it to"):
            ckptio.load(tmp_path / name, {"model": _build(1)["model"]}, strict=False)
    done = run_cli("verify", str(tmp_path / "tmp_step-400"), env=ENV, timeout=120)
    assert done.returncode != 0 and "tmp_step-400" in done.stderr, (done.stdout, done.stderr)
    (tmp_path / "tmp_step-400").rename(tmp_path / "step-400")  # the fix the message names
    state = _build(1)
    ckptio.load(tmp_path / "step-400", state)
    assert torch.equal(state["model"].weight, run["state"]["model"].weight)


@pytest.mark.parametrize("damage", ["truncated", "emptied", "flipped"])
def test_a_damaged_file_is_named(run, tmp_path, damage: str) -> None:
    where = tmp_path / "step-200"
    shutil.copytree(run["root"] / "step-200", where)
    file = where / "optim_0.pt"
    data = bytearray(file.read_bytes())
    if damage == "flipped":
        data[100] ^= 1  # in its data.pkl record
    file.write_bytes(bytes(data[:len(data) // 2] if damage == "truncated" else
                           b"" if damage == "emptied" else data))
    with pytest.raises(ckptio.CkptError, match="optim_0.pt"):
        ckptio.load(where, _build(1))


def test_a_manager_save_into_its_step_is_refused_and_retention_leaves_it(run, tmp_path) -> None:
    """Before: the save wrote beside its model_0.pt..., committed, and keep_last=1 then deleted
    the step with the user's torch_checkpointing files in it."""
    shutil.copytree(run["root"], tmp_path / "run")
    state = _build(1)
    with ckptio.CheckpointManager(tmp_path / "run", keep_last=1) as mgr:
        with pytest.raises(ckptio.CkptError, match=r"step-200 holds a torch_checkpointing"):
            mgr.save(200, state)
        for step in (201, 202):
            mgr.save(step, state)
        assert mgr.steps() == [202]
    for step in (100, 200):
        assert sorted(os.listdir(tmp_path / "run" / f"step-{step}")) == [
            "model_0.pt", "optim_0.pt", "sched_0.pt"]


class _Runs:
    """Unpickled, it would run ``exec`` writing a file."""

    def __init__(self, flag: Path) -> None:
        self.flag = flag

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({str(self.flag)!r}, 'w').close()",))


def test_a_file_that_would_run_code_is_refused_with_a_fix_that_applies(run, tmp_path) -> None:
    """Before: the refusal said 'pass allow_pickle=True', which refuses the same way here."""
    where, flag = tmp_path / "step-200", tmp_path / "ran"
    shutil.copytree(run["root"] / "step-200", where)
    rewritten = tmp_path / "sched_0.pt"
    with zipfile.ZipFile(where / "sched_0.pt") as src, \
            zipfile.ZipFile(rewritten, "w", zipfile.ZIP_STORED) as out:
        for info in src.infolist():
            data = src.read(info)
            out.writestr(info, pickle.dumps({"x": _Runs(flag)}, protocol=2)
                         if info.filename.endswith("data.pkl") else data)
    shutil.move(rewritten, where / "sched_0.pt")
    for kwargs in ({}, {"allow_pickle": True}):
        with pytest.raises(ckptio.PickleRefusedError) as caught:
            ckptio.load(where, **kwargs)
        said = str(caught.value)
        assert "sched_0.pt" in said and "CheckpointManager.load" in said, said
        assert "pass allow_pickle=True" not in said, said
    done = run_cli("ls", str(where), env=ENV, timeout=120)  # and ls says no other fix
    assert done.returncode != 0 and "CheckpointManager.load" in done.stderr, done.stderr
    assert "allow_pickle=True)" not in done.stderr, done.stderr
    assert not flag.exists()


def test_a_slower_tier_over_its_run_keeps_its_steps_and_refuses_a_save_into_them(
        run, tmp_path) -> None:
    """Its run directory as the disk tier behind a memory tier. Before: the manager's start took
    its step-N folders for copies a killed drain cut short and deleted them (and restore then
    started fresh); a drain of a step of the same number would have saved beside its files."""
    shutil.copytree(run["root"], tmp_path / "run")
    tiers = [ckptio.Tier(f"mem://rttc-{tmp_path.name}", keep_last=2),
             ckptio.Tier(str(tmp_path / "run"), every=1, keep_last=1)]
    state = _build(1)
    with ckptio.CheckpointManager(tiers=tiers) as mgr:
        with pytest.raises(ckptio.CkptError, match=r"step-200 holds a torch_checkpointing.*"
                           r"ckptio convert"):
            mgr.restore(state)
        with pytest.raises(ckptio.CkptError, match=r"run/step-100 holds a torch_checkpointing"):
            mgr.save(100, state)
        for step in (201, 202):
            mgr.save(step, state)
        assert mgr.drained(timeout=60)
    assert sorted(os.listdir(tmp_path / "run")) == ["step-100", "step-200", "step-202"]
    for step in (100, 200):
        assert sorted(os.listdir(tmp_path / "run" / f"step-{step}")) == [
            "model_0.pt", "optim_0.pt", "sched_0.pt"]


@pytest.fixture(scope="module")
def weed(tmp_path_factory: pytest.TempPathFactory) -> Any:
    try:
        import boto3  # noqa: F401
        weed_binary()
    except (ImportError, ServerError) as exc:
        pytest.skip(f"needs boto3 and SeaweedFS: {exc}")
    with SeaweedServer(tmp_path_factory.mktemp("weed")) as server:
        yield server


@pytest.mark.parametrize("others", [0, 40])  # few steps: looked up each; many: one listing
def test_on_s3_its_steps_are_named_refused_and_kept_with_no_listing_per_step(
        run, weed, monkeypatch, others: int) -> None:
    for name, value in weed.env().items():
        monkeypatch.setenv(name, value)
    s3 = make_client(weed)
    prefix = f"tc-{uuid.uuid4().hex}"
    url = f"s3://{weed.bucket}/{prefix}"
    files = {f"{prefix}/{step}/{f.name}": f.read_bytes()
             for step in ("step-100", "step-200") for f in (run["root"] / step).iterdir()}
    files.update({f"{prefix}/step-{n}/data-x.bin": b"x" for n in range(10, 10 + others)})
    for key, body in files.items():
        s3.put_object(Bucket=weed.bucket, Key=key, Body=body)
    state = _build(1)
    ckptio.load(f"{url}/step-200", state)  # its checkpoint itself loads from s3://
    assert torch.equal(state["model"].weight, run["state"]["model"].weight)
    with FaultProxy(weed.host, weed.port) as proxy:
        options = ckptio.Options(s3_endpoint_url=proxy.endpoint)
        with ckptio.CheckpointManager(url, keep_last=1, options=options) as mgr:
            with pytest.raises(ckptio.CkptError, match=rf"{url}/step-200 holds a "
                               r"torch_checkpointing.*ckptio convert"):
                mgr.restore(_build(1))
            with pytest.raises(ckptio.CkptError, match=r"step-100 holds a torch_checkpointing"):
                mgr.save(100, state)
            for step in (201, 202):
                mgr.save(step, state)
            assert mgr.steps() == [202]
        # many steps: one listing, not one per step (40 more steps, 18 listings); few steps:
        # each looked up by a listing of its own prefix, by design (24, 25 under load)
        limit = 25 if others else 32
        assert proxy.counts["ListObjectsV2"] < limit, dict(proxy.counts)
    for key, body in files.items():
        assert s3.get_object(Bucket=weed.bucket, Key=key)["Body"].read() == body, key


def _two_ranks(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """Each rank: its CheckpointManager's save of two steps (each rank's own model), then
    ckptio's manager over that directory and a load of its newest step."""
    run = Path(tmp) / "run"
    model = _build(rank)["model"]
    tc = manager()
    for step in (100, 200):
        tc.save(str(run / f"step-{step}"), {"model": model.state_dict()})
    tc.close()
    out: dict[str, Any] = {}
    with ckptio.CheckpointManager(run, keep_last=1) as mgr:
        for what, call in (("restore", lambda: mgr.restore({"model": model})),
                           ("save", lambda: mgr.save(200, {"model": model}))):
            try:
                call()
            except ckptio.CkptError as exc:
                out[what] = str(exc)
        mgr.save(201, {"model": model})
        mgr.save(202, {"model": model})
        out["steps"] = mgr.steps()
    torch.distributed.barrier()
    out["files"] = sorted(os.listdir(run / "step-200"))
    loaded = {"model": _build(9)["model"]}
    ckptio.load(run / "step-200", loaded)
    out["own"] = torch.equal(loaded["model"].weight, model.weight)
    return out


def test_two_ranks_agree_on_the_refusals_and_each_loads_its_own(tmp_path) -> None:
    """gloo, 2 ranks: restore and the save into its step are refused on both ranks alike (no
    rank goes on to a collective the other left), and each rank loads its own model."""
    for got in run_ranks(2, _two_ranks, str(tmp_path), timeout_s=120):
        assert "step-200 holds a torch_checkpointing" in got.get("restore", ""), got
        assert "step 200 was not saved" in got.get("save", ""), got
        assert got["steps"] == [202] and got["own"], got
        assert got["files"] == ["model_0.pt", "model_1.pt"], got


def _s3_commit_cut(weed: Any, monkeypatch: pytest.MonkeyPatch, name: str, items: dict[str, Any],
                   dies: Callable[[str, list[str]], bool]) -> tuple[str, list[str]]:
    """Its CheckpointManager over ckptio.tc_storage on S3 saves ``items`` as step-5; the commit
    copies each object of tmp_step-5 to step-5 (S3 has no rename) and the connection dies on
    the copy where ``dies(key, copied so far)`` -> (the run's URL, the keys copied)."""
    from torch_checkpointing import CheckpointManager

    from ckptio.storage.s3.store import S3Bucket
    from ckptio.tc_storage import CkptioStorageConfig

    for env, value in weed.env().items():
        monkeypatch.setenv(env, value)
    root = f"s3://{weed.bucket}/{name}-{uuid.uuid4().hex}"
    copied: list[str] = []
    copy = S3Bucket.copy

    def cut(self: Any, key: str, to: Any, dest_key: str) -> None:
        if dies(key, copied):
            raise ckptio.StorageIOError(f"copying {key}: the connection was reset")
        copied.append(key)
        copy(self, key, to, dest_key)

    monkeypatch.setattr(S3Bucket, "copy", cut)
    config = CheckpointManager.Config.with_sync_save()
    config.storage_config = CkptioStorageConfig(root)
    tc = config.build()
    try:
        with pytest.raises(Exception, match="connection was reset"):
            tc.save("step-5", items)
    finally:
        tc.close()
    monkeypatch.setattr(S3Bucket, "copy", copy)
    return root, copied


def test_on_s3_a_commit_through_ckptio_storage_cut_short_is_refused_not_loaded_in_part(
        weed, monkeypatch) -> None:
    """The commit's copy dies on the optimizer's file. Before: ckptio.load(step-5) returned the
    model alone, as a whole checkpoint (strict=False, or no state, resumed without the
    optimizer, silently)."""
    state = _build(0)
    _train(state, 1)
    root, copied = _s3_commit_cut(weed, monkeypatch, "cut",
                                  {k: v.state_dict() for k, v in state.items()},
                                  lambda key, _copied: key.endswith("optim_0.pt"))
    assert any(k.endswith("model_0.pt") for k in copied), copied  # step-5 holds the model
    for kwargs in ({}, {"strict": False}):
        with pytest.raises(ckptio.CheckpointNotFoundError, match=r"step-5: its commit .* did "
                           r"not finish.*load an earlier checkpoint"):
            ckptio.load(f"{root}/step-5", _build(1), **kwargs)
    with pytest.raises(ckptio.CheckpointNotFoundError, match="did not finish"):
        ckptio.load(f"{root}/step-5")


def test_on_s3_the_unfinished_marker_is_copied_before_any_item(weed, monkeypatch) -> None:
    """The commit's marker (tcdir.MOVING_NAME) went over in the listing's order, so an item
    whose name sorts before it ("-head") was copied first: a connection dying on the second
    copy left step-5 holding "-head" alone, which ckptio.load returned as a whole checkpoint.
    Now names beginning with "." go first (object_tree.keys)."""
    root, copied = _s3_commit_cut(weed, monkeypatch, "order",
                                  {"-head": {"w": torch.ones(3)}, "model": {"w": torch.zeros(3)}},
                                  lambda _key, copied: len(copied) == 1)
    with pytest.raises(ckptio.CkptError):
        ckptio.load(f"{root}/step-5")
    assert copied[0].endswith("/.ckptio-moving"), copied
