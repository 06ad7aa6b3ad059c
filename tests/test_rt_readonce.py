"""Red team of issue 67's read-once loads: real gloo ranks loading replicated state in place
while one rank dies, one rank's state differs, the stored bytes are damaged, or the group and
the number of ranks change. Each rank ends with its state bitwise what was saved, or a CkptError
on every rank within a bound; never a hang or another rank's bytes."""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch

import ckptio
from ckptio.testing.rank_processes import run_ranks

def options(**changes: Any) -> ckptio.Options:
    return dataclasses.replace(ckptio.Options(buffer_bytes=1 << 20, pool_bytes=4 << 20),
                               rank_timeout_s=3.0, step_timeout_s=30.0, **changes)


def state(n_tiny: int = 0, zeros: bool = False) -> dict[str, Any]:
    g = torch.Generator().manual_seed(11)
    out: dict[str, Any] = {
        "big": torch.randn(512, 1024, generator=g),
        "mid": torch.randn(1000, 300, generator=g).to(torch.bfloat16),
        "norm": {f"n{i}": torch.randn(33 + i, generator=g) for i in range(6)},
    }
    if n_tiny < 0:  # many tensors of a message each
        out["many"] = {f"m{i}": torch.randn(1 << 18, generator=g) for i in range(-n_tiny)}
    if n_tiny > 0:
        out["tiny"] = {f"t{i}": torch.randn(3, generator=g) for i in range(n_tiny)}
    return _zeroed(out) if zeros else out


def _zeroed(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _zeroed(v) for k, v in value.items()}
    return torch.zeros_like(value)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def save(rank: int, world: int, path: str, n_tiny: int = 0) -> None:
    ckptio.save(state(n_tiny), path, options=options())


def save_dcp(rank: int, world: int, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state(), checkpoint_id=path)


def _changed(rank: int, into: dict[str, Any], change: str, victim: int) -> None:
    if rank != victim:
        return
    if change == "shape":
        into["big"] = torch.zeros(1024, 512)
    elif change == "dtype":
        into["mid"] = torch.zeros(1000, 300)
    elif change == "missing":
        del into["norm"]["n3"]
    elif change == "cast":
        into["mid"] = torch.zeros(1000, 300)
    elif change == "extra":
        into["norm"]["n99"] = torch.zeros(4)


def load(rank: int, world: int, path: str, fault: str = "", victim: int = 1,
         broadcast: bool = True, n_tiny: int = 0, group_ranks: list[int] | None = None,
         **load_kw: Any) -> dict[str, Any]:
    """Load the saved state in place with ``fault`` on rank ``victim`` (see the branches) ->
    {"error": (type, message) or None, "warnings", "equal": bitwise the saved state, "took"}."""
    into = state(n_tiny, zeros=True)
    _changed(rank, into, fault, victim)
    if fault == "kill" and rank == victim:
        delay = random.Random(os.getpid()).uniform(0.0, 0.15)
        threading.Thread(target=_killed_once_seen, args=(delay,), daemon=True).start()
    if fault in ("unreadable", "die_reading") and rank == victim:
        _deny_reads(path, fault == "die_reading")
    pg = None
    if group_ranks is not None:
        pg = torch.distributed.new_group(group_ranks, backend="gloo")
        if rank not in group_ranks:
            return {"skipped": True}
    if fault == "off1" and rank == victim:
        broadcast = False
    if fault == "keys1" and rank == victim:
        load_kw["keys"] = ["big", "norm"]
    if fault == "cast":
        load_kw["cast"] = True
    if fault == "stop_posted" and rank == victim:
        _stop_after_posting()
    error = None
    started = time.time()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            ckptio.load(path, into, options=options(broadcast_replicated=broadcast),
                        process_group=pg, **load_kw)
        except ckptio.CkptError as exc:
            error = (type(exc).__name__, str(exc))
        except Exception as exc:  # noqa: BLE001 - a red-team probe reports any escape
            error = ("NOT-CkptError " + type(exc).__name__, str(exc))
    want = state(n_tiny)
    _changed(rank, want, fault, victim)
    return {"error": error, "warnings": [str(w.message) for w in caught],
            "equal": _equal(into, want) if fault not in ("shape", "dtype", "cast", "keys1")
            else _equal(into["big"], want["big"]),
            "untouched": _equal(into, state(n_tiny, zeros=True)), "took": time.time() - started}


