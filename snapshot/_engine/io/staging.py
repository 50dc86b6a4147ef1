"""The staging pool of async take: host buffers that tensors are copied into, kept and reused from
one snapshot to the next, within one staging budget for the process.

``StagingPool`` lends blocks as ``Lease``s. The process's pool is the runtime's
(``process_pool``).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from snapshot._engine import runtime
from snapshot._engine.format.serialization import tensor_memoryview
from snapshot._engine.io import device
from snapshot._engine.runtime import BudgetShare, ByteBudget

if TYPE_CHECKING:
    from snapshot.options import Options

logger = logging.getLogger(__name__)


def process_pool(options: Options) -> StagingPool:
    """The process's staging pool (held by its runtime), made keeping up to
    ``options.budget()`` of free blocks; its ``budget`` is the staging budget every async take
    of the process shares (each take sets it to its own, ``StagingPool.share``)."""
    rt = runtime.get()
    with rt.lock:
        if rt.pool is None:
            rt.pool = StagingPool(keep_bytes=options.budget())
        return rt.pool


class Lease:
    """A pooled staging buffer lent to one write: ``tensor`` is a 1-d uint8 CPU tensor of the
    requested size (``pinned``: page-locked), ``view`` the same memory as a memoryview.

    Copies from a device into it are issued on that device's staging stream (``stream``), a
    copy from host memory may run on the copier thread (``copy``, its future); its bytes may
    be read only after ``ready`` has waited for them. ``release`` gives the buffer back to the
    pool.
    """

    __slots__ = ("_block", "_keep", "_pool", "_streams", "copy", "pinned", "tensor", "view")

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
        self.copy: Future[None] | None = None  # on the copier thread, until ``ready``

    def stream(self, index: int, reads: torch.Tensor) -> device.Stream:
        """The stream to issue this lease's copies from device ``index`` on: the pool's staging
        stream for that device, made to wait (the first time this lease asks) for the kernels
        queued so far on the device's current stream. ``reads``, the tensor a copy reads, is
        kept alive until ``ready``."""
        assert self._pool is not None, "a released lease"
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = self._pool.stream(index)
            device.wait_stream(stream, device.current_stream(index))
        self._keep.append(reads)
        return stream

    def ready(self) -> None:
        """Waits for the copy on the copier thread and for every staging stream this lease
        issued copies on; raises what the copy raised."""
        copy, self.copy = self.copy, None
        if copy is not None:
            copy.result()
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            device.synchronize(stream)
        self._keep = []

    def release(self) -> None:
        """Gives the buffer back, once the copies still in flight into it (a stage that failed
        midway) are done; if that wait fails (a device error), the block is never lent again.
        """
        pool, self._pool = self._pool, None
        if pool is None:
            return
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
                pool._aside.append((self._block, self._keep))
        else:
            pool._give_back(self._block, self.pinned)
        self._block = self.tensor = self.view = None  # type: ignore[assignment]
        self._keep = []


class StagingPool:
    """Host buffers for async take, reused across snapshots (a copy into fresh memory pays a
    page fault per page), within one staging budget for the process (``budget``, which each
    take's write pipeline charges through a ``share``).

    Blocks come in size classes of at least 64 KiB, so a block freed by one write fits the next
    of a similar size: powers of two and 1.5 times them; powers of two only when pinned (torch
    rounds pinned allocations up to one). At most ``keep_bytes`` of free blocks are kept
    (``free_bytes`` of them now; ``leased_bytes`` are lent out).

    A block is pinned only for a write that copies from a device; when pinning fails, the pool
    warns once and stages in pageable memory (with synchronous copies) from then on.
    """

    _MIN_BLOCK = 64 * 1024

    def __init__(self, keep_bytes: int, pin: bool | None = None) -> None:
        self.keep_bytes = keep_bytes
        self.pin = pin is not False  # whether blocks for copies from a device may be pinned
        self.budget = ByteBudget(keep_bytes)
        self._streams: dict[int, device.Stream] = {}
        self._free: dict[tuple[bool, int], list[torch.Tensor]] = {}
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
        """The bytes of the block ``acquire(nbytes, from_device)`` lends: what a write staged
        through this pool costs the staging budget."""
        return self.size_class(nbytes, from_device and self.pin)

    def share(self, budget_bytes: int) -> BudgetShare:
        """A write pipeline's share of the process's staging budget, which becomes
        ``budget_bytes`` (the budget as of this take; the pool keeps as many free bytes)."""
        with self._lock:
            self.keep_bytes = budget_bytes
        self.budget.capacity = max(1, budget_bytes)
        self.budget.wake()  # waiters re-check against the new capacity
        return BudgetShare(self.budget)

    def stream(self, index: int) -> device.Stream:
        """The staging stream of device ``index``, made the first time one is needed (only a
        GPU run makes a real one)."""
        with self._lock:
            if index not in self._streams:
                self._streams[index] = device.new_stream(index)
            return self._streams[index]

    def acquire(self, nbytes: int, from_device: bool = False) -> Lease:
        """A buffer of at least ``nbytes``: a free block of its size class, or a new one;
        pinned when ``from_device`` (its copies come from a device) and pinning works."""
        pinned = from_device and self.pin
        size = self.size_class(nbytes, pinned)
        with self._lock:
            blocks = self._free.get((pinned, size))
            block = blocks.pop() if blocks else None
            if block is not None:
                self.free_bytes -= size
                self.leased_bytes += size
        if block is None:
            block, pinned = self._new_block(nbytes, pinned)
            with self._lock:
                self.leased_bytes += block.numel()
        return Lease(self, block, nbytes, pinned)

    def _new_block(self, nbytes: int, pinned: bool) -> tuple[torch.Tensor, bool]:
        if pinned:
            size = self.size_class(nbytes, True)
            try:  # only a GPU run pins for real
                block = device.pinned_empty((size,), torch.uint8)
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
            else:
                self.allocated_bytes += size
                self.pinned_bytes += size
                return block, True
        size = self.size_class(nbytes)
        self.allocated_bytes += size
        return torch.empty(size, dtype=torch.uint8), False

    def _give_back(self, block: torch.Tensor, pinned: bool) -> None:
        size = block.numel()
        with self._lock:
            self.leased_bytes -= size
            if self.free_bytes + size <= self.keep_bytes:
                self._free.setdefault((pinned, size), []).append(block)
                self.free_bytes += size
            elif pinned:
                self._dropped_pinned = True  # still locked in torch's host cache until trim

    def trim(self) -> None:
        """Drops free blocks, largest first, beyond ``keep_bytes``; if pinned blocks were
        dropped since the last trim, empties torch's host cache, which keeps them locked until
        then (async take's background commit runs it once its writes are done)."""
        dropped: list[torch.Tensor] = []
        with self._lock:
            pinned = self._dropped_pinned
            for key in sorted(self._free, key=lambda k: -k[1]):
                blocks = self._free[key]
                while blocks and self.free_bytes > self.keep_bytes:
                    dropped.append(blocks.pop())
                    self.free_bytes -= key[1]
                    pinned = pinned or key[0]
                if not blocks:
                    del self._free[key]
            self._dropped_pinned = False
        del dropped  # freed outside the lock
        if pinned:  # only a GPU run frees pinned memory for real
            device.empty_host_cache()
