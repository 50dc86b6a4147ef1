"""The staging of a take's bytes, on the caller's thread (what each write request's ``stage``
runs, just before its blob is written), and the byte budgets of the writes and reads in flight.

Without a pool (take), a payload of a blob of its own is written from a view of its tensor's
memory (``stage_payload``), or from a gathered copy when its tensor cannot be viewed
(``TensorSource`` pieces: prepared, conjugate or negated, non-contiguous, on a device); a slab's
members are copied into one buffer, which is written (``stage_slab``). With a ``StagingPool``
(async take), every payload of a write is copied into one pooled buffer (``_pooled``), so that
nothing written later reads the application's memory. A slab's members get their CRC-32s here,
from the copy that is written (see ``plan.Placer``). ``stager(pool)`` is what the take
gives its placers (``plan.Stager``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from snapshot._engine.format.serialization import (
    as_copyable,
    crc32,
    dtype_name,
    gather_elements,
    range_views,
    scatter_into_flat,
    tensor_memoryview,
)
from snapshot._engine.handlers.dense import call_prepare
from snapshot._engine.io import device
from snapshot._engine.io.staging import Lease, StagingPool
from snapshot._engine.take.plan import ALIGN, Payload, Slab, Staged, Stager, TensorSource
from snapshot.errors import UnsupportedValueError

if TYPE_CHECKING:
    from snapshot._engine.io.staging import Lease, StagingPool

logger = logging.getLogger(__name__)

_ZEROS = memoryview(bytes(ALIGN))

# Up to this size a payload is copied by a slice assignment of its bytes; above it, torch's
# copy spreads the bytes over its threads.
_SMALL_COPY = 1 << 20


def stager(pool: StagingPool | None) -> Stager:
    """How placed blobs are staged: from the payloads' own memory, or, with ``pool`` (async
    take), through pooled buffers."""
    return _Direct() if pool is None else _Pooled(pool)


class _Direct:
    """Writes a blob of its own from its payload's memory (a view; a gathered copy of a
    tensor that cannot be viewed, which costs its bytes of staging memory), a slab from a
    copy of its members (``stage_slab``)."""

    pooled = False

    def blob(self, p: Payload, from_device: bool) -> tuple[Callable[[], Staged], int]:
        return functools.partial(stage_payload, p), p.staging_bytes

    def slab(self, slab: Slab, checksums: bool) -> tuple[Callable[[], Staged], int]:
        # A copy of the slab, and at most its gathered copies besides.
        return functools.partial(stage_slab, slab, checksums), slab.nbytes + slab.staging_bytes

    def settle(self) -> None:
        pass  # every stage is done when it returns


class _Pooled:
    """Copies each write's payloads into one buffer of ``pool``; a pooled write costs the
    budget its whole block (``StagingPool.block_bytes``)."""

    pooled = True

    def __init__(self, pool: StagingPool) -> None:
        self.pool = pool

    def blob(self, p: Payload, from_device: bool) -> tuple[Callable[[], Staged], int]:
        stage = _pooled(self.pool, [(0, p)], p.nbytes, False, from_device)
        return stage, self.pool.block_bytes(p.nbytes, from_device)

    def settle(self) -> None:
        pass  # every copy from host memory is done when its stage returns

    def slab(self, slab: Slab, checksums: bool) -> tuple[Callable[[], Staged], int]:
        stage = _pooled(self.pool, slab.members, slab.nbytes, checksums, slab.from_device)
        return stage, self.pool.block_bytes(slab.nbytes, slab.from_device)


def stage_payload(p: Payload) -> Staged:
    """Buffers to write a payload from, and what must stay alive while they are written."""
    t = p.tensor
    if t is not None:
        return [payload_view(p)], t
    if p.data is not None:
        return [p.data], None
    assert p.source is not None
    return piece(p.source, p.start, p.stop)


def payload_view(p: Payload) -> memoryview:
    """The bytes of a payload of a contiguous CPU tensor (``p.tensor``, which the payload's
    bytes lie in from ``p.address`` on), as a view of the tensor's memory."""
    assert p.tensor is not None
    at = p.address - p.tensor.data_ptr() if p.nbytes else 0
    return tensor_memoryview(p.tensor)[at : at + p.nbytes]


