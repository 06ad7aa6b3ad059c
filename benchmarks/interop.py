"""Interop benchmark driver: Hugging Face export, cold load of a DCP checkpoint and dcp.save,
ckptio against DCP's own tools and the disk's O_DIRECT ceiling, one fresh process per run.

Owns: setup (the inputs written once, untimed: a ckptio checkpoint, DCP dirs and DCP's
HF-sharded output of the same GPT+AdamW state, with per-tensor digests), the protocol of
docs/BENCHMARKING.md (a fresh process per (engine, repetition), alternating order, page cache
dropped before each timed phase, peak extra RSS, bitwise checks), the summary and its markdown.
Does not own: the engines (interop_engines.py), the state (ckptio.tuning.state), the ceiling
(save_load.py's ceiling worker, run in the same repetition).

    python -m benchmarks.interop --gb 2 --reps 3 --markdown docs/results/interop/interop.md
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks import fmt, median

Run = dict[str, Any]
CEILING = "ceiling"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.interop", description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=2.0, help="state size in GB (default 2)")
    p.add_argument("--dir", type=Path, default=Path("bench-data/interop"),
                   help="scratch directory on the disk under test; removed at the end")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--engines", default="", help="comma list (default: every available engine)")
    p.add_argument("--idle", type=float, default=2.0, help="idle seconds before each timed phase")
    p.add_argument("--markdown", type=Path)
    p.add_argument("--json", type=Path)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--keep", action="store_true", help="keep the scratch directory")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--rep", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------- workers (fresh processes)


def inputs_of(root: Path) -> Any:
    from benchmarks.interop_engines import Inputs

    return Inputs(root / "in-ckptio", root / "in-dcp", root / "in-dcp-model", root / "in-hf")


def setup_worker(args: argparse.Namespace) -> Run:
    """Write every engine's input once from the same state, and the digests that check them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

    import ckptio
    from benchmarks.interop_engines import tensor_digests
    from ckptio.tuning import state

    src = state.build_state(args.gb, 0)
    inputs = inputs_of(args.dir)
    ckptio.save(src, str(inputs.ckptio_full))
    dcp.save(src, storage_writer=dcp.FileSystemWriter(str(inputs.dcp_full)), no_dist=True)
    dcp.save({"model": src["model"]}, storage_writer=dcp.FileSystemWriter(str(inputs.dcp_model)),
             no_dist=True)
    model = {k: v.clone() for k, v in src["model"].items()}  # safetensors refuses shared storage
    dcp.save(model, storage_writer=HuggingFaceStorageWriter(str(inputs.hf_sharded),
                                                            save_distributed=True), no_dist=True)
    digests = {"model": tensor_digests(src["model"]), "tied": tied_keys(src["model"]),
               "state": state.digest(src),
               "model_bytes": state.tensor_nbytes(src["model"]),  # a tied weight once
               "state_bytes": state.tensor_nbytes(src)}
    (args.dir / "digests.json").write_text(json.dumps(digests))
    return {"engine": "setup", "rep": 0, "ok": True}


def engine_worker(args: argparse.Namespace) -> Run:
    from benchmarks import engines as timing
    from benchmarks.interop_engines import ENGINES, EXPORT, LOAD, RUNNERS
    from ckptio.tuning import state

    importlib_prepare()
    engine, inputs = ENGINES[args.worker], inputs_of(args.dir)
    digests = json.loads((args.dir / "digests.json").read_text())
    out = args.dir / f"out-{args.worker}-r{args.rep}"
    shutil.rmtree(out, ignore_errors=True)
    run: Run = {"engine": engine.name, "part": engine.part, "rep": args.rep}
    if engine.part == EXPORT:
        cache = harness.cold([args.dir])
        phase = timing.timed_phase(lambda: RUNNERS[engine.name](inputs, out), args.idle)
        ok = export_matches(out, digests["model"], set(digests["tied"]))
        nbytes = digests["model_bytes"]
    elif engine.part == LOAD:
        src = state.build_state(args.gb, 0)
        dest = state.empty_destination(src)
        del src
        state.prefault(dest)
        cache = harness.cold([args.dir])
        phase = timing.timed_phase(lambda: RUNNERS[engine.name](inputs, dest), args.idle)
        ok, nbytes = state.digest(dest) == digests["state"], digests["state_bytes"]
    else:
        src = state.build_state(args.gb, 0)
        timing.reset_peak_rss()
        rss_before = timing.status_kib("VmRSS")
        first = timing.timed_phase(lambda: RUNNERS[engine.name](src, out / "first"), args.idle,
                                   reset_peak=False)
        shutil.rmtree(out / "first")
        cache = "-"
        phase = timing.timed_phase(lambda: RUNNERS[engine.name](src, out / "second"), args.idle,
                                   reset_peak=False)
        # RSS+ spans both saves (a pool allocated by the first is extra memory too)
        phase = dataclasses.replace(
            phase, extra_rss_mib=(timing.status_kib("VmHWM") - rss_before) / 1024)
        run["first_s"] = first.seconds
        ok = saved_matches(engine.name, out / "second", digests["state"], args.gb)
        nbytes = digests["state_bytes"]
    shutil.rmtree(out, ignore_errors=True)
    return {**run, "seconds": phase.seconds, "rss_mib": phase.extra_rss_mib, "bytes": nbytes,
            "cache_drop": cache, "bitwise_ok": ok}


