"""Who takes part in a snapshot, and how they agree: this process alone, or a process group.

The library's own coordination uses object collectives on a gloo group of its own over the
caller's ranks (created once per group and use), so it never needs NCCL, and a wait for a lost
rank is bounded (``liveness``). Every collective carries each rank's outcome, so that a rank
that failed still takes part and every rank learns of the failure: nobody waits for a rank that
will never arrive.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from snapshot._engine.dist import liveness

from snapshot._engine import runtime
from snapshot.errors import RankFailedError

if TYPE_CHECKING:
    from snapshot.options import Options


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one rank contributes to a collective: its result, or the error it met."""

    value: Any = None
    error: str | None = None  # "TypeName: message"


class Coordinator:
    """This process's rank among ``world_size`` participants, and collectives among them.

    The base class is the single-process case: every collective returns this rank's value.
    """

    rank: int = 0
    world_size: int = 1
    step = "a snapshot"  # what the ranks last agreed on (for messages)

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, indexed by rank."""
        return [value]

    def gather(self, value: Any) -> list[Any] | None:
        """Every rank's ``value`` on rank 0 (None elsewhere)."""
        return [value]

    def broadcast(self, tensor: Any, src: int) -> None:
        """Fills ``tensor`` (a CPU tensor) on every rank with rank ``src``'s."""

    def agree(self, what: str, value: Any = None, error: BaseException | None = None) -> list[Any]:
        """All-gathers each rank's outcome of step ``what``; raises on every rank if any failed.

        Returns every rank's ``value`` when all succeeded.

        Raises:
            RankFailedError: naming each failed rank and its error (with this rank's own error
                chained when it was one of them).
        """
        outcome = Outcome(
            value=None if error else value,
            error=None if error is None else f"{type(error).__name__}: {error}",
        )
        self.step = what
        outcomes = self.all_gather(outcome)
        failures = {r: o.error for r, o in enumerate(outcomes) if o.error is not None}
        if failures:
            if self.world_size == 1 and error is not None:
                raise error
            detail = "; ".join(f"rank {r}: {msg}" for r, msg in sorted(failures.items()))
            raise RankFailedError(
                f"{what} failed on rank(s) {sorted(failures)} of {self.world_size}: {detail}",
                failures,
            ) from error
        return [o.value for o in outcomes]


