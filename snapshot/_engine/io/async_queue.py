"""Background work: ``AsyncRequest`` (work, and what to run once it is done) and
``AsyncCallsQueue`` (runs requests one at a time, in order, on one thread). Async take hands its
commit to the process's queue; the strategy API's ``async_save`` returns an ``AsyncRequest``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from snapshot.errors import SnapshotError
from storage_plugins.base import DaemonThreadPool

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AsyncRequest:
    """``async_fn(*async_fn_args)`` to run in the background, then, if it succeeded,
    ``finalize_fns`` in order on the thread that finalizes the call. Frozen once scheduled."""

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


class AsyncCallsQueue:
    """Runs scheduled requests one at a time, in order, on one background thread (a later
    snapshot's commit always follows an earlier one's), and finalizes finished ones when asked.
    """

    def __init__(self) -> None:
        self._executor = DaemonThreadPool(1, thread_name_prefix="statesnap-async")
        self._calls: deque[tuple[int, AsyncRequest, Future[Any]]] = deque()  # unfinalized
        self._next = 0
        self._lock = threading.Lock()

    def schedule_async_request(self, request: AsyncRequest) -> int:
        """Starts ``request`` in the background; returns its call index."""
        request = request.freeze()
        fn = request.async_fn or (lambda *_: None)
        with self._lock:
            index, self._next = self._next, self._next + 1
            self._calls.append((index, request, self._executor.submit(fn, *request.async_fn_args)))
        return index

    def future(self, index: int) -> Future[Any]:
        """The future of an unfinalized call."""
        with self._lock:
            for i, _, future in self._calls:
                if i == index:
                    return future
        raise KeyError(f"no unfinalized call {index}")

    def maybe_finalize_async_calls(
        self, blocking: bool = False, up_to: int | None = None
    ) -> list[int]:
        """Finalizes finished calls, oldest first, stopping at the first unfinished one (or,
        when ``blocking``, waiting for it) and after call ``up_to``; returns their indices. A
        call whose work failed is removed, and its error raised as a ``SnapshotError``."""
        done: list[int] = []
        while True:
            with self._lock:
                if not self._calls:
                    return done
                index, request, future = self._calls[0]
                if (up_to is not None and index > up_to) or not (blocking or future.done()):
                    return done
            try:
                future.result()
            except SnapshotError:
                raise
            except BaseException as e:
                raise SnapshotError(f"async call {index} failed: {type(e).__name__}: {e}") from e
            finally:
                with self._lock:
                    self._calls.popleft()
            for fn in request.finalize_fns:
                fn()
            done.append(index)

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
