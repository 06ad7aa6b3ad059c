"""The ``ckptio`` commands that read checkpoints: ls, diff, verify, convert, export, status.

Owns: their arguments (``add_parsers``) and running each one (``run``), importing torch and the
loaders only in the commands that need them (ls and diff on a ckptio checkpoint never do).
Does not own: the tree, run, diff and verify logic (cli/ls.py, cli/ls_run.py, cli/diff.py,
cli/verify.py), reading and writing checkpoints (ckptio.load / save / verify) or the Hugging
Face export (ckptio.export).
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from ckptio.cli.progress import Bar
from ckptio.errors import CkptError

__all__ = ["add_parsers", "parse_size", "run"]

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "f16": "float16",
          "float16": "float16", "fp32": "float32", "f32": "float32", "float32": "float32"}
CONVERT_HELP = """Read SRC (a ckptio checkpoint, a DCP checkpoint directory, a torch.save file,
safetensors or a torch_checkpointing directory) and write it at DST as --to: a ckptio checkpoint
(default), a DCP directory (DCP's own files: plain dcp.load with FileSystemReader reads it), a
torch.save file, a torch_checkpointing directory (its CheckpointManager.load reads it; one item
per top-level key) or a Hugging Face safetensors folder (tensors only: values are refused, naming them, unless
--drop-non-tensors). Memory: the whole state is loaded into host memory first (about the
checkpoint's size in RAM, plus ckptio's staging pool), then saved (safetensors streams
instead). A DST that already holds a checkpoint is refused unless --overwrite (the old one stays
intact until the new one is complete)."""
TARGETS = ("ckptio", "dcp", "torch.save", "safetensors", "torch_checkpointing")  # ckptio.convert.TARGETS (torch-free)


def parse_size(text: str) -> int:
    """'5GB' -> 5*10**9, '512MiB' -> 512*2**20, '1000' -> 1000 (argparse type)."""
    found = _SIZE.fullmatch(text.strip())
    if not found:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 5GB, 500MB or 2GiB")
    unit = (found.group(2) or "").lower().removesuffix("b")
    return int(float(found.group(1)) * _UNITS[unit])


def _rename(text: str) -> tuple[str, str]:
    old, sep, new = text.partition("=")
    if not sep or not old:
        raise argparse.ArgumentTypeError(f"{text!r} is not OLD=NEW (e.g. model.=)")
    return old, new


def add_parsers(sub: Any) -> None:
    quiet = argparse.ArgumentParser(add_help=False)
    quiet.add_argument("--no-progress", action="store_true",
                       help="no progress bar (one is drawn on stderr only when it is a terminal)")
    ls = sub.add_parser("ls", help="list what a checkpoint holds, as a tree, or the steps of a "
                        "run (a CheckpointManager's directory or s3:// prefix)")
    ls.add_argument("path", help="a ckptio checkpoint (directory or s3://), a run's directory "
                    "or prefix of step-N checkpoints, a DCP directory or a torch.save file "
                    "(those two import torch)")
    ls.add_argument("--json", action="store_true", help="JSON, schema ckptio.ls/1 (a run: "
                    "ckptio.run/1; docs/CLI.md)")
    ls.add_argument("--bytes", action="store_true", help="sizes in bytes (default: KiB, MiB, "
                    "GiB as people read them)")
    ls.add_argument("--depth", type=int, default=None, metavar="N",
                    help="show N levels of the tree; deeper ones are summed up")
    ls.add_argument("--flat", action="store_true", help="one line per key (its dotted name, "
                    "as load's keys= takes it), no tree: for grep")
    ls.add_argument("--values", action="store_true", help="values in full, sizes, dtypes and "
                    "devices decoded by torch (imports torch)")
    ls.add_argument("--storage", action="store_true", help="per key, the bytes stored and each "
                    "chunk's codec (raw, zstd, ...) or base reference (ref/xor step-N)")
    diff = sub.add_parser("diff", parents=[quiet], help="what differs between two checkpoints "
                          "(exit 0 the same, 1 different, 2 error)")
    diff.add_argument("a", help="a checkpoint (any format ls reads)")
    diff.add_argument("b", help="the checkpoint to compare it with")
    diff.add_argument("--data", action="store_true", help="read every tensor of both (the "
                      "ones checksums cannot compare, another checksum or chunking, are read "
                      "without it up to 1 GiB a side) and show the largest differences")
    verify = sub.add_parser("verify", parents=[quiet],
                            help="read every byte and check it against its checksum",
                            description="Read back every byte of a checkpoint and check it "
                            "against the checksums its manifest (or a DCP directory's, a "
                            "torch.save file's records) holds; nothing is loaded or unpickled. "
                            "Exit 0: every byte checks; 1: damage found (named, with the key, "
                            "file and byte range); 2: not a checkpoint or unreadable. A run's "
                            "directory (a CheckpointManager's): every committed step in turn, "
                            "a summary last; exit 1 if any is damaged.")
    verify.add_argument("path", help="a checkpoint (a directory, shm://NAME/..., s3://..., a "
                        "DCP directory or a torch.save file) or a run's directory of steps")
    convert = sub.add_parser("convert", parents=[quiet], help="a checkpoint -> ckptio, a DCP "
                             "directory, a torch.save file or safetensors (--to)",
                             description=CONVERT_HELP)
    convert.add_argument("src", help="the checkpoint to read (ckptio, DCP, torch.save, "
                         "safetensors)")
    convert.add_argument("dst", help="where to write it (a new directory or file)")
    convert.add_argument("--to", choices=TARGETS, default="ckptio", help="what DST becomes "
                         "(default ckptio; dcp: plain dcp.load with FileSystemReader reads it)")
    convert.add_argument("--overwrite", action="store_true", help="replace what DST holds")
    convert.add_argument("--allow-pickle", action="store_true", help="SRC holds pickled Python "
                         "objects you trust (unpickling runs code)")
    convert.add_argument("--per-rank-from", type=int, metavar="RANK", help="SRC was saved by "
                         "many ranks with per-rank values (RNG, data loader): take RANK's")
    convert.add_argument("--drop-non-tensors", action="store_true", help="--to safetensors: "
                         "leave out the values, numpy/bytes/pickled and per-rank entries it "
                         "cannot hold (named in the output) instead of refusing")
    _export_parser(sub, quiet)
    status = sub.add_parser("status", help="which steps each tier of a tiered manager holds, "
                            "and which are still being copied (tiers fastest first)")
    status.add_argument("tiers", nargs="+", metavar="TIER",
                        help="a tier's location (directory, shm://NAME, s3://bucket/prefix)")
    status.add_argument("--json", action="store_true", help="JSON, schema ckptio.status/1")


def _export_parser(sub: Any, quiet: argparse.ArgumentParser) -> None:
    export = sub.add_parser("export", parents=[quiet], help="a checkpoint's model -> a Hugging "
                            "Face safetensors directory (run under torchrun to export with many "
                            "ranks)")
    export.add_argument("src", help="the checkpoint holding the model (ckptio, DCP, "
                        "torch.save)")
    export.add_argument("dst", help="the Hugging Face directory to write")
    export.add_argument("--keys", default="model.", metavar="PREFIX", help="export the keys "
                        "under PREFIX, stripped from their names (default 'model.'; '' all)")
    export.add_argument("--rename", type=_rename, action="append", default=[],
                        metavar="OLD=NEW", help="rename names starting with OLD (after "
                        "--keys is stripped) to start with NEW; repeatable, the first match wins")
    export.add_argument("--dtype", choices=sorted(DTYPES), help="convert floating tensors")
    export.add_argument("--max-shard-size", type=parse_size, default=5 * 10**9, metavar="SIZE",
                        help="largest .safetensors file (default 5GB)")
    export.add_argument("--copy-from", metavar="DIR",
                        help="copy config.json and tokenizer files from DIR")
    export.add_argument("--overwrite", action="store_true", help="replace what DST holds")
    export.add_argument("--no-verify", action="store_true", help="skip the source's checksums "
                        "(a DCP or torch.save tensor that windows cut is verified whole first)")


def run(args: argparse.Namespace) -> int:
    command = {"ls": _ls, "diff": _diff, "verify": _verify, "convert": _convert,
               "export": _export, "status": _status}[args.command]
    return command(args)


def _ls(args: argparse.Namespace) -> int:
    from ckptio.cli import ls
    from ckptio.cli.source import open_manifest

    if args.depth is not None and args.depth < 0:
        raise CkptError(f"ckptio ls: --depth {args.depth}: give 0 or more levels")
    from ckptio.cli import ls_run

    steps = ls_run.list_run(args.path)  # None: not a run directory (a checkpoint, or nothing)
    if steps is not None:
        return ls_run.run(args.path, steps, as_json=args.json, exact=args.bytes)
    ranks = ls_run.list_ranks(args.path)  # each rank's own directory (redundancy's layout)
    if ranks is not None:
        return ls_run.run_ranks(args.path, ranks, as_json=args.json, exact=args.bytes)
    return ls.run(open_manifest(args.path), as_json_doc=args.json, depth=args.depth,
                  exact=args.values, flat=args.flat, in_bytes=args.bytes,
                  storage=args.storage)


def _diff(args: argparse.Namespace) -> int:
    from ckptio.cli import diff
    from ckptio.cli.source import open_manifest

    a, b = open_manifest(args.a), open_manifest(args.b)
    found = diff.compare(a, b, args.data)
    changes = found.changes
    unsettled = sum(r.nbytes for r in found.unsettled)
    read = args.data or bool(found.unsettled) and unsettled <= diff.AUTO_DATA_NBYTES
    if read and found.unsettled:
        with Bar(2 * unsettled, "diff", not args.no_progress) as bar:
            changes += diff.data_changes(a, b, found.unsettled, bar.update)
    elif found.unsettled:
        changes += diff.not_compared(a, b, found.unsettled)
    how = ("every tensor read, checksums verified" if args.data else
           diff.compared_how(a, b, sum(r.kind == "tensor" and r.ranks is None
                                       for r in found.unsettled)) if read and unsettled else None)
    return diff.report(a, b, changes, how)


def _verify(args: argparse.Namespace) -> int:
    from ckptio.cli import ls_run, verify

    steps = ls_run.list_run(args.path)  # a run's directory: every committed step in turn
    if steps is None:
        return verify.run(args.path, progress=not args.no_progress)
    return verify.run_steps(args.path, [(s.step, s.path) for s in steps if s.state == "committed"],
                            [s.step for s in steps if s.state == "incomplete"],
                            progress=not args.no_progress)


def _convert(args: argparse.Namespace) -> int:
    from ckptio.cli import convert_cmd as convert

    return convert.convert(args.src, args.dst, to=args.to, overwrite=args.overwrite,
                           allow_pickle=args.allow_pickle, per_rank_from=args.per_rank_from,
                           drop_non_tensors=args.drop_non_tensors,
                           progress=not args.no_progress)


def _status(args: argparse.Namespace) -> int:
    from ckptio.cli import status

    return status.run(args.tiers, as_json=args.json)


def _export(args: argparse.Namespace) -> int:
    from ckptio.cli import convert_cmd as convert

    return convert.export(args.src, args.dst, keys=args.keys, rename=args.rename,
                          dtype=DTYPES[args.dtype] if args.dtype else None,
                          max_shard_bytes=args.max_shard_size, copy_from=args.copy_from,
                          overwrite=args.overwrite, verify=not args.no_verify,
                          progress=not args.no_progress)
