"""Rank functions of tests/test_redundancy.py (importable by name: ranks are forked from a clean
forkserver). Each group of ``per_host`` consecutive ranks plays a host: its own
``CKPTIO_HOST_ID`` and its own ``CKPTIO_SHM_DIR`` (``<base>/host<h>``), so wiping a host's memory
is removing that directory."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import os
import shutil
import signal
import time
import warnings
from typing import Any

import torch

import ckptio
from ckptio import Tier

MiB = 1 << 20
OPTS = ckptio.Options(buffer_bytes=MiB, pool_bytes=4 * MiB)
# the time the others' restore has to name a rank killed mid-transfer: the stated bound, one
# transfer's peer_timeout_s (a holder that left with this rank's share unreceived is waited for
# that long; most runs take under a second), and a loaded machine's slack; never step_timeout_s
PEER_GONE_S = OPTS.peer_timeout_s + 30


# delta saves with the other manager features (issue 44): the best step by loss kept in memory,
# saves due every step or by the clock (agreed over the whole job, not each rank's own group)
# (deltas however large: these cases are about protecting and rebuilding deltas, not the policy)
_DELTA: dict[str, Any] = {"delta": ckptio.DeltaPolicy(max_ratio=1.0), "compression": "zstd",
                          "keep_best": 1, "monitor": "loss", "save_every": 1,
                          "save_interval_s": 3600.0}
LOSSES = {1: 0.9, 2: 0.1, 3: 0.8, 4: 0.7}  # step 2 is the best


def _frozen(rank: int) -> dict[str, torch.Tensor]:
    """A tensor that never changes (a frozen embedding): what makes a delta worth saving."""
    return {"frozen": torch.randn(1 << 16, generator=torch.Generator().manual_seed(rank))}


def train_deltas(rank: int, world: int, base: str, disk: str, per_host: int, spec: str,
                 steps: int) -> dict[str, Any]:
    """train() with delta saves."""
    return train(rank, world, base, disk, per_host, spec, steps, delta=True)


def restore_deltas(rank: int, world: int, base: str, disk: str, per_host: int,
                   spec: str) -> dict[str, Any]:
    """restore() of a manager making delta saves."""
    return restore(rank, world, base, disk, per_host, spec, delta=True)



def same_bits(got: Any, want: Any, where: str) -> None:
    """Assert ``got`` holds ``want`` bit for bit (tensors by their bytes, containers walked),
    naming the first place that differs."""
    if isinstance(want, torch.Tensor):
        assert torch.equal(got.reshape(-1).view(torch.uint8),
                           want.reshape(-1).view(torch.uint8)), where
    elif isinstance(want, dict):
        assert sorted(map(str, got)) == sorted(map(str, want)), where
        for k in want:
            same_bits(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        for i, (g, w) in enumerate(zip(got, want)):
            same_bits(g, w, f"{where}[{i}]")
    else:
        assert got == want, where


def restore_then_meet(tiers: list[Tier], state: Any, peer_timeout_s: float,
                      step_timeout_s: float) -> dict[str, Any]:
    """A manager of ``tiers`` with those two deadlines restores ``state`` -> its error (or the
    step) and the seconds the restore took; then every rank meets the others at a barrier of
    the job's group (as a script's next collective) and closes its manager."""
    options = dataclasses.replace(OPTS, peer_timeout_s=peer_timeout_s,
                                  step_timeout_s=step_timeout_s)
    mgr = ckptio.CheckpointManager(tiers=tiers, options=options)
    started = time.monotonic()
    out: dict[str, Any] = {"error": None}
    try:
        out["step"] = mgr.restore(state)
    except ckptio.errors.CkptError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["seconds"] = time.monotonic() - started
    torch.distributed.barrier()
    mgr.close()
    return out


def host_dir(base: str, host: int) -> str:
    return os.path.join(base, f"host{host}")


def wipe_host(base: str, host: int) -> None:
    """Host ``host`` lost and replaced: its memory directory empty again."""
    shutil.rmtree(host_dir(base, host))
    os.makedirs(host_dir(base, host))


def _play_host(rank: int, per_host: int, base: str) -> None:
    os.environ["CKPTIO_HOST_ID"] = f"host{rank // per_host}"
    os.environ["CKPTIO_SHM_DIR"] = host_dir(base, rank // per_host)
    os.makedirs(host_dir(base, rank // per_host), exist_ok=True)  # the host's tmpfs


def train_racks(rank: int, world: int, base: str, disk: str, racks: int, spec: str,
                steps: int) -> dict[str, Any]:
    """train() with one rank per host and the hosts in ``racks`` failure domains (host h in rack
    h * racks // world: the first hosts share a rack, as a scheduler fills one rack first)."""
    os.environ["CKPTIO_FAILURE_DOMAIN"] = f"rack{rank * racks // world}" if racks else ""
    return train(rank, world, base, disk, 1, spec, steps)


def restore_racks(rank: int, world: int, base: str, disk: str, racks: int,
                  spec: str) -> dict[str, Any]:
    """restore() as train_racks() placed the ranks."""
    os.environ["CKPTIO_FAILURE_DOMAIN"] = f"rack{rank * racks // world}" if racks else ""
    return restore(rank, world, base, disk, 1, spec)


def _spec(name: str) -> Any:
    """partners-N, parity-K, parity2-K (two parity pieces)."""
    kind, _, n = name.partition("-")
    if kind == "partners":
        return ckptio.Partners(int(n))
    return ckptio.Parity(k=int(n), m=2 if kind == "parity2" else 1)


def _tiers(spec: str, disk: str) -> list[Tier]:
    return [Tier("shm://run", keep_last=2, redundancy=_spec(spec)),
            Tier(disk, every=2, keep_last=2)]


def _build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"model": model, "optim": opt, "rng": ckptio.RNGState(), "step": step}


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return copy.deepcopy({"model": model.state_dict(), "optim": opt.state_dict(),
                          "rng": torch.get_rng_state()})


