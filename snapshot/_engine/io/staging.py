"""The staging of a take's bytes on the caller's thread (what each write request's ``stage``
runs, just before its blob is written), and async take's staging pool.

A placed blob is a ``Slab``: small payloads packed at aligned offsets, or one payload alone;
``write_request`` makes its write. Without a pool, a payload alone is written from a view of its
memory (or a gathered copy of a ``TensorSource`` piece) and the plugin checksums it; so is each
slab member over 1 MiB, while the smaller ones are copied, run by run, into one buffer and
checksummed from that copy (a compressed slab is copied whole). With a ``StagingPool`` (async
take) every write is copied into a pooled buffer (a ``Lease``), so that nothing written later
reads the application's memory; a large host tensor (in a blob of its own or in a slab) is
copied on the runtime's copier thread while the caller stages the rest, and ``Lease.ready``
waits for those copies.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import logging
import mmap
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from snapshot._engine import runtime
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
from snapshot._engine.io import device
from snapshot._engine.io.pipeline import WriteRequest
from snapshot._engine.runtime import BudgetShare, ByteBudget
from snapshot.errors import UnsupportedValueError
from storage_plugins.base import Buffer, FrozenBuffers

if TYPE_CHECKING:
    from snapshot.options import Options

logger = logging.getLogger(__name__)

# Up to this size a tensor's bytes are copied by one ``memmove`` (slabs hold thousands, and a
# torch copy pays its dispatch each time); above it, torch's copy spreads them over its threads.
_SMALL_COPY = 1 << 20
# A synchronous take copies each run of slab members of up to this size into one buffer (a
# ``memmove`` per member costs less than a view each through the plugin's calls) and writes the
# larger members from their own memory, without a copy of the take's.
_COPIED_MAX = 1 << 20
# A host tensor of at least this many bytes (in a blob of its own, or in an async take's slab) is
# copied on the copier thread: each copy is long enough to hide the caller's planning of many
# small tensors behind it.
_COPIER_MIN_BYTES = 4 << 20


def process_pool(options: Options) -> StagingPool:
    """The process's staging pool (its runtime's), whose budget every async take shares."""
    rt = runtime.get()
    with rt.lock:
        if rt.pool is None:
            rt.pool = StagingPool(keep_bytes=options.budget())
        return rt.pool


class Lease:
    """A pooled staging buffer lent to one write: ``tensor``, a 1-d uint8 CPU tensor of the
    requested size (``pinned``: page-locked), and ``view``, its memory. Copies into it (on a
    device's staging stream, ``stream``, or on the copier thread, ``copies``) may be read after
    ``ready``; ``release`` gives the buffer back."""

    __slots__ = ("_block", "_keep", "_pool", "_streams", "copies", "pinned", "tensor", "view")

    def __init__(self, pool: StagingPool, block: torch.Tensor, nbytes: int, pinned: bool) -> None:
        self._pool: StagingPool | None = pool
        self._block = block
        self.pinned = pinned
        self.tensor = block[:nbytes]
        self.view = tensor_memoryview(self.tensor)
        # Until ``ready``: device index -> the staging stream copies were issued on, and the
        # tensors those copies read (a prepared one may have no other owner).
        self._streams: dict[int, device.Stream] = {}
        self._keep: list[torch.Tensor] = []
        # Until ``ready``: the copies handed to the copier thread, each with its work (made
        # by the waiting thread if the copier has not started it).
        self.copies: list[tuple[Future[None], Callable[[], None]]] = []

    def stream(self, index: int, reads: torch.Tensor) -> device.Stream:
        """The pool's staging stream of device ``index``, ordered (the first time this lease
        asks) after the kernels queued on the device's current stream; ``reads``, the tensor a
        copy reads, is kept alive until ``ready``."""
        pool = self._pool
        assert pool is not None, "a released lease"
        stream = self._streams.get(index)
        if stream is None:
            with pool._lock:  # made the first time a lease needs one
                if index not in pool._streams:
                    pool._streams[index] = device.new_stream(index)
                stream = self._streams[index] = pool._streams[index]
            device.wait_stream(stream, device.current_stream(index))
        self._keep.append(reads)
        return stream

    def ready(self) -> None:
        """Waits for every copy into the buffer; raises what the copy raised. A copy the
        copier thread has not started is made here, on the waiting thread: the two threads
        share the copies (and the page faults of fresh blocks) instead of one waiting."""
        copies, self.copies = self.copies, []
        error: BaseException | None = None
        for copy, here in reversed(copies):  # the copier starts from the first
            try:  # every copy ends before this returns, even after one failed
                if copy.cancel():
                    here()
                else:
                    copy.result()
            except BaseException as e:
                error = error or e
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            device.synchronize(stream)
        self._keep = []
        if error is not None:
            raise error

    def release(self) -> None:
        """Gives the buffer back once the copies into it are done (a block whose wait fails
        is never lent again)."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        # Dropped: the copies not started are not made.
        self.copies = [(copy, here) for copy, here in self.copies if not copy.cancel()]
        try:
            self.ready()
        except BaseException:
            logger.warning(
                "staging: waiting for the copies into a staging buffer failed; the buffer is "
                "set aside, never reused",
                exc_info=True,
            )
            with pool._lock:
                pool.leased_bytes -= self._block.numel()
                pool._written.pop(self._block.data_ptr(), None)
                pool._aside.append((self._block, self._keep))
        else:
            pool._give_back(self._block, self.pinned)
        self._block = self.tensor = self.view = None  # type: ignore[assignment]
        self._keep = []


