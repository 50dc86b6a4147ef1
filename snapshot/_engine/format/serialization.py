"""Bytes of tensors and objects: the dtype table, zero-copy tensor views, the object codec."""

from __future__ import annotations

import codecs
import ctypes
import io
import pickle
import re
import sys
import types
from itertools import repeat
from operator import add, sub

import torch

from snapshot.errors import CorruptSnapshotError, IncompatibleSnapshotError, UnsafeObjectError

# Every dtype this torch build knows, by the name the manifest records ("float32", "bfloat16").
DTYPES: dict[str, torch.dtype] = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)
}


_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}

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


_memory_view = ctypes.pythonapi.PyMemoryView_FromMemory
_memory_view.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_memory_view.restype = ctypes.py_object
_PYBUF_WRITE = 0x200

# The whole address space as one writable byte view, of which a view of any range is a slice:
# slicing an existing view is a cheaper call than making a new one through ctypes (takes and
# restores make one per tensor). It starts at address 1, NULL being no valid start: the view of
# ``nbytes`` at ``address`` is ``ADDRESS_SPACE[address - 1 : address - 1 + nbytes]``, which a
# loop over thousands of tensors may cut itself (``raw_memoryview`` checks its arguments
# first). Never used whole: each slice is no more valid than the memory it points at.
ADDRESS_SPACE = _memory_view(1, sys.maxsize - 1, _PYBUF_WRITE)


def raw_memoryview(address: int, nbytes: int) -> memoryview:
    """A writable byte view of ``nbytes`` of memory at ``address``; the caller keeps the memory
    alive (and valid) for as long as the view is used."""
    if nbytes == 0:
        return memoryview(bytearray())
    if address <= 0 or nbytes < 0:
        raise ValueError(f"no memory at address {address} of {nbytes} bytes")
    return ADDRESS_SPACE[address - 1 : address - 1 + nbytes]


def raw_memoryviews(addresses: list[int], sizes: list[int]) -> list[memoryview]:
    """``raw_memoryview`` of each address and size, in C-level passes where every address and
    size is positive (the members of a read: thousands of views)."""
    if not addresses or min(addresses) <= 0 or min(sizes) <= 0:
        return list(map(raw_memoryview, addresses, sizes))  # checked, or empty, one by one
    starts = list(map(sub, addresses, repeat(1)))
    return list(map(ADDRESS_SPACE.__getitem__, map(slice, starts, map(add, starts, sizes))))


def tensor_memoryview(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory, without copying.

    The view does not keep ``t`` alive: the caller must hold ``t`` as long as it uses the view.
    Works for every dtype, including those torch has no copy kernel for (int4, uint3...).
    """
    if not t.is_cpu or not t.is_contiguous():
        raise ValueError("tensor_memoryview needs a contiguous CPU tensor")
    return raw_memoryview(t.data_ptr(), t.numel() * t.element_size())


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


class _Pickler(pickle._Pickler):  # type: ignore[name-defined]
    """The pure-Python pickler, writing an empty ``bytes`` as it writes any other.

    ``torch.save`` pickles with protocol 2, which has no opcode for bytes: a non-empty one is
    written as ``_codecs.encode(text, 'latin1')``, which the safe loader allows, but an empty
    one as a call of ``bytes()`` (``GLOBAL __builtin__ bytes`` + ``REDUCE``), which it refuses.
    Allowing ``bytes`` there is no fix (a hostile pickle could call ``bytes(10**12)``), so the
    empty one is written as ``_codecs.encode('', 'latin1')`` instead. Everything else is
    written by the pure-Python pickler, which gives the same bytes as the C one.
    """

    dispatch = dict(pickle._Pickler.dispatch)  # type: ignore[attr-defined]

    def save_bytes(self, obj: bytes) -> None:
        if self.proto < 3 and not obj:
            self.save_reduce(codecs.encode, ("", "latin1"), obj=obj)
        else:
            super().save_bytes(obj)  # type: ignore[misc]

    dispatch[bytes] = save_bytes


# What ``torch.save`` takes as ``pickle_module`` (it uses only ``Pickler`` and ``__name__``).
_EMPTY_BYTES_PICKLE = types.SimpleNamespace(__name__="pickle", Pickler=_Pickler)

# The protocol 2 opcode naming ``bytes``: how the C pickler starts an empty ``bytes``.
_BYTES_GLOBAL = b"c__builtin__\nbytes\n"


def encode_object(obj: object) -> bytes:
    """Serializes a non-tensor, non-primitive value with ``torch.save``.

    A value holding an empty ``bytes`` (whose pickle then names ``bytes``, see ``_Pickler``) is
    pickled again, by ``_Pickler``. Only such a value pays for the pure-Python pickler, which is
    much slower than the C one; every other value is written by the C pickler, as before.
    """
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
    """Lets the safe loader rebuild NumPy arrays and scalars (``np.float64(0.5)`` from a
    metric, an array in a data loader's state), as training state often holds them.

    The names allowed build an array, a scalar or a dtype from raw bytes and type codes,
    nothing else: an object array's elements go through the same restricted loader. They are
    added to torch's process-wide allow-list once, the first time a pickle names NumPy
    (torch.load takes no per-call list; a scoped ``safe_globals`` block would be undone under
    another thread's decode).
    """
    global _numpy_allowed
    if _numpy_allowed:
        return
    try:
        import numpy as np
    except ImportError:
        return
    # NumPy 2 moved numpy.core to numpy._core (1.26 has a numpy._core of its own, without it).
    multiarray = np.core.multiarray if np.__version__.startswith("1.") else np._core.multiarray
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
