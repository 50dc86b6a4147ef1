"""Moving bytes between memory and the files of :mod:`storage_plugins.fs`: the system-call
loops behind its reads and writes, and its direct writes.

Vectored calls (``writev`` / ``preadv``) move many buffers per call, resuming after short
transfers, with an optional observer (a checksum) that sees each piece right after its call.
A file written with direct I/O (``O_DIRECT``), or with an observer, goes through an aligned
buffer of the writing thread: the observer sees the very bytes written. Functions only: the
plugin decides which file gets which.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import threading
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from itertools import accumulate, repeat
from operator import sub

from storage_plugins.base import BlobTooLargeError

Observer = Callable[[memoryview], None]

# Linux moves at most this many bytes per read/write system call, in at most IOV_MAX buffers.
_MAX_SYSCALL_BYTES = 0x7FFFF000
_MAX_IOV = 1024
# With an observer, reads move bytes in system calls of at most ``_OBSERVED_READ_BYTES``, each
# observed right after it, while the bytes are likely still in the CPU's caches. Smaller calls
# cost more calls per byte; larger ones let the bytes leave the caches before the observer reads
# them. Observed writes go through the thread's buffer (``write_all``), a buffer-full at a time.
# A file that will be fsynced is written in calls of at most ``_OBSERVED_WRITE_BYTES``: the
# piece handed to the device at a time (below).
_OBSERVED_READ_BYTES = 4 << 20
_OBSERVED_WRITE_BYTES = 8 << 20

# A whole-file read asks for what ``fstat`` reported and one byte more (to see the end in the
# same call), and for at least this much when the file turns out longer than reported.
_MIN_READ_BYTES = 64 << 10


def read_to_end(fd: int, reported: int, limit: int | None, name: str) -> bytes:
    """The rest of the file ``fd`` from its current offset, whose ``fstat`` said ``reported``
    bytes; past ``limit`` bytes (when given), ``BlobTooLargeError`` after reading one byte more:
    the length a file reports can be wrong (a file still growing)."""
    pieces: list[bytes] = []
    got = 0
    while True:
        want = max(reported - got + 1, _MIN_READ_BYTES)
        if limit is not None:
            want = min(want, limit + 1 - got)
            if want <= 0:
                raise BlobTooLargeError(name, limit)
        piece = os.read(fd, want)
        if not piece:
            break
        pieces.append(piece)
        got += len(piece)
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def _find_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range`` (Linux), or None where there is none."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


# A file that will be fsynced is written in calls of at most ``_OBSERVED_WRITE_BYTES``, and
# each call's range is handed to the device at once (``sync_file_range``, SYNC_FILE_RANGE_WRITE:
# start the writeback, do not wait for it), so the device writes while later pieces are copied
# into the page cache; the fsync then waits for what is left. Otherwise the kernel starts
# writing only at the fsync (or past its dirty-memory threshold, 10% of memory by default) and
# copying and writing take turns. A hint only: its errors are ignored, the fsync reports the
# rest.
_sync_file_range = _find_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2

# Direct I/O (O_DIRECT, Linux): a file's bytes go from a buffer of this process to the device,
# bypassing the page cache. The kernel then allocates no page-cache memory for them, which on
# some machines (a VM that hands its free memory back to the host, see the plugin) costs more
# than the device's write. A checkpoint is written once and read rarely, so keeping it out of
# the page cache also spares what the cache holds for training (its data set). The kernel wants
# the memory address, the file offset and the length of each direct write aligned to the
# device's logical block size (at most 4 KiB on common devices): the bytes are copied into a
# page-aligned buffer of each I/O thread and written from there in pieces of
# ``_DIRECT_PIECE_BYTES``; the last piece is padded to ``_DIRECT_ALIGN`` and the file cut back
# to its length. Tensor memory is rarely page-aligned, so the copy is needed; it runs at memory
# speed into memory reused for every piece. The same buffer carries the checksummed writes
# through the page cache (``write_all``): a checksum must be of the bytes written, and the
# buffer is the one copy of them that no other thread can change.
O_DIRECT: int = getattr(os, "O_DIRECT", 0)
_DIRECT_ALIGN = 4096
# Per I/O thread (8 threads: 32 MiB at most): each write call moves a few MiB, and the buffers
# stay small; the pace depends little on the piece size at this scale.
_DIRECT_PIECE_BYTES = 4 << 20
_bounce = threading.local()


def _bounce_buffer() -> memoryview:
    """This thread's page-aligned buffer for direct and checksummed writes (freed when the
    thread ends, with the plugin's pool)."""
    buf = getattr(_bounce, "view", None)
    if buf is None or len(buf) != _DIRECT_PIECE_BYTES:
        buf = _bounce.view = memoryview(mmap.mmap(-1, _DIRECT_PIECE_BYTES))
    return buf


