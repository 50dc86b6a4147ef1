"""Byte budgets: how much memory the writes and reads in flight may hold at once.

A ``ByteBudget`` is shared by the caller's thread (which blocks in ``acquire``) and the I/O loop
(whose tasks wait in ``acquire_async``); a ``BudgetShare`` is one write pipeline's part of a
budget that several pipelines charge (the staging pool's, for async takes pending at once).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable

logger = logging.getLogger(__name__)


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
    """One write pipeline's part of a ``ByteBudget`` that several share (the staging pool's:
    async takes pending at once stage at most one budget together).

    Bytes are charged to the shared budget and counted here too (a pipeline's peak and leftover
    are its own); ``abort`` fails only this share's waiters (one take's write error must not
    fail the next take's staging).
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