class GroupCoordinator(Coordinator):
    """The ranks of a ``torch.distributed`` process group, coordinating on a gloo group of
    the library's. A rank waits in a collective for a peer that is alive (beats its heartbeat,
    see ``liveness``) at most ``options.collective_timeout_secs``, for one that fell silent at
    most ``options.rank_timeout_secs``; a peer whose process ended fails the collective at
    once."""

    def __init__(self, pg: Any | None, options: Options, *, background: bool = False) -> None:
        self.pg = pg
        self.rank = dist.get_rank(pg)
        self.world_size = dist.get_world_size(pg)
        self.timeout_secs = options.collective_timeout_secs
        self.rank_timeout = options.rank_timeout_secs
        self.group, self.watch = _gloo_group(
            pg,
            background=background,
            timeout_secs=self.timeout_secs,
            rank_timeout=self.rank_timeout,
        )
        self.watch.set_timeout(self.rank_timeout)

    def all_gather(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        self._run(lambda: dist.all_gather_object(out, value, group=self.group))
        return out

    def gather(self, value: Any) -> list[Any] | None:
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dst = self._global_rank(0)
        self._run(lambda: dist.gather_object(value, out, dst=dst, group=self.group))
        return out

    def broadcast(self, tensor: Any, src: int) -> None:
        root = self._global_rank(src)
        self._run(lambda: dist.broadcast(tensor, src=root, group=self.group))

    def _run(self, collective: Any) -> None:
        self.watch.run(collective, self._silent, self._lost)

    def _silent(self, why: str, failures: dict[int, str]) -> RankFailedError:
        """What a rank raises when a peer (or the store) fell silent while it waited."""
        return RankFailedError(
            f"rank {self.rank} of {self.world_size} lost contact with the other ranks while "
            f"they agreed on {self.step}: {why}; a take commits nothing",
            failures,
        )

    def _lost(self, error: RuntimeError, dead: list[int]) -> RankFailedError:
        """What a rank raises when the group's collective itself failed: a peer's process
        ended (its connections closed at once; ``dead``: the peers whose heartbeat stopped,
        when the store could tell), or a live peer did not arrive within the group's
        timeout."""
        self.watch.broken = f"an earlier collective of the group failed ({error})"
        who = (
            f"rank(s) {dead} stopped (their process ended)"
            if dead
            else "a rank's process ended, or a live rank did not arrive within "
            f"{self.timeout_secs} s (Options.collective_timeout_secs, "
            "STATESNAP_COLLECTIVE_TIMEOUT_SECS)"
        )
        return RankFailedError(
            f"rank {self.rank} of {self.world_size} lost contact with the other ranks while "
            f"they agreed on {self.step}: {who}; a take commits nothing. gloo said: {error}",
            {r: "process ended" for r in dead},
        )

    def _global_rank(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank)


def _gloo_group(
    pg: Any | None, *, background: bool, timeout_secs: int, rank_timeout: float
) -> tuple[Any, liveness.Watch]:
    """The gloo group the library coordinates on for ``pg``, and its ``Watch``: made once per
    caller group and use (foreground, or an async take's background work), kept by the
    runtime (``Runtime.gloo_groups``). Its collectives wait ``timeout_secs`` at most for a live
    peer.

    The library never coordinates on the caller's own group, even a gloo one: a collective
    abandoned when a peer fell silent would stay pending on it."""
    group = pg if pg is not None else dist.group.WORLD
    rt = runtime.get()
    groups = rt.gloo_groups
    cached = groups.get((id(group), background))
    if cached is None:
        # Only the ranks of the caller's group are in this take or restore. torch wants every
        # rank of the default group to call ``new_group`` for each group, in the same order,
        # unless the group synchronizes locally: then its members alone make it, under a name
        # hashed from its ranks and the number of groups each member has (equal on members
        # that made their groups alike). Without it, disjoint subgroups taking snapshots at
        # once hang or join each other's groups. The default group's ranks all call this, so
        # its group is made the ordinary way.
        ranks = dist.get_process_group_ranks(group)
        rt.heartbeat(dist.get_rank(), rank_timeout)
        gloo = dist.new_group(
            ranks=ranks,
            backend="gloo",
            timeout=datetime.timedelta(seconds=timeout_secs),
            use_local_synchronization=len(ranks) < dist.get_world_size(),
        )
        watch = liveness.Watch(dist.get_rank(group), ranks, rank_timeout)
        cached = groups[(id(group), background)] = (group, gloo, watch)
    else:
        rt.heartbeat(dist.get_rank(), rank_timeout)
    return cached[1], cached[2]


def resolve_background(pg: Any | None, options: Options) -> Coordinator:
    """Like ``resolve``, but on a gloo group of its own: the one background work (async
    take's commit) agrees on, while the caller's thread goes on using the foreground one.

    Creating that group is itself a collective, so call this on the caller's thread, on every
    rank, at the same point (async take does, when it is called).
    """
    coord = resolve(pg, options)
    return GroupCoordinator(pg, options, background=True) if coord.world_size > 1 else coord


def resolve(pg: Any | None, options: Options) -> Coordinator:
    """The participants for ``pg``: the default group when ``torch.distributed`` is initialized
    and ``pg`` is None, else this process alone. A group of one rank is this process alone.
    ``options.collective_timeout_secs`` and ``rank_timeout_secs`` bound the waits of its
    collectives."""
    if pg is None and not (dist.is_available() and dist.is_initialized()):
        return Coordinator()
    if dist.get_world_size(pg) == 1:
        return Coordinator()
    return GroupCoordinator(pg, options)
