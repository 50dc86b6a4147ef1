"""Local file-system storage: one file per blob, written through a thread pool."""

from __future__ import annotations

import asyncio
import ctypes
import errno
import functools
import logging
import mmap
import os
import stat
import threading
import uuid
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import accumulate, islice, repeat
from operator import sub
from typing import Any, TypeVar

from storage_plugins.base import BlobTooLargeError, Buffer, StoragePlugin, UnsafeBlobError

Observer = Callable[[memoryview], None]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

# Linux moves at most this many bytes per read/write system call, in at most IOV_MAX buffers.
_MAX_SYSCALL_BYTES = 0x7FFFF000
_MAX_IOV = 1024
# With an observer, bytes move in system calls of at most these sizes, each observed right after
# it, while the bytes are likely still in the CPU's caches. Reads: on an Intel Xeon, calls of
# 256 KiB to 4 MiB cost alike (a 2 GiB state restored warm); on an AMD EPYC, warm restores of
# 512 MiB in one process took 139 and 153 ms in 4 MiB calls against 159 and 180 ms in 1 MiB ones
# (medians of 10, two runs; 16 MiB: 149 ms), and one of 20,000 tensors of 10 KiB cost the same
# either way. Writes in calls of 1 MiB took 40% longer than unsliced ones even with nothing
# observed, and with checksums 8 MiB calls cost the least (+16% over no checksums, where 1 MiB
# calls cost +100%). The write size is also the piece handed to the device at a time when the
# file will be fsynced (below).
_OBSERVED_READ_BYTES = 4 << 20
_OBSERVED_WRITE_BYTES = 8 << 20
_DEFAULT_IO_THREADS = 8

# A snapshot's bytes are untrusted (a tarball or an upload can carry anything), so paths below
# the root are opened one component at a time, each relative to its parent with O_NOFOLLOW: a
# symbolic link (to a file outside the root, or a directory elsewhere) is refused, never
# followed. Files are opened with O_NONBLOCK so that a FIFO's open returns at once, then
# refused by ``fstat`` like any other file that is not regular.
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# A whole-file read asks for what ``fstat`` reported and one byte more (to see the end in the
# same call), and for at least this much when the file turns out longer than reported.
_MIN_READ_BYTES = 64 << 10

_KINDS = (
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISDIR, "a directory"),
)


def _unsafe(where: str, mode: int) -> UnsafeBlobError:
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    return UnsafeBlobError(
        f"{where} is {kind}: refused (a snapshot holds regular files and directories only; "
        "links are never followed, nor other kinds of files opened)"
    )


def _read_to_end(fd: int, reported: int, limit: int | None, name: str) -> bytes:
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
# copying and writing take turns. Measured here, one thread writing 2 GiB in 8 MiB calls and
# then fsyncing: 1.65-1.89 s plain, 1.11-1.61 s so (512 MiB: 0.42-0.53 s, 0.31-0.38 s); in
# calls of 32 MiB 1.52-1.67 s. A hint only: its errors are ignored, the fsync reports the rest.
_sync_file_range = _find_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2

# Direct I/O (O_DIRECT, Linux): a file's bytes go from a buffer of this process to the device,
# bypassing the page cache. The kernel then allocates no page-cache memory for them, which on some
# machines costs more than the device's write: on a 2-core VM here, 2 GiB written by 8 threads
# through the page cache took 3.5-4.0 s with no fsync at all, and 1.2 s with O_DIRECT and an
# fsync (one thread: 8.0-8.5 s buffered, 1.4-1.5 s direct; each MiB of page cache cost ~4 ms of
# host faults, the VM having handed its free memory back to the host: below). A checkpoint is
# written once and read rarely, so keeping it out of the page cache also spares what the cache
# holds for training (its data set). The kernel wants the memory address, the file offset and
# the length of each direct write aligned to the device's logical block size (at most 4 KiB on
# common devices): the bytes are copied into a page-aligned buffer of each I/O thread and
# written from there in pieces of ``_DIRECT_PIECE_BYTES``; the last piece is padded to
# ``_DIRECT_ALIGN`` and the file cut back to its length. Tensor memory is rarely page-aligned,
# so the copy is needed; it runs at memory speed into memory reused for every piece.
_O_DIRECT: int = getattr(os, "O_DIRECT", 0)
_DIRECT_ALIGN = 4096
# 4 MiB per I/O thread (8 threads: 32 MiB at most); 1-8 MiB pieces wrote at the same pace here.
_DIRECT_PIECE_BYTES = 4 << 20
# Smaller files (manifests, objects, a few small tensors) go through the page cache: a direct
# write of a few KiB waits on the device for little.
_DIRECT_MIN_BYTES = 1 << 20
# With direct_io="auto", a file made of many small views (a slab of small tensors) also goes
# through the page cache, where ``pwritev`` copies up to 1,024 views in the kernel without the
# GIL; a direct write copies them into the aligned buffer holding the GIL and takes the GIL back
# after each 4 MiB piece, which costs up to the switch interval while the caller still plans in
# Python (docs/architecture.md, "Storage plugins", has the figures). A file whose views average
# this much or more (a large tensor: one view) is written directly.
_DIRECT_MIN_MEAN_VIEW_BYTES = 256 << 10
_bounce = threading.local()

