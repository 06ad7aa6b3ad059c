"""ckptio: fast, verified PyTorch checkpoints.

Commands: ls (what a checkpoint holds), verify (check every byte), demo (train a small model,
kill it mid-save, resume it bit-exactly), bench (io: the I/O study of ckptio.tuning; save-load,
train, plan: the peer benchmarks of a ckptio checkout's benchmarks/ folder), tune (measure a
filesystem's fastest I/O settings). Errors are one line naming the fix.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import sys

from ckptio.format import manifest
from ckptio.tuning import tune
from ckptio.errors import CheckpointNotFoundError, CkptError
from ckptio.format.types import TensorEntry

__all__ = ["main"]

# `ckptio bench WHICH`: the peer benchmarks, modules of the repository's benchmarks/ folder (not
# installed with ckptio, which never imports them otherwise); "io" is ckptio.tuning.io_study.
PEER_BENCHMARKS = {"save-load": "save_load", "train": "train", "plan": "plan_scale"}


def _shown(tagged: object) -> str:
    """An inline value as the user wrote it (the tagged JSON if it does not decode)."""
    from ckptio.format import values

    try:
        return repr(values.decode(tagged))
    except ValueError:
        return f"<malformed {tagged!r:.40}>"


def _ls(args: argparse.Namespace) -> int:
    from ckptio.api import store_for

    path = args.path
    store = store_for(path)
    try:
        if os.path.isfile(path):  # a torch.save file, shown as ckptio.load reads it
            raise CheckpointNotFoundError(path)
        record = manifest.decode(store.read_manifest(), store.path_of(manifest.MANIFEST_NAME))
    except CheckpointNotFoundError:  # a DCP checkpoint is shown as ckptio.load reads it
        from ckptio.api import Checkpointer
        from ckptio.options import Options

        record = Checkpointer(Options(buffer_bytes=1 << 20, pool_bytes=4 << 20)).manifest(path)
    total = sum(t.nbytes for t in record.tensors)
    by_key: dict[str, list[TensorEntry]] = {}
    for t in record.tensors:
        by_key.setdefault(t.key, []).append(t)
    what = ("DCP checkpoint" if "dcp" in record.meta and record.save_id == "dcp" else
            "torch.save file" if "torch.save" in record.meta else f"save {record.save_id}"
            + (" (dcp.save through ckptio.DcpWriter)" if "dcp" in record.meta else ""))
    print(f"{path}: {what} by {record.world_size} rank(s), {len(by_key)} tensors "
          f"in {len(record.tensors)} chunks ({total / 2**20:.1f} MiB), {len(record.objects)} "
          f"values, {len(record.aliases)} aliases, {len(record.files)} file(s)")
    print(f"  {'KEY':60s} {'KIND':8s} {'DTYPE':10s} {'SHAPE':20s} {'BYTES':>12s} WHERE / VALUE")
    for key, chunks in by_key.items():
        t = chunks[0]
        where = (f"{len(chunks)} per-rank" if t.rank is not None else
                 f"{len(chunks)} chunk(s)" if len(chunks) > 1 or t.chunk.flat else "")
        print(f"  {key:60s} {t.kind:8s} {t.dtype:10s} {list(t.shape)!s:20s} "
              f"{sum(c.nbytes for c in chunks):>12d} {where}")
    for o in record.objects:
        rank = f" (rank {o.rank})" if o.rank is not None else ""
        print(f"  {o.key:60s} {'value':8s} {'':10s} {'':20s} {'':>12s} {_shown(o.value)}{rank}")
    for key, target in record.aliases:
        print(f"  {key:60s} {'alias':8s} {'':10s} {'':20s} {'':>12s} same tensor as {target}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from ckptio.shared import verify

    nbytes = verify(args.path)
    print(f"{args.path}: OK, every entry matches its checksum ({nbytes} bytes read)")
    return 0


def _checkout(module: str) -> str | None:
    """The ckptio checkout holding benchmarks/``module``.py: the one this ckptio was imported from
    (an editable install), else the working directory; None if neither holds it."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for root in (here, os.getcwd()):
        if all(os.path.isfile(os.path.join(root, *part)) for part in
               (("benchmarks", "__init__.py"), ("benchmarks", f"{module}.py"))):
            return root
    return None


def _bench(which: str, rest: list[str]) -> int:
    if which == "io":
        from ckptio.tuning import io_study

        return io_study.main(rest)
    module = PEER_BENCHMARKS[which]
    root = _checkout(module)
    if root is None:
        print(f"ckptio bench {which}: the peer benchmarks are not installed with ckptio; from a "
              f"checkout of its repository run: python -m benchmarks.{module} {shlex.join(rest)}"
              .rstrip(), file=sys.stderr)
        return 2
    if root not in sys.path:
        sys.path.insert(0, root)
    return importlib.import_module(f"benchmarks.{module}").main(rest)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["demo"]:  # all its options are its own (ckptio demo --help)
        from ckptio.demo import main as demo_main

        return demo_main.main(argv[1:])
    parser = argparse.ArgumentParser(prog="ckptio", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("ls", help="list what a checkpoint holds")
    ls.add_argument("path")
    verify = sub.add_parser("verify", help="read every byte and check it against its checksum")
    verify.add_argument("path")
    bench = sub.add_parser("bench", help="benchmarks against peers and the disk's ceiling")
    bench.add_argument("which", choices=[*PEER_BENCHMARKS, "io"])
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    sub.add_parser("demo", help="train a small GPT, SIGKILL it mid-save, resume it in a new "
                   "process and compare every loss bit for bit (--quick: seconds; ckptio demo "
                   "--help for its options)")
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
        return _bench(args.which, args.rest)
    except CkptError as exc:
        print(f"ckptio: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `ckptio ls ... | head`: the reader left; not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
