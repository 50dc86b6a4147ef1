"""The process-wide state of the library, in one object, and its one shutdown path.

``get()`` is the process's ``Runtime``, made on first use (and made anew in a forked child: a
child shares none of its parent's threads, so it starts with state of its own). It owns:

- the I/O loop: one event loop on a background thread ("statesnap-io") that every storage call
  runs on, so that callers need no loop of their own and can call the library from inside one
  (``io_loop``: ``run``, ``spawn``, ``join``);
- the tasks nobody awaits (a dropped write pipeline winding down), held until done: the loop
  itself keeps only weak references to its tasks;
- the storage plugins kept open between operations (``kept``);
- the queue that runs async takes' background work in order (``queue``);
- the staging pool and budget of async take (``staging_pool``);
- the gloo groups the library coordinates on, per caller group (``gloo_groups``, ``dist``),
  and the process's heartbeat that lets its peers tell it alive (``heartbeat``, ``liveness``);
- the threads that digest payloads for replication (``digest_pool``).

At exit, one hook (``shutdown``) waits for the pending async takes, ends the tasks left on the
loop, closes the kept plugins and stops the loop, in that order.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from snapshot._engine.dist.liveness import Heartbeat
from snapshot._engine.io.async_queue import AsyncCallsQueue
from snapshot._engine.io.kept import KeptPlugins
from snapshot._engine.io.staging import StagingPool

if TYPE_CHECKING:
    from snapshot.options import Options

logger = logging.getLogger(__name__)


class LoopThread:
    """An event loop running for ever on a daemon thread of its own."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name="statesnap-io", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()


