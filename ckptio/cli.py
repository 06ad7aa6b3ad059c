"""The ckptio command: inspect and verify checkpoints, run benchmarks and the demo.

Owns: argument parsing and printing. Every action calls the library or a bench driver.
"""

from __future__ import annotations

import argparse
import os
import sys

from . import commit, manifest, tune
from .errors import CkptError
from .types import TensorEntry


def _ls(args: argparse.Namespace) -> int:
    path = args.path
    record = manifest.decode(commit.read_committed(path), os.path.join(path, manifest.MANIFEST_NAME))
    total = sum(t.nbytes for t in record.tensors)
    by_key: dict[str, list[TensorEntry]] = {}
    for t in record.tensors:
        by_key.setdefault(t.key, []).append(t)
    print(f"{path}: save {record.save_id} by {record.world_size} rank(s), {len(by_key)} tensors "
          f"in {len(record.tensors)} chunks ({total / 2**20:.1f} MiB), {len(record.objects)} "
          f"values, {len(record.aliases)} aliases, {len(record.files)} file(s)")
    for key, chunks in by_key.items():
        t = chunks[0]
        where = (f"{len(chunks)} per-rank" if t.rank is not None else
                 f"{len(chunks)} chunk(s)" if len(chunks) > 1 or t.chunk.flat else "")
        print(f"  {key:60s} {t.kind:8s} {t.dtype:10s} {list(t.shape)!s:20s} "
              f"{sum(c.nbytes for c in chunks):>12d} {where}")
    for key, target in record.aliases:
        print(f"  {key:60s} alias of {target}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from .shared import verify

    nbytes = verify(args.path)
    print(f"{args.path}: OK, every entry matches its checksum ({nbytes} bytes read)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ckptio", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("ls", help="list what a checkpoint holds")
    ls.add_argument("path")
    verify = sub.add_parser("verify", help="read every byte and check it against its checksum")
    verify.add_argument("path")
    bench = sub.add_parser("bench", help="benchmarks against peers and the disk's ceiling")
    bench.add_argument("which", choices=["save-load", "train", "io", "plan"])
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    sub.add_parser("demo", help="a small save-load benchmark printing its table")
    tune.add_arguments(sub.add_parser("tune", help="measure a filesystem and store its fastest "
                                      "I/O settings (--show prints them)"))
    args = parser.parse_args(argv)
    try:
        if args.command == "ls":
            return _ls(args)
        if args.command == "verify":
            return _verify(args)
        if args.command == "tune":
            return tune.run(args)
        from .bench import save_load

        if args.command == "demo":
            return save_load.main(["--gb", "0.25", "--reps", "2"])
        if args.which == "io":
            from .bench import io_study

            return io_study.main(args.rest)
        if args.which == "plan":
            from .bench import plan_scale

            return plan_scale.main(args.rest)
        if args.which == "train":
            from .bench import train

            return train.main(args.rest)
        return save_load.main(args.rest)
    except CkptError as exc:
        print(f"ckptio: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
