"""Which committed steps a checkpoint manager keeps, and the thread that deletes the rest.

``to_delete`` is a pure function of the committed steps, their metrics and bases, and what is
in flight: the kept set is the union of what each policy keeps (the last N, every N-th step, the
best N by a metric), always with the newest committed step, closed over bases (a step an
incremental take points at stays while a kept step needs it). A committed step whose manifest
cannot be read may need any other as its base: while one is there, nothing is deleted.

``Cleaner`` runs retention rounds and deletes debris on a worker thread of its own, kept off the
steps the manager is saving (docs/reliability.md, "Checkpoint manager and deletions").
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Collection, Set
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from snapshot._engine.manager.steps import INCOMPLETE, LEFT, UNREADABLE, StepInfo, Steps
from snapshot.errors import InvalidArgumentError
from storage_plugins.base import DaemonThreadPool

logger = logging.getLogger("snapshot")

# What became of a save of the manager's (``Cleaner._saves``).
WRITING, SAVED, FAILED = "writing", "saved", "failed"


@dataclass(frozen=True)
class Policy:
    """What to keep; None turns a policy off. ``keep_best`` needs ``metric`` and ``mode``
    (``"min"``: lower is better, ``"max"``: higher). With every policy off, everything is
    kept."""

    keep_last: int | None = None
    keep_every_steps: int | None = None
    keep_best: int | None = None
    metric: str | None = None
    mode: str = "min"

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every_steps", "keep_best"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise InvalidArgumentError(f"{name} must be an int >= 1 or None, got {value!r}")
        if self.mode not in ("min", "max"):
            raise InvalidArgumentError(f"mode must be 'min' or 'max', got {self.mode!r}")
        if self.keep_best is not None and not isinstance(self.metric, str):
            raise InvalidArgumentError("keep_best needs metric= (the name of a metric to rank by)")

    @property
    def keeps_everything(self) -> bool:
        return self.keep_last is None and self.keep_every_steps is None and self.keep_best is None


# A committed step as retention sees it: ``Step(step, name, metrics, bases)``.
Step = StepInfo


def to_keep(policy: Policy, steps: list[Step]) -> set[int]:
    """The steps ``policy`` keeps among the committed ``steps`` (before closing over bases)."""
    ordered = sorted(s.step for s in steps)
    if policy.keeps_everything:
        return set(ordered)
    keep = set(ordered[-1:])  # the newest committed step, always
    if policy.keep_last is not None:
        keep.update(ordered[-policy.keep_last :])
    if policy.keep_every_steps is not None:
        keep.update(s for s in ordered if s % policy.keep_every_steps == 0)
    if policy.keep_best is not None:
        assert policy.metric is not None
        scored = [
            (value, s.step)
            for s in steps
            if isinstance(value := s.metrics.get(policy.metric), (int, float))
            and not isinstance(value, bool)
            and math.isfinite(value)
        ]
        # Ties go to the newer step.
        sign = 1 if policy.mode == "min" else -1
        scored.sort(key=lambda vs: (sign * vs[0], -vs[1]))
        keep.update(step for _, step in scored[: policy.keep_best])
    return keep


def to_delete(
    policy: Policy,
    steps: list[Step],
    in_flight: Set[int] = frozenset(),
    unreadable: Collection[str] = (),
) -> list[Step]:
    """The committed steps to delete, oldest first: neither kept by ``policy`` nor needed as a
    base by a kept step, nor in flight. ``unreadable``: the folders of committed steps whose
    manifest cannot be read; each may need any other step as its base, so with one there
    nothing is deleted."""
    if unreadable:
        return []
    keep = to_keep(policy, steps)
    by_name = {s.name: s for s in steps}
    by_step = {s.step: s for s in steps}
    # Closed over bases, transitively: a step kept only as a base is still a committed
    # snapshot, and must stay restorable itself.
    needed = set(keep)
    todo = list(keep)
    while todo:
        for b in by_step[todo.pop()].bases:
            base = by_name.get(b)
            if base is not None and base.step not in needed:
                needed.add(base.step)
                todo.append(base.step)
    return sorted(
        (s for s in steps if s.step not in needed and s.step not in in_flight),
        key=lambda s: s.step,
    )


class Cleaner:
    """Retention and every deletion of one checkpoint manager, on one worker thread (started by
    the first round queued), and which steps the manager's saves hold."""

    def __init__(self, steps: Steps, policy: Policy) -> None:
        self._steps = steps
        self.policy = policy
        self.root = steps.root
        # Each step the manager began saving: WRITING (not yet committed nor failed) and SAVED
        # are never taken for an earlier run's debris; FAILED is debris, deleted even without
        # the pending marker.
        self._saves: dict[int, str] = {}
        self._deleting: set[int] = set()  # folders being deleted: a save there waits
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._warned: set[str] = set()
        # The worker thread runs the rounds in order. A manager dropped without ``close`` is
        # collected, then the cleaner and its pool, which ends the thread once the rounds
        # queued before are done.
        self._pool = DaemonThreadPool(1, thread_name_prefix="statesnap-checkpoint-manager")
        self.last_round: Future[None] | None = None  # None: no round queued, no thread started

    def begin(self, step: int) -> None:
        """A save of ``step`` begins: waits while the worker deletes debris at that step, then
        marks the step in flight and begun by this manager."""
        with self._changed:
            while step in self._deleting:  # debris at this step, being deleted
                self._changed.wait()
            self._saves[step] = WRITING

    def end(self, step: int, failed: bool = False) -> None:
        """The save of ``step`` is no longer writing (``failed``: and it failed)."""
        with self._lock:
            self._saves[step] = FAILED if failed else SAVED

    def run_round(self) -> None:
        """Queues a retention round on the worker thread (started on the first call)."""
        with self._lock:
            self.last_round = self._pool.submit(self.retain)

    def join(self) -> None:
        """Waits for the rounds queued so far."""
        last = self.last_round  # (one read: a round queued meanwhile is not waited for)
        if last is not None:
            futures.wait([last])

    def stop(self) -> None:
        """Ends the worker thread once the rounds queued so far are done."""
        self._pool.shutdown()

    def retain(self) -> None:
        """On the worker, after a commit: lists the steps, deletes the debris of takes no save
        of this manager is writing, and the committed steps the policy lets go."""
        try:
            found = self.scan()
        except Exception as e:
            logger.warning(
                "retention under %s deleted nothing this round (tried again after the next "
                "save): %s",
                self.root,
                e,
            )
            return
        # Read after the listing: every folder of this manager's that it saw is in ``_saves``
        # even if its save began, or committed, meanwhile.
        with self._lock:
            saves = dict(self._saves)
        in_flight = {step for step, state in saves.items() if state == WRITING}
        for s in found:
            # A take's debris: this manager's failed save's, or an earlier run's marked one.
            failed = saves.get(s.step) == FAILED
            if s.debris and (failed or (s.state == INCOMPLETE and s.step not in saves)):
                logger.warning(
                    "%s holds no committed snapshot (%s): deleting it",
                    self._steps.path(s.name),
                    "a save that failed" if failed else s.reason,
                )
                self._delete(s, unmarked=failed)
        steps = [s for s in found if s.committed]
        unreadable = [s.name for s in found if s.state == UNREADABLE]
        doomed = to_delete(self.policy, steps, in_flight)
        if unreadable and doomed:
            doomed = []
            self._warn_once(
                "retention under %s deletes no step while %s cannot be read (it may need any "
                "other step as its base): upgrade statesnap to read it, or move it away",
                self.root,
                ", ".join(unreadable),
            )
        for d in doomed:
            self._delete(d)

    def _delete(self, s: StepInfo, unmarked: bool = False) -> None:
        """Deletes the folder of ``s`` (checked whole first), unless a save of this manager began
        writing there since the listing; a failure is logged."""
        with self._changed:
            if not s.committed and self._saves.get(s.step, FAILED) != FAILED:
                return
            self._deleting.add(s.step)
        try:
            self._steps.delete(s.name, unmarked=unmarked)
        except Exception as e:
            logger.warning(
                "%s not deleted (tried again after the next save): %s",
                self._steps.path(s.name),
                e,
            )
        finally:
            with self._changed:
                self._deleting.discard(s.step)
                self._changed.notify_all()

    def scan(self) -> list[StepInfo]:
        """``Steps.scan``, warning once per folder and reason of the folders kept because the
        manager cannot read them or did not make them."""
        found = self._steps.scan()
        for s in found:
            if s.state == UNREADABLE:
                self._warn_once(
                    "%s holds a committed snapshot that cannot be read: kept, never restored "
                    "as the latest step: %s",
                    self._steps.path(s.name),
                    s.reason,
                )
            elif s.state == LEFT and s.step not in self._saves:
                self._warn_once(
                    "%s is left alone (the checkpoint manager deletes only what a take of its "
                    "own left): %s",
                    self._steps.path(s.name),
                    s.reason,
                )
        return found

    def _warn_once(self, message: str, *args: Any) -> None:
        text = message % args
        with self._lock:
            if text in self._warned:
                return
            self._warned.add(text)
        logger.warning(text)