# A VM guest whose kernel reports its free memory to the host (virtio-balloon's free page
# reporting) gives freed pages back a second or two after they are freed, and allocating them
# again then faults on the host: on such a VM here, 2 GiB written through the page cache (no
# fsync) took 6-9 s once the memory freed before had been handed back, 0.6 s right after a
# 2 GiB file was removed; a take of a 2 GiB state without fsync 3.8-4.6 s through the page
# cache, 1.4-1.9 s with direct I/O (benchmarks/README.md, "Settled memory"). On such a machine
# "auto" writes directly also without fsync. Read from sysfs: the balloon device (virtio device
# id 5) and its negotiated feature bits, one character per bit (VIRTIO_BALLOON_F_REPORTING is
# bit 5).
_VIRTIO_DEVICES = "/sys/bus/virtio/devices"
_VIRTIO_ID_BALLOON = 5
_VIRTIO_BALLOON_F_REPORTING = 5


def reports_free_memory() -> bool:
    """Whether this machine is a VM that hands its free memory back to the host (a virtio
    balloon device with free page reporting)."""
    devices = _VIRTIO_DEVICES
    try:
        names = os.listdir(devices)
    except OSError:
        return False
    for name in names:
        try:
            with open(os.path.join(devices, name, "device")) as f:
                if int(f.read().strip(), 16) != _VIRTIO_ID_BALLOON:
                    continue
            with open(os.path.join(devices, name, "features")) as f:
                bits = f.read().strip()
        except (OSError, ValueError):
            continue
        if len(bits) > _VIRTIO_BALLOON_F_REPORTING and bits[_VIRTIO_BALLOON_F_REPORTING] == "1":
            return True
    return False


@functools.cache
def _direct_without_fsync() -> bool:
    """What ``direct_io="auto"`` does when fsync is off: direct on a VM that reports free
    memory (decided once per process, said once in the log)."""
    if not _O_DIRECT or not reports_free_memory():
        return False
    logger.info(
        "this machine hands its free memory back to the host (virtio-balloon free page "
        "reporting), which makes page-cache memory slow to allocate: files of 1 MiB and more "
        "(but slabs of small tensors) are written with direct I/O also without fsync "
        "(storage_options direct_io=False writes them through the page cache)"
    )
    return True


def _bounce_buffer() -> memoryview:
    """This thread's page-aligned buffer for direct writes (freed when the thread ends, with
    the plugin's pool)."""
    buf = getattr(_bounce, "view", None)
    if buf is None or len(buf) != _DIRECT_PIECE_BYTES:
        buf = _bounce.view = memoryview(mmap.mmap(-1, _DIRECT_PIECE_BYTES))
    return buf


