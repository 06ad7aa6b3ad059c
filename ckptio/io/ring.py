"""A minimal io_uring over the raw system calls: set up a ring, queue reads/writes, reap results.

Owns: the kernel ABI (struct layouts, mmap offsets, opcodes), io_uring_setup/enter/register through
ctypes (which releases the GIL for the duration of each call), and the probe that says whether
this kernel and sandbox let us use io_uring at all. It knows nothing of files, futures or errors
beyond errno: uring.py builds the backend on top.

Why ctypes and not a binding: measured in docs/PROBES.md. The liburing wheel dies with SIGILL on
this machine's CPU; and since the kernel does the work and Python only fills 64-byte entries, a C
extension would save CPU per request, not bandwidth, while adding a build step that installing
ckptio must not need.

Memory ordering: the submission ring is read by the kernel inside io_uring_enter on this same
thread (no SQPOLL), so program order suffices. Completions are written by other CPUs; Python
cannot issue an acquire load, so the ring is only enabled on x86-64, whose loads are not
reordered with other loads (TSO). Elsewhere the probe reports io_uring unavailable.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import struct

__all__ = ["MAX_REGISTERED", "OP_NOP", "OP_READ", "OP_READ_FIXED", "OP_WRITE", "OP_WRITE_FIXED",
           "Ring", "address_of", "unavailable_reason"]

SYS_SETUP, SYS_ENTER, SYS_REGISTER = 425, 426, 427  # same numbers on every architecture
OP_NOP, OP_READ_FIXED, OP_WRITE_FIXED, OP_READ, OP_WRITE = 0, 4, 5, 22, 23
ENTER_GETEVENTS = 1
FEAT_SINGLE_MMAP = 1
OFF_SQ_RING, OFF_CQ_RING, OFF_SQES = 0, 0x8000000, 0x10000000
REGISTER_BUFFERS, REGISTER_PROBE, REGISTER_BUFFERS2, REGISTER_BUFFERS_UPDATE = 0, 8, 15, 16
RSRC_REGISTER_SPARSE = 1
MAX_REGISTERED = 1 << 30  # the kernel limits one registered buffer to 1 GiB

_SQE = struct.Struct("<BBHiQQIIQHHiQQ")  # struct io_uring_sqe, 64 bytes
_CQE = struct.Struct("<QiI")  # struct io_uring_cqe, 16 bytes
_U32 = struct.Struct("<I")
_RSRC = struct.Struct("<IIQQQ")  # struct io_uring_rsrc_register, 32 bytes
_UPDATE = struct.Struct("<IIQQII")  # struct io_uring_rsrc_update2, 32 bytes
_PARAMS = struct.Struct("<10I" + "8IQ" + "8IQ")  # io_uring_params: 120 bytes

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


def _call(*args: int | bytes | ctypes.c_void_p | None) -> int:
    """One system call; OSError with the errno on failure. The GIL is released while in it."""
    result = _syscall(*[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return result


class Ring:
    """One io_uring: ``entries`` submission slots, twice as many completion slots."""

    def __init__(self, entries: int) -> None:
        params = ctypes.create_string_buffer(_PARAMS.size)
        self.fd = _call(SYS_SETUP, entries, ctypes.cast(params, ctypes.c_void_p))
        try:
            self._map(_PARAMS.unpack(params.raw))
        except BaseException:
            os.close(self.fd)
            raise

    def _map(self, p: tuple[int, ...]) -> None:
        sq_entries, cq_entries, features = p[0], p[1], p[5]
        sq_off, cq_off = p[10:19], p[19:28]
        sq_bytes = sq_off[6] + sq_entries * 4  # array offset + u32 per slot
        cq_bytes = cq_off[5] + cq_entries * _CQE.size  # cqes offset + entries
        prot, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | mmap.MAP_POPULATE
        if features & FEAT_SINGLE_MMAP:
            self._sq_map = mmap.mmap(self.fd, max(sq_bytes, cq_bytes), flags, prot, offset=OFF_SQ_RING)
            self._cq_map = self._sq_map
        else:
            self._sq_map = mmap.mmap(self.fd, sq_bytes, flags, prot, offset=OFF_SQ_RING)
            self._cq_map = mmap.mmap(self.fd, cq_bytes, flags, prot, offset=OFF_CQ_RING)
        self._sqes = mmap.mmap(self.fd, sq_entries * _SQE.size, flags, prot, offset=OFF_SQES)
        self.sq_entries, self.cq_entries = sq_entries, cq_entries
        self._sq_head, self._sq_tail, self._sq_mask, self._sq_array = sq_off[0], sq_off[1], sq_off[2], sq_off[6]
        self._cq_head, self._cq_tail, self._cq_mask, self._cqes = cq_off[0], cq_off[1], cq_off[2], cq_off[5]
        self._sq_mask_value = _U32.unpack_from(self._sq_map, self._sq_mask)[0]
        self._cq_mask_value = _U32.unpack_from(self._cq_map, self._cq_mask)[0]
        self._queued = 0  # entries placed in the ring but not yet handed to the kernel

    def push(self, opcode: int, fd: int, offset: int, address: int, nbytes: int,
             user_data: int, buf_index: int = 0) -> None:
        """Place one request in the submission ring; ``enter`` hands it to the kernel.

        The caller keeps at most ``sq_entries`` requests queued between two enters."""
        tail = _U32.unpack_from(self._sq_map, self._sq_tail)[0]
        index = tail & self._sq_mask_value
        _SQE.pack_into(self._sqes, index * _SQE.size, opcode, 0, 0, fd, offset, address, nbytes,
                       0, user_data, buf_index, 0, 0, 0, 0)
        _U32.pack_into(self._sq_map, self._sq_array + 4 * index, index)
        _U32.pack_into(self._sq_map, self._sq_tail, (tail + 1) & 0xFFFFFFFF)
        self._queued += 1

    def submit(self) -> None:
        """Hand every queued request to the kernel (one system call for the whole batch)."""
        while self._queued:
            try:
                self._queued -= _call(SYS_ENTER, self.fd, self._queued, 0, 0, None, 0)
            except OSError as exc:
                if exc.errno not in (errno.EINTR, errno.EAGAIN, errno.EBUSY):
                    self._unqueue()
                    raise

    def _unqueue(self) -> None:
        """Take back entries the kernel has not consumed, so a failed submission never runs later
        (when its memory may belong to someone else); the kernel consumes in order from the head."""
        tail = _U32.unpack_from(self._sq_map, self._sq_tail)[0]
        _U32.pack_into(self._sq_map, self._sq_tail, (tail - self._queued) & 0xFFFFFFFF)
        self._queued = 0

    def wait(self) -> None:
        """Block (GIL released) until at least one completion is available."""
        try:
            _call(SYS_ENTER, self.fd, 0, 1, ENTER_GETEVENTS, None, 0)
        except OSError as exc:
            if exc.errno not in (errno.EINTR, errno.EAGAIN, errno.EBUSY):
                raise

    def reap(self) -> list[tuple[int, int]]:
        """Every completion available now, as (user_data, result); frees their slots."""
        head = _U32.unpack_from(self._cq_map, self._cq_head)[0]
        tail = _U32.unpack_from(self._cq_map, self._cq_tail)[0]
        done = []
        while head != tail:
            offset = self._cqes + (head & self._cq_mask_value) * _CQE.size
            user_data, result, _flags = _CQE.unpack_from(self._cq_map, offset)
            done.append((user_data, result))
            head = (head + 1) & 0xFFFFFFFF
        _U32.pack_into(self._cq_map, self._cq_head, head)
        return done

    def register_buffers(self, regions: list[tuple[int, int]]) -> None:
        """Pin (address, nbytes) regions so READ_FIXED/WRITE_FIXED skip per-request page pinning."""
        iovecs = (ctypes.c_uint64 * (2 * len(regions)))(*[v for r in regions for v in r])
        _call(SYS_REGISTER, self.fd, REGISTER_BUFFERS, ctypes.cast(iovecs, ctypes.c_void_p), len(regions))

    def register_sparse(self, slots: int) -> None:
        """An empty table of ``slots`` fixed buffers, filled one by one with ``update_buffer``
        (Linux >= 5.19)."""
        rsrc = _RSRC.pack(slots, RSRC_REGISTER_SPARSE, 0, 0, 0)  # io_uring_rsrc_register
        _call(SYS_REGISTER, self.fd, REGISTER_BUFFERS2, rsrc, len(rsrc))

    def update_buffer(self, slot: int, address: int, nbytes: int) -> None:
        """Pin the region (address, nbytes) as fixed buffer ``slot`` of a sparse table; requests
        in flight on other slots go on meanwhile."""
        iovec = (ctypes.c_uint64 * 2)(address, nbytes)
        update = _UPDATE.pack(slot, 0, ctypes.addressof(iovec), 0, 1, 0)  # io_uring_rsrc_update2
        _call(SYS_REGISTER, self.fd, REGISTER_BUFFERS_UPDATE, update, len(update))

    def close(self) -> None:
        for m in {id(m): m for m in (self._sqes, self._sq_map, self._cq_map)}.values():
            m.close()
        os.close(self.fd)


def unavailable_reason() -> str | None:
    """Why io_uring cannot be used here (None: it can): architecture, sysctl, seccomp, old kernel."""
    if os.environ.get("CKPTIO_DISABLE_IO_URING", "") not in ("", "0"):
        return "disabled by CKPTIO_DISABLE_IO_URING"
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"not enabled on {platform.machine()} (completion ring needs acquire loads)"
    try:
        ring = Ring(2)
    except OSError as exc:
        hint = {errno.ENOSYS: "kernel without io_uring", errno.EPERM: "kernel.io_uring_disabled or "
                "seccomp forbids it"}.get(exc.errno or 0, "io_uring_setup failed")
        return f"{hint} ({exc.strerror})"
    try:
        missing = [op for op in (OP_READ, OP_WRITE) if not _supported(ring, op)]
    finally:
        ring.close()
    return f"kernel lacks io_uring opcodes {missing}" if missing else None


def _supported(ring: Ring, opcode: int) -> bool:
    probe = ctypes.create_string_buffer(16 + 256 * 8)
    try:
        _call(SYS_REGISTER, ring.fd, REGISTER_PROBE, ctypes.cast(probe, ctypes.c_void_p), 256)
    except OSError:
        return False  # kernels before 5.6 have no probe, and no OP_READ/OP_WRITE either
    last_op = probe.raw[0]
    flags = struct.unpack_from("<H", probe.raw, 16 + opcode * 8 + 2)[0]
    return opcode <= last_op and bool(flags & 1)


def address_of(view: memoryview) -> int:
    """Address of a contiguous buffer's first byte (read-only buffers included)."""
    if not view.readonly:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    buf = _PyBuffer()
    if ctypes.pythonapi.PyObject_GetBuffer(ctypes.py_object(view), ctypes.byref(buf), 0) != 0:
        raise BufferError("buffer is not contiguous")
    try:
        return buf.buf or 0
    finally:
        ctypes.pythonapi.PyBuffer_Release(ctypes.byref(buf))


class _PyBuffer(ctypes.Structure):
    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.c_void_p), ("len", ctypes.c_ssize_t),
                ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
                ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p)]