class Runtime:
    """The library's process-wide state (see the module). Every part is made on first use."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._lock = threading.Lock()
        self._loop: LoopThread | None = None
        self._queue: AsyncCallsQueue | None = None
        self._pool: StagingPool | None = None
        self._digests: ThreadPoolExecutor | None = None
        self._copier: ThreadPoolExecutor | None = None
        self._shut_down = False
        # Touched on the I/O loop only.
        self.kept = KeptPlugins()
        self.held: set[asyncio.Task[Any]] = set()
        # Per caller group (by id, holding the group so the id stays its own) and use
        # (background or not), the gloo group the library coordinates on.
        self.gloo_groups: dict[tuple[int, bool], tuple[Any, Any, Any]] = {}
        self._heartbeat: Heartbeat | None = None

    # -- the I/O loop ----------------------------------------------------------------------

    def loop(self) -> asyncio.AbstractEventLoop:
        """The I/O loop, started on first use (and again if it was stopped: an operation run
        after ``shutdown``, by an exit hook of the application's, still runs)."""
        with self._lock:
            if self._loop is None or not self._loop.thread.is_alive():
                self._loop = LoopThread()
            return self._loop.loop

    def on_loop_thread(self) -> bool:
        """Whether the calling thread is the I/O loop's."""
        return self._loop is not None and threading.current_thread() is self._loop.thread

    def _live_loop(self) -> LoopThread | None:
        loop = self._loop
        return loop if loop is not None and loop.thread.is_alive() else None

    def hold(self, task: asyncio.Task[Any]) -> None:
        """Keeps ``task`` (on the I/O loop, that nobody awaits) alive until it is done."""
        self.held.add(task)
        task.add_done_callback(self.held.discard)

    @property
    def keeps_plugins(self) -> bool:
        """Whether plugins may be kept open after an operation (not once shut down: nothing
        would close them)."""
        return not self._shut_down

    # -- the parts made on first use -------------------------------------------------------

    def queue(self) -> AsyncCallsQueue:
        """The queue for async snapshots; the process waits for it before exiting."""
        with self._lock:
            if self._queue is None:
                self._queue = AsyncCallsQueue()
            return self._queue

    def staging_pool(self, options: Options) -> StagingPool:
        """The staging pool, made keeping up to ``options.budget()`` of free blocks; its
        ``budget`` is the staging budget every async take of the process shares (each take
        sets it to its own budget, ``StagingPool.share``)."""
        with self._lock:
            if self._pool is None:
                self._pool = StagingPool(keep_bytes=options.budget())
            return self._pool

    def heartbeat(self, global_rank: int, rank_timeout: float) -> Heartbeat:
        """This process's heartbeat, started on first use, beating often enough for
        ``rank_timeout``."""
        with self._lock:
            if self._heartbeat is None:
                self._heartbeat = Heartbeat(global_rank, rank_timeout)
            else:
                self._heartbeat.tighten(rank_timeout)
            return self._heartbeat

    def copier(self) -> ThreadPoolExecutor:
        """The thread that runs async take's copies of large host tensors into staging
        buffers while the caller stages the rest (``stage._Pooled``)."""
        with self._lock:
            if self._copier is None:
                self._copier = ThreadPoolExecutor(1, thread_name_prefix="statesnap-stage")
            return self._copier

    def digest_pool(self, threads: int) -> ThreadPoolExecutor:
        """The threads that digest payloads (replication), ``threads`` of them."""
        with self._lock:
            if self._digests is None:
                self._digests = ThreadPoolExecutor(threads, thread_name_prefix="statesnap-digest")
            return self._digests

    # -- shutdown --------------------------------------------------------------------------

    def close_kept_plugins(self) -> None:
        """Closes every plugin kept open for a next operation."""
        loop = self._live_loop()
        if loop is not None and len(self.kept):
            asyncio.run_coroutine_threadsafe(self.kept.close_all(), loop.loop).result()

    def end_leftover_tasks(self, timeout: float = 5.0) -> None:
        """Cancels the tasks still pending on the I/O loop, and waits ``timeout`` seconds at
        most for them to end. The loop's thread is a daemon, stopped mid-step when the
        interpreter ends, and a task still pending then is destroyed with a warning on
        stderr; at exit the pending snapshots have been waited for by then, so what is left
        belongs to nobody."""
        loop = self._live_loop()
        if loop is None:
            return

        async def end_all() -> None:
            me = asyncio.current_task()
            left = [task for task in asyncio.all_tasks() if task is not me]
            for task in left:
                task.cancel()
            if left:
                await asyncio.wait(left, timeout=timeout)

        asyncio.run_coroutine_threadsafe(end_all(), loop.loop).result(timeout + 1)

    def stop_loop(self, timeout: float = 5.0) -> None:
        """Stops the I/O loop and waits ``timeout`` seconds at most for its thread to end."""
        with self._lock:
            loop, self._loop = self._loop, None
        if loop is None or not loop.thread.is_alive():
            return
        loop.loop.call_soon_threadsafe(loop.loop.stop)
        loop.thread.join(timeout)
        if not loop.thread.is_alive():
            loop.loop.close()

    def shutdown(self) -> None:
        """Waits for the pending async takes (committed or failed), ends the tasks left on the
        I/O loop, closes the kept plugins, stops the loop. Each step's failure is logged, and
        the next steps run all the same. (The digest and copier threads are idle by then:
        concurrent.futures ends them, as it ends every thread pool's, when the process exits.)"""
        self._shut_down = True
        queue = self._queue
        if queue is not None:
            _step("wait for the pending snapshots", lambda: _drain(queue))
        if self._heartbeat is not None:  # after the pending snapshots: they agree with peers
            _step("stop the heartbeat", self._heartbeat.stop)
        _step("end the I/O loop's leftover tasks", self.end_leftover_tasks)
        _step("close the kept storage plugins", self.close_kept_plugins)
        _step("stop the I/O loop", self.stop_loop)


def _drain(queue: AsyncCallsQueue) -> None:
    if queue.get_num_unfinalized_calls():
        logger.info(
            "waiting for %d pending snapshot(s) before exiting",
            queue.get_num_unfinalized_calls(),
        )
    queue.close()


def _step(what: str, fn: Any) -> None:
    try:
        fn()
    except Exception:
        logger.warning("at exit: could not %s", what, exc_info=True)


_runtime: Runtime | None = None
_runtime_lock = threading.Lock()
_hook_registered = False


def get() -> Runtime:
    """The process's runtime, made on first use (and in a forked child, on its first use
    there)."""
    runtime = _runtime
    if runtime is not None and runtime.pid == os.getpid():
        return runtime
    return _make()


def _make() -> Runtime:
    global _runtime
    with _runtime_lock:
        if _runtime is None or _runtime.pid != os.getpid():
            _runtime = Runtime()
            _register_exit_hook()
        return _runtime


def _at_exit() -> None:
    runtime = _runtime
    if runtime is not None and runtime.pid == os.getpid():
        runtime.shutdown()


def _register_exit_hook() -> None:
    """Registers ``_at_exit`` once per process (a forked child inherits its parent's).

    It must run before concurrent.futures refuses new work at exit (every thread pool does
    then, the storage plugins' included, and the pending snapshots still need them), which
    ``atexit`` handlers run too late for. The thread-exit hooks that concurrent.futures itself
    uses run last-registered first, and this one is registered after concurrent.futures' (this
    module imports it), so it runs first; and before every ``atexit`` handler, the
    application's included.
    """
    global _hook_registered
    if _hook_registered:
        return
    _hook_registered = True
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is None:  # pragma: no cover - CPython has had the hook since 3.9
            raise RuntimeError("no thread-exit hook")
        register(_at_exit)
    except RuntimeError:  # first used while the interpreter is already exiting
        atexit.register(_at_exit)


@contextlib.contextmanager
def use(runtime: Runtime | None = None) -> Iterator[Runtime]:
    """Makes ``runtime`` (a new one by default) the process's for the block, shuts it down at
    the end of the block and puts the previous one back: state of its own for a test."""
    global _runtime
    runtime = runtime if runtime is not None else Runtime()
    get()  # the exit hook is registered, and there is a previous runtime to put back
    with _runtime_lock:
        previous, _runtime = _runtime, runtime
    try:
        yield runtime
    finally:
        with _runtime_lock:
            _runtime = previous
        runtime.shutdown()
