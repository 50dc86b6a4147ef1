"""How a checkpoint manager's ranks agree: rank 0 lists, decides and deletes, and every rank
gets its answers (``RankZero``), on the library's gloo group."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed

from snapshot.errors import InvalidArgumentError, SnapshotError
from snapshot.options import Options


class RankZero:
    """This process's rank and the world size of ``pg`` (0 and 1 without
    ``torch.distributed``), and rank 0's answers given to every rank. ``root`` names the
    manager in errors."""

    def __init__(self, pg: Any | None, options: Options, root: str) -> None:
        self.pg = pg
        self.options = options
        self.root = root
        self.rank, self.world = _rank_and_world(pg)

    def agreed(self, compute: Callable[[], Any]) -> Any:
        """``compute()`` on rank 0, given to every rank (a failure there fails every rank).
        It travels on the library's gloo group (any backend's job; a lost rank is found
        within the library's bounds)."""
        if self.world == 1:
            return compute()
        from snapshot._engine.dist import dist as coordination

        box: tuple[str, Any] | None = None
        if self.rank == 0:
            try:
                box = ("ok", compute())
            except Exception as e:
                box = ("error", f"{type(e).__name__}: {e}")
        kind, value = coordination.resolve(self.pg, self.options).all_gather(box)[0]
        if kind == "error":
            raise SnapshotError(f"rank 0 of the checkpoint manager of {self.root} failed: {value}")
        return value

    def barrier(self) -> None:
        """Returns once every rank has called it (at once without a group)."""
        if self.world > 1:
            from snapshot._engine.dist import dist as coordination

            coordination.resolve(self.pg, self.options).all_gather(None)


def _rank_and_world(pg: Any | None) -> tuple[int, int]:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        if pg is not None:
            raise InvalidArgumentError(
                "CheckpointManager got a process group, but torch.distributed is not initialized"
            )
        return 0, 1
    return torch.distributed.get_rank(pg), torch.distributed.get_world_size(pg)
