"""Who takes part in a snapshot, and how they agree: this process alone, or a process group.

The library coordinates with object collectives on a gloo group of its own over the caller's
ranks (never NCCL, never the caller's group), and bounds each wait for a lost rank
(``liveness``). Every collective carries each rank's outcome, so a rank that failed still takes
part and every rank learns of the failure.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from snapshot._engine import runtime
from snapshot._engine.dist import liveness
from snapshot.errors import InvalidArgumentError, RankFailedError

if TYPE_CHECKING:
    from snapshot.options import Options


class Coordinator:
    """This process's rank among ``world_size`` participants, and collectives among them. The
    base class is the single-process case: every collective returns this rank's value."""

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

    def broadcast_object(self, value: Any) -> Any:
        """Rank 0's ``value`` (any picklable object) on every rank."""
        return value

    def any_failed(self, failed: bool) -> bool:
        """Whether ``failed`` is true on any rank."""
        return failed

    def agree(self, what: str, value: Any = None, error: BaseException | None = None) -> list[Any]:
        """All-gathers each rank's outcome of step ``what``; returns every rank's ``value``.

        Raises:
            RankFailedError: on every rank when any failed, naming each failed rank and its
                error (this rank's own chained).
        """
        self.step = what
        outcomes = self.all_gather((value, None if error is None else describe(error)))
        failures = {r: failed for r, (_, failed) in enumerate(outcomes) if failed is not None}
        if failures:
            if self.world_size == 1 and error is not None:
                raise error
            raise RankFailedError(self.failed(what, failures), failures) from error
        return [value for value, _ in outcomes]

    def agree_outcome(self, what: str, error: BaseException | None) -> None:
        """``agree`` for a step that carries no value: one flag per rank, and the errors
        gathered only when a rank failed (every rank then takes part).

        Raises:
            RankFailedError: as ``agree``.
        """
        self.step = what
        if self.any_failed(error is not None):
            self.agree(what, error=error)

    def failed(self, what: str, failures: dict[int, str]) -> str:
        """The message of a ``RankFailedError``: step ``what`` failed on the ranks of
        ``failures`` (rank -> its error, as ``describe`` gives it)."""
        detail = "; ".join(f"rank {r}: {msg}" for r, msg in sorted(failures.items()))
        return f"{what} failed on rank(s) {sorted(failures)} of {self.world_size}: {detail}"


def describe(error: BaseException) -> str:
    """An error as a rank reports it to the others: ``"TypeName: message"``."""
    return f"{type(error).__name__}: {error}"