def _move_all(
    views: list[memoryview],
    move: Callable[[list[memoryview]], int],
    limit: int,
    observe: Observer | None,
) -> None:
    """Moves the bytes of ``views`` (non-empty, in order) with vectored system calls of at most
    ``limit`` bytes and ``_MAX_IOV`` buffers each: ``move(batch)`` moves a prefix of ``batch``
    and says how many bytes. ``observe`` sees each piece moved, in order, right after its call;
    when it has a ``many`` method, the pieces of a call that complete a buffer are shown to
    that at once.

    A slab of small tensors is thousands of buffers: the bookkeeping is per call (bisection in
    the buffers' end offsets, computed once in a C-level pass), not per buffer.
    """
    if not views:
        return
    many = getattr(observe, "many", None)
    ends = list(accumulate(map(len, views)))  # where each buffer ends in the stream
    count, total = len(views), ends[-1]
    pos = 0  # bytes moved so far
    j = 0  # the first buffer not wholly moved
    while pos < total:
        skip = pos - ends[j] + len(views[j])  # bytes of buffer j moved by earlier calls
        # The buffers that fit whole in this call (the first: what is left of buffer j).
        k = bisect_right(ends, pos + limit, j, min(j + _MAX_IOV, count))
        if k == j:  # what is left of buffer j alone is over the limit: a slice of it
            batch = [views[j][skip : skip + limit]]
        else:
            batch = views[j:k]
            if skip:
                batch[0] = batch[0][skip:]
        n = move(batch)
        if n <= 0:
            raise OSError(errno.EIO, f"a system call moved no bytes at byte {pos} of {total}")
        end = pos + n
        done = bisect_right(ends, end, j, max(k, j + 1))  # buffers now wholly moved
        if observe is not None:
            if done > j:
                moved = batch[: done - j]  # the same buffers, the first as cut for the call
                if many is not None:
                    many(moved)
                else:
                    for view in moved:
                        observe(view)
            if done < count:  # a part of buffer ``done`` moved by this call
                lo = skip if done == j else 0
                hi = end - ends[done] + len(views[done])
                if hi > lo:
                    observe(views[done][lo:hi])
        pos, j = end, done


