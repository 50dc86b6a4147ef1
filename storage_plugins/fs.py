"""Local file-system storage: one file per blob, written through a thread pool.

Paths below the root are opened without following links; a blob is written to a temporary file
renamed into place, by vectored calls, or through an aligned buffer lent to the write for
direct I/O and for checksums (which must see the very bytes written); ``FrozenBuffers`` (memory
that no thread changes meanwhile) are checksummed and written as they are, with direct I/O from
their own page-aligned memory (only an unaligned rest through the buffer)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import functools
import logging
import mmap
import os
import pathlib
import shutil
import stat
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from itertools import islice
from typing import Any, TypeVar

from storage_plugins import base
from storage_plugins.base import (
    BlobTooLargeError,
    Buffer,
    StoragePlugin,
    UnsafeBlobError,
    fill_buffer,
    move_views,
)

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
Observer = Callable[[memoryview], None]

# Paths below the root are opened one component at a time with O_NOFOLLOW (a link is refused),
# files with O_NONBLOCK (a FIFO's open returns at once, then ``fstat`` refuses it).
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_KINDS = (
    (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
    (stat.S_ISDIR, "a directory"),
)  # fmt: skip


def _unsafe(where: str, mode: int) -> UnsafeBlobError:
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    return UnsafeBlobError(
        f"{where} is {kind}: refused (a snapshot holds regular files and directories only; "
        "links are never followed, nor other kinds of files opened)"
    )


_MAX_CALL_BYTES = 0x7FFFF000
# An observed read moves pieces of at most this many bytes, each observed right after its call.
_OBSERVED_READ_BYTES = 4 << 20
# A whole-file read asks for the reported length and one byte more, at least this much.
_MIN_READ_BYTES = 64 << 10

# Direct I/O (O_DIRECT, Linux) writes from a page-aligned buffer lent to each write, in pieces
# of ``_DIRECT_PIECE_BYTES``, the last padded to ``_DIRECT_ALIGN`` and the file cut back. The
# buffer also carries observed writes through the page cache: the one copy of the bytes that no
# other thread changes while they are checksummed and written; ``FrozenBuffers`` and the whole
# pages of page-aligned memory written unobserved need none. The buffers are kept for the
# process (one per write under way): fresh ones cost every take (a plugin of its own) a page
# fault per page (benchmarks/results/2026-12-07-parallel-take.md).
O_DIRECT: int = getattr(os, "O_DIRECT", 0)
_DIRECT_ALIGN = 4096
_DIRECT_PIECE_BYTES = 4 << 20
# A direct write from page-aligned memory of the caller's moves at most this many bytes per call.
_DIRECT_CALL_BYTES = 64 << 20
# Smaller files go through the page cache: a direct write of a few KiB waits on the device.
_DIRECT_MIN_BYTES = 1 << 20
_free_buffers: list[memoryview] = []
_free_lock = threading.Lock()

# The balloon device (virtio device id 5) and its feature bit for free page reporting.
_VIRTIO_DEVICES, _VIRTIO_ID_BALLOON, _VIRTIO_BALLOON_F_REPORTING = "/sys/bus/virtio/devices", 5, 5


@functools.cache
def direct_without_fsync() -> bool:
    """Whether ``direct_io="auto"`` writes directly also without fsync: on a VM guest whose
    kernel hands freed pages back to the host (virtio-balloon free page reporting), allocating
    page-cache memory faults on the host for every page, where direct I/O reuses one buffer per
    thread (benchmarks/results/2026-11-23-ba9f183-8e60bb4-settled-memory.md). Read once per
    process from sysfs (negotiated feature bits, one character per bit), said once."""
    for device in pathlib.Path(_VIRTIO_DEVICES).glob("*"):  # (none when it does not exist)
        try:
            balloon = int((device / "device").read_text(), 16) == _VIRTIO_ID_BALLOON
            bits = (device / "features").read_text() if balloon else ""
        except (OSError, ValueError):
            continue
        if bits[_VIRTIO_BALLOON_F_REPORTING : _VIRTIO_BALLOON_F_REPORTING + 1] == "1":
            logger.info(
                "this machine hands its free memory back to the host (virtio-balloon free page "
                "reporting), which makes page-cache memory slow to allocate: files of 1 MiB and "
                "more are written with direct I/O also without fsync "
                "(storage_options direct_io=False writes them through the page cache)"
            )
            return True
    return False


@contextlib.contextmanager
def _bounce_buffer() -> Iterator[memoryview]:
    """A page-aligned buffer of ``_DIRECT_PIECE_BYTES``, lent for one write; private memory,
    so that a forked child that keeps the list writes to copies of its own."""
    with _free_lock:
        buf = _free_buffers.pop() if _free_buffers else None
    if buf is None or len(buf) != _DIRECT_PIECE_BYTES:  # (tests make the pieces smaller)
        buf = memoryview(mmap.mmap(-1, _DIRECT_PIECE_BYTES, flags=mmap.MAP_PRIVATE))
    try:
        yield buf
    finally:
        with _free_lock:
            _free_buffers.append(buf)


def _address(view: memoryview) -> int:
    """Where ``view``'s bytes start; -1 for read-only memory (never written directly)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    except (TypeError, ValueError):
        return -1


