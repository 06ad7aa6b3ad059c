"""The ``ckptio`` command (entry point ``ckptio.cli:main``): parsing, dispatch and errors.

Internal: nothing here is public API. The public surface is ``ckptio`` itself (its
``__all__``); the command's behaviour is documented in docs/CLI.md. Owns: the top-level parser,
``bench``/``demo``/``tune`` dispatch, one-line errors (exit 2) and a quiet exit on a closed
pipe. Does not own: the checkpoint commands (cli/commands.py and the modules it calls).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import shlex
import sys

from ckptio.cli.pipe import OutputClosed
from ckptio.errors import CkptError

__all__ = ["main"]

DESCRIPTION = """ckptio: fast, verified PyTorch checkpoints.

  ls       what a checkpoint holds, or the steps of a run directory (or of each rank's
           directory of a tier with redundancy)
  diff     what differs between two checkpoints
  verify   read every byte back and check it, naming every damaged tensor
  convert  a checkpoint (ckptio, DCP, torch.save, safetensors) into ckptio, a DCP directory,
           a torch.save file or safetensors (--to)
  export   a checkpoint's model into a Hugging Face safetensors directory
  status   which steps each tier of a tiered manager holds, and which are being copied
  demo     train a small model, kill it mid-save, resume it bit-exactly
  bench    io: the I/O study of ckptio.tuning; save-load, train, plan: the peer benchmarks
           of a ckptio checkout's benchmarks/ folder
  tune     measure a filesystem's or an S3 endpoint's fastest I/O settings

Errors are one line naming the fix (exit 2). ls and diff read a ckptio checkpoint's manifest
without importing torch. docs/CLI.md says the rest.
"""

# `ckptio bench WHICH`: the peer benchmarks, modules of the repository's benchmarks/ folder (not
# installed with ckptio, which never imports them otherwise); "io" is ckptio.tuning.io_study.
PEER_BENCHMARKS = {"save-load": "save_load", "train": "train", "plan": "plan_scale"}
MANY_RANKS = {"save-load": "ranks"}  # the benchmark a --ranks N > 1 of these runs instead


def _checkout(module: str) -> str | None:
    """The ckptio checkout holding benchmarks/``module``.py: the one this ckptio was imported from
    (an editable install), else the working directory; None if neither holds it."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for root in (here, os.getcwd()):
        if all(os.path.isfile(os.path.join(root, *part)) for part in
               (("benchmarks", "__init__.py"), ("benchmarks", f"{module}.py"))):
            return root
    return None


def _bench(which: str, rest: list[str]) -> int:
    if which == "io":
        from ckptio.tuning import io_study

        return io_study.main(rest)
    module = MANY_RANKS[which] if which in MANY_RANKS and _ranks(rest) > 1 else (
        PEER_BENCHMARKS[which])
    root = _checkout(module)
    if root is None:
        print(f"ckptio bench {which}: the peer benchmarks are not installed with ckptio; from a "
              f"checkout of its repository run: python -m benchmarks.{module} {shlex.join(rest)}"
              .rstrip(), file=sys.stderr)
        return 2
    if root not in sys.path:
        sys.path.insert(0, root)
    return importlib.import_module(f"benchmarks.{module}").main(rest)


def _ranks(argv: list[str]) -> int:
    """The value of --ranks N / --ranks=N (1 when absent or not a number)."""
    for i, arg in enumerate(argv):
        value = arg.split("=", 1)[1] if arg.startswith("--ranks=") else (
            argv[i + 1] if arg == "--ranks" and i + 1 < len(argv) else None)
        if value is not None:
            return int(value) if value.isdigit() else 1
    return 1


def _parser(argv: list[str]) -> argparse.ArgumentParser:
    from ckptio.cli import commands
    from ckptio.version import __version__

    parser = argparse.ArgumentParser(prog="ckptio", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"ckptio {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    commands.add_parsers(sub)
    bench = sub.add_parser("bench", help="benchmarks against peers and the disk's ceiling")
    bench.add_argument("which", choices=[*PEER_BENCHMARKS, "io"], help="io: ckptio.tuning's "
                       "I/O study; the others: the peer benchmarks of a ckptio checkout")
    bench.add_argument("rest", nargs=argparse.REMAINDER, metavar="...",
                       help="the benchmark's own options (ckptio bench WHICH --help)")
    sub.add_parser("demo", help="train a small GPT, SIGKILL it mid-save, resume it in a new "
                   "process and compare every loss bit for bit (--quick: seconds; ckptio demo "
                   "--help for its options)")
    tuning = sub.add_parser("tune", help="measure a filesystem or an S3 endpoint (s3://bucket/"
                            "prefix) and store its fastest I/O settings (--show prints them)")
    if argv[:1] == ["tune"]:  # its options (ckptio.tuning) only when run: a faster start
        from ckptio.tuning import tune

        tune.add_arguments(tuning)
    return parser


def _run(argv: list[str]) -> int:
    if argv[:1] == ["demo"]:  # all its options are its own (ckptio demo --help)
        from ckptio.demo import main as demo_main

        return demo_main.main(argv[1:])
    args = _parser(argv).parse_args(argv)
    if args.command == "tune":
        from ckptio.tuning import tune

        return tune.run(args)
    if args.command == "bench":
        return _bench(args.which, args.rest)
    from ckptio.cli import commands

    return commands.run(args)


def main(argv: list[str] | None = None) -> int:
    """The ``ckptio`` command. Exit status: 0 done (diff: the same), 1 diff found differences,
    2 an error, printed as one line on stderr (a CkptError's message names the fix)."""
    argv = sys.argv[1:] if argv is None else argv
    for stream in (sys.stdout, sys.stderr):  # a key or path the terminal's encoding lacks
        if isinstance(stream, io.TextIOWrapper):  # (PYTHONIOENCODING=ascii) is escaped
            with contextlib.suppress(OSError):  # a stream whose fd was replaced by a pipe
                stream.reconfigure(errors="backslashreplace")  # after it was made: unchanged
    try:
        status = _run(argv)
        sys.stdout.flush()  # a closed pipe shows here, inside the try
        return status
    except CkptError as exc:
        print(f"ckptio: error: {exc}", file=sys.stderr)
        return 2
    except OutputClosed as closed:  # `ckptio diff A B | head`: the status diff found
        _quiet_stdout()
        return closed.status
    except BrokenPipeError:  # `ckptio ls ... | head`: the reader left; not an error
        _quiet_stdout()
        return 0
    except OSError as exc:  # a file the command itself opens (e.g. a --copy-from DIR)
        print(f"ckptio: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ckptio: interrupted", file=sys.stderr)
        return 130


def _quiet_stdout() -> None:
    """Python's "Note on SIGPIPE": point stdout at devnull so the exit's flush is quiet."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
