"""The bytes of one rank's memory step, and how they move between ranks: what the redundancy's
protection (protect.py) and restore (rebuild.py) share.

- **A step's stream**: a rank's one-rank checkpoint ``r<rank>/step-N`` as its manifest's bytes
  plus its data files concatenated in manifest order (every file a multiple of BLOCK bytes),
  read through its Store; rebuilt into a checkpoint by writing the files, the manifest last
  (a step of one file on tmpfs is received into that file itself: ``landing_buffer``).
- **Transport**: a gloo process group of the redundancy's own (made once per manager, so its
  messages never interleave with the training's collectives): all_gather of small JSON
  messages, point-to-point send/recv of uint8 tensors; under a bandwidth budget (budget.py)
  in chunks of budget.CHUNK, every receive posted before the first paced send. The caller's
  thread's gathers meet first over the job's store (``Meeting``), so that a rank frozen or
  dead is named after rank_timeout_s, not after the gather's own timeout.
Where the copies live on each host: marks.py.

Owns: the stream, its reading and writing, the transport. Does not own: what to send where
(topology.py), when (protect.py), the restore's decisions (rebuild.py), the stores (storage/).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import xxhash

from ckptio.alignment import align_up
from ckptio.errors import CkptError, CorruptCheckpointError, RankFailedError, StorageIOError
from ckptio.format import manifest as manifest_format
from ckptio.redundancy.budget import CHUNK, Budget
from ckptio.storage.local.local_store import LocalStore
from ckptio.storage.local.mapped import new_shared_file, on_tmpfs
from ckptio.storage.store_contract import TreeStore, new_save_id

__all__ = ["Meeting", "Stream", "agree_min", "all_gather_json", "all_ok", "bases_of",
           "chunk_spans",
           "digest", "files_of", "landing_buffer",
           "map_stream", "piece", "piece_len", "piece_nbytes", "post_recv", "read_block", "read_stream", "recv",
           "recv_into",
           "send", "stream_damage", "stream_entries", "send_paced", "write_checkpoint", "write_json", "xor_into"]

log = logging.getLogger("ckptio")
_STEP_NAME = re.compile(r"step-(\d+)$", re.ASCII)


@dataclass
class Stream:
    """One rank's step: its manifest bytes, its files (name, nbytes) and their bytes."""

    manifest: bytes
    files: list[tuple[str, int]]
    data: torch.Tensor  # uint8, the files concatenated
    bases: tuple[int, ...] = ()  # the steps a delta step needs (its manifest's bases)

    def meta(self) -> dict[str, Any]:
        return {"manifest": self.manifest.decode(), "files": self.files,
                "nbytes": int(self.data.numel()), "digest": digest(self.manifest),
                "bases": list(self.bases)}


def digest(data: bytes | memoryview | torch.Tensor) -> str:
    if isinstance(data, torch.Tensor):
        data = data.numpy().data.cast("B") if data.numel() else b""
    return xxhash.xxh3_64_hexdigest(data)


def files_of(manifest: bytes, where: str) -> list[tuple[str, int]]:
    """The data files a manifest names, in its order (decoded and checked: CRC, bounds)."""
    record = manifest_format.decode(manifest, where)
    return [(f.name, f.nbytes) for f in record.files]


def bases_of(manifest: bytes, where: str) -> tuple[int, ...]:
    """The steps (``step-B`` siblings) a delta step's manifest needs; () for a full step.
    CkptError if a base is not named as a step."""
    names = manifest_format.bases_of(manifest_format.decode(manifest, where))
    found = [_STEP_NAME.match(name) for name in names]
    if not all(found):
        raise CkptError(f"{where}: its bases {list(names)} are not steps (step-N): a memory "
                        "tier's delta steps are deltas of its own steps")
    return tuple(int(m.group(1)) for m in found if m)


def read_stream(store: TreeStore, reuse: torch.Tensor | None = None) -> Stream:
    """The stream of the checkpoint committed in ``store``. ``reuse``: a buffer (a previous
    stream's data, no longer in use) read into where it is large enough, so that a thread
    reading a step every step does not fault in fresh pages each time."""
    manifest = store.read_manifest()
    files = files_of(manifest, store.location)
    total = sum(n for _, n in files)
    data = (reuse[:total] if reuse is not None and reuse.numel() >= total
            else torch.empty(total, dtype=torch.uint8))
    view = data.numpy().data.cast("B") if data.numel() else memoryview(b"")
    offset = 0
    for name, nbytes in files:
        got = store.read_into(name, view[offset:offset + nbytes])
        if got != nbytes:
            raise StorageIOError(f"{store.path_of(name)}: {got} bytes, its manifest names "
                                 f"{nbytes}")
        offset += nbytes
    return Stream(manifest, files, data, bases_of(manifest, store.location))


