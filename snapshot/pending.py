"""``PendingSnapshot``: what :meth:`Snapshot.async_take` returns while the writes go on (on
the process's queue, ``snapshot._engine.io.async_queue``, in the order they were taken)."""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from snapshot.errors import InvalidArgumentError, SnapshotError

if TYPE_CHECKING:
    from snapshot._engine.io.async_queue import AsyncCallsQueue
    from snapshot._engine.take.guard import StagingGuard
    from snapshot.snapshot import Snapshot

logger = logging.getLogger(__name__)


class PendingSnapshot:
    """Returned by :meth:`Snapshot.async_take`: the state is captured, the writes go on.

    Pending snapshots commit in the order they were taken; the process waits for them at exit.
    One killed outright leaves its snapshot uncommitted, never half-committed. ``opened``
    turns the committed manifest into the :class:`Snapshot` that ``wait`` returns. A
    ``progress`` given to ``async_take`` goes on reporting the writes until they end.

    Made by ``async_take``, not by hand: ``path`` is the snapshot's, ``queue`` the process's
    queue of pending takes and ``index`` this take's place in it; ``guard`` the hooks and the
    event of a take staged in the background (``stage_in_background``), else None.
    """

    def __init__(
        self,
        path: str,
        queue: AsyncCallsQueue,
        index: int,
        opened: Callable[[Any], Snapshot],
        guard: StagingGuard | None = None,
    ) -> None:
        self.path = path
        self._guard = guard  # background staging's (``stage_in_background``)
        self._opened = opened
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
            SnapshotError: the background work failed; nothing was committed.
            TimeoutError: ``timeout`` seconds passed first; the work goes on.
            InvalidArgumentError: ``timeout`` is not None or a number of seconds >= 0.
        """
        self._check_timeout("wait", timeout)
        if self._snapshot is not None:
            return self._snapshot
        try:
            manifest = self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"snapshot {self.path} still pending after {timeout} s") from None
        except Exception as e:
            # Raised here, to its owner: the queue forgets the call (not reported at exit).
            self._finalize_through_me()
            if isinstance(e, SnapshotError):
                raise
            raise SnapshotError(
                f"async snapshot {self.path} failed: {type(e).__name__}: {e}"
            ) from e
        self._finalize_through_me()
        self._snapshot = self._opened(manifest)
        return self._snapshot

    def wait_staged(self, timeout: float | None = None) -> None:
        """Blocks until every tensor of the state is copied into staging memory: from then on
        the state may change. Call it before changing in place what no hook of
        ``stage_in_background`` holds (a :class:`StateDict`'s tensors, an object's state);
        returns at once otherwise (``async_take`` staged before it returned).

        Raises:
            SnapshotError: staging failed (``wait`` raises it too); nothing will be committed.
            TimeoutError: ``timeout`` seconds passed first; staging goes on.
            InvalidArgumentError: ``timeout`` is not None or a number of seconds >= 0.
        """
        self._check_timeout("wait_staged", timeout)
        guard = self._guard
        if guard is None:
            return
        if not guard.staged.wait(timeout):
            raise TimeoutError(f"snapshot {self.path} still staging after {timeout} s")
        e = guard.error
        if isinstance(e, SnapshotError):
            raise e
        if e is not None:
            raise SnapshotError(
                f"staging snapshot {self.path} failed: {type(e).__name__}: {e}"
            ) from e

    def _check_timeout(self, call: str, timeout: object) -> None:
        # A bool is an int to Python, and NaN compares false with everything: both refused.
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0
        ):
            raise InvalidArgumentError(
                f"PendingSnapshot.{call} of {self.path}: timeout must be None or a number of "
                f"seconds >= 0, got {timeout!r}"
            )

    def _finalize_through_me(self) -> None:
        """Finalizes the queue's calls up to this one; earlier failures belong to their own
        handles, so they are logged here, not raised."""
        while True:
            try:
                self._queue.maybe_finalize_async_calls(blocking=True, up_to=self._index)
                return
            except SnapshotError:
                logger.debug("an earlier async snapshot failed", exc_info=True)
