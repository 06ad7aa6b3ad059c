"""``ckptio convert`` and ``ckptio export``: a checkpoint in another format.

Owns: the commands' arguments handed to the library (``ckptio.convert.convert`` for convert:
ckptio, DCP, torch.save or safetensors; ``ckptio.export.export_hf`` for export), the progress
bar and the lines they print. Does not own: the conversion, its destination checks, reading,
saving or exporting themselves.
"""

from __future__ import annotations

from collections.abc import Callable

from ckptio.cli.progress import Bar
from ckptio.errors import CkptError

__all__ = ["convert", "export", "renamer"]


class _Shown:
    """The write's progress as a bar, made when the first count (and with it the total)
    arrives."""

    def __init__(self, enabled: bool, desc: str = "convert") -> None:
        self.enabled, self.desc = enabled, desc
        self.bar: Bar | None = None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            self.bar = Bar(total, self.desc, self.enabled)
        self.bar.to(done)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def convert(src: str, dst: str, *, to: str, overwrite: bool, allow_pickle: bool,
            per_rank_from: int | None, drop_non_tensors: bool, progress: bool) -> int:
    """``ckptio.convert.convert`` with the command's arguments; one line of what was written
    (and of what was left out, or what torch.load needs)."""
    from ckptio.convert import convert as run

    shown = _Shown(progress)
    try:
        done = run(src, dst, to=to, overwrite=overwrite, allow_pickle=allow_pickle,
                   per_rank_from=per_rank_from, drop_non_tensors=drop_non_tensors,
                   progress=shown if progress else None)
    finally:
        shown.close()
    what = {"ckptio": "ckptio checkpoint", "dcp": "DCP checkpoint (FileSystemReader reads it)",
            "torch.save": "torch.save file", "safetensors": "Hugging Face safetensors folder",
            "torch_checkpointing": "torch_checkpointing checkpoint (its CheckpointManager "
                                   "reads it)"}
    print(f"{src} -> {dst}: {what[to]} of {done.nbytes} tensor bytes in {len(done.files)} "
          "file(s)")
    if done.dropped:
        print(f"left out (safetensors cannot hold them, or the rest of their top-level entry, "
              f"or tied aliases): {_grouped(done.dropped)}")
        print(f"for a from_pretrained folder of the model alone, names without its prefix: "
              f"ckptio export {src} {dst} --keys model.")
    if done.needs_pickle:
        print(f"torch.load(weights_only=True) refuses {', '.join(done.needs_pickle)} (numpy "
              "values, pickled objects, a defaultdict or namedtuple): load it with "
              "weights_only=False if you trust it")
    return 0


def _grouped(keys: tuple[str, ...]) -> str:
    """``keys`` with those of one top-level entry shown as the entry and their count."""
    groups: dict[str, list[str]] = {}
    for key in keys:
        groups.setdefault(key.split(".", 1)[0], []).append(key)
    return ", ".join(members[0] if len(members) == 1 else f"{top} ({len(members)} keys)"
                     for top, members in groups.items())


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
           max_shard_bytes: int, copy_from: str | None, overwrite: bool, verify: bool,
           progress: bool = True) -> int:
    """ckptio.export.export_hf with the command's arguments (a bar of the bytes written)."""
    try:
        from ckptio.export import export_hf
    except ImportError as exc:
        if isinstance(exc, ModuleNotFoundError) and exc.name == "ckptio.export":
            raise CkptError("ckptio export: this ckptio has no Hugging Face export yet (no "
                            "module ckptio.export); upgrade ckptio") from None
        package = (exc.name or "ckptio").split(".")[0]  # a dependency of the export
        raise CkptError(f"ckptio export needs the package {package} ({exc}); install it "
                        f"(pip install {package})") from None
    shown = _Shown(progress, "export")
    try:
        done = export_hf(src, dst, keys=keys or None, rename=renamer(rename), dtype=dtype,
                         max_shard_bytes=max_shard_bytes, copy_from=copy_from,
                         overwrite=overwrite, verify=None if verify else False,
                         progress=shown if progress else None)
    finally:
        shown.close()
    dropped = (f", tied alias(es) left out (from_pretrained ties them again): "
               f"{', '.join(done.dropped)}" if done.dropped else "")
    print(f"{src} -> {dst}: {len(done.files)} safetensors file(s), {done.total_size} bytes, "
          f"{done.total_parameters} parameters{dropped}")
    return 0