class FSStoragePlugin(StoragePlugin):
    """Blobs are files under a directory.

    Each blob is written to a temporary name in its final directory and renamed into place, so a
    reader never sees a partial file. Blocking calls run on the plugin's own thread pool: one pool
    hop per blob operation (open, write, sync, rename together) rather than one per system call.

    storage_options:
        fsync (bool, default True): fsync each file after writing it, and (in ``sync()``) every
            directory a file was renamed into, so a committed snapshot survives a power loss.
        direct_io (bool or "auto", default "auto"): write files of 1 MiB and more with direct
            I/O (O_DIRECT), past the page cache. "auto" does so when ``fsync`` is on (the bytes
            must reach the device before the take ends anyway), and without fsync on a VM that
            hands its free memory back to the host (virtio-balloon free page reporting: there
            allocating page-cache memory costs more than the device's write); True always
            (the take then ends when the device has the bytes, not when the page cache has
            them: slower on a machine whose page cache takes writes faster than its disk).
            "auto" leaves a file of many small views (a slab of small tensors) to the page
            cache, where they are copied without the GIL; True writes it directly too.
            A file system that refuses direct I/O (tmpfs, some network and FUSE file
            systems) is written through the page cache instead, with a log line.
        io_threads (int, default 8): size of the thread pool.
    """

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None) -> None:
        options = dict(storage_options or {})
        self._fsync = bool(options.pop("fsync", True))
        direct = options.pop("direct_io", "auto")
        io_threads = int(options.pop("io_threads", _DEFAULT_IO_THREADS))
        if options:
            raise TypeError(
                f"unknown storage_options for local storage: {sorted(options)}; "
                "known: fsync, direct_io, io_threads"
            )
        if io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {io_threads}")
        if direct not in (True, False, "auto"):
            raise ValueError(f'direct_io must be True, False or "auto", got {direct!r}')
        if direct is True and not _O_DIRECT:
            raise ValueError("direct_io=True needs O_DIRECT, which this platform does not have")
        # Whether files are written directly; turned off for good when the file system refuses.
        # "auto" leaves a file of many small views to the page cache
        # (``_DIRECT_MIN_MEAN_VIEW_BYTES``); True writes every file of ``_DIRECT_MIN_BYTES``
        # directly.
        self._direct_small_views = direct is True
        if direct == "auto":
            direct = self._fsync or _direct_without_fsync()
        self._direct = bool(_O_DIRECT) and direct
        self.root = os.path.abspath(os.path.expanduser(root.removeprefix("file://")))
        # The root as the user named it may be a symbolic link: that choice is theirs, so it is
        # resolved here, once. Below it nothing is followed (``_open_dir``).
        self._base = os.path.realpath(self.root)
        self._executor = ThreadPoolExecutor(io_threads, thread_name_prefix="statesnap-fs")
        # What this plugin created, so that deleting the blobs of a failed take also removes
        # the directories made for them (``_remove_made_dirs``): the root and its ancestors
        # that were missing, outermost first, and the directories below the root.
        self._made_above: list[str] = []
        self._making_root = threading.Lock()
        self._made_below: set[str] = set()
        self._dirty_dirs: set[tuple[str, ...]] = set()
        # Lengths of the files reads opened (an fstat of the open file, a microsecond where a
        # separate query is a hop through the pool): ``size`` answers from them.
        self._sizes: dict[str, int] = {}

    def _abs(self, path: str) -> str:
        return os.path.join(self.root, *path.split("/"))

    def describe(self, path: str) -> str:
        return self._abs(path)

    async def _run(self, fn: Callable[..., _T], *args: Any) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # -- opening without following -------------------------------------------------------------

    def _openat(self, at: int | None, name: str, flags: int, path: str) -> int:
        """``os.open(name, flags)`` relative to the directory ``at`` (``name`` absolute when
        None). When the open fails on something that is neither a regular file nor a directory
        (``O_NOFOLLOW`` refuses a link, ``O_DIRECTORY`` anything else, a socket cannot be
        opened), ``UnsafeBlobError`` naming ``path`` (relative to the root) and what it is."""
        try:
            return os.open(name, flags, dir_fd=at)
        except FileNotFoundError:
            raise
        except OSError as error:
            try:
                mode = os.stat(name, dir_fd=at, follow_symlinks=False).st_mode
            except OSError:
                mode = stat.S_IFREG  # gone or unreadable: the open's own error stands
            if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
                raise
            raise _unsafe(self._abs(path), mode) from error

    def _open_root(self, create: bool) -> int:
        try:
            return self._openat(None, self._base, _DIR_FLAGS, "")
        except FileNotFoundError:
            if not create:
                raise
        self._make_root()
        return self._openat(None, self._base, _DIR_FLAGS, "")

    def _make_root(self) -> None:
        """Creates the root and its missing ancestors, remembering which it made, outermost
        first (under a lock: the first writes of a take race to make the root)."""
        with self._making_root:
            missing: list[str] = []
            path = self._base
            while not os.path.lexists(path):
                missing.append(path)
                parent = os.path.dirname(path)
                if parent == path:
                    break
                path = parent
            for path in reversed(missing):
                try:
                    os.mkdir(path)
                except FileExistsError:
                    continue  # made meanwhile (another process, another rank)
                self._made_above.append(path)

    def _open_dir(self, parts: Sequence[str], create: bool = False) -> int:
        """A descriptor of the directory ``root/parts...``, each component opened relative to
        its parent with ``O_NOFOLLOW``: a symbolic link below the root is refused, never
        followed. With ``create``, missing directories are made (and remembered)."""
        if not parts:
            return self._open_root(create)
        fd: int | None = None
        try:
            for i, part in enumerate(parts):
                # The first component is opened by its absolute path: the root's own
                # components were resolved at construction, and O_NOFOLLOW guards this one.
                name = part if fd is not None else os.path.join(self._base, part)
                child = self._open_subdir(fd, name, "/".join(parts[: i + 1]), create)
                if fd is not None:
                    os.close(fd)
                fd = child
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise
        return fd

    def _open_subdir(self, at: int | None, name: str, path: str, create: bool) -> int:
        try:
            return self._openat(at, name, _DIR_FLAGS, path)
        except FileNotFoundError:
            if not create:
                raise
        try:
            try:
                os.mkdir(name, dir_fd=at)
            except FileNotFoundError:
                if at is not None:
                    raise
                self._make_root()  # the first directory below a root not made yet
                os.mkdir(name)
            self._made_below.add(path)
        except FileExistsError:
            pass  # made meanwhile (another thread or rank)
        return self._openat(at, name, _DIR_FLAGS, path)

    def _open_blob(self, path: str) -> tuple[int, os.stat_result]:
        """A read-only descriptor of blob ``path`` and its ``fstat``: a regular file reached
        from the root without following a link. ``O_NONBLOCK`` makes opening a FIFO return at
        once (without it the open waits for a writer, forever); the ``fstat`` then refuses it,
        and anything else that is not a regular file. On a regular file the flag changes
        nothing."""
        *dirs, name = path.split("/")
        parent = self._open_dir(dirs)
        try:
            fd = self._openat(parent, name, _FILE_FLAGS, path)
        finally:
            os.close(parent)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise _unsafe(self._abs(path), st.st_mode)
        except BaseException:
            os.close(fd)
            raise
        return fd, st

    # -- writes ----------------------------------------------------------------------------------

    def _write_sync(
        self, path: str, buffers: Sequence[Buffer], observe: Observer | None = None
    ) -> None:
        self._sizes.pop(path, None)
        *dirs, name = path.split("/")
        parent = self._open_dir(dirs, create=True)
        try:
            self._write_in(parent, name, self._abs(path), buffers, observe)
        finally:
            os.close(parent)
        if self._fsync:
            self._dirty_dirs.add(tuple(dirs))

    def _write_in(
        self,
        parent: int,
        name: str,
        final: str,
        buffers: Sequence[Buffer],
        observe: Observer | None,
    ) -> None:
        """Writes blob ``name`` of the directory ``parent`` (``final`` is its full path, for
        messages) through a temporary file renamed into place."""
        tmp = f".{name}.{uuid.uuid4().hex[:12]}.tmp"
        views = [memoryview(b).cast("B") for b in buffers if len(b)]
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        total = sum(map(len, views))
        direct = (
            self._direct
            and total >= _DIRECT_MIN_BYTES
            and (self._direct_small_views or total >= len(views) * _DIRECT_MIN_MEAN_VIEW_BYTES)
        )
        try:
            fd = os.open(tmp, flags | (_O_DIRECT if direct else 0), 0o644, dir_fd=parent)
        except OSError as e:
            if not direct or e.errno != errno.EINVAL:
                raise
            self._refused(final, e)
            direct = False
            try:
                os.unlink(tmp, dir_fd=parent)  # some kernels create the file, then refuse
            except FileNotFoundError:
                pass
            fd = os.open(tmp, flags, 0o644, dir_fd=parent)
        try:
            try:
                if direct:
                    try:
                        _write_direct(fd, views, observe)
                    except _DirectRefused as e:
                        # Nothing was written or observed: the same file, through the cache.
                        import fcntl  # POSIX, as O_DIRECT is

                        self._refused(final, e.error)
                        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT)
                        _write_all(fd, views, observe, writeback=self._fsync)
                else:
                    _write_all(fd, views, observe, writeback=self._fsync)
                if self._fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            # A rename replaces the directory entry ``name``, whatever it was (a link too),
            # without following it.
            os.replace(tmp, name, src_dir_fd=parent, dst_dir_fd=parent)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=parent)
            except OSError:
                pass
            raise

    def _refused(self, final: str, error: OSError) -> None:
        if self._direct:
            self._direct = False
            logger.info(
                "direct I/O refused for %s (%s): writing through the page cache from now on",
                final,
                error,
            )

    async def write(self, path: str, buffers: Sequence[Buffer]) -> None:
        await self._run(self._write_sync, path, buffers)

    async def write_observed(self, path: str, buffers: Sequence[Buffer], observe: Observer) -> None:
        if type(self).write is not FSStoragePlugin.write:
            # A subclass changed ``write``: observed writes go through it too.
            await super().write_observed(path, buffers, observe)
            return
        await self._run(self._write_sync, path, buffers, observe)

    # -- reads -----------------------------------------------------------------------------------

    def _read_sync(self, path: str, limit: int | None = None) -> bytes:
        fd, st = self._open_blob(path)
        try:
            if limit is not None and st.st_size > limit:
                raise BlobTooLargeError(self._abs(path), limit, st.st_size)
            return _read_to_end(fd, st.st_size, limit, self._abs(path))
        finally:
            os.close(fd)

    async def read(self, path: str) -> bytes:
        return await self._run(self._read_sync, path)

    async def read_limited(self, path: str, limit: int) -> bytes:
        return await self._run(self._read_sync, path, limit)

    def _readv_sync(
        self, path: str, offset: int, outs: Sequence[memoryview], observe: Observer | None = None
    ) -> None:
        fd, st = self._open_blob(path)
        try:
            self._sizes[path] = st.st_size
            _read_all(fd, offset, outs, self._abs(path), observe)
        finally:
            os.close(fd)

    async def read_into(self, path: str, offset: int, out: memoryview) -> None:
        await self._run(self._readv_sync, path, offset, (out,))

    async def readv(self, path: str, offset: int, outs: Sequence[memoryview]) -> None:
        await self._run(self._readv_sync, path, offset, outs)

    async def readv_observed(
        self, path: str, offset: int, outs: Sequence[memoryview], observe: Observer
    ) -> None:
        if type(self).readv is not FSStoragePlugin.readv:
            await super().readv_observed(path, offset, outs, observe)  # as for write_observed
            return
        await self._run(self._readv_sync, path, offset, outs, observe)

    # -- metadata --------------------------------------------------------------------------------

    def _size_sync(self, path: str) -> int:
        fd, st = self._open_blob(path)
        os.close(fd)
        return st.st_size

    async def size(self, path: str) -> int:
        known = self._sizes.get(path)
        if known is not None:
            return known  # as a read of it found it, during this operation
        return await self._run(self._size_sync, path)

    def _exists_sync(self, path: str) -> bool:
        """Whether ``path`` is a regular file (a directory there is no blob); anything else at
        the path, or a link on the way to it, is refused."""
        *dirs, name = path.split("/")
        try:
            parent = self._open_dir(dirs)
        except (FileNotFoundError, NotADirectoryError):
            return False
        try:
            mode = os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode
        except (FileNotFoundError, NotADirectoryError):
            return False
        finally:
            os.close(parent)
        if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
            return stat.S_ISREG(mode)
        raise _unsafe(self._abs(path), mode)

    async def exists(self, path: str) -> bool:
        return await self._run(self._exists_sync, path)

    def _list_sync(self, limit: int) -> list[str] | None:
        try:
            with os.scandir(self._base) as found:
                return [entry.name for entry in islice(found, limit)]
        except FileNotFoundError:
            return []
        except NotADirectoryError:
            return None  # a file: the take's first write reports it

    async def list_names(self, limit: int) -> list[str] | None:
        return await self._run(self._list_sync, limit)

    # -- deletion --------------------------------------------------------------------------------

    def _delete_sync(self, path: str) -> None:
        """Removes blob ``path`` (a link there is removed itself: ``unlink`` does not follow
        it; a link on the way to it is refused), then the directories this plugin made for it
        that are left empty: a failed take leaves the path as it found it."""
        self._sizes.pop(path, None)
        *dirs, name = path.split("/")
        try:
            parent = self._open_dir(dirs)
            try:
                os.unlink(name, dir_fd=parent)
            finally:
                os.close(parent)
        finally:
            self._remove_made_dirs(dirs)

    def _remove_made_dirs(self, dirs: Sequence[str]) -> None:
        """Removes, innermost first, the directories of ``dirs`` and then the root and its
        ancestors, for as long as this plugin made them and they are empty."""
        for depth in range(len(dirs), 0, -1):
            path = "/".join(dirs[:depth])
            if path not in self._made_below:
                return
            try:
                parent = self._open_dir(dirs[: depth - 1])
                try:
                    os.rmdir(dirs[depth - 1], dir_fd=parent)  # never follows a link
                finally:
                    os.close(parent)
            except OSError:
                return  # not empty (other blobs, another rank's), or gone already
            self._made_below.discard(path)
        while self._made_above:
            try:
                os.rmdir(self._made_above[-1])
            except OSError:
                return
            self._made_above.pop()

    async def delete(self, path: str) -> None:
        await self._run(self._delete_sync, path)

    def forget(self) -> None:
        self._sizes.clear()

    def _sync_dirs(self) -> None:
        dirty, self._dirty_dirs = self._dirty_dirs, set()
        for parts in sorted(dirty):
            fd = self._open_dir(parts)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    async def sync(self) -> None:
        if self._fsync:
            await self._run(self._sync_dirs)

    async def close(self) -> None:
        self._executor.shutdown(wait=True)


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


