"""The stored bytes and their format: the dtype table, byte views of tensor memory and what
that memory can be trusted for, the object codec, CRC-32 checksums, and which writer's format a
snapshot holds.
"""

from __future__ import annotations

import codecs
import ctypes
import importlib
import io
import pickle
import re
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch
from isal import isal_zlib

from manifest import Location
from snapshot.errors import (
    ChecksumError,
    CorruptSnapshotError,
    IncompatibleSnapshotError,
    UnsafeObjectError,
)

# Every dtype this torch build knows, by the name the manifest records ("float32", "bfloat16").
DTYPES: dict[str, torch.dtype] = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)
}


_NAMES = {v: k for k, v in DTYPES.items()}

# One-byte dtypes torch has no copy kernel for (int1-int7, uint1-uint7 hold a byte per element):
# their bytes are moved through uint8 views of the same shape and strides (``as_copyable``), so
# a transposed or sliced one is copied like any other.
BYTE_VIEW_DTYPES = frozenset(
    getattr(torch, f"{sign}int{bits}")
    for sign in ("", "u")
    for bits in range(1, 8)
    if hasattr(torch, f"{sign}int{bits}")
)


def as_copyable(t: torch.Tensor) -> torch.Tensor:
    """``t``, or for a dtype of ``BYTE_VIEW_DTYPES`` its uint8 view: the same bytes, which
    torch's copy kernels accept."""
    return t.view(torch.uint8) if t.dtype in BYTE_VIEW_DTYPES else t


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest's name of ``dtype``."""
    return _NAMES.get(dtype) or str(dtype).removeprefix("torch.")


def dtype_from_name(name: str, where: str) -> torch.dtype:
    """The dtype a manifest names; a clear error when this torch build lacks it."""
    try:
        return DTYPES[name]
    except KeyError:
        raise IncompatibleSnapshotError(
            f"{where}: dtype {name!r} is unknown to torch {torch.__version__}; "
            "restore with the torch version that took the snapshot, or a newer one"
        ) from None


def tensor_memoryview(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory, without copying (through
    NumPy; a dtype NumPy lacks, bfloat16 or float8, through the tensor's uint8 view).

    The caller holds ``t`` as long as it uses the view. A lazily negated or conjugated tensor
    is refused: its memory does not hold its values.
    """
    if not t.is_cpu or not t.is_contiguous():
        raise ValueError("tensor_memoryview needs a contiguous CPU tensor")
    if t.numel() == 0:
        return memoryview(bytearray())
    t = t.detach()
    if t.dtype in _NUMPY_DTYPES:
        return t.numpy().data.cast("B")
    return t.reshape(-1).view(torch.uint8).numpy().data


_NUMPY_DTYPES = frozenset(
    {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}
    | {torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128}
)


def raw_memoryview(address: int, nbytes: int) -> memoryview:
    """A writable byte view of ``nbytes`` of memory at ``address`` (inside a tensor the caller
    keeps alive while the view is used): for callers that hold addresses, not tensors."""
    if nbytes == 0:
        return memoryview(bytearray())
    if address <= 0 or nbytes < 0:
        raise ValueError(f"no memory at address {address} of {nbytes} bytes")
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


def range_views(t: torch.Tensor, start: int, stop: int) -> list[torch.Tensor]:
    """Views of ``t`` that together are its elements ``[start, stop)`` in row-major order.

    One view for a contiguous tensor; for another, at most two partial rows per dimension plus
    one block of whole rows, so a range never needs a copy of more than itself.
    """
    if start >= stop:
        return []
    if t.is_contiguous():
        return [t.view(-1)[start:stop]]
    if t.dim() == 1:
        return [t[start:stop]]
    row = t[0].numel()
    first, last = start // row, (stop - 1) // row
    if first == last:
        return range_views(t[first], start - first * row, stop - first * row)
    views: list[torch.Tensor] = []
    if start % row:
        views += range_views(t[first], start % row, row)
        first += 1
    whole_end = stop // row
    if whole_end > first:
        views.append(t[first:whole_end])
    if stop % row:
        views += range_views(t[whole_end], 0, stop % row)
    return views


def gather_elements(t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """A new contiguous CPU tensor holding elements ``[start, stop)`` of ``t`` (any layout or
    device); the device-to-host copy is the only line here that needs an accelerator to run."""
    out = torch.empty(stop - start, dtype=t.dtype)
    scatter_into_flat(out, range_views(t, start, stop))
    return out


def scatter_into_flat(flat: torch.Tensor, views: list[torch.Tensor]) -> None:
    """Copies ``views`` one after another into the 1-d tensor ``flat`` (synchronously; a
    device's asynchronous copies go through ``snapshot._engine.io.device``)."""
    pos = 0
    for v in views:
        n = v.numel()
        flat[pos : pos + n].view(v.shape).copy_(v)
        pos += n


def copy_elements(target: torch.Tensor, start: int, stop: int, flat: torch.Tensor) -> None:
    """Copies the 1-d tensor ``flat`` into elements ``[start, stop)`` of ``target`` (any layout,
    device or dtype: ``copy_`` casts as ``load_state_dict`` would)."""
    if flat.dtype is target.dtype:
        target, flat = as_copyable(target), as_copyable(flat)
    pos = 0
    for v in range_views(target, start, stop):
        n = v.numel()
        v.copy_(flat[pos : pos + n].view(v.shape))
        pos += n


def memory_span(t: torch.Tensor) -> tuple[int, int]:
    """The addresses ``[start, end)`` of the memory ``t``'s elements lie in (empty when it has
    none), whatever the signs of its strides."""
    if t.numel() == 0:
        return 0, 0
    low = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True) if s < 0)
    high = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True) if s > 0)
    size = t.element_size()
    return t.data_ptr() + low * size, t.data_ptr() + (high + 1) * size


