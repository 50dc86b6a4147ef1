"""Compressed ranges (format version 6): where a range's compressed bytes lie in its blob
(``Frame``, a ``Location``'s ``stored``) and their strict decoding; imported only by a take
that compresses and by a reader of a manifest that records one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_CRC32 = 0xFFFFFFFF

# The codecs a compressed range may name.
CODECS = ("zstd",)
# The most raw bytes one stored byte may hold (a zstd block of 128 KiB repeating one byte is
# stored in 4 bytes): a manifest claiming more is damaged, and never makes a reader allocate it.
MAX_RATIO = 1 << 15


@dataclass(frozen=True, slots=True)
class Frame:
    """A compressed range as stored: ``codec`` (``"zstd"``: one zstd frame) over the ``nbytes``
    bytes at ``offset`` of its location's blob, with their CRC-32 ``crc32`` (None when the
    snapshot was taken without checksums). The location's ``crc32`` is that of the bytes
    decompressed: a range is checked after decompression and before."""

    codec: str
    offset: int
    nbytes: int
    crc32: int | None


def decode_frame(value: Any, raw_nbytes: int, where: str, error: type[Exception]) -> Frame:
    """The ``Frame`` of a location's fifth field ``[codec, offset, nbytes, crc32]``, whose bytes
    decompress to ``raw_nbytes``; an ``error`` (the decoder's ``ManifestDecodeError``; this
    module imports none of ``manifest.entries``, which imports it) naming ``where`` for
    anything else."""
    ok = type(value) is list and len(value) == 4 and value[0] in CODECS
    if ok:
        codec, offset, nbytes, crc = value
        ok = (
            type(offset) is int
            and type(nbytes) is int
            and offset >= 0
            and nbytes > 0
            and (crc is None or (type(crc) is int and 0 <= crc <= MAX_CRC32))
        )
    if not ok:
        raise error(
            f"{where}: expected a compressed range [codec ({', '.join(CODECS)}), offset, nbytes, "
            f"crc32], got {value!r}"
        )
    if raw_nbytes > nbytes * MAX_RATIO:
        raise error(
            f"{where}: a compressed range of {nbytes:,} bytes claims {raw_nbytes:,} bytes "
            f"decompressed, more than {MAX_RATIO:,} times as many: the manifest is damaged"
        )
    return Frame(codec, offset, nbytes, crc)