def copy_payload(p: Payload, buf: torch.Tensor, pos: int) -> None:
    """Copies a payload's bytes into ``buf[pos : pos + nbytes]`` of a staging buffer ``buf``
    (a 1-d uint8 CPU tensor), from host memory (a source's: ``copy_source``)."""
    nbytes = p.nbytes
    if p.tensor is None and p.data is None:
        assert p.source is not None
        copy_source(p.source, p.start, p.stop, buf, pos)
        return
    src = payload_view(p) if p.tensor is not None else memoryview(p.data or b"").cast("B")
    dst = buf[pos : pos + nbytes]
    if nbytes <= _SMALL_COPY:
        tensor_memoryview(dst)[:] = src
    else:
        dst.copy_(torch.frombuffer(src, dtype=torch.uint8))


def stage_slab(slab: Slab, checksums: bool) -> Staged:
    """A slab's bytes, copied into one new buffer (zeros in the padding between members); with
    ``checksums``, each member's CRC-32, of that copy (what is written, even while another
    thread changes the tensors), goes to its ``crc32``."""
    out = memoryview(bytearray(slab.nbytes))  # zeroed: the padding
    pos = 0
    for pad, p in slab.members:
        pos += pad
        nbytes = p.nbytes
        if p.tensor is not None:  # most members: a tensor's memory
            out[pos : pos + nbytes] = payload_view(p)
        else:
            bufs, keepalive = stage_payload(p)
            at = pos
            for b in bufs:
                view = memoryview(b).cast("B")
                out[at : at + len(view)] = view
                at += len(view)
            del bufs, keepalive  # a gathered copy is freed before the next member's
        if checksums:
            p.crc32 = crc32(out[pos : pos + nbytes])
        pos += nbytes
    return [out], None


def _pooled(
    pool: StagingPool,
    members: list[tuple[int, Payload]],
    nbytes: int,
    checksums: bool,
    from_device: bool,
) -> Callable[[], Staged]:
    """Stages ``members`` by copying them into one buffer of ``pool`` (pinned when
    ``from_device``); with ``checksums``, each member's CRC-32 goes to its ``crc32``, taken
    once its bytes are there: right after a copy from host memory, after ``lease.ready()`` for
    a (non-blocking) copy from a device. A stage that fails releases its lease, which first
    waits for the copies already issued into it."""

    def stage() -> Staged:
        lease = pool.acquire(nbytes, from_device)
        try:
            buf = lease.tensor
            view = lease.view
            pos = 0
            late: list[tuple[int, Payload]] | None = None  # copies still in flight
            for pad, p in members:
                if pad:
                    view[pos : pos + pad] = _ZEROS[:pad]
                    pos += pad
                source = p.source
                if source is None:  # host memory: a tensor's, an object's bytes
                    copy_payload(p, buf, pos)
                    if checksums:
                        p.crc32 = crc32(view[pos : pos + p.nbytes])
                elif copy_source(source, p.start, p.stop, buf, pos, lease):
                    if checksums:  # issued from a device: readable after ``ready``
                        if late is None:
                            late = []
                        late.append((pos, p))
                elif checksums:
                    p.crc32 = crc32(view[pos : pos + p.nbytes])
                pos += p.nbytes
            lease.ready()
            if late is not None:
                for at, p in late:
                    p.crc32 = crc32(view[at : at + p.nbytes])
        except BaseException:
            lease.release()  # waits for the copies already issued before lending it again
            raise
        return [lease.view], lease

    return stage


# ---------------------------------------------------------------------------------------------
# The bytes of a ``TensorSource``, piece by piece (element ranges).


