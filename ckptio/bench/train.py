"""Training benchmark: how long checkpoints every k steps block a real training loop.

Owns: the training loop (a GPT-like model on random tokens, real forward, backward and fused
AdamW steps on CPU), the schedule of checkpoints, the measurements of docs/BENCH_TRAIN.md
(T_block, T_persist, iteration overhead, extra RSS, memcpy bandwidth, bitwise check of the last
checkpoint), one fresh process per (engine, repetition), the summary and its markdown and JSON
reports. Does not own: the model's shape and fill (state.py), the engines (train_engines.py),
phase helpers shared with the save/load benchmark (engines.py).

    python -m ckptio.bench.train --gb 1 --steps 50 --every 10 --reps 3
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from .state import GPT, GPTConfig
    from .train_engines import Pending, Saver, TrainEngine

Run = dict[str, Any]
BASELINE = "none"
PACKAGE_ROOT = Path(__file__).resolve().parents[2]
SCRATCH = re.compile(r"^\w+-r\d+$")  # what workers create
HEAD_DIM = 64


# ---------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m ckptio.bench.train",
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
    from .train_engines import ENGINES

    return list(ENGINES)


# ---------------------------------------------------------------- the model and one step


def build_training(gb: float, seed: int) -> tuple[GPT, torch.optim.Optimizer, GPTConfig]:
    """state.py's GPT (same S as the save/load benchmark at the same --gb) and its optimizer."""
    from . import state

    torch.manual_seed(seed)
    cfg = state.gpt_config(gb)
    model = state._build_model(cfg, state.Filler(seed))
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


def train_step(model: GPT, opt: torch.optim.Optimizer, tokens: torch.Tensor) -> None:
    logits = forward(model, tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def checkpoint_state(model: GPT, opt: torch.optim.Optimizer, step: int,
                     batch: int) -> dict[str, Any]:
    """What a training job saves: live references, no copies (engines must capture them)."""
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step,
            "rng": torch.get_rng_state(), "loader": {"epoch": 0, "index": step * batch, "seed": 7}}


def checkpoint_steps(steps: int, every: int) -> list[int]:
    """Every K-th step but the last: each checkpoint is followed by steps it can overlap."""
    return list(range(every, steps, every))


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
    from . import state
    from . import train_engines as te

    engine = te.ENGINES[args.worker]
    engine.prepare()
    t0 = time.perf_counter()
    model, opt, cfg = build_training(args.gb, args.seed)
    build_s = time.perf_counter() - t0
    nbytes = state.state_nbytes(cfg)  # before the first step creates the optimizer state
    pool = te.pool_bytes_for(nbytes, args.pool_gb) if args.worker.startswith("ckptio") else None
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
    if saver is not None:
        saver.close()
    run.update(verify_last(engine, run.pop("last")))
    nbytes = state.tensor_nbytes(checkpoint_state(model, opt, args.steps, args.batch))  # S
    run.update({"engine": args.worker, "rep": args.rep, "bytes": nbytes, "pool_bytes": pool,
                "build_s": build_s, "d_model": cfg.d_model, "layers": cfg.n_layers,
                "vocab": cfg.vocab, "params": cfg.n_params, "memcpy_gbps": memcpy_gbps(nbytes)})
    shutil.rmtree(work)
    print(json.dumps(run), flush=True)
    return 0 if run["bitwise_ok"] else 3


