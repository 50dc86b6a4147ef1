"""Background work: AsyncRequest and AsyncCallsQueue, and PendingSnapshot on top of them."""

from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from snapshot.errors import InvalidArgumentError, SnapshotError

if TYPE_CHECKING:
    from snapshot.snapshot import Snapshot

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AsyncRequest:
    """Work to run in the background, and what to run once it is done.

    ``async_fn(*async_fn_args)`` runs on the queue's background thread; ``finalize_fns`` run
    afterwards, in order, on the thread that finalizes the call (the caller's), only if
    ``async_fn`` succeeded. A request is frozen once scheduled.
    """

    async_fn: Callable[..., Any] | None
    async_fn_args: tuple[Any, ...] = ()
    finalize_fns: tuple[Callable[[], Any], ...] = ()
    is_frozen: bool = False

    def add_finalize_fn(self, fn: Callable[[], Any]) -> AsyncRequest:
        """A request that also runs ``fn`` when finalized (requests are immutable)."""
        if self.is_frozen:
            raise SnapshotError("cannot add a finalize function to a request already scheduled")
        return dataclasses.replace(self, finalize_fns=(*self.finalize_fns, fn))

    def execute_sync(self) -> Any:
        """Runs the request in the calling thread: the work, then its finalize functions."""
        result = self.async_fn(*self.async_fn_args) if self.async_fn is not None else None
        for fn in self.finalize_fns:
            fn()
        return result

    def freeze(self) -> AsyncRequest:
        return dataclasses.replace(self, is_frozen=True)


@dataclass
class _Call:
    index: int
    request: AsyncRequest
    future: Future[Any] = field(repr=False)


class AsyncCallsQueue:
    """Runs scheduled requests one at a time, in the order scheduled, on one background thread,
    and finalizes finished ones when asked.

    One thread means the calls' work never overlaps, so a later snapshot's commit always follows
    an earlier one's.
    """

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="statesnap-async")
        self._calls: deque[_Call] = deque()
        self._next = 0
        self._lock = threading.Lock()

    def schedule_async_request(self, request: AsyncRequest) -> int:
        """Starts ``request`` in the background; returns its call index."""
        request = request.freeze()
        with self._lock:
            index = self._next
            self._next += 1
            fn = request.async_fn or (lambda *_: None)
            future = self._executor.submit(fn, *request.async_fn_args)
            self._calls.append(_Call(index, request, future))
        return index

    def future(self, index: int) -> Future[Any]:
        """The future of an unfinalized call."""
        with self._lock:
            for call in self._calls:
                if call.index == index:
                    return call.future
        raise KeyError(f"no unfinalized call {index}")

    def maybe_finalize_async_calls(
        self, blocking: bool = False, up_to: int | None = None
    ) -> list[int]:
        """Finalizes finished calls, oldest first, stopping at the first unfinished one (or,
        when ``blocking``, waiting for it), and after call ``up_to`` when given.

        Returns the indices finalized. A call whose work failed is removed, and its error raised
        (as a ``SnapshotError``, the original chained) after the calls before it are finalized.
        """
        done: list[int] = []
        while True:
            with self._lock:
                if not self._calls:
                    return done
                call = self._calls[0]
                if up_to is not None and call.index > up_to:
                    return done
                if not blocking and not call.future.done():
                    return done
            try:
                call.future.result()
            except BaseException as e:
                with self._lock:
                    self._calls.popleft()
                if isinstance(e, SnapshotError):
                    raise
                raise SnapshotError(
                    f"async call {call.index} failed: {type(e).__name__}: {e}"
                ) from e
            with self._lock:
                self._calls.popleft()
            for fn in call.request.finalize_fns:
                fn()
            done.append(call.index)

    def get_num_unfinalized_calls(self) -> int:
        with self._lock:
            return len(self._calls)

    def close(self) -> None:
        """Waits for every call and finalizes it; errors are logged."""
        while self.get_num_unfinalized_calls():
            try:
                self.maybe_finalize_async_calls(blocking=True)
            except SnapshotError:
                logger.exception("an async call failed")
        self._executor.shutdown(wait=True)