def storage_shortfall(t: torch.Tensor) -> tuple[int, int] | None:
    """``(bytes needed, bytes held)`` when ``t``'s storage is shorter than the elements it views
    reach (a view of a storage freed with ``resize_(0)``, as FSDP does); None when it holds them
    (or ``t`` has none)."""
    if t.numel() == 0:
        return None
    reach = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    needed = int((t.storage_offset() + reach + 1) * t.element_size())
    held = t.untyped_storage().nbytes()
    return (needed, held) if needed > held else None


def shares_memory(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` are one place in memory (an expanded view, ``as_strided``
    with overlapping strides): a restore target that cannot hold distinct values.

    The dimensions of more than one element, by increasing stride, must each step past all the
    memory the smaller ones span; a zero stride never does. Layouts that fail the test without a
    zero stride (interleaved dimensions, rare) are decided exactly, by the elements' offsets.
    """
    if t.layout is not torch.strided or t.numel() <= 1 or t.is_contiguous():
        return False
    dims = sorted((s, n) for n, s in zip(t.shape, t.stride(), strict=True) if n > 1)
    span = 1  # elements spanned by the dimensions so far
    for stride, size in dims:
        if stride == 0:
            return True
        if stride < span:
            offsets = torch.zeros((), dtype=torch.int64)
            for n, s in zip(t.shape, t.stride(), strict=True):
                offsets = offsets.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * s
            return offsets.flatten().unique().numel() != t.numel()
        span += stride * (size - 1)
    return False


class _Pickler(pickle._Pickler):
    """The pure-Python pickler, writing an empty ``bytes`` as it writes any other.

    ``torch.save`` pickles with protocol 2, which has no opcode for bytes: a non-empty one is
    written as ``_codecs.encode(text, 'latin1')``, which the safe loader allows, but an empty
    one as a call of ``bytes()`` (``GLOBAL __builtin__ bytes`` + ``REDUCE``), which it refuses.
    Allowing ``bytes`` there is no fix (a hostile pickle could call ``bytes(10**12)``), so the
    empty one is written as ``_codecs.encode('', 'latin1')`` instead. Everything else is
    written by the pure-Python pickler, which gives the same bytes as the C one.
    """

    # What the pure-Python pickler has, and typeshed does not declare.
    proto: int
    save_reduce: Callable[..., None]
    dispatch: ClassVar[dict[type, Callable[[Any, Any], None]]] = dict(pickle._Pickler.dispatch)
    plain_save_bytes = dispatch[bytes]

    def save_bytes(self, obj: bytes) -> None:
        if self.proto < 3 and not obj:
            self.save_reduce(codecs.encode, ("", "latin1"), obj=obj)
        else:
            _Pickler.plain_save_bytes(self, obj)

    dispatch[bytes] = save_bytes


# What ``torch.save`` takes as ``pickle_module`` (it uses only ``Pickler`` and ``__name__``).
_EMPTY_BYTES_PICKLE = types.SimpleNamespace(__name__="pickle", Pickler=_Pickler)

# The protocol 2 opcode naming ``bytes``: how the C pickler starts an empty ``bytes``.
_BYTES_GLOBAL = b"c__builtin__\nbytes\n"


def encode_object(obj: object) -> bytes:
    """Serializes a non-tensor, non-primitive value with ``torch.save``; a value holding an
    empty ``bytes`` again with ``_Pickler`` (only it pays for the slower pure-Python pickler)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    if _BYTES_GLOBAL in data:  # torch.save stores its records uncompressed: the name is there
        buf = io.BytesIO()
        torch.save(obj, buf, pickle_module=_EMPTY_BYTES_PICKLE)
        data = buf.getvalue()
    return data


_numpy_allowed = False


def _allow_numpy() -> None:
    """Lets the safe loader rebuild NumPy arrays and scalars (a metric's ``np.float64``, an
    array in a data loader's state), added to torch's process-wide allow-list once, the first
    time a pickle names NumPy (a scoped ``safe_globals`` block would be undone under another
    thread's decode). The names allowed build an array, a scalar or a dtype from raw bytes and
    type codes, nothing else: an object array's elements go through the same loader."""
    global _numpy_allowed
    if _numpy_allowed:
        return
    # NumPy 2 moved numpy.core to numpy._core (1.26 has a numpy._core of its own, without it).
    core = "numpy.core" if np.__version__.startswith("1.") else "numpy._core"
    multiarray = importlib.import_module(f"{core}.multiarray")
    # A dtype's state is set on an instance of its class (``numpy.dtypes.Float64DType``...).
    dtype_classes = [
        c
        for c in vars(getattr(np, "dtypes", np)).values()
        if isinstance(c, type) and issubclass(c, np.dtype)
    ]
    torch.serialization.add_safe_globals(
        [np.ndarray, np.dtype, multiarray._reconstruct, multiarray.scalar, *dtype_classes]
    )
    _numpy_allowed = True


def decode_object(data: bytes, where: str) -> object:
    """Deserializes what :func:`encode_object` wrote, with torch's ``weights_only`` loader.

    That loader only rebuilds tensors, primitives, containers, NumPy arrays and scalars
    (``_allow_numpy``) and the types allowed by ``torch.serialization.add_safe_globals``; it
    never calls anything the bytes name otherwise.
    """
    if b"numpy" in data:  # torch.save stores its records uncompressed: the names are there
        _allow_numpy()
    try:
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        if not re.search(r"GLOBAL|allowlist|unrecognized function|Can only", str(e)):
            raise CorruptSnapshotError(f"{where}: object bytes cannot be decoded: {e}") from e
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
        name = found.group(1) if found else "YourType"
        what = f"it names {name}, which" if found else "it names a function or class that"
        raise UnsafeObjectError(
            f"{where}: refused to load this object: {what} the safe loader does not allow "
            "(loading it could run code carried by the snapshot). If you trust this snapshot, "
            f"allow the type with torch.serialization.add_safe_globals([{name}]) before "
            "restoring."
        ) from e
    except Exception as e:
        raise CorruptSnapshotError(f"{where}: object bytes cannot be decoded: {e}") from e


# ---------------------------------------------------------------------------------------------
# CRC-32 checksums (ISA-L's, the zlib polynomial) of stored bytes: each location's is in the
# manifest. The plugin's I/O threads show each piece they move to a ``RangeDigest``; a write's
# CRC is of the copy written, never of the application's memory, which may change meanwhile. A
# location read in pieces is checked by a ``LocationCheck``, which combines them in any order.

crc32 = isal_zlib.crc32
"""``crc32(data, value=0)``: the CRC-32 of ``data``; with ``value``, of the bytes whose CRC was
``value`` followed by ``data``."""

combine = isal_zlib.crc32_combine
"""``combine(crc_a, crc_b, nbytes_b)``: the CRC-32 of bytes A followed by bytes B."""


class RangeDigest:
    """The running CRC-32 of given ranges of a stream of bytes that arrives in pieces.

    ``ranges`` are ``(offset, nbytes)`` within the stream, ascending and not overlapping (the
    members of a slab, with padding between them; the wanted parts of a read, with gaps). Call
    the digest with each piece of the stream, in order; ``values`` then holds each range's CRC.
    """

    __slots__ = ("_next", "_pos", "ranges", "values")

    def __init__(self, ranges: Sequence[tuple[int, int]]) -> None:
        self.ranges = ranges
        self.values = [0] * len(ranges)
        self._pos = 0  # where the next piece starts in the stream
        self._next = 0  # the first range not yet complete

    def __call__(self, piece: memoryview) -> None:
        start = self._pos
        end = self._pos = start + len(piece)
        ranges, values = self.ranges, self.values
        i = self._next
        while i < len(ranges):
            offset, nbytes = ranges[i]
            if offset >= end and nbytes:
                break
            lo, hi = max(offset, start), min(offset + nbytes, end)
            if hi > lo:
                values[i] = crc32(piece[lo - start : hi - start], values[i])
            if offset + nbytes > end:
                break
            i += 1
        self._next = i


def _mismatch(label: str, loc: Location, got: int) -> ChecksumError:
    return ChecksumError(
        f"{label}: checksum mismatch in blob {loc.blob}, bytes "
        f"[{loc.offset}, {loc.offset + loc.nbytes}): the manifest records crc32 "
        f"{loc.crc32:#010x}, the bytes read have {got:#010x}; the blob is damaged"
    )


class LocationCheck:
    """Verifies one location's bytes as its pieces arrive, in any order.

    ``add`` takes each piece's offset (within the location), length and CRC; once the pieces
    cover the location, their combined CRC must be the one the manifest records, or
    ``ChecksumError`` names ``label`` (the logical path) and the blob.
    """

    __slots__ = ("_got", "_pieces", "label", "location")

    def __init__(self, label: str, location: Location, pieces: int) -> None:
        self.label = label
        self.location = location
        self._pieces = pieces
        self._got: list[tuple[int, int, int]] = []

    def add(self, offset: int, nbytes: int, value: int) -> None:
        self._got.append((offset, nbytes, value))
        if len(self._got) < self._pieces:
            return
        self._got.sort()
        total = 0
        for _, n, v in self._got:
            total = combine(total, v, n)  # the CRC of nothing is 0
        if total != self.location.crc32:
            raise _mismatch(self.label, self.location, total)


class WholeCheck:
    """Verifies a location read in one piece: called with that piece's CRC, which must be the
    recorded one (a ``LocationCheck`` of one piece, without its bookkeeping)."""

    __slots__ = ("label", "location")

    def __init__(self, label: str, location: Location) -> None:
        self.label = label
        self.location = location

    def __call__(self, value: int) -> None:
        if value != self.location.crc32:
            raise _mismatch(self.label, self.location, value)


# ---------------------------------------------------------------------------------------------
# Which backend and version wrote each part of a snapshot (sharded entries; the rest), recorded
# under ``metadata["strategies"]`` at take and checked at restore: by default against
# ``BACKEND``/``VERSION``; once ``snapshot.strategies`` is imported, its registry decides
# (``set_check``: the engine never imports that layer).

BACKEND = "statesnap"
VERSION = 1

# (part, backend, version) -> None, or raises IncompatibleSnapshotError.
Check = Callable[[str, str, int], None]


def _builtin_check(part: str, backend: str, version: int) -> None:
    if (backend, version) != (BACKEND, VERSION):
        raise IncompatibleSnapshotError(
            f"no load_{part} strategy is registered for backend {backend!r} version {version}; "
            f"registered: {BACKEND} v{VERSION}"
        )


_check: Check = _builtin_check


def set_check(check: Check) -> None:
    """Makes ``check`` decide whether a part written by (backend, version) can be read."""
    global _check
    _check = check


def recorded(backend: str = BACKEND, version: int = VERSION) -> dict[str, list[Any]]:
    """What a take records under ``metadata["strategies"]``: ``backend`` and ``version`` as the
    writer of both parts."""
    return {"sharded": [backend, version], "common": [backend, version]}


def check_readable(metadata: Mapping[str, Any], where: str) -> None:
    """Checks that each part of the snapshot ``where`` (whose manifest's metadata is
    ``metadata``) was written by a backend and version that can be read.

    Raises:
        IncompatibleSnapshotError: the manifest does not say who wrote a part, or nothing
            reads what it says.
    """
    # Manifests written before strategies were recorded were written by this version.
    written = metadata.get("strategies", recorded(BACKEND, 1))
    for part in ("common", "sharded"):
        writer = written.get(part) if isinstance(written, dict) else None
        if (
            not isinstance(writer, list)
            or len(writer) != 2
            or not isinstance(writer[0], str)
            or type(writer[1]) is not int
        ):
            raise IncompatibleSnapshotError(
                f"snapshot {where}: the manifest does not say which backend and version wrote its "
                f"{part} part (metadata.strategies.{part}: {writer!r})"
            )
        try:
            _check(part, writer[0], writer[1])
        except IncompatibleSnapshotError as e:
            raise IncompatibleSnapshotError(f"snapshot {where}, {part} part: {e}") from None


class MissingBytes(EOFError):
    """A read of bytes an ``ArchiveEnds`` was not given."""


class ArchiveEnds(io.RawIOBase):
    """A seekable file of ``size`` bytes of which only ``head`` (its start) and ``tail`` (its
    end) are known: enough for ``zipfile`` to list an archive's members (its directory is at
    the end) and read its first records, without the bytes in between. A read that starts in
    the head returns what the head holds of it (a short read); one that starts in between
    raises ``MissingBytes``."""

    def __init__(self, size: int, head: bytes, tail: bytes) -> None:
        self.size, self.head, self.tail, self.pos = size, head, tail, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, out: Any) -> int:
        start = self.pos
        end = start + max(0, min(len(out), self.size - start))
        cut = self.size - len(self.tail)
        if start >= cut:
            data = self.tail[start - cut : end - cut]
        elif start < len(self.head):
            data = self.head[start:end]
        else:
            raise MissingBytes(f"bytes {start}-{end} of the archive were not read")
        memoryview(out)[: len(data)] = data
        self.pos = start + len(data)
        return len(data)
