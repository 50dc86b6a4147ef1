"""The one path to storage: a byte-budgeted, pipelined stage -> write and read -> consume engine.

Every blob the library writes or reads goes through this module. It owns the event loop (one
background thread per process, "statesnap-io"), so that callers need no loop of their own and can
call the library from inside one (a notebook, say).

Writes are a pipeline across two threads: the caller's thread stages each request (a zero-copy
view of CPU memory, or a copy when one is needed) under a byte budget, and hands staged batches to
the I/O loop, whose workers write them while the caller stages the next ones. Reads run on the I/O
loop: workers read straight into destination memory, or into budgeted scratch memory that a
callback consumes (a dtype cast, an object decode).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import functools
import json
import logging
import os
import random
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import accumulate, compress
from typing import Any, TypeVar

from snapshot import knobs
from snapshot._engine import checksum
from snapshot._engine.requests import (
    ReadRequest,
    WriteRequest,
    segment_bytes,
    segment_verify,
)
from snapshot.errors import (
    CorruptSnapshotError,
    SnapshotError,
    StorageError,
    UnsafeSnapshotError,
)
from storage_plugins import (
    BlobTooLargeError,
    Buffer,
    RefusedBlobError,
    StoragePlugin,
    UnsafeBlobError,
    url_to_storage_plugin,
)

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

# ---------------------------------------------------------------------------------------------
# The I/O loop.


class _LoopThread:
    def __init__(self) -> None:
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name="statesnap-io", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()


_loop_thread: _LoopThread | None = None
_loop_lock = threading.Lock()


def io_loop() -> asyncio.AbstractEventLoop:
    """The library's event loop, started on first use (and again in a forked child)."""
    global _loop_thread
    with _loop_lock:
        if _loop_thread is None or _loop_thread.pid != os.getpid():
            _loop_thread = _LoopThread()
        return _loop_thread.loop


def run(coro: Coroutine[Any, Any, _T]) -> _T:
    """Runs ``coro`` on the I/O loop and waits for its result, from any thread but the loop's."""
    return join(spawn(coro))


