"""From flattened state to manifest entries and I/O requests (and back), without doing any I/O.

Take: each leaf of each ``state_dict()`` becomes an entry; tensors and large values also become
write requests whose ``stage`` step runs later, on the caller's thread, under the scheduler's
budget. Restore and ``read_object``: each entry to load becomes read requests that land in the
target tensor's memory when dtype and layout agree, or in budget-sized scratch tiles otherwise.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from manifest import (
    Entry,
    Location,
    ObjectEntry,
    PrimitiveEntry,
    TensorEntry,
)
from snapshot.errors import (
    CorruptSnapshotError,
    ShapeMismatchError,
    SnapshotError,
    UnsupportedValueError,
)
from snapshot.flatten import Leaf, flatten
from snapshot.scheduler import Piece, ReadRequest, WriteRequest
from snapshot.serialization import (
    decode_object,
    dtype_from_name,
    dtype_name,
    encode_object,
    tensor_memoryview,
    tensor_nbytes,
)
from storage_plugins import Buffer

# (logical_path, tensor, tracing) -> tensor to write; see Snapshot.take.
logger = logging.getLogger(__name__)

PrepareFunc = Callable[[str, torch.Tensor, bool], torch.Tensor]

_INLINE_TYPES = (bool, int, float, type(None))


def is_dense_tensor(value: object) -> bool:
    """Whether ``value`` is stored as raw bytes (a strided, non-quantized plain tensor)."""
    return (
        type(value) in (torch.Tensor, torch.nn.Parameter)
        and value.layout == torch.strided  # type: ignore[union-attr]
        and not value.is_quantized  # type: ignore[union-attr]
    )


def _type_name(value: object) -> str:
    t = type(value)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


# ---------------------------------------------------------------------------------------------
# Take.


@dataclass
class TakePlan:
    """Entries for the manifest (in flatten order) and the writes that fill their blobs."""

    entries: dict[str, Entry] = field(default_factory=dict)
    writes: list[WriteRequest] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.writes)


class _TakePlanner:
    def __init__(
        self,
        rank: int,
        prepare: PrepareFunc | None,
        replicated: Sequence[str],
        inline_max_bytes: int,
        copy_tensors: bool,
    ) -> None:
        self.copy_tensors = copy_tensors
        self.rank = rank
        self.prepare = prepare
        self.replicated = tuple(replicated)
        self.inline_max = inline_max_bytes
        self.plan = TakePlan()
        self._next_blob = 0
        self._written: dict[tuple[Any, ...], tuple[Location, ...]] = {}

    def _blob(self) -> str:
        name = f"{self.rank}/{self._next_blob}"
        self._next_blob += 1
        return name

    def _is_replicated(self, logical: str) -> bool:
        return any(fnmatch.fnmatchcase(logical, g) for g in self.replicated)

    def add(self, key_path: str, state: Any) -> None:
        rank_prefix = f"{self.rank}/"
        for path, node in flatten(state, rank_prefix + key_path):
            logical = path[len(rank_prefix) :]
            if isinstance(node, Leaf):
                entry = self._leaf(path, logical, node.value)
            else:
                entry = node
            if self.replicated and self._is_replicated(logical):
                entry = _with_replicated(entry)
            self.plan.entries[path] = entry

    def _leaf(self, path: str, logical: str, value: Any) -> Entry:
        if isinstance(value, torch.Tensor) and is_dense_tensor(value):
            return self._tensor(path, logical, value)
        kind = type(value)
        if kind in _INLINE_TYPES:
            return PrimitiveEntry(value=value)
        if kind is str:
            try:
                data = value.encode("utf-8")
            except UnicodeEncodeError:  # lone surrogates: only pickle keeps them
                return self._object(path, value)
            if len(data) <= self.inline_max:
                return PrimitiveEntry(value=value)
            return self._blob_entry(path, "utf8", "str", data)
        if kind is bytes:
            if len(value) <= self.inline_max:
                return PrimitiveEntry(value=value)
            return self._blob_entry(path, "bytes", "bytes", value)
        return self._object(path, value)

    def _object(self, path: str, value: Any) -> Entry:
        try:
            data = encode_object(value)
        except Exception as e:
            raise UnsupportedValueError(
                f"{path}: cannot serialize a {_type_name(value)}: {type(e).__name__}: {e}"
            ) from e
        try:
            decode_object(data, path)
        except SnapshotError as e:
            # Found out now rather than at restore time, perhaps months later.
            logger.warning(
                "%s: a %s will need an explicit opt-in to restore: %s", path, _type_name(value), e
            )
        return self._blob_entry(path, "torch_save", _type_name(value), data)

    def _blob_entry(self, path: str, serializer: str, obj_type: str, data: bytes) -> ObjectEntry:
        blob = self._blob()
        self.plan.writes.append(
            WriteRequest(
                blob=blob,
                nbytes=len(data),
                staging_bytes=0,
                stage=lambda: ([data], None),
                label=path,
            )
        )
        location = Location(blob=blob, offset=0, nbytes=len(data))
        return ObjectEntry(serializer=serializer, obj_type=obj_type, location=location)

    def _tensor(self, path: str, logical: str, tensor: torch.Tensor) -> TensorEntry:
        if tensor.device.type == "meta":
            raise UnsupportedValueError(
                f"{path}: tensor is on the meta device and holds no data to snapshot"
            )
        prepare = self.prepare
        if prepare is not None:
            traced = _call_prepare(prepare, path, logical, tensor, tracing=True)
            dtype, shape = traced.dtype, tuple(traced.shape)
            del traced
        else:
            dtype, shape = tensor.dtype, tuple(tensor.shape)
        nbytes = tensor_nbytes(dtype, shape)
        if nbytes == 0:
            return TensorEntry(dtype=dtype_name(dtype), shape=shape, chunks=())
        # The same memory under two paths (tied weights) is written once.
        key = None
        if prepare is None:
            key = (tensor.device, tensor.data_ptr(), dtype, shape, tuple(tensor.stride()))
            if key in self._written:
                return TensorEntry(dtype=dtype_name(dtype), shape=shape, chunks=self._written[key])
        zero_copy = (
            prepare is None
            and not self.copy_tensors
            and tensor.device.type == "cpu"
            and tensor.is_contiguous()
            and not tensor.is_conj()
            and not tensor.is_neg()
        )
        blob = self._blob()
        self.plan.writes.append(
            WriteRequest(
                blob=blob,
                nbytes=nbytes,
                staging_bytes=0 if zero_copy else nbytes,
                stage=_tensor_stager(
                    path, logical, tensor, prepare, dtype, shape, self.copy_tensors
                ),
                label=path,
            )
        )
        chunks = (Location(blob=blob, offset=0, nbytes=nbytes),)
        if key is not None:
            self._written[key] = chunks
        return TensorEntry(dtype=dtype_name(dtype), shape=shape, chunks=chunks)


def _with_replicated(entry: Entry) -> Entry:
    return dataclasses.replace(entry, replicated=True)


def _call_prepare(
    prepare: PrepareFunc, path: str, logical: str, tensor: torch.Tensor, *, tracing: bool
) -> torch.Tensor:
    try:
        out = prepare(logical, tensor, tracing)
    except Exception as e:
        raise SnapshotError(
            f"{path}: _custom_tensor_prepare_func raised {type(e).__name__}: {e}"
        ) from e
    if not is_dense_tensor(out):
        raise UnsupportedValueError(
            f"{path}: _custom_tensor_prepare_func must return a dense tensor, got {_type_name(out)}"
        )
    return out


def _tensor_stager(
    path: str,
    logical: str,
    tensor: torch.Tensor,
    prepare: PrepareFunc | None,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    copy: bool,
) -> Callable[[], tuple[Sequence[Buffer], object]]:
    """The stage step of a tensor's write: its bytes as a contiguous CPU buffer.

    With ``copy``, the buffer never aliases the application's memory, so the application may
    change the tensor as soon as staging returns.
    """

    def stage() -> tuple[Sequence[Buffer], object]:
        t = tensor
        if prepare is not None:
            t = _call_prepare(prepare, path, logical, t, tracing=False)
            if t.dtype != dtype or tuple(t.shape) != shape:
                raise UnsupportedValueError(
                    f"{path}: _custom_tensor_prepare_func returned {dtype_name(t.dtype)}"
                    f"{list(t.shape)} when tracing but {dtype_name(dtype)}{list(shape)} when "
                    "preparing; both calls must agree"
                )
        try:
            t = t.detach()
            if t.is_conj():
                t = t.resolve_conj()
            if t.is_neg():
                t = t.resolve_neg()
            if t.device.type != "cpu":
                # Only a machine with an accelerator runs this line.
                t = t.to("cpu")
            if not t.is_contiguous():
                t = t.contiguous()
        except RuntimeError as e:
            raise UnsupportedValueError(
                f"{path}: cannot read this {dtype_name(t.dtype)} tensor on {t.device}: {e}"
            ) from e
        view = tensor_memoryview(t)
        if copy and _shares_memory(t, tensor):
            owned = bytearray(len(view))
            owned[:] = view
            return [owned], None
        return [view], t

    return stage


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def plan_take(
    states: Iterable[tuple[str, Any]],
    *,
    rank: int,
    prepare: PrepareFunc | None,
    replicated: Sequence[str],
    inline_max_bytes: int,
    copy_tensors: bool = False,
) -> TakePlan:
    """Plans a take of ``(key_path, state_dict)`` pairs for process ``rank``.

    Manifest paths are ``"<rank>/<key_path>/..."``; ``prepare`` and the ``replicated`` globs see
    the logical path without the rank. With ``copy_tensors``, staging copies every tensor that
    would otherwise be written from the application's own memory.
    """
    planner = _TakePlanner(rank, prepare, replicated, inline_max_bytes, copy_tensors)
    for key_path, state in states:
        planner.add(key_path, state)
    return planner.plan


# ---------------------------------------------------------------------------------------------
# Restore and read_object.


def _pieces(chunks: Sequence[Location], start: int, end: int, path: str) -> tuple[Piece, ...]:
    """The blob ranges holding bytes ``[start, end)`` of a tensor stored as ``chunks``."""
    pieces = []
    chunk_start = 0
    for c in chunks:
        chunk_end = chunk_start + c.nbytes
        lo, hi = max(start, chunk_start), min(end, chunk_end)
        if lo < hi:
            pieces.append(
                Piece(
                    blob=c.blob,
                    offset=c.offset + lo - chunk_start,
                    nbytes=hi - lo,
                    dest_offset=lo - start,
                )
            )
        chunk_start = chunk_end
        if chunk_start >= end:
            break
    if sum(p.nbytes for p in pieces) != end - start:
        raise CorruptSnapshotError(f"{path}: chunks do not cover bytes {start}..{end}")
    return tuple(pieces)


@dataclass
class TensorRead:
    """Read requests for one tensor entry, and the tensor they fill."""

    requests: list[ReadRequest]
    result: Callable[[], torch.Tensor]


def check_tensor_entry(path: str, entry: TensorEntry) -> torch.dtype:
    """The entry's dtype, after checking its bytes add up to its dtype and shape."""
    dtype = dtype_from_name(entry.dtype, path)
    expected = tensor_nbytes(dtype, entry.shape)
    if entry.nbytes != expected:
        raise CorruptSnapshotError(
            f"{path}: manifest records {entry.nbytes} bytes for a {entry.dtype}{list(entry.shape)} "
            f"tensor, which needs {expected}"
        )
    return dtype