class StagingPool:
    """Host buffers for async take, reused across snapshots (fresh memory pays a page fault per
    page), within one staging budget for the process (``budget``, charged through ``share``).

    Blocks come in size classes of at least 64 KiB: powers of two and 1.5 times them (powers of
    two only when pinned, as torch rounds pinned allocations). The blocks, leased and free,
    stay within ``keep_bytes`` (the budget): a new block first drops free blocks of other sizes
    to make room, so a budget smaller than the state reuses what it can snapshot after snapshot
    instead of keeping one size and allocating the others anew each time. A block's memory is
    resident only as far as a lease has written it, so a free block of a size class goes to the
    lease it fits best (``_fitting``): the slabs and tensors of one state, staged snapshot after
    snapshot, each find the block they filled the time before, and no block grows resident up
    to the largest size its class has held. A block is pinned
    only for copies from a device; when pinning fails, the pool warns once and stages in
    pageable memory from then on.
    """

    _MIN_BLOCK = 64 * 1024

    def __init__(self, keep_bytes: int, pin: bool | None = None) -> None:
        self.keep_bytes = keep_bytes
        self.pin = pin is not False  # whether blocks for copies from a device may be pinned
        self.budget = ByteBudget(keep_bytes)
        self._streams: dict[int, device.Stream] = {}  # by device index: copies from it
        self._free: dict[tuple[bool, int], list[torch.Tensor]] = {}
        self._written: dict[int, int] = {}  # by block address: the most bytes a lease asked for
        self.free_bytes = 0
        self.leased_bytes = 0
        self._lock = threading.Lock()
        self._dropped_pinned = False  # a pinned block was dropped since the last trim
        self._aside: list[object] = []  # blocks a failed wait left possibly still being written
        self.allocated_bytes = 0  # every block this pool ever allocated, for tests and logs
        self.pinned_bytes = 0  # the pinned part of allocated_bytes

    @classmethod
    def size_class(cls, nbytes: int, pinned: bool = False) -> int:
        size = max(nbytes, cls._MIN_BLOCK)
        power = 1 << (size - 1).bit_length()
        three_quarters = power // 4 * 3
        return three_quarters if size <= three_quarters and not pinned else power

    def block_bytes(self, nbytes: int, from_device: bool) -> int:
        """The bytes of the block ``acquire(nbytes, from_device)`` lends."""
        return self.size_class(nbytes, from_device and self.pin)

    def share(self, budget_bytes: int) -> BudgetShare:
        """A write pipeline's share of the process's staging budget, now ``budget_bytes``."""
        with self._lock:
            self.keep_bytes = budget_bytes
        self.budget.capacity = max(1, budget_bytes)
        self.budget.wake()  # waiters re-check against the new capacity
        return BudgetShare(self.budget)

    def acquire(self, nbytes: int, from_device: bool = False) -> Lease:
        """A buffer of at least ``nbytes``: a free block of its size class, or a new one;
        pinned when ``from_device`` (its copies come from a device) and pinning works."""
        pinned = from_device and self.pin
        size = self.size_class(nbytes, pinned)
        dropped: list[torch.Tensor] = []
        with self._lock:
            blocks = self._free.get((pinned, size))
            block = blocks.pop(self._fitting(blocks, nbytes)) if blocks else None
            if block is not None:
                self.free_bytes -= size
                self.leased_bytes += size
                ptr = block.data_ptr()
                self._written[ptr] = max(self._written[ptr], nbytes)
            else:  # room for a new block: free blocks of other sizes go first
                dropped = self._drop_free(self.keep_bytes - self.leased_bytes - size)
        if block is not None:
            return Lease(self, block, nbytes, pinned)
        del dropped  # freed outside the lock
        if pinned:
            try:  # only a GPU run pins for real
                block = device.pinned_empty((size,), torch.uint8)
                self.pinned_bytes += size
            except RuntimeError as e:
                with self._lock:
                    first, self.pin = self.pin, False
                if first:
                    logger.warning(
                        "staging: cannot pin %d bytes of host memory (%s); async take stages "
                        "device tensors in pageable memory from now on, with synchronous "
                        "copies (raise the locked-memory limit, ulimit -l, to pin)",
                        size,
                        e,
                    )
                pinned, size = False, self.size_class(nbytes)
        if block is None:
            block = _aligned_empty(size)
        self.allocated_bytes += size
        with self._lock:
            self.leased_bytes += size
            self._written[block.data_ptr()] = nbytes
        return Lease(self, block, nbytes, pinned)

    def _fitting(self, blocks: list[torch.Tensor], nbytes: int) -> int:
        """Under the lock: the index in ``blocks`` of the one to lend for ``nbytes``: of those
        already written that far, the least written; else the most written (the fewest pages
        to fault in)."""
        written = [self._written[b.data_ptr()] for b in blocks]
        enough = [i for i, w in enumerate(written) if w >= nbytes]
        if enough:
            return min(enough, key=written.__getitem__)
        return max(range(len(blocks)), key=written.__getitem__)

    def _give_back(self, block: torch.Tensor, pinned: bool) -> None:
        size = block.numel()
        with self._lock:
            self.leased_bytes -= size
            if self.free_bytes + size <= self.keep_bytes:
                self._free.setdefault((pinned, size), []).append(block)
                self.free_bytes += size
                return
            del self._written[block.data_ptr()]
            if pinned:
                self._dropped_pinned = True  # still locked in torch's host cache until trim

    def close(self) -> None:
        """Gives every free block back (pinned ones to the system too): the runtime's shutdown,
        once the pending snapshots are done. A later async take allocates again."""
        with self._lock:
            self.keep_bytes = 0
        self.trim()

    def _drop_free(self, keep: int) -> list[torch.Tensor]:
        """Under the lock: takes free blocks out, largest first, until at most ``keep`` bytes
        of them are left; the blocks taken (to free outside the lock)."""
        dropped: list[torch.Tensor] = []
        for key in sorted(self._free, key=lambda k: -k[1]):
            blocks = self._free[key]
            while blocks and self.free_bytes > max(keep, 0):
                dropped.append(blocks.pop())
                del self._written[dropped[-1].data_ptr()]
                self.free_bytes -= key[1]
                self._dropped_pinned = self._dropped_pinned or key[0]
            if not blocks:
                del self._free[key]
        return dropped

    def trim(self) -> None:
        """Drops free blocks, largest first, beyond ``keep_bytes``; empties torch's host cache,
        which keeps dropped pinned blocks locked, if any were dropped since the last trim."""
        with self._lock:
            dropped = self._drop_free(self.keep_bytes)
            pinned, self._dropped_pinned = self._dropped_pinned, False
        del dropped  # freed outside the lock
        if pinned:  # only a GPU run frees pinned memory for real
            device.empty_host_cache()


