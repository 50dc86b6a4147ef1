"""Who takes part in a snapshot: this process alone, or the ranks of a process group."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from snapshot.errors import SnapshotError


@dataclass(frozen=True)
class Coordinator:
    """This process's rank among ``world_size`` participants."""

    rank: int = 0
    world_size: int = 1


def resolve(pg: Any | None) -> Coordinator:
    """The participants for ``pg``: the default group when ``torch.distributed`` is initialized
    and ``pg`` is None, else this process alone."""
    if pg is None and not (dist.is_available() and dist.is_initialized()):
        return Coordinator()
    world_size = dist.get_world_size(pg)
    if world_size == 1:
        return Coordinator()
    raise SnapshotError(
        f"snapshots across a process group of {world_size} ranks are not supported by this "
        "version of statesnap; pass a group of one rank or call from a single process"
    )