def check_target(path: str, entry: TensorEntry, target: torch.Tensor) -> None:
    """Refuses a restore target that cannot receive this entry."""
    if tuple(target.shape) != entry.shape:
        raise ShapeMismatchError(
            f"{path}: the snapshot holds shape {list(entry.shape)} ({entry.dtype}), "
            f"the object being restored has shape {list(target.shape)} ({dtype_name(target.dtype)})"
        )
    if target.device.type == "meta":
        raise UnsupportedValueError(f"{path}: cannot restore into a tensor on the meta device")


def _direct(target: torch.Tensor, dtype: torch.dtype) -> bool:
    return (
        target.device.type == "cpu"
        and target.dtype == dtype
        and target.is_contiguous()
        and not target.is_conj()
        and not target.is_neg()
    )


def plan_tensor_read(
    path: str, entry: TensorEntry, target: torch.Tensor | None, tile_bytes: int
) -> TensorRead:
    """Reads for ``entry``: into ``target`` in place when given (cast like ``copy_``), else into a
    new tensor.

    Bytes land directly in the destination's memory when it is a contiguous CPU tensor of the
    stored dtype; otherwise they go through scratch tiles of at most ``tile_bytes`` (rounded to
    whole elements, or whole rows when the target is not contiguous) copied into the target.
    """
    dtype = check_tensor_entry(path, entry)
    if target is not None:
        check_target(path, entry, target)
    if entry.nbytes == 0:
        out = target if target is not None else torch.empty(entry.shape, dtype=dtype)
        return TensorRead(requests=[], result=lambda: out)

    if target is None or _direct(target, dtype):
        holder: list[torch.Tensor] = [target] if target is not None else []
        views: list[memoryview] = []

        def into_direct() -> memoryview:
            if not views:
                if not holder:
                    holder.append(torch.empty(entry.shape, dtype=dtype))
                views.append(tensor_memoryview(holder[0]))
            return views[0]

        requests = [
            ReadRequest(pieces=(piece,), scratch_bytes=0, into=into_direct, done=None, label=path)
            for piece in _pieces(entry.chunks, 0, entry.nbytes, path)
        ]

        def result_direct() -> torch.Tensor:
            into_direct()  # allocates the tensor if no read did (cannot happen when nbytes > 0)
            return holder[0]

        return TensorRead(requests=requests, result=result_direct)

    # Through scratch tiles: a dtype cast, a device copy, or a non-contiguous target.
    # Tiles are whole elements of a contiguous target, whole rows (along dim 0) of another.
    unit = 1
    flat = target.view(-1) if target.is_contiguous() else None
    if flat is None:
        for s in entry.shape[1:]:
            unit *= s
    unit_bytes = unit * dtype.itemsize
    units_total = entry.nbytes // unit_bytes
    units_per_tile = max(1, tile_bytes // unit_bytes)
    requests = []
    for first in range(0, units_total, units_per_tile):
        last = min(units_total, first + units_per_tile)
        requests.append(_tile_request(path, entry, dtype, target, flat, unit, first, last))
    return TensorRead(requests=requests, result=lambda: target)


def _tile_request(
    path: str,
    entry: TensorEntry,
    dtype: torch.dtype,
    target: torch.Tensor,
    flat: torch.Tensor | None,
    unit: int,
    first: int,
    last: int,
) -> ReadRequest:
    count = (last - first) * unit
    nbytes = count * dtype.itemsize
    start = first * unit * dtype.itemsize
    scratch: list[torch.Tensor] = []

    def into() -> memoryview:
        scratch.append(torch.empty(count, dtype=dtype))
        return tensor_memoryview(scratch[0])

    def done() -> None:
        tile = scratch.pop()
        with torch.no_grad():
            if flat is not None:
                flat[first * unit : last * unit].copy_(tile)
            else:
                target[first:last].copy_(tile.view(last - first, *entry.shape[1:]))

    return ReadRequest(
        pieces=_pieces(entry.chunks, start, start + nbytes, path),
        scratch_bytes=nbytes,
        into=into,
        done=done,
        label=path,
    )


def plan_object_read(path: str, entry: ObjectEntry, results: dict[str, Any]) -> ReadRequest:
    """A read of an object blob; ``done`` decodes it into ``results[path]``."""
    nbytes = entry.location.nbytes
    buf: list[bytearray] = []

    def into() -> memoryview:
        buf.append(bytearray(nbytes))
        return memoryview(buf[0])

    def done() -> None:
        results[path] = decode_value(path, entry, bytes(buf.pop()))

    piece = Piece(
        blob=entry.location.blob, offset=entry.location.offset, nbytes=nbytes, dest_offset=0
    )
    return ReadRequest(pieces=(piece,), scratch_bytes=nbytes, into=into, done=done, label=path)


def decode_value(path: str, entry: ObjectEntry, data: bytes) -> Any:
    """The value an object entry's bytes encode."""
    if entry.serializer == "bytes":
        return data
    if entry.serializer == "utf8":
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise CorruptSnapshotError(f"{path}: stored text is not valid UTF-8: {e}") from e
    if entry.serializer == "torch_save":
        return decode_object(data, path)
    raise CorruptSnapshotError(
        f"{path}: unknown serializer {entry.serializer!r}; known: torch_save, bytes, utf8"
    )