def _killed_once_seen(delay: float) -> None:
    """SIGKILL this rank ``delay`` s after ckptio's heartbeat began in it (its load has begun:
    the others have seen it alive). A kill before that, which a loaded machine made of a fixed
    delay, is a rank never seen alive, waited for step_timeout_s, not rank_timeout_s."""
    while not any(t.name == "ckptio-alive" for t in threading.enumerate()):
        time.sleep(0.001)
    time.sleep(delay)
    os.kill(os.getpid(), signal.SIGKILL)


def _deny_reads(path: str, die: bool = False) -> None:
    """This rank cannot open the checkpoint's data files (``die``: it is killed as it does)."""
    real = os.open

    def denied(file: Any, flags: int, *a: Any, **k: Any) -> int:
        if str(file).startswith(path) and not str(file).endswith("manifest.json"):
            if die:
                os.kill(os.getpid(), signal.SIGKILL)
            raise PermissionError(13, "Permission denied", str(file))
        return real(file, flags, *a, **k)

    os.open = denied  # type: ignore[assignment]


def flip_bit_of(path: str, key_bytes: bytes, at: int) -> str:
    """Flip one bit ``at`` bytes into where ``key_bytes`` (a tensor's leading bytes) is stored
    in ``path``'s data files -> the file."""
    for f in sorted(Path(path).iterdir()):
        data = f.read_bytes()
        where = data.find(key_bytes)
        if where >= 0 and not f.name.endswith((".json", ".metadata")):
            with open(f, "r+b") as out:
                out.seek(where + at)
                byte = out.read(1)[0]
                out.seek(where + at)
                out.write(bytes([byte ^ 0x10]))
            return str(f)
    raise AssertionError("tensor bytes not found")


def leading(key: str, nbytes: int = 64) -> bytes:
    t = state()[key] if "." not in key else state()["norm"][key.split(".")[1]]
    return t.reshape(-1).view(torch.uint8)[:nbytes].numpy().tobytes()


def save_torch(rank: int, world: int, path: str) -> None:
    if rank == 0:
        torch.save(state(), path)


