"""The staging of a take's bytes, on the caller's thread (what each write request's ``stage``
runs, just before its blob is written).

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

import functools
import logging
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
from snapshot._engine.handlers.table import ALIGN, Payload, Staged, TensorSource
from snapshot._engine.io import device
from snapshot._engine.io.staging import Lease, StagingPool
from snapshot._engine.take.plan import Slab, Stager
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


class _Pooled:
    """Copies each write's payloads into one buffer of ``pool``; a pooled write costs the
    budget its whole block (``StagingPool.block_bytes``)."""

    pooled = True

    def __init__(self, pool: StagingPool) -> None:
        self.pool = pool

    def blob(self, p: Payload, from_device: bool) -> tuple[Callable[[], Staged], int]:
        stage = _pooled(self.pool, [(0, p)], p.nbytes, False, from_device)
        return stage, self.pool.block_bytes(p.nbytes, from_device)

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