def map_stream(store: TreeStore) -> Stream:
    """read_stream, but a step of one data file on a local filesystem (the memory tier's tmpfs)
    is mapped, not copied: its pages are sent or read where they lie (read-only)."""
    manifest = store.read_manifest()
    files = files_of(manifest, store.location)
    data = _mapped(store, files[0][0], files[0][1]) if len(files) == 1 else None
    if data is None:
        return read_stream(store)
    return Stream(manifest, files, data, bases_of(manifest, store.location))


def _mapped(store: TreeStore, name: str, nbytes: int) -> torch.Tensor | None:
    """File ``name`` of ``store`` mapped read-only (MAP_PRIVATE: never written back), where it
    is a local file of ``nbytes``; else None (the caller reads it)."""
    if not isinstance(store, LocalStore) or nbytes == 0:
        return None
    if store.sizes([name]).get(name) != nbytes:
        return None  # read_stream's read names the difference
    return torch.from_file(store.path_of(name), shared=False, size=nbytes, dtype=torch.uint8)


def read_block(held: TreeStore, name: str) -> tuple[dict[str, Any], torch.Tensor]:
    """A parity block ``name`` (``.json`` and ``.bin``) of ``held`` -> (its JSON, its bytes:
    mapped where local), checked against the xxh3 recorded when it was encoded;
    CorruptCheckpointError if it does not match or its record is damaged (naming the file),
    CkptError if it cannot be read."""
    try:
        info = json.loads(held.read_file(f"{name}.json"))
        nbytes = int(info["nbytes"])
    except (ValueError, KeyError, TypeError) as exc:  # not JSON, or not a block's record
        raise CorruptCheckpointError(
            f"{held.path_of(name + '.json')}, the record of a parity block, is damaged "
            f"({type(exc).__name__}: {exc})") from None
    block = _mapped(held, f"{name}.bin", nbytes)
    if block is None:
        data = bytearray(held.read_file(f"{name}.bin"))
        block = torch.frombuffer(data or bytearray(1), dtype=torch.uint8)[:len(data)]
    if block.numel() != info["nbytes"] or digest(block) != info["digest"]:
        raise CorruptCheckpointError(f"{held.path_of(name + '.bin')} does not match the xxh3 "
                                     "recorded when it was encoded (corrupted)")
    return info, block


def stream_entries(manifest: bytes, files: list[tuple[str, int]],
                   where: str) -> list[tuple[int, Any]] | None:
    """(offset in the stream, entry) of every tensor entry with bytes, where the manifest's
    checksums alone check the stream (landing.StreamCheck); else None: a compressed or
    delta entry, regular sections, index files, bases (the written step is verified whole)."""
    record = manifest_format.decode(manifest, where)
    if (record.regular or record.indexes or record.bases or record.checksum_algorithm
            not in ("xxh3_64_tree", "xxh3_64")
            or any(e.stored is not None or e.delta is not None for e in record.tensors)):
        return None
    starts, offset = {}, 0
    for name, nbytes in files:
        starts[name] = offset
        offset += nbytes
    if any(e.nbytes and e.file not in starts for e in record.tensors):
        return None  # an entry outside this stream: the full verify names it
    return [(starts[e.file] + e.offset, e) for e in record.tensors if e.nbytes]


def stream_damage(where: str, entry: Any, got: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{where}: entry {entry.key!r} ({entry.file} at {entry.offset}) does not match its "
        f"checksum ({got} != {entry.checksum}): the copy or rebuild is damaged")