def _resolve(source: TensorSource) -> torch.Tensor:
    """The tensor whose elements are written: the prepare function's (checked against what it
    returned when tracing), detached, conjugate and negation resolved; kept from the first
    piece this rank stages to the last."""
    if source.base is not None:
        return source.base
    t = source.tensor
    if source.prepare is not None:
        t = call_prepare(source.prepare, source.path, source.logical, t, tracing=False)
        if t.dtype != source.dtype or tuple(t.shape) != source.shape:
            raise UnsupportedValueError(
                f"{source.path}: _custom_tensor_prepare_func returned {dtype_name(t.dtype)}"
                f"{list(t.shape)} when tracing but {dtype_name(source.dtype)}"
                f"{list(source.shape)} when preparing; both calls must agree"
            )
    t = as_copyable(t.detach())
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    source.base = t
    return t


def piece(source: TensorSource, start: int, stop: int) -> Staged:
    """Elements ``[start, stop)`` as a new contiguous CPU tensor's bytes (a view when the
    resolved tensor already is one)."""
    try:
        base = _resolve(source)
        if base.is_cpu and base.is_contiguous():
            part = base.view(-1)[start:stop]
        else:
            part = gather_elements(base, start, stop)
    except RuntimeError as e:
        raise _unreadable(source, e) from e
    finally:
        _staged_one(source)
    return [tensor_memoryview(part)], part


def copy_source(
    source: TensorSource,
    start: int,
    stop: int,
    buf: torch.Tensor,
    pos: int,
    lease: Lease | None = None,
) -> bool:
    """Copies elements ``[start, stop)`` into the uint8 staging buffer ``buf`` at ``pos``.

    From host memory the copy is done when this returns (False). From a CUDA device with a
    ``lease`` (``buf`` is its tensor), the copies are issued on the lease's staging stream
    for that device, after the work queued on the device's current stream, non-blocking
    when the buffer is pinned; this returns True and the bytes may be read only after
    ``lease.ready()``. Without a lease, a device's copies are synchronous.
    """
    dst = buf[pos : pos + (stop - start) * source.dtype.itemsize]
    try:
        base = _resolve(source)
        if base.is_cpu and base.is_contiguous():
            # As raw bytes: works for dtypes torch has no copy kernel for.
            dst.copy_(base.view(-1)[start:stop].view(torch.uint8))
            return False
        flat = dst.view(base.dtype)
        views = range_views(base, start, stop)
        index = device.cuda_index(base)
        if index is None:  # host memory (not contiguous), or another device type
            scatter_into_flat(flat, views)
            return False
        if lease is None:
            _copy_from_device(flat, views, False)
            return False
        # Queued on the device's staging stream, after its current stream's kernels;
        # ``Lease.ready`` waits for them. The lease keeps ``base`` (maybe a prepared tensor
        # of no other owner, whose memory CUDA could reuse) alive until then.
        with device.use_stream(lease.stream(index, base)):
            _copy_from_device(flat, views, lease.pinned)
        return True
    except RuntimeError as e:
        raise _unreadable(source, e) from e
    finally:
        _staged_one(source)


def _unreadable(source: TensorSource, e: Exception) -> UnsupportedValueError:
    return UnsupportedValueError(
        f"{source.path}: cannot read this {dtype_name(source.dtype)} tensor on "
        f"{source.tensor.device}: {e}"
    )


def _staged_one(source: TensorSource) -> None:
    source.remaining -= 1
    if source.remaining == 0:
        source.base = None


def _copy_from_device(flat: torch.Tensor, views: list[torch.Tensor], non_blocking: bool) -> None:
    """Copies ``views`` (of a device's memory), laid end to end, into the 1-d host tensor
    ``flat``, on the device's current stream (``device.copy``)."""
    pos = 0
    for v in views:
        n = v.numel()
        device.copy(flat[pos : pos + n].view(v.shape), v, non_blocking)
        pos += n


# ---------------------------------------------------------------------------------------------
# Byte budgets: how much memory the writes and reads in flight may hold at once.


