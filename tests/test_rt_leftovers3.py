"""Leftovers of earlier rounds, played as a user would (fresh processes, the public API):

* a layer resized between save and load, through an integration whose user cannot pass
  ckptio.load's strict=: the refusal names the integration's own fix, not ``strict=False``
  (TorchTitan's manager, its initial_load_path, Megatron's strategy); plain ckptio.load keeps
  its own wording.
* every read of a load is stall-watched (FUSE fault file system): a DCP directory's
  ``.metadata``, and the torch.load of an ``allow_pickle=True`` file (was unwatched: a hung
  read said nothing).
* a load finding a save in flight in an S3 prefix (its lock object): a fresh lease says the
  save is still running on host H, pid P, since when, and to wait; an expired one, or a holder
  provably dead, says the save was interrupted (both said "interrupted ... or still running");
  a local save killed before its commit likewise.
* a rank never seen alive (killed before its first ckptio call) is named alone, as never seen,
  when the step times out: not with the ranks that did their part as "alive, but stuck".
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptio

from s3.conftest import s3_env, s3_live, s3_server  # noqa: F401 - the S3 fixtures
from stall_cases import BOUND_S, WARN_S, Behind, warned

sys.path.insert(0, str(Path(__file__).parent))


def _no_load_arguments(said: str) -> None:
    assert "strict=False" not in said and "keys=..." not in said, said


# ------------------------------------------------------------------ item 1: each fix its own


def test_plain_load_of_a_resized_layer_still_says_strict_false(tmp_path: Path) -> None:
    """ckptio.load's own refusal keeps naming its arguments (strict=False)."""
    ckptio.save({"model": torch.nn.Linear(3, 4)}, tmp_path / "c")
    with pytest.raises(ckptio.StateMismatchError) as err:
        ckptio.load(tmp_path / "c", {"model": torch.nn.Linear(3, 5)})
    said = str(err.value)
    assert "model.weight: shape (5, 3) in the state, (4, 3) in the checkpoint" in said, said
    assert said.endswith("Fix the state, or pass strict=False to load the rest and skip these")
    assert str(tmp_path / "c") in said, said


def test_plain_load_of_another_dtype_still_says_cast_true(tmp_path: Path) -> None:
    """ckptio.load's own dtype refusal keeps naming its argument (cast=True)."""
    ckptio.save({"w": torch.zeros(3)}, tmp_path / "c")
    with pytest.raises(ckptio.StateMismatchError) as err:
        ckptio.load(tmp_path / "c", {"w": torch.zeros(3, dtype=torch.float64)})
    said = str(err.value)
    assert "w: dtype torch.float64 in the state, torch.float32 in the checkpoint (pass " \
        "cast=True to convert)" in said, said


@pytest.fixture()
def titan(monkeypatch: pytest.MonkeyPatch) -> Any:
    pytest.importorskip("torchtitan.components.checkpointer.base")
    import test_torchtitan

    return test_torchtitan


