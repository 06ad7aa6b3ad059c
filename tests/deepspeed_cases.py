"""Rank functions for tests/test_deepspeed.py: a real DeepSpeed engine (CPU accelerator, gloo)
on a small model with an optimizer and an LR scheduler, trained, saved and resumed through
ckptio.deepspeed_engine (module-level so ckptio.testing.rank_processes.run_ranks can spawn
them by name)."""

from __future__ import annotations

import os
import signal
from typing import Any

import torch

SAVE_AT = 3  # steps before the first save
MORE = 3  # steps after it


def engine_for(stage: int, world_size: int) -> Any:
    """A fresh DeepSpeed engine (ZeRO ``stage``) on a fresh model, seeded alike on every run."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("LOCAL_RANK", str(torch.distributed.get_rank()))
    import importlib

    import deepspeed

    # DeepSpeed's CPU backend JIT-compiles (g++, minutes) a shared-memory allreduce op for
    # inference at initialize; training does not use it, so these tests skip the compile
    # ("deepspeed.comm.torch" by name: the package's attribute ``torch`` is torch itself)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                                torch.nn.ReLU(), torch.nn.Linear(32, 4))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config_for(stage))
    return engine


def config_for(stage: int) -> dict[str, Any]:
    """The DeepSpeed config of these tests: Adam, WarmupLR, ZeRO ``stage``."""
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4,
                                                     "warmup_max_lr": 1e-2}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1000,
    }


def train(engine: Any, steps: int) -> list[float]:
    """``steps`` optimizer steps on data that depends only on the step and the rank."""
    losses = []
    rank = torch.distributed.get_rank()
    for _ in range(steps):
        g = torch.Generator().manual_seed(1000 * engine.global_steps + rank)
        x = torch.randn(4, 8, generator=g)
        loss = (engine(x) - 1).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def snapshot(engine: Any) -> dict[str, Any]:
    """This rank's parameters (its ZeRO-3 partitions), optimizer and scheduler state."""
    params = [(p.ds_tensor if hasattr(p, "ds_tensor") else p).detach().clone()
              for p in engine.module.parameters()]
    return {"params": params, "optimizer": flat(engine.optimizer.state_dict()),
            "scheduler": engine.lr_scheduler.state_dict(), "step": engine.global_steps}


def flat(value: Any, key: str = "") -> list[tuple[str, Any]]:
    """The tensors and plain values of a nested state, by key path."""
    if isinstance(value, dict):
        return [x for k, v in value.items() for x in flat(v, f"{key}/{k}")]
    if isinstance(value, (list, tuple)):
        return [x for i, v in enumerate(value) for x in flat(v, f"{key}/{i}")]
    if isinstance(value, torch.Tensor):
        return [(key, value.detach().clone())]
    return [(key, value if isinstance(value, (int, float, str, bool, type(None))) else repr(value))]


def save_then_go_on(rank: int, world_size: int, root: str, stage: int,
                    decoupled: bool) -> dict[str, Any]:
    """Train SAVE_AT steps, save through ckptio, train MORE: the uninterrupted run."""
    import ckptio.deepspeed_engine

    engine = engine_for(stage, world_size)
    ckptio.deepspeed_engine.use(engine, decoupled=decoupled, allow_pickle=True)
    train(engine, SAVE_AT)
    engine.save_checkpoint(root)
    losses = train(engine, MORE)
    if decoupled:  # a save after the last step: committed by commit_now, not by a step
        engine.save_checkpoint(f"{root}-final")
        ckptio.deepspeed_engine.commit_now(engine)
    engine.destroy()
    return {**snapshot(engine), "losses": losses}


def resume(rank: int, world_size: int, root: str, stage: int, tag: str | None = None,
           steps: int = MORE) -> dict[str, Any]:
    """A fresh engine loads ``root`` (its 'latest' tag) through ckptio, then trains on."""
    import ckptio.deepspeed_engine

    engine = engine_for(stage, world_size)
    ckptio.deepspeed_engine.use(engine, allow_pickle=True)
    path, client = engine.load_checkpoint(root, tag=tag)
    assert path is not None, f"nothing loaded from {root}"
    losses = train(engine, steps)
    return {**snapshot(engine), "losses": losses, "loaded": path}


