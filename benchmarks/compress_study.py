"""Codec study (issue 28): which lossless codec pays on which tensor class of real training state.

Owns: the measurements of docs/PROBES.md's "Codecs on real training state" and
/work/wt/codec-study.md: for a full mixed-precision run and a LoRA-style run
(compress_traj.py), at steps s, s+1, s+10, s+100, per tensor class (bf16 weights, fp32 master,
exp_avg, exp_avg_sq): the fraction of bit-identical elements and of unchanged tensors between s
and s+k, the ratio and single-core compress / decompress GB/s of each codec (compress_codecs.py)
on the state itself and on its XOR against step s, in independent 1 MiB frames per tensor (the
format's block size), and the markdown of it. Does not own: training (compress_traj.py), the
codecs (compress_codecs.py), checkpoint engines (compress.py).

    python -m benchmarks.compress_study --start 50 --reps 3 --markdown study.md --json study.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from benchmarks import compress_codecs, compress_traj, write_reports
from benchmarks.compress_traj import CLASSES, Snapshot

FRAME = 1 << 20  # the format's default block_nbytes: frames decode alone
INT = {2: torch.int16, 4: torch.int32}
LORA_CODECS = ["zstd-1", "bg+zstd-1", "blosc2 shuffle+zstd-1"]
Row = dict[str, Any]


def frames(tensors: dict[str, torch.Tensor]) -> Iterator[tuple[memoryview, int]]:
    """Each tensor's bytes cut into FRAME-sized frames, with its element size."""
    for t in tensors.values():
        raw = memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy())
        for at in range(0, len(raw), FRAME):
            yield raw[at:at + FRAME], t.element_size()


def xor(new: dict[str, torch.Tensor], old: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: new[k].view(INT[new[k].element_size()]) ^ old[k].view(INT[old[k].element_size()])
            for k in new}


def identical(new: dict[str, torch.Tensor], old: dict[str, torch.Tensor]) -> dict[str, float]:
    """Fractions of elements and of tensor bytes (whole tensors) that did not change."""
    n = same = tensor_bytes = same_bytes = 0
    for k, a in new.items():
        eq = a.view(INT[a.element_size()]) == old[k].view(INT[a.element_size()])
        n, same = n + a.numel(), same + int(eq.sum())
        tensor_bytes += a.numel() * a.element_size()
        same_bytes += a.numel() * a.element_size() if bool(eq.all()) else 0
    return {"elements_identical": same / max(n, 1), "tensor_bytes_unchanged": same_bytes
            / max(tensor_bytes, 1)}


def measure(codec: compress_codecs.Codec, tensors: dict[str, torch.Tensor], reps: int) -> Row:
    """Ratio (logical / stored) and median single-thread GB/s of encode and decode of all
    frames; checks every frame round-trips bit-exactly."""
    parts = list(frames(tensors))
    logical = sum(len(f) for f, _ in parts)
    enc_t, dec_t = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        blobs = [codec.encode(f, size) for f, size in parts]
        enc_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        outs = [codec.decode(b, size, len(f)) for b, (f, size) in zip(blobs, parts)]
        dec_t.append(time.perf_counter() - t0)
    for out, (f, _) in zip(outs, parts):
        if bytes(out) != f.tobytes():
            raise RuntimeError(f"{codec.name} did not round-trip a frame")
    stored = sum(len(b) for b in blobs)
    return {"codec": codec.name, "logical": logical, "stored": stored,
            "ratio": logical / stored, "compress_gbs": logical / statistics.median(enc_t) / 1e9,
            "decompress_gbs": logical / statistics.median(dec_t) / 1e9}


def xor_speed(new: dict[str, torch.Tensor], old: dict[str, torch.Tensor], reps: int) -> float:
    nbytes = sum(t.numel() * t.element_size() for t in new.values())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        xor(new, old)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def study_run(kind: str, snaps: dict[int, Snapshot], start: int, ks: list[int], reps: int,
              codec_names: list[str] | None) -> list[Row]:
    """Every (class, data, codec) row of one run; data is "state" (step start) or "xor k"."""
    codecs = compress_codecs.available(codec_names)
    rows: list[Row] = []
    base = snaps[start]
    for cls in CLASSES:
        if not base[cls]:
            continue
        datasets = [("state", base[cls], {})]
        for k in ks:
            new = snaps[start + k][cls]
            extra = identical(new, base[cls]) | {"xor_gbs": xor_speed(new, base[cls], reps)}
            datasets.append((f"xor {k}", xor(new, base[cls]), extra))
        for data, tensors, extra in datasets:
            for codec in codecs:
                row = measure(codec, tensors, reps)
                rows.append({"run": kind, "class": cls, "data": data, **extra, **row})
                print(f"{kind:5} {cls:10} {data:7} {codec.name:32} {row['ratio']:6.3f}x "
                      f"c {row['compress_gbs']:5.2f} d {row['decompress_gbs']:5.2f} GB/s",
                      file=sys.stderr, flush=True)
    return rows


