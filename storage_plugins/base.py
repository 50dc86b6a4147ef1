"""The storage-plugin contract: named blobs of bytes under one root, nothing more."""

from __future__ import annotations

import abc
import asyncio
import errno
import functools
import queue
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

# Anything exposing the buffer protocol as contiguous bytes: bytes, bytearray, memoryview.
Buffer = bytes | bytearray | memoryview

_T = TypeVar("_T")


class FrozenBuffers(tuple[Buffer, ...]):
    """Buffers whose memory no thread changes until the write they are handed to returns (an
    async take's private staged copies). ``write_observed`` may then observe and write them as
    they are, without a copy of its own; any other sequence of buffers may change meanwhile."""

    __slots__ = ()


class RefusedBlobError(OSError):
    """A plugin refused a blob for what the store holds at its path (never retried)."""


class UnsafeBlobError(RefusedBlobError):
    """What the store holds at a blob's path is not a plain blob inside the root (a symbolic
    link on the way to it, a FIFO, a device, a socket, a directory): a plugin never follows or
    opens such a thing."""


class BlobTooLargeError(RefusedBlobError):
    """The blob ``where`` holds more bytes than a bounded read (``StoragePlugin.read_limited``)
    allows, ``limit``; ``size`` is its length when the store told it, else None."""

    def __init__(self, where: str, limit: int, size: int | None = None) -> None:
        held = f"{size} bytes" if size is not None else "more bytes"
        super().__init__(f"{where} holds {held}, over the limit of {limit} bytes")
        self.limit = limit
        self.size = size


