"""How a rank waiting in a collective tells a lost peer from a slow one.

A peer whose process ended closes its connections, and gloo fails the collective at once; a
frozen peer, or one whose host went silent, closes nothing, and gloo would wait its whole
(long) timeout. So every process beats a heartbeat (``Heartbeat``: a counter of its own,
``statesnap/hb/<global rank>``, in the default group's store), and a rank runs each collective
on the group's collective thread (``Watch.run``) while it reads its peers' counters: a peer
whose counter has not moved for ``rank_timeout`` seconds of the reader's own clock is lost. The
rank then raises, leaves the collective behind, and marks the group broken (a later collective
could pair with the abandoned one). When the collective itself fails, the peers that do not
beat within a short window are the ones whose process ended.

The store is read through a clone of its own (a call never queues behind the application's)
whose timeout is ``rank_timeout``: a store that stops answering fails the wait within the same
bound.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from storage_plugins.base import DaemonThreadPool

logger = logging.getLogger(__name__)

T = TypeVar("T")

HEARTBEAT_KEY = "statesnap/hb/{}"
# Set by a rank whose collective failed, before it raises: a peer that stops beating after that
# left on purpose, it did not die.
LEFT_KEY = "statesnap/left/{}"


def interval(rank_timeout: float) -> float:
    """Seconds between two heartbeats, and between two reads of them: a twentieth of the bound
    (a live peer beats many times within it), within [0.05, 0.5] s."""
    return min(0.5, max(0.05, rank_timeout / 20))


def _default_store(timeout_secs: float) -> Any | None:
    """A connection of its own to the default group's store, whose calls wait ``timeout_secs``
    at most; None where there is none (then only gloo's timeouts bound a wait)."""
    try:
        from torch.distributed import distributed_c10d

        store: Any = distributed_c10d._get_default_store()
        store = store.clone()
        store.set_timeout(datetime.timedelta(seconds=timeout_secs))
        return store
    except Exception:  # a store without clone(), or torch without the helper
        logger.debug("no store for heartbeats: only gloo's timeout bounds waits", exc_info=True)
        return None


class Heartbeat:
    """This process's heartbeat (one per process, kept by the runtime)."""

    def __init__(self, global_rank: int, rank_timeout: float) -> None:
        self.key = HEARTBEAT_KEY.format(global_rank)
        self.every = interval(rank_timeout)
        self.stopped = threading.Event()  # set to stop it
        store = _default_store(max(rank_timeout, 1.0))
        if store is not None:
            store.add(self.key, 1)  # the key exists before any peer reads it
            with contextlib.suppress(Exception):  # left there by an earlier run of this rank
                store.delete_key(LEFT_KEY.format(global_rank))
            threading.Thread(
                target=self._beat, args=(store,), name="statesnap-heartbeat", daemon=True
            ).start()

    def _beat(self, store: Any) -> None:
        failed = False
        while not self.stopped.wait(self.every):
            try:
                store.add(self.key, 1)
                failed = False
            except Exception:  # the store unreachable (a waiting peer reports it), or gone
                if not failed:
                    logger.debug("heartbeat: the store does not answer", exc_info=True)
                failed = True


class Watch:
    """The collectives of one gloo group of the library's, each run on the group's collective
    thread while the calling thread watches the peers' heartbeats."""

    def __init__(
        self, rank: int, global_ranks: list[int], rank_timeout: float, collective_timeout: float
    ) -> None:
        self.rank = rank
        self.collective_timeout = collective_timeout  # the gloo group's, for messages
        self.peers = [r for r in range(len(global_ranks)) if r != rank]
        self.keys = [HEARTBEAT_KEY.format(global_ranks[r]) for r in self.peers]
        self.left_keys = [LEFT_KEY.format(global_ranks[r]) for r in self.peers]
        self.left_key = LEFT_KEY.format(global_ranks[rank])
        self.rank_timeout = rank_timeout
        self.store = _default_store(rank_timeout)
        self.broken: str | None = None  # why no collective may run on the group any more
        self._thread: DaemonThreadPool | None = None

    def set_timeout(self, rank_timeout: float) -> None:
        if rank_timeout != self.rank_timeout and self.store is not None:
            self.store.set_timeout(datetime.timedelta(seconds=rank_timeout))
        self.rank_timeout = rank_timeout

    def run(
        self, collective: Callable[[], T], lost: Callable[[str, dict[int, str]], Exception]
    ) -> T:
        """``collective()``'s result. Raises ``lost(why, failures)`` (failed rank -> why) when
        a peer (or the store) falls silent while it waits, or when the collective fails: a
        peer's process ended (those whose heartbeat stopped, when the store can tell), or a
        live peer did not arrive within the group's timeout."""
        if self.broken is not None:
            raise lost(self.broken, {})
        future = self._start(collective)
        store = self.store  # None: only gloo's timeout bounds the wait
        seen: dict[int, tuple[bytes, float]] = {}
        while True:
            try:
                return future.result(timeout=None if store is None else interval(self.rank_timeout))
            except concurrent.futures.TimeoutError:
                pass
            except RuntimeError as e:  # gloo's: a peer's connection closed, or its timeout
                self.broken = f"an earlier collective of the group failed ({e})"
                dead = [] if store is None else self._stopped_beating(store)
                who = (
                    f"rank(s) {dead} stopped (their process ended)"
                    if dead
                    else "a rank's process ended, or a live rank did not arrive within "
                    f"{self.collective_timeout:g} s (Options.collective_timeout_secs, "
                    "STATESNAP_COLLECTIVE_TIMEOUT_SECS)"
                )
                raise lost(f"{who} (gloo said: {e})", {r: "process ended" for r in dead}) from e
            assert store is not None
            try:
                silent = self._silent(store, seen)
            except Exception as e:  # the store's own timeout, or its connection gone
                self.broken = (
                    f"the process group's store did not answer within {self.rank_timeout:g} s "
                    f"(the host serving it, rank 0's usually, is unreachable or gone): {e}"
                )
                raise lost(self.broken, {}) from e
            if silent:
                why = f"no heartbeat for {self.rank_timeout:g} s"
                self.broken = (
                    f"rank(s) {sorted(silent)} fell silent: {why} (Options.rank_timeout_secs, "
                    "STATESNAP_RANK_TIMEOUT_SECS); a process frozen or its host unreachable"
                )
                failures = {
                    r: f"no heartbeat for {still:.1f} s (process frozen, or its host unreachable)"
                    for r, still in sorted(silent.items())
                }
                # This rank leaves on purpose: a slower peer, whose collective fails once this
                # process has exited, must not count it among the ranks that died.
                with contextlib.suppress(Exception):
                    store.set(self.left_key, b"1")
                raise lost(self.broken, failures)

    def _start(self, collective: Callable[[], T]) -> concurrent.futures.Future[T]:
        """``collective()`` running on the group's one daemon thread, made on first use and
        kept (a thread per collective cost a thread start each time): one left behind waiting
        for a silent peer must not keep the process from exiting, and once one is left behind
        the group is broken, so no later collective queues behind it."""
        if self._thread is None:
            self._thread = DaemonThreadPool(1, thread_name_prefix="statesnap-collective")
        return self._thread.submit(collective)

    def _silent(self, store: Any, seen: dict[int, tuple[bytes, float]]) -> dict[int, float]:
        """Peer -> seconds its heartbeat has not moved (of this rank's clock, counted from this
        wait's first read at the earliest), once one peer's reaches ``rank_timeout``; {} before.
        With it go the peers still for half the bound or more: a live peer beats every
        ``interval``, so those missed ten beats in a row and are in the same outage (a host
        cut off stops all its ranks' beats at once, but each last beat landed at its own time).
        """
        now = time.monotonic()
        still: dict[int, float] = {}
        for peer, value in zip(self.peers, store.multi_get(self.keys), strict=True):
            last = seen.get(peer)
            if last is None or last[0] != value:
                seen[peer] = (value, now)
            else:
                still[peer] = now - last[1]
        if not any(s >= self.rank_timeout for s in still.values()):
            return {}
        return {p: s for p, s in still.items() if s >= self.rank_timeout / 2}

    def _stopped_beating(self, store: Any) -> list[int]:
        """After the collective failed: the peers that neither beat within a short window nor
        left on purpose (a peer that raised first may have exited since): those whose process
        ended; [] when the store cannot say."""
        every = interval(self.rank_timeout)
        try:
            store.set(self.left_key, b"1")
            first = store.multi_get(self.keys)
            known = [False] * len(self.peers)  # beat, or left
            deadline = time.monotonic() + max(2.5 * every, 1.0)
            while True:
                known = [
                    k or store.check([left]) for k, left in zip(known, self.left_keys, strict=True)
                ]
                if all(known) or time.monotonic() >= deadline:
                    break
                time.sleep(every / 2)
                now = store.multi_get(self.keys)
                known = [k or a != b for k, a, b in zip(known, first, now, strict=True)]
        except Exception:
            return []
        return [peer for peer, k in zip(self.peers, known, strict=True) if not k]
