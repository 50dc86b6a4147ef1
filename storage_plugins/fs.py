"""Local file-system storage: one file per blob, written through a thread pool.

This module holds the plugin: where each blob lives, how paths below the root are opened
without following links, temporary files renamed into place, fsync and direct-I/O policy. The
system-call loops that move the bytes are :mod:`storage_plugins.fs_io`.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import os
import shutil
import stat
import threading
import uuid
from collections.abc import Callable, Sequence
from itertools import islice
from typing import Any, TypeVar

from storage_plugins import host
from storage_plugins.base import (
    BlobTooLargeError,
    Buffer,
    DaemonThreadPool,
    StoragePlugin,
    UnsafeBlobError,
)
from storage_plugins.fs_io import (
    O_DIRECT,
    DirectRefused,
    Observer,
    read_all,
    read_to_end,
    write_all,
    write_direct,
)

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

_DEFAULT_IO_THREADS = 8

# A snapshot's bytes are untrusted (a tarball or an upload can carry anything), so paths below
# the root are opened one component at a time, each relative to its parent with O_NOFOLLOW: a
# symbolic link (to a file outside the root, or a directory elsewhere) is refused, never
# followed. Files are opened with O_NONBLOCK so that a FIFO's open returns at once, then
# refused by ``fstat`` like any other file that is not regular.
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

_KINDS = (
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISDIR, "a directory"),
)


# Path components that do not name an entry below the root.
_NOT_NAMES = frozenset({"", ".", ".."})


def _unsafe(where: str, mode: int) -> UnsafeBlobError:
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    return UnsafeBlobError(
        f"{where} is {kind}: refused (a snapshot holds regular files and directories only; "
        "links are never followed, nor other kinds of files opened)"
    )


# Smaller files (manifests, objects, a few small tensors) go through the page cache: a direct
# write of a few KiB waits on the device for little.
_DIRECT_MIN_BYTES = 1 << 20
# With direct_io="auto", a file made of many small views also goes through the page cache, where
# ``pwritev`` copies up to 1,024 views in the kernel without the GIL; a direct write copies
# them into the aligned buffer holding the GIL and takes the GIL back
# after each 4 MiB piece, which costs up to the switch interval while the caller still plans in
# Python (figures: benchmarks/results/2026-11-23-71727b9-slabs-through-the-page-cache.md).
# A file whose views average this much or more (a large tensor: one view) is written directly.
_DIRECT_MIN_MEAN_VIEW_BYTES = 256 << 10


@functools.cache
def _direct_without_fsync() -> bool:
    """What ``direct_io="auto"`` does when fsync is off: direct on a VM that reports free
    memory (decided once per process, said once in the log)."""
    if not O_DIRECT or not host.reports_free_memory():
        return False
    logger.info(
        "this machine hands its free memory back to the host (virtio-balloon free page "
        "reporting), which makes page-cache memory slow to allocate: files of 1 MiB and more "
        "are written with direct I/O also without fsync "
        "(storage_options direct_io=False writes them through the page cache)"
    )
    return True



def missing_folders(path: str) -> list[str]:
    """``path`` and those of its parents that do not exist, deepest first: the folders
    ``os.makedirs(path)`` would make."""
    missing = []
    path = os.path.abspath(path)
    while not os.path.lexists(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return missing

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
            "auto" leaves a file given as many small views to the page cache, where they
            are copied without the GIL; True writes it directly too. (A slab of small tensors
            is one buffer, its copy: written as any other file.)
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
        if direct is True and not O_DIRECT:
            raise ValueError("direct_io=True needs O_DIRECT, which this platform does not have")
        # Whether files are written directly; turned off for good when the file system refuses.
        # "auto" leaves a file of many small views to the page cache
        # (``_DIRECT_MIN_MEAN_VIEW_BYTES``); True writes every file of ``_DIRECT_MIN_BYTES``
        # directly.
        self._direct_small_views = direct is True
        if direct == "auto":
            direct = self._fsync or _direct_without_fsync()
        self._direct = bool(O_DIRECT) and direct
        self.root = os.path.abspath(os.path.expanduser(root.removeprefix("file://")))
        # The root as the user named it may be a symbolic link: that choice is theirs, so it is
        # resolved here, once. Below it nothing is followed (``_open_dir``).
        self._base = os.path.realpath(self.root)
        self._executor = DaemonThreadPool(io_threads, thread_name_prefix="statesnap-fs")
        # What this plugin created, so that deleting the blobs of a failed take also removes
        # the directories made for them (``_remove_made_dirs``): the root and its ancestors
        # that were missing, outermost first, and the directories below the root.
        self._made_above: list[str] = []
        self._making_root = threading.Lock()
        self._made_below: set[str] = set()
        self._dirty_dirs: set[tuple[str, ...]] = set()
        # Lengths of the files reads opened (an fstat of the file already open, where a separate
        # query is a hop through the pool): ``size`` answers from them.
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
            for path in reversed(missing_folders(self._base)):
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
        nothing. A path with a ``..`` (or empty, or ``.``) component is refused: it would
        leave the root (the library reads a sibling snapshot's blobs through a plugin of its
        own, never through ``..``)."""
        *dirs, name = parts = path.split("/")
        if any(part in _NOT_NAMES for part in parts):
            raise UnsafeBlobError(f"{self._abs(path)}: not a path below the root")
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
        self,
        path: str,
        buffers: Sequence[Buffer],
        observe: Observer | None = None,
        exclusive: bool = False,
    ) -> None:
        self._sizes.pop(path, None)
        *dirs, name = path.split("/")
        parent = self._open_dir(dirs, create=True)
        try:
            self._write_in(parent, name, self._abs(path), buffers, observe, exclusive)
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
        exclusive: bool = False,
    ) -> None:
        """Writes blob ``name`` of the directory ``parent`` (``final`` is its full path, for
        messages) through a temporary file renamed into place; ``exclusive``: linked into
        place instead, which fails (``FileExistsError``) when ``name`` exists."""
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
            fd = os.open(tmp, flags | (O_DIRECT if direct else 0), 0o644, dir_fd=parent)
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
                        write_direct(fd, views, observe)
                    except DirectRefused as e:
                        # Nothing was written or observed: the same file, through the cache.
                        import fcntl  # POSIX, as O_DIRECT is

                        self._refused(final, e.error)
                        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~O_DIRECT)
                        write_all(fd, views, observe, writeback=self._fsync)
                else:
                    write_all(fd, views, observe, writeback=self._fsync)
                if self._fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            if exclusive:
                # A hard link is made only where no entry ``name`` exists, atomically.
                os.link(tmp, name, src_dir_fd=parent, dst_dir_fd=parent, follow_symlinks=False)
                os.unlink(tmp, dir_fd=parent)
                return
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

    async def write_if_absent(self, path: str, buffers: Sequence[Buffer]) -> None:
        await self._run(self._write_sync, path, buffers, None, True)

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
            return read_to_end(fd, st.st_size, limit, self._abs(path))
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
            read_all(fd, offset, outs, self._abs(path), observe)
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

    def _read_ahead_sync(self, path: str, offset: int, nbytes: int) -> None:
        fd, _ = self._open_blob(path)  # as a read opens it: no link followed
        try:
            os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)

    async def read_ahead(self, path: str, offset: int, nbytes: int) -> None:
        # The kernel reads the range into the page cache in the background (the call returns
        # once the reads are queued); the restore's buffered reads then copy it from there.
        if hasattr(os, "posix_fadvise"):
            await self._run(self._read_ahead_sync, path, offset, nbytes)

    def read_ahead_now(self, path: str, offset: int, nbytes: int) -> bool:
        if type(self).read_ahead is not FSStoragePlugin.read_ahead:
            return False  # a subclass's own hint: the library awaits it
        if hasattr(os, "posix_fadvise"):
            self._read_ahead_sync(path, offset, nbytes)
        return True

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

    async def delete_all(self) -> None:
        await self._run(self._delete_all_sync)

    def _delete_all_sync(self) -> None:
        """``shutil.rmtree`` of the root: on Linux it walks by directory descriptors and
        removes a link below the root as a link, never what it points to. A root that is
        itself a link is refused."""
        if os.path.islink(self.root):
            raise UnsafeBlobError(f"{self.root}: the root is a symbolic link")
        self._sizes.clear()
        try:
            shutil.rmtree(self.root)
        except FileNotFoundError:
            pass

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