def load_on_one_host(rank: int, world: int, path: str, budget: int,
                     broadcast: bool = True) -> dict[str, Any]:
    """A rank of ``world`` on one host (as torchrun tells it) loading through a Checkpointer
    whose host budget is ``budget`` -> its error, whether exact, the staging it held."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world))
    ck = ckptio.Checkpointer(dataclasses.replace(
        options(broadcast_replicated=broadcast), host_budget_bytes=budget,
        buffer_bytes=1 << 20, pool_bytes=2 << 20, use_profile=False))
    into = state(zeros=True)
    error = None
    try:
        ck.load(path, into)
    except ckptio.CkptError as exc:
        error = (type(exc).__name__, str(exc))
    held = ck.staging_nbytes
    ck.close()
    return {"error": error, "equal": _equal(into, state()), "held": held}


def _stop_after_posting() -> None:
    """This rank stops (SIGSTOP) once its exchange's messages are posted: its peers' sends to
    it, and their receives from it, wait on a frozen process."""
    from ckptio.distributed import sendreads

    real = sendreads._post

    def post_then_stop(group: Any, posts: Any) -> Any:
        works = real(group, posts)
        os.kill(os.getpid(), signal.SIGSTOP)
        return works

    sendreads._post = post_then_stop  # type: ignore[attr-defined]


def odd_state(zeros: bool = False) -> dict[str, Any]:
    """Tied weights, an empty tensor, a scalar, a transposed view, a slice of a flat buffer."""
    g = torch.Generator().manual_seed(5)
    emb = torch.randn(300, 64, generator=g)
    flat = torch.randn(10000, generator=g)
    out = {"emb": emb, "head": emb, "empty": torch.zeros(0, 3), "scalar": torch.tensor(2.5),
           "t": torch.randn(200, 100, generator=g).t(), "a": flat[:4000].view(40, 100),
           "b": flat[4000:].view(60, 100), "step": torch.tensor(7, dtype=torch.int64)}
    if zeros:
        z = torch.zeros_like(emb)
        zf = torch.zeros_like(flat)
        out = {"emb": z, "head": z, "empty": torch.zeros(0, 3), "scalar": torch.tensor(0.0),
               "t": torch.zeros(200, 100).t(), "a": zf[:4000].view(40, 100),
               "b": zf[4000:].view(60, 100), "step": torch.tensor(0, dtype=torch.int64)}
    return out


def save_odd(rank: int, world: int, path: str) -> None:
    ckptio.save(odd_state(), path, options=options())


def load_odd(rank: int, world: int, path: str) -> dict[str, Any]:
    into = odd_state(zeros=True)
    ckptio.load(path, into, options=options())
    want = odd_state()
    return {"equal": {k: _equal(into[k], want[k]) for k in want},
            "tied": into["emb"] is into["head"]}


def load_twice(rank: int, world: int, path: str, victim: int = 1) -> dict[str, Any]:
    """A load whose sender damages what it sends (caught), then the same load again."""
    from ckptio.distributed import sendreads

    real = sendreads._send_buffer
    if rank == victim:
        def flipped(sources: Any, pieces: Any) -> torch.Tensor:
            out = real(sources, pieces).clone()
            out[0] ^= 0x01
            return out

        sendreads._send_buffer = flipped
    out: dict[str, Any] = {}
    for attempt in range(3):
        into = state(zeros=True)
        try:
            ckptio.load(path, into, options=options())
            out[attempt] = ("ok", _equal(into, state()))
        except ckptio.CkptError as exc:
            out[attempt] = (type(exc).__name__, str(exc)[:300])
        sendreads._send_buffer = real
    return out


def save_tc(rank: int, world: int, path: str) -> None:
    """A torch_checkpointing directory: one torch.save file per item and rank."""
    os.makedirs(path, exist_ok=True)
    torch.save({**state(), "own": torch.full((100,), float(rank))},
               os.path.join(path, f"model_{rank}.pt"))


def load_tc(rank: int, world: int, path: str, broadcast: bool = True) -> dict[str, Any]:
    into = {"model": {**state(zeros=True), "own": torch.zeros(100)}}
    error = None
    try:
        ckptio.load(path, into, options=options(broadcast_replicated=broadcast))
    except ckptio.CkptError as exc:
        error = (type(exc).__name__, str(exc)[:400])
    want = {"model": {**state(), "own": torch.full((100,), float(rank))}}
    return {"error": error, "equal": _equal(into, want)}


def load_in_pairs(rank: int, world: int, paths: list[str]) -> dict[str, Any]:
    """Ranks {0,1} and {2,3} (two process groups, every rank makes both) each load their own
    checkpoint at once, twice."""
    groups = [torch.distributed.new_group([0, 1]), torch.distributed.new_group([2, 3])]
    mine = rank // 2
    out = []
    for _ in range(2):
        into = state(zeros=True)
        ckptio.load(paths[mine], into, options=options(), process_group=groups[mine])
        out.append(_equal(into, state()))
    return {"equal": out}


def per_rank_state(rank: int, zeros: bool = False) -> dict[str, Any]:
    """The replicated state and, under one name on every rank, a tensor of this rank's own."""
    out = {**state(zeros=zeros), "rng": torch.full((20000,), float(rank))}
    return _zeroed(out) if zeros else out


def save_per_rank(rank: int, world: int, path: str) -> None:
    ckptio.save(per_rank_state(rank), path, options=options())


def load_per_rank(rank: int, world: int, path: str) -> dict[str, Any]:
    into = per_rank_state(rank, zeros=True)
    ckptio.load(path, into, options=options())
    return {"equal": _equal(into, per_rank_state(rank)), "rng": float(into["rng"][0])}


# --- the tests ---------------------------------------------------------------------------

BOUND_S = 5 * 3.0  # rank_timeout_s is 3 s: a load that loses a rank ends within a few of them


def _saved(tmp_path: Path, world: int = 3, n_tiny: int = 0) -> str:
    path = str(tmp_path / "ck")
    run_ranks(world, save, path, n_tiny)
    return path


def _all_exact(got: list[Any]) -> bool:
    return all(g["error"] is None and g["equal"] and not g["warnings"] for g in got)


def test_one_rank_with_the_option_off_loads_without_stalling(tmp_path: Path) -> None:
    """Options.broadcast_replicated=False on one rank only (the others on): before, the ranks
    took different steps (the manifest step ran on some only) and every load stalled for
    step_timeout_s, then warned that no rank read rank 0's answer."""
    path = _saved(tmp_path)
    for victim in (0, 1):
        got = run_ranks(3, load, path, "off1", victim, timeout_s=120)
        assert _all_exact(got), got
        assert max(g["took"] for g in got) < BOUND_S, [g["took"] for g in got]


