"""The process-wide state of the library, in one object, its one shutdown path, and what
surrounds every operation (the I/O loop, errors naming their snapshot, the paused collector,
the byte budgets).

``get()`` is the process's ``Runtime``, made on first use (and anew in a forked child: a child
shares none of its parent's threads); each of its parts is made on first use too. The I/O loop
is one event loop on a daemon thread ("statesnap-io") that every storage call runs on
(``run``), so callers need no loop of their own and may call the library from inside one.

At exit one ``atexit`` hook (``Runtime.shutdown``) waits for the pending async takes, then shuts
the rest down. It runs after ``concurrent.futures`` has shut the standard thread pools down, so
every pool the pending takes' I/O uses, the loop's default executor included, is a
``storage_plugins.base.DaemonThreadPool``, which keeps working.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import gc
import json
import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Coroutine, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from snapshot._engine.dist.liveness import Heartbeat, interval
from snapshot._engine.format.text import printable_message
from snapshot._engine.io.async_queue import AsyncCallsQueue
from snapshot.errors import RankFailedError, SnapshotError
from storage_plugins import StoragePlugin
from storage_plugins.base import DaemonThreadPool

if TYPE_CHECKING:
    from snapshot._engine.io.staging import StagingPool

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class Runtime:
    """The library's process-wide state (see the module). Every part is made on first use."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.lock = threading.Lock()  # guards the parts made on first use
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._queue: AsyncCallsQueue | None = None
        self.pool: StagingPool | None = None  # set by ``staging.process_pool``, under ``lock``
        self._digests: DaemonThreadPool | None = None
        self._copier: DaemonThreadPool | None = None
        self._stager: DaemonThreadPool | None = None
        self._heartbeat: Heartbeat | None = None
        # Whether plugins may be kept open after an operation (not once shut down: nothing
        # would close them).
        self.keeps_plugins = True
        # Touched on the I/O loop only.
        self.kept = KeptPlugins()
        # Per caller group (by id, holding the group so the id stays its own) and use
        # (background or not), the gloo group the library coordinates on.
        self.gloo_groups: dict[tuple[int, bool], tuple[Any, Any, Any]] = {}

    def loop(self) -> asyncio.AbstractEventLoop:
        """The I/O loop, started on first use (and again if it was stopped: an operation run
        after ``shutdown``, by an exit hook of the application's, still runs)."""
        with self.lock:
            if self._loop is None or self._thread is None or not self._thread.is_alive():
                loop = self._loop = asyncio.new_event_loop()
                loop.set_default_executor(DaemonThreadPool(thread_name_prefix="statesnap-blocking"))
                self._thread = threading.Thread(
                    target=_run_forever, args=(loop,), name="statesnap-io", daemon=True
                )
                self._thread.start()
            return self._loop

    def queue(self) -> AsyncCallsQueue:
        """The queue for async snapshots; the process waits for it before exiting."""
        with self.lock:
            if self._queue is None:
                self._queue = AsyncCallsQueue()
            return self._queue

    def heartbeat(self, global_rank: int, rank_timeout: float) -> Heartbeat:
        """This process's heartbeat, started on first use, beating often enough for
        ``rank_timeout``."""
        with self.lock:
            if self._heartbeat is None:
                self._heartbeat = Heartbeat(global_rank, rank_timeout)
            self._heartbeat.every = min(self._heartbeat.every, interval(rank_timeout))
            return self._heartbeat

    def copier(self) -> DaemonThreadPool:
        """The thread that copies an async take's large host tensors into their pooled
        buffers while the caller plans the rest (``io/staging.py``)."""
        with self.lock:
            if self._copier is None:
                self._copier = DaemonThreadPool(1, thread_name_prefix="statesnap-stage")
            return self._copier

    def stager(self) -> DaemonThreadPool:
        """The thread that stages the async takes asked to stage in the background, one after
        the other (``take/guard.py``): started once, so a call does not wait for a new thread
        to start."""
        with self.lock:
            if self._stager is None:
                self._stager = DaemonThreadPool(1, thread_name_prefix="statesnap-staging")
            return self._stager

    def digest_pool(self, threads: int) -> DaemonThreadPool:
        """The threads that digest payloads (replication), ``threads`` of them."""
        with self.lock:
            if self._digests is None:
                self._digests = DaemonThreadPool(threads, thread_name_prefix="statesnap-digest")
            return self._digests

    def stop_loop(self) -> None:
        """Stops the I/O loop and waits 5 s at most for its thread to end."""
        with self.lock:
            loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is None or thread is None or not thread.is_alive():
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5.0)
        if not thread.is_alive():
            loop.close()

    def shutdown(self) -> None:
        """Waits for the pending async takes, ends the tasks left on the I/O loop (each would
        otherwise be destroyed with a warning at exit), closes the kept plugins, stops the
        loop; a step that fails is logged, and the next ones run."""
        self.keeps_plugins = False
        queue = self._queue
        if queue is not None:
            _step("wait for the pending snapshots", lambda: _drain(queue))
        pool = self.pool
        if pool is not None:  # after the pending snapshots: their writes hold its blocks
            # Pinned blocks go back through torch's host cache (only a GPU run proves it).
            _step("release the staging memory", pool.close)
        if self._heartbeat is not None:  # after the pending snapshots: they agree with peers
            _step("stop the heartbeat", self._heartbeat.stopped.set)
        loop = self._loop
        if loop is not None and self._thread is not None and self._thread.is_alive():
            for what, work in (
                ("end the I/O loop's leftover tasks", _end_all),
                ("close the kept storage plugins", self.kept.close_all),
            ):
                _step(what, asyncio.run_coroutine_threadsafe(work(), loop).result)
        _step("stop the I/O loop", self.stop_loop)


