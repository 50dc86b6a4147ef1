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

Observer = Callable[[memoryview], None]

_T = TypeVar("_T")

# Linux moves at most this many bytes per read/write system call, in at most IOV_MAX buffers.
_MAX_SYSCALL_BYTES = 0x7FFFF000
_MAX_IOV = 1024
# With an observer, bytes move in system calls of at most these sizes, each observed right after
# it, while the bytes are likely still in the CPU's caches. Measured on a 2 GiB state (take to
# the page cache, restore warm): reads in calls of 256 KiB to 4 MiB cost alike; writes in calls
# of 1 MiB took 40% longer than unsliced ones even with nothing observed, and with checksums
# 8 MiB calls cost the least (+16% over no checksums, where 1 MiB calls cost +100%).
_OBSERVED_READ_BYTES = 1 << 20
_OBSERVED_WRITE_BYTES = 8 << 20
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

    def _write_sync(
        self, path: str, buffers: Sequence[Buffer], observe: Observer | None = None
    ) -> None:
        final = self._abs(path)
        directory = os.path.dirname(final)
        if directory not in self._made_dirs:
            os.makedirs(directory, exist_ok=True)
            self._made_dirs.add(directory)
        tmp = os.path.join(directory, f".{os.path.basename(final)}.{uuid.uuid4().hex[:12]}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            try:
                _write_all(fd, buffers, observe)
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

    async def write_observed(self, path: str, buffers: Sequence[Buffer], observe: Observer) -> None:
        if type(self).write is not FSStoragePlugin.write:
            # A subclass changed ``write``: observed writes go through it too.
            await super().write_observed(path, buffers, observe)
            return
        await self._run(self._write_sync, path, buffers, observe)

    def _read_sync(self, path: str) -> bytes:
        with open(self._abs(path), "rb") as f:
            return f.read()

    async def read(self, path: str) -> bytes:
        return await self._run(self._read_sync, path)

    def _readv_sync(
        self, path: str, offset: int, outs: Sequence[memoryview], observe: Observer | None = None
    ) -> None:
        fd = os.open(self._abs(path), os.O_RDONLY | os.O_CLOEXEC)
        try:
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


def _next_batch(pending: deque[memoryview], limit: int = _MAX_SYSCALL_BYTES) -> list[memoryview]:
    """The leading buffers of ``pending`` that one vectored system call moves, up to ``limit``
    bytes."""
    batch: list[memoryview] = []
    size = 0
    for view in pending:
        if size + len(view) > limit:
            if not batch:
                batch.append(view[:limit])
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


def _observe_prefix(batch: list[memoryview], n: int, observe: Observer) -> None:
    """Observes the first ``n`` bytes of ``batch`` (what one system call moved)."""
    for view in batch:
        if n <= 0:
            return
        observe(view[:n] if n < len(view) else view)
        n -= len(view)


def _write_all(fd: int, buffers: Sequence[Buffer], observe: Observer | None = None) -> None:
    """Writes every buffer in order, resuming after short writes; ``observe`` sees each piece
    written, in order, right after its system call."""
    pending = deque(memoryview(b).cast("B") for b in buffers if len(b))
    limit = _MAX_SYSCALL_BYTES if observe is None else _OBSERVED_WRITE_BYTES
    while pending:
        batch = _next_batch(pending, limit)
        n = os.writev(fd, batch)
        if observe is not None:
            _observe_prefix(batch, n, observe)
        _consume(pending, n)


def _read_all(
    fd: int, offset: int, outs: Sequence[memoryview], name: str, observe: Observer | None = None
) -> None:
    """Fills every buffer in order from ``offset`` on, resuming after short reads; ``observe``
    sees each piece read, in order, right after its system call."""
    pending = deque(o for o in outs if len(o))
    total = offset + sum(len(o) for o in pending)
    limit = _MAX_SYSCALL_BYTES if observe is None else _OBSERVED_READ_BYTES
    pos = offset
    while pending:
        batch = _next_batch(pending, limit)
        n = os.preadv(fd, batch, pos)
        if n == 0:
            raise EOFError(f"{name} ends at byte {pos}, but bytes up to {total} were requested")
        if observe is not None:
            _observe_prefix(batch, n, observe)
        _consume(pending, n)
        pos += n