class _DirectRefused(Exception):
    """The file system accepted O_DIRECT at open but refused the first direct write."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


def _write_direct(fd: int, views: Sequence[memoryview], observe: Observer | None) -> None:
    """Writes ``views`` (non-empty byte views, in order) to ``fd``, opened with O_DIRECT at
    offset 0, through this thread's aligned buffer; ``observe`` sees each piece right after its
    write, from the buffer (the very bytes written). Raises ``_DirectRefused`` when the first
    write is refused (EINVAL): nothing is then written or observed.

    A slab is thousands of views: those that fit whole in the buffer are copied by one C-level
    pass per buffer-full (``map`` of the buffer's ``__setitem__`` over their slices), not by a
    Python loop per view; only a view cut by the buffer's end takes Python steps of its own.
    """
    buf = _bounce_buffer()
    piece = len(buf)
    count = len(views)
    ends = list(accumulate(map(len, views)))  # where each view ends in the stream
    starts = [0, *ends[:-1]]
    total = ends[-1] if ends else 0
    pos = 0  # stream (and file) offset of the buffer's first byte
    i = 0  # the first view not wholly copied (it may have begun in an earlier buffer-full)

    def flush(nbytes: int, padded: int) -> None:
        done = 0
        while done < padded:
            try:
                n = os.pwrite(fd, buf[done:padded], pos + done)
            except OSError as e:
                if pos == 0 and done == 0 and e.errno == errno.EINVAL:
                    raise _DirectRefused(e) from e
                raise
            if n <= 0:
                raise OSError(errno.EIO, f"a system call moved no bytes at byte {pos + done}")
            done += n
        if observe is not None:
            observe(buf[:nbytes])

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
        fill = stop - pos
        if fill == piece:
            flush(piece, piece)
        else:  # the last, short piece: padded to the alignment, then the file cut back
            padded = -(-fill // _DIRECT_ALIGN) * _DIRECT_ALIGN
            buf[fill:padded] = bytes(padded - fill)  # no stale memory reaches the disk
            flush(fill, padded)
            os.ftruncate(fd, pos + fill)
        pos = stop


def _write_all(
    fd: int, views: Sequence[memoryview], observe: Observer | None = None, writeback: bool = False
) -> None:
    """Writes every view (non-empty byte views) in order, resuming after short writes;
    ``observe`` sees each piece written, in order, right after its system call. With
    ``writeback``, the device starts writing each piece as soon as it is written (the file is
    about to be fsynced)."""
    start_writeback = _sync_file_range if writeback else None
    if start_writeback is None:
        limit = _MAX_SYSCALL_BYTES if observe is None else _OBSERVED_WRITE_BYTES
        _move_all(views, functools.partial(os.writev, fd), limit, observe)
        return
    pos = 0

    def write(batch: list[memoryview]) -> int:
        nonlocal pos
        n = os.writev(fd, batch)
        if n > 0:
            start_writeback(fd, pos, n, _SYNC_FILE_RANGE_WRITE)
            pos += n
        return n

    _move_all(views, write, _OBSERVED_WRITE_BYTES, observe)


def _read_all(
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
