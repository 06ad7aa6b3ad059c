"""Run PyTorch's own DCP tests against ckptio's DcpWriter / DcpReader, with DCP's run beside them.

For a developer to run by hand (it downloads the test files; CI has no network beyond the
package registries). Each file of PyTorch's ``test/distributed/checkpoint`` at the installed
torch's tag is run twice with pytest, in fresh processes: as it is (the control: DCP's own
FileSystemWriter / FileSystemReader), and with both replaced by ckptio's, through a
``sitecustomize`` put first on PYTHONPATH, so that the test processes PyTorch spawns get the
swap too. ``FileSystemWriter(path, ..., overwrite=...)`` becomes ``ckptio.DcpWriter(path,
overwrite=...)`` (its thread count, file-per-rank and extension arguments have no ckptio
counterpart and are dropped); ``FileSystemReader(path, ...)`` becomes ``ckptio.DcpReader(path)``.
The table counts passed / failed / skipped per file and run; a test DCP passes and ckptio fails
is a finding (or a DCP feature ckptio does not have: read the failure).

    python dev/pytorch_dcp_tests.py                          # the default files
    python dev/pytorch_dcp_tests.py --files test_dtensor_resharding.py --keep /tmp/ptd
    python dev/pytorch_dcp_tests.py --from /path/to/pytorch/test/distributed/checkpoint

Needs: ckptio installed in this interpreter, pytest, network access to GitHub (or --from).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

FILES = ("test_dtensor_resharding.py", "test_file_system_checkpoint_cpu.py",
         "test_file_system_checkpoint.py", "test_dtensor_checkpoint.py",
         "test_fsdp_model_state.py", "test_save_load_api.py", "test_nested_dict.py",
         "test_list_state_dict.py", "e2e/test_e2e_save_and_load.py")
RAW = "https://raw.githubusercontent.com/pytorch/pytorch/{ref}/test/distributed/checkpoint/{name}"

SWAP = '''
import ckptio
import torch.distributed.checkpoint as _dcp
import torch.distributed.checkpoint.filesystem as _fs


class FileSystemWriter(ckptio.DcpWriter):
    def __init__(self, path, *args, overwrite=True, **kwargs):
        super().__init__(path, overwrite=overwrite)


class FileSystemReader(ckptio.DcpReader):
    def __init__(self, path, *args, **kwargs):
        super().__init__(path)


for _module in (_dcp, _fs):
    _module.FileSystemWriter, _module.FileSystemReader = FileSystemWriter, FileSystemReader
'''


def fetch(names: list[str], ref: str, into: Path) -> None:
    for name in names:
        target = into / name
        target.parent.mkdir(parents=True, exist_ok=True)
        with urllib.request.urlopen(RAW.format(ref=ref, name=name), timeout=60) as response:
            target.write_bytes(response.read())


def run(path: Path, swap_dir: Path | None, timeout: float) -> tuple[dict[str, int], str]:
    env = dict(os.environ)
    if swap_dir is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(swap_dir),
                                                          env.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(path)], capture_output=True, text=True, env=env,
                          timeout=timeout, check=False)
    counts = {k: 0 for k in ("passed", "failed", "skipped", "error")}
    summary = (done.stdout.strip().splitlines() or [""])[-1]
    for number, what in re.findall(r"(\d+) (passed|failed|skipped|errors?)", summary):
        counts["error" if what.startswith("error") else what] += int(number)
    return counts, done.stdout + done.stderr


def main() -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", default=",".join(FILES), help="comma list, relative to "
                   "test/distributed/checkpoint")
    p.add_argument("--ref", default="v" + torch.__version__.split("+")[0],
                   help="the git tag or commit to fetch (default: the installed torch's tag)")
    p.add_argument("--from", dest="source", type=Path, help="a local copy of "
                   "test/distributed/checkpoint instead of downloading")
    p.add_argument("--keep", type=Path, help="keep the files and the runs' output here")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per pytest run")
    args = p.parse_args()
    names = [n.strip() for n in args.files.split(",") if n.strip()]
    work = args.keep or Path(tempfile.mkdtemp(prefix="pytorch-dcp-tests-"))
    work.mkdir(parents=True, exist_ok=True)
    tests = args.source or work / "tests"
    if args.source is None:
        fetch(names, args.ref, tests)
    swap = work / "swap"
    swap.mkdir(exist_ok=True)
    (swap / "sitecustomize.py").write_text(SWAP)
    print("| file | DCP passed / failed / skipped | ckptio passed / failed / skipped |")
    print("|---|---|---|")
    worse = 0
    for name in names:
        rows = []
        for label, swap_dir in (("dcp", None), ("ckptio", swap)):
            counts, output = run(tests / name, swap_dir, args.timeout)
            (work / f"{name.replace('/', '_')}.{label}.log").write_text(output)
            rows.append(counts)
        worse += max(0, rows[1]["failed"] + rows[1]["error"] - rows[0]["failed"] - rows[0]["error"])
        print(f"| {name} | " + " | ".join(
            f"{c['passed']} / {c['failed'] + c['error']} / {c['skipped']}" for c in rows) + " |")
    print(f"\nlogs: {work}")
    return 1 if worse else 0


if __name__ == "__main__":
    sys.exit(main())