def landing_buffer(store: TreeStore, files: list[tuple[str, int]],
                   nbytes: int) -> tuple[torch.Tensor, bool]:
    """Where a step of ``nbytes`` received from peers lands -> (the tensor, placed). Placed:
    ``store`` (the step's scratch directory) is a local directory on tmpfs and the step is one
    data file, so the tensor is that file's own pages there (what ``store`` held removed
    first; the file sized and allocated now, so a full tmpfs fails here, never inside a
    receive; mapped shared): installing the step is committing its manifest
    (``write_checkpoint(..., placed=True)``), no copy. Else (or where the file cannot be
    made: logged) a fresh tensor, written by ``write_checkpoint`` as before."""
    if (nbytes and len(files) == 1 and files[0][1] == nbytes and isinstance(store, LocalStore)
            and on_tmpfs(store.directory)):
        try:
            return _placed(store, files[0][0], nbytes), True
        except (OSError, RuntimeError, CkptError) as exc:  # from_file's RuntimeError included
            log.warning("ckptio: %s: the received step cannot land in place (%s): received "
                        "into memory and written after", store.location, exc)
            store.remove_tree()
    return torch.empty(nbytes, dtype=torch.uint8), False


def _placed(store: LocalStore, name: str, nbytes: int) -> torch.Tensor:
    problems = store.remove_tree()
    if problems:
        raise StorageIOError(f"{store.location}: cannot replace what it holds: {problems[0]}")
    store.prepare()
    path = store.path_of(name)
    new_shared_file(path, nbytes)
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def write_checkpoint(store: TreeStore, manifest: bytes, files: list[tuple[str, int]],
                     data: torch.Tensor, placed: bool = False) -> None:
    """Write ``data`` split into ``files`` in ``store`` (what it held removed first), then
    commit the manifest: a checkpoint (incomplete until its manifest lands). ``placed``:
    ``data`` is already ``store``'s file (``landing_buffer``): the manifest alone is written."""
    offset = sum(nbytes for _name, nbytes in files)
    if not placed:
        problems = store.remove_tree()
        if problems:
            raise StorageIOError(f"{store.location}: cannot replace what it holds: "
                                 f"{problems[0]}")
        store.prepare()
        view = data.numpy().data.cast("B") if data.numel() else memoryview(b"")
        at = 0
        for name, nbytes in files:
            store.write_file(name, view[at:at + nbytes])
            at += nbytes
    if offset != data.numel():
        raise CkptError(f"{store.location}: {data.numel()} bytes received, the files name "
                        f"{offset}")
    store.commit(manifest, new_save_id())


def write_json(store: TreeStore, name: str, value: Any) -> None:
    """Write file ``name`` of ``store`` as ``value``'s JSON, whole (a marker)."""
    store.write_file(name, json.dumps(value, sort_keys=True).encode())


