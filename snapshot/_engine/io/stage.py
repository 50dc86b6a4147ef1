"""The staging of a take's bytes, on the caller's thread: what each write request's ``stage``
runs, just before its blob is written.

Without a pool (take), a payload of a blob of its own is written from a view of its tensor's
memory (``stage_payload``), or from a gathered copy when its tensor cannot be viewed
(``TensorSource`` pieces: prepared, conjugate or negated, non-contiguous, on a device); the
plugin checksums the bytes it writes, from its own copy of them. A slab's members are copied
into one buffer of the slab (``stage_slab``), which is written. With a ``StagingPool`` (async
take), every payload of a write is copied into one pooled buffer (``_pooled``), from a device
asynchronously on a staging stream, a large host tensor on the runtime's copier thread
(``_Pooled``), so that nothing written later reads the application's memory. A slab's members
get their CRC-32s here, from the copy that is written, as they are staged (see
``plan.Placer``).

``stager(pool)`` is what the take gives its placers (``plan.Stager``).
"""

from __future__ import annotations

import ctypes
import functools
from collections import deque
from collections.abc import Callable, Iterator

import torch

from snapshot._engine import runtime
from snapshot._engine.format.checksum import HOLD_MAX_BYTES, crc32_each, crc32_held
from snapshot._engine.format.serialization import (
    ADDRESS_SPACE,
    as_copyable,
    dtype_name,
    gather_elements,
    range_views,
    raw_memoryview,
    scatter_into_flat,
    tensor_memoryview,
)
from snapshot._engine.handlers.dense import call_prepare
from snapshot._engine.io import device
from snapshot._engine.io.staging import Lease, StagingPool
from snapshot._engine.take.plan import ALIGN, Payload, Slab, Staged, Stager, TensorSource
from snapshot.errors import UnsupportedValueError
from storage_plugins import Buffer

_ZEROS = memoryview(bytes(ALIGN))

# A host tensor of at least this size, a blob of its own, is copied off the caller's thread
# in an async take (``_Pooled``): a few large copies, each long enough to hide the caller's
# planning of many small tensors behind it.
_OFFLOAD_MIN = 4 << 20

# Below this size a payload of a tensor is copied by one memmove call (the least overhead per
# copy); above it, torch's copy spreads the bytes over its threads.
_MEMMOVE_MAX = 1 << 20

# ``ctypes.memmove`` gives up the GIL for the copy, as ctypes does around every foreign call,
# and must take it back after: beside a thread that runs Python (the training loop an async
# take runs beside), at that thread's next switch only, once per member of a slab (see
# ``checksum.HELD_BYTES``). The same C function typed with PYFUNCTYPE keeps the GIL: copies of
# at most ``HOLD_MAX_BYTES`` go through it.
_memmove_held = ctypes.PYFUNCTYPE(
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t
)(
    ctypes._memmove_addr  # type: ignore[attr-defined]  # what ``ctypes.memmove`` calls
)