def _aligned_empty(nbytes: int) -> torch.Tensor:
    """A new uint8 CPU tensor of ``nbytes`` in a mapping of its own: page-aligned, so that a
    plugin can write it with direct I/O as it is, and handed back to the system when the block
    is dropped (from the heap, freed blocks stayed in the process: a budget smaller than the
    state drops and makes blocks snapshot after snapshot). Private: a forked child's writes
    never reach the parent's blocks."""
    return torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE), dtype=torch.uint8)


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


def write_request(
    slab: Slab, pool: StagingPool | None, checksums: bool, zstd_level: int = 0
) -> WriteRequest:
    """The write of ``slab``, staged from the payloads' own memory or, with ``pool``, copied
    into one pooled block; with ``checksums``, each member's CRC-32 is recorded (from a slab's
    copy when staged without a pool, else by the plugin as it writes); with ``zstd_level``,
    each member is compressed as it is written (``io.compression``)."""
    if pool is not None:
        # Uncompressed, the pooled copy is written as it is: the plugin checksums each member
        # as it writes it, in the background rather than in the caller's staging.
        member_crcs = checksums and not slab.alone and zstd_level > 0
        stage = functools.partial(stage_slab, slab, member_crcs, pool)
        cost = pool.block_bytes(slab.nbytes, slab.from_device)
    elif slab.alone:  # a view, or a gathered copy of a source's piece
        stage = functools.partial(stage_payload, slab.members[0])
        cost = slab.nbytes if slab.members[0].source is not None else 0
    elif zstd_level:  # compressed from one copy of the slab
        stage, cost = functools.partial(stage_slab, slab, checksums), slab.nbytes
    else:
        stage = functools.partial(stage_in_place, slab, checksums)
        cost = sum(p.nbytes if p.nbytes <= _COPIED_MAX else p.staging_bytes for p in slab.members)
    if zstd_level:  # (imported only by a take that compresses)
        from snapshot._engine.io.compression import compressed_write

        return compressed_write(slab, stage, cost, checksums, zstd_level)
    ranges: tuple[tuple[int, int], ...] = ()
    if checksums and slab.alone:
        ranges = ((0, slab.nbytes),)
    elif checksums and pool is not None:
        ranges = tuple((p.pos, p.nbytes) for p in slab.members)
    elif checksums:  # the members written from their own memory
        ranges = tuple((p.pos, p.nbytes) for p in slab.members if p.nbytes > _COPIED_MAX)
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
    """Copies a payload of host memory into ``buf[pos : pos + nbytes]`` (a uint8 CPU tensor)."""
    if p.data is not None:
        ctypes.memmove(buf.data_ptr() + pos, p.data, p.nbytes)
    else:
        (view,), _ = stage_payload(p)
        buf[pos : pos + p.nbytes].copy_(torch.frombuffer(view, dtype=torch.uint8))


