"""Local file-system storage: one file per blob, written through a thread pool."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from storage_plugins.base import Buffer, StoragePlugin

_T = TypeVar("_T")

# Linux moves at most this many bytes per read/write system call, in at most IOV_MAX buffers.
_MAX_SYSCALL_BYTES = 0x7FFFF000
_MAX_IOV = 1024
_DEFAULT_IO_THREADS = 8


class FSStoragePlugin(StoragePlugin):
    """Blobs are files under a directory.

    Each blob is written to a temporary name in its final directory and renamed into place, so a
    reader never sees a partial file. Blocking calls run on the plugin's own thread pool: one pool
    hop per blob operation (open, write, sync, rename together) rather than one per system call.

    storage_options:
        fsync (bool, default True): fsync each file after writing it, and (in ``sync()``) every
            directory a file was renamed into, so a committed snapshot survives a power loss.
        io_threads (int, default 8): size of the thread pool.
    """

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None) -> None:
        options = dict(storage_options or {})
        self._fsync = bool(options.pop("fsync", True))
        io_threads = int(options.pop("io_threads", _DEFAULT_IO_THREADS))
        if options:
            raise TypeError(
                f"unknown storage_options for local storage: {sorted(options)}; "
                "known: fsync, io_threads"
            )
        if io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {io_threads}")
        self.root = os.path.abspath(os.path.expanduser(root.removeprefix("file://")))
        self._executor = ThreadPoolExecutor(io_threads, thread_name_prefix="statesnap-fs")
        self._made_dirs: set[str] = set()
        self._dirty_dirs: set[str] = set()

    def _abs(self, path: str) -> str:
        return os.path.join(self.root, *path.split("/"))

    def describe(self, path: str) -> str:
        return self._abs(path)

    async def _run(self, fn: Callable[..., _T], *args: Any) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _write_sync(self, path: str, buffers: Sequence[Buffer]) -> None:
        final = self._abs(path)
        directory = os.path.dirname(final)
        if directory not in self._made_dirs:
            os.makedirs(directory, exist_ok=True)
            self._made_dirs.add(directory)
        tmp = os.path.join(directory, f".{os.path.basename(final)}.{uuid.uuid4().hex[:12]}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            try:
                _write_all(fd, buffers)
                if self._fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        if self._fsync:
            self._dirty_dirs.add(directory)

    async def write(self, path: str, buffers: Sequence[Buffer]) -> None:
        await self._run(self._write_sync, path, buffers)

    def _read_sync(self, path: str) -> bytes:
        with open(self._abs(path), "rb") as f:
            return f.read()

    async def read(self, path: str) -> bytes:
        return await self._run(self._read_sync, path)

    def _readv_sync(self, path: str, offset: int, outs: Sequence[memoryview]) -> None:
        fd = os.open(self._abs(path), os.O_RDONLY | os.O_CLOEXEC)
        try:
            _read_all(fd, offset, outs, self._abs(path))
        finally:
            os.close(fd)

    async def read_into(self, path: str, offset: int, out: memoryview) -> None:
        await self._run(self._readv_sync, path, offset, (out,))

    async def readv(self, path: str, offset: int, outs: Sequence[memoryview]) -> None:
        await self._run(self._readv_sync, path, offset, outs)

    async def size(self, path: str) -> int:
        return await self._run(os.path.getsize, self._abs(path))

    async def exists(self, path: str) -> bool:
        return await self._run(os.path.isfile, self._abs(path))

    async def delete(self, path: str) -> None:
        await self._run(os.remove, self._abs(path))

    def _sync_dirs(self) -> None:
        dirty, self._dirty_dirs = self._dirty_dirs, set()
        for directory in sorted(dirty):
            fd = os.open(directory, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    async def sync(self) -> None:
        if self._fsync:
            await self._run(self._sync_dirs)

    async def close(self) -> None:
        self._executor.shutdown(wait=True)


def _next_batch(pending: deque[memoryview]) -> list[memoryview]:
    """The leading buffers of ``pending`` that one vectored system call can take."""
    batch: list[memoryview] = []
    size = 0
    for view in pending:
        if size + len(view) > _MAX_SYSCALL_BYTES:
            if not batch:
                batch.append(view[:_MAX_SYSCALL_BYTES])
            break
        batch.append(view)
        size += len(view)
        if len(batch) >= _MAX_IOV:
            break
    return batch


def _consume(pending: deque[memoryview], n: int) -> None:
    """Drops the first ``n`` bytes from ``pending`` (after a short or complete transfer)."""
    while n:
        head = pending[0]
        if n >= len(head):
            n -= len(head)
            pending.popleft()
        else:
            pending[0] = head[n:]
            n = 0


def _write_all(fd: int, buffers: Sequence[Buffer]) -> None:
    """Writes every buffer in order, resuming after short writes."""
    pending = deque(memoryview(b).cast("B") for b in buffers if len(b))
    while pending:
        _consume(pending, os.writev(fd, _next_batch(pending)))


def _read_all(fd: int, offset: int, outs: Sequence[memoryview], name: str) -> None:
    """Fills every buffer in order from ``offset`` on, resuming after short reads."""
    pending = deque(o for o in outs if len(o))
    total = offset + sum(len(o) for o in pending)
    pos = offset
    while pending:
        n = os.preadv(fd, _next_batch(pending), pos)
        if n == 0:
            raise EOFError(f"{name} ends at byte {pos}, but bytes up to {total} were requested")
        _consume(pending, n)
        pos += n
