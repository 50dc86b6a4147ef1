"""How a waiting rank tells a lost peer from a slow one (snapshot/_engine/dist/liveness.py), in one
process: the peers are threads beating (or not) into an in-memory store. The same logic across
real processes, frozen, killed and cut off: tests/test_rank_loss.py, tests/test_multihost.py."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from snapshot import InvalidArgumentError, Options
from snapshot._engine.dist import liveness
from snapshot.options import resolve


class Lost(Exception):
    pass


@pytest.fixture
def store(monkeypatch):
    """One in-memory store that every ``Watch`` of the test reads through."""
    shared = dist.HashStore()
    monkeypatch.setattr(liveness, "_default_store", lambda timeout: shared)
    return shared


def beat(store, rank: int, stop: threading.Event, every: float = 0.02) -> threading.Thread:
    def run() -> None:
        while not stop.wait(every):
            store.add(liveness.HEARTBEAT_KEY.format(rank), 1)

    store.add(liveness.HEARTBEAT_KEY.format(rank), 1)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def lost(why, failures):
    return Lost(why, failures)


def test_the_interval_is_a_twentieth_of_the_bound_within_limits():
    assert liveness.interval(60) == 0.5 and liveness.interval(3) == pytest.approx(0.15)
    assert liveness.interval(1) == 0.05 and liveness.interval(3600) == 0.5


def test_a_silent_peer_is_named_after_the_bound_and_the_group_is_broken(store):
    stop, release = threading.Event(), threading.Event()
    beat(store, 1, stop)  # alive, whatever it takes
    store.add(liveness.HEARTBEAT_KEY.format(2), 1)  # beat once, then silent
    watch = liveness.Watch(0, [0, 1, 2], rank_timeout=1.0, collective_timeout=600)
    start = time.monotonic()
    with pytest.raises(Lost) as info:
        watch.run(release.wait, lost)  # a collective that never completes by itself
    waited = time.monotonic() - start
    why, failures = info.value.args
    assert "rank(s) [2] fell silent" in why and list(failures) == [2], info.value
    assert 1.0 <= waited < 3.0, waited
    # Nothing more runs on a group with a collective left behind: the next call fails at once.
    with pytest.raises(Lost, match="fell silent"):
        watch.run(lambda: "never", lost)
    release.set()
    stop.set()


def test_collectives_run_on_one_kept_thread_of_the_group(store):
    """Each collective runs off the calling thread (which watches the heartbeats), on one
    thread the group keeps: starting a thread per collective cost every take a thread start
    per agreement."""
    stop = threading.Event()
    beat(store, 1, stop)
    watch = liveness.Watch(0, [0, 1], rank_timeout=1.0, collective_timeout=600)
    ran_on = {watch.run(threading.get_ident, lost) for _ in range(5)}
    assert len(ran_on) == 1 and threading.get_ident() not in ran_on
    assert watch.run(lambda: 42, lost) == 42
    with pytest.raises(Lost, match="boom"):  # a collective's own error, as gloo's would be
        watch.run(lambda: (_ for _ in ()).throw(RuntimeError("boom")), lost)
    stop.set()


def test_peers_silent_in_the_same_outage_are_named_together(store):
    """A host cut off stops its ranks' beats at once, but each last beat lands at its own time:
    when the first passes the bound, a peer still for half of it is named with it; a live one
    is not."""
    stop, stop_3, release = threading.Event(), threading.Event(), threading.Event()
    beat(store, 1, stop)  # alive throughout
    store.add(liveness.HEARTBEAT_KEY.format(2), 1)  # silent from the start
    beat(store, 3, stop_3)  # silent a third of the bound later
    threading.Timer(0.35, stop_3.set).start()
    watch = liveness.Watch(0, [0, 1, 2, 3], rank_timeout=1.0, collective_timeout=600)
    with pytest.raises(Lost) as info:
        watch.run(release.wait, lost)
    why, failures = info.value.args
    assert "rank(s) [2, 3] fell silent" in why and sorted(failures) == [2, 3], info.value
    still = {r: float(failures[r].split("for ")[1].split(" s")[0]) for r in (2, 3)}
    assert 1.0 <= still[2] < 3.0 and 0.5 <= still[3] < still[2], failures
    release.set()
    stop.set()


@pytest.mark.slow
def test_live_peers_are_waited_for_past_the_bound(store):
    stop = threading.Event()
    beat(store, 1, stop)
    watch = liveness.Watch(0, [0, 1], rank_timeout=1.0, collective_timeout=600)
    assert watch.run(lambda: time.sleep(2.5) or "done", lost) == "done"
    stop.set()


def test_a_failed_collective_names_the_peers_that_neither_beat_nor_left(store):
    stop = threading.Event()
    beat(store, 1, stop)  # alive
    store.add(liveness.HEARTBEAT_KEY.format(2), 1)  # raised and exited: it left on purpose
    store.set(liveness.LEFT_KEY.format(2), b"1")
    store.add(liveness.HEARTBEAT_KEY.format(3), 1)  # died
    watch = liveness.Watch(0, [0, 1, 2, 3], rank_timeout=1.0, collective_timeout=600)

    def collective():
        raise RuntimeError("Connection closed by peer")

    with pytest.raises(Lost) as info:
        watch.run(collective, lost)
    why, failures = info.value.args
    assert "rank(s) [3] stopped" in why and "Connection closed" in why, info.value
    assert failures == {3: "process ended"}, info.value
    assert store.check([liveness.LEFT_KEY.format(0)])  # this rank said it left, for the others
    stop.set()


def test_a_store_that_stops_answering_fails_the_wait(monkeypatch):
    class Gone:
        def multi_get(self, keys):
            raise RuntimeError("timed out after 1000ms")

    monkeypatch.setattr(liveness, "_default_store", lambda timeout: Gone())
    watch = liveness.Watch(0, [0, 1], rank_timeout=1.0, collective_timeout=600)
    with pytest.raises(Lost, match="store did not answer within 1 s"):
        watch.run(threading.Event().wait, lost)


def test_rank_timeout_is_an_option_and_an_environment_variable(monkeypatch):
    assert resolve(None).rank_timeout_secs == 60.0
    monkeypatch.setenv("STATESNAP_RANK_TIMEOUT_SECS", "5")
    assert resolve(None).rank_timeout_secs == 5.0
    assert resolve(Options(rank_timeout_secs=2.5)).rank_timeout_secs == 2.5
    with pytest.raises(InvalidArgumentError, match="rank_timeout_secs"):
        Options(rank_timeout_secs=0)
