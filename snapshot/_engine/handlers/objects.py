"""Values that are not tensors: primitives (bool, int, float, None, and short str / bytes) kept in
the manifest itself, longer str / bytes given a payload of their own; and any other value,
pickled with torch.save (and checked to be restorable at take). torchsnapshot's pickled tensors
are read here too."""

from __future__ import annotations

import functools
import io
import math
import zipfile
from typing import TYPE_CHECKING, Any, BinaryIO

import torch

from manifest import (
    ObjectEntry,
    PickledTensorEntry,
    PrimitiveEntry,
    Shard,
    ShardedObjectEntry,
    int_fits,
    new_tensor_entry,
)
from snapshot._engine.format.serialization import (
    decode_object,
    dtype_from_name,
    dtype_name,
    encode_object,
)
from snapshot._engine.handlers import geometry
from snapshot._engine.handlers.dense import DENSE, QUANTIZED, is_dense_tensor, is_sharded
from snapshot._engine.handlers.table import (
    Kind,
    ObjectDraft,
    ReadPlanner,
    TakeSink,
    bytes_need,
    type_name,
)
from snapshot._engine.restore.reads import (
    allocate,
    check_target,
)
from snapshot._engine.state_dicts import int_refusal
from snapshot._engine.take.restorable import check_object
from snapshot.errors import (
    CorruptSnapshotError,
    StateMismatchError,
    UnsafeSnapshotError,
    UnsupportedValueError,
    a_or_an,
)

if TYPE_CHECKING:
    from snapshot._engine.handlers.table import Planned

# What a pickled tensor's piece must decode to: a plain tensor (not a subclass).
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def decode_value(path: str, entry: ObjectEntry | ShardedObjectEntry, data: bytes) -> Any:
    """The value an object entry's bytes encode."""
    if entry.serializer == "bytes":
        return data
    if entry.serializer == "utf8":
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise CorruptSnapshotError(f"{path}: stored text is not valid UTF-8: {e}") from e
    if entry.serializer == "torch_save":
        check_archive(data, path)
        return decode_object(data, path)
    raise CorruptSnapshotError(
        f"{path}: unknown serializer {entry.serializer!r}; known: torch_save, bytes, utf8"
    )


def restored(path: str, entry: ObjectEntry, target: Any, data: bytes) -> Any:
    """The value an object entry's bytes encode, restored for ``target`` as torchsnapshot
    restores a quantized tensor (a ``_custom_tensor_prepare_func``'s): into a quantized target
    of its shape in place (requantized to the target's scheme and dtype where they differ),
    never into a dense one, whose values it does not hold in that dtype."""
    value = decode_value(path, entry, data)
    if not (isinstance(value, torch.Tensor) and value.is_quantized) or target is None:
        return value
    if is_dense_tensor(target):
        raise quantized_refusal(path, dtype_name(value.dtype), value.shape, target)
    if isinstance(target, torch.Tensor) and target.is_quantized and target.shape == value.shape:
        if value.qscheme() != target.qscheme() or value.dtype != target.dtype:
            value = value.dequantize()
        target.copy_(value)  # (its own quantizer takes the scales: not through a detached alias)
        return target
    return value


def quantized_refusal(
    path: str, dtype: str, shape: Any, target: torch.Tensor
) -> StateMismatchError:
    """The error of a quantized tensor stored at ``path`` restored into a dense ``target``."""
    return StateMismatchError(
        f"{path}: the snapshot holds a quantized {dtype}{list(shape)} tensor, which the "
        f"{dtype_name(target.dtype)} tensor being restored cannot receive (torchsnapshot refuses "
        f"it too); read it with read_object({path!r}) and call dequantize(), or restore into "
        "a quantized tensor of its shape, or a state that holds no tensor there"
    )


# The first bytes of a zip archive's member (torch.save's format since torch 1.6).
_ZIP_MAGIC = b"PK\x03\x04"


