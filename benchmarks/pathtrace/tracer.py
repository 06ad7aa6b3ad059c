"""Which ckptio modules lie on the stack when a path reaches a primitive (the "before" count
of issue 44, docs in ../paths_before.md). Test-support script, not part of the package.

A primitive event is: a Python call into a FLOOR module (storage/, io/, stepdir/, the byte
collectives), into torch.distributed or shutil, or a C call to a file-system builtin (open,
os.replace, os.fsync, ...) made from a ckptio frame. At each event the logical stack (this
thread's frames, then the frames that started this thread, recursively) is cut to its ckptio
frames outside the floor; their modules are the path's "spine".
"""
from __future__ import annotations

import sys
import threading
import types

# ckptio.stepdir (before issue 44) moved into ckptio.storage (steproot, local_root, memory_root,
# s3/root) on main: the same floor, under one prefix.
FLOOR_PREFIXES = ("ckptio.storage.", "ckptio.io.", "ckptio.stepdir.")
FLOOR_MODULES = {"ckptio.storage", "ckptio.io", "ckptio.stepdir",
                 "ckptio.distributed.dist", "ckptio.distributed.storegroup",
                 "ckptio.distributed.step", "ckptio.distributed.liveness",
                 "ckptio.redundancy.peers"}
# torch.distributed's collectives and groups (not DTensor / DeviceMesh attribute reads)
OTHER_PRIMITIVE_PREFIXES = ("torch.distributed.distributed_c10d", "torch.distributed.c10d_logger",
                            "shutil")
# calls into the floor that move no byte and exchange nothing: names, records, queries
NOT_PRIMITIVE = {"__init__", "__post_init__", "__new__", "__hash__", "__eq__", "__repr__",
                 "capabilities", "backend_kind", "location", "path_of", "where", "path",
                 "scheme_of", "checkpoint_path", "store_for", "store_and_file", "root_for",
                 "new_save_id", "is_ours", "plain_name", "check_if_locked", "current_group",
                 "is_empty", "sibling_location", "describe", "listed", "claim_of", "exact",
                 "stored_name", "__enter__",
                 # main (issue 44): a TreeStore's child() makes the store object of a
                 # sub-location (nothing is created until written: a name, as os.path.join was
                 # before, when tiering/ built paths itself)
                 "child"}
C_IO = {"open", "replace", "rename", "fsync", "fdatasync", "remove", "unlink", "rmdir", "mkdir",
        "listdir", "scandir", "pwrite", "pread", "pwritev", "preadv", "write", "read",
        "ftruncate", "posix_fallocate", "makedirs"}
C_IO_MODULES = {"posix", "builtins", "io", "_io", "os"}


def is_floor(module: str) -> bool:
    return module in FLOOR_MODULES or module.startswith(FLOOR_PREFIXES)


class Tracer:
    def __init__(self) -> None:
        self.chains: dict[tuple[tuple[str, str], ...], str] = {}
        self.active = False
        self._orig_start = threading.Thread.start

    # ------------------------------------------------------------ chains
    @staticmethod
    def _frames(frame) -> list[tuple[str, str]]:
        out = []
        while frame is not None:
            mod = frame.f_globals.get("__name__", "")
            if mod.startswith("ckptio"):
                out.append((mod, frame.f_code.co_qualname if hasattr(frame.f_code, "co_qualname")
                            else frame.f_code.co_name))
            frame = frame.f_back
        out.reverse()  # outermost first
        return out

    def _logical(self, frame) -> list[tuple[str, str]]:
        parent = getattr(threading.current_thread(), "_pathtrace_parent", [])
        return list(parent) + self._frames(frame)

    def _record(self, frame, what: str) -> None:
        chain = [f for f in self._logical(frame) if not is_floor(f[0])
                 and not f[0].startswith("ckptio.testing")]
        if chain:
            self.chains.setdefault(tuple(chain), what)

    # ------------------------------------------------------------ profile hook
    def _profile(self, frame, event, arg):
        if not self.active:
            return
        if event == "call":
            mod = frame.f_globals.get("__name__", "")
            caller = frame.f_back
            cmod = caller.f_globals.get("__name__", "") if caller is not None else ""
            if not cmod.startswith("ckptio") or is_floor(cmod):
                return
            if frame.f_code.co_name in NOT_PRIMITIVE and not mod.startswith("torch"):
                return
            if is_floor(mod) or mod.startswith(OTHER_PRIMITIVE_PREFIXES):
                self._record(caller, f"{mod}.{frame.f_code.co_name}")
            elif mod == "os" and frame.f_code.co_name in C_IO:
                self._record(caller, f"os.{frame.f_code.co_name}")
        elif event == "c_call":
            mod = frame.f_globals.get("__name__", "")
            if not mod.startswith("ckptio") or is_floor(mod):
                return
            name = getattr(arg, "__name__", "")
            if name not in C_IO:
                return
            owner = getattr(arg, "__self__", None)
            if isinstance(owner, types.ModuleType):
                where = owner.__name__
                if where in ("posix", "_io", "io") or (where == "builtins" and name == "open"):
                    self._record(frame, f"{where}.{name}")
            elif type(owner).__module__ in ("_io", "io"):  # a file object's read / write
                self._record(frame, f"file.{name}")

    # ------------------------------------------------------------ control
    def start(self) -> None:
        tracer = self
        orig = self._orig_start
        logical = self._logical

        def start(thread_self, *a, **k):
            if tracer.active:
                thread_self._pathtrace_parent = logical(sys._getframe(1))
            return orig(thread_self, *a, **k)

        threading.Thread.start = start
        self.active = True
        threading.setprofile(self._profile)
        sys.setprofile(self._profile)

    def stop(self) -> None:
        self.active = False
        sys.setprofile(None)
        threading.setprofile(None)
        threading.Thread.start = self._orig_start

    # ------------------------------------------------------------ results
    def result(self) -> list[dict]:
        return [{"chain": [list(f) for f in chain], "primitive": what}
                for chain, what in self.chains.items()]


SUBPATH_ENTRIES = {("ckptio.api", f"Checkpointer.{m}") for m in
                   ("save", "async_save", "load", "verify", "manifest", "read")}


def own_part(chain: list[list[str]]) -> list[list[str]] | None:
    """The chain cut at a Checkpointer entry reached from outside api/shared (None: no cut)."""
    for i, (mod, fn) in enumerate(chain):
        if (mod, fn) in SUBPATH_ENTRIES and i > 0 and chain[i - 1][0] not in ("ckptio.shared",
                                                                              "ckptio.api"):
            return chain[:i]
    return None


def summarise(records: list[dict]) -> dict:
    full: dict[str, set[str]] = {}
    own: dict[str, set[str]] = {}
    for r in records:
        chain = r["chain"]
        for mod, fn in chain:
            full.setdefault(mod, set()).add(fn)
        cut = own_part(chain)
        for mod, fn in (chain if cut is None else cut):
            own.setdefault(mod, set()).add(fn)
    return {"full": {m: sorted(v) for m, v in sorted(full.items())},
            "own": {m: sorted(v) for m, v in sorted(own.items())}}