class StoragePlugin(abc.ABC):
    """Stores and fetches blobs addressed by relative paths under one root.

    A plugin knows nothing of tensors or manifests. It is constructed on the library's event
    loop and every coroutine of it runs there (it may create loop-bound resources in
    ``__init__``). Call sequence: construct with the root and the user's ``storage_options``;
    any number of concurrent calls; ``sync()`` whenever what was written must become durable;
    ``close()`` once, last.

    Errors are builtins: ``FileNotFoundError`` for a missing blob, ``EOFError`` when a blob
    ends before the requested range, ``OSError`` for what the storage reports;
    ``UnsafeBlobError`` for something at a blob's path that is not a plain blob inside the root,
    ``BlobTooLargeError`` from ``read_limited``. The library repeats a call when
    ``is_transient`` says its error may pass (never a ``RefusedBlobError``): every call must be
    safe to repeat.

    Paths are relative, ``/``-separated, made by the library (never ``..`` or absolute).
    """

    # The largest blob this store handles best, or None: the library's default chunk size for
    # tensors is lowered to it (read from the class, alike on every rank).
    chunk_bytes_hint: int | None = None

    # True when making the plugin is expensive (an S3 client): the library keeps it open a few
    # seconds after an operation (STATESNAP_KEEP_OPEN_SECS) for the next one on the same path
    # with the same options, calling ``forget`` before that one.
    keep_open: bool = False

    @abc.abstractmethod
    async def write(self, path: str, buffers: Sequence[Buffer]) -> None:
        """Stores the concatenation of ``buffers`` as the blob ``path``, replacing any old one.
        No reader ever sees a partial blob; ``buffers`` are not referenced after returning (the
        caller reuses their memory at once)."""

    async def write_if_absent(self, path: str, buffers: Sequence[Buffer]) -> None:
        """``write`` of ``buffers``, only if no blob ``path`` exists: ``FileExistsError``
        otherwise (the
        manifest is written so: of two takes racing at one path only one commits). The default
        asks ``exists`` then writes, which two writers can pass at once; a store that can create
        a blob only if absent in one step (an exclusive link, a conditional put) overrides it.
        """
        if await self.exists(path):
            raise FileExistsError(f"{self.describe(path)} exists")
        await self.write(path, buffers)

    @abc.abstractmethod
    async def read(self, path: str) -> bytes:
        """Returns the whole blob ``path``."""

    async def read_limited(self, path: str, limit: int) -> bytes:
        """Returns the whole blob ``path``, which holds at most ``limit`` bytes: checked
        against the reported length before reading, and by reading no more than ``limit + 1``
        bytes (the default trusts ``size``; plugins that can bound a read override it).

        Raises:
            FileNotFoundError: no blob at ``path``.
            BlobTooLargeError: the blob holds more than ``limit`` bytes.
        """
        size = await self.size(path)
        if size is not None and size > limit:
            raise BlobTooLargeError(self.describe(path), limit, size)
        data = await self.read(path)
        if len(data) > limit:
            raise BlobTooLargeError(self.describe(path), limit, len(data))
        return data

    @abc.abstractmethod
    async def read_into(self, path: str, offset: int, out: memoryview) -> None:
        """Fills ``out`` with the bytes ``[offset, offset + len(out))`` of blob ``path``.

        Raises:
            FileNotFoundError: no blob at ``path``.
            EOFError: the blob ends before ``offset + len(out)``.
        """

    async def readv(self, path: str, offset: int, outs: Sequence[memoryview]) -> None:
        """Fills the buffers in ``outs``, in order, from consecutive bytes starting at ``offset``
        (a scatter read). The default reads into one temporary buffer and copies it out.

        Raises:
            FileNotFoundError: no blob at ``path``.
            EOFError: the blob ends before the last buffer is filled.
        """
        if len(outs) == 1:
            await self.read_into(path, offset, outs[0])
            return
        total = sum(len(o) for o in outs)
        staging = memoryview(bytearray(total))
        await self.read_into(path, offset, staging)
        pos = 0
        for out in outs:
            out[:] = staging[pos : pos + len(out)]
            pos += len(out)

    async def write_observed(
        self, path: str, buffers: Sequence[Buffer], observe: Callable[[memoryview], None]
    ) -> None:
        """``write`` of blob ``path``, with ``observe`` called on consecutive pieces of its
        bytes, in order, each once (checksums), from any thread but never concurrently with
        itself.

        What is observed must be the very bytes stored, even while another thread changes the
        memory of ``buffers``: a plugin observes its own copy, the one it writes. The default
        copies the blob's bytes (a ``bytes`` buffer as it is), observes the copy, then writes
        it. ``observe`` may have a ``many(pieces)`` method, the same as calling it on each.

        ``buffers`` given as ``FrozenBuffers`` do not change until the call returns: they may be
        observed and written as they are (the default observes them, then writes them).
        """
        nbytes = sum(map(len, buffers))
        if isinstance(buffers, FrozenBuffers):
            await off_loop(nbytes, _observe_all, buffers, observe)
            await self.write(path, buffers)
            return
        data = await off_loop(nbytes, observed_copy, buffers, observe)
        await self.write(path, [data])

    async def readv_observed(
        self,
        path: str,
        offset: int,
        outs: Sequence[memoryview],
        observe: Callable[[memoryview], None],
    ) -> None:
        """``readv`` of ``path`` from ``offset`` into ``outs``, with ``observe`` called on the
        bytes read, as ``write_observed`` does (the default reads, then observes each
        buffer)."""
        await self.readv(path, offset, outs)
        await off_loop(sum(map(len, outs)), _observe_all, outs, observe)

    async def size(self, path: str) -> int | None:
        """The length of blob ``path``, or None when this store cannot tell cheaply (the
        default); compared with the manifest, so that a blob that grew is noticed.

        Raises:
            FileNotFoundError: no blob at ``path``.
        """
        return None

    @abc.abstractmethod
    async def exists(self, path: str) -> bool:
        """Whether a blob ``path`` exists."""

    async def list_names(self, limit: int) -> list[str] | None:
        """Up to ``limit`` names of what the root holds at its top level (blobs, and the first
        component of longer paths), ``[]`` when it is empty or absent; None (the default) when
        the store cannot tell with one cheap call. A take asks, to refuse a root that holds
        anything but what an interrupted take left; a list of fewer than ``limit`` names is
        taken as whole (hidden names included) and also answers whether a snapshot's or
        another library's marker file is there, which a store that cannot list is asked with
        ``exists``."""
        return None

    @abc.abstractmethod
    async def delete(self, path: str) -> None:
        """Deletes blob ``path``; ``FileNotFoundError`` if there is none."""

    async def delete_all(self) -> None:
        """Deletes every blob under the root, and the root itself where the store has
        directories (links removed, never followed); nothing when it does not exist. The
        default raises ``NotImplementedError``."""
        raise NotImplementedError(f"{type(self).__name__} cannot delete a whole root")

    async def sync(self) -> None:  # noqa: B027 - optional hook, most stores are durable on write
        """Makes every blob written so far durable, under its name (a take calls it on each
        rank once its blobs are written, and on rank 0 after the manifest); stores durable on
        ``write`` need not override it."""

    async def close(self) -> None:  # noqa: B027 - optional hook, most plugins hold nothing
        """Releases what the plugin holds (sessions, threads). Called once, last."""

    def forget(self) -> None:  # noqa: B027 - optional hook, for plugins that remember blobs
        """Drops what the plugin learned about blobs during an operation (a length seen in a
        read's answer), before a plugin kept open serves the next one."""

    def describe(self, path: str) -> str:
        """A human-readable location of blob ``path``, for error messages."""
        return path

    def is_transient(self, error: BaseException) -> bool:
        """Whether ``error`` may go away if the call is made again (then retried with backoff):
        by default timeouts, dropped or refused connections, and the "busy, try again" errnos.
        """
        if isinstance(error, (ConnectionError, TimeoutError)):
            return True
        return isinstance(error, OSError) and error.errno in _TRANSIENT_ERRNOS