def check_archive(data: bytes | BinaryIO, path: str) -> None:
    """Checks, before ``torch.load`` sees them, that the ``torch.save`` bytes of the entry at
    ``path`` (``data``, or a seekable file of them) cannot expand past their own length: each
    member of the zip archive is stored (torch's reader would inflate a deflated one) and
    declares no more bytes than it occupies. The legacy (pre-zip) format is refused: its loader
    allocates what its pickle claims before reading.

    Raises:
        UnsafeSnapshotError: a member is compressed.
        CorruptSnapshotError: the bytes are not a zip archive (the legacy format included), or
            a member declares more bytes than it holds or than the archive holds.
    """
    file = io.BytesIO(data) if isinstance(data, bytes) else data
    file.seek(0)
    if file.read(len(_ZIP_MAGIC)) != _ZIP_MAGIC:
        raise CorruptSnapshotError(
            f"{path}: object bytes cannot be decoded: they are not a torch.save zip archive "
            "(torch.save's legacy format is not read either: its loader allocates what its "
            "pickle claims before reading)"
        )
    size = file.seek(0, io.SEEK_END)
    try:
        with zipfile.ZipFile(file) as archive:
            members = archive.infolist()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
        raise CorruptSnapshotError(f"{path}: the stored torch.save archive is damaged: {e}") from e
    declared = 0
    for info in members:
        if info.compress_type != zipfile.ZIP_STORED:
            raise UnsafeSnapshotError(
                f"{path}: member {info.filename!r} of the stored torch.save archive is "
                f"compressed (method {info.compress_type}); torch.save stores its members "
                "uncompressed, and a compressed one could expand far past the bytes stored"
            )
        declared += info.file_size
        if info.file_size != info.compress_size or declared > size:
            raise CorruptSnapshotError(
                f"{path}: member {info.filename!r} of the stored torch.save archive declares "
                f"{info.file_size:,} bytes, but holds {info.compress_size:,} (the archive is "
                f"{size:,} bytes)"
            )


def restore_pickled_tensor(
    reader: ReadPlanner, path: str, entry: PickledTensorEntry, target: Any
) -> None:
    """Plans the needs of a tensor stored as ``torch.save`` bytes, one per piece; once all are
    decoded (by the safe loader, each a plain tensor of the recorded dtype and its piece's
    size), ``reader.objects[path]`` is ``target`` filled in place (cast like ``copy_``) when it
    is a dense tensor, else a new one (the decoded tensor itself when one piece holds it all).
    """
    if is_sharded(target):
        raise StateMismatchError(
            f"{path}: the snapshot holds a whole tensor here (pickled), the object being "
            "restored is a piece of a sharded one; restore it into a plain tensor"
        )
    reader.claim()  # buffers of the stored length
    dtype = dtype_from_name(entry.dtype, path)
    shape, pieces, landing = tuple(entry.shape), entry.pieces, reader.landing
    _check_pieces(path, entry, dtype)
    into_target = is_dense_tensor(target)
    dest: torch.Tensor | None = None  # the tensor the pieces are copied into
    if into_target and dtype in QUANTIZED:  # (before any read)
        raise quantized_refusal(path, entry.dtype, shape, target)
    if into_target:
        check_target(path, new_tensor_entry(entry.dtype, shape, ()), target, dtype)
        landing.prepare(target)
        dest = target
    elif len(pieces) != 1 or tuple(pieces[0].sizes) != shape:
        nbytes = math.prod(shape) * dtype.itemsize
        dest = allocate(path, nbytes, lambda: torch.empty(shape, dtype=dtype))
    remaining = [len(pieces)]
    decoded: dict[str, Any] = {}  # each piece's value, once copied (``bytes_need``'s results)

    def place(piece: Shard, data: bytes) -> None:
        check_archive(data, path)
        value = decode_object(data, path)
        box = tuple(piece.sizes)
        if (
            not isinstance(value, torch.Tensor)
            or type(value) not in _PLAIN_TENSORS
            or value.dtype != dtype
            or tuple(value.shape) != box
        ):
            what = (
                f"a {dtype_name(value.dtype)}{list(value.shape)} tensor"
                if isinstance(value, torch.Tensor)
                else a_or_an(type_name(value))
            )
            raise CorruptSnapshotError(
                f"{path}: the pickle of the piece at {list(piece.offsets)} holds {what}; the "
                f"manifest records a {entry.dtype}{list(box)} tensor"
            )
        if dest is None:  # one piece, the whole tensor, no target: the decoded one is it
            reader.objects[path] = value.detach()
            return
        window = dest[tuple(slice(o, o + n) for o, n in zip(piece.offsets, box, strict=True))]
        try:
            landing.copy(window, value)
        except RuntimeError as e:
            raise StateMismatchError(
                f"{path}: cannot copy the stored {entry.dtype} values into the "
                f"{dtype_name(window.dtype)} tensor being restored: {e}"
            ) from e
        remaining[0] -= 1
        if remaining[0] == 0:
            reader.objects[path] = dest

    needs = [
        bytes_need(path, p.chunks[0], decoded, functools.partial(place, p), reader.verify)
        for p in pieces
    ]
    reader.add_needs(needs, into_target=into_target)


