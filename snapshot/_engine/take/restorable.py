"""Take-time refusal of values a restore would refuse: a take never commits a snapshot that
cannot be restored.

An object (not a tensor, primitive or plain container) is stored as ``torch.save`` bytes and
restored by ``torch.load(weights_only=True)``. Take decodes each object's bytes once with that
loader and refuses the value (``UnsupportedValueError``, naming its path and what to do) when
the decode fails. A torch ``ShardedTensor``, ``DTensor`` or ``DeviceMesh`` inside a value
stored whole is refused before the decode: its pickle needs the take's process group.
"""

from __future__ import annotations

import io
import pickletools
import re
import sys
import zipfile

import torch

from snapshot._engine.format.serialization import decode_object
from snapshot.errors import SnapshotError, UnsafeObjectError, UnsupportedValueError

# Modules whose classes hold process-group state: once none of them is imported, no value can
# hold such an instance, and the scan below is skipped.
_GROUP_MODULES = {
    "torch.distributed.tensor": ("DTensor",),
    "torch.distributed.device_mesh": ("DeviceMesh",),
    "torch.distributed._shard.sharded_tensor.api": ("ShardedTensor", "ShardedTensorBase"),
}


def check_object(path: str, what: str, data: bytes, *, tensor_subclass: bool = False) -> None:
    """Refuses ``data`` (the ``torch.save`` bytes of a ``what`` at ``path``; a tensor subclass
    when ``tensor_subclass``) when a restore would refuse it.

    Raises:
        UnsupportedValueError: naming ``path``, the types at fault and what to do.
    """
    group_types = _group_types_in(data)
    if group_types:
        raise UnsupportedValueError(
            f"{path}: this {what} is stored whole (pickled) and holds "
            f"{', '.join(group_types)}, whose pickle needs the process group of this job: a "
            "restore could not rebuild it. Put sharded tensors at a leaf of the state dict "
            "(in dicts with str/int keys, lists and tuples), where they are stored as pieces "
            "of a global tensor and restored into any sharding, or convert them first (e.g. "
            "DTensor.full_tensor())"
        )
    try:
        decode_object(data, path)
    except UnsafeObjectError as e:
        names = _unsafe_globals(data)
        if not names:
            # Every type it names is allowed, yet the loader refuses how the pickle builds it
            # (a defaultdict is rebuilt by SETITEM, which the loader allows on dicts only).
            raise UnsupportedValueError(
                f"{path}: a restore would refuse this {what}: torch.load(weights_only=True) "
                f"cannot rebuild it ({_loader_reason(e)}); store it as tensors, primitives and "
                "plain containers instead (e.g. a dict in place of a defaultdict)"
            ) from e
        listed = ", ".join(names)
        instead = (
            # Only plain tensors (torch.Tensor, nn.Parameter) are stored as raw bytes.
            "store it as a plain tensor (t.as_subclass(torch.Tensor)), which is stored as raw bytes"
            if tensor_subclass
            else "store the value as tensors, primitives and plain containers (e.g. its "
            "state_dict())"
        )
        raise UnsupportedValueError(
            f"{path}: a restore would refuse this {what}: its pickle needs {listed}, which "
            "torch.load(weights_only=True) does not allow by default. If you trust them, call "
            f"torch.serialization.add_safe_globals([{listed}]) before take and restore (in "
            f"every process); or {instead}"
        ) from e
    except SnapshotError as e:
        raise UnsupportedValueError(
            f"{path}: this {what} was pickled, but its bytes do not load again, so a restore "
            f"would fail: {e}"
        ) from e


def _loader_reason(e: BaseException) -> str:
    """The weights-only unpickler's own words, from the error it raised."""
    text = str(e.__cause__ or e)
    found = re.search(r"WeightsUnpickler error:\s*([^\n]+)", text)
    return found.group(1).strip() if found else text.splitlines()[0]


def _group_types_in(data: bytes) -> list[str]:
    """The process-group types the pickle names: the GLOBAL opcodes (``torch.save`` pickles
    with protocol 2) of ``data.pkl`` in its zip archive."""
    wanted = set()
    for module, names in _GROUP_MODULES.items():
        loaded = sys.modules.get(module)
        for name in names:
            kind = getattr(loaded, name, None)
            if isinstance(kind, type):
                wanted.add(f"{kind.__module__}.{kind.__qualname__}")
    # A pickle naming none of these modules (most) costs one search in C, not a scan:
    # torch.save stores its records uncompressed, so the names are in ``data`` as written.
    if not wanted or b"torch.distributed" not in data:
        return []
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            records = [n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            pickled = archive.read(records[0]) if records else b""
    except zipfile.BadZipFile:
        return []
    ops = pickletools.genops(pickled)
    found = {str(arg).replace(" ", ".") for op, arg, _ in ops if op.name == "GLOBAL"}
    return sorted(found & wanted)


def _unsafe_globals(data: bytes) -> list[str]:
    """What the safe loader would refuse in ``data``, named as ``add_safe_globals`` takes it."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data))
    except Exception:  # a name we cannot list is still refused by the decode
        return []
    return sorted(n.removeprefix("builtins.").removeprefix("__builtin__.") for n in names)
