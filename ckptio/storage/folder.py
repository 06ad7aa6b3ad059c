"""The files of a local folder that go along with an export (``export_hf(copy_from=...)``):
``config.json``, tokenizer files and subfolders such as sentence-transformers' ``1_Pooling/``.

``files_under`` walks the folder without following anything out of it: each path it returns
is relative, made of names the directory itself listed (never ``..``, never absolute), and
resolves inside the folder. A symlink whose target lies outside the folder, a symlink to a
directory, or anything that is not a regular file or directory is refused with a CkptError
naming it: an export is often published, and a link out of the folder (``tokenizer.json ->
~/.ssh/id_rsa``) must not carry a private file into it. Hidden names (``.git``, ``.cache``)
are passed over, at every level, and so is a subfolder that is itself a ckptio checkpoint
(it holds ``manifest.json``: a Trainer's ``checkpoint-N/ckptio/`` beside its config.json):
the training state (optimizer, RNG) must not ride along into a published model folder.

``check_parents`` / ``make_parents`` check / create a relative path's folders inside the
destination, refusing a symlink there (it could lead the copy out of the destination).

Owns: that walk, those folders and their refusals. Does not own: which files an export leaves
out, the copying and the commit (ckptio/export.py).
"""

from __future__ import annotations

import os
import stat

from ckptio.errors import CkptError
from ckptio.format.manifest import MANIFEST_NAME
from ckptio.storage.local.durable import fsync_path

__all__ = ["check_parents", "files_under", "make_parents"]


def files_under(root: str) -> list[str]:
    """Every regular file below ``root`` (hidden names passed over), as sorted relative paths
    with ``/`` between names."""
    real = os.path.realpath(root)
    found: list[str] = []
    _walk(real, real, "", found)
    return sorted(found)


def _walk(real_root: str, directory: str, prefix: str, found: list[str]) -> None:
    with os.scandir(directory) as entries:
        listed = sorted(entries, key=lambda e: e.name)
    for entry in listed:
        if entry.name.startswith("."):
            continue
        rel = prefix + entry.name
        if entry.is_symlink():
            _check_link(real_root, entry.path, rel)
            found.append(rel)  # a file inside the folder: copied as the file it names
        elif entry.is_dir(follow_symlinks=False):
            if not os.path.lexists(os.path.join(entry.path, MANIFEST_NAME)):
                _walk(real_root, entry.path, rel + "/", found)
        elif entry.is_file(follow_symlinks=False):
            found.append(rel)
        else:
            raise CkptError(f"copy_from: {entry.path} is neither a file nor a folder (a "
                            "device, socket or pipe); remove it from the folder copied")


def _check_link(real_root: str, path: str, rel: str) -> None:
    """A symlink is copied only when it names a regular file inside the folder."""
    target = os.path.realpath(path)
    if os.path.commonpath([real_root, target]) != real_root:
        raise CkptError(f"copy_from: {rel} is a symlink to {target}, outside the folder "
                        f"{real_root}; links out of the folder are not followed (a Hugging Face "
                        "cache snapshot links into ../../blobs: copy it with links resolved, "
                        "e.g. cp -rL, and pass the copy)")
    try:
        mode = os.stat(target).st_mode
    except OSError as exc:
        raise CkptError(f"copy_from: {rel} is a symlink to {target}, which cannot be read "
                        f"({exc.strerror}); fix or remove the link") from None
    if not stat.S_ISREG(mode):
        raise CkptError(f"copy_from: {rel} is a symlink to {target}, which is not a file; "
                        "links to folders are not followed: replace the link by the folder")


def check_parents(out: str, rel: str) -> None:
    """Refuse a symlink or a file inside ``out`` where a folder of ``rel`` goes."""
    at = out
    for name in rel.split("/")[:-1]:
        at = os.path.join(at, name)
        if os.path.islink(at) or (os.path.lexists(at) and not os.path.isdir(at)):
            raise CkptError(f"copy_from: {at} is a symlink or a file where the folder {name}/ "
                            "goes; remove it from the destination")


def make_parents(out: str, rel: str) -> None:
    """The folders of ``rel`` (``/``-separated) inside ``out``, created (and their parents
    fsynced) where missing, after ``check_parents``."""
    check_parents(out, rel)
    at = out
    for name in rel.split("/")[:-1]:
        at = os.path.join(at, name)
        if not os.path.isdir(at):
            os.mkdir(at)
            fsync_path(os.path.dirname(at))
