"""The storage-plugin contract: named blobs of bytes under one root, nothing more."""

from __future__ import annotations

import abc
import asyncio
import errno
import functools
import os
import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

# Anything exposing the buffer protocol as contiguous bytes: bytes, bytearray, memoryview.
Buffer = bytes | bytearray | memoryview

_T = TypeVar("_T")


class RefusedBlobError(OSError):
    """A plugin refused a blob for what the store holds at its path, not for a failure of the
    store: the same call would be refused again, so it is never retried."""


class UnsafeBlobError(RefusedBlobError):
    """What the store holds at a blob's path is not a plain blob inside the root: a symbolic
    link (at the blob, or at a directory on the way to it), a FIFO, a device, a socket or a
    directory. A plugin never follows or opens such a thing: a link could lead out of the root,
    and opening a FIFO or a device could block or never end."""


class BlobTooLargeError(RefusedBlobError):
    """A blob holds more bytes than a bounded read (``StoragePlugin.read_limited``) allows.

    ``size`` is the blob's length when the store told it, else None (the read stopped one byte
    past ``limit``).
    """

    def __init__(self, where: str, limit: int, size: int | None = None) -> None:
        held = f"{size} bytes" if size is not None else "more bytes"
        super().__init__(f"{where} holds {held}, over the limit of {limit} bytes")
        self.limit = limit
        self.size = size


