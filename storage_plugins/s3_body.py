"""The body of an S3 upload request: the caller's buffers read in pieces as they are sent,
each piece checksummed as it is copied, and cut into the parts of a multipart upload."""

from __future__ import annotations

import errno
import os
from collections.abc import AsyncIterator, Callable, Iterator

try:
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - the library depends on isal; a plugin alone may not
    from zlib import crc32 as _crc32


class Body:
    """One request's body, read from the caller's buffers in pieces: never copied whole.

    What botocore and aiohttp do with each form of body decides how often it is copied. A
    ``bytes`` or ``bytearray`` body is sliced and joined whole before aiohttp hands it to the
    socket, a ``BytesIO`` must first be filled with a copy of the bytes (fresh memory, 32 MiB
    per request), and a memoryview botocore refuses. This is a file-like object (``read``,
    ``seek``, ``tell``, ``len``: what botocore needs for the Content-Length, and for hashing
    or re-sending a body if it is configured to) that aiohttp streams as an async iterable:
    each piece is a ``bytes`` copy of at most ``_PIECE_BYTES``, made as it is sent, into
    memory the allocator hands back piece after piece (warm in the CPU's cache). Copies, not
    views: the socket transport may keep what it could not send at once after the request was
    given up, and the caller's buffers are reused once ``write`` returns.
    """

    def __init__(
        self, views: list[memoryview], observe: Callable[[memoryview], None] | None = None
    ) -> None:
        self._views = views
        self._size = sum(len(v) for v in views)
        self._pos = 0
        # Where sequential reads resume: the view holding ``_pos`` and that view's offset in
        # the body (a slab's body is thousands of member views; reads must not rescan them).
        self._index = 0
        self._index_start = 0
        self._observe = observe
        self._seen = 0  # the bytes [0, _seen) were read, copied and observed
        # With ``observe``: the CRC-32 of the bytes [0, n) as first read, at the end n of each
        # read; a body read again after a seek back (botocore re-sending it, or reading it
        # once to hash it) must give the same bytes, checked against these.
        self._prefix_crcs: dict[int, int] = {0: 0}
        self._check: tuple[int, int] | None = None  # (position, CRC of [0, position)) re-read

    def __len__(self) -> int:
        return self._size

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = self._size
        pos, want = self._pos, min(n, max(0, self._size - self._pos))
        views, i, start = self._views, self._index, self._index_start
        if pos < start:  # a seek back: start over
            i = start = 0
        pieces: list[memoryview] = []
        while want and i < len(views):
            v = views[i]
            if pos < start + len(v):
                piece = v[pos - start : pos - start + want]
                pieces.append(piece)
                pos += len(piece)
                want -= len(piece)
                if pos < start + len(v):
                    break  # this view has more for the next read
            start += len(v)
            i += 1
        begin = self._pos
        self._pos, self._index, self._index_start = pos, i, start
        data = bytes(pieces[0]) if len(pieces) == 1 else b"".join(pieces)
        if self._observe is not None and data:
            self._observed(begin, memoryview(data))
        return data

    def _observed(self, begin: int, data: memoryview) -> None:
        """Shows the copy ``data`` of the body's bytes from ``begin`` on to the observer, each
        byte once, the first time it is read; a byte read again must be what was observed
        (an ``OSError`` otherwise: the bytes sent would not be those checksummed)."""
        end = begin + len(data)
        if begin < self._seen:  # read again, after a seek back
            check = self._check
            if check is None or check[0] != begin:
                if begin not in self._prefix_crcs:
                    raise OSError(
                        errno.EIO, f"an upload's body was read again from byte {begin}, "
                        "where no read of it ended: its checksum cannot be kept"
                    )
                check = (begin, self._prefix_crcs[begin])
            again = min(end, self._seen) - begin
            value = _crc32(data[:again], check[1])
            at = begin + again
            recorded = self._prefix_crcs.get(at)
            if recorded is not None and recorded != value:
                raise OSError(
                    errno.EIO, "an upload's body changed between two reads of it (its memory "
                    "was written meanwhile): what is sent would not be what was checksummed"
                )
            self._check = (at, value)
            data = data[again:]
            begin = at
            if not data:
                return
        if begin > self._seen:
            raise OSError(
                errno.EIO, f"an upload's body was read from byte {begin}, past the bytes read "
                f"so far ({self._seen}): its checksum cannot be kept"
            )
        self._observe(data)  # type: ignore[misc]  # checked by the caller
        self._prefix_crcs[end] = _crc32(data, self._prefix_crcs[begin])
        self._seen = end

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while piece := self.read(_PIECE_BYTES):
            yield piece

    def close(self) -> None:
        self._views = []


# A piece of a request body: large enough that a 32 MiB body is 128 socket writes, small
# enough to be reused from the allocator's heap (not a fresh mmap) and to stay in cache.
_PIECE_BYTES = 256 << 10


def split_parts(views: list[memoryview], part_bytes: int) -> Iterator[list[memoryview]]:
    """Cuts the concatenation of ``views`` into consecutive parts of ``part_bytes`` (the last
    one shorter), each a list of slices of the views: nothing is copied here."""
    part: list[memoryview] = []
    room = part_bytes
    for v in views:
        while len(v):
            take = v[:room]
            part.append(take)
            v = v[len(take) :]
            room -= len(take)
            if room == 0:
                yield part
                part, room = [], part_bytes
    if part:
        yield part
