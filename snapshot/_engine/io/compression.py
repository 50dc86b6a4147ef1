"""Ranges stored compressed (``Options.zstd_level``, format version 6): a take's writes that
compress each payload into a zstd frame of its own (``compressed_write``), and the storage a
reader of such a snapshot reads through (``Inflating``), which serves every range as the blob
would hold it uncompressed. Imported only by a take that compresses and by a reader of a
snapshot that records compressed ranges: a plain take or restore never enters it.

A compressed range is checked before it is decompressed (the CRC-32 of its stored bytes,
``Frame.crc32``) and after (its location's ``crc32``, checked by the reads as for any range).
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from manifest import Manifest
from manifest.frames import Frame
from snapshot._engine.format.serialization import crc32
from snapshot._engine.io.pipeline import WriteRequest
from snapshot.errors import ChecksumError, CorruptSnapshotError, IncompatibleSnapshotError
from storage_plugins import Buffer, StoragePlugin
from storage_plugins.base import FrozenBuffers, off_loop

if TYPE_CHECKING:
    from snapshot._engine.io.staging import Slab

# What to install for compression (pyproject.toml's extra).
EXTRA = "pip install zstandard (the zstd extra: pip install -e '.[zstd]' from a clone)"
# A payload of the caller's own memory is compressed from copies of this many bytes at a time,
# each checksummed as it is compressed: the two see the same bytes while another thread writes.
_PIECE_BYTES = 1 << 20
# Decompression streams kept between reads of one compressed range (a read of its next bytes
# goes on from where the last stopped).
_CURSORS = 16


def zstandard(why: str) -> Any:
    """The ``zstandard`` module; ``IncompatibleSnapshotError`` naming what to install (``why``:
    what needs it) when it is missing."""
    try:
        import zstandard
    except ImportError as e:
        raise IncompatibleSnapshotError(
            f"{why} needs the zstandard package, which is not installed: {EXTRA}"
        ) from e
    return zstandard


def _bound(nbytes: int) -> int:
    """At least the bytes zstd makes of ``nbytes`` bytes at worst (its ZSTD_COMPRESSBOUND)."""
    return nbytes + (nbytes >> 8) + 1024


# ---------------------------------------------------------------------------------------------
# Writes.


def compressed_write(
    slab: Slab,
    stage: Callable[[], tuple[Sequence[Buffer], object]],
    cost: int,
    checksums: bool,
    level: int,
) -> WriteRequest:
    """The write of ``slab`` (staged by ``stage``, which allocates ``cost`` bytes): each member
    compressed into a zstd frame of its own, end to end, on a worker thread as it is written;
    the compressed bytes are charged to the budget too."""
    zstandard("Options.zstd_level")  # before the first write: a missing package fails the take
    extra = sum(_bound(p.nbytes) for p in slab.members)
    encode = functools.partial(_encode, slab, checksums, level)
    return WriteRequest(slab.blob, slab.nbytes, cost + extra, stage, slab.label(), (), encode)


def _encode(slab: Slab, checksums: bool, level: int, buffers: Sequence[Buffer]) -> list[bytes]:
    """The frames of ``slab``'s members from its staged ``buffers``; sets each member's
    ``stored`` (where its frame lies) and, with ``checksums``, its ``crc32`` (of its bytes)."""
    zstd = zstandard("Options.zstd_level")
    data = memoryview(buffers[0] if len(buffers) == 1 else b"".join(buffers)).cast("B")
    # Staged into memory of the take's own (a slab, a pooled buffer, a gathered copy, bytes),
    # or a view of the caller's tensor, compressed from copies.
    own = isinstance(buffers, FrozenBuffers) or not slab.alone or slab.members[0].data is not None
    cctx = zstd.ZstdCompressor(level=level)
    frames: list[bytes] = []
    at = 0
    for p in slab.members:
        raw = data[p.pos : p.pos + p.nbytes]
        if own:
            frame = cctx.compress(raw)
            if checksums and p.crc32 is None:  # (a slab's members have theirs from staging)
                p.crc32 = crc32(raw)
        else:
            frame, value = _compress_copies(cctx, raw)
            if checksums:
                p.crc32 = value
        p.stored = Frame("zstd", at, len(frame), crc32(frame) if checksums else None)
        frames.append(frame)
        at += len(frame)
    return frames


def _compress_copies(cctx: Any, raw: memoryview) -> tuple[bytes, int]:
    """One frame of ``raw`` and the CRC-32 of its bytes, both from the same copies of it."""
    stream = cctx.compressobj(size=len(raw))
    parts, value = [], 0
    for lo in range(0, len(raw), _PIECE_BYTES):
        piece = bytes(raw[lo : lo + _PIECE_BYTES])
        value = crc32(piece, value)
        parts.append(stream.compress(piece))
    parts.append(stream.flush())
    return b"".join(parts), value


# ---------------------------------------------------------------------------------------------
# Reads.


# A blob's compressed ranges: their raw offsets, sorted, and (raw offset, raw bytes, frame) each.
_Index = tuple[list[int], list[tuple[int, int, Frame]]]


def frame_index(manifest: Manifest) -> dict[str, _Index]:
    """Blob -> its compressed ranges, from every location of ``manifest`` (kept with it)."""
    index = manifest.__dict__.get("_frame_index")
    if index is None:
        found: dict[str, dict[int, tuple[int, Frame]]] = {}
        for entry in manifest.entries.values():
            for loc in entry.locations:
                if loc.stored is not None and loc.nbytes:  # (nothing is read of an empty one)
                    found.setdefault(loc.blob, {})[loc.offset] = (loc.nbytes, loc.stored)
        index = {}
        for blob, spans in found.items():
            items = [(offset, n, frame) for offset, (n, frame) in sorted(spans.items())]
            index[blob] = ([offset for offset, _, _ in items], items)
        manifest.__dict__["_frame_index"] = index
    return index


class _Cursor:
    """A compressed range being decompressed front to back: ``pos`` raw bytes read so far."""

    def __init__(self, zstd: Any, data: memoryview, nbytes: int, where: str) -> None:
        self.zstd = zstd
        self.reader = zstd.ZstdDecompressor().stream_reader(data)
        self.nbytes = nbytes
        self.where = where
        self.pos = 0

    def read(self, lo: int, out: memoryview) -> None:
        """Fills ``out`` with the raw bytes from ``lo`` on (``lo >= pos``)."""
        try:
            if lo > self.pos:
                self.reader.seek(lo)
                self.pos = lo
            filled = 0
            while filled < len(out):
                n = self.reader.readinto(out[filled:])
                if not n:
                    raise CorruptSnapshotError(
                        f"{self.where} decompresses to {self.pos + filled:,} bytes, fewer than "
                        f"the {self.nbytes:,} the manifest records; the blob is damaged"
                    )
                filled += n
        except self.zstd.ZstdError as e:
            raise CorruptSnapshotError(
                f"{self.where} cannot be decompressed ({e}); the blob is damaged"
            ) from None
        self.pos += len(out)


class InflatedCheck:
    """``verify``'s check of a compressed range once decompressed, given its stored bytes in
    order (``add``): its length and CRC-32 against those its location records (``nbytes``,
    ``crc32``). Decompresses as the pieces come, holding at most one piece's output."""

    def __init__(self, nbytes: int, crc32: int | None) -> None:
        self.zstd = zstandard("verifying a snapshot taken with Options.zstd_level")
        self.nbytes, self.crc32 = nbytes, crc32
        self.count = self.value = 0
        self.failed = False
        self._stream = self.zstd.ZstdDecompressor().stream_writer(self, write_size=_PIECE_BYTES)

    def write(self, data: bytes) -> int:  # (the stream's output)
        self.value = crc32(data, self.value)
        self.count += len(data)
        return len(data)

    def flush(self) -> None:
        pass

    def add(self, piece: memoryview, last: bool) -> str | None:
        """Decompresses the next ``piece``; once the ``last`` (and the stored bytes matched
        their CRC-32), returns what is wrong with the result, if anything."""
        if not self.failed:
            try:
                self._stream.write(piece)
            except self.zstd.ZstdError as e:
                self.failed = True
                return f"cannot be decompressed: {e}"
        if not last or self.failed:
            return None
        if self.count != self.nbytes:
            return f"decompresses to {self.count:,} bytes, the manifest records {self.nbytes:,}"
        if self.crc32 is not None and self.value != self.crc32:
            return (
                f"checksum mismatch once decompressed: the manifest records crc32 "
                f"{self.crc32:#010x}, the bytes have {self.value:#010x}"
            )
        return None