def _run_forever(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    loop.run_forever()


async def _end_all() -> None:
    """Cancels the other tasks of the running loop and waits 5 s at most for them to end."""
    me = asyncio.current_task()
    left = [task for task in asyncio.all_tasks() if task is not me]
    for task in left:
        task.cancel()
    if left:
        await asyncio.wait(left, timeout=5.0)


def _drain(queue: AsyncCallsQueue) -> None:
    if pending := queue.get_num_unfinalized_calls():
        logger.info("waiting for %d pending snapshot(s) before exiting", pending)
    queue.close()


def _step(what: str, fn: Callable[[], object]) -> None:
    try:
        fn()
    except Exception:
        logger.warning("at exit: could not %s", what, exc_info=True)


_runtime: Runtime | None = None
_runtime_lock = threading.Lock()
_hooked_pid = 0


def get() -> Runtime:
    """The process's runtime, made on first use (and in a forked child, on its first use
    there)."""
    global _runtime, _hooked_pid
    runtime = _runtime
    if runtime is not None and runtime.pid == os.getpid():
        return runtime
    with _runtime_lock:
        if _runtime is None or _runtime.pid != os.getpid():
            _runtime = Runtime()
            if _hooked_pid != os.getpid():  # a forked child inherits its parent's hook
                _hooked_pid = os.getpid()
                atexit.register(_at_exit)
        return _runtime


def _at_exit() -> None:
    runtime = _runtime
    if runtime is not None and runtime.pid == os.getpid():
        runtime.shutdown()


@contextlib.contextmanager
def use(runtime: Runtime | None = None) -> Iterator[Runtime]:
    """Makes ``runtime`` (a new one by default) the process's for the block, then shuts it down
    and puts the previous one back: state of its own for a test. It is still the process's while
    it shuts down: the pending snapshots it waits for finish on its own I/O loop."""
    global _runtime
    runtime = runtime if runtime is not None else Runtime()
    get()  # the exit hook is registered, and there is a previous runtime to put back
    with _runtime_lock:
        previous, _runtime = _runtime, runtime
    try:
        yield runtime
    finally:
        try:
            runtime.shutdown()
        finally:
            with _runtime_lock:
                _runtime = previous


# ---------------------------------------------------------------------------------------------
# Running work on the I/O loop.


def io_loop() -> asyncio.AbstractEventLoop:
    """The library's event loop, started on first use (and again in a forked child)."""
    return get().loop()


def run(coro: Coroutine[Any, Any, _T]) -> _T:
    """Runs ``coro`` on the I/O loop and waits for its result, from any thread but the loop's."""
    rt = get()
    loop = rt.loop()
    if threading.current_thread() is rt._thread:
        coro.close()
        raise RuntimeError("snapshot I/O called from the I/O loop itself; this would deadlock")
    future = asyncio.run_coroutine_threadsafe(coro, loop)
    try:
        return future.result()
    except BaseException:
        future.cancel()  # KeyboardInterrupt in the caller: stop the work, don't leave it running
        raise


# ---------------------------------------------------------------------------------------------
# Storage plugins kept open between operations.

# (url, storage options as canonical JSON)
Key = tuple[str, str]


def key_of(url: str, storage_options: dict[str, Any] | None) -> Key | None:
    """The key a plugin for ``url`` and ``storage_options`` is kept under; None for options that
    are objects (a session, a callback): those are not compared, so their plugins are not
    kept."""
    try:
        options = json.dumps(storage_options or {}, sort_keys=True)
    except (TypeError, ValueError):
        return None
    return (url, options)


async def close_quietly(plugin: StoragePlugin) -> None:
    """Closes ``plugin``, logging (not raising) an error: nothing depends on it any more."""
    try:
        await plugin.close()
    except Exception as e:
        logger.warning("closing storage plugin %r failed: %s: %s", plugin, type(e).__name__, e)


class KeptPlugins:
    """The plugins kept open, by key, each with the timer that closes it (on the I/O loop only):
    a plugin whose class sets ``keep_open`` (S3's client is expensive to make) is kept after a
    successful operation for the next one on the same URL and storage options."""

    def __init__(self) -> None:
        self._kept: dict[Key, tuple[StoragePlugin, asyncio.TimerHandle]] = {}

    def __len__(self) -> int:
        return len(self._kept)

    async def reclaim(self, key: Key) -> StoragePlugin | None:
        """The plugin kept under ``key``, taken out of the table (it forgets what it learned
        about the store: the next operation may find it changed); None when there is none."""
        kept = self._kept.pop(key, None)
        if kept is None:
            return None
        plugin, timer = kept
        timer.cancel()
        plugin.forget()
        return plugin

    async def keep(self, key: Key, plugin: StoragePlugin, secs: float) -> None:
        """Keeps ``plugin`` under ``key`` for ``secs`` seconds, then closes it."""
        previous = self._kept.pop(key, None)
        if previous is not None:  # two operations on one path at once: keep the later one
            previous[1].cancel()
            await close_quietly(previous[0])
        loop = asyncio.get_running_loop()
        timer = loop.call_later(secs, lambda: loop.create_task(self._expire(key, plugin)))
        self._kept[key] = (plugin, timer)

    async def _expire(self, key: Key, plugin: StoragePlugin) -> None:
        kept = self._kept.get(key)
        if kept is not None and kept[0] is plugin:
            del self._kept[key]
            await close_quietly(plugin)

    async def close_all(self) -> None:
        """Closes every plugin kept open (at exit, or to release them now)."""
        while self._kept:
            _, (plugin, timer) = self._kept.popitem()
            timer.cancel()
            await close_quietly(plugin)


# ---------------------------------------------------------------------------------------------
# What surrounds an operation.


@contextlib.contextmanager
def naming_snapshot(where: str) -> Iterator[None]:
    """Errors about an entry (which name its logical path) also name the snapshot they were
    met in."""
    try:
        yield
    except SnapshotError as e:
        if isinstance(e, RankFailedError):
            raise
        text = str(e)
        named = text if where in text else f"snapshot {where}: {text}"
        # Escaped: a traceback or a log line shows a hostile key's control characters (from
        # the manifest) instead of obeying them.
        shown = printable_message(named)
        if shown == text:
            raise
        raise type(e)(shown) from e.__cause__


_gc_lock = threading.Lock()
_gc_depth = 0
_gc_was_enabled = False


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pauses the cyclic garbage collector while a phase builds many small acyclic objects
    (planning or decoding 100,000 entries), which would otherwise trigger full collections of
    every object of the process; it resumes, as it was, when the last overlapping phase (any
    thread) ends."""
    global _gc_depth, _gc_was_enabled
    with _gc_lock:
        if _gc_depth == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_depth += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_depth -= 1
            if _gc_depth == 0 and _gc_was_enabled:
                gc.enable()


# ---------------------------------------------------------------------------------------------
# Byte budgets: how much memory the writes and reads in flight may hold at once.


class ByteBudget:
    """Bytes of memory that may be held at once, shared by the caller's thread and the I/O loop.

    A request larger than the whole budget is admitted when nothing else is held, so it runs
    alone rather than never. ``abort`` wakes every waiter with an error.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.used = 0  # the bytes held now
        self.peak = 0  # the most bytes held at once so far
        self._cond = threading.Condition()
        self._async_waiters: deque[tuple[int, asyncio.AbstractEventLoop, asyncio.Future[None]]] = (
            deque()
        )
        self._error: BaseException | None = None

    def _fits(self, n: int) -> bool:
        return self.used == 0 or self.used + n <= self.capacity

    def _take(self, n: int) -> None:
        self.used += n
        self.peak = max(self.peak, self.used)

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
        with self._cond:  # (reentrant: ``try_acquire`` takes it too)
            if self.try_acquire(n):
                return
            loop = asyncio.get_running_loop()
            future: asyncio.Future[None] = loop.create_future()
            self._async_waiters.append((n, loop, future))
        await future

    def release(self, n: int) -> None:
        with self._cond:
            self.used -= n
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
    """One write pipeline's part of a ``ByteBudget`` that several share (the staging pool's:
    async takes pending at once stage at most one budget together).

    Bytes are charged to the shared budget and counted here too (a pipeline's peak and leftover
    are its own); ``abort`` fails only this share's waiters (one take's write error must not
    fail the next take's staging).
    """

    def __init__(self, shared: ByteBudget) -> None:
        self.shared = shared
        self._used = 0
        self.peak = 0  # the most bytes this share held at once
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    def _took(self, n: int) -> None:
        with self._lock:
            self._used += n
            self.peak = max(self.peak, self._used)

    def try_acquire(self, n: int) -> bool:
        if self._error is not None:
            raise self._error
        if not self.shared.try_acquire(n):
            return False
        self._took(n)
        return True

    def acquire(self, n: int) -> None:
        """Blocks until ``n`` bytes fit in the shared budget (one larger than the whole budget,
        when nothing is held: the caller flushes its own writes first)."""
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