def spawn(coro: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
    """Starts ``coro`` on the I/O loop, from any thread but the loop's; ``join`` waits for it
    (the caller does other work meanwhile)."""
    loop = io_loop()
    if _loop_thread is not None and threading.current_thread() is _loop_thread.thread:
        coro.close()
        raise RuntimeError("snapshot I/O called from the I/O loop itself; this would deadlock")
    return asyncio.run_coroutine_threadsafe(coro, loop)


def join(future: concurrent.futures.Future[_T]) -> _T:
    """Waits for what ``spawn`` started, and gives its result or raises its error."""
    try:
        return future.result()
    except BaseException:
        future.cancel()  # KeyboardInterrupt in the caller: stop the work, don't leave it running
        raise


def open_plugin(url: str, storage_options: dict[str, Any] | None) -> StoragePlugin:
    """The storage plugin for ``url``, built on the I/O loop; the caller closes it."""

    async def make() -> StoragePlugin:
        return url_to_storage_plugin(url, storage_options)

    try:
        return run(make())
    except (ValueError, TypeError, ImportError) as e:
        raise StorageError(f"cannot open storage for {url!r}: {e}") from e


@contextmanager
def open_storage(url: str, storage_options: dict[str, Any] | None) -> Iterator[StoragePlugin]:
    """A storage plugin for ``url``, built on the I/O loop and closed on exit; or, for a plugin
    class that asks for it (``keep_open``), kept open ``knobs.keep_open_secs()`` after a
    successful exit and handed to the next ``open_storage`` of the same ``url`` and options."""
    keep_secs = knobs.keep_open_secs()  # read first: a bad setting fails before any work
    key = _keep_open_key(url, storage_options)
    plugin = run(_reclaim(key)) if key is not None else None
    if plugin is None:
        plugin = open_plugin(url, storage_options)
    done = False
    try:
        yield plugin
        done = True
    finally:
        if done and key is not None and type(plugin).keep_open and keep_secs > 0:
            run(_keep(key, plugin, keep_secs))
        else:
            run(plugin.close())


# Plugins kept open between operations, by (pid, url, options): each with the timer that
# closes it. Touched on the I/O loop only.
_kept: dict[tuple[int, str, str], tuple[StoragePlugin, asyncio.TimerHandle]] = {}


def _keep_open_key(url: str, storage_options: dict[str, Any] | None) -> tuple[int, str, str] | None:
    try:
        options = json.dumps(storage_options or {}, sort_keys=True)
    except (TypeError, ValueError):
        return None  # options that are objects (a session, a callback): not compared, not kept
    return (os.getpid(), url, options)


async def _reclaim(key: tuple[int, str, str]) -> StoragePlugin | None:
    kept = _kept.pop(key, None)
    if kept is None:
        return None
    plugin, timer = kept
    timer.cancel()
    plugin.forget()
    return plugin


async def _keep(key: tuple[int, str, str], plugin: StoragePlugin, secs: float) -> None:
    previous = _kept.pop(key, None)
    if previous is not None:  # two operations on one path at once: keep the later one
        previous[1].cancel()
        await _close_quietly(previous[0])
    loop = asyncio.get_running_loop()
    timer = loop.call_later(secs, lambda: loop.create_task(_expire(key, plugin)))
    _kept[key] = (plugin, timer)


async def _expire(key: tuple[int, str, str], plugin: StoragePlugin) -> None:
    kept = _kept.get(key)
    if kept is not None and kept[0] is plugin:
        del _kept[key]
        await _close_quietly(plugin)


async def _close_quietly(plugin: StoragePlugin) -> None:
    try:
        await plugin.close()
    except Exception as e:  # nothing depends on it any more; say so and go on
        logger.warning("closing storage plugin %r failed: %s: %s", plugin, type(e).__name__, e)


async def _close_kept() -> None:
    pid = os.getpid()
    for key in [k for k in _kept if k[0] == pid]:
        plugin, timer = _kept.pop(key)
        timer.cancel()
        await _close_quietly(plugin)
    _kept.clear()  # a forked child's copy of its parent's plugins: not ours to close


def close_kept_plugins() -> None:
    """Closes every plugin kept open for a next operation (at exit, or to release them now)."""
    if (
        _loop_thread is not None
        and _loop_thread.pid == os.getpid()
        and _loop_thread.thread.is_alive()
    ):
        run(_close_kept())


async def _end_leftovers(timeout: float) -> None:
    """Cancels the tasks still pending on the I/O loop, and waits for them to end."""
    me = asyncio.current_task()
    left = [task for task in asyncio.all_tasks() if task is not me]
    for task in left:
        task.cancel()
    if left:
        await asyncio.wait(left, timeout=timeout)


def end_leftover_tasks(timeout: float = 5.0) -> None:
    """At exit: ends whatever work is still pending on the I/O loop. The loop's thread is a
    daemon, stopped mid-step when the interpreter ends, and a task still pending then is
    destroyed with a warning on stderr; by now the pending snapshots have been waited for
    (``pending``), so what is left belongs to nobody. Waits ``timeout`` seconds at most."""
    if (
        _loop_thread is not None
        and _loop_thread.pid == os.getpid()
        and _loop_thread.thread.is_alive()
    ):
        try:
            spawn(_end_leftovers(timeout)).result(timeout + 1)
        except Exception:
            logger.debug("could not end the I/O loop's leftover tasks", exc_info=True)


# Registered first, so run last (atexit runs its functions last-registered first): after the
# kept plugins are closed, and after the weakref finalizers of takes dropped unfinished.
atexit.register(end_leftover_tasks)
atexit.register(close_kept_plugins)


# ---------------------------------------------------------------------------------------------
# The byte budget.


class ByteBudget:
    """Bytes of memory that may be held at once, shared by the caller's thread and the I/O loop.

    A request larger than the whole budget is admitted when nothing else is held, so it runs
    alone rather than never. ``abort`` wakes every waiter with an error.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._used = 0
        self._peak = 0
        self._cond = threading.Condition()
        self._async_waiters: deque[tuple[int, asyncio.AbstractEventLoop, asyncio.Future[None]]] = (
            deque()
        )
        self._error: BaseException | None = None

    @property
    def peak(self) -> int:
        """The most bytes held at once so far."""
        return self._peak

    @property
    def used(self) -> int:
        """The bytes held now."""
        return self._used

    def _fits(self, n: int) -> bool:
        return self._used == 0 or self._used + n <= self.capacity

    def _take(self, n: int) -> None:
        self._used += n
        self._peak = max(self._peak, self._used)

    def try_acquire(self, n: int) -> bool:
        with self._cond:
            if self._error is not None:
                raise self._error
            if n == 0 or (not self._async_waiters and self._fits(n)):
                self._take(n)
                return True
            return False

    def acquire(self, n: int, stop: Callable[[], BaseException | None] | None = None) -> None:
        """Blocks the calling thread until ``n`` bytes fit.

        ``stop`` (checked whenever the waiter wakes, ``wake`` included) returns an error that
        ends the wait instead: a ``BudgetShare`` aborted while this budget is not.
        """
        with self._cond:
            while self._error is None and not (n == 0 or self._fits(n)):
                if stop is not None and (error := stop()) is not None:
                    raise error
                self._cond.wait()
            if self._error is not None:
                raise self._error
            self._take(n)

    def wake(self) -> None:
        """Wakes the threads waiting in ``acquire``, so they check their ``stop`` again."""
        with self._cond:
            self._cond.notify_all()

    async def acquire_async(self, n: int) -> None:
        """Waits on the running loop until ``n`` bytes fit."""
        if self.try_acquire(n):
            return
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._cond:
            if self._error is not None:
                raise self._error
            if self._fits(n) and not self._async_waiters:
                self._take(n)
                return
            self._async_waiters.append((n, loop, future))
        await future

    def release(self, n: int) -> None:
        with self._cond:
            self._used -= n
            self._cond.notify_all()
            while self._async_waiters and self._fits(self._async_waiters[0][0]):
                want, loop, future = self._async_waiters.popleft()
                self._take(want)
                loop.call_soon_threadsafe(self._grant, future, want)

    def _grant(self, future: asyncio.Future[None], n: int) -> None:
        if future.cancelled():
            self.release(n)  # the waiter gave up after being granted: hand the bytes back
        else:
            future.set_result(None)

    def abort(self, error: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()
            waiters, self._async_waiters = self._async_waiters, deque()
        for _, loop, future in waiters:
            loop.call_soon_threadsafe(_fail_future, future, error)


class BudgetShare:
    """One write pipeline's part of a ``ByteBudget`` that several share (the staging pool's, for
    async takes pending at once, so that together they stage at most one budget).

    Bytes are charged to the shared budget; the share counts its own, so a pipeline's peak and
    a leftover are its own, and ``abort`` fails only this share's waiters: the shared budget is
    never aborted (one take's write error must not fail the next take's staging).
    """

    def __init__(self, shared: ByteBudget) -> None:
        self.shared = shared
        self._used = 0
        self._peak = 0
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    @property
    def peak(self) -> int:
        """The most bytes this share held at once."""
        return self._peak

    def _took(self, n: int) -> None:
        with self._lock:
            self._used += n
            self._peak = max(self._peak, self._used)

    def try_acquire(self, n: int) -> bool:
        if self._error is not None:
            raise self._error
        if not self.shared.try_acquire(n):
            return False
        self._took(n)
        return True

    def acquire(self, n: int) -> None:
        """Blocks until ``n`` bytes fit in the shared budget. A request larger than the whole
        budget fits when nothing at all is held: every other holder is a pending take whose
        writes are under way, and the caller flushes its own first, so it is never waiting for
        itself."""
        self.shared.acquire(n, stop=lambda: self._error)
        self._took(n)

    def release(self, n: int) -> None:
        with self._lock:
            self._used -= n
        self.shared.release(n)

    def abort(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self.shared.wake()

    def close(self) -> None:
        """Gives back whatever this share still holds (none once its pipeline is drained; a
        leftover would shrink every later take's budget for good)."""
        with self._lock:
            left, self._used = self._used, 0
        if left:
            logger.debug("a write pipeline ended holding %d staging bytes; released", left)
            self.shared.release(left)


def _fail_future(future: asyncio.Future[None], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


@dataclass(frozen=True, slots=True)
class IOStats:
    """What a batch of requests moved."""

    blobs: int
    nbytes: int
    seconds: float
    peak_budget_bytes: int

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def _storage_error(
    plugin: StoragePlugin, verb: str, blob: str, label: str, e: Exception, attempts: int = 1
) -> Exception:
    """The library's error for a failed plugin call, with ``e`` as its cause."""
    if isinstance(e, SnapshotError):
        return e
    where = plugin.describe(blob)
    error: SnapshotError
    if isinstance(e, UnsafeBlobError):
        error = UnsafeSnapshotError(f"{label}: blob {blob}: {e}")  # ``e`` names the full path
    elif verb == "read" and isinstance(e, FileNotFoundError):
        error = CorruptSnapshotError(f"{label}: blob {where} is missing")
    elif verb == "read" and isinstance(e, EOFError):
        error = CorruptSnapshotError(
            f"{label}: blob {where} is shorter than the manifest says ({e})"
        )
    else:
        tries = f" ({attempts} attempts)" if attempts > 1 else ""
        error = StorageError(
            f"{label}: failed to {verb} blob {where}{tries}: {type(e).__name__}: {e}"
        )
    error.__cause__ = e
    return error


_FIRST_BACKOFF_SECS = 0.05
_MAX_BACKOFF_SECS = 2.0


async def call(
    plugin: StoragePlugin,
    verb: str,
    blob: str,
    label: str,
    op: Callable[[], Awaitable[_T]],
    *,
    convert: bool = True,
) -> _T:
    """Awaits ``op()``, one plugin call, and turns its errors into the library's (or, with
    ``convert=False``, raises the plugin's own error once retries are spent).

    A transient error (``plugin.is_transient``) makes the call again, up to
    ``STATESNAP_IO_RETRIES`` times, after a backoff that doubles from 50 ms (with jitter, so
    that many workers do not retry in step) up to 2 s; each retry is logged. Every plugin call
    can be repeated: a write replaces the whole blob, a read fills the whole range again.

    The call, retries included, must end within ``STATESNAP_IO_TIMEOUT_SECS``: a stalled
    upload fails the operation, naming the blob, instead of hanging it. (An attempt running on
    a worker thread cannot be stopped; it is abandoned, and the operation fails.)
    """
    loop = asyncio.get_running_loop()
    timeout = knobs.io_timeout_secs()
    deadline = loop.time() + timeout
    delay = _FIRST_BACKOFF_SECS
    attempt = 1
    while True:
        try:
            try:
                return await asyncio.wait_for(op(), max(deadline - loop.time(), 0))
            except asyncio.TimeoutError:
                if loop.time() < deadline:
                    raise  # the plugin's own timeout, not the deadline
                raise TimeoutError(
                    f"no answer within {timeout} s (STATESNAP_IO_TIMEOUT_SECS) after "
                    f"{attempt} attempt(s)"
                ) from None
        except Exception as e:
            if loop.time() >= deadline:
                if not convert:
                    raise
                raise _storage_error(plugin, verb, blob, label, e, attempt) from e
            retries = knobs.io_retries()  # read on failure only: calls that succeed pay nothing
            # A refused blob is refused again on every attempt, whatever the plugin says.
            refused = isinstance(e, RefusedBlobError)
            if attempt > retries or refused or not plugin.is_transient(e):
                if not convert:
                    raise
                raise _storage_error(plugin, verb, blob, label, e, attempt) from e
            pause = delay * random.uniform(0.5, 1.0)
            logger.warning(
                "%s: %s of blob %s failed (%s: %s); retrying in %.2f s (retry %d of %d)",
                label,
                verb,
                plugin.describe(blob),
                type(e).__name__,
                e,
                pause,
                attempt,
                retries,
            )
            await asyncio.sleep(min(pause, max(deadline - loop.time(), 0)))
            delay = min(delay * 2, _MAX_BACKOFF_SECS)
            attempt += 1


async def read_unrecorded(plugin: StoragePlugin, blob: str, where: str) -> bytes:
    """The whole of ``blob``, a file of the snapshot ``where`` whose length nothing records (a
    manifest), read through ``call`` and bounded by ``STATESNAP_MAX_MANIFEST_BYTES``.

    Raises:
        UnsafeSnapshotError: the blob is over the limit, or the plugin refused what the store
            holds at its path (a link, a FIFO, a device).
        FileNotFoundError, NotADirectoryError, ...: the plugin's own errors, as they are (the
            caller tells "no snapshot here" by them).
    """
    limit = knobs.max_manifest_bytes()
    read = lambda: plugin.read_limited(blob, limit)  # noqa: E731
    try:
        return await call(plugin, "read", blob, where, read, convert=False)
    except BlobTooLargeError as e:
        held = f"{e.size} bytes" if e.size is not None else "more bytes"
        raise UnsafeSnapshotError(
            f"snapshot {where}: {plugin.describe(blob)} holds {held}, over the limit of {limit} "
            "bytes (STATESNAP_MAX_MANIFEST_BYTES): refused. To open a snapshot whose manifest "
            "is really that large, set the environment variable STATESNAP_MAX_MANIFEST_BYTES "
            "to a larger number of bytes"
        ) from e
    except UnsafeBlobError as e:
        raise refused(where, e) from e


def refused(where: str, error: UnsafeBlobError) -> UnsafeSnapshotError:
    """The library's error for what a plugin refused to open in the snapshot ``where``."""
    return UnsafeSnapshotError(f"snapshot {where}: {error}")


# ---------------------------------------------------------------------------------------------
# Writes.


# A staged write: the request, its buffers, what to keep alive.
_Staged = tuple[WriteRequest, Sequence[Buffer], object]


class WritePipeline:
    """Stages write requests on the caller's thread and writes them on the I/O loop.

    Call sequence: ``submit`` any number of times on the caller's thread, then either ``finish``
    on that thread, or ``flush`` (on that thread or, once the caller is done submitting, on any
    one thread) and ``await wait()`` on the I/O loop; ``abort`` on failure. ``submit`` blocks
    only while the staging budget is full.

    Staged writes are handed to the I/O loop in batches of ``batch_bytes``, so writing overlaps
    staging. With ``batch_bytes=None`` they are held until ``flush`` (or until the budget is full
    and writes must start to free it): async take stages everything first, so that its writes,
    which compete with the caller for memory bandwidth and cores, start only once the caller is
    free to go.

    The staging budget is a ``ByteBudget`` of ``budget_bytes`` of its own, or ``budget``: a
    ``BudgetShare`` of one that other pipelines charge too (async takes pending at once).
    """

    _BATCH_ITEMS = 256

    def __init__(
        self,
        plugin: StoragePlugin,
        *,
        budget_bytes: int,
        max_concurrency: int,
        batch_bytes: int | None,
        budget: BudgetShare | None = None,
    ) -> None:
        self._plugin = plugin
        self._loop = io_loop()
        self.budget: ByteBudget | BudgetShare = (
            ByteBudget(budget_bytes) if budget is None else budget
        )
        self._batch: list[_Staged] = []
        self._batch_bytes = 0
        self._batch_limit = batch_bytes
        self._error: BaseException | None = None
        self._nbytes = 0
        self._blobs = 0
        # (blob, offset) -> CRC-32 of each range of ``checksum_ranges`` written so far.
        self.checksums: dict[tuple[str, int], int] = {}
        self._start = time.perf_counter()
        self._queue: asyncio.Queue[_Staged | None]
        self._workers: list[asyncio.Task[None]] = []
        self._concurrency = max_concurrency
        self._pid = os.getpid()  # a forked child's copy never touches its parent's loop
        run(self._start_workers())

    async def _start_workers(self) -> None:
        self._queue = asyncio.Queue()
        self._workers = [asyncio.create_task(self._worker()) for _ in range(self._concurrency)]

    async def _worker(self) -> None:
        while True:
            item = await self._queue.get()
            if item is None:
                return
            req, buffers, keepalive = item
            try:
                if self._error is None:
                    await self._write(req, buffers)
            except Exception as e:  # already the library's error (``call`` converts)
                self._fail(e)
            finally:
                # Nothing of the item may outlive its write: an idle worker would otherwise keep
                # its last buffer alive, beyond the budget.
                _release(keepalive)
                del buffers, item, keepalive
                self.budget.release(req.staging_bytes)

    async def _write(self, req: WriteRequest, buffers: Sequence[Buffer]) -> None:
        """Writes one staged request, with the checksums of its ranges when it asks for them."""
        plugin = self._plugin
        ranges = req.checksum_ranges
        if not ranges:
            op = functools.partial(plugin.write, req.blob, buffers)
            await call(plugin, "write", req.blob, req.label, op)
        else:
            values = await call_digesting(
                plugin,
                "write",
                req.blob,
                req.label,
                ranges,
                lambda digest: plugin.write_observed(req.blob, buffers, digest),
            )
            for (offset, _), value in zip(ranges, values, strict=True):
                self.checksums[(req.blob, offset)] = value
        self._nbytes += req.nbytes
        self._blobs += 1

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self.budget.abort(self._error)

    def _enqueue(self, batch: list[_Staged]) -> None:
        for item in batch:
            self._queue.put_nowait(item)

    def flush(self) -> None:
        """Hands what is staged to the I/O loop."""
        if self._batch:
            batch, self._batch, self._batch_bytes = self._batch, [], 0
            self._loop.call_soon_threadsafe(self._enqueue, batch)

    def submit(self, req: WriteRequest) -> None:
        """Stages ``req`` (waiting for budget if needed) and queues its write."""
        if self._error is not None:
            raise self._error
        if not self.budget.try_acquire(req.staging_bytes):
            self.flush()  # what is staged must start writing, or the budget never frees
            self.budget.acquire(req.staging_bytes)
        try:
            buffers, keepalive = req.stage()
        except BaseException:
            self.budget.release(req.staging_bytes)
            raise
        self._batch.append((req, buffers, keepalive))
        self._batch_bytes += req.nbytes
        limit = self._batch_limit
        if limit is not None and (
            self._batch_bytes >= limit or len(self._batch) >= self._BATCH_ITEMS
        ):
            self.flush()

    async def _drain(self) -> None:
        for _ in self._workers:
            self._queue.put_nowait(None)
        await asyncio.gather(*self._workers)

    def _settle_budget(self) -> None:
        close = getattr(self.budget, "close", None)  # a share gives back what it still holds
        if close is not None:
            close()

    async def wait(self) -> IOStats:
        """On the I/O loop, after the last ``submit``: waits until every queued write is done,
        and raises the first error any of them met."""
        await self._drain()
        self._settle_budget()
        if self._error is not None:
            raise self._error
        return IOStats(
            blobs=self._blobs,
            nbytes=self._nbytes,
            seconds=time.perf_counter() - self._start,
            peak_budget_bytes=self.budget.peak,
        )

    async def wait_quietly(self) -> None:
        """Waits for the workers to stop, ignoring errors (after ``abort``)."""
        try:
            await self._drain()
        except Exception:
            logger.debug("error while draining aborted writes", exc_info=True)
        self._settle_budget()

    def finish(self) -> IOStats:
        """From the caller's thread: hands over what is staged, then ``wait``."""
        self.flush()
        return run(self.wait())

    def abort(self, error: BaseException) -> None:
        """Stops writing (what is queued is dropped) and waits for the workers to stop."""
        for req, _, keepalive in self._batch:
            _release(keepalive)
            self.budget.release(req.staging_bytes)  # a shared budget outlives this pipeline
        self._batch = []
        self._loop.call_soon_threadsafe(self._fail, error)
        try:
            run(self._drain())
        except Exception:  # the workers record errors; nothing more to report here
            logger.debug("error while draining aborted writes", exc_info=True)
        self._settle_budget()

    def stop(self, error: BaseException) -> None:
        """Ends a pipeline that nobody will wait for (its take was dropped unfinished): what is
        staged is given back, the workers skip what is queued and end. Otherwise they would wait
        on the queue for ever, and be reported as tasks destroyed while pending when collected
        (at exit at the latest). Waits for them, except on the I/O loop's own thread (a
        collection can run there), where they end on their own. Nothing once drained."""
        if os.getpid() != self._pid or (
            not self._batch and all(worker.done() for worker in self._workers)
        ):
            return
        for req, _, keepalive in self._batch:
            _release(keepalive)
            self.budget.release(req.staging_bytes)
        self._batch = []
        if _loop_thread is not None and threading.current_thread() is _loop_thread.thread:
            _hold(self._loop.create_task(self._wind_down(error)))
            return
        try:
            run(self._wind_down(error))
        except Exception:
            logger.debug("error while ending a dropped write pipeline", exc_info=True)

    async def _wind_down(self, error: BaseException) -> None:
        self._fail(error)
        await self.wait_quietly()


# Tasks nobody awaits, held until done: the loop itself keeps only weak references to tasks.
_held: set[asyncio.Task[Any]] = set()


def _hold(task: asyncio.Task[Any]) -> None:
    _held.add(task)
    task.add_done_callback(_held.discard)


def _release(keepalive: object) -> None:
    """Gives back a staged write's pooled buffer (a ``Lease``), if it has one."""
    release = getattr(keepalive, "release", None)
    if release is not None:
        release()


# ---------------------------------------------------------------------------------------------
# Reads.


async def read_all(
    plugin: StoragePlugin,
    requests: Iterable[ReadRequest],
    *,
    budget_bytes: int,
    max_concurrency: int,
) -> IOStats:
    """Performs every read request on the running loop; the first error stops the rest."""
    budget = ByteBudget(budget_bytes)
    pending = iter(requests)
    totals = [0, 0]
    error: list[BaseException] = []
    start = time.perf_counter()

    async def worker() -> None:
        junk = memoryview(bytearray(0))  # where skipped gaps land; grows to the largest gap
        for req in pending:
            if error:
                return
            try:
                await budget.acquire_async(req.scratch_bytes)
            except BaseException as e:  # the budget was aborted by another worker's error
                if not error:
                    error.append(e)
                return
            try:
                outs = []
                for seg in req.segments:
                    if seg.dest is not None:
                        outs.append(seg.dest())
                    else:
                        if len(junk) < seg.nbytes:
                            junk = memoryview(bytearray(seg.nbytes))
                        outs.append(junk[: seg.nbytes])
                await _read(plugin, req, outs)
                if req.done is not None:
                    req.done()
                totals[0] += 1
                totals[1] += req.nbytes
            except BaseException as e:
                if not error:
                    error.append(e)
                budget.abort(e)
                return
            finally:
                budget.release(req.scratch_bytes)

    await asyncio.gather(*(worker() for _ in range(max_concurrency)))
    if error:
        raise error[0]
    return IOStats(
        blobs=totals[0],
        nbytes=totals[1],
        seconds=time.perf_counter() - start,
        peak_budget_bytes=budget.peak,
    )


async def _read(plugin: StoragePlugin, req: ReadRequest, outs: list[memoryview]) -> None:
    """One read request into ``outs`` (one per segment), then each segment's ``verify`` with
    the CRC-32 of what landed in it."""
    # C-level passes over the segments: a read of a slab has one per member, thousands.
    verifiers = list(map(segment_verify, req.segments))
    if not any(verifiers):
        op = functools.partial(plugin.readv, req.blob, req.offset, outs)
        await call(plugin, "read", req.blob, req.label, op)
        return
    sizes = list(map(segment_bytes, req.segments))
    starts = accumulate(sizes, initial=0)  # one more value than sizes: zip stops first
    ranges = list(compress(zip(starts, sizes, strict=False), verifiers))
    verifiers = list(filter(None, verifiers))
    values = await call_digesting(
        plugin,
        "read",
        req.blob,
        req.label,
        ranges,
        lambda digest: plugin.readv_observed(req.blob, req.offset, outs, digest),
    )
    for verify, value in zip(verifiers, values, strict=True):
        verify(value)


async def call_digesting(
    plugin: StoragePlugin,
    verb: str,
    blob: str,
    label: str,
    ranges: Sequence[tuple[int, int]],
    op: Callable[[checksum.RangeDigest], Awaitable[None]],
    *,
    convert: bool = True,
) -> list[int]:
    """``call`` of a plugin operation that shows its bytes to a digest of ``ranges`` (a new
    one for every attempt, so that a retry starts over); the ranges' CRC-32s."""
    digests: list[checksum.RangeDigest] = []

    def attempt() -> Awaitable[None]:
        digests.append(checksum.RangeDigest(ranges))
        return op(digests[-1])

    await call(plugin, verb, blob, label, attempt, convert=convert)
    return digests[-1].values
