"""The key of the filesystem a path is on: its st_dev and its type from /proc/self/mountinfo.

Call order: ``filesystem_key(directory)`` (tuning/profile.py's lookup, the tuner, the I/O
report), which reads the mount table once per call. Owns: reading the mount table and choosing
the mount that holds a path. Does not own: the profiles kept per key (tuning/profile.py).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = ["filesystem_key", "fs_type"]

MOUNTINFO = "/proc/self/mountinfo"


def filesystem_key(directory: str | os.PathLike[str]) -> tuple[int, str]:
    """(st_dev, filesystem type) of ``directory``, or of its nearest existing parent: a
    checkpoint path usually does not exist yet when its profile is looked up."""
    path = _existing(Path(directory).absolute())
    device = os.stat(path).st_dev
    return device, fs_type(path, device)


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def fs_type(path: Path, device: int) -> str:
    """The type of the mount holding ``path``: the longest mount point above it, preferring
    mounts of the same device (bind mounts and btrfs subvolumes make st_dev ambiguous)."""
    try:
        lines = Path(MOUNTINFO).read_text().splitlines()
    except OSError:
        return "unknown"
    real = os.path.realpath(path)
    best: tuple[bool, int, str] = (False, -1, "unknown")
    for line in lines:
        mount = _parse_mount(line)
        if mount is None or not _is_under(real, mount[1]):
            continue
        rank = (mount[0] == device, len(mount[1]), mount[2])
        best = max(best, rank)
    return best[2]


def _parse_mount(line: str) -> tuple[int, str, str] | None:
    """(device, mount point, fs type) of one mountinfo line (see proc(5))."""
    left, sep, right = line.partition(" - ")
    fields, tail = left.split(), right.split()
    if not sep or len(fields) < 5 or not tail:
        return None
    major, _, minor = fields[2].partition(":")
    if not (major.isdigit() and minor.isdigit()):
        return None
    mount_point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])  # \040: space
    return os.makedev(int(major), int(minor)), mount_point, tail[0]


def _is_under(path: str, mount_point: str) -> bool:
    return mount_point == "/" or path == mount_point or path.startswith(mount_point.rstrip("/") + "/")
