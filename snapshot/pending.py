"""PendingSnapshot: a snapshot whose bytes are still being written in the background."""

from __future__ import annotations

import concurrent.futures
from typing import TYPE_CHECKING, Any

from manifest import Manifest
from snapshot.errors import SnapshotError

if TYPE_CHECKING:
    from snapshot.snapshot import Snapshot


class PendingSnapshot:
    """Returned by :meth:`Snapshot.async_take`: the state is captured, the writes go on.

    If the process exits before the snapshot is committed, the snapshot is left uncommitted
    (an incomplete snapshot that ``Snapshot(path)`` refuses), never half-committed.
    """

    def __init__(
        self,
        path: str,
        pg: Any | None,
        storage_options: dict[str, Any] | None,
        future: concurrent.futures.Future[Manifest],
    ) -> None:
        self.path = path
        self._pg = pg
        self._storage_options = storage_options
        self._future = future

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"PendingSnapshot(path={self.path!r}, {state})"

    def done(self) -> bool:
        """Whether the background work has finished (committed or failed). Never blocks."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> Snapshot:
        """Blocks until the snapshot is committed and returns it.

        Raises:
            SnapshotError: the background work failed (the original error is chained, or is the
                SnapshotError raised); nothing was committed.
            TimeoutError: ``timeout`` seconds passed first; the work goes on.
        """
        from snapshot.snapshot import Snapshot

        try:
            manifest = self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"snapshot {self.path} still pending after {timeout} s") from None
        except SnapshotError:
            raise
        except Exception as e:
            raise SnapshotError(
                f"async snapshot {self.path} failed: {type(e).__name__}: {e}"
            ) from e
        return Snapshot(self.path, self._pg, self._storage_options, _manifest=manifest)