def settle(idle: float) -> None:
    """Every run starts equally: freed heap returned, disk synced (ext4 discards of earlier runs'
    files done), idle, VmHWM reset to the current RSS."""
    from . import engines

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
    from .engines import status_kib
    from .state import digest

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
    from .state import digest, empty_destination

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
    path = [str(PACKAGE_ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    cmd = [sys.executable, "-m", "ckptio.bench.train", "--worker", engine, "--rep", str(rep),
           "--gb", repr(args.gb), "--steps", str(args.steps), "--every", str(args.every),
           "--batch", str(args.batch), "--seq", str(args.seq), "--dir", str(args.dir),
           "--idle", repr(args.idle), "--seed", str(args.seed)]
    cmd += ["--pool-gb", repr(args.pool_gb)] if args.pool_gb else []
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"engine": engine, "rep": rep, "error": f"timed out after {args.timeout} s"}
    for line in proc.stderr.strip().splitlines()[-20:]:
        print(f"    | {line}", file=sys.stderr)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return {"engine": engine, "rep": rep,
                "error": f"worker exited {proc.returncode} without a result (see above)"}
    return {**json.loads(lines[-1]), "wall_s": time.perf_counter() - t0}


def choose_engines(spec: str) -> tuple[list[str], dict[str, str]]:
    """(engines to run, the baseline first; {engine: why it cannot run})."""
    from .train_engines import ENGINES, unavailable_reason

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
    total, runs = args.reps * len(names), []
    for rep in range(args.reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            runs.append(spawn(args, name, rep))
            print(progress(runs[-1], len(runs), total), file=sys.stderr, flush=True)
    return runs


def progress(run: Run, index: int, total: int) -> str:
    head = f"[{index}/{total} rep {run['rep'] + 1}] {run['engine']}:"
    if "error" in run:
        return f"{head} FAILED {run['error']}"
    calls = ", ".join(f"{c['call_s']:.3f}" for c in run["checkpoints"]) or "-"
    persist = ", ".join(f"{c['persist_s']:.2f}" for c in run["checkpoints"]) or "-"
    return (f"{head} step median {statistics.median(run['step_s']):.3f} s, "
            f"train {run['train_s']:.1f} s, "
            f"save calls [{calls}] s, persist [{persist}] s, RSS+ {run['rss_extra_mib']:.0f} MiB, "
            f"bitwise {'ok' if run['bitwise_ok'] else 'MISMATCH'} (wall {run['wall_s']:.1f} s)")


def cleanup(root: Path, created: bool) -> None:
    """Remove what workers left (crashed runs), and the directory itself if we made it."""
    for p in root.glob("*"):
        if SCRATCH.match(p.name) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
    if created:
        shutil.rmtree(root, ignore_errors=True)


# ---------------------------------------------------------------- summary


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def baselines(runs: list[Run]) -> dict[int, float]:
    """Per repetition: the median step time of the 'none' run, the first (warm-up) step left out."""
    return {r["rep"]: statistics.median(r["step_s"][1:]) for r in runs
            if r["engine"] == BASELINE and "error" not in r}


def annotate(runs: list[Run]) -> None:
    """Add to each run its baseline, every checkpoint's T_block and the iteration overhead."""
    from .train_engines import ENGINES

    base = baselines(runs)
    train = {r["rep"]: r["train_s"] for r in runs if r["engine"] == BASELINE and "error" not in r}
    for r in (r for r in runs if "error" not in r):
        r["base_step_s"], r["base_from"] = base_for(r, base)
        r["overhead_pct"] = (100 * (r["train_s"] / train[r["rep"]] - 1) if r["rep"] in train
                             else None)
        ends = [c["step"] for c in r["checkpoints"][1:]] + [len(r["step_s"])]
        for c, end in zip(r["checkpoints"], ends):
            c["t_block_s"] = t_block(c, r["step_s"][c["step"] : end], r["base_step_s"],
                                     ENGINES[r["engine"]].is_async)


def base_for(r: Run, base: dict[int, float]) -> tuple[float | None, str]:
    if r["rep"] in base:
        return base[r["rep"]], "none, same rep"
    if base:
        return median(list(base.values())), "none, other reps"
    first = r["checkpoints"][0]["step"] if r["checkpoints"] else len(r["step_s"])
    return median(r["step_s"][1:first]), "own steps before the first checkpoint"


def t_block(c: dict[str, Any], following: list[float], base: float | None, is_async: bool) -> float:
    """Save call + wait for durability before the next save + (async engines) the time the
    steps up to the next checkpoint took beyond the baseline median step, floored at 0."""
    extra = max(0.0, sum(s - base for s in following)) if is_async and base is not None else 0.0
    return c["call_s"] + c.get("wait_after_s", 0.0) + extra


def first_and_rest(runs: list[Run], get: Callable[[dict[str, Any]], float | None]
                   ) -> tuple[float | None, float | None]:
    """(median over runs of the first checkpoint's value, median over runs of the median of the
    later checkpoints' values)."""
    firsts = [v for r in runs if r["checkpoints"] and (v := get(r["checkpoints"][0])) is not None]
    rests = [median(vs) for r in runs
             if (vs := [v for c in r["checkpoints"][1:] if (v := get(c)) is not None])]
    return median(firsts), median([v for v in rests if v is not None])


def steady_t_block(r: Run) -> float:
    """The median T_block of the later checkpoints (the first one's when there is only one)."""
    values = [c["t_block_s"] for c in r["checkpoints"]]
    return statistics.median(values[1:] or values)


def summarize_engine(name: str, runs: list[Run]) -> dict[str, Any]:
    good = [r for r in runs if "error" not in r]
    row: dict[str, Any] = {"engine": name, "runs": len(runs), "failed": len(runs) - len(good)}
    for key, get in (("t_block", lambda c: c["t_block_s"]), ("call", lambda c: c["call_s"]),
                     ("persist", lambda c: c["persist_s"]),
                     ("blocked", lambda c: c.get("reported", {}).get("blocked_s"))):
        row[f"{key}_first_s"], row[f"{key}_s"] = first_and_rest(good, get)

    def med(key: str) -> float | None:
        return median([r[key] for r in good if r.get(key) is not None])

    for key in ("base_step_s", "overhead_pct", "rss_extra_mib", "rss_over_train_peak_mib",
                "helper_hwm_mib", "memcpy_gbps", "load_s", "train_s"):
        row[key] = med(key)
    row["step_s"] = median([statistics.median(r["step_s"][1:]) for r in good])
    row["t_block_x_memcpy"] = median([steady_t_block(r) / (r["bytes"] / 1e9 / r["memcpy_gbps"])
                                      for r in good if r["checkpoints"]])
    row["bitwise_ok"] = bool(good) and all(r["bitwise_ok"] for r in good)
    return row


def summarize(runs: list[Run], names: list[str], skipped: dict[str, str]) -> dict[str, Any]:
    good = [r for r in runs if "error" not in r]
    nbytes = good[0]["bytes"] if good else None
    bw = median([r["memcpy_gbps"] for r in good])
    memcpy_s = nbytes / 1e9 / bw if nbytes and bw else None
    rows = [summarize_engine(n, [r for r in runs if r["engine"] == n]) for n in names]
    eager = next((r for r in rows if r["engine"] == "ckptio_eager"), None)
    target = None
    if eager and memcpy_s and (tb := eager["t_block_s"] or eager["t_block_first_s"]) is not None:
        target = {"t_block_s": tb, "limit_s": 1.1 * memcpy_s, "met": tb <= 1.1 * memcpy_s}
    model = {k: good[0][k] for k in ("d_model", "layers", "vocab", "params")} if good else {}
    pool = next((r["pool_bytes"] for r in good if r.get("pool_bytes")), None)
    return {"bytes": nbytes, "memcpy_gbps": bw, "memcpy_s": memcpy_s, "eager_target": target,
            "rows": rows, "unavailable": skipped, "model": model, "pool_bytes": pool}


# ---------------------------------------------------------------- markdown

HEADER = ("| engine | T_block 1st s | T_block s | blocked_s (self) | save call s | T_persist 1st s "
          "| T_persist s | overhead % | step s | RSS+ MiB | RSS+ over train peak MiB | helper RSS MiB "
          "| T_block / memcpy | load s | bitwise |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")


def fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def table_row(r: dict[str, Any]) -> str:
    ok = "ok" if r["bitwise_ok"] else "MISMATCH"
    ok += f" ({r['failed']} failed)" if r["failed"] else ""
    self_count = (r["blocked_first_s"], r["blocked_s"])
    blocked = " / ".join(map(fmt, self_count)) if self_count != (None, None) else "-"
    cells = [r["engine"], fmt(r["t_block_first_s"]), fmt(r["t_block_s"]), blocked, fmt(r["call_s"]),
             fmt(r["persist_first_s"], ".2f"), fmt(r["persist_s"], ".2f"),
             fmt(r["overhead_pct"], "+.1f"), fmt(r["step_s"]), fmt(r["rss_extra_mib"], ".0f"),
             fmt(r["rss_over_train_peak_mib"], ".0f"), fmt(r["helper_hwm_mib"], ".0f"),
             fmt(r["t_block_x_memcpy"], ".2f"), fmt(r["load_s"], ".2f"), ok]
    return "| " + " | ".join(cells) + " |"


def markdown(summary: dict[str, Any], args: argparse.Namespace, command: str) -> str:
    from .train_engines import ENGINES

    s, m, pool = summary["bytes"] or 0, summary["model"], summary["pool_bytes"]
    pool_note = ("-" if pool is None else f"{pool / 1e6:,.0f} MB " + (
        "(--pool-gb)" if args.pool_gb else "(default: holds the whole state)"))
    lines = [
        "## Checkpointing during training", "", f"`{command}`  ",
        f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"dir `{args.dir.resolve()}`, {args.reps} reps, one fresh process per engine and rep; "
        "medians over reps  ",
        f"model: GPT d_model {m.get('d_model')}, {m.get('layers')} blocks, vocab {m.get('vocab')}, "
        f"{m.get('params', 0) / 1e6:.1f} M params, fused AdamW; S = {s:,} bytes; {args.steps} steps "
        f"of {args.batch} x {args.seq} random tokens; checkpoint after steps "
        f"{checkpoint_steps(args.steps, args.every)}  ",
        f"memcpy (S bytes into pre-faulted memory, best of 3): {fmt(summary['memcpy_gbps'], '.2f')} "
        f"GB/s, S / memcpy = {fmt(summary['memcpy_s'])} s; ckptio pool: {pool_note}", "",
        HEADER, *[table_row(r) for r in summary["rows"]], ""]
    if (t := summary["eager_target"]) is not None:
        lines.append(f"- target eager T_block <= 1.1 x S / memcpy = {t['limit_s']:.3f} s: "
                     f"{t['t_block_s']:.3f} s, {'met' if t['met'] else 'NOT met'}")
    lines += [f"- {name}: unavailable: {why}" for name, why in summary["unavailable"].items()]
    lines += [f"- {r['engine']}: {ENGINES[r['engine']].note}" for r in summary["rows"]]
    lines += ["- T_block: save call + wait for it to be durable before the next save + for async "
              "engines the steps up to the next checkpoint beyond the baseline median step "
              "(floored at 0); 1st = first checkpoint, else median of the later ones; see "
              "docs/BENCH_TRAIN.md. blocked_s: ckptio's own count (first / later). overhead: "
              "training wall time / the none run's of the same rep - 1. RSS+: peak VmHWM minus "
              "VmRSS before the first checkpoint; over train peak: minus the loop's own peak", ""]
    return "\n".join(lines)


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
    text = markdown(summary, args, shlex.join(["python", "-m", "ckptio.bench.train", *argv]))
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    if args.json:
        args.json.write_text(json.dumps({"argv": argv, "runs": runs, "summary": summary}, indent=1))
    return 1 if any("error" in r or not r["bitwise_ok"] for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
