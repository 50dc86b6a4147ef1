"""A peer lost while the memory tier copies parts: killed outright (SIGKILL) or frozen
(SIGSTOP: alive to the kernel, silent to its peers) as its replication of step 1 starts. The
survivor's ``wait()`` raises RankFailedError naming the lost rank, within the bound the library
states: at once for a process that ended, ``rank_timeout_secs`` for a silent one (not the
collective timeout, ten minutes by default)."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch

from snapshot import CheckpointManager, MemoryTier, Options, RankFailedError, StateDict
from tests.multirank import run_ranks
from tests.test_rank_loss import VICTIM, _lose, _since

pytestmark = pytest.mark.slow  # real processes (gloo), one lost

RANK_TIMEOUT = {"kill": 20.0, "stop": 3.0}  # a kill must be found long before its bound


def _copy(rank: int, world: int, root: str, base: str, cause: str, clock: str) -> Any:
    from snapshot._engine.manager.tier import Tier

    if rank == VICTIM:
        exchange = Tier._exchange

        def lost_in_exchange(self: Tier, outgoing: Any, incoming: Any) -> Any:
            if outgoing or incoming:  # the parts' copy, not an agreement
                _lose(cause, clock)
            return exchange(self, outgoing, incoming)

        Tier._exchange = lost_in_exchange  # type: ignore[method-assign]
    host = "ab"[rank]
    tier = MemoryTier(dir=os.path.join(base, host), host=host, durable_every=2)
    options = Options(rank_timeout_secs=RANK_TIMEOUT[cause])
    manager = CheckpointManager(root, memory_tier=tier, options=options)
    manager.save(1, {"s": StateDict(t=torch.ones(1 << 16))})
    try:
        manager.wait()  # the replication of step 1 (closing would wait in collectives too)
    except RankFailedError as e:
        return str(e), dict(e.failures), _since(clock)
    raise AssertionError("the copy did not fail")


@pytest.mark.parametrize("cause", ["kill", "stop"])
def test_a_peer_lost_mid_copy_fails_the_survivor_within_the_bound(tmp_path, cause):
    clock = str(tmp_path / "clock")
    t = time.monotonic()
    out = run_ranks(
        2,
        _copy,
        str(tmp_path / "root"),
        str(tmp_path / "tier"),
        cause,
        clock,
        timeout=120,
        expect_dead=frozenset({VICTIM}),
    )
    message, failures, seconds = out[0]
    assert VICTIM in failures, (message, failures)
    assert f"rank(s) [{VICTIM}]" in message and "memory tier" in message, message
    if cause == "kill":
        assert seconds < RANK_TIMEOUT["kill"] / 2, (seconds, message)
    else:
        assert RANK_TIMEOUT["stop"] * 0.9 <= seconds < RANK_TIMEOUT["stop"] + 10, (seconds, message)
    assert time.monotonic() - t < 100