_queue: AsyncCallsQueue | None = None
_queue_lock = threading.Lock()


def default_queue() -> AsyncCallsQueue:
    """The process's queue for async snapshots; the process waits for it before exiting."""
    global _queue
    with _queue_lock:
        if _queue is None:
            _queue = AsyncCallsQueue()
            _wait_at_exit(_queue)
        return _queue


def _wait_at_exit(queue: AsyncCallsQueue) -> None:
    """Makes interpreter exit wait until ``queue``'s snapshots are committed (or failed).

    It must run before concurrent.futures refuses new work at exit (every thread pool does then,
    the storage plugins' included), which ``atexit`` handlers run too late for. The thread-exit
    hooks that concurrent.futures itself uses run last-registered first, and this one is
    registered after concurrent.futures', so it runs first.
    """

    def drain() -> None:
        if queue.get_num_unfinalized_calls():
            logger.info(
                "waiting for %d pending snapshot(s) before exiting",
                queue.get_num_unfinalized_calls(),
            )
        queue.close()

    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(drain)
    else:  # pragma: no cover - CPython has had the hook since 3.9
        atexit.register(drain)


class PendingSnapshot:
    """Returned by :meth:`Snapshot.async_take`: the state is captured, the writes go on.

    Snapshots pending at once commit in the order they were taken. When the process exits, it
    first waits for pending snapshots to commit (or fail); a process killed outright leaves its
    pending snapshot uncommitted (``Snapshot(path)`` says it is incomplete), never
    half-committed.
    """

    def __init__(
        self,
        path: str,
        pg: Any | None,
        storage_options: dict[str, Any] | None,
        queue: AsyncCallsQueue,
        index: int,
    ) -> None:
        self.path = path
        self._pg = pg
        self._storage_options = storage_options
        self._queue = queue
        self._index = index
        self._future = queue.future(index)
        self._snapshot: Snapshot | None = None

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"PendingSnapshot(path={self.path!r}, {state})"

    def __del__(self) -> None:
        future = getattr(self, "_future", None)
        if future is not None and not future.done():
            logger.warning(
                "PendingSnapshot for %s was garbage-collected before it finished; the snapshot "
                "is still being written and will commit (or fail) in the background, but "
                "nobody will see an error: keep the handle and call wait()",
                self.path,
            )

    def done(self) -> bool:
        """Whether the background work has finished (committed or failed). Never blocks."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> Snapshot:
        """Blocks until the snapshot is committed and returns it.

        Raises:
            SnapshotError: the background work failed (the SnapshotError it raised, or one with
                the original error chained); nothing was committed.
            TimeoutError: ``timeout`` seconds passed first; the work goes on.
            InvalidArgumentError: ``timeout`` is not None or a number of seconds >= 0.
        """
        from snapshot.snapshot import Snapshot

        # A bool is an int to Python, and NaN compares false with everything: both refused.
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0
        ):
            raise InvalidArgumentError(
                f"PendingSnapshot.wait of {self.path}: timeout must be None or a number of "
                f"seconds >= 0, got {timeout!r}"
            )

        if self._snapshot is not None:
            return self._snapshot
        try:
            manifest = self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"snapshot {self.path} still pending after {timeout} s") from None
        except Exception as e:
            # The error is raised here, to its owner: the queue forgets the call (so that it
            # is not reported again at exit).
            self._finalize_through_me()
            if isinstance(e, SnapshotError):
                raise
            raise SnapshotError(
                f"async snapshot {self.path} failed: {type(e).__name__}: {e}"
            ) from e
        self._finalize_through_me()
        self._snapshot = Snapshot(self.path, self._pg, self._storage_options, _manifest=manifest)
        return self._snapshot

    def _finalize_through_me(self) -> None:
        """Finalizes the queue's calls up to this one; earlier failures belong to their own
        handles, so they are logged here, not raised."""
        while True:
            try:
                self._queue.maybe_finalize_async_calls(blocking=True, up_to=self._index)
                return
            except SnapshotError:
                logger.debug("an earlier async snapshot failed", exc_info=True)