class GroupCoordinator(Coordinator):
    """The ranks of a process group, coordinating on a gloo group of the library's. A rank
    waits in a collective at most ``options.collective_timeout_secs`` for a live peer (one that
    beats its heartbeat), ``options.rank_timeout_secs`` for a silent one; a peer whose process
    ended fails the collective at once."""

    def __init__(self, pg: Any | None, options: Options, *, background: bool = False) -> None:
        self.rank = dist.get_rank(pg)
        self.world_size = dist.get_world_size(pg)
        timeout, rank_timeout = options.collective_timeout_secs, options.rank_timeout_secs
        assert timeout is not None and rank_timeout is not None  # resolved options
        # The library's gloo group for ``pg`` and its ``Watch``: made once per caller group and
        # use (foreground, or an async take's background work), kept by the runtime. A
        # collective abandoned on a silent peer would stay pending on the caller's own group,
        # so that one is never used.
        group = pg if pg is not None else dist.group.WORLD
        rt = runtime.get()
        rt.heartbeat(dist.get_rank(), rank_timeout)
        cached = rt.gloo_groups.get((id(group), background))
        if cached is None:
            # Only the caller's group's ranks are here: a subgroup synchronizes locally (its
            # members alone make it), so disjoint subgroups taking snapshots at once neither
            # hang nor join each other's groups.
            ranks = dist.get_process_group_ranks(group)
            watch = liveness.Watch(dist.get_rank(group), ranks, rank_timeout, timeout)
            # Making the group is a collective too: a peer lost meanwhile is a RankFailedError
            # naming it, found as any collective's is, not gloo's error or a wait for its timeout.
            self.step = "the library's process group"
            gloo = watch.run(
                lambda: dist.new_group(
                    ranks=ranks,
                    backend="gloo",
                    timeout=datetime.timedelta(seconds=timeout),
                    use_local_synchronization=len(ranks) < dist.get_world_size(),
                ),
                self._lost,
            )
            cached = rt.gloo_groups[(id(group), background)] = (group, gloo, watch)
        self.group, self.watch = cached[1], cached[2]
        self.watch.set_timeout(rank_timeout)

    def all_gather(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        self.watch.run(lambda: dist.all_gather_object(out, value, group=self.group), self._lost)
        return out

    def gather(self, value: Any) -> list[Any] | None:
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dst = dist.get_global_rank(self.group, 0)
        self.watch.run(lambda: dist.gather_object(value, out, dst, self.group), self._lost)
        return out

    def broadcast(self, tensor: Any, src: int) -> None:
        root = dist.get_global_rank(self.group, src)
        self.watch.run(lambda: dist.broadcast(tensor, src=root, group=self.group), self._lost)

    def any_failed(self, failed: bool) -> bool:
        # One small all-reduce: on gloo it costs a fraction of an object all-gather's two
        # collectives and pickling.
        flag = torch.tensor([int(failed)], dtype=torch.int32)
        op = dist.ReduceOp.MAX
        self.watch.run(lambda: dist.all_reduce(flag, op=op, group=self.group), self._lost)
        return bool(flag.item())

    def broadcast_object(self, value: Any) -> Any:
        box = [value]
        root = dist.get_global_rank(self.group, 0)
        self.watch.run(
            lambda: dist.broadcast_object_list(box, src=root, group=self.group), self._lost
        )
        return box[0]

    def _lost(self, why: str, failures: dict[int, str]) -> RankFailedError:
        """What a rank raises when it lost contact with its peers while it waited."""
        return RankFailedError(
            f"rank {self.rank} of {self.world_size} lost contact with the other ranks while "
            f"they agreed on {self.step}: {why}; a take commits nothing",
            failures,
        )


def resolve(pg: Any | None, options: Options) -> Coordinator:
    """The participants for ``pg``: the default group when ``torch.distributed`` is initialized
    and ``pg`` is None, else this process alone (so is a group of one rank)."""
    if pg is None and not (dist.is_available() and dist.is_initialized()):
        return Coordinator()
    return Coordinator() if dist.get_world_size(pg) == 1 else GroupCoordinator(pg, options)


class RankZero:
    """How a checkpoint manager's ranks agree: rank 0 lists, decides and deletes, and every
    rank gets its answers, on the library's gloo group. ``root`` names the manager in errors."""

    def __init__(self, pg: Any | None, options: Options, root: str) -> None:
        self.pg = pg
        self.options = options
        self.root = root
        self.rank, self.world = 0, 1
        if dist.is_available() and dist.is_initialized():
            self.rank, self.world = dist.get_rank(pg), dist.get_world_size(pg)
        elif pg is not None:
            raise InvalidArgumentError(
                "CheckpointManager got a process group, but torch.distributed is not initialized"
            )

    def agreed(self, compute: Callable[[], Any]) -> Any:
        """``compute()`` on rank 0, given to every rank (a failure there fails every rank)."""
        if self.world == 1:
            return compute()
        value = error = None
        if self.rank == 0:
            try:
                value = compute()
            except Exception as e:
                error = e
        coordinator = resolve(self.pg, self.options)
        return coordinator.agree(f"the checkpoint manager of {self.root}", value, error)[0]

    def barrier(self) -> None:
        """Returns once every rank has called it."""
        if self.world > 1:
            resolve(self.pg, self.options).all_gather(None)