def stage_slab(slab: Slab, checksums: bool, pool: StagingPool | None = None) -> Staged:
    """A slab's bytes, copied into a new buffer or a lease of ``pool``."""
    if pool is None:
        buf = torch.empty(slab.nbytes, dtype=torch.uint8)
        view = tensor_memoryview(buf)
        _fill(slab.members, buf, view, checksums, None)
        return [view], buf
    lease = pool.acquire(slab.nbytes, slab.from_device)
    try:
        _fill(slab.members, lease.tensor, lease.view, checksums, lease)
    except BaseException:
        lease.release()
        raise
    # A private copy that nothing changes until its write ends: written and checksummed as it
    # is, without a copy of the plugin's.
    return FrozenBuffers((lease.view,)), lease


def stage_in_place(slab: Slab, checksums: bool) -> Staged:
    """A synchronous take's slab: each run of members of up to ``_COPIED_MAX`` copied into a
    new buffer (one ``memmove`` each, checksummed from the copy), larger members as views of
    their own memory (checksummed by the plugin as it writes them: ``write_request``'s
    ranges), zeros between them."""
    buffers: list[Buffer] = []
    keep: list[object] = []
    end = 0  # where the buffers so far end in the blob
    for copied, group in itertools.groupby(slab.members, lambda p: p.nbytes <= _COPIED_MAX):
        # The small members are copied run by run; each larger one is a run of its own.
        members = list(group)
        runs = [members] if copied else [[p] for p in members]
        for run in runs:
            start = run[0].pos
            if start > end:
                buffers.append(bytes(start - end))  # the padding
            end = run[-1].pos + run[-1].nbytes
            if copied:
                buf = torch.empty(end - start, dtype=torch.uint8)
                view = tensor_memoryview(buf)
                _fill(run, buf, view, checksums, None, start)
                buffers.append(view)
                keep.append(buf)
            else:
                views, alive = stage_payload(run[0])
                buffers += views
                keep.append(alive)
    return buffers, keep


