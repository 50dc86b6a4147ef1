"""A rank whose process is killed outright (SIGKILL: no exception, no goodbye) during a take or
a restore across ranks: every other rank raises RankFailedError at once, naming the step, and
nothing is committed."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from snapshot import RankFailedError, Snapshot, SnapshotNotFoundError, StateDict
from tests.multirank import run_ranks

pytestmark = pytest.mark.slow  # real processes (gloo), one killed

VICTIM = 1


class DiesOn:
    """A Stateful whose ``state_dict`` (or ``load_state_dict``) kills its own process on the
    victim rank, as the OOM killer or a node failure would."""

    def __init__(self, when: str) -> None:
        self.when = when

    def _maybe_die(self, now: str) -> None:
        if now == self.when and dist.get_rank() == VICTIM:
            os.kill(os.getpid(), signal.SIGKILL)

    def state_dict(self):
        self._maybe_die("take")
        return {"x": torch.full((1000,), float(dist.get_rank()))}

    def load_state_dict(self, sd):
        self._maybe_die("restore")


def _take(rank: int, world: int, path: str) -> tuple[str, float]:
    state = {"good": StateDict(t=torch.ones(1 << 16)), "dies": DiesOn("take")}
    t = time.monotonic()
    try:
        Snapshot.take(path, state)
    except RankFailedError as e:
        return str(e), time.monotonic() - t
    raise AssertionError("the take did not fail")


def _restore(rank: int, world: int, path: str) -> tuple[str, float]:
    Snapshot.take(path, {"good": StateDict(t=torch.ones(10)), "dies": DiesOn("never")})
    t = time.monotonic()
    try:
        Snapshot(path).restore({"good": StateDict(t=torch.zeros(10)), "dies": DiesOn("restore")})
    except RankFailedError as e:
        return str(e), time.monotonic() - t
    raise AssertionError("the restore did not fail")


def _async_take(rank: int, world: int, path: str) -> tuple[str, float]:
    pending = Snapshot.async_take(path, {"good": StateDict(t=torch.ones(1 << 20))})
    if rank == VICTIM:  # captured, then gone before the background work agrees to commit
        os.kill(os.getpid(), signal.SIGKILL)
    t = time.monotonic()
    try:
        pending.wait()
    except RankFailedError as e:
        return str(e), time.monotonic() - t
    raise AssertionError("the async take did not fail")


def survivors(world: int, body, path: str) -> list[tuple[str, float]]:
    """What every rank but the victim raised, and how long after the kill it took."""
    results = run_ranks(world, body, path, timeout=120, expect_dead=frozenset({VICTIM}))
    return [r for rank, r in enumerate(results) if rank != VICTIM]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(
    ("body", "step"), [(_take, "take"), (_async_take, "take"), (_restore, "restore")]
)
def test_a_rank_killed_outright(tmp_path, world, body, step):
    path = str(tmp_path / "snap")
    for message, seconds in survivors(world, body, path):
        assert "lost contact with the other ranks" in message and step in message, message
        # At once: the dead process's connections closed; nobody waited for the group's
        # timeout (60 s, run_ranks's), the one way a late rank is found.
        assert seconds < 45, seconds
    if body is _restore:
        # The snapshot itself is whole: read without the dead rank, it is all there.
        assert torch.equal(Snapshot(path).read_object("0/good/t"), torch.ones(10))
    else:  # a take commits nothing
        with pytest.raises(SnapshotNotFoundError):
            Snapshot(path)