def replay(rank: int, steps: int) -> dict[int, dict[str, Any]]:
    """What train() saves at each step, computed again without saving (it is seeded)."""
    model, opt = _build(seed=rank)
    saved = {}
    for step in range(1, steps + 1):
        _step(model, opt)
        saved[step] = _snapshot(model, opt)
    return saved


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(8, 16)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def kill_during_protection(base: str, host: int, step: int) -> None:
    """SIGKILL this rank once its host's protection of ``step`` has begun (its location made;
    CKPTIO_TEST_PROTECT_PAUSE_S holds every rank's protection thread there)."""
    pending = os.path.join(host_dir(base, host), "run", ".redundancy", f"step-{step}")
    deadline = time.monotonic() + 60
    while not os.path.isdir(pending) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # every rank's thread is in the encoding of this step
    os.kill(os.getpid(), signal.SIGKILL)


def train(rank: int, world: int, base: str, disk: str, per_host: int, spec: str, steps: int,
          kill_at: int = 0, delta: bool = False) -> dict[str, Any]:
    """Train ``steps`` steps saving each; -> the state saved at each step and the status.
    ``kill_at``: SIGKILL this process while the protection of that step is being encoded.
    ``delta``: the saves are deltas (DeltaPolicy's defaults), compressed with zstd, with the
    options of _DELTA."""
    _play_host(rank, per_host, base)
    model, opt = _build(seed=rank)
    mgr = ckptio.CheckpointManager(tiers=_tiers(spec, disk), options=OPTS,
                                   **(_DELTA if delta else {}))
    saved = {}
    for step in range(1, steps + 1):
        _step(model, opt)
        if step == kill_at:
            os.environ["CKPTIO_TEST_PROTECT_PAUSE_S"] = "60"
        saved[step] = _snapshot(model, opt)
        mgr.save(step, {**_state(model, opt, step), **(_frozen(rank) if delta else {})},
                 metrics={"loss": LOSSES.get(step, 0.0)} if delta else None)
        if step == kill_at:
            kill_during_protection(base, rank // per_host, step)
        latest = mgr.latest()  # a collective of this thread while the protection runs
        if latest != step:
            raise AssertionError(f"latest() {latest} after saving step {step}")
        mgr.protected()  # each step protected before the next (the tests' determinism)
    status = mgr.status()
    mgr.close()
    return {"saved": saved, "status": status[0]}


def train_burst(rank: int, world: int, base: str, disk: str, per_host: int, spec: str,
                steps: int, pause_s: float) -> dict[str, Any]:
    """Save ``steps`` steps back to back while each protection pauses ``pause_s`` after reading
    its streams (the protection falls behind), then wait for it; -> as train()."""
    _play_host(rank, per_host, base)
    os.environ["CKPTIO_TEST_PROTECT_PAUSE_S"] = str(pause_s)
    model, opt = _build(seed=rank)
    mgr = ckptio.CheckpointManager(tiers=_tiers(spec, disk), options=OPTS)
    saved = {}
    for step in range(1, steps + 1):
        _step(model, opt)
        saved[step] = _snapshot(model, opt)
        mgr.save(step, _state(model, opt, step))
    mgr.protected()
    status = mgr.status()
    mgr.close()
    return {"saved": saved, "status": status[0]}


def restore(rank: int, world: int, base: str, disk: str, per_host: int,
            spec: str, delta: bool = False) -> dict[str, Any]:
    """A restarted job: fresh weights, restore -> the state restored and how."""
    _play_host(rank, per_host, base)
    model, opt = _build(seed=1000 + rank)
    torch.manual_seed(999)  # a generator state the restore must replace
    state = {**_state(model, opt, -1), **({"frozen": torch.zeros(1 << 16)} if delta else {})}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mgr = ckptio.CheckpointManager(tiers=_tiers(spec, disk), options=OPTS,
                                       **(_DELTA if delta else {}))
        step = mgr.restore(state)
    got = _snapshot(model, opt)
    if delta:
        assert torch.equal(state["frozen"], _frozen(rank)["frozen"]), "frozen differs"
    status = mgr.status()
    mgr.close()
    return {"step": step, "state_step": state["step"], "got": got, "how": mgr.last_restore,
            "warnings": [str(w.message) for w in caught], "status": status[0]}


def restore_broken(rank: int, world: int, base: str, disk: str, per_host: int, spec: str,
                   broken: int) -> dict[str, Any]:
    """A restarted job where rank ``broken``'s state does not fit the step (a model of another
    shape: an error that is not damage) -> each rank's error and how long it took to come."""
    _play_host(rank, per_host, base)
    model, opt = _build(seed=1000 + rank)
    if rank == broken:
        model = torch.nn.Sequential(torch.nn.Linear(16, 8))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mgr = ckptio.CheckpointManager(tiers=_tiers(spec, disk), options=OPTS)
    started = time.monotonic()
    try:
        mgr.restore(_state(model, opt, -1))
    except Exception as exc:  # noqa: BLE001 - the test inspects what every rank got
        error = f"{type(exc).__name__}|{exc}"
    else:
        error = ""
    seconds = time.monotonic() - started
    mgr.close()
    return {"error": error, "seconds": seconds}


def _protected_step_1(rank: int, base: str, disk: str, spec: str,
                      peer_timeout_s: float) -> tuple[Any, Any, Any]:
    """One rank per host: a manager with ``peer_timeout_s``, step 1 saved and protected ->
    (the manager, the model, its optimizer)."""
    _play_host(rank, 1, base)
    model, opt = _build(seed=rank)
    options = dataclasses.replace(OPTS, peer_timeout_s=peer_timeout_s)
    mgr = ckptio.CheckpointManager(tiers=_tiers(spec, disk), options=options)
    _step(model, opt)
    mgr.save(1, _state(model, opt, 1))
    mgr.protected()
    return mgr, model, opt


def peer_dies(rank: int, world: int, base: str, disk: str, spec: str, victim: int,
              peer_timeout_s: float, how: str) -> dict[str, Any]:
    """One rank per host; step 1 protected; rank ``victim`` is SIGKILLed (``how`` "kill") or
    frozen (SIGSTOP, "stop": it never answers) while step 2 is being protected (after the
    metadata exchange, before the transfers). -> on the others: the
    protection's error, how long protected() took to raise it, status(), close()'s seconds."""
    mgr, model, opt = _protected_step_1(rank, base, disk, spec, peer_timeout_s)
    if rank == victim:
        os.environ["CKPTIO_TEST_PROTECT_PAUSE_S"] = "60"
    mgr.save(2, _state(model, opt, 2))
    if rank == victim:
        pending = os.path.join(host_dir(base, rank), "run", ".redundancy", "step-2")
        deadline = time.monotonic() + 60
        while not os.path.isdir(pending) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    error, seconds = _timed_error(mgr.protected)
    status = mgr.status()[0]
    started = time.monotonic()
    mgr.close()
    return {"error": error, "seconds": seconds, "status": status,
            "close_seconds": time.monotonic() - started}


def group_destroyed(rank: int, world: int, base: str, disk: str,
                    spec: str) -> dict[str, Any]:
    """One rank per host; step 1 protected; every rank destroys the process group (as a
    training loop does after a peer's failure) while step 2's protection is paused after its
    metadata exchange -> close()'s error and seconds, status() after it."""
    import torch.distributed as dist

    mgr, model, opt = _protected_step_1(rank, base, disk, spec, 10.0)
    os.environ["CKPTIO_TEST_PROTECT_PAUSE_S"] = "1"
    mgr.save(2, _state(model, opt, 2))
    pending = os.path.join(host_dir(base, rank), "run", ".redundancy", "step-2")
    deadline = time.monotonic() + 60
    while not os.path.isdir(pending) and time.monotonic() < deadline:
        time.sleep(0.02)
    dist.destroy_process_group()
    error, seconds = _timed_error(mgr.close)
    return {"error": error, "seconds": seconds, "status": mgr.status()[0]}


def calls_after_destroy(rank: int, world: int, base: str, disk: str,
                        spec: str) -> dict[str, Any]:
    """One rank per host; step 1 protected; every rank destroys the process group (a loop's
    recovery), then calls the old manager: steps(), restore(), close() -> each one's error
    ("Type|message", "" for none) and seconds."""
    import torch.distributed as dist

    mgr, model, opt = _protected_step_1(rank, base, disk, spec, 10.0)
    dist.destroy_process_group()
    out: dict[str, Any] = {}
    for name, call in (("steps", mgr.steps),
                       ("restore", lambda: mgr.restore(_state(model, opt, 0))),
                       ("close", mgr.close)):
        out[name], out[f"{name}_seconds"] = _timed_error(call)
    return out


def steps_past_a_frozen_peer(rank: int, world: int, base: str, disk: str, spec: str,
                             peer_timeout_s: float) -> dict[str, Any]:
    """One rank per host; step 1 saved and protected; then the last rank freezes (SIGSTOP)
    while the others call steps(). -> on the others: the error and how long it took."""
    mgr, _model, _opt = _protected_step_1(rank, base, disk, spec, peer_timeout_s)
    assert mgr.steps() == [1]
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    error, seconds = _timed_error(mgr.latest)
    return {"error": error, "seconds": seconds}


def _timed_error(call: Any) -> tuple[str, float]:
    """-> ("Type|message" of what ``call()`` raised, or "", the seconds it took)."""
    started = time.monotonic()
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return f"{type(exc).__name__}|{exc}", time.monotonic() - started
    return "", time.monotonic() - started


def train_budget(rank: int, world: int, base: str, disk: str, spec: str, max_bytes: int,
                 steps: int) -> dict[str, Any]:
    """One rank per host, the memory tier bounded by ``max_bytes``: save ``steps`` steps, each
    protected before the next -> the steps saved, the refusal (if any) and each step's size."""
    _play_host(rank, 1, base)
    model, opt = _build(seed=rank)
    tiers = [Tier("shm://run", keep_last=2, max_bytes=max_bytes, redundancy=_spec(spec)),
             Tier(disk, every=2, keep_last=2)]
    mgr = ckptio.CheckpointManager(tiers=tiers, options=OPTS)
    saved, error = [], ""
    for step in range(1, steps + 1):
        _step(model, opt)
        try:
            mgr.save(step, _state(model, opt, step))
        except ckptio.errors.CkptError as exc:
            error = str(exc)
            break
        saved.append(step)
        mgr.protected()
    own = os.path.join(host_dir(base, rank), "run", f"r{rank:05d}", f"step-{saved[-1]}")
    nbytes = sum(e.stat().st_size for e in os.scandir(own) if e.is_file())
    mgr.close()
    return {"saved": saved, "error": error, "step_nbytes": nbytes}


def _paced_tiers(spec: str, disk: str, rate: float) -> list[Tier]:
    redundancy = dataclasses.replace(_spec(spec), rate=rate)
    return [Tier("shm://run", keep_last=2, redundancy=redundancy), Tier(disk, every=100)]


def save_paced(rank: int, world: int, base: str, disk: str, spec: str, mib: int,
               rate: float) -> dict[str, Any]:
    """One rank per host: save one step of a ``mib`` MiB tensor under a protection budget of
    ``rate`` bytes per second per host -> the seconds from the save's return to protected(),
    the bytes of the step in this host's memory and the tensor's bytes."""
    _play_host(rank, 1, base)
    weights = torch.randn(mib * MiB // 4, generator=torch.Generator().manual_seed(rank))
    mgr = ckptio.CheckpointManager(tiers=_paced_tiers(spec, disk, rate), options=OPTS)
    mgr.save(1, {"w": weights, "step": 1})
    start = time.monotonic()
    mgr.protected()
    seconds = time.monotonic() - start
    step_dir = os.path.join(host_dir(base, rank), "run", f"r{rank:05d}", "step-1")
    nbytes = sum(os.path.getsize(os.path.join(step_dir, n)) for n in os.listdir(step_dir))
    status = mgr.status()[0]
    mgr.close()
    return {"seconds": seconds, "nbytes": nbytes, "status": status,
            "digest": _digest(weights)}


def restore_paced(rank: int, world: int, base: str, disk: str, spec: str, mib: int,
                  rate: float) -> dict[str, Any]:
    """A restarted job of save_paced's -> the step, where from, and the tensor's digest."""
    _play_host(rank, 1, base)
    state = {"w": torch.zeros(mib * MiB // 4), "step": 0}
    mgr = ckptio.CheckpointManager(tiers=_paced_tiers(spec, disk, rate), options=OPTS)
    step = mgr.restore(state)
    how = mgr.last_restore
    mgr.close()
    return {"step": step, "state_step": state["step"], "how": how, "digest": _digest(state["w"])}


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def restore_rebuild_raises(rank: int, world: int, base: str, disk: str, per_host: int,
                           spec: str, broken: int) -> dict[str, Any]:
    """``restore`` where rank ``broken``'s sum of its part of a lost piece (its share of the
    parity decode, redundancy/stripes.py) raises a RuntimeError (a bug, not damage) -> what
    restore returns, and how long it took."""
    if rank == broken:
        from ckptio.redundancy import erasure

        def fails(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("injected: the decode failed")

        erasure.mul_into = fails
    started = time.monotonic()
    out = restore(rank, world, base, disk, per_host, spec)
    return {**out, "seconds": time.monotonic() - started}


def too_few_ranks(rank: int, world: int, base: str, spec: str) -> str:
    """A manager whose redundancy needs more hosts than the job has ranks -> what each rank
    raised (every rank alike, before any group is made)."""
    _play_host(rank, 1, base)
    try:
        ckptio.CheckpointManager(tiers=[Tier("shm://run", redundancy=_spec(spec))])
    except ckptio.CkptError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "made"