def _write_in_place(
    fd: int, views: list[memoryview], observe: Observer | None
) -> tuple[int, list[memoryview]] | None:
    """Writes with direct I/O, from ``views`` themselves, the page-aligned whole pages at the
    start of the file (each piece observed once written): the bytes written and the views left
    for the aligned buffer; None when the first write is refused (EINVAL: nothing written)."""
    pos = 0
    for i, view in enumerate(views):
        body = len(view) // _DIRECT_ALIGN * _DIRECT_ALIGN
        if not body or _address(view) % _DIRECT_ALIGN:
            return pos, views[i:]
        done = 0
        while done < body:
            piece = view[done : min(body, done + _DIRECT_CALL_BYTES)]
            try:
                n = os.pwrite(fd, piece, pos)
            except OSError as e:
                if pos == 0 and e.errno == errno.EINVAL:
                    return None
                raise
            if n <= 0 or n % _DIRECT_ALIGN:
                raise OSError(errno.EIO, f"a direct write moved {n} bytes at byte {pos}")
            if observe is not None:
                observe(piece[:n])
            done += n
            pos += n
        if body < len(view):
            return pos, [view[body:], *views[i + 1 :]]
    return pos, []


def _write_all(
    fd: int, views: list[memoryview], observe: Observer | None, direct: bool, stable: bool
) -> bool:
    """Writes ``views`` to ``fd`` (at offset 0). Unobserved page-cache writes, and observed
    ones of ``stable`` views (no other thread changes them), go from ``views`` by vectored
    calls. Direct writes go from ``views`` too where they are page-aligned and unobserved or
    ``stable`` (``_write_in_place``). The rest goes through a lent aligned buffer, each
    buffer-full observed once written (never ``views``, which another thread may change
    meanwhile). With ``direct`` (``fd`` opened with O_DIRECT) each piece is padded to
    ``_DIRECT_ALIGN`` and the file cut back; False when the first direct write is refused
    (EINVAL): nothing is then written or observed."""
    write = functools.partial(os.writev, fd)
    if not direct and (observe is None or stable):
        move_views(views, write, _MAX_CALL_BYTES, observe)
        return True
    pos = 0
    if direct and (observe is None or stable):
        placed = _write_in_place(fd, views, observe)
        if placed is None:
            return False
        pos, views = placed
        if not views:
            return True
    with _bounce_buffer() as buf:
        for fill in fill_buffer(buf, views):
            end = -(-fill // _DIRECT_ALIGN) * _DIRECT_ALIGN if direct else fill
            buf[fill:end] = bytes(end - fill)  # no stale memory reaches the disk
            done = 0
            while done < end:
                try:
                    n = (
                        os.pwrite(fd, buf[done:end], pos + done)
                        if direct
                        else write([buf[done:end]])
                    )
                except OSError as e:
                    if direct and pos == done == 0 and e.errno == errno.EINVAL:
                        return False
                    raise
                if n <= 0:
                    raise OSError(errno.EIO, f"a system call moved no bytes at byte {pos + done}")
                done += n
            if observe is not None:
                observe(buf[:fill])
            pos += fill
            if fill < end:
                os.ftruncate(fd, pos)
    return True


def missing_folders(path: str) -> list[str]:
    """``path`` and those of its parents that do not exist, deepest first: the folders
    ``os.makedirs(path)`` would make."""
    missing = []
    path = os.path.abspath(path)
    while not os.path.lexists(path):  # ("/" exists)
        missing.append(path)
        path = os.path.dirname(path)
    return missing


class FSStoragePlugin(StoragePlugin):
    """Blobs are files under a directory; blocking calls run on the plugin's thread pool, one
    hop per blob operation.

    storage_options:
        fsync (bool, default True): fsync each file after writing it, and (in ``sync()``) every
            directory a file was renamed into or a directory made in, so a committed snapshot
            survives a power loss.
        direct_io (bool or "auto", default "auto"): write files of 1 MiB and more with direct
            I/O (O_DIRECT), past the page cache. "auto" does so when ``fsync`` is on (the bytes
            must reach the device anyway), and without fsync on a VM that hands its free memory
            back to the host; True always. A file system that refuses direct I/O (tmpfs, some
            FUSE file systems) is written through the page cache instead, with a log line.
        io_threads (int, default 8): size of the thread pool.
    """

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None) -> None:
        options = dict(storage_options or {})
        self._fsync = bool(options.pop("fsync", True))
        direct = options.pop("direct_io", "auto")
        io_threads = int(options.pop("io_threads", 8))
        if options:
            raise TypeError(
                f"unknown storage_options for local storage: {sorted(options)}; "
                "known: fsync, direct_io, io_threads"
            )
        if io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {io_threads}")
        if direct not in (True, False, "auto"):
            raise ValueError(f'direct_io must be True, False or "auto", got {direct!r}')
        if direct is True and not O_DIRECT:
            raise ValueError("direct_io=True needs O_DIRECT, which this platform does not have")
        # Turned off for good when the file system refuses direct I/O.
        if direct == "auto":
            direct = self._fsync or (bool(O_DIRECT) and direct_without_fsync())
        self._direct = bool(O_DIRECT) and direct
        self.root = os.path.abspath(os.path.expanduser(root.removeprefix("file://")))
        # The root as the user named it may be a link (their choice): resolved once, here.
        self._base = os.path.realpath(self.root)
        self._executor = base.DaemonThreadPool(io_threads, thread_name_prefix="statesnap-fs")
        # What this plugin created (the root and its missing ancestors, outermost first; the
        # directories below the root): deleting a failed take's blobs removes them too.
        self._made_above: list[str] = []
        self._making_root = threading.Lock()
        self._made_below: set[str] = set()
        self._dirty_dirs: set[str] = set()  # those that gained an entry, for ``sync``

    def describe(self, path: str) -> str:
        return os.path.join(self.root, *path.split("/"))

    async def _run(self, fn: Callable[..., _T], *args: Any) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _openat(self, at: int | None, name: str, flags: int, path: str) -> int:
        """``os.open(name, flags)`` relative to the directory ``at`` (``name`` absolute when
        None); ``UnsafeBlobError`` naming ``path`` when it fails on something that is neither
        a regular file nor a directory."""
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
            raise _unsafe(self.describe(path), mode) from error

    def _open_dir(self, parts: Sequence[str], create: bool = False) -> int:
        """A descriptor of the directory ``root/parts...``, each component opened relative to
        its parent without following a link; with ``create``, missing ones are made."""
        try:
            fd = self._openat(None, self._base, _DIR_FLAGS, "")
        except FileNotFoundError:
            if not create:
                raise
            with self._making_root:  # the root and its missing ancestors, remembered
                for folder in reversed(missing_folders(self._base)):
                    with contextlib.suppress(FileExistsError):  # (made by another rank)
                        os.mkdir(folder)
                        self._made_above.append(folder)
                        self._dirty_dirs.add(os.path.dirname(folder))
            fd = self._openat(None, self._base, _DIR_FLAGS, "")
        try:
            for i, name in enumerate(parts):
                path = "/".join(parts[: i + 1])
                try:
                    child = self._openat(fd, name, _DIR_FLAGS, path)
                except FileNotFoundError:
                    if not create:
                        raise
                    with contextlib.suppress(FileExistsError):  # (made by another thread)
                        os.mkdir(name, dir_fd=fd)
                        self._made_below.add(path)
                        self._dirty_dirs.add(os.path.join(self._base, *parts[:i]))
                    child = self._openat(fd, name, _DIR_FLAGS, path)
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _open_blob(self, path: str) -> tuple[int, os.stat_result]:
        """A read-only descriptor of blob ``path`` and its ``fstat``: a regular file reached
        from the root without following a link (nor a ``..``, ``.`` or empty part)."""
        *dirs, name = parts = path.split("/")
        if any(part in ("", ".", "..") for part in parts):
            raise UnsafeBlobError(f"{self.describe(path)}: not a path below the root")
        parent = self._open_dir(dirs)
        try:
            fd = self._openat(parent, name, _FILE_FLAGS, path)
        finally:
            os.close(parent)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise _unsafe(self.describe(path), st.st_mode)
        except BaseException:
            os.close(fd)
            raise
        return fd, st

    def _write_sync(
        self,
        path: str,
        buffers: Sequence[Buffer],
        observe: Observer | None = None,
        exclusive: bool = False,
        stable: bool = False,
    ) -> None:
        """Writes blob ``path`` through a temporary file renamed into place; ``exclusive``:
        linked into place instead, which fails (``FileExistsError``) when it exists; ``stable``:
        no other thread changes ``buffers`` meanwhile (``base.FrozenBuffers``)."""
        *dirs, name = path.split("/")
        tmp = f".{name}.{uuid.uuid4().hex[:12]}.tmp"
        views = [memoryview(b).cast("B") for b in buffers if len(b)]
        direct = self._direct and sum(map(len, views)) >= _DIRECT_MIN_BYTES
        parent = self._open_dir(dirs, create=True)
        try:
            if not self._write_new(parent, tmp, views, observe, direct, stable):
                # Refused: the same file through the cache, and every later one (said once).
                if self._direct:
                    self._direct = False
                    what = "writing through the page cache from now on"
                    logger.info("direct I/O refused for %s: %s", self.describe(path), what)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp, dir_fd=parent)  # some kernels create it, then refuse
                self._write_new(parent, tmp, views, observe, False, stable)
            if exclusive:
                # A hard link is made only where no entry ``name`` exists, atomically.
                os.link(tmp, name, src_dir_fd=parent, dst_dir_fd=parent, follow_symlinks=False)
                os.unlink(tmp, dir_fd=parent)
            else:
                # Replaces the entry ``name``, whatever it was (a link too), unfollowed.
                os.replace(tmp, name, src_dir_fd=parent, dst_dir_fd=parent)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=parent)
            raise
        finally:
            os.close(parent)
        if self._fsync:
            self._dirty_dirs.add(os.path.join(self._base, *dirs))

    def _write_new(
        self,
        parent: int,
        tmp: str,
        views: list[memoryview],
        observe: Observer | None,
        direct: bool,
        stable: bool,
    ) -> bool:
        """Writes the new file ``tmp`` in ``parent`` (then fsyncs it, with fsync), with direct
        I/O when ``direct``; False when the file system refuses direct I/O, at the open or at
        the first write."""
        try:
            fd = os.open(tmp, _NEW_FILE | (O_DIRECT if direct else 0), 0o644, dir_fd=parent)
        except OSError as e:
            if direct and e.errno == errno.EINVAL:
                return False
            raise
        try:
            if not _write_all(fd, views, observe, direct, stable):
                return False
            if self._fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        return True

    async def write(self, path: str, buffers: Sequence[Buffer]) -> None:
        await self._run(self._write_sync, path, buffers)

    async def write_if_absent(self, path: str, buffers: Sequence[Buffer]) -> None:
        await self._run(self._write_sync, path, buffers, None, True)

    async def write_observed(self, path: str, buffers: Sequence[Buffer], observe: Observer) -> None:
        if type(self).write is not FSStoragePlugin.write:  # a subclass's ``write`` serves
            return await super().write_observed(path, buffers, observe)
        stable = isinstance(buffers, base.FrozenBuffers)
        await self._run(self._write_sync, path, buffers, observe, False, stable)

    def _read_sync(self, path: str, limit: int | None = None) -> bytes:
        """The whole blob, read to its end (``fstat``'s length may be wrong: a file still
        growing); past ``limit`` bytes, ``BlobTooLargeError``."""
        fd, st = self._open_blob(path)
        try:
            if limit is not None and st.st_size > limit:
                raise BlobTooLargeError(self.describe(path), limit, st.st_size)
            pieces: list[bytes] = []
            got = 0
            while limit is None or got <= limit:
                want = max(st.st_size - got + 1, _MIN_READ_BYTES)
                piece = os.read(fd, want if limit is None else min(want, limit + 1 - got))
                if not piece:
                    return b"".join(pieces)
                pieces.append(piece)
                got += len(piece)
            raise BlobTooLargeError(self.describe(path), limit)
        finally:
            os.close(fd)

    async def read(self, path: str) -> bytes:
        return await self._run(self._read_sync, path)

    async def read_limited(self, path: str, limit: int) -> bytes:
        return await self._run(self._read_sync, path, limit)

    def _readv_sync(
        self, path: str, offset: int, outs: Sequence[memoryview], observe: Observer | None = None
    ) -> None:
        """Fills every buffer in order from ``offset`` on, resuming after short reads."""
        fd, _ = self._open_blob(path)
        pos, end = offset, offset + sum(map(len, outs))

        def read(batch: list[memoryview]) -> int:
            nonlocal pos
            n = os.preadv(fd, batch, pos)
            if n == 0:
                raise base.short_read(self.describe(path), pos, end)
            pos += n
            return n

        limit = _MAX_CALL_BYTES if observe is None else _OBSERVED_READ_BYTES
        try:
            move_views([o for o in outs if len(o)], read, limit, observe)
        finally:
            os.close(fd)

    async def read_into(self, path: str, offset: int, out: memoryview) -> None:
        await self._run(self._readv_sync, path, offset, (out,))

    async def readv(self, path: str, offset: int, outs: Sequence[memoryview]) -> None:
        await self._run(self._readv_sync, path, offset, outs)

    async def readv_observed(
        self, path: str, offset: int, outs: Sequence[memoryview], observe: Observer
    ) -> None:
        if type(self).readv is not FSStoragePlugin.readv:  # as for write_observed
            return await super().readv_observed(path, offset, outs, observe)
        await self._run(self._readv_sync, path, offset, outs, observe)

    def _size_sync(self, path: str) -> int:
        fd, st = self._open_blob(path)
        os.close(fd)
        return st.st_size

    async def size(self, path: str) -> int:
        return await self._run(self._size_sync, path)

    def _exists_sync(self, path: str) -> bool:
        """Whether ``path`` is a regular file; anything but a directory there is refused."""
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
        raise _unsafe(self.describe(path), mode)

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

    async def delete_all(self) -> None:
        await self._run(self._delete_all_sync)

    def _delete_all_sync(self) -> None:
        """``shutil.rmtree`` of the root (by directory descriptors: a link below the root is
        removed, never followed); a root that is itself a link is refused."""
        if os.path.islink(self.root):
            raise UnsafeBlobError(f"{self.root}: the root is a symbolic link")
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(self.root)

    def _delete_sync(self, path: str) -> None:
        """Removes blob ``path`` (a link there is removed itself: ``unlink`` does not follow
        it; a link on the way to it is refused), then the directories this plugin made for it
        that are left empty: a failed take leaves the path as it found it."""
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

    def _sync_dirs(self) -> None:
        """fsyncs each directory a file was renamed into or a directory made in."""
        dirty, self._dirty_dirs = self._dirty_dirs, set()
        for fd in (os.open(d, _DIR_FLAGS) for d in sorted(dirty)):
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    async def sync(self) -> None:
        if self._fsync:
            await self._run(self._sync_dirs)

    async def close(self) -> None:
        self._executor.shutdown(wait=True)