def piece_nbytes(longest: int, k: int) -> int:
    """The size of each of the k pieces of a parity group whose longest shard is ``longest``:
    ceil(longest / k), rounded up to 8 bytes (XOR in 64-bit words)."""
    per = -(-longest // k)
    return align_up(per, 8)


def piece(data: torch.Tensor, i: int, p: int) -> torch.Tensor:
    """Piece ``i`` (of size ``p``) of a shard, without its zero padding: data[i*p:(i+1)*p]."""
    return data[min(i * p, data.numel()):min((i + 1) * p, data.numel())]


def piece_len(nbytes: int, i: int, p: int) -> int:
    """The length of piece ``i`` of a shard of ``nbytes`` (its padding is not sent)."""
    return max(0, min(p, nbytes - i * p))


def xor_into(acc: torch.Tensor, data: torch.Tensor) -> None:
    """acc[:len(data)] ^= data (uint8; as int64 words where the lengths allow)."""
    n = data.numel()
    if n % 8 == 0 and acc.numel() % 8 == 0:
        acc[:n].view(torch.int64).bitwise_xor_(data.view(torch.int64))
    else:
        acc[:n].bitwise_xor_(data)


# ------------------------------------------------------------------ transport (gloo)

class Meeting:
    """The gathers of a restore on the caller's thread (inventories, metadata, outcomes).
    Every rank first says it is there over the job's store (``arrivals``: a StoreGroup of
    every rank; storegroup.py): a rank that died or froze is named after rank_timeout_s, one
    alive but still busy (protecting, loading from a slow tier) is waited for up to
    step_timeout_s. Then the values go over ``group``, a gloo group of peer_timeout_s, as
    every rank is at the gather by then: a gloo gather alone waits its whole timeout for a
    frozen rank."""

    def __init__(self, arrivals: Any, group: Any, rank: int,
                 name_ranks: Callable[[Sequence[int]], str]) -> None:
        self.arrivals, self.group, self.rank = arrivals, group, rank
        self.name_ranks = name_ranks  # Topology.name_ranks: ranks with their hosts

    def all_gather_json(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (JSON), in rank order, once every rank has come."""
        try:
            self.arrivals.all_gather(b"")
        except RankFailedError as exc:
            raise RankFailedError(
                f"rank {self.rank}: a restore from the memory of other hosts stopped where the "
                f"ranks meet, waiting for {self.name_ranks(exc.ranks) or 'a rank'}: {exc}; "
                "restart the job (the restore is made again with the ranks alive then)",
                exc.ranks) from exc
        return all_gather_json(self.group, value)


    def leave(self, ranks: Sequence[int], why: str) -> None:
        """This rank leaves the restore, ``why`` (a transfer found ``ranks`` gone), instead of
        coming to the next meeting: recorded in the job's store, so that every rank waiting
        there raises it at its next look, not after step_timeout_s (this rank is alive)."""
        self.arrivals.record_failure(list(ranks) or [self.rank],
                                     f"found gone by rank {self.rank}'s restore ({why})")


def all_gather_json(group: Any, value: Any) -> list[Any]:
    """Every rank's ``value`` (JSON), in group rank order."""
    data = json.dumps(value).encode()
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, size, group=group)
    longest = int(max(s.item() for s in sizes))
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    outs = [torch.empty(longest, dtype=torch.uint8) for _ in sizes]
    dist.all_gather(outs, mine, group=group)
    return [json.loads(bytes(o[:int(s.item())].numpy())) for o, s in zip(outs, sizes)]


def send(group: Any, data: torch.Tensor, dst: int, tag: int = 0) -> Any:
    """Post a send of ``data`` to (global) rank ``dst``; -> a work to wait on (None: empty)."""
    return dist.isend(data, dst, group=group, tag=tag) if data.numel() else None


def recv(group: Any, nbytes: int, src: int, tag: int = 0) -> torch.Tensor:
    """Receive ``nbytes`` from (global) rank ``src`` (blocking)."""
    out = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes:
        dist.recv(out, src, group=group, tag=tag)
    return out


def recv_into(group: Any, out: torch.Tensor, src: int, tag: int = 0) -> None:
    """Receive ``out.numel()`` bytes from (global) rank ``src`` into ``out`` (blocking)."""
    if out.numel():
        dist.recv(out, src, group=group, tag=tag)


def chunk_spans(nbytes: int) -> list[tuple[int, int]]:
    """The chunks [lo, hi) of budget.CHUNK bytes that ``nbytes`` are sent in."""
    return [(lo, min(lo + CHUNK, nbytes)) for lo in range(0, nbytes, CHUNK)]


def post_recv(group: Any, nbytes: int, src: int, tag: int = 0) -> tuple[torch.Tensor, list[Any]]:
    """Post the receives of ``nbytes`` from rank ``src``, sent by send_paced in chunks ->
    (the tensor they land in, the works to wait on)."""
    out = torch.empty(nbytes, dtype=torch.uint8)
    return out, [dist.irecv(out[lo:hi], src, group=group, tag=tag) for lo, hi in chunk_spans(nbytes)]


def send_paced(group: Any, sends: list[tuple[torch.Tensor, int, int]],
               budget: Budget) -> list[tuple[int, Any]]:
    """Send each (data, dst, tag) in chunks, round-robin over the sends, each chunk posted once
    ``budget`` allows it -> (dst, work) per chunk. The receivers posted post_recv first (two
    sends to one rank: told apart by their tags, each one's chunks in order)."""
    works = []
    for lo, hi in chunk_spans(max((data.numel() for data, _dst, _tag in sends), default=0)):
        for data, dst, tag in sends:
            piece = data[lo:min(hi, data.numel())]
            if piece.numel():
                budget.spend(piece.numel())
                works.append((dst, dist.isend(piece, dst, group=group, tag=tag)))
    return works


def agree_min(group: Any, value: int) -> int:
    """The smallest of every rank's ``value`` (a MIN all_reduce)."""
    flag = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return int(flag.item())


def all_ok(group: Any, ok: bool) -> bool:
    """Whether every rank says ok (a MIN all_reduce)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