class DirectRefused(Exception):
    """The file system accepted O_DIRECT at open but refused the first direct write."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


def _fill(buf: memoryview, views: Sequence[memoryview]) -> Iterator[tuple[int, int]]:
    """Copies the concatenation of ``views`` (non-empty byte views, in order) into ``buf`` one
    buffer-full at a time: yields ``(pos, fill)`` once the buffer holds the stream's bytes
    ``[pos, pos + fill)`` at its start (``fill`` is the buffer's length but for the last).

    A slab is thousands of views: those that fit whole in the buffer are copied by one C-level
    pass per buffer-full (``map`` of the buffer's ``__setitem__`` over their slices), not by a
    Python loop per view; only a view cut by the buffer's end takes Python steps of its own.
    """
    piece = len(buf)
    count = len(views)
    ends = list(accumulate(map(len, views)))  # where each view ends in the stream
    starts = [0, *ends[:-1]]
    total = ends[-1] if ends else 0
    pos = 0  # stream offset of the buffer's first byte
    i = 0  # the first view not wholly copied (it may have begun in an earlier buffer-full)
    while pos < total:
        stop = min(pos + piece, total)  # stream offset where this buffer-full ends
        j = bisect_right(ends, stop, i, count)  # views i..j-1 end within this buffer-full
        if j > i and starts[i] < pos:  # the rest of a view cut by the previous buffer's end
            buf[: ends[i] - pos] = views[i][pos - starts[i] :]
            i += 1
        if j > i:  # one pass copies the views that lie wholly in this buffer-full
            slices = map(
                slice, map(sub, starts[i:j], repeat(pos)), map(sub, ends[i:j], repeat(pos))
            )
            deque(map(buf.__setitem__, slices, views[i:j]), maxlen=0)
            i = j
        if i < count and starts[i] < stop:  # a view going on past this buffer-full
            lo = max(starts[i], pos)
            buf[lo - pos : piece] = views[i][lo - starts[i] : stop - starts[i]]
        yield pos, stop - pos
        pos = stop


def write_direct(fd: int, views: Sequence[memoryview], observe: Observer | None) -> None:
    """Writes ``views`` (non-empty byte views, in order) to ``fd``, opened with O_DIRECT at
    offset 0, through this thread's aligned buffer (``_fill``); ``observe`` sees each piece
    right after its write, from the buffer (the very bytes written). Raises ``DirectRefused``
    when the first write is refused (EINVAL): nothing is then written or observed.
    """
    buf = _bounce_buffer()
    piece = len(buf)

    def flush(pos: int, nbytes: int, padded: int) -> None:
        done = 0
        while done < padded:
            try:
                n = os.pwrite(fd, buf[done:padded], pos + done)
            except OSError as e:
                if pos == 0 and done == 0 and e.errno == errno.EINVAL:
                    raise DirectRefused(e) from e
                raise
            if n <= 0:
                raise OSError(errno.EIO, f"a system call moved no bytes at byte {pos + done}")
            done += n
        if observe is not None:
            observe(buf[:nbytes])

    for pos, fill in _fill(buf, views):
        if fill == piece:
            flush(pos, piece, piece)
        else:  # the last, short piece: padded to the alignment, then the file cut back
            padded = -(-fill // _DIRECT_ALIGN) * _DIRECT_ALIGN
            buf[fill:padded] = bytes(padded - fill)  # no stale memory reaches the disk
            flush(pos, fill, padded)
            os.ftruncate(fd, pos + fill)


def write_all(
    fd: int, views: Sequence[memoryview], observe: Observer | None = None, writeback: bool = False
) -> None:
    """Writes every view (non-empty byte views) in order, resuming after short writes. With
    ``writeback``, the device starts writing each piece as soon as it is written (the file is
    about to be fsynced).

    With ``observe`` (a checksum), the bytes go through this thread's buffer (``_fill``): each
    buffer-full is copied there, written from there, then shown to ``observe``, so that what is
    observed is what was written even while another thread changes the memory of ``views``
    (an application updating its tensors in place during a take). Observing ``views``
    themselves after their write would checksum whatever they hold by then."""
    start_writeback = _sync_file_range if writeback else None
    pos = 0

    def write(batch: list[memoryview]) -> int:
        nonlocal pos
        n = os.writev(fd, batch)
        if n > 0 and start_writeback is not None:
            start_writeback(fd, pos, n, _SYNC_FILE_RANGE_WRITE)
        pos += max(n, 0)
        return n

    if observe is not None:
        buf = _bounce_buffer()
        for _, fill in _fill(buf, views):
            _move_all([buf[:fill]], write, _OBSERVED_WRITE_BYTES, None)
            observe(buf[:fill])
        return
    if start_writeback is None:
        _move_all(list(views), functools.partial(os.writev, fd), _MAX_SYSCALL_BYTES, None)
        return
    _move_all(list(views), write, _OBSERVED_WRITE_BYTES, None)


def read_all(
    fd: int, offset: int, outs: Sequence[memoryview], name: str, observe: Observer | None = None
) -> None:
    """Fills every buffer in order from ``offset`` on, resuming after short reads; ``observe``
    sees each piece read, in order, right after its system call."""
    views = list(filter(len, outs))
    total = offset + sum(map(len, views))
    limit = _MAX_SYSCALL_BYTES if observe is None else _OBSERVED_READ_BYTES
    pos = offset

    def read(batch: list[memoryview]) -> int:
        nonlocal pos
        n = os.preadv(fd, batch, pos)
        if n == 0:
            raise EOFError(f"{name} ends at byte {pos}, but bytes up to {total} were requested")
        pos += n
        return n

    _move_all(views, read, limit, observe)