def test_a_frozen_sender_of_many_tensors_costs_one_timeout_not_one_per_message(
        tmp_path: Path) -> None:
    """A rank frozen (SIGSTOP) once its exchange is posted, many tensors of a message each:
    before, each of its messages was waited for its own rank_timeout_s in turn (40 tensors,
    3 ranks: over 30 s; at the default 60 s, a quarter of an hour)."""
    path = _saved(tmp_path, n_tiny=-40)
    got = run_ranks(3, load, path, "stop_posted", 1, True, -40, may_die=(1,), timeout_s=300)
    for rank in (0, 2):
        g = got[rank]
        assert g["error"] is not None and g["error"][0] == "RankFailedError", g
        assert "rank 1" in g["error"][1] and "load again" in g["error"][1], g
        assert g["took"] < BOUND_S, (rank, g["took"])


def test_a_sender_killed_at_a_random_moment_never_leaves_wrong_bytes(tmp_path: Path) -> None:
    """SIGKILL of a rank at a random moment of its load, a few times: each survivor either
    loaded every byte (the kill came after the load) or raised RankFailedError naming the
    killed rank, within a few rank timeouts, its state untouched or said to be partly loaded."""
    path = _saved(tmp_path)
    for _ in range(3):
        got = run_ranks(3, load, path, "kill", 1, may_die=(1,), timeout_s=120)
        for rank in (0, 2):
            g = got[rank]
            # a kill while the wire group connects costs up to five rank timeouts (gloo tries
            # a failed connect again, each try waiting the timeout; measured 5.0x), then the
            # load's last step finds the rank dead
            assert g["took"] < BOUND_S + 3 * 3.0, g
            if g["error"] is None:
                assert g["equal"], g
            else:
                assert g["error"][0] == "RankFailedError" and "rank 1" in g["error"][1], g
                # failed before any read (its state as it was), or it says it may be partly
                assert g["equal"] or g["untouched"] or "partly loaded" in g["error"][1], g


def test_a_rank_killed_as_it_reads_leaves_the_others_told_their_state_is_partial(
        tmp_path: Path) -> None:
    """A rank killed as it opens a data file (the others read their share meanwhile): each
    survivor's RankFailedError names it and, its tensors partly filled, says so and to load
    again (before, the read step's error said only that the load failed on rank 1)."""
    path = _saved(tmp_path)
    got = run_ranks(3, load, path, "die_reading", 1, may_die=(1,), timeout_s=120)
    for rank in (0, 2):
        g = got[rank]
        kind, message = g["error"]
        assert kind == "RankFailedError" and "rank 1" in message and g["took"] < BOUND_S, g
        assert g["untouched"] or "partly loaded: load again" in message, g


def test_a_bit_flipped_in_a_stored_replicated_tensor_fails_every_rank(tmp_path: Path) -> None:
    """One bit of a replicated tensor flipped in its data file: the rank that reads it raises
    CorruptCheckpointError naming the key and the file, every other rank RankFailedError
    naming it; none holds the damaged bytes as a success; option off, each rank its own."""
    path = _saved(tmp_path)
    damaged = flip_bit_of(path, leading("big"), 1000)
    for broadcast in (True, False):
        got = run_ranks(3, load, path, "", 1, broadcast, timeout_s=120)
        assert all(g["error"] is not None for g in got), got
        corrupt = [g["error"][1] for g in got if g["error"][0] == "CorruptCheckpointError"]
        assert corrupt and all("'big'" in m and damaged in m for m in corrupt), got
        assert all("'big'" in g["error"][1] and g["took"] < BOUND_S for g in got), got
        if not broadcast:
            assert len(corrupt) == 3, got


def test_foreign_formats_read_once_and_a_flipped_bit_is_named(tmp_path: Path) -> None:
    """A DCP directory and a torch.save file, loaded on 3 ranks: exact; one bit flipped in
    a replicated item: CkptError on every rank naming the key and the file."""
    dcp_path, pt_path = str(tmp_path / "dcp"), str(tmp_path / "pt" / "ck.pt")
    run_ranks(3, save_dcp, dcp_path)
    os.makedirs(tmp_path / "pt")
    run_ranks(1, save_torch, pt_path)
    for path, where in ((dcp_path, dcp_path), (pt_path, str(tmp_path / "pt"))):
        assert _all_exact(run_ranks(3, load, path, timeout_s=120))
        damaged = flip_bit_of(where, leading("mid"), 1000)
        got = run_ranks(3, load, path, timeout_s=120)
        assert all(g["error"] is not None and "'mid'" in g["error"][1]
                   and damaged in g["error"][1] for g in got), got


