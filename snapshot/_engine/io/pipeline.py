"""The I/O of a take and a restore: ``WritePipeline`` executes a take's ``WriteRequest``s
(staged on the caller's thread under a byte budget, written on the I/O loop while the next ones
stage); ``read_all`` performs a restore's ``ReadRequest``s (segments into memory that callbacks
supply) on the I/O loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate, compress
from typing import TYPE_CHECKING

from snapshot._engine.io.storage_calls import call, call_digesting
from snapshot._engine.runtime import BudgetShare, ByteBudget, io_loop, run
from storage_plugins import Buffer, StoragePlugin

if TYPE_CHECKING:
    from snapshot.options import Options

logger = logging.getLogger(__name__)


def plugin_location(plugin: StoragePlugin) -> str:
    """The snapshot's location as messages name it."""
    return plugin.describe("").rstrip("/")


@dataclass(frozen=True, slots=True)
class IOStats:
    """What a batch of requests moved."""

    blobs: int
    nbytes: int
    seconds: float
    peak_budget_bytes: int

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


# ---------------------------------------------------------------------------------------------
# Writes.


@dataclass(slots=True)
class WriteRequest:
    """One blob to write. ``stage`` (on the caller's thread) returns the buffers whose
    concatenation is the blob, and an object to keep alive until it is written (a lease is
    released then); ``staging_bytes`` is what it allocates, held against the budget until the
    write ends. The plugin computes the CRC-32 of each ``(offset, nbytes)`` of
    ``checksum_ranges`` as it writes, kept in the pipeline's ``checksums`` by ``(blob, offset)``.
    ``encode``, if set, turns the staged buffers into those written, on a worker thread of the
    I/O loop, while the write holds its slot (compression).
    """

    blob: str
    nbytes: int
    staging_bytes: int
    stage: Callable[[], tuple[Sequence[Buffer], object]]
    label: str
    checksum_ranges: Sequence[tuple[int, int]] = ()
    encode: Callable[[Sequence[Buffer]], Sequence[Buffer]] | None = None


# A staged write: the request, its buffers, what to keep alive.
_Staged = tuple[WriteRequest, Sequence[Buffer], object]


class WritePipeline:
    """Stages write requests on the caller's thread and writes them on the I/O loop:
    ``submit`` each (blocks only while the staging budget is full), then ``flush`` and
    ``await wait()`` on the I/O loop; ``abort`` on failure.

    Staged writes go to the loop in batches of ``batch_bytes``; with None they are held until
    ``flush`` (or until the budget is full): async take's writes start once its caller is free.
    The budget is ``budget_bytes`` of its own, or ``budget``, a share of one that pending async
    takes charge too; ``options`` give each write's retries and deadline (``call``).
    """

    def __init__(
        self,
        plugin: StoragePlugin,
        *,
        budget_bytes: int,
        max_concurrency: int,
        batch_bytes: int | None,
        options: Options,
        budget: BudgetShare | None = None,
    ) -> None:
        self._plugin = plugin
        self._options = options
        self._loop = io_loop()
        self.budget = BudgetShare(ByteBudget(budget_bytes)) if budget is None else budget
        self._batch: list[_Staged] = []
        self._batch_bytes = 0
        self._batch_limit = batch_bytes
        self._error: BaseException | None = None
        self._nbytes = 0
        self._blobs = 0
        # (blob, offset) -> CRC-32 of each range of ``checksum_ranges`` written so far.
        self.checksums: dict[tuple[str, int], int] = {}
        self._start = time.perf_counter()
        # One task per write handed over, ``max_concurrency`` of them writing at once.
        self._slots = asyncio.Semaphore(max_concurrency)
        self._tasks: list[asyncio.Task[None]] = []
        self._pid = os.getpid()  # a forked child's copy leaves its parent's writes alone

    async def _write_staged(
        self, req: WriteRequest, buffers: Sequence[Buffer], keepalive: object
    ) -> None:
        plugin, ranges = self._plugin, req.checksum_ranges
        try:
            async with self._slots:
                if self._error is not None:
                    return
                if req.encode is not None:
                    buffers = await asyncio.to_thread(req.encode, buffers)
                if not ranges:
                    op = functools.partial(plugin.write, req.blob, buffers)
                    await call(plugin, "write", req.blob, req.label, op, options=self._options)
                else:
                    values = await call_digesting(
                        plugin, "write", req.blob, req.label, ranges,
                        lambda digest: plugin.write_observed(req.blob, buffers, digest),
                        options=self._options,
                    )  # fmt: skip
                    for (offset, _), value in zip(ranges, values, strict=True):
                        self.checksums[(req.blob, offset)] = value
                self._nbytes += req.nbytes
                self._blobs += 1
        except Exception as e:  # already the library's error (``call`` converts)
            self._fail(e)
        finally:
            _release(keepalive)
            self.budget.release(req.staging_bytes)

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self.budget.abort(self._error)

    def _enqueue(self, batch: list[_Staged]) -> None:
        self._tasks += [self._loop.create_task(self._write_staged(*item)) for item in batch]

    def ready(self) -> None:
        """Waits for the copies into the pooled buffers of what is staged (``Lease.ready``),
        and raises the error of one that failed. Last first: the copier thread takes them
        first first, and this thread makes those it has not started (``Lease.ready``)."""
        for _, _, keepalive in reversed(self._batch):
            ready = getattr(keepalive, "ready", None)
            if ready is not None:
                ready()

    def flush(self) -> None:
        """Hands what is staged to the I/O loop, once its copies have landed (``ready``)."""
        if self._batch:
            self.ready()
            batch, self._batch, self._batch_bytes = self._batch, [], 0
            self._loop.call_soon_threadsafe(self._enqueue, batch)

    def submit(self, req: WriteRequest) -> None:
        """Stages ``req`` (waiting for budget if needed) and queues its write."""
        if self._error is not None:
            raise self._error
        if not self.budget.try_acquire(req.staging_bytes):
            self.flush()  # what is staged must start writing, or the budget never frees
            self.budget.acquire(req.staging_bytes)
        try:
            buffers, keepalive = req.stage()
        except BaseException:
            self.budget.release(req.staging_bytes)
            raise
        self._batch.append((req, buffers, keepalive))
        self._batch_bytes += req.nbytes
        if self._batch_limit is not None and self._batch_bytes >= self._batch_limit:
            self.flush()

    async def wait(self) -> IOStats:
        """On the I/O loop, after the last ``flush``: waits until every queued write is done,
        and raises the first error any of them met."""
        await asyncio.gather(*self._tasks)
        self.budget.close()  # a share gives back what it still holds
        if self._error is not None:
            raise self._error
        seconds = time.perf_counter() - self._start
        return IOStats(self._blobs, self._nbytes, seconds, self.budget.peak)

    def _drop_batch(self) -> None:
        """Gives back what is staged and not handed over (a shared budget outlives this)."""
        for req, _, keepalive in self._batch:
            _release(keepalive)
            self.budget.release(req.staging_bytes)
        self._batch = []

    def abort(self, error: BaseException) -> None:
        """Stops writing (what is staged or queued is dropped) and waits for the writes under
        way to end."""
        self._drop_batch()
        self._fail(error)  # the writes not yet started are skipped
        try:
            run(self.wait())
        except Exception:
            logger.debug("error while draining aborted writes", exc_info=True)

    def stop(self, error: BaseException) -> None:
        """Ends a pipeline that nobody will wait for (its take was dropped unfinished): what is
        staged is given back, and the writes handed over that have not started are skipped.
        Once drained, nothing is left to end; nothing in a forked child."""
        if os.getpid() == self._pid:
            self._drop_batch()
            self._fail(error)


