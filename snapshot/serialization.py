"""Bytes of tensors and objects: the dtype table, zero-copy tensor views, the object codec."""

from __future__ import annotations

import ctypes
import io
import pickle
import re

import torch

from snapshot.errors import CorruptSnapshotError, IncompatibleSnapshotError, UnsafeObjectError

# Every dtype this torch build knows, by the name the manifest records ("float32", "bfloat16").
_DTYPES: dict[str, torch.dtype] = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)
}


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest's name of ``dtype``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str, where: str) -> torch.dtype:
    """The dtype a manifest names; a clear error when this torch build lacks it."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise IncompatibleSnapshotError(
            f"{where}: dtype {name!r} is unknown to torch {torch.__version__}; "
            "restore with the torch version that took the snapshot, or a newer one"
        ) from None


def tensor_nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """Bytes of a dense tensor of this dtype and shape."""
    n = dtype.itemsize
    for s in shape:
        n *= s
    return n


def tensor_memoryview(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory, without copying.

    The view does not keep ``t`` alive: the caller must hold ``t`` as long as it uses the view.
    Works for every dtype, including those torch has no copy kernel for (int4, uint3...).
    """
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("tensor_memoryview needs a contiguous CPU tensor")
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_ubyte * nbytes).from_address(t.data_ptr())).cast("B")


def encode_object(obj: object) -> bytes:
    """Serializes a non-tensor, non-primitive value with ``torch.save``."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def decode_object(data: bytes, where: str) -> object:
    """Deserializes what :func:`encode_object` wrote, with torch's ``weights_only`` loader.

    That loader only rebuilds tensors, primitives, containers and the types allowed by
    ``torch.serialization.add_safe_globals``; it never calls anything the bytes name otherwise.
    """
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