def killed_mid_save(rank: int, world_size: int, root: str,
                    runs: list[tuple[int, bool]]) -> None:
    """For each (stage, decoupled), into root/<i>: save tag global_step3, train 2 steps, save
    global_step5 without its commit: a decoupled engine's save_checkpoint returns, and no step
    commits it; a sync engine's second file of that tag is never written. Then the job is
    killed (SIGKILL), its saves in flight with it."""
    import ckptio.deepspeed_engine

    for i, (stage, decoupled) in enumerate(runs):
        engine = engine_for(stage, world_size)
        ours = ckptio.deepspeed_engine.use(engine, decoupled=decoupled, allow_pickle=True)
        train(engine, SAVE_AT)
        engine.save_checkpoint(os.path.join(root, str(i)))
        train(engine, 2)
        if not decoupled:
            ours.save = _dies_at_second(ours.save)  # type: ignore[method-assign]
        engine.save_checkpoint(os.path.join(root, str(i)))
    os.kill(os.getpid(), signal.SIGKILL)


def _dies_at_second(save: Any) -> Any:
    calls = [0]

    def save_or_die(state_dict: Any, path: str) -> None:
        calls[0] += 1
        if calls[0] == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        save(state_dict, path)

    return save_or_die


def load_tag(rank: int, world_size: int, root: str, stage: int, tag: str) -> str:
    """load_checkpoint(root, tag) in a fresh engine: 'loaded', or the error's type and text."""
    import ckptio.deepspeed_engine

    engine = engine_for(stage, world_size)
    ckptio.deepspeed_engine.use(engine, allow_pickle=True)
    try:
        path, _ = engine.load_checkpoint(root, tag=tag)
    except Exception as exc:  # noqa: BLE001 - the test checks which error it is
        return f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
    return f"loaded {path}"


def save_each(rank: int, world_size: int, root: str,
              runs: list[tuple[int, bool]]) -> list[dict[str, Any]]:
    """save_then_go_on for each (stage, decoupled), into root/<i>, in one job."""
    return [save_then_go_on(rank, world_size, os.path.join(root, str(i)), stage, decoupled)
            for i, (stage, decoupled) in enumerate(runs)]


def resume_each(rank: int, world_size: int, jobs: list[tuple[str, int, str | None]]) -> list[Any]:
    """For each (root, stage, tag) in one fresh job: resume's result (tag None: DeepSpeed's
    'latest'), or load_tag's text where a tag is given."""
    out: list[Any] = []
    for root, stage, tag in jobs:
        if tag is not None:
            out.append(load_tag(rank, world_size, root, stage, tag))
            continue
        try:
            out.append(resume(rank, world_size, root, stage))
        except Exception as exc:  # noqa: BLE001 - reported to the test, which names the stage
            out.append(f"{type(exc).__name__}: {exc}")
    return out