def _release(keepalive: object) -> None:
    """Gives back a staged write's pooled buffer (a ``Lease``), if it has one."""
    release = getattr(keepalive, "release", None)
    if release is not None:
        release()


# ---------------------------------------------------------------------------------------------
# Reads.


@dataclass(slots=True)
class Segment:
    """``nbytes`` consecutive bytes of a read, into ``dest()`` (scratch for a gap between two
    wanted ranges). ``verify``, when set, is given the CRC-32 of what landed before the read's
    ``done`` runs, and raises if those are not the bytes expected. ``owner``: the app_state key
    whose live state the bytes land in, None for a gap."""

    nbytes: int
    dest: Callable[[], memoryview] | None
    verify: Callable[[int], None] | None = None
    owner: str | None = None


@dataclass(slots=True)
class ReadRequest:
    """One scatter read of ``blob`` from ``offset`` on, into ``segments`` in order. The
    ``dest`` calls run on the I/O loop just before the read and allocate ``scratch_bytes``
    (held against the budget), which ``done``, run once the bytes have landed, frees.
    """

    blob: str
    offset: int
    segments: list[Segment]
    scratch_bytes: int
    done: Callable[[], None] | None
    label: str

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments)


async def read_all(
    plugin: StoragePlugin,
    requests: Iterable[ReadRequest],
    *,
    budget_bytes: int,
    max_concurrency: int,
    options: Options,
) -> IOStats:
    """Performs every read request on the running loop; the first error stops the rest
    (``options``: each read's retries and deadline, ``call``)."""
    budget = ByteBudget(budget_bytes)
    pending = iter(requests)
    done: list[ReadRequest] = []
    errors: list[BaseException] = []  # the first one stops every worker
    start = time.perf_counter()

    async def worker() -> None:
        for req in pending:
            if errors:
                return
            held = 0
            try:
                await budget.acquire_async(req.scratch_bytes)
                held = req.scratch_bytes
                await _read(plugin, req, options)
                if req.done is not None:
                    req.done()
                done.append(req)
            except BaseException as e:
                errors.append(e)
                budget.abort(e)
                return
            finally:
                budget.release(held)

    await asyncio.gather(*(worker() for _ in range(max_concurrency)))
    if errors:
        raise errors[0]
    nbytes = sum(req.nbytes for req in done)
    return IOStats(len(done), nbytes, time.perf_counter() - start, budget.peak)


async def _read(plugin: StoragePlugin, req: ReadRequest, options: Options) -> None:
    """One read request into its segments' ``dest()``s, then each segment's ``verify``."""
    outs = [s.dest() for s in req.segments]  # type: ignore[misc]  # set once planned
    verifiers = [s.verify for s in req.segments]
    if not any(verifiers):
        op = functools.partial(plugin.readv, req.blob, req.offset, outs)
        await call(plugin, "read", req.blob, req.label, op, options=options)
        return
    sizes = [s.nbytes for s in req.segments]
    starts = accumulate(sizes, initial=0)  # one more value than sizes: zip stops first
    ranges = list(compress(zip(starts, sizes, strict=False), verifiers))
    values = await call_digesting(
        plugin, "read", req.blob, req.label, ranges,
        lambda digest: plugin.readv_observed(req.blob, req.offset, outs, digest),
        options=options,
    )  # fmt: skip
    for verify, value in zip([v for v in verifiers if v is not None], values, strict=True):
        verify(value)
