"""A rank lost during a take, an async take's background work or a restore across ranks, for
each cause: its process killed outright (SIGKILL: no exception, no goodbye), frozen (SIGSTOP:
alive to the kernel, silent to its peers, as a hung or swapped-out process is), or its code
raising. Every other rank raises RankFailedError naming the lost rank, within the bound the
library states (at once for a process that ended or raised; ``rank_timeout_secs`` for a silent
one), and nothing is committed. (A host gone silent: tests/test_multihost.py.)"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from snapshot import Options, RankFailedError, Snapshot, SnapshotNotFoundError, StateDict
from tests.multirank import run_ranks

pytestmark = pytest.mark.slow  # real processes (gloo), one lost

VICTIM = 1
RANK_TIMEOUT = 3.0  # seconds: the bound for a silent rank, set low to keep the tests short
OPTIONS = Options(rank_timeout_secs=RANK_TIMEOUT)
# For a killed rank, a bound long enough that a raise before it shows the rank was found by
# its closed connections, not by its silence.
KILL_OPTIONS = Options(rank_timeout_secs=20)


def _options(cause: str) -> Options:
    return KILL_OPTIONS if cause == "kill" else OPTIONS


def _lose(cause: str, clock: str) -> None:
    """Loses this rank by ``cause``, noting the moment in the file ``clock`` first."""
    with open(clock + ".tmp", "w") as f:
        f.write(repr(time.time()))
    os.replace(clock + ".tmp", clock)
    if cause == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif cause == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    raise ValueError("this rank's state cannot be read")


class LostOn:
    """A Stateful whose ``state_dict`` (or ``load_state_dict``) loses the victim rank."""

    def __init__(self, when: str, cause: str, clock: str) -> None:
        self.when, self.cause, self.clock = when, cause, clock

    def _maybe(self, now: str) -> None:
        if now == self.when and dist.get_rank() == VICTIM:
            _lose(self.cause, self.clock)

    def state_dict(self):
        self._maybe("take")
        return {"x": torch.full((1000,), float(dist.get_rank()))}

    def load_state_dict(self, sd):
        self._maybe("restore")


def _since(clock: str) -> float:
    """Seconds since the victim was lost (the file it wrote then)."""
    with open(clock) as f:
        return time.time() - float(f.read())


def _take(rank: int, world: int, path: str, cause: str, clock: str) -> tuple[str, float]:
    state = {"good": StateDict(t=torch.ones(1 << 16)), "lost": LostOn("take", cause, clock)}
    try:
        Snapshot.take(path, state, options=_options(cause))
    except RankFailedError as e:
        return str(e), _since(clock)
    raise AssertionError("the take did not fail")


def _async_take(rank: int, world: int, path: str, cause: str, clock: str) -> tuple[str, float]:
    state = {"good": StateDict(t=torch.ones(1 << 20))}
    pending = Snapshot.async_take(path, state, options=_options(cause))
    if rank == VICTIM:  # captured, then lost before the background work agrees to commit
        _lose(cause, clock)
    try:
        pending.wait()
    except RankFailedError as e:
        return str(e), _since(clock)
    raise AssertionError("the async take did not fail")


def _restore(rank: int, world: int, path: str, cause: str, clock: str) -> tuple[str, float]:
    Snapshot.take(
        path, {"good": StateDict(t=torch.ones(10)), "lost": LostOn("never", cause, clock)}
    )
    try:
        Snapshot(path).restore(
            {"good": StateDict(t=torch.zeros(10)), "lost": LostOn("restore", cause, clock)},
            options=_options(cause),
        )
    except RankFailedError as e:
        return str(e), _since(clock)
    raise AssertionError("the restore did not fail")


def _check_committed(body, path: str) -> None:
    if body is _restore:
        # The snapshot itself is whole: read without the lost rank, it is all there.
        assert torch.equal(Snapshot(path).read_object("0/good/t"), torch.ones(10))
    else:  # a take commits nothing
        with pytest.raises(SnapshotNotFoundError):
            Snapshot(path)


STEPS = [(_take, "take"), (_async_take, "take"), (_restore, "restore")]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(("body", "step"), STEPS)
@pytest.mark.parametrize("cause", ["kill", "stop"])
def test_a_rank_lost(tmp_path, world, body, step, cause):
    path, clock = str(tmp_path / "snap"), str(tmp_path / "lost-at")
    results = run_ranks(
        world, body, path, cause, clock, timeout=120, expect_dead=frozenset({VICTIM})
    )
    seconds = []
    for rank, result in enumerate(results):
        if rank == VICTIM:
            continue
        message, after = result
        assert "lost contact with the other ranks" in message and step in message, message
        assert f"rank(s) [{VICTIM}]" in message, message  # the lost rank is named
        seconds.append(after)
    if cause == "kill":
        # At once: the dead process's connections closed, and its heartbeat stopped within
        # the short window in which every live rank beats (1 s; chained once or twice at 4
        # ranks, where the failure reaches some ranks through the others' exits), long before
        # the bound for a silent rank.
        assert max(seconds) < KILL_OPTIONS.rank_timeout_secs / 2, seconds
    else:
        # A frozen rank closes nothing: its heartbeat stops, and the others give up on it
        # after RANK_TIMEOUT (plus a read interval), not after the group's timeouts (600 s
        # for the library's group, 60 s for run_ranks's).
        assert RANK_TIMEOUT - 0.5 < max(seconds) < RANK_TIMEOUT + 10, seconds
    print(f"{cause} at {world} ranks during {body.__name__}: raised after {max(seconds):.2f} s")
    _check_committed(body, path)


def _raises(rank: int, world: int, root: str) -> list[tuple[str, str, float]]:
    """A rank whose code raises, in a take (its ``state_dict``), an async take's background
    work (its storage writes) and a restore (its ``load_state_dict``), one after another on
    one group: the group survives an error (every rank takes part in each agreement, the
    failed one with its error), so each step fails alone. Each rank's message and the seconds
    its call took."""
    victim = rank == VICTIM
    out = []

    def attempt(name, call):
        start = time.time()
        try:
            call(os.path.join(root, name))
        except RankFailedError as e:
            out.append((str(e), name, time.time() - start))
            return
        raise AssertionError(f"{name} did not fail on rank {rank}")

    cause = "raise" if victim else "never"
    clock = os.path.join(root, f"clock-{rank}")
    attempt(
        "take",
        lambda p: Snapshot.take(
            p,
            {"good": StateDict(t=torch.ones(10)), "lost": LostOn("take", cause, clock)},
            options=OPTIONS,
        ),
    )

    def async_take(p):
        from storage_plugins.fs import FSStoragePlugin

        if victim:  # this rank's disk fails under its background writes

            async def fail(self, *args, **kwargs):
                raise OSError("this rank's state cannot be read")

            FSStoragePlugin.write = FSStoragePlugin.write_observed = fail
        # Each rank's own values: every rank writes its own blob (replicated values would be
        # written by one rank).
        state = {"own": StateDict(t=torch.full((1 << 20,), float(rank)))}
        Snapshot.async_take(p, state, options=OPTIONS).wait()

    attempt("async_take", async_take)

    def restore(p):
        state = {"good": StateDict(t=torch.ones(10)), "lost": LostOn("never", cause, clock)}
        Snapshot.take(p, state, options=OPTIONS)
        Snapshot(p).restore(
            {"good": StateDict(t=torch.zeros(10)), "lost": LostOn("restore", cause, clock)},
            options=OPTIONS,
        )

    attempt("restore", restore)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_that_raises(tmp_path, world):
    results = run_ranks(world, _raises, str(tmp_path), timeout=120)
    for rank, steps in enumerate(results):
        for message, name, seconds in steps:
            assert f"failed on rank(s) [{VICTIM}]" in message, message
            assert "this rank's state cannot be read" in message, message
            assert seconds < RANK_TIMEOUT, (name, seconds)  # no waiting on the failed rank
            print(f"raise at {world} ranks during {name}: rank {rank} raised after {seconds:.2f} s")
    for name in ("take", "async_take"):  # nothing committed
        with pytest.raises(SnapshotNotFoundError):
            Snapshot(str(tmp_path / name))