def _memmove(dst: int, src: int | bytes, nbytes: int) -> None:
    (_memmove_held if nbytes <= HOLD_MAX_BYTES else ctypes.memmove)(dst, src, nbytes)


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
    budget its whole block (``StagingPool.block_bytes``).

    A large tensor in host memory, a blob of its own, is copied on the runtime's copier
    thread (``Runtime.copier``) while the caller goes on planning and staging the rest:
    torch's copy lets the GIL go, so the caller's Python and the copy run at once. ``settle``
    waits for those copies; nothing may read a staged buffer before it (the take calls it at
    the end of its staging, and the write pipeline before it hands staged writes over)."""

    pooled = True

    def __init__(self, pool: StagingPool) -> None:
        self.pool = pool
        self._copying: list[Lease] = []

    def blob(self, p: Payload, from_device: bool) -> tuple[Callable[[], Staged], int]:
        if p.tensor is not None and p.nbytes >= _OFFLOAD_MIN:
            stage: Callable[[], Staged] = functools.partial(self._offloaded, p)
        else:
            stage = _pooled(self.pool, [(0, p)], p.nbytes, False, from_device)
        return stage, self.pool.block_bytes(p.nbytes, from_device)

    def _offloaded(self, p: Payload) -> Staged:
        lease = self.pool.acquire(p.nbytes, False)
        try:
            try:
                copy = runtime.get().copier().submit(copy_payload, p, lease.tensor, 0)
            except RuntimeError:  # the interpreter is shutting down: no new thread work
                copy_payload(p, lease.tensor, 0)
                return [lease.view], lease
            lease.copying(copy)
        except BaseException:
            lease.release()
            raise
        self._copying.append(lease)
        return [lease.view], lease

    def settle(self) -> None:
        """Waits for the copies in flight on the copier thread (``Lease.ready``; a lease
        released meanwhile, by a take that failed, waited for its own); raises the first
        one's error once they are all done."""
        leases, self._copying = self._copying, []
        error: BaseException | None = None
        for lease in leases:
            try:
                lease.ready()
            except BaseException as e:
                error = error or e
        if error is not None:
            raise error

    def slab(self, slab: Slab, checksums: bool) -> tuple[Callable[[], Staged], int]:
        stage = _pooled(self.pool, slab.members, slab.nbytes, checksums, slab.from_device)
        return stage, self.pool.block_bytes(slab.nbytes, slab.from_device)


def stage_payload(p: Payload) -> Staged:
    """Buffers to write a payload from, and what must stay alive while they are written."""
    t = p.tensor
    if t is not None:
        return [raw_memoryview(p.address, p.nbytes)], t
    if p.data is not None:
        return [p.data], None
    assert p.source is not None
    return piece(p.source, p.start, p.stop)


def copy_payload(p: Payload, buf: torch.Tensor, pos: int) -> None:
    """Copies a payload's bytes into ``buf[pos : pos + nbytes]`` of a staging buffer ``buf``
    (a 1-d uint8 CPU tensor), from host memory (a source's: ``copy_source``)."""
    t = p.tensor
    nbytes = p.nbytes
    if t is not None:
        if nbytes <= _MEMMOVE_MAX:
            # One memmove: slabs hold thousands, and each torch copy pays its dispatch.
            _memmove(buf.data_ptr() + pos, p.address, nbytes)
        else:  # torch's copy spreads the bytes over its threads
            src = raw_memoryview(p.address, nbytes)
            buf[pos : pos + nbytes].copy_(torch.frombuffer(src, dtype=torch.uint8))
    elif p.data is not None:
        _memmove(buf.data_ptr() + pos, p.data, nbytes)
    else:
        assert p.source is not None
        copy_source(p.source, p.start, p.stop, buf, pos)


# A slab is copied and checksummed in runs of members of about this many bytes: each run's CRCs
# are taken right after its copy, while its bytes are still in the CPU's caches.
_SLAB_RUN_BYTES = 1 << 20


def stage_slab(slab: Slab, checksums: bool) -> Staged:
    """A slab's bytes, copied into one new buffer (zeros in the padding between members); with
    ``checksums``, each member's CRC-32, taken from that copy, goes to its ``crc32`` (see
    ``plan.Placer``).

    The copy is what is written: the CRCs are of the bytes that reach storage even while
    another thread changes the members' tensors in place (an EMA update, a hook), as a CRC of
    the tensors' own memory, taken before or after their write, would not be. Members are
    copied in runs, each in one C-level pass (``map`` of the buffer's ``__setitem__`` over
    their slices), its CRCs in one more (``crc32_each``)."""
    out = memoryview(bytearray(slab.nbytes))  # zeroed: the padding
    slices: list[slice] = []  # the current run: where its members go, their bytes, themselves
    sources: list[Buffer] = []
    run: list[Payload] = []
    run_bytes = 0

    def flush() -> None:
        nonlocal run_bytes
        deque(map(out.__setitem__, slices, sources), maxlen=0)
        if checksums:
            views = list(map(out.__getitem__, slices))
            for p, value in zip(run, crc32_each(views), strict=True):
                p.crc32 = value
        slices.clear()
        sources.clear()
        run.clear()
        run_bytes = 0

    pos = 0
    for pad, p in slab.members:
        pos += pad
        nbytes = p.nbytes
        if p.tensor is not None:  # most members: a tensor's memory (``stage_payload``)
            # ``raw_memoryview`` inline: a slice of the address space.
            address = p.address - 1
            slices.append(slice(pos, pos + nbytes))
            sources.append(ADDRESS_SPACE[address : address + nbytes])
            run.append(p)
            run_bytes += nbytes
            pos += nbytes
            if run_bytes >= _SLAB_RUN_BYTES:
                flush()
            continue
        flush()  # the runs before it go first: a gathered copy is freed after its own
        bufs, keepalive = stage_payload(p)
        at = pos
        for b in bufs:
            view = b if type(b) is memoryview and b.format == "B" else memoryview(b).cast("B")
            out[at : at + len(view)] = view
            at += len(view)
        del bufs, keepalive
        if checksums:
            p.crc32 = crc32_held(out[pos : pos + nbytes])
        pos += nbytes
    flush()
    return [out], None


