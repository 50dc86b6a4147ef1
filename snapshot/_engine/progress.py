"""The progress of one take or restore on this rank, reported as its bytes complete (the
``progress`` argument of ``Snapshot.take`` / ``async_take`` / ``restore``). Imported only when a
call asks for progress: a plain take or restore never enters this module.

``Reporter`` counts what completed and hands a ``snapshot.options.Progress`` record to the
caller's callable, or, for ``progress=True``, draws a bar (tqdm, on stderr, when stderr is a
terminal) or else logs a line each tenth of the bytes. ``Counting`` is the storage plugin a
take's writes go through: it reports each blob once written whole.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from snapshot.options import Progress

if TYPE_CHECKING:
    from snapshot._engine.io.pipeline import ReadRequest, WriteRequest
    from storage_plugins import Buffer, StoragePlugin

logger = logging.getLogger("snapshot")


class Reporter:
    """Reports one operation's progress on this rank (see the module). ``begin`` (the caller's
    thread) gives the totals; ``add`` runs on the thread that completed the bytes (the I/O
    thread), under a lock, so records reach the callable one at a time and in order; ``end``
    closes a bar.

    A callable that raises is logged once (a warning with its traceback) and not called again
    for this operation, which goes on as if no progress had been asked for.
    """

    def __init__(
        self, operation: str, progress: bool | Callable[[Progress], object], rank: int, ranks: int
    ) -> None:
        self.record = Progress(operation, "", rank, 0, 0, 0, 0)
        self._callback = progress if callable(progress) else None
        self._ranks = ranks
        self._lock = threading.Lock()
        self._bar: Any = None  # a tqdm bar, on a terminal
        self._tenth = -1  # the last tenth of the bytes logged, without a bar

    def begin(self, path: str, total_bytes: int, total_items: int) -> None:
        """The totals, once planned; reports that nothing is done yet."""
        with self._lock:
            self.record = dataclasses.replace(
                self.record, path=path, total_bytes=total_bytes, total_items=total_items
            )
            if self._callback is None and _terminal():
                self._bar = _bar(self._label(short=True), total_bytes)
            self._report(0)

    def add(self, nbytes: int) -> None:
        """One more item, of ``nbytes``, complete."""
        with self._lock:
            r = self.record
            self.record = dataclasses.replace(
                r, done_bytes=r.done_bytes + nbytes, done_items=r.done_items + 1
            )
            self._report(nbytes)

    def end(self) -> None:
        """The operation is over (done or failed): its bar, if any, is closed."""
        with self._lock:
            bar, self._bar = self._bar, None
        if bar is not None:
            bar.close()

    def _report(self, nbytes: int) -> None:
        record = self.record
        if self._callback is not None:
            try:
                self._callback(record)
            except Exception:
                self._callback = self._report_nothing
                logger.warning(
                    "%s: the progress callable raised; it is not called again for this %s, "
                    "which goes on", self._label(), record.operation, exc_info=True,
                )  # fmt: skip
        elif self._bar is not None:
            self._bar.update(nbytes)
        else:
            total = record.total_bytes
            tenth = record.done_bytes * 10 // total if total else 10
            if tenth > self._tenth:
                self._tenth = tenth
                logger.info(
                    "%s: %d%% (%.1f of %.1f MB, %d of %d items)",
                    self._label(), tenth * 10, record.done_bytes / 1e6, total / 1e6,
                    record.done_items, record.total_items,
                )  # fmt: skip

    @staticmethod
    def _report_nothing(record: Progress) -> None:
        """What a callable that raised is replaced with."""

    def _label(self, short: bool = False) -> str:
        """``"take /runs/a/step_9"``; ``short`` (a bar's, within a terminal's width): the last
        part of the path only, ``"take step_9"``."""
        r = self.record
        path = (r.path.rstrip("/").rsplit("/", 1)[-1] or r.path) if short else r.path
        return f"{r.operation} {path}" + (f" (rank {r.rank})" if self._ranks > 1 else "")

    # -- where the bytes complete ------------------------------------------------------------

    def counting(
        self, plugin: StoragePlugin, writes: Sequence[WriteRequest], path: str
    ) -> StoragePlugin:
        """``plugin``, reporting each blob of ``writes`` once written; ``begin`` called with
        their totals, at ``path``."""
        sizes = {w.blob: w.nbytes for w in writes}
        self.begin(path, sum(sizes.values()), len(sizes))
        return Counting(plugin, sizes, self)  # type: ignore[return-value]  # the same calls

    def watch(self, requests: Sequence[ReadRequest], path: str) -> None:
        """Makes each read of ``requests`` report its bytes once landed; ``begin`` called with
        their totals, at ``path``."""
        self.begin(path, sum(r.nbytes for r in requests), len(requests))
        for req in requests:
            req.done = functools.partial(self._landed, req.nbytes, req.done)

    def _landed(self, nbytes: int, done: Callable[[], None] | None) -> None:
        if done is not None:
            done()
        self.add(nbytes)


class Counting:
    """A take's storage plugin, reporting each blob to a ``Reporter`` once ``write`` or
    ``write_observed`` returned (a failed attempt that is retried reports nothing); every other
    attribute is the plugin's own."""

    def __init__(self, plugin: StoragePlugin, sizes: dict[str, int], reporter: Reporter) -> None:
        self._plugin = plugin
        self._sizes = sizes
        self._reporter = reporter

    def __getattr__(self, name: str) -> Any:
        return getattr(self._plugin, name)

    async def write(self, path: str, buffers: Sequence[Buffer]) -> None:
        await self._plugin.write(path, buffers)
        self._reporter.add(self._sizes[path])

    async def write_observed(
        self, path: str, buffers: Sequence[Buffer], observe: Callable[[memoryview], None]
    ) -> None:
        await self._plugin.write_observed(path, buffers, observe)
        self._reporter.add(self._sizes[path])


def _terminal() -> bool:
    """Whether stderr is a terminal (a bar is drawn there only)."""
    stream = sys.stderr
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError):  # a replaced stream without isatty, or a closed one
        return False


def _bar(label: str, total_bytes: int) -> Any:
    """A tqdm bar of ``total_bytes`` on stderr; None when tqdm is not installed (lines are
    logged instead)."""
    try:
        tqdm = importlib.import_module("tqdm").tqdm  # an optional dependency, without types
    except ImportError:
        logger.debug("tqdm is not installed: progress is logged instead of drawn")
        return None
    return tqdm(
        total=total_bytes, desc=label, unit="B", unit_scale=True, unit_divisor=1024,
        file=sys.stderr, dynamic_ncols=True,
    )  # fmt: skip
