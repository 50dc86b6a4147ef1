"""How a read's scratch tiles land in restore targets: on the host, or on a CUDA device in the
order the caller's streams need.

A restore or ``read_object`` that cannot read bytes straight into a target (another dtype than
stored, not contiguous, on a device) reads them into scratch tiles, taken when a tile's read is
about to run and charged to the read budget until its ``done`` (``reads.tile_need``), and
copies each tile into its target elements when it has landed. ``Landing`` is that copy and the
pool of those tiles, one per read (``loader.Loader``):

- Host targets: ``copy_`` at once (casting as ``load_state_dict`` does); the tile is then free
  for the next read of its size.
- CUDA targets: tiles are page-locked (``device.pinned_empty``) and copied to the device
  non-blocking, on a copy stream of the read's own for that device. That stream is made, on
  the caller's thread while the read is planned, to wait for the work queued so far on the
  caller's current stream of that device (the kernels that last wrote the targets; a current
  stream is per thread, and the copies are issued on the I/O thread, whose current stream is
  the device's default one). Tiles into a device are short (``DEVICE_TILE_BYTES``) and a read
  holds one (``scratch_limit``), so the memory pinned stays about a tile per worker. A tile
  whose copy may be in flight stays referenced, neither reused nor freed, until the event
  recorded after its copies has passed (asked without waiting when a pinned tile is wanted:
  ``_reap``) or the copy streams are synchronized: when the tiles kept and in flight pass the
  read's spare bytes (the budget left beside the reads' own tiles), and at the end of the read
  (``finish``, on the caller's thread, after the reads, also after a failure). So a restore
  returns with the restored bytes in the targets and no copy still reading a tile. A
  device target of another dtype than stored is cast on the host into a second pinned tile of
  the target's dtype (charged with the first: ``cast_bytes``), then copied: torch's own copy
  with a cast from host to device would cast into pageable memory and copy from there
  synchronously. When pinning fails (``ulimit -l``, a container's limit) tiles are pageable
  and their copies synchronous, still on the copy stream.

Copies from pageable scratch that a later read reuses (a box of a sharded read through its
gaps, a decoded pickle) go to a device synchronously, on the copy stream too (``copy``).

Every call into CUDA goes through ``snapshot._engine.io.device`` (looked up at call time), which
tests on CPU replace with ``tests/cuda_double.py``: that double holds each non-blocking copy
until its stream is synchronized, so the rules above are tested without a GPU. That they hold
on a real device (the stream wait covers the caller's kernels queued before the read; copies
from pinned tiles overlap the reads; a copy stream's synchronize is the last wait) only a GPU
run proves.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

import torch

from snapshot._engine.format.serialization import as_copyable, copy_elements, range_views
from snapshot._engine.io import device

logger = logging.getLogger(__name__)

_pin_warned = False

# The longest tile through which a read lands bytes in a device target. A read's tiles are as
# long as the budget allows (``loader.tile_bytes``: up to 128 MiB with the default budget), and
# each is pinned; reads of a few GiB onto a GPU then pinned that much fresh memory, at the
# speed the host locks pages, which the first restore of a process pays in full (the tiles
# stay in torch's pinned-memory cache for the next). Short tiles, reused as soon as their
# copies are done (``Landing._reap``), keep the pinned memory to about one tile per worker;
# an 8 MiB copy from pinned memory takes a fraction of the time its read takes. Long tiles do
# make later restores of the same process faster, which find them cached: the figures of both
# are in benchmarks/README.md ("GPU").
DEVICE_TILE_BYTES = 8 << 20


def tile_limit(target: torch.Tensor, tile_bytes: int) -> int:
    """The longest tile to read ``target``'s bytes through: ``tile_bytes``, or
    ``DEVICE_TILE_BYTES`` at most for a target on a CUDA device."""
    if device.cuda_index(target) is None:
        return tile_bytes
    return min(tile_bytes, DEVICE_TILE_BYTES)


class Tile:
    """A scratch tile: ``data``, a contiguous 1-d host tensor of the stored dtype that a read
    fills, viewing ``block`` (pooled uint8 memory), and whether that memory is page-locked (its
    device copies may then be non-blocking)."""

    __slots__ = ("block", "data", "pinned")

    def __init__(self, block: torch.Tensor, dtype: torch.dtype, pinned: bool) -> None:
        self.block = block
        self.data = block.view(dtype)
        self.pinned = pinned


class Landing:
    """The copies of one read from scratch tiles into targets, and the pool of those tiles
    (see the module's docstring).

    ``prepare`` runs on the caller's thread while the read is planned; ``tile``, ``land`` and
    ``copy`` on the I/O loop as reads complete; ``finish`` on the caller's thread after the
    reads.

    ``spare_bytes`` is the memory the read may hold beyond its reads' charges (the budget left
    beside one tile per worker: ``Loader._read``): tiles kept for reuse, and pinned tiles whose
    device copies may still be in flight. Past it, free tiles are dropped, and then the copy
    streams are synchronized. 0 (the default): nothing is kept, and every device copy is waited
    for at once.
    """

    def __init__(self, spare_bytes: int = 0) -> None:
        self.spare_bytes = spare_bytes
        # Device index -> this read's copy stream there (made by ``prepare``).
        self._streams: dict[int, device.Stream] = {}
        self._pinning = True  # until pinning fails once
        # Free tiles by (bytes, pinned): the tiles of a read are mostly of one size (a tile, a
        # run cut into tiles), and reused memory costs no page faults (a copy into fresh memory
        # faults in every page it writes) nor malloc's fragmentation: tiles allocated and freed
        # one after another stay resident well past the budget (glibc keeps the freed ones),
        # where pooled ones stay within it (tests/test_restore_tiles.py).
        self._free: dict[tuple[int, bool], list[torch.Tensor]] = {}
        self._free_total = 0
        # Pinned tiles whose non-blocking copies may still read them, oldest first, each with
        # the event recorded after its copies: referenced (so neither reused nor freed) until
        # that event has passed (``_reap``) or the copy streams are synchronized (``_drain``).
        self._in_flight: deque[tuple[torch.Tensor, Any]] = deque()
        self._in_flight_total = 0

    def prepare(self, target: torch.Tensor) -> None:
        """Called on the caller's thread for each target a tile or box will be copied into,
        before any read: the first time a device is met, its copy stream is made and ordered
        after the work queued so far on the caller's current stream of that device."""
        index = device.cuda_index(target)
        if index is None or index in self._streams:
            return
        # Only a GPU run proves that this wait covers the caller's queued kernels.
        stream = device.new_stream(index)
        device.wait_stream(stream, device.current_stream(index))
        self._streams[index] = stream

    def scratch_limit(self, tile_bytes: int) -> int:
        """The most scratch one read may hold: ``tile_bytes``, or one device tile once a
        target on a device is planned (``prepare``), so that the reads' pinned tiles stay
        about one per worker."""
        return min(tile_bytes, DEVICE_TILE_BYTES) if self._streams else tile_bytes

    def cast_bytes(self, count: int, dtype: torch.dtype, target: torch.Tensor) -> int:
        """Host memory beside the tile that landing ``count`` elements of ``dtype`` into
        ``target`` takes: a pinned tile of the target's dtype, for a device target of another
        dtype (charged to the budget with the tile)."""
        if target.dtype is dtype or device.cuda_index(target) is None:
            return 0
        return count * target.element_size()

    def tile(self, count: int, dtype: torch.dtype, target: torch.Tensor) -> Tile:
        """A tile of ``count`` elements of ``dtype`` to read into, for ``target``: page-locked
        when the device copy reads it (a CUDA target of that dtype) and pinning works, else
        pageable (a host target; a device target of another dtype, whose copy reads the cast
        tile)."""
        pin = target.dtype is dtype and device.cuda_index(target) is not None
        return self._take(count, dtype, pin)

    def _take(self, count: int, dtype: torch.dtype, pin: bool) -> Tile:
        global _pin_warned
        nbytes = count * dtype.itemsize
        pin = pin and self._pinning
        free = self._free.get((nbytes, pin))
        if pin and not free and self._in_flight:
            # Tiles whose copies are done are free again (most, with a device that keeps up).
            self._reap()
            free = self._free.get((nbytes, pin))
            if not free and self._free_total + self._in_flight_total + nbytes > self.spare_bytes:
                # The tiles in flight are as much as may be kept: wait for their copies and
                # reuse one, rather than lock more memory (pinning a new block costs far more
                # than a copy already queued takes to finish, and the block would outlive the
                # read in torch's host cache).
                self._drain()
                free = self._free.get((nbytes, pin))
        if free:
            self._free_total -= nbytes
            return Tile(free.pop(), dtype, pin)
        if pin:
            try:
                return Tile(device.pinned_empty((nbytes,), torch.uint8), dtype, True)
            except RuntimeError as e:
                self._pinning = False
                if not _pin_warned:
                    _pin_warned = True
                    logger.warning(
                        "restore: cannot pin host memory (%s); copying to the device from "
                        "pageable memory, synchronously",
                        e,
                    )
        return Tile(torch.empty(nbytes, dtype=torch.uint8), dtype, False)

    def _give(self, tile: Tile) -> None:
        """Keeps a tile no copy reads any more for reuse, while the spare bytes allow."""
        block = tile.block
        nbytes = block.numel()
        if self._free_total + self._in_flight_total + nbytes <= self.spare_bytes:
            self._free.setdefault((nbytes, tile.pinned), []).append(block)
            self._free_total += nbytes

    def land(self, target: torch.Tensor, start: int, stop: int, tile: Tile) -> None:
        """Copies ``tile`` (elements ``[start, stop)`` of ``target`` in row-major order, in the
        stored dtype) into ``target``, casting like ``copy_``. On the host the copy is done
        when this returns; to a device it is queued on the copy stream, non-blocking from a
        pinned tile (``finish`` waits for it)."""
        index = device.cuda_index(target)
        if index is None:
            with torch.no_grad():
                copy_elements(target, start, stop, tile.data)
            self._give(tile)
            return
        src = tile
        if target.dtype is not tile.data.dtype:
            # Cast on the host, into a tile of the target's dtype that the copy then reads:
            # copy_ from a pinned tile of another dtype would cast into pageable memory and
            # copy from there synchronously.
            src = self._take(stop - start, target.dtype, True)
            src.data.copy_(tile.data)
            self._give(tile)
        # Same dtype now: moved as bytes where torch has no copy kernel for it.
        flat, target = as_copyable(src.data), as_copyable(target)
        # Only a GPU run proves these copies: queued on the copy stream, after the caller's
        # work (``prepare``), returning at once from pinned memory.
        stream = self._streams[index]
        with torch.no_grad(), device.use_stream(stream):
            pos = 0
            for view in range_views(target, start, stop):
                n = view.numel()
                device.copy(view, flat[pos : pos + n].view(view.shape), src.pinned)
                pos += n
        if not src.pinned:  # a synchronous copy: done
            self._give(src)
            return
        # Only a GPU run proves that the event passes once these copies have read the tile.
        self._in_flight.append((src.block, device.record_event(stream)))
        self._in_flight_total += src.block.numel()
        self._settle()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` from pageable host scratch that is reused once this returns (a
        box's buffer, a decoded pickle): on the host at once; to a device on the copy stream,
        synchronously."""
        index = device.cuda_index(dst)
        with torch.no_grad():
            if index is None:
                dst.copy_(src)
                return
            if dst.dtype is src.dtype:  # as bytes where torch has no copy kernel
                dst, src = as_copyable(dst), as_copyable(src)
            # Only a GPU run proves this: a blocking copy on the copy stream, after the
            # caller's work and this read's earlier copies there.
            with device.use_stream(self._streams[index]):
                device.copy(dst, src, False)

    def _settle(self) -> None:
        """Keeps free and in-flight tiles within the spare bytes: drops free tiles first, then
        waits for the copies in flight."""
        if self._free_total + self._in_flight_total <= self.spare_bytes:
            return
        self._drop_free()
        if self._in_flight_total > self.spare_bytes:
            self._reap()
        if self._in_flight_total > self.spare_bytes:
            self._drain()

    def _drop_free(self) -> None:
        self._free.clear()
        self._free_total = 0

    def _reap(self) -> None:
        """Frees the tiles whose copies the device has done, oldest first, without waiting:
        asks each one's event, up to the first not passed yet."""
        in_flight = self._in_flight
        while in_flight and device.event_done(in_flight[0][1]):
            block, _ = in_flight.popleft()
            self._in_flight_total -= block.numel()
            self._give(Tile(block, torch.uint8, True))

    def _drain(self) -> None:
        # Only a GPU run proves that this is where the tiles' copies complete.
        for stream in self._streams.values():
            device.synchronize(stream)
        landed, self._in_flight = self._in_flight, deque()
        self._in_flight_total = 0
        for block, _ in landed:
            self._give(Tile(block, torch.uint8, True))

    def finish(self) -> None:
        """After the reads (on the caller's thread; also after a failure): waits for every copy
        this read queued on a device, so that the targets hold the restored bytes and no tile
        is read any more when the restore returns; then lets the pooled tiles go."""
        if self._streams:
            self._drain()
        self._drop_free()