def start_killed_job(root: str, runs: list[tuple[int, bool]]) -> list[Any]:
    """killed_mid_save on two fresh processes (run_ranks wants an answer from some rank; here
    every rank dies) -> the processes (wait() gives their exit codes); their output goes to
    root.rank<r>.log."""
    import json
    import subprocess
    import sys

    from ckptio.testing.rank_processes import free_port

    port, here = free_port(), os.path.dirname(os.path.abspath(__file__))
    code = ("import json, sys, torch.distributed as dist, deepspeed_cases as c; "
            "r = int(sys.argv[1]); dist.init_process_group('gloo', init_method=sys.argv[2], "
            "rank=r, world_size=2); c.killed_mid_save(r, 2, sys.argv[3], json.loads(sys.argv[4]))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")])}
    procs = []
    for r in range(2):  # their output in root.rank<r>.log
        with open(f"{root}.rank{r}.log", "wb") as log:
            procs.append(subprocess.Popen([sys.executable, "-c", code, str(r),
                                           f"tcp://127.0.0.1:{port}", root, json.dumps(runs)],
                                          env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def weights_on_fewer(rank: int, world_size: int, root: str, stage: int) -> Any:
    """A fresh engine on fewer ranks: load_checkpoint(load_module_only=True) -> the module's
    parameters (gathered under ZeRO-3), or the error's type and text."""
    import ckptio.deepspeed_engine

    engine = engine_for(stage, world_size)
    ckptio.deepspeed_engine.use(engine, allow_pickle=True)
    try:
        path, _ = engine.load_checkpoint(root, load_module_only=True,
                                         load_optimizer_states=False,
                                         load_lr_scheduler_states=False)
    except Exception as exc:  # noqa: BLE001 - the test checks which error it is
        return f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
    if stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def zero3_weights_only(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """A ZeRO-3 job saves at step SAVE_AT; fresh jobs then load its weights without optimizer
    states: straight (DeepSpeed reads them through zero_to_fp32, whose torch.load ckptio's
    engine answers) and from a to_torch_save copy -> what each did."""
    import ckptio.deepspeed_engine

    def fresh() -> Any:
        engine = engine_for(3, world_size)
        ckptio.deepspeed_engine.use(engine, allow_pickle=True)
        return engine

    def params(engine: Any) -> list[torch.Tensor]:
        return [p.ds_tensor.detach().clone() for p in engine.module.parameters()]

    engine = fresh()
    train(engine, SAVE_AT)
    engine.save_checkpoint(root)
    saved = params(engine)
    engine.destroy()
    out: dict[str, Any] = {}
    try:
        engine = fresh()
        engine.load_checkpoint(root, load_optimizer_states=False)
        out["straight"] = all(torch.equal(a, b) for a, b in zip(params(engine), saved))
    except Exception as exc:  # noqa: BLE001 - the test reads which exception it was
        out["straight"] = f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
    copy = ckptio.deepspeed_engine.to_torch_save(root, f"{root}-torch")
    engine = fresh()
    engine.load_checkpoint(copy, load_optimizer_states=False)
    out["from_copy"] = all(torch.equal(a, b) for a, b in zip(params(engine), saved))
    return out


def save_16bit(rank: int, world_size: int, root: str, decoupled: bool) -> bool:
    """A trained step, then ``save_16bit_model(root)`` through ckptio's engine -> whether
    ``root/pytorch_model.bin`` is a torch.save file holding the module's weights, and ``root``
    holds nothing else (no run lease: an export, not a run)."""
    from ckptio.deepspeed_engine import use

    engine = engine_for(1, world_size)
    use(engine, decoupled=decoupled)
    train(engine, 1)
    engine.save_16bit_model(root)
    saved = torch.load(os.path.join(root, "pytorch_model.bin"), weights_only=True)
    want = engine.module.state_dict()
    return (saved.keys() == want.keys() and all(torch.equal(saved[k], want[k]) for k in want)
            and os.listdir(root) == ["pytorch_model.bin"])


def second_job(rank: int, world_size: int, save_dir: str, take_over: bool) -> dict[str, Any]:
    """A job that trains a step and saves into ``save_dir``, where another job may hold the
    run lease -> what its save_checkpoint raised (type and message; none: it saved) and the
    tags there after it."""
    import ckptio
    from ckptio.deepspeed_engine import use

    engine = engine_for(1, world_size)
    use(engine, allow_pickle=True, take_over=take_over)
    train(engine, 1)
    error = None
    try:
        engine.save_checkpoint(save_dir)
    except ckptio.CkptError as exc:
        error = (type(exc).__name__, str(exc))
    engine.destroy()
    return {"error": error, "there": sorted(os.listdir(save_dir))}


def url_dirs(rank: int, world_size: int, cwd: str) -> list[tuple[str, str]]:
    """save_checkpoint and load_checkpoint given an ``s3://`` URL, run from ``cwd`` -> what
    each raised (type, message)."""
    import ckptio
    from ckptio.deepspeed_engine import use

    os.chdir(cwd)
    engine = engine_for(1, world_size)
    use(engine, allow_pickle=True)
    train(engine, 1)
    out = []
    for call in (lambda: engine.save_checkpoint("s3://bucket/run"),
                 lambda: engine.load_checkpoint("s3://bucket/run")):
        try:
            call()
            out.append(("", ""))
        except ckptio.CkptError as exc:
            out.append((type(exc).__name__, str(exc)))
    engine.destroy()
    return out


def save_into_faults(rank: int, world_size: int, save_dir: str) -> dict[str, Any]:
    """ZeRO 1, sync: train a step, save_checkpoint into ``save_dir`` (a fault file system fails
    one rank's write), then train on and save again -> what the first save raised on this rank
    (type, message), how long it took, and whether the second save went through."""
    import time

    import ckptio
    from ckptio.deepspeed_engine import use

    engine = engine_for(1, world_size)
    use(engine, allow_pickle=True)
    train(engine, 1)
    started, error = time.monotonic(), None
    try:
        engine.save_checkpoint(save_dir)
    except ckptio.CkptError as exc:
        error = (type(exc).__name__, str(exc))
    seconds = time.monotonic() - started
    train(engine, 1)
    engine.save_checkpoint(save_dir)
    latest = open(os.path.join(save_dir, "latest")).read()
    engine.destroy()
    return {"error": error, "seconds": seconds, "latest": latest}
