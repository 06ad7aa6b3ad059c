"""S3 round two (issue 29, item 6): ckptio at the old defaults and with the endpoint's tuned
profile against boto3's raw ceiling, in one run, with the tuner's study (table and plot).

    .venv/bin/python -m benchmarks.s3_tune --gb 0.5 --reps 3 --concurrency 4,8,16 \\
        --parts 16,32,64 --json docs/results/s3/tune.json --markdown docs/results/s3/tune.md \\
        --plot docs/results/s3/tune

First ``ckptio tune``'s study (ckptio.tuning.s3_tune.tune, what the command runs, its defaults
unless --tune-* say otherwise) on a fresh server; its profile goes to a profile file of this run
(CKPTIO_PROFILE_PATH). Then, per repetition, benchmarks/s3.py's protocol: the raw boto3 sweep
(s3_ceiling.py; the best cell is the ceiling), then ``ckptio`` (the old defaults: no profile) and
``ckptio_tuned`` (no options but the endpoint: the profile applies), alternating order, each on a
fresh server. Every fresh server listens on new ports, so the profile is stored again under the
new endpoint before each item (same binary, disk and data directory: the store it measured).

Owns: the order above, the study's section and plot. Does not own: the protocol, the engines,
the ceiling and the report of benchmarks/s3.py (reused as they are).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import s3
from benchmarks import s3_report as report

ENGINES = ["ckptio", "ckptio_tuned"]


class TunedServer(s3.Server):
    """benchmarks.s3's server; a fresh one re-keys the tuned profile to its endpoint."""

    tuned: Any = None

    def fresh(self) -> Any:
        from ckptio.tuning import profile

        server = super().fresh()
        if self.tuned is not None:
            profile.store(dataclasses.replace(self.tuned, endpoint=server.endpoint))
        return server


def parse(argv: list[str]) -> tuple[argparse.Namespace, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.s3_tune", add_help=False)
    p.add_argument("--tune-total", default=None, help="study bytes per cell (ckptio tune --total)")
    p.add_argument("--tune-sizes", default=None, help="study part sizes (ckptio tune --sizes)")
    p.add_argument("--tune-concurrency", default=None, help="study requests in flight")
    p.add_argument("--tune-reps", type=int, default=2, help="study repetitions (default 2)")
    p.add_argument("--tune-engines", default=",".join(ENGINES),
                   help="ckptio engines measured after each sweep (default: ckptio,ckptio_tuned; "
                   "ckptio_tuned_prepared adds loads after Checkpointer.prepare)")
    p.add_argument("--plot", type=Path, help="write PREFIX_study.png (needs matplotlib)")
    p.add_argument("--replot", type=Path, help="only draw --plot from this run's --json")
    own, rest = p.parse_known_args(argv)
    args = s3.parse_args(rest)
    args.tune_engines = own.tune_engines
    return own, args


def run_study(own: argparse.Namespace, srv: TunedServer) -> dict[str, Any]:
    from ckptio.tuning import profile, s3_tune
    from ckptio.tuning.io_study import parse_list, parse_nbytes

    server = srv.fresh()
    saved = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())
    try:
        t0 = time.perf_counter()
        chosen, candidates = s3_tune.tune(
            f"s3://{server.bucket}/tune", parse_nbytes(own.tune_total or s3_tune.TOTAL),
            parse_list(own.tune_sizes or s3_tune.PARTS, parse_nbytes),
            parse_list(own.tune_concurrency or s3_tune.CONCURRENCY), own.tune_reps)
        seconds = time.perf_counter() - t0
        profile.store(chosen)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        srv.stop()
    srv.tuned = chosen
    return {"seconds": seconds, "chosen": dataclasses.asdict(chosen),
            "candidates": [dataclasses.asdict(c) | {"score": c.score} for c in candidates]}


def run_all(args: argparse.Namespace, srv: TunedServer) -> list[s3.Run]:
    runs: list[s3.Run] = []
    full = [f"{c}x{p}" for p in args.parts.split(",") for c in args.concurrency.split(",")]
    for rep in range(args.reps):
        cells = full if rep == 0 or not args.refine else report.top_cells(runs, args.refine)
        runs.append(s3.ceiling_rep(args, srv, rep, cells))
        print(report.progress(runs[-1]), file=sys.stderr, flush=True)
        engines = args.tune_engines.split(",")
        for name in engines if rep % 2 == 0 else engines[::-1]:
            runs.append(s3.engine_rep(args, srv, rep, name, None))
            print(report.progress(runs[-1]), file=sys.stderr, flush=True)
    return runs