def importlib_prepare() -> None:
    """Import what the engines use before any clock starts (DCP's import alone is ~1 s)."""
    import torch.distributed.checkpoint
    import torch.distributed.checkpoint.format_utils  # noqa: F401

    # `import ckptio` alone is lazy (PEP 562): the modules behind ckptio.load, export_hf and
    # DcpReader/DcpWriter are imported here, outside the clock, as DCP's are
    import ckptio.dcp
    import ckptio.export
    import ckptio.shared  # noqa: F401


def export_matches(out: Path, want: dict[str, str], tied: set[str]) -> bool:
    """Every exported tensor equals the source's (digest by key; keys without "model."), and
    only ``tied`` keys (their storage another key's) may be left out."""
    import torch

    from benchmarks.interop_engines import tensor_digests

    got: dict[str, str] = {}
    for file in sorted(out.glob("*.safetensors")):
        from safetensors.torch import load_file

        got.update(tensor_digests(load_file(str(file))))
    for file in sorted(out.glob("*.pt")):
        loaded = torch.load(file, weights_only=True)
        got.update(tensor_digests(loaded.get("model", loaded)))
    return bool(got) and all(got.get(k) == d for k, d in want.items() if k in got) and \
        set(want) - set(got) <= tied


def tied_keys(tensors: dict[str, Any]) -> list[str]:
    """Keys an HF export may leave out: a tensor that is an earlier key's very storage (a tied
    weight, e.g. lm_head), not merely equal to it (LayerNorm weights all start as ones)."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    tied = []
    for key, t in tensors.items():
        where = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if where in seen:
            tied.append(key)
        seen.add(where)
    return tied


def saved_matches(engine: str, path: Path, want: str, gb: float) -> bool:
    """What a save wrote loads back (fresh, through dcp.load into an empty copy) bitwise."""
    import torch.distributed.checkpoint as dcp

    import ckptio
    from ckptio.tuning import state

    dest = state.empty_destination(state.build_state(gb, 0))
    if engine == "dcp_save_ckptio_writer":  # an ordinary ckptio checkpoint
        ckptio.load(str(path), dest)
    else:
        dcp.load(dest, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    return state.digest(dest) == want


def worker_main(args: argparse.Namespace) -> int:
    warnings.simplefilter("ignore")
    run = setup_worker(args) if args.worker == "setup" else engine_worker(args)
    return harness.emit(run)


# ---------------------------------------------------------------- driver


def spawn(args: argparse.Namespace, worker: str, rep: int) -> Run:
    module = "benchmarks.save_load" if worker == CEILING else "benchmarks.interop"
    return harness.spawn(harness.command(module, worker, "--gb", repr(args.gb), "--dir", args.dir,
                                         "--rep", rep, "--idle", repr(args.idle)),
                         timeout=args.timeout, label={"engine": worker, "rep": rep})


def choose(spec: str) -> list[str]:
    from benchmarks.interop_engines import ENGINES, unavailable_reason

    names = [s.strip() for s in spec.split(",") if s.strip()] or list(ENGINES)
    chosen = []
    for name in names:
        if (why := unavailable_reason(name)) is None:
            chosen.append(name)
        else:
            print(f"skipping {name}: {why}", file=sys.stderr)
    return chosen


def describe(run: Run) -> str:
    head = f"[rep {run['rep'] + 1}] {run['engine']}:"
    if "error" in run:
        return f"{head} FAILED: {run['error']}"
    if run["engine"] == CEILING:
        gb = run["bytes"] / 1e9
        return f"{head} write {gb / run['write_s']:.2f} GB/s, read {gb / run['read_s']:.2f} GB/s"
    return (f"{head} {run['seconds']:.2f} s ({run['bytes'] / 1e9 / run['seconds']:.2f} GB/s), "
            f"RSS+ {run['rss_mib']:.0f} MiB, bitwise {'ok' if run['bitwise_ok'] else 'MISMATCH'}")


def run_all(args: argparse.Namespace, engines: list[str]) -> list[Run]:
    return harness.repeat(engines + [CEILING], args.reps,
                          lambda worker, rep: spawn(args, worker, rep),
                          lambda run, _i, _n: describe(run))


# ---------------------------------------------------------------- summary and markdown


def summarize(runs: list[Run]) -> dict[str, Any]:
    from benchmarks.interop_engines import ENGINES

    ceil = [r for r in runs if r["engine"] == CEILING and "error" not in r]
    out: dict[str, Any] = {
        "write_gbps": median([r["bytes"] / 1e9 / r["write_s"] for r in ceil]),
        "read_gbps": median([r["bytes"] / 1e9 / r["read_s"] for r in ceil]), "rows": []}
    for name in dict.fromkeys(r["engine"] for r in runs if r["engine"] != CEILING):
        mine = [r for r in runs if r["engine"] == name]
        good = [r for r in mine if "error" not in r]
        out["rows"].append({
            "engine": name, "part": ENGINES[name].part, "runs": len(mine),
            "failed": len(mine) - len(good), "error": next((r["error"] for r in mine if "error" in r), None),
            "seconds": median([r["seconds"] for r in good]),
            "min_s": min((r["seconds"] for r in good), default=None),
            "max_s": max((r["seconds"] for r in good), default=None),
            "first_s": median([r["first_s"] for r in good if "first_s" in r]),
            "gbps": median([r["bytes"] / 1e9 / r["seconds"] for r in good]),
            "rss_mib": median([r["rss_mib"] for r in good]),
            "bytes": good[0]["bytes"] if good else None,
            "bitwise_ok": bool(good) and all(r["bitwise_ok"] for r in good)})
    return out


TARGETS = {  # part: (ckptio engine, the peers it is compared with, target ratio)
    "export": ("ckptio_export", ("dcp_to_torch_save", "consolidate_t1", "consolidate_t2",
                                 "consolidate_t4"), 2.0),
    "load": ("ckptio_load", ("dcp_load",), 1.5),
    "save": ("dcp_save_ckptio_writer", ("dcp_save_t1", "dcp_save_t2", "dcp_save_t4",
                                        "dcp_save_t8"), 1.5),
}


def verdicts(summary: dict[str, Any]) -> list[str]:
    rows = {r["engine"]: r for r in summary["rows"] if r["seconds"]}
    lines = []
    for part, (mine, peers, target) in TARGETS.items():
        best = min((rows[p] for p in peers if p in rows), key=lambda r: r["seconds"], default=None)
        if mine not in rows or best is None:
            lines.append(f"- {part}: not measured (engine missing or failed)")
            continue
        ratio = best["seconds"] / rows[mine]["seconds"]
        lines.append(f"- {part}: {mine} is {ratio:.2f}x the best peer ({best['engine']}); target "
                     f">= {target}x: {'met' if ratio >= target else 'MISSED'}")
    if "dcp_load_ckptio_reader" in rows and "dcp_load" in rows:
        ratio = rows["dcp_load"]["seconds"] / rows["dcp_load_ckptio_reader"]["seconds"]
        lines.append(f"- load: dcp.load through ckptio.DcpReader is {ratio:.2f}x dcp.load with "
                     "FileSystemReader")
    return lines


def markdown(summary: dict[str, Any], args: argparse.Namespace, argv: list[str]) -> str:
    from benchmarks.interop_engines import ENGINES

    cmd = shlex.join(["python", "-m", "benchmarks.interop", *argv])

    f = fmt
    lines = [f"`{cmd}`  ", (f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, "
             f"{args.reps} reps, a fresh process each, medians (min-max); page cache dropped "
             "before every export and load; saves: the second in the process (1st: the first)"), "",
             "| part | engine | s (min-max) | GB/s | % ceiling | 1st save s | RSS+ MiB | bitwise |",
             "|---|---|---|---:|---:|---:|---:|---|"]
    for r in summary["rows"]:
        ceil = summary["write_gbps"] if r["part"] in ("save", "export") else summary["read_gbps"]
        pct = None if not (r["gbps"] and ceil) else 100 * r["gbps"] / ceil
        ok = f"FAILED: {r['error']}" if r["failed"] else ("ok" if r["bitwise_ok"] else "MISMATCH")
        lines.append(f"| {r['part']} | {r['engine']} | {f(r['seconds'])} ({f(r['min_s'])}-"
                     f"{f(r['max_s'])}) | {f(r['gbps'])} | {f(pct, '.0f')} | {f(r['first_s'])} | "
                     f"{f(r['rss_mib'], '.0f')} | {ok} |")
    lines += [(f"| ceiling | O_DIRECT | - | write {f(summary['write_gbps'])}, read "
               f"{f(summary['read_gbps'])} | 100 | - | - | - |"), "", *verdicts(summary), ""]
    lines += [f"- {name}: {e.note}" for name, e in ENGINES.items()
              if any(r["engine"] == name for r in summary["rows"])]
    lines += [("- export GB/s counts the model weights, a tied weight once (what an HF export "
               "holds; dcp_to_torch_save writes the tie twice); load and save count "
               "the whole training state; % ceiling: export and save against the write ceiling, "
               "load against the read ceiling"), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    engines = choose(args.engines)
    args.dir.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        setup = spawn(args, "setup", 0)
        if "error" in setup:
            print(f"setup failed: {setup['error']}", file=sys.stderr)
            return 1
        print(f"setup {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        runs = run_all(args, engines)
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)
    summary = summarize(runs)
    text = markdown(summary, args, argv)
    print(text)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(text)
    if args.json:
        args.json.write_text(json.dumps({"argv": argv, "runs": runs, "summary": summary}, indent=1))
    return 1 if any("error" in r or not r.get("bitwise_ok", True) for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