class Inflating(StoragePlugin):
    """Reads through ``inner`` a snapshot whose manifest records compressed ranges (``index``,
    from ``frame_index``): a read of a blob holding any returns the bytes the blob would hold
    uncompressed (zeros between ranges), each range read whole, checked against its stored
    CRC-32 when ``verify``, and decompressed as far as the reads need, streaming; every other
    call goes to ``inner``, whose opener closes it."""

    def __init__(self, inner: StoragePlugin, index: dict[str, _Index], verify: bool) -> None:
        self.inner = inner
        self.index = index
        self.verify = verify
        self.zstd = zstandard("reading a snapshot taken with Options.zstd_level")
        self._cursors: dict[tuple[str, int], _Cursor] = {}

    async def readv(self, path: str, offset: int, outs: Sequence[memoryview]) -> None:
        index = self.index.get(path)
        if index is None:
            await self.inner.readv(path, offset, outs)
            return
        ahead = await self._read_ahead(path, index, offset, offset + sum(map(len, outs)))
        for out in outs:
            await self._fill(path, index, offset, out, ahead)
            offset += len(out)

    async def _read_ahead(
        self, path: str, index: _Index, lo: int, hi: int
    ) -> dict[int, memoryview]:
        """The stored bytes of the ranges a read of raw ``[lo, hi)`` touches, by raw offset,
        read at once when it touches several (a merged read of a slab's members: one read, not
        one per member) that lie together as stored; else nothing."""
        starts, spans = index
        first = max(bisect.bisect_right(starts, lo) - 1, 0)
        touched = [s for s in spans[first : bisect.bisect_left(starts, hi)] if s[0] + s[1] > lo]
        if len(touched) < 2:
            return {}
        begin = min(f.offset for _, _, f in touched)
        end = max(f.offset + f.nbytes for _, _, f in touched)
        if end - begin > sum(f.nbytes for _, _, f in touched) + 64 * len(touched):
            return {}  # not laid out as a take lays them out: each read alone
        data = memoryview(bytearray(end - begin))
        await self.inner.read_into(path, begin, data)
        return {raw: data[f.offset - begin :][: f.nbytes] for raw, _, f in touched}

    async def read_into(self, path: str, offset: int, out: memoryview) -> None:
        await self.readv(path, offset, [out])

    async def _fill(
        self, path: str, index: _Index, pos: int, out: memoryview, ahead: dict[int, memoryview]
    ) -> None:
        starts, spans = index
        filled = 0
        while filled < len(out):
            at = pos + filled
            i = bisect.bisect_right(starts, at) - 1
            if i >= 0 and at < spans[i][0] + spans[i][1]:
                start, nbytes, frame = spans[i]
                n = min(len(out) - filled, start + nbytes - at)
                piece = out[filled:][:n]
                await self._inflate(path, start, nbytes, frame, at - start, piece, ahead)
            elif i + 1 < len(starts):  # between two ranges: what a merged read drops
                n = min(len(out) - filled, starts[i + 1] - at)
                out[filled : filled + n] = bytes(n)
            else:
                raise EOFError(
                    f"{self.describe(path)}: bytes {at:,}.. lie beyond its last compressed range"
                )
            filled += n

    async def _inflate(
        self,
        path: str,
        start: int,
        nbytes: int,
        frame: Frame,
        lo: int,
        out: memoryview,
        ahead: dict[int, memoryview],
    ) -> None:
        """Bytes ``lo`` on of the range at raw ``start`` into ``out`` (its stored bytes from
        ``ahead``, if read there)."""
        key = (path, start)
        cursor = self._cursors.pop(key, None)
        if cursor is None or cursor.pos > lo:
            end = frame.offset + frame.nbytes
            where = f"blob {self.describe(path)}, compressed bytes [{frame.offset:,}, {end:,})"
            data = ahead.get(start)
            if data is None:
                data = memoryview(bytearray(frame.nbytes))
                await self.inner.read_into(path, frame.offset, data)
            if self.verify and frame.crc32 is not None:
                got = await off_loop(len(data), crc32, data)
                if got != frame.crc32:
                    raise ChecksumError(
                        f"checksum mismatch in {where}: the manifest records crc32 "
                        f"{frame.crc32:#010x}, the bytes read have {got:#010x}; the blob is "
                        "damaged"
                    )
            cursor = _Cursor(self.zstd, data, nbytes, where)
        await off_loop(len(out) + lo - cursor.pos, cursor.read, lo, out)
        if cursor.pos < nbytes:
            if len(self._cursors) >= _CURSORS:
                del self._cursors[next(iter(self._cursors))]
            self._cursors[key] = cursor

    # Everything else: the inner plugin's.
    async def write(self, path: str, buffers: Sequence[Buffer]) -> None:
        await self.inner.write(path, buffers)

    async def read(self, path: str) -> bytes:
        return await self.inner.read(path)

    async def read_limited(self, path: str, limit: int) -> bytes:
        return await self.inner.read_limited(path, limit)

    async def size(self, path: str) -> int | None:
        return await self.inner.size(path)

    async def exists(self, path: str) -> bool:
        return await self.inner.exists(path)

    async def delete(self, path: str) -> None:
        await self.inner.delete(path)

    def describe(self, path: str) -> str:
        return self.inner.describe(path)

    def is_transient(self, error: BaseException) -> bool:
        return self.inner.is_transient(error)

    def forget(self) -> None:
        self._cursors.clear()
        self.inner.forget()


def inflating(plugin: StoragePlugin, manifest: Manifest, verify: bool) -> StoragePlugin:
    """``plugin``, read through ``Inflating`` when ``manifest`` records compressed ranges."""
    index = frame_index(manifest)
    return Inflating(plugin, index, verify) if index else plugin
