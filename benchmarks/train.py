"""Training benchmark: how long checkpoints every k steps block a real training loop.

Owns: the training loop (a GPT-like model on random tokens, real forward, backward and fused
AdamW steps on CPU), the schedule of checkpoints, the measurements of docs/BENCH_TRAIN.md
(step and save-call times, waits, T_persist, extra RSS, memcpy bandwidth, bitwise check of the
last checkpoint), one fresh process per (engine, repetition) and the command line, which writes
the markdown and JSON reports. Does not own: the progress lines, the summary, T_block and the
markdown (train_report.py), the model's shape and fill (state.py), the engines
(train_engines.py), phase helpers shared with the save/load benchmark (engines.py).

    python -m benchmarks.train --gb 1 --steps 50 --every 10 --reps 3
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import re
import shlex
import shutil
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from benchmarks import harness, worker_env
# t_block is not used here: it stays importable from train (the tests use train.t_block).
from benchmarks.train_report import (BASELINE, annotate, checkpoint_steps, markdown, progress,  # noqa: F401
                                     summarize, t_block)

if TYPE_CHECKING:
    from ckptio.tuning.state import GPT, GPTConfig
    from benchmarks.train_engines import Pending, Saver, TrainEngine

Run = dict[str, Any]
SCRATCH = re.compile(r"^\w+-r\d+$")  # what workers create
HEAD_DIM = 64


# ---------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.train",
        description="Train a GPT-like model on CPU and checkpoint it every K steps: how long each "
        "engine blocks the loop, how long until durable, what it costs in memory.")
    p.add_argument("--gb", type=float, default=1.0, help="state size target in GB, AdamW "
                   "included (12 bytes per parameter); default 1")
    p.add_argument("--steps", type=int, default=50, help="training steps per run (default 50)")
    p.add_argument("--every", type=int, default=10, help="checkpoint after every K-th step, "
                   "except the last step (default 10)")
    p.add_argument("--batch", type=int, default=2, help="sequences per step (default 2)")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--engines", default="", help="comma list (default: all available; "
                   "'none' is always run): " + ",".join(_engine_names()))
    p.add_argument("--reps", type=int, default=3, help="fresh processes per engine (default 3)")
    p.add_argument("--dir", type=Path, default=Path("bench-train"), help="scratch directory "
                   "(default ./bench-train); what the workers write there is deleted")
    p.add_argument("--pool-gb", type=float, default=None, help="ckptio staging pool in GB "
                   "(default: enough to hold the whole state)")
    p.add_argument("--json", type=Path, help="write runs and summary as JSON here")
    p.add_argument("--markdown", type=Path, help="write the markdown report here")
    p.add_argument("--idle", type=float, default=2.0, help="idle seconds before each run's loop")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per worker")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--rep", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.gb <= 0 or args.reps < 1 or args.every < 1 or args.steps <= args.every:
        p.error("need --gb > 0, --reps >= 1, --every >= 1 and --steps > --every")
    if args.seq < 1 or args.seq > 1024 or args.batch < 1:
        p.error("need 1 <= --seq <= 1024 (the model's context) and --batch >= 1")
    return args


def _engine_names() -> list[str]:
    from benchmarks.train_engines import ENGINES

    return list(ENGINES)


# ---------------------------------------------------------------- the model and one step


def build_training(gb: float, seed: int) -> tuple[GPT, torch.optim.Optimizer, GPTConfig]:
    """state.py's GPT (same S as the save/load benchmark at the same --gb) and its optimizer."""
    from ckptio.tuning import state

    torch.manual_seed(seed)
    cfg = state.gpt_config(gb)
    model = state.build_model(cfg, state.Filler(seed))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    return model, opt, cfg