def test_torchtitan_resized_layer_says_torchtitans_fix_only(
        titan: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hidden layer resized (30 -> 31) since the save: the refusal names the keys, both
    shapes and TorchTitan's options, and no strict=False (the manager has no such option)."""
    job = titan.Job(tmp_path)
    for _ in range(2):
        job.step()
    job.checkpointer.close()
    monkeypatch.setattr(titan, "DIMS", (12, 31, 17, 5))
    again = titan.Job(tmp_path)
    with pytest.raises(ckptio.StateMismatchError) as caught:
        again.checkpointer.load()
    again.checkpointer.close()
    said = str(caught.value)
    assert "0.weight: shape (31, 12) in the state, (30, 12) in the checkpoint" in said, said
    assert "step-2" in said and "--checkpoint.exclude_from_loading" in said, said
    _no_load_arguments(said)


def test_torchtitan_model_of_another_dtype_says_no_load_argument(
        titan: Any, tmp_path: Path) -> None:
    """The model built in float64 since a float32 save: the refusal names the key and both
    dtypes, TorchTitan's fix, and neither cast=True nor strict=False (no such options there)."""
    job = titan.Job(tmp_path)
    for _ in range(2):
        job.step()
    job.checkpointer.close()
    again = titan.Job(tmp_path)
    again.model.to(torch.float64)
    with pytest.raises(ckptio.StateMismatchError) as caught:
        again.checkpointer.load()
    again.checkpointer.close()
    said = str(caught.value)
    assert "weight.exp_avg: dtype torch.float64 in the state, torch.float32 in the checkpoint" \
        in said, said
    assert "--checkpoint" in said and "cast=True" not in said, said
    _no_load_arguments(said)


def test_torchtitan_initial_load_of_a_resized_layer_says_torchtitans_fix_only(
        titan: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--checkpoint.initial_load_path to a checkpoint of a model since resized: TorchTitan's
    fix (build the model as saved, leave the option out), no strict=False."""
    model = torch.nn.Sequential(torch.nn.Linear(12, 30), torch.nn.GELU(), torch.nn.Linear(30, 17),
                                torch.nn.GELU(), torch.nn.Linear(17, 5))
    ckptio.save(model.state_dict(), tmp_path / "seed")
    monkeypatch.setattr(titan, "DIMS", (12, 31, 17, 5))
    job = titan.Job(tmp_path / "run", initial_load_path=str(tmp_path / "seed"),
                    initial_load_model_only=True)
    with pytest.raises(ckptio.StateMismatchError) as caught:
        job.checkpointer.load()
    job.checkpointer.close()
    said = str(caught.value)
    assert "0.weight: shape (31, 12) in the state, (30, 12) in the checkpoint" in said, said
    assert "--checkpoint.initial_load_path" in said, said
    _no_load_arguments(said)


def _megatron_resized(rank: int, world: int, root: str) -> str:
    """A ShardedTensor saved with 8 elements, loaded as 10 -> the refusal's text."""
    from megatron.core import dist_checkpointing as mdc
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from ckptio.megatron_strategy import CkptioLoadShardedStrategy, CkptioSaveShardedStrategy

    def state(n: int) -> dict[str, Any]:
        return {"a": ShardedTensor.from_rank_offsets("A", torch.ones(n))}

    mdc.save(state(8), root, sharded_strategy=CkptioSaveShardedStrategy())
    try:
        mdc.load(state(10), root, sharded_strategy=CkptioLoadShardedStrategy())
    except ckptio.StateMismatchError as exc:
        return str(exc)
    return "loaded"


def test_megatron_resized_tensor_says_megatrons_fix_only(tmp_path: Path) -> None:
    """dist_checkpointing.load of a tensor resized since the save: the key, both shapes and
    Megatron's fix (build the model as saved), not ckptio.load's strict=False."""
    pytest.importorskip("megatron.core.dist_checkpointing")
    from ckptio.testing.rank_processes import run_ranks

    (said,) = run_ranks(1, _megatron_resized, str(tmp_path), timeout_s=120)
    assert "tensors.A: shape (10,) in the state, (8,) in the checkpoint" in said, said
    assert "through Megatron: build the model as it was saved" in said, said
    _no_load_arguments(said)


# ------------------------------------------------------------------ item 2: every read watched


@pytest.fixture
def fs(tmp_path: Path) -> Iterator[Any]:
    from ckptio.testing.faultfs import FaultFS, fuse_unusable

    if fuse_unusable() is not None:
        pytest.skip(str(fuse_unusable()))
    with FaultFS(tmp_path / "backing", tmp_path / "mnt") as mounted:
        yield mounted


class _Picklish:
    """An object only an unpickling torch.load brings back."""

    def __init__(self, n: int) -> None:
        self.n = n


def _every_read_is_warned(fs: Any, caplog: pytest.LogCaptureFixture, pattern: str, file: str,
                          location: str, call: Any) -> int:
    """``call`` (a load) run once per read of ``file`` (``pattern``, FaultFS's), that read
    stalled: each time a warning naming rank 0, the location, the file and the seconds comes
    within BOUND_S, and, released, the load completes -> how many reads were stalled."""
    caplog.set_level("WARNING", logger="ckptio")
    for nth in range(1, 9):
        caplog.clear()
        fs.clear()
        fs.stall("read", pattern, nth=nth)
        behind = Behind(call)
        try:
            try:
                assert fs.wait_stalled(BOUND_S).endswith(file)
            except TimeoutError:  # no read left to stall: the load completed without one
                behind.joined()
                return nth - 1
            said = warned(caplog, f"the load from {location} has made no progress")
            assert said, f"read {nth} of {file}: no stall warning within {BOUND_S} s"
            assert said[0].startswith(f"ckptio: rank 0: the load from {location} "), said
            assert f"{file} has not returned" in said[0], said
            assert f"Options.io_stall_warn_s={WARN_S:g}" in said[0], said
        finally:
            fs.release()
        behind.joined()
    return 8


def test_a_dcp_directorys_stalled_metadata_read_is_warned_about(
        fs: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A torch.distributed.checkpoint directory on a file system whose reads of ``.metadata``
    hang: each warned about as a data file's read is; released, the load completes."""
    import torch.distributed.checkpoint as dcp

    path = fs.mountpoint / "dcp"
    dcp.save({"w": torch.arange(64.0)}, checkpoint_id=str(path), no_dist=True)
    state = {"w": torch.zeros(64)}
    assert _every_read_is_warned(fs, caplog, r"^/dcp/\.metadata$", ".metadata", str(path),
                                 lambda: ckptio.load(path, state,
                                                     options=ckptio.Options(io_stall_warn_s=WARN_S)))
    assert torch.equal(state["w"], torch.arange(64.0))


def test_an_allow_pickle_torch_load_stalled_read_is_warned_about(
        fs: Any, caplog: pytest.LogCaptureFixture) -> None:
    """ckptio.load(file, allow_pickle=True) of a torch.save file holding Python objects (read
    by torch.load itself) on a file system whose reads hang: each warned about too."""
    (fs.mountpoint / "run").mkdir()
    file = fs.mountpoint / "run" / "model.pt"
    torch.save({"w": torch.ones(8), "obj": _Picklish(3)}, file)
    got: list[Any] = []
    assert _every_read_is_warned(fs, caplog, r"^/run/model\.pt$", "model.pt",
                                 str(fs.mountpoint / "run"),
                                 lambda: got.append(ckptio.load(
                                     file, allow_pickle=True,
                                     options=ckptio.Options(io_stall_warn_s=WARN_S))))
    assert got[-1]["obj"].n == 3 and torch.equal(got[-1]["w"], torch.ones(8))


# ------------------------------------------------------------------ item 3: in flight on S3


def _left_behind(server: Any, url: str, holder: dict[str, Any]) -> None:
    """What a save into ``url`` by ``holder`` leaves before its commit: a data object and its
    lock object (as s3/lock.py writes it)."""
    import json

    from ckptio.testing.s3server import make_client

    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    client = make_client(server)
    client.put_object(Bucket=bucket, Key=f"{prefix}/data-0-r00000-x.bin", Body=b"\0" * 64)
    client.put_object(Bucket=bucket, Key=f"{prefix}/.ckptio.lock", Body=json.dumps(holder).encode())


def _other_host(lease_s: float) -> dict[str, Any]:
    from ckptio.storage import holder as holders

    return {**holders.me(), "host": "node-17", "boot": "another-boot", "pid": 4242,
            "save": "s1", "lease_s": lease_s}


def test_s3_save_in_flight_on_another_host_says_still_running_and_who(
        s3_env: str, s3_live: Any) -> None:  # noqa: F811 - the S3 fixtures
    """A load finds another host's save in flight (its lock's lease fresh): it names the host,
    the pid and how long ago it started, and says to wait; no "interrupted"."""
    _left_behind(s3_live, s3_env, _other_host(60.0))
    with pytest.raises(ckptio.IncompleteCheckpointError) as err:
        ckptio.load(s3_env)
    said = str(err.value)
    assert "still running" in said and "node-17" in said and "pid 4242" in said, said
    assert " s ago" in said and "wait" in said and "interrupted" not in said, said


def test_s3_save_whose_lease_expired_says_interrupted(
        s3_env: str, s3_live: Any) -> None:  # noqa: F811 - the S3 fixtures
    """The lock of a save that stopped renewing it (its lease expired): the load says the save
    was interrupted, naming the holder and how long its lock has not been renewed; not
    "or still running"."""
    _left_behind(s3_live, s3_env, _other_host(1.0))
    time.sleep(2.5)
    with pytest.raises(ckptio.IncompleteCheckpointError) as err:
        ckptio.load(s3_env)
    said = str(err.value)
    assert "interrupted" in said and "still running" not in said, said
    assert "node-17" in said and "pid 4242" in said and "stopped renewing" in said, said


def test_s3_save_whose_holder_here_exited_says_interrupted_at_once(
        s3_env: str, s3_live: Any) -> None:  # noqa: F811 - the S3 fixtures
    """The lock of a save by a process of this host that has exited (killed), its lease still
    fresh: the load says the save was interrupted, naming that process."""
    import subprocess

    from ckptio.storage import holder as holders

    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)
    pid = int(ended.stdout)
    _left_behind(s3_live, s3_env, {**holders.me(), "pid": pid, "start": None, "save": "s1",
                                   "lease_s": 60.0})
    with pytest.raises(ckptio.IncompleteCheckpointError) as err:
        ckptio.load(s3_env)
    said = str(err.value)
    assert "interrupted" in said and "still running" not in said, said
    assert f"pid {pid}" in said and "has exited" in said, said


def test_local_save_killed_before_its_commit_says_interrupted(tmp_path: Path) -> None:
    """A save SIGKILLed before its commit leaves its lock file: the load says the save was
    interrupted, naming the exited process (it said "interrupted ... or still running")."""
    import subprocess

    where = tmp_path / "ck"
    code = ("import os, signal, torch, ckptio\n"
            "from ckptio.saving import persist\n"
            "persist.SaveJob.finish = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)\n"
            f"ckptio.save({{'w': torch.ones(1000)}}, {str(where)!r})\n")
    killed = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert killed.returncode == -9, killed.stderr
    with pytest.raises(ckptio.IncompleteCheckpointError) as err:
        ckptio.load(where)
    said = str(err.value)
    assert "interrupted" in said and "still running" not in said, said
    assert "has exited" in said and "pid " in said, said


# ------------------------------------------------------------------ item 4: who is to blame


def test_a_rank_never_seen_is_named_alone_not_the_ranks_that_read_the_broadcast() -> None:
    """Three ranks; rank 1 was killed before its first ckptio call (it never beat). Rank 0
    broadcasts (rank 2 reads it), then all-gathers: each fails naming rank 1 as never seen alive,
    not rank 2 (which had read it) as "alive, but stuck" too, and rank 2 is not given up on."""
    import torch.distributed as dist

    from ckptio.distributed.liveness import key_of
    from ckptio.distributed.storegroup import Deadlines, StoreGroup

    store, deadlines = dist.HashStore(), Deadlines(rank_s=5.0, step_s=1.0)
    stop, out = threading.Event(), {}

    def beat() -> None:  # ranks 0 and 2 beat; rank 1 never did
        while not stop.wait(deadlines.beat_s):
            for r in (0, 2):
                store.add(key_of(r), 1)

    def run(rank: int) -> None:
        group = StoreGroup(store, store, (0, 1, 2), rank, "ckptio/t/0", deadlines)
        try:
            group.broadcast(b"plan" if rank == 0 else None)
            group.all_gather(b"x")
        except ckptio.RankFailedError as exc:
            out[rank] = exc

    for r in (0, 2):
        store.add(key_of(r), 1)
    threads = [threading.Thread(target=beat)] + [threading.Thread(target=run, args=(r,))
                                                 for r in (0, 2)]
    for t in threads[1:]:
        t.start()
    threads[0].start()
    for t in threads[1:]:
        t.join(timeout=30)
    stop.set()
    threads[0].join()
    for rank in (0, 2):
        said = str(out[rank])
        assert out[rank].ranks == (1,), (rank, said)
        assert "rank 1" in said and "never seen alive" in said, said
        assert "rank 2" not in said and "alive, but stuck" not in said, said