def versions() -> dict[str, str]:
    out = {}
    for dist in ("zstandard", "blosc2", "zipnn", "numcodecs", "numpy", "torch"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "absent"
    return out


# ------------------------------------------------------------------------------ markdown


def markdown(result: dict[str, Any]) -> str:
    rows, lines = result["rows"], []
    classes = [c for c in CLASSES if any(r["class"] == c for r in rows)]
    for run, info in result["runs"].items():
        lines.append(f"\n### {run} run: {info['params']:,} parameters ({info['trainable']:,} "
                     f"trainable), peak lr {info['lr']}, loss {info['loss_first']} -> "
                     f"{info['loss_last']}\n")
        lines.append(_identity_table(rows, run, classes))
        lines.append(_whole_state(rows, run))
        for data in dict.fromkeys(r["data"] for r in rows if r["run"] == run):
            sel = [r for r in rows if r["run"] == run and r["data"] == data]
            head = "| codec | " + " | ".join(f"{c} ratio, c/d GB/s" for c in classes
                                              if any(r["class"] == c for r in sel))
            s = result["start"]
            what = f"step {s}" if data == "state" else f"step {s + int(data[4:])} XOR step {s}"
            lines += [f"\n{run}, {data} ({what}):\n", head + " |", "|---" * head.count("|") + "|"]
            for codec in dict.fromkeys(r["codec"] for r in sel):
                cells = []
                for c in classes:
                    r = next((r for r in sel if r["class"] == c and r["codec"] == codec), None)
                    if r is not None:
                        cells.append(f"{r['ratio']:.2f}x, {r['compress_gbs']:.2f}/"
                                     f"{r['decompress_gbs']:.2f}")
                lines.append(f"| {codec} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _whole_state(rows: list[Row], run: str) -> str:
    """Every class together: ratio and single-core GB/s of each codec on each data; and the
    bytes a delta of references alone (unchanged tensors referenced, the rest rewritten raw)
    would write."""
    sel = [r for r in rows if r["run"] == run]
    datas = list(dict.fromkeys(r["data"] for r in sel))
    out = ["\nAll classes together (ratio, compress/decompress GB/s per core):\n",
           "| codec | " + " | ".join(datas) + " |", "|---" * (len(datas) + 1) + "|"]
    for codec in dict.fromkeys(r["codec"] for r in sel):
        cells = []
        for data in datas:
            part = [r for r in sel if r["codec"] == codec and r["data"] == data]
            logical = sum(r["logical"] for r in part)
            stored = sum(r["stored"] for r in part)
            enc = sum(r["logical"] / r["compress_gbs"] for r in part)
            dec = sum(r["logical"] / r["decompress_gbs"] for r in part)
            cells.append(f"{logical / stored:.2f}x, {logical / enc:.2f}/{logical / dec:.2f}")
        out.append(f"| {codec} | " + " | ".join(cells) + " |")
    first = sel[0]["codec"]
    for data in datas[1:]:
        part = [r for r in sel if r["codec"] == first and r["data"] == data]
        logical = sum(r["logical"] for r in part)
        written = sum(r["logical"] * (1 - r["tensor_bytes_unchanged"]) for r in part)
        out.append(f"\n{data}: a delta of references alone (unchanged tensors referenced, the "
                   f"rest raw) writes {written / 1e6:.3f} of {logical / 1e6:.3f} MB "
                   f"({logical / max(written, 1):.1f}x fewer bytes than a full save)")
    return "\n".join(out)


def _identity_table(rows: list[Row], run: str, classes: list[str]) -> str:
    out = ["| class | k | elements bit-identical | tensor bytes unchanged | XOR GB/s |",
           "|---|---|---|---|---|"]
    for c in classes:
        for r in rows:
            if r["run"] == run and r["class"] == c and r["data"] != "state" and \
                    r["codec"] == rows[0]["codec"]:
                out.append(f"| {c} | {r['data'][4:]} | {r['elements_identical']:.1%} | "
                           f"{r['tensor_bytes_unchanged']:.1%} | {r['xor_gbs']:.2f} |")
    return "\n".join(out)


# ------------------------------------------------------------------------------ command line


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compress_study", description=__doc__
                                .split("\n")[0])
    p.add_argument("--start", type=int, default=50, help="step s (default 50)")
    p.add_argument("--ks", default="1,10,100", help="XOR distances k (default 1,10,100)")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions, median (default 3)")
    p.add_argument("--preset", default="study", choices=sorted(compress_traj.PRESETS))
    p.add_argument("--runs", default="full,lora")
    p.add_argument("--lora-base-steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the "
                   "preset's, 3e-3)")
    p.add_argument("--codecs", default="", help="comma list (default: all that import)")
    p.add_argument("--json", type=Path)
    p.add_argument("--markdown", type=Path)
    args = p.parse_args(argv)
    ks = [int(k) for k in args.ks.split(",")]
    steps = [args.start] + [args.start + k for k in ks]
    chosen = args.codecs.split(",") if args.codecs else None
    result: dict[str, Any] = {"start": args.start, "ks": ks, "frame": FRAME, "reps": args.reps,
                              "versions": versions(), "runs": {}, "rows": [],
                              "command": "python -m benchmarks.compress_study "
                              + " ".join(argv if argv is not None else sys.argv[1:])}
    for kind in args.runs.split(","):
        t0 = time.perf_counter()
        snaps, info = compress_traj.trajectory(kind, steps, args.preset,
                                               base_steps=args.lora_base_steps, lr=args.lr)
        info["train_s"] = round(time.perf_counter() - t0, 1)
        result["runs"][kind] = info
        names = chosen if kind == "full" or chosen else LORA_CODECS
        result["rows"] += study_run(kind, snaps, args.start, ks, args.reps, names)
        del snaps
    write_reports(result, args.json, args.markdown, markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