def _check_pieces(path: str, entry: PickledTensorEntry, dtype: torch.dtype) -> None:
    """The pieces of a pickled tensor are one location each, of at least the bytes of their
    values (uncompressed in the archive: ``check_archive``), and cover it exactly once."""
    shape = tuple(entry.shape)
    for piece in entry.pieces:
        need = math.prod(piece.sizes) * dtype.itemsize
        if len(piece.chunks) != 1 or need > piece.chunks[0].nbytes:
            raise CorruptSnapshotError(
                f"{path}: the piece at {list(piece.offsets)} claims {need:,} bytes of values "
                f"in {len(piece.chunks)} locations; one pickle holding them is stored per piece"
            )
    problem = geometry.cover_problem(shape, [(p.offsets, p.sizes) for p in entry.pieces])
    if problem is not None or not entry.pieces:
        raise CorruptSnapshotError(
            f"{path}: the pieces of this {entry.dtype}{list(shape)} tensor do not cover it "
            f"exactly once{f': {problem}' if problem else ''}"
        )


class Objects(Kind):
    """The catch-all, asked last: pickled with torch.save, and refused at take when a restore
    would refuse it (``check_object``). Restored by the safe loader; a pickled tensor
    (torchsnapshot's) into a dense target, or a new tensor."""

    name = "objects"
    entry_types = (ObjectEntry, PickledTensorEntry)

    def accepts(self, value: Any) -> bool:
        return True

    def take(
        self, sink: TakeSink, path: str, logical: str, value: Any, replicated: bool
    ) -> ObjectDraft:
        try:
            data = encode_object(value)
        except Exception as e:
            raise UnsupportedValueError(
                f"{path}: cannot serialize {a_or_an(type_name(value))}: {type(e).__name__}: {e}"
            ) from e
        obj_type = type_name(value)
        check_object(path, obj_type, data, tensor_subclass=isinstance(value, torch.Tensor))
        return self.write_bytes(
            sink, path, logical, data, replicated, serializer="torch_save", obj_type=obj_type
        )

    def restore(
        self, reader: ReadPlanner, path: str, entry: ObjectEntry | PickledTensorEntry, target: Any
    ) -> None:
        if isinstance(entry, PickledTensorEntry):
            restore_pickled_tensor(reader, path, entry, target)
        else:
            decode = functools.partial(restored, path, entry, target)
            self.read_bytes(reader, path, entry.location, decode)

    def archived(self, entry: Any) -> bool:
        return isinstance(entry, PickledTensorEntry) or super().archived(entry)

    def check_target(self, label: str, entry: Any, target: Any) -> None:
        if isinstance(entry, PickledTensorEntry):  # an object is never filled in place
            DENSE.check_target(label, entry, target)


OBJECTS = Objects()


class Primitive(Kind):
    """bool, int, float and None, and a str or bytes of at most ``inline_max`` bytes (a str
    encoded), are the manifest's own; a longer str or bytes is a payload of its own, and a str
    that UTF-8 cannot encode is pickled. An int of more digits than every reader converts
    (``manifest.int_fits``) is refused. By exact type only: a subclass (an IntEnum, a str enum)
    is pickled, as the object it is."""

    name = "primitive"
    value_types = (bool, int, float, type(None), str, bytes)
    entry_types = (PrimitiveEntry,)

    def accepts(self, value: Any) -> bool:
        return type(value) in self.value_types

    def take(
        self, sink: TakeSink, path: str, logical: str, value: Any, replicated: bool
    ) -> Planned:
        kind = type(value)
        if kind is int and not int_fits(value):
            raise UnsupportedValueError(int_refusal(path))  # ``check_nesting`` refuses most
        if kind is not str and kind is not bytes:
            return PrimitiveEntry(value=value, replicated=replicated)
        try:
            data = value.encode("utf-8") if kind is str else value
        except UnicodeEncodeError:  # lone surrogates: only pickle keeps them
            return OBJECTS.take(sink, path, logical, value, replicated)
        if len(data) <= sink.inline_max:
            return PrimitiveEntry(value=value, replicated=replicated)
        serializer = "utf8" if kind is str else "bytes"
        return self.write_bytes(
            sink, path, logical, data, replicated, serializer=serializer, obj_type=kind.__name__
        )

    def restore(self, reader: ReadPlanner, path: str, entry: PrimitiveEntry, target: Any) -> None:
        """The value recorded in the manifest, whatever the target (never filled in place)."""
        reader.objects[path] = entry.value


PRIMITIVE = Primitive()