class StoragePlugin(abc.ABC):
    """Stores and fetches blobs addressed by relative paths under one root.

    A plugin knows nothing of tensors or manifests. The caller (the library's scheduler) owns the
    event loop; every coroutine of a plugin runs on that loop, and the plugin is constructed on it
    too, so a plugin may create loop-bound resources (an aiohttp session, say) in ``__init__``.

    Call sequence: construct with the root and the user's ``storage_options``; any number of
    concurrent ``write`` / ``read`` / ``read_into`` / ``readv`` / ``write_observed`` /
    ``readv_observed`` / ``size`` / ``exists`` / ``delete`` calls; ``sync()`` whenever what was
    written must become durable; ``close()`` once, after which the plugin is not used again.

    Errors are builtins a caller already knows: ``FileNotFoundError`` for a missing blob,
    ``EOFError`` when a blob ends before the requested range does, ``OSError`` (or a subclass) for
    everything the storage itself reports; ``UnsafeBlobError`` for something at a blob's path
    that is not a plain blob inside the root (a symbolic link, a FIFO, a device), which a plugin
    must neither follow nor open, and ``BlobTooLargeError`` from ``read_limited``. The library
    makes a call again when ``is_transient`` says its error may pass (never for a
    ``RefusedBlobError``), so every call must be safe to repeat.

    Paths are relative, ``/``-separated, and were produced by the library (never ``..`` or
    absolute); a plugin maps them under its root however it likes.
    """

    # The largest blob this store handles best, or None: the library's default chunk size for
    # tensors (128 MiB) is lowered to it (an explicit STATESNAP_CHUNK_BYTES still wins). Read
    # from the class, before any instance exists, and alike on every rank.
    chunk_bytes_hint: int | None = None

    # True when making the plugin is expensive (an S3 client: the SDK loads its service model
    # and opens new connections) and one may serve several operations in turn: the library then
    # keeps it open a few seconds after an operation (STATESNAP_KEEP_OPEN_SECS) for the next one
    # on the same path with the same options, calling ``forget`` before that one.
    keep_open: bool = False

    @abc.abstractmethod
    async def write(self, path: str, buffers: Sequence[Buffer]) -> None:
        """Stores the concatenation of ``buffers`` as the blob ``path``, replacing any old one.

        When this returns, the blob holds exactly these bytes, and no reader ever sees a
        partially written blob at ``path``. The plugin must not keep references to ``buffers``
        after returning: the caller may reuse their memory at once.
        """

    async def write_if_absent(self, path: str, buffers: Sequence[Buffer]) -> None:
        """``write``, only if no blob ``path`` exists: ``FileExistsError`` otherwise, and
        nothing written. The library writes a snapshot's manifest this way, so that of two
        takes racing at one path only one commits.

        The default asks ``exists`` and then writes, which two writers can pass at once; a
        plugin whose store can create a blob only if it is absent, in one step (an exclusive
        link on a local disk, a conditional put on S3), overrides it.
        """
        if await self.exists(path):
            raise FileExistsError(f"{self.describe(path)} exists")
        await self.write(path, buffers)

    @abc.abstractmethod
    async def read(self, path: str) -> bytes:
        """Returns the whole blob ``path``."""

    async def read_limited(self, path: str, limit: int) -> bytes:
        """Returns the whole blob ``path``, which holds at most ``limit`` bytes.

        Reading a blob whose length the snapshot does not record (its manifest) must cost no
        more than ``limit`` bytes of memory and transfer, whatever the store claims: a plugin
        checks the length the store reports before reading (``size``), and reads no more than
        ``limit + 1`` bytes anyway, since that length may be wrong. The default trusts ``size``
        and then reads the whole blob; plugins that can bound a read override it.

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
        (a scatter read: one ranged request, several destinations).

        The default reads the whole range into one temporary buffer and copies it out; plugins
        that can scatter without the copy (``preadv``) override it.

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
        """``write``, with ``observe`` called on the blob's bytes: on consecutive pieces of them,
        in order, each exactly once (the library computes checksums this way). ``observe``
        may be called from any thread, but never concurrently with itself.

        What is observed must be the very bytes stored, even while another thread changes the
        memory of ``buffers`` (an application updating its tensors in place during a take):
        a plugin observes its own copy of them, the one it sends or writes, never ``buffers``
        before or after their write. The default copies the blob's bytes (a ``bytes`` buffer,
        which nobody can change, is used as it is; on a worker thread when they are large),
        observes the copy, then writes the copy; plugins that can stream override it to copy
        and observe piece by piece.

        ``observe`` may also have a ``many(pieces)`` method, the same as calling ``observe`` on
        each of ``pieces`` in order; a plugin that moves many buffers at once may use it (the
        library's digests checksum slab members in bulk that way).
        """
        if sum(len(b) for b in buffers) > OBSERVE_INLINE_BYTES:
            copies = await asyncio.to_thread(copy_observed, buffers, observe)
        else:
            copies = copy_observed(buffers, observe)
        await self.write(path, copies)

    async def readv_observed(
        self,
        path: str,
        offset: int,
        outs: Sequence[memoryview],
        observe: Callable[[memoryview], None],
    ) -> None:
        """``readv``, with ``observe`` called on the bytes read, as ``write_observed`` does.

        The default reads, then observes each buffer; a plugin that reads in pieces overrides
        it to observe each piece right after it lands.
        """
        await self.readv(path, offset, outs)
        if sum(len(o) for o in outs) > OBSERVE_INLINE_BYTES:
            await asyncio.to_thread(_observe_all, outs, observe)
        else:
            _observe_all(outs, observe)

    async def read_ahead(self, path: str, offset: int, nbytes: int) -> None:  # noqa: B027 - a hint
        """A hint: the bytes ``[offset, offset + nbytes)`` of blob ``path`` are about to be
        read. A plugin may start fetching them now, where that costs no memory of the process
        (the local plugin asks the kernel to read them into the page cache); the default does
        nothing. The library gives these hints while a restore plans its reads, and ignores
        their errors (the read itself reports a missing or short blob).
        """

    def read_ahead_now(self, path: str, offset: int, nbytes: int) -> bool:
        """The hint of ``read_ahead``, given from a library thread (not the I/O loop), for a
        plugin that acts on it at once with a short blocking call: True when it did. The
        default returns False, and the library awaits ``read_ahead`` on its I/O loop instead.
        The local plugin answers here (one ``posix_fadvise``, which queues the reads): a hint
        then costs no hand-over between threads, each of which would take the GIL from the
        restore planning meanwhile.
        """
        return False

    async def size(self, path: str) -> int | None:
        """The length of blob ``path`` in bytes, or None when this store cannot tell cheaply
        (the default). The library compares it with what the manifest records, so that a blob
        that grew after the take is noticed.

        Raises:
            FileNotFoundError: no blob at ``path``.
        """
        return None

    @abc.abstractmethod
    async def exists(self, path: str) -> bool:
        """Whether a blob ``path`` exists."""

    async def list_names(self, limit: int) -> list[str] | None:
        """Up to ``limit`` names of what the root holds at its top level, in any order: its
        blobs, and the first component of longer paths (a directory, an object store's common
        prefix); ``[]`` when the root is empty or does not exist. None (the default) when the
        store cannot tell with one cheap call.

        The library asks before a take, which refuses a root that holds anything but what an
        interrupted take left there; a plugin that answers None leaves that check undone.
        """
        return None

    @abc.abstractmethod
    async def delete(self, path: str) -> None:
        """Deletes blob ``path``; ``FileNotFoundError`` if there is none."""

    async def delete_all(self) -> None:
        """Deletes every blob under the root, and the root itself where the store has
        directories; nothing when the root does not exist. Links are removed, never followed.
        The library calls it to remove a whole snapshot once its manifest is gone (the
        checkpoint manager's retention). The default raises ``NotImplementedError``: a store
        that cannot list what is under a root cannot delete it whole.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot delete a whole root")

    async def sync(self) -> None:  # noqa: B027 - optional hook, most stores are durable on write
        """Makes every blob written so far durable (survives a crash of the machine).

        The library calls this before and after writing a snapshot's commit marker. Stores whose
        writes are durable when ``write`` returns (object stores) need not override it.
        """

    async def close(self) -> None:  # noqa: B027 - optional hook, most plugins hold nothing
        """Releases what the plugin holds (sessions, threads). Called once, last."""

    def forget(self) -> None:  # noqa: B027 - optional hook, for plugins that remember blobs
        """Drops what the plugin learned about blobs during an operation (an object's length
        seen in a read's answer): a plugin kept open (``keep_open``) may serve the next one
        after the blobs changed."""

    def describe(self, path: str) -> str:
        """A human-readable location of blob ``path``, for error messages."""
        return path

    def is_transient(self, error: BaseException) -> bool:
        """Whether ``error`` may go away if the same call is simply made again (the library then
        retries it, with backoff). By default: timeouts, dropped or refused connections, and
        the errnos that say "busy, try again". A missing blob, a permission error, a full disk
        or an I/O error of the device are not. Plugins for remote stores may add their own.
        """
        if isinstance(error, (ConnectionError, TimeoutError)):
            return True
        return isinstance(error, OSError) and error.errno in _TRANSIENT_ERRNOS


# Observing up to this many bytes inline costs less than handing them to a thread.
OBSERVE_INLINE_BYTES = 1 << 20


def copy_observed(
    buffers: Sequence[Buffer], observe: Callable[[memoryview], None]
) -> list[bytes]:
    """A private copy of each non-empty buffer (``bytes`` ones as they are: immutable), each
    shown to ``observe`` in order."""
    copies = [b if type(b) is bytes else bytes(b) for b in buffers if len(b)]
    for c in copies:
        observe(memoryview(c))
    return copies


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
        super().__init__(max_workers, thread_name_prefix)
        most = max_workers if max_workers is not None else min(32, (os.cpu_count() or 1) + 4)
        self._daemons = _Daemons(most, thread_name_prefix or "pool")
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
            _run(*job)
            job = None  # the job's arguments go now, not when the next one comes
            with self.lock:
                self.idle += 1

    def stop(self, wait: bool = True, cancel_futures: bool = False) -> None:
        """Ends the threads once they have run the jobs queued (cancelled, with
        ``cancel_futures``); with ``wait``, waits for them."""
        with self.lock:
            first, self.closed = not self.closed, True
            ends = 0
            while cancel_futures:
                try:
                    job = self.jobs.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    ends += 1
                else:
                    job[0].cancel()
            for _ in range(ends):
                self.jobs.put(None)
            if first:
                for _ in self.threads:
                    self.jobs.put(None)
        if wait:
            for thread in self.threads:
                if thread is not threading.current_thread():
                    thread.join()


def _run(future: Future[Any], fn: Callable[[], Any]) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = fn()
    except BaseException as e:
        future.set_exception(e)
    else:
        future.set_result(result)