def test_a_torch_checkpointing_directory_loads_each_rank_its_own(tmp_path: Path) -> None:
    """model_<rank>.pt of 3 ranks, the same replicated tensors in each and one per-rank one:
    every rank gets the replicated bytes and its own value."""
    path = str(tmp_path / "tc")
    run_ranks(3, save_tc, path)
    got = run_ranks(3, load_tc, path, timeout_s=120)
    assert all(g["error"] is None and g["equal"] for g in got), got


def test_one_rank_with_a_different_state(tmp_path: Path) -> None:
    """A shape, a dtype, an extra key on one rank: its error on it, RankFailedError naming it
    and the key on the others; a key missing on one rank (another asks for it), a dtype cast
    on one rank, and one rank loading fewer keys: exact everywhere."""
    path = _saved(tmp_path)
    for change, key in (("shape", "big"), ("dtype", "mid"), ("extra", "norm.n99")):
        got = run_ranks(3, load, path, change, 1, timeout_s=120)
        assert got[1]["error"][0] == "StateMismatchError" and key in got[1]["error"][1], got
        for rank in (0, 2):
            kind, message = got[rank]["error"]
            assert kind == "RankFailedError" and "rank 1" in message and key in message, got
    for change in ("missing", "cast", "keys1"):
        got = run_ranks(3, load, path, change, 1, timeout_s=120)
        assert all(g["error"] is None and g["equal"] for g in got), (change, got)


def test_one_rank_that_cannot_read_the_files_fails_every_rank_by_name(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    got = run_ranks(3, load, path, "unreadable", 1, timeout_s=120)
    assert got[1]["error"][0] == "StorageIOError" and "Permission denied" in got[1]["error"][1]
    for rank in (0, 2):
        kind, message = got[rank]["error"]
        assert kind == "RankFailedError" and "rank 1" in message and "owner and mode" in message


def test_other_groups_and_other_rank_counts(tmp_path: Path) -> None:
    """A process group of ranks 1..3 of 4 (rank 0 not loading), two groups loading their own
    checkpoints at once (twice), and a 3-rank checkpoint loaded on 2 and on 4 ranks."""
    path = _saved(tmp_path)
    got = run_ranks(4, load, path, "", 1, True, 0, [1, 2, 3], timeout_s=120, agent_store=True)
    assert got[0] == {"skipped": True} and _all_exact(got[1:]), got
    for world in (2, 4):
        assert _all_exact(run_ranks(world, load, path, timeout_s=120))
    run_ranks(2, save, path + "b")
    got = run_ranks(4, load_in_pairs, [path, path + "b"], timeout_s=120)
    assert all(g["equal"] == [True, True] for g in got), got


def test_many_tiny_and_odd_replicated_tensors(tmp_path: Path) -> None:
    """3000 tiny tensors on 4 ranks; tied weights, an empty tensor, a scalar, a transposed
    view and views of one flat buffer; a per-rank value saved under one name on every rank."""
    path = _saved(tmp_path, n_tiny=3000)
    assert _all_exact(run_ranks(4, load, path, "", 1, True, 3000, timeout_s=120))
    run_ranks(3, save_odd, str(tmp_path / "odd"))
    got = run_ranks(3, load_odd, str(tmp_path / "odd"), timeout_s=120)
    assert all(all(g["equal"].values()) and g["tied"] for g in got), got
    run_ranks(3, save_per_rank, str(tmp_path / "pr"))
    got = run_ranks(3, load_per_rank, str(tmp_path / "pr"), timeout_s=120)
    assert [g["rng"] for g in got] == [0.0, 1.0, 2.0] and all(g["equal"] for g in got), got


def test_a_load_after_a_damaged_exchange_works(tmp_path: Path) -> None:
    """A load that failed on bytes damaged between ranks, then the same load again in the same
    job (the wire group made anew): exact on every rank."""
    path = _saved(tmp_path)
    got = run_ranks(3, load_twice, path, timeout_s=120)
    for g in got:
        assert g[0][0] in ("CorruptCheckpointError", "RankFailedError"), got
        assert g[1] == ("ok", True) and g[2] == ("ok", True), got


def test_ranks_of_one_host_sharing_a_budget_below_the_largest_tensor(tmp_path: Path) -> None:
    """4 ranks of one host, a 1 MiB host budget (the largest tensor 2 MiB), option on and
    off: every rank exact, each holding its streaming floor."""
    path = _saved(tmp_path)
    for broadcast in (True, False):
        got = run_ranks(4, load_on_one_host, path, 1 << 20, broadcast, timeout_s=120)
        assert all(g["error"] is None and g["equal"] for g in got), got
        assert all(g["held"] <= 2 << 20 for g in got), got