def _pooled(
    pool: StagingPool,
    members: list[tuple[int, Payload]],
    nbytes: int,
    checksums: bool,
    from_device: bool,
) -> Callable[[], Staged]:
    """Stages ``members`` by copying them into one buffer of ``pool`` (pinned when
    ``from_device``: a member is on a device); with ``checksums``, each member's CRC-32
    goes to its ``crc32``.

    The CRC is taken from the buffer only once the member's bytes are there: right after a
    copy from host memory (synchronous, and still in the CPU's cache), and after
    ``lease.ready()`` for a copy from a device, which is issued non-blocking on a staging
    stream and lands only when ``ready`` has waited for that stream. A stage that fails
    releases its lease, which first waits for the copies already issued into it."""

    def stage() -> Staged:
        lease = pool.acquire(nbytes, from_device)
        try:
            if len(members) > 1:
                lease.touch()
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
                        p.crc32 = crc32_held(view[pos : pos + p.nbytes])
                elif copy_source(source, p.start, p.stop, buf, pos, lease):
                    if checksums:  # issued from a device: readable after ``ready``
                        if late is None:
                            late = []
                        late.append((pos, p))
                elif checksums:
                    p.crc32 = crc32_held(view[pos : pos + p.nbytes])
                pos += p.nbytes
            lease.ready()
            if late is not None:
                for at, p in late:
                    p.crc32 = crc32_held(view[at : at + p.nbytes])
        except BaseException:
            lease.release()  # waits for the copies already issued before lending it again
            raise
        return [lease.view], lease

    return stage


# ---------------------------------------------------------------------------------------------
# The bytes of a ``TensorSource``, piece by piece (element ranges).


def _resolve(source: TensorSource) -> torch.Tensor:
    """The tensor whose elements are written: the prepare function's (checked against what it
    returned when tracing), detached, with any lazy conjugate or negation resolved. Made at the
    first piece, kept until the last one this rank stages."""
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
        index = device.cuda_index(base)
        if index is None:  # host memory (not contiguous), or another device type
            scatter_into_flat(dst.view(base.dtype), range_views(base, start, stop))
            return False
        flat = dst.view(base.dtype)
        views = range_views(base, start, stop)
        if lease is None:
            for at, v in _flat_slots(views):
                device.copy(flat[at : at + v.numel()].view(v.shape), v, False)
            return False
        # Only a machine with a GPU runs these lines for real: the copies are queued on the
        # device's staging stream (``Lease.stream``: after the kernels already queued on
        # its current stream) and, into pinned memory, return at once; ``Lease.ready``
        # waits for them. The lease keeps ``base`` alive until then: a prepared or resolved
        # tensor may have no other owner, and CUDA's caching allocator would hand its
        # memory to the next allocation on the current stream while the copy still reads
        # it on the staging stream.
        with device.use_stream(lease.stream(index, base)):
            for at, v in _flat_slots(views):
                device.copy(flat[at : at + v.numel()].view(v.shape), v, lease.pinned)
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


def _flat_slots(views: list[torch.Tensor]) -> Iterator[tuple[int, torch.Tensor]]:
    """Each view with the element offset it starts at when the views are laid end to end."""
    at = 0
    for v in views:
        yield at, v
        at += v.numel()