# Observing up to this many bytes inline costs less than handing them to a thread.
OBSERVE_INLINE_BYTES = 1 << 20


async def off_loop(nbytes: int, fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)``, on a thread when it handles more than ``OBSERVE_INLINE_BYTES``."""
    if nbytes > OBSERVE_INLINE_BYTES:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


def observed_copy(buffers: Sequence[Buffer], observe: Callable[[memoryview], None]) -> bytes:
    """One private copy of the concatenated ``buffers`` (a lone ``bytes`` one as it is:
    immutable), shown to ``observe``."""
    data = b"".join(buffers)
    if data:
        observe(memoryview(data))
    return data


_MAX_IOV = 1024  # Linux's IOV_MAX: buffers per vectored call


def move_views(
    views: list[memoryview],
    move: Callable[[list[memoryview]], int],
    limit: int,
    observe: Callable[[memoryview], None] | None = None,
) -> None:
    """Moves ``views`` (non-empty) by calls ``move(batch)`` of at most ``limit`` bytes and
    ``_MAX_IOV`` buffers, each moving a prefix of ``batch``; ``observe`` (or its ``many``)
    sees the pieces moved, in order, right after each call."""
    many = getattr(observe, "many", None)
    i, skip, pos = 0, 0, 0  # the first view not wholly moved, its bytes moved, bytes moved
    while i < len(views):
        batch = [views[i][skip : skip + limit]]
        size, j = len(batch[0]), i + 1
        while j < len(views) and len(batch) < _MAX_IOV and size + len(views[j]) <= limit:
            batch.append(views[j])
            size += len(views[j])
            j += 1
        n = move(batch)
        if n <= 0:
            total = sum(map(len, views))
            raise OSError(errno.EIO, f"a system call moved no bytes at byte {pos} of {total}")
        pos += n
        moved = []
        for piece in batch:
            k = min(n, len(piece))
            moved.append(piece[:k])
            n -= k
            skip += k
            if skip == len(views[i]):
                i, skip = i + 1, 0
            if n == 0:
                break
        if many is not None:
            many(moved)
        elif observe is not None:
            list(map(observe, moved))


def fill_buffer(buf: memoryview, views: Sequence[memoryview]) -> Iterator[int]:
    """Copies the concatenation of ``views`` into ``buf`` one buffer-full at a time, yielding
    how many bytes it holds (``len(buf)`` but for the last)."""
    fill = 0
    for view in views:
        while len(view):
            k = min(len(view), len(buf) - fill)
            buf[fill : fill + k] = view[:k]
            fill += k
            view = view[k:]
            if fill == len(buf):
                yield fill
                fill = 0
    if fill:
        yield fill


def short_read(where: str, end: int, wanted: int) -> EOFError:
    """The error for a read of the blob ``where``, which ends at byte ``end``, of the bytes up
    to ``wanted``."""
    return EOFError(f"{where} ends at byte {end}, but bytes up to {wanted} were requested")


def _observe_all(buffers: Sequence[Buffer], observe: Callable[[memoryview], None]) -> None:
    for b in buffers:
        if len(b):
            observe(memoryview(b).cast("B"))


_TRANSIENT_ERRNOS = frozenset(
    {
        errno.EAGAIN,
        errno.EBUSY,
        errno.EINTR,
        errno.ETIMEDOUT,
        errno.ECONNRESET,
        errno.ECONNABORTED,
        errno.ECONNREFUSED,
        errno.EPIPE,
        errno.ENETUNREACH,
        errno.ENETDOWN,
        errno.EHOSTUNREACH,
    }
)


class DaemonThreadPool(ThreadPoolExecutor):
    """A ``ThreadPoolExecutor`` that keeps taking work while the interpreter exits: its own
    daemon threads (started as work arrives, up to ``max_workers``) take jobs from a queue.

    At exit, ``concurrent.futures`` marks every standard pool shut down (``submit`` raises) and
    joins its threads before ``atexit`` handlers run; the library's ``atexit`` hook still waits
    for pending async snapshots, whose I/O runs on these pools (a plugin's blocking calls, the
    I/O loop's default executor behind ``asyncio.to_thread`` and ``getaddrinfo``).
    """

    def __init__(self, max_workers: int | None = None, thread_name_prefix: str = "") -> None:
        super().__init__(max_workers, thread_name_prefix)  # (sets ``_max_workers``)
        self._daemons = _Daemons(self._max_workers, thread_name_prefix or "pool")
        # A pool dropped without ``shutdown`` lets its threads go; not at exit (see above).
        weakref.finalize(self, self._daemons.stop, False).atexit = False

    def submit(self, fn: Callable[..., _T], /, *args: Any, **kwargs: Any) -> Future[_T]:
        future: Future[_T] = Future()
        self._daemons.put(future, functools.partial(fn, *args, **kwargs))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._daemons.stop(wait, cancel_futures)


_Job = tuple["Future[Any]", Callable[[], Any]]


class _Daemons:
    """The threads of a ``DaemonThreadPool`` and their queue (apart from the pool, so that the
    threads do not keep it alive)."""

    def __init__(self, most: int, prefix: str) -> None:
        self.most = most
        self.prefix = prefix
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []
        self.idle = 0  # threads waiting for a job that no ``put`` has counted on yet
        self.closed = False

    def put(self, future: Future[Any], fn: Callable[[], Any]) -> None:
        with self.lock:
            if self.closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self.jobs.put((future, fn))
            if self.idle:
                self.idle -= 1
            elif len(self.threads) < self.most:
                name = f"{self.prefix}_{len(self.threads)}"
                thread = threading.Thread(target=self._work, name=name, daemon=True)
                thread.start()
                self.threads.append(thread)

    def _work(self) -> None:
        while (job := self.jobs.get()) is not None:
            settle = _run(*job)
            job = None  # the job's arguments go now, not when the next one comes
            # Counted idle before the caller learns the result: the job it submits next is
            # this thread's, not a new thread's (a pool would grow to its limit otherwise).
            with self.lock:
                self.idle += 1
            settle()

    def stop(self, wait: bool = True, cancel_futures: bool = False) -> None:
        """Ends the threads once they have run the jobs queued (cancelled, with
        ``cancel_futures``); with ``wait``, waits for them."""
        with self.lock:
            self.closed = True
            while cancel_futures:
                try:
                    job = self.jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job[0].cancel()
            for _ in self.threads:  # (one more each on a second call: never read)
                self.jobs.put(None)
        if wait:
            for thread in self.threads:
                if thread is not threading.current_thread():
                    thread.join()


def _run(future: Future[Any], fn: Callable[[], Any]) -> Callable[[], None]:
    """Runs ``fn`` for ``future`` (unless cancelled); what sets the future's outcome."""
    if not future.set_running_or_notify_cancel():
        return _nothing
    try:
        result = fn()
    except BaseException as e:
        return functools.partial(future.set_exception, e)
    return functools.partial(future.set_result, result)


def _nothing() -> None:
    pass
