"""``ckptio convert`` and ``ckptio export``: a checkpoint in another format.

Owns: convert (any checkpoint ckptio.load reads -> a ckptio checkpoint, by a fresh load and a
save: the simplest correct way, costing the state's size in host memory), refusing a
destination that already holds a checkpoint unless ``overwrite``, and calling
``ckptio.export.export_hf`` for export. Does not own: reading, saving or exporting themselves.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from ckptio.cli.progress import Bar
from ckptio.errors import CkptError
from ckptio.io.s3client import is_s3
from ckptio.loading import foreign, safetensors
from ckptio.storage import steps
from ckptio.storage.select import checkpoint_path, store_for

__all__ = ["convert", "export", "held_at", "renamer"]


def held_at(path: str) -> str | None:
    """What checkpoint ``path`` already holds ("a ckptio checkpoint", "a DCP checkpoint", "a
    Hugging Face folder", "a file"), or None."""
    text = checkpoint_path(path)
    if not is_s3(text) and os.path.isfile(text):
        return "a file"
    store = store_for(text)
    for holds, what in ((steps.is_committed, "a ckptio checkpoint"),
                        (foreign.holds_dcp, "a DCP checkpoint"),
                        (safetensors.holds_hf, "a Hugging Face folder")):
        if holds(store):
            return what
    return None


def _check_destination(src: str, dst: str, overwrite: bool) -> None:
    if checkpoint_path(src).rstrip("/") == checkpoint_path(dst).rstrip("/"):
        raise CkptError(f"ckptio convert: SRC and DST are both {dst}; choose another DST")
    held = held_at(dst)
    if held == "a file":
        raise CkptError(f"ckptio convert: {dst} is a file, and a ckptio checkpoint is a "
                        "directory; choose another DST")
    if held is not None and not overwrite:
        raise CkptError(f"ckptio convert: {dst} already holds {held}; pass --overwrite to "
                        "replace it (it stays intact until the new checkpoint commits) or "
                        "choose another DST")


def convert(src: str, dst: str, *, overwrite: bool, allow_pickle: bool, progress: bool) -> int:
    """Load ``src`` whole into host memory, then save it at ``dst`` as a ckptio checkpoint."""
    _check_destination(src, dst, overwrite)
    import ckptio

    state = ckptio.load(src, allow_pickle=allow_pickle)
    handle = ckptio.async_save(state, dst, allow_pickle=allow_pickle)
    with Bar(handle.progress().nbytes_total, "convert", progress) as bar:
        while bar.shown and not handle.done():
            bar.to(handle.progress().nbytes_written)
            time.sleep(0.1)
        result = handle.wait()
    print(f"{src} -> {dst}: ckptio checkpoint of {result.nbytes} bytes in "
          f"{len(result.files)} file(s)")
    return 0


def renamer(pairs: list[tuple[str, str]]) -> Callable[[str], str] | None:
    """``--rename OLD=NEW ...`` as export_hf's ``rename``: the first OLD a name starts with is
    replaced by its NEW; other names are kept."""
    if not pairs:
        return None

    def rename(name: str) -> str:
        for old, new in pairs:
            if name.startswith(old):
                return new + name[len(old):]
        return name

    return rename


def export(src: str, dst: str, *, keys: str, rename: list[tuple[str, str]], dtype: str | None,
           max_shard_bytes: int, copy_from: str | None, overwrite: bool, verify: bool) -> int:
    """ckptio.export.export_hf with the command's arguments."""
    try:
        from ckptio.export import export_hf
    except ImportError as exc:
        if isinstance(exc, ModuleNotFoundError) and exc.name == "ckptio.export":
            raise CkptError("ckptio export: this ckptio has no Hugging Face export yet (no "
                            "module ckptio.export); upgrade ckptio") from None
        package = (exc.name or "ckptio").split(".")[0]  # a dependency of the export
        raise CkptError(f"ckptio export needs the package {package} ({exc}); install it "
                        f"(pip install {package})") from None
    done = export_hf(src, dst, keys=keys or None, rename=renamer(rename), dtype=dtype,
                     max_shard_bytes=max_shard_bytes, copy_from=copy_from, overwrite=overwrite,
                     verify=None if verify else False)
    dropped = (f", tied alias(es) left out (from_pretrained ties them again): "
               f"{', '.join(done.dropped)}" if done.dropped else "")
    print(f"{src} -> {dst}: {len(done.files)} safetensors file(s), {done.total_size} bytes, "
          f"{done.total_parameters} parameters{dropped}")
    return 0
