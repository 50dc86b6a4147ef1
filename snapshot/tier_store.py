"""``MemoryTierStore``: the memory tier without a checkpoint manager (docs/tiers.md)::

store = MemoryTierStore("job-1", MemoryTier(dir="/dev/shm/statesnap", replicas=1, keep=2))
start = store.restore(app_state)  # the step restored, or None: start fresh
...
store.save(step, app_state)
store.close()
"""

from __future__ import annotations

import logging
import os
from typing import Any

from snapshot._engine.manager.tier import Tier
from snapshot.errors import InvalidArgumentError, SnapshotError
from snapshot.options import MemoryTier, Options, resolve
from snapshot.snapshot import Snapshot

logger = logging.getLogger(__name__)


class MemoryTierStore:
    """Steps of one job's state kept in a folder on each node and copied to peer ranks on
    other hosts, as a :class:`CheckpointManager`'s memory tier keeps them, with no durable
    storage behind them: a step lives as long as some node's folder holds every rank's part.

    Args:
        name: the job's name: the store's folder under ``tier.dir`` is named after it, so a
            store of another name never reads it.
        tier: where and how many (:class:`MemoryTier`; its ``durable_every`` is not used).
        pg: the process group; every rank makes the store (a collective) and calls ``save``
            and ``restore`` in the same order.
        options: the :class:`Options` of every take and restore of a part.
    """

    def __init__(
        self, name: str, tier: MemoryTier, *, pg: Any | None = None, options: Options | None = None
    ) -> None:
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(
                f"MemoryTierStore: name must be a non-empty str, got {name!r}"
            )
        if not isinstance(tier, MemoryTier):
            raise InvalidArgumentError(
                f"MemoryTierStore: tier must be a snapshot.MemoryTier, got {type(tier).__name__}"
            )
        self.name, self.options = name, resolve(options)
        self._tier = Tier(tier, f"memory-tier-store://{name}", pg, self.options)

    def save(self, step: int, app_state: dict[str, Any]) -> None:
        """Takes this rank's part of ``step`` (its ``app_state``, as :meth:`Snapshot.take`
        takes it) into its node's folder before returning, then copies it to the peers in the
        background (a failed copy is raised by ``wait``)."""
        if type(step) is not int or step < 0:
            raise InvalidArgumentError(f"step must be an int >= 0, got {step!r}")
        self._tier.save(step, app_state, self._take)

    def restore(self, app_state: dict[str, Any]) -> int | None:
        """Restores the newest step that every rank's part is complete and valid for on some
        node, each part from its node, else from a peer's copy, every range checked; returns
        the step, or None when the store holds none (nothing is loaded). A step whose part is
        valid nowhere is passed over, with a warning, for the next older one. Steps newer than
        the one restored are deleted.

        Raises:
            SnapshotError: steps were held, but none had every part valid (app_state may hold
                values loaded before a check failed).
        """
        self._tier.wait()
        below, passed = float("inf"), []
        while True:
            step, failed = self._tier.restore(app_state, set(), below=below)
            if step is None or not failed:
                break
            logger.warning(
                "memory tier store %r: step %d has no valid copy of the part of rank(s) %s; "
                "trying an older step",
                self.name,
                step,
                failed,
            )
            below = step
            passed.append(f"step {step}: rank(s) {failed}")
        if step is None and passed:
            raise SnapshotError(
                f"memory tier store {self.name!r}: no step can be restored, a part of each is "
                f"valid on no node ({'; '.join(passed)}); app_state may hold values loaded "
                "before a check failed"
            )
        if step is not None:
            self._tier.forget_after(step)
        return step

    def wait(self) -> None:
        """Waits for the copies to peers of the saves so far; raises a copy's error."""
        self._tier.wait()

    def close(self) -> None:
        """Waits for the copies under way, then stops the store's worker; raises a copy's
        error."""
        try:
            self._tier.wait()
        finally:
            self._tier.close()

    def __enter__(self) -> MemoryTierStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _take(self, path: str | os.PathLike[str], app_state: dict[str, Any], pg: Any) -> None:
        Snapshot.take(path, app_state, pg=pg, options=self.options)


__all__ = ["MemoryTierStore"]