def study_lines(study: dict[str, Any]) -> list[str]:
    chosen = study["chosen"]
    lines = [f"## The tuner's study ({study['seconds']:.0f} s)", "",
             (f"Chosen: {chosen['s3_concurrency']} requests in flight, "
              f"{chosen['buffer_bytes'] >> 20} MiB parts (write {chosen['write_gbps']:.3f}, "
              f"read {chosen['read_gbps']:.3f} GB/s); loads: io_depth "
              f"{chosen.get('io_depth') or chosen['s3_concurrency']}, GETs of "
              f"{(chosen.get('read_bytes') or chosen['buffer_bytes']) >> 20} MiB."), "",
             "| requests | part MiB | write GB/s | read GB/s | score (harmonic mean) |",
             "|---:|---:|---:|---:|---:|"]
    for c in sorted(study["candidates"], key=lambda c: -c["score"]):
        lines.append(f"| {c['io_depth']} | {c['buffer_bytes'] >> 20} | {c['write_gbps']:.3f} | "
                     f"{c['read_gbps']:.3f} | {c['score']:.3f} |")
    return lines


def plot(study: dict[str, Any], prefix: Path) -> Path:
    """Write, read and score GB/s against the part size, one line per requests in flight."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), sharex=True)
    chosen = study["chosen"]
    for ax, key, title in zip(axes, ("write_gbps", "read_gbps", "score"),
                              ("write (multipart upload)", "read (ranged GETs)",
                               "score: harmonic mean")):
        for depth in sorted({c["io_depth"] for c in study["candidates"]}):
            row = sorted((c for c in study["candidates"] if c["io_depth"] == depth),
                         key=lambda c: c["buffer_bytes"])
            ax.plot([c["buffer_bytes"] >> 20 for c in row], [c[key] for c in row], marker="o",
                    label=f"{depth} in flight")
            for c in row:
                if (c["io_depth"], c["buffer_bytes"]) == (chosen["s3_concurrency"],
                                                         chosen["buffer_bytes"]):
                    ax.plot([c["buffer_bytes"] >> 20], [c[key]], marker="*", markersize=16,
                            color="black", linestyle="none")
        ax.set_xscale("log", base=2)
        ax.set_title(title)
        ax.set_xlabel("part size (MiB)")
        ax.set_ylabel("GB/s")
        ax.set_ylim(bottom=0)
    axes[0].legend(fontsize=8)
    fig.suptitle("ckptio tune s3://: the study (star: the chosen setting)")
    path = prefix.with_name(f"{prefix.name}_study.png")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, args = parse(argv)
    if own.replot and own.plot:
        print(plot(json.loads(own.replot.read_text())["study"], own.plot))
        return 0
    os.environ["CKPTIO_PROFILE_PATH"] = str(Path(tempfile.mkdtemp(prefix="s3tune-")) / "p.json")
    machine = report.machine(args)
    srv = TunedServer(args.dir)
    t0 = time.perf_counter()
    try:
        study = run_study(own, srv)
        print("\n".join(study_lines(study)), file=sys.stderr, flush=True)
        runs = run_all(args, srv)
    finally:
        srv.stop()
    print(f"{len(runs)} items in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    summary = report.summarize(runs)
    text = report.markdown(summary, args, argv, ENGINES, machine).replace(
        "python -m benchmarks.s3 ", "python -m benchmarks.s3_tune ", 1)
    text += "\n" + "\n".join(study_lines(study)) + "\n"
    if own.plot:
        try:
            text += f"\n![the study]({plot(study, own.plot).name})\n"
        except ImportError:  # draw it later: --replot JSON --plot PREFIX where matplotlib is
            print("no matplotlib: the plot is left to --replot", file=sys.stderr)
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    if args.json:
        args.json.write_text(json.dumps({"argv": argv, "machine": machine, "study": study,
                                         "runs": runs, "summary": summary}, indent=1))
    return 1 if report.failed(runs) else 0


if __name__ == "__main__":
    sys.exit(main())