def _fill(
    members: Sequence[Payload],
    buf: torch.Tensor,
    view: memoryview,
    checksums: bool,
    lease: Lease | None,
    base: int = 0,
) -> None:
    """Copies ``members`` into ``buf`` (``view``: its bytes), each at its ``pos`` less
    ``base``, zeros between them; with ``checksums``, sets each member's ``crc32`` from the
    copy (what is written, even while another thread changes the tensors)."""
    start = buf.data_ptr()
    memmove = ctypes.memmove
    end = 0
    late: list[Payload] = []  # copies from a device, still in flight
    for p in members:
        pos = p.pos - base
        if pos > end:
            view[end:pos] = bytes(pos - end)  # the padding
        end = pos + p.nbytes
        if p.tensor is not None and p.nbytes <= _SMALL_COPY:  # most members
            memmove(start + pos, p.address, p.nbytes)
        elif p.source is not None:
            if copy_source(p.source, p.start, p.stop, buf, pos, lease):
                late.append(p)  # issued from a device: readable after ``ready``
                continue
        elif lease is not None and not checksums and p.nbytes >= _COPIER_MIN_BYTES:
            # Checksummed by the plugin as it writes, once the lease is ready.
            _on_copier(lease, functools.partial(copy_payload, p, buf, pos))
        else:  # a large tensor, an object's bytes
            copy_payload(p, buf, pos)
        if checksums:
            p.crc32 = crc32(view[pos:end])
    if late and checksums:
        assert lease is not None
        lease.ready()
    for p in late if checksums else ():
        p.crc32 = crc32(view[p.pos - base : p.pos - base + p.nbytes])


def _on_copier(lease: Lease, copy: Callable[[], None]) -> None:
    """Hands ``copy`` (into ``lease``'s buffer) to the copier thread; ``Lease.ready`` waits for
    it, or makes it on the waiting thread if the copier has not started it."""
    try:
        lease.copies.append((runtime.get().copier().submit(copy), copy))
    except RuntimeError:  # the interpreter is shutting down: no new work for threads
        copy()


# ---------------------------------------------------------------------------------------------
# The bytes of a ``TensorSource``, piece by piece (element ranges).


def _resolve(source: TensorSource) -> torch.Tensor:
    """The tensor whose elements are written (prepared, detached, conjugate and negation
    resolved), kept from the first piece this rank stages to the last."""
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
    """Copies elements ``[start, stop)`` into the uint8 buffer ``buf`` at ``pos``. True when
    the copies were issued on the ``lease``'s staging stream of a CUDA device (readable after
    ``lease.ready()``); False when done (host memory, or a device without a lease)."""
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
    """Copies ``views`` of a device's memory end to end into the 1-d host tensor ``flat``."""
    pos = 0
    for v in views:
        n = v.numel()
        device.copy(flat[pos : pos + n].view(v.shape), v, non_blocking)
        pos += n