class ByteBudget:
    """Bytes of memory that may be held at once, shared by the caller's thread and the I/O loop.

    A request larger than the whole budget is admitted when nothing else is held, so it runs
    alone rather than never. ``abort`` wakes every waiter with an error.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._used = 0
        self._peak = 0
        self._cond = threading.Condition()
        self._async_waiters: deque[tuple[int, asyncio.AbstractEventLoop, asyncio.Future[None]]] = (
            deque()
        )
        self._error: BaseException | None = None

    @property
    def peak(self) -> int:
        """The most bytes held at once so far."""
        return self._peak

    @property
    def used(self) -> int:
        """The bytes held now."""
        return self._used

    def _fits(self, n: int) -> bool:
        return self._used == 0 or self._used + n <= self.capacity

    def _take(self, n: int) -> None:
        self._used += n
        self._peak = max(self._peak, self._used)

    def try_acquire(self, n: int) -> bool:
        with self._cond:
            if self._error is not None:
                raise self._error
            if n == 0 or (not self._async_waiters and self._fits(n)):
                self._take(n)
                return True
            return False

    def acquire(self, n: int, stop: Callable[[], BaseException | None] | None = None) -> None:
        """Blocks the calling thread until ``n`` bytes fit.

        ``stop`` (checked whenever the waiter wakes, ``wake`` included) returns an error that
        ends the wait instead: a ``BudgetShare`` aborted while this budget is not.
        """
        with self._cond:
            while self._error is None and not (n == 0 or self._fits(n)):
                if stop is not None and (error := stop()) is not None:
                    raise error
                self._cond.wait()
            if self._error is not None:
                raise self._error
            self._take(n)

    def wake(self) -> None:
        """Wakes the threads waiting in ``acquire``, so they check their ``stop`` again."""
        with self._cond:
            self._cond.notify_all()

    async def acquire_async(self, n: int) -> None:
        """Waits on the running loop until ``n`` bytes fit."""
        if self.try_acquire(n):
            return
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._cond:
            if self._error is not None:
                raise self._error
            if self._fits(n) and not self._async_waiters:
                self._take(n)
                return
            self._async_waiters.append((n, loop, future))
        await future

    def release(self, n: int) -> None:
        with self._cond:
            self._used -= n
            self._cond.notify_all()
            while self._async_waiters and self._fits(self._async_waiters[0][0]):
                want, loop, future = self._async_waiters.popleft()
                self._take(want)
                loop.call_soon_threadsafe(self._grant, future, want)

    def _grant(self, future: asyncio.Future[None], n: int) -> None:
        if future.cancelled():
            self.release(n)  # the waiter gave up after being granted: hand the bytes back
        else:
            future.set_result(None)

    def abort(self, error: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()
            waiters, self._async_waiters = self._async_waiters, deque()
        for _, loop, future in waiters:
            loop.call_soon_threadsafe(_fail_future, future, error)


class BudgetShare:
    """One write pipeline's part of a ``ByteBudget`` that several share (the staging pool's:
    async takes pending at once stage at most one budget together).

    Bytes are charged to the shared budget and counted here too (a pipeline's peak and leftover
    are its own); ``abort`` fails only this share's waiters (one take's write error must not
    fail the next take's staging).
    """

    def __init__(self, shared: ByteBudget) -> None:
        self.shared = shared
        self._used = 0
        self._peak = 0
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    @property
    def peak(self) -> int:
        """The most bytes this share held at once."""
        return self._peak

    def _took(self, n: int) -> None:
        with self._lock:
            self._used += n
            self._peak = max(self._peak, self._used)

    def try_acquire(self, n: int) -> bool:
        if self._error is not None:
            raise self._error
        if not self.shared.try_acquire(n):
            return False
        self._took(n)
        return True

    def acquire(self, n: int) -> None:
        """Blocks until ``n`` bytes fit in the shared budget (one larger than the whole budget,
        when nothing is held: the caller flushes its own writes first)."""
        self.shared.acquire(n, stop=lambda: self._error)
        self._took(n)

    def release(self, n: int) -> None:
        with self._lock:
            self._used -= n
        self.shared.release(n)

    def abort(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self.shared.wake()

    def close(self) -> None:
        """Gives back whatever this share still holds (none once its pipeline is drained; a
        leftover would shrink every later take's budget for good)."""
        with self._lock:
            left, self._used = self._used, 0
        if left:
            logger.debug("a write pipeline ended holding %d staging bytes; released", left)
            self.shared.release(left)


def _fail_future(future: asyncio.Future[None], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
