"""Which committed steps a checkpoint manager keeps: a pure function of the steps, their
metrics and bases, and what is in flight (``CheckpointManager`` runs it after each commit).

The kept set is the union of what each policy keeps (keep the last N, every N-th step, the best
N by a metric), always with the newest committed step, then closed over bases: a snapshot an
incremental take pointed at stays while any kept snapshot needs its bytes (and so do the bases
of a snapshot kept that way). Steps in flight are
never candidates (they are not committed yet). Everything else is deleted.

A committed step whose manifest cannot be read (a newer format, damage, a store refusing the
read) is never a candidate either, and the bases it needs are unknown: while one is there,
no step is deleted (when in doubt, keep).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Set
from dataclasses import dataclass

from snapshot.errors import InvalidArgumentError


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


@dataclass(frozen=True)
class Step:
    """A committed step as retention sees it: its metrics and the names of the steps (folders)
    whose bytes it needs."""

    step: int
    name: str
    metrics: Mapping[str, float]
    bases: tuple[str, ...] = ()


def to_keep(policy: Policy, steps: list[Step]) -> set[int]:
    """The steps ``policy`` keeps among the committed ``steps`` (before closing over bases)."""
    if not steps:
        return set()
    ordered = sorted(s.step for s in steps)
    if policy.keeps_everything:
        return set(ordered)
    keep = {ordered[-1]}  # the newest committed step, always
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
        if policy.mode == "min":
            scored.sort(key=lambda vs: (vs[0], -vs[1]))
        else:
            scored.sort(key=lambda vs: (-vs[0], -vs[1]))
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