def forward(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """Pre-norm GPT forward over state.GPT's modules: causal attention + GELU MLP, tied head."""
    x = model.tok_emb(idx) + model.pos_emb.weight[: idx.shape[1]]
    for b in model.blocks:
        x = x + b.proj(attention(b.qkv(b.ln1(x))))
        x = x + b.fc_out(F.gelu(b.fc(b.ln2(x))))
    return model.lm_head(model.ln_f(x))


def attention(qkv: torch.Tensor) -> torch.Tensor:
    batch, seq, width = qkv.shape
    heads = max(1, width // 3 // HEAD_DIM)
    q, k, v = qkv.view(batch, seq, 3, heads, -1).permute(2, 0, 3, 1, 4)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return y.transpose(1, 2).reshape(batch, seq, -1)


def train_step(model: GPT, opt: torch.optim.Optimizer, tokens: torch.Tensor,
               guard: Callable[[], contextlib.AbstractContextManager[Any]] | None = None) -> None:
    """One step; ``guard()`` (a peer's lock against its capture) around the optimizer step."""
    logits = forward(model, tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    with guard() if guard is not None else contextlib.nullcontext():
        opt.step()
    opt.zero_grad(set_to_none=True)


def checkpoint_state(model: GPT, opt: torch.optim.Optimizer, step: int,
                     batch: int) -> dict[str, Any]:
    """What a training job saves: live references, no copies (engines must capture them)."""
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step,
            "rng": torch.get_rng_state(), "loader": {"epoch": 0, "index": step * batch, "seed": 7}}


# ---------------------------------------------------------------- worker


def memcpy_gbps(nbytes: int, tries: int = 3) -> float:
    """Copy S bytes into a pre-allocated, pre-faulted tensor: the floor of any capture."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    best = float("inf")
    for _ in range(tries):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def children_hwm_kib() -> int:
    """Peak RSS of our child processes (DCP's helper process), summed."""
    pids = [pid for task in Path("/proc/self/task").iterdir()
            for pid in _read(task / "children").split()]
    return sum(next((int(ln.split()[1]) for ln in _read(Path(f"/proc/{pid}/status")).splitlines()
                     if ln.startswith("VmHWM:")), 0) for pid in pids)


def _read(path: Path) -> str:
    """A /proc file's text, or "" when its thread or process exited meanwhile."""
    try:
        return path.read_text()
    except OSError:
        return ""


def check_disk(root: Path, need: int) -> None:
    free = shutil.disk_usage(root).free
    if free < need + (1 << 30):
        raise SystemExit(f"{root}: {free / 1e9:.1f} GB free, the run needs {need / 1e9:.1f} GB "
                         "+ 1 GB headroom: use --dir elsewhere, fewer --steps or a larger --every")


def worker_main(args: argparse.Namespace) -> int:
    from ckptio.tuning import state
    from benchmarks import train_engines as te

    engine = te.ENGINES[args.worker]
    engine.prepare()
    t0 = time.perf_counter()
    model, opt, cfg = build_training(args.gb, args.seed)
    build_s = time.perf_counter() - t0
    nbytes = state.state_nbytes(cfg)  # before the first step creates the optimizer state
    pool = te.pool_bytes_for(args.pool_gb) if args.worker.startswith("ckptio") else None
    saver = engine.make(te.Context(opt, pool or 0)) if engine.make else None
    work = args.dir / f"{args.worker}-r{args.rep}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    saves = len(checkpoint_steps(args.steps, args.every)) if saver else 0
    check_disk(work, int(saves * nbytes * 1.1))
    gen = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(cfg.vocab, (args.steps, args.batch, args.seq + 1), generator=gen)
    settle(args.idle)
    run = train_loop(args, model, opt, tokens, SaveTimeline(saver, work) if saver else None)
    staging = getattr(saver, "staging_bytes", None)
    if saver is not None:
        saver.close()
    run.update(verify_last(engine, run.pop("last")))
    nbytes = state.tensor_nbytes(checkpoint_state(model, opt, args.steps, args.batch))  # S
    run.update({"engine": args.worker, "rep": args.rep, "bytes": nbytes, "pool_bytes": pool,
                "staging_bytes": staging,
                "build_s": build_s, "d_model": cfg.d_model, "layers": cfg.n_layers,
                "vocab": cfg.vocab, "params": cfg.n_params, "memcpy_gbps": memcpy_gbps(nbytes)})
    shutil.rmtree(work)
    harness.emit(run)
    return 0 if run["bitwise_ok"] else 3


def settle(idle: float) -> None:
    """Every run starts equally: freed heap returned, disk synced (ext4 discards of earlier runs'
    files done), idle, VmHWM reset to the current RSS."""
    from benchmarks import engines

    gc.collect()
    engines.release_free_heap()
    engines.settle_disk()
    time.sleep(idle)
    engines.reset_peak_rss()


class SaveTimeline:
    """The saves of one run: wait for the previous save to be durable, start the next, record
    when each call returned and when each save became durable. A helper thread waits on each
    save where the engine allows it, so that moment is known without the training thread
    polling; otherwise (ckptio) the engine's own total_s is the moment."""

    def __init__(self, saver: Saver, work: Path) -> None:
        self.saver, self.work = saver, work
        self.waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-wait")
        self.records: list[dict[str, Any]] = []
        self.pending: tuple[Pending, Future[None] | None] | None = None

    def save(self, saved: dict[str, Any], step: int) -> Path:
        if self.pending is not None:
            self.records[-1]["wait_after_s"] = self._wait(*self.pending)
        record: dict[str, Any] = {"step": step}
        self.records.append(record)
        path = self.work / f"step-{step}"
        t0 = time.perf_counter()
        pending = self.saver.start(saved, path)
        record["call_s"] = time.perf_counter() - t0
        watch = (self.waiter.submit(self._durable, pending.durable, t0, record)
                 if pending.durable is not None else None)
        self.pending = (pending, watch)
        return path

    @staticmethod
    def _durable(durable: Callable[[], object], t0: float, record: dict[str, Any]) -> None:
        durable()
        record["persist_s"] = time.perf_counter() - t0  # save called -> durable

    def _wait(self, pending: Pending, watch: Future[None] | None) -> float:
        """Block until the last save is durable (its error re-raised here); -> seconds."""
        t0 = time.perf_counter()
        if watch is not None:
            watch.result()
        record = self.records[-1]
        record["reported"] = pending.report()
        record.setdefault("persist_s", record["reported"].get("total_s"))
        self.pending = None
        return time.perf_counter() - t0

    def finish(self) -> float:
        waited = self._wait(*self.pending) if self.pending is not None else 0.0
        self.waiter.shutdown()
        return waited


def train_loop(args: argparse.Namespace, model: GPT, opt: torch.optim.Optimizer,
               tokens: torch.Tensor, timeline: SaveTimeline | None) -> Run:
    """Steps timed one by one, a save after each scheduled step (none without a timeline)."""
    from benchmarks.engines import status_kib
    from ckptio.tuning.state import digest

    when = checkpoint_steps(args.steps, args.every)
    step_s: list[float] = []
    rss: dict[str, int] = {}
    last: dict[str, Any] = {}
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        train_step(model, opt, tokens[step - 1])
        step_s.append(time.perf_counter() - t0)
        if step == when[0]:  # the loop's own peak, before any checkpoint
            rss = {"rss_before_kib": status_kib("VmRSS"), "train_hwm_kib": status_kib("VmHWM")}
        if timeline is None or step not in when:
            continue
        saved = checkpoint_state(model, opt, step, args.batch)
        reference = digest(saved) if step == when[-1] else ""  # untimed: state at the save moment
        path = timeline.save(saved, step)
        last = {"digest": reference, "state": saved, "path": path} if reference else last
    final_wait_s = timeline.finish() if timeline else 0.0
    ckpts = timeline.records if timeline else []
    hwm = status_kib("VmHWM")
    return {"step_s": step_s, "checkpoints": ckpts, "final_wait_s": final_wait_s,
            "train_s": sum(step_s) + sum(c["call_s"] + c.get("wait_after_s", 0.0) for c in ckpts),
            "rss_extra_mib": (hwm - rss["rss_before_kib"]) / 1024,
            "rss_over_train_peak_mib": (hwm - rss["train_hwm_kib"]) / 1024,
            "helper_hwm_mib": children_hwm_kib() / 1024, "last": last}


def verify_last(engine: TrainEngine, last: dict[str, Any]) -> Run:
    """Load the last checkpoint with the engine's own loader into an empty twin; compare digests."""
    from ckptio.tuning.state import digest, empty_destination

    if not last or engine.load is None:
        return {"bitwise_ok": True, "load_s": None}
    dest = empty_destination(last["state"])
    t0 = time.perf_counter()
    engine.load(last["path"], dest)
    load_s = time.perf_counter() - t0
    return {"bitwise_ok": digest(dest) == last["digest"], "load_s": load_s}


# ---------------------------------------------------------------- driver


def spawn(args: argparse.Namespace, engine: str, rep: int) -> Run:
    """One worker in a fresh interpreter; its last JSON line on stdout is the result."""
    env = worker_env()
    cmd = [sys.executable, "-m", "benchmarks.train", "--worker", engine, "--rep", str(rep),
           "--gb", repr(args.gb), "--steps", str(args.steps), "--every", str(args.every),
           "--batch", str(args.batch), "--seq", str(args.seq), "--dir", str(args.dir),
           "--idle", repr(args.idle), "--seed", str(args.seed)]
    cmd += ["--pool-gb", repr(args.pool_gb)] if args.pool_gb else []
    return harness.spawn(cmd, timeout=args.timeout, env=env, echo=20,
                         label={"engine": engine, "rep": rep})


def choose_engines(spec: str) -> tuple[list[str], dict[str, str]]:
    """(engines to run, the baseline first; {engine: why it cannot run})."""
    from benchmarks.train_engines import ENGINES, unavailable_reason

    names = [s.strip() for s in spec.split(",") if s.strip()] or list(ENGINES)
    names = [BASELINE] + [n for n in dict.fromkeys(names) if n != BASELINE]
    skipped = {n: why for n in names if (why := unavailable_reason(n)) is not None}
    unknown = [n for n in skipped if n not in ENGINES]
    if unknown:
        raise SystemExit("cannot run: " + "; ".join(skipped[n] for n in unknown))
    for name, why in skipped.items():
        print(f"skipping {name}: unavailable: {why}", file=sys.stderr)
    return [n for n in names if n not in skipped], skipped


def run_all(args: argparse.Namespace, names: list[str]) -> list[Run]:
    """Every engine once per repetition, the order reversed on odd repetitions."""
    return harness.repeat(names, args.reps, lambda name, rep: spawn(args, name, rep), progress)


def cleanup(root: Path, created: bool) -> None:
    """Remove what workers left (crashed runs), and the directory itself if we made it."""
    for p in root.glob("*"):
        if SCRATCH.match(p.name) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
    if created:
        shutil.rmtree(root, ignore_errors=True)



def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    names, skipped = choose_engines(args.engines)
    created = not args.dir.exists()
    args.dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        runs = run_all(args, names)
    finally:
        cleanup(args.dir, created)
    print(f"{len(runs)} runs in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    annotate(runs)
    summary = summarize(runs, names, skipped)
    text = markdown(summary, args, shlex.join(["python", "-m", "benchmarks.train", *argv]))
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    if args.json:
        args.json.write_text(json.dumps({"argv": argv, "runs": runs, "summary": summary}, indent=1))
    return 1 if any("error" in r or not r["bitwise_ok"] for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
