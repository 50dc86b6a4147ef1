"""The staging of a take's bytes, on the caller's thread: what each write request's ``stage``
runs, just before its blob is written.

A placed blob is a ``Slab``: small payloads packed at aligned offsets, or one payload alone;
``write_request`` makes its write. Without a pool (take), a payload alone is written from a
view of its tensor's memory, or from a gathered copy when its tensor cannot be viewed
(``TensorSource`` pieces: prepared, conjugate or negated, non-contiguous, on a device); a
slab's members are copied into one buffer, which is written. With a ``StagingPool`` (async
take), every payload of a write is copied into one pooled buffer, so that nothing written later
reads the application's memory. A slab's members get their CRC-32s here, from the copy that is
written (even while another thread changes the tensors); a payload alone gets its CRC-32 from
the plugin as it writes.
"""

from __future__ import annotations

import ctypes
import functools

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
from snapshot._engine.handlers.table import Payload, Staged, TensorSource
from snapshot._engine.io import copier, device
from snapshot._engine.io.pipeline import WriteRequest
from snapshot._engine.io.staging import Lease, StagingPool
from snapshot.errors import UnsupportedValueError

# Up to this size a tensor's bytes are copied by one ``memmove`` (slabs hold thousands, and a
# torch copy pays its dispatch each time); above it, torch's copy spreads them over its threads.
_SMALL_COPY = 1 << 20


class Slab:
    """The payloads of one blob (``members``, in order, each at its ``pos``): small ones packed
    after the padding that aligns each, or one payload ``alone``. ``from_device``: a member is
    copied from a CUDA device (async take pins its buffer)."""

    __slots__ = ("alone", "blob", "from_device", "members", "nbytes")

    def __init__(self, blob: str, alone: bool = False) -> None:
        self.blob = blob
        self.alone = alone
        self.members: list[Payload] = []
        self.nbytes = 0
        self.from_device = False

    def label(self) -> str:
        first = self.members[0].label
        if self.alone:
            return first
        more = f" and {len(self.members) - 1} more" if len(self.members) > 1 else ""
        return f"{first}{more} (slab {self.blob})"


def write_request(slab: Slab, pool: StagingPool | None, checksums: bool) -> WriteRequest:
    """The write of ``slab``: staged from the payloads' own memory, or, with ``pool`` (async
    take), copied into one pooled block (which the write costs the budget whole,
    ``StagingPool.block_bytes``). With ``checksums``, each member's CRC-32: a slab's taken as
    it is staged, a payload alone's by the plugin as it writes."""
    if pool is not None:
        stage = functools.partial(_stage_pooled, pool, slab, checksums and not slab.alone)
        cost = pool.block_bytes(slab.nbytes, slab.from_device)
    elif slab.alone:  # a view, or a gathered copy of a source's piece
        stage = functools.partial(stage_payload, slab.members[0])
        cost = slab.nbytes if slab.members[0].source is not None else 0
    else:
        stage, cost = functools.partial(stage_slab, slab, checksums), slab.nbytes
    ranges = ((0, slab.nbytes),) if slab.alone and checksums else ()
    return WriteRequest(slab.blob, slab.nbytes, cost, stage, slab.label(), ranges)


def stage_payload(p: Payload) -> Staged:
    """Buffers to write a payload from, and what must stay alive while they are written."""
    t = p.tensor
    if t is not None:
        at = p.address - t.data_ptr()
        return [tensor_memoryview(t)[at : at + p.nbytes]], t
    if p.data is not None:
        return [p.data], None
    assert p.source is not None
    return piece(p.source, p.start, p.stop)


def copy_payload(p: Payload, buf: torch.Tensor, pos: int) -> None:
    """Copies a payload of host memory (an object's bytes, or a tensor's, by torch's copy,
    which spreads them over its threads) into ``buf[pos : pos + nbytes]`` of a staging buffer
    ``buf`` (a 1-d uint8 CPU tensor)."""
    if p.data is not None:
        ctypes.memmove(buf.data_ptr() + pos, p.data, p.nbytes)
    else:
        (view,), _ = stage_payload(p)
        buf[pos : pos + p.nbytes].copy_(torch.frombuffer(view, dtype=torch.uint8))


def stage_slab(slab: Slab, checksums: bool) -> Staged:
    """A slab's bytes, copied into one new buffer (``_fill``)."""
    buf = torch.empty(slab.nbytes, dtype=torch.uint8)
    view = tensor_memoryview(buf)
    _fill(slab, buf, view, checksums, None)
    return [view], buf


def _stage_pooled(pool: StagingPool, slab: Slab, checksums: bool) -> Staged:
    """A slab's bytes, copied into one buffer of ``pool`` (``_fill``; pinned when a member is
    on a device). A stage that fails releases its lease, which first waits for the copies
    already issued into it."""
    lease = pool.acquire(slab.nbytes, slab.from_device)
    try:
        _fill(slab, lease.tensor, lease.view, checksums, lease)
    except BaseException:
        lease.release()
        raise
    return [lease.view], lease


def _fill(
    slab: Slab, buf: torch.Tensor, view: memoryview, checksums: bool, lease: Lease | None
) -> None:
    """Copies the members of ``slab`` into ``buf`` (a 1-d uint8 CPU tensor, ``view`` its bytes),
    zeros in the padding between them; from a device through ``lease`` (``copy_source``). With
    ``checksums``, each member's CRC-32, of that copy (what is written, even while another
    thread changes the tensors), goes to its ``crc32``, taken once its bytes are there: right
    after a copy from host memory, after ``lease.ready()`` for a copy from a device."""
    start = buf.data_ptr()
    memmove = ctypes.memmove
    end = 0
    late: list[Payload] = []  # copies from a device, still in flight
    for p in slab.members:
        pos = p.pos
        if pos > end:
            view[end:pos] = bytes(pos - end)  # the padding
        end = pos + p.nbytes
        if p.tensor is not None and p.nbytes <= _SMALL_COPY:  # most members
            memmove(start + pos, p.address, p.nbytes)
        elif p.source is not None:
            if copy_source(p.source, p.start, p.stop, buf, pos, lease):
                late.append(p)  # issued from a device: readable after ``ready``
                continue
        elif lease is not None and slab.alone and p.nbytes >= copier.MIN_BYTES:
            # Checksummed by the plugin, once the lease is ready.
            lease.copy = copier.start(functools.partial(copy_payload, p, buf, pos))
        else:  # a large tensor, an object's bytes
            copy_payload(p, buf, pos)
        if checksums:
            p.crc32 = crc32(view[pos:end])
    if late and checksums:
        assert lease is not None
        lease.ready()
    for p in late if checksums else ():
        p.crc32 = crc32(view[p.pos : p.pos + p.nbytes])


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
