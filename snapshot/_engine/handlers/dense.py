"""Dense tensors (``torch.Tensor`` and ``nn.Parameter``, strided, not quantized or nested): written
from their memory, in chunks, packed into slabs when small; restored into the caller's tensor in
place, or into new tensors."""

from __future__ import annotations

import functools
import math
import sys
from typing import TYPE_CHECKING, Any

import torch

from manifest import TensorEntry, new_tensor_entry
from snapshot._engine.format.serialization import (
    DTYPES,
    dtype_name,
    encode_object,
    storage_shortfall,
)
from snapshot._engine.handlers.table import (
    Kind,
    ObjectDraft,
    Payload,
    PrepareFunc,
    ReadPlanner,
    TakeSink,
    TensorDraft,
    TensorLayout,
    TensorSource,
    WholeTensor,
    by_value_type,
    type_name,
)
from snapshot._engine.restore.reads import (
    Need,
    TensorRead,
    allocate,
    check_target,
    check_tensor_entry,
    direct_need,
    lands_directly,
    pieces,
    resolve_view,
    tile_limit,
    tile_need,
)
from snapshot.errors import (
    CorruptSnapshotError,
    SnapshotError,
    StateMismatchError,
    UnsupportedValueError,
    a_or_an,
)
from snapshot.sharding.mapping import ShardedTensor

if TYPE_CHECKING:
    from snapshot._engine.handlers.table import Planned


# A DTensor, and torch's own ShardedTensor (FSDP1's SHARDED_STATE_DICT, torchrec; its base class
# holds the shards and their metadata): (module, type).
DTENSOR = ("torch.distributed.tensor", "DTensor")
TORCH_SHARDED = ("torch.distributed._shard.sharded_tensor.api", "ShardedTensorBase")


def loaded(module: str, name: str) -> type:
    """The type ``name`` of ``module``, or our ShardedTensor while the module is not imported (no
    instance exists before: looking it up costs nothing, where importing it would make the
    first take pay for importing torch.distributed.tensor)."""
    return getattr(sys.modules.get(module), name, ShardedTensor)


def is_sharded(value: object) -> bool:
    """Whether ``value`` is stored as pieces of a global tensor."""
    return isinstance(value, (ShardedTensor, loaded(*DTENSOR), loaded(*TORCH_SHARDED)))


def is_dense_tensor(value: object) -> bool:
    """Whether ``value`` is stored as raw bytes: of a type the table gives a dense kind
    (``torch.Tensor``, ``nn.Parameter``, or one registered since), strided and not quantized
    (and not nested: its layout says strided but it has no one shape; torch.save stores it)."""
    return (
        isinstance(by_value_type.get(type(value)), Dense)
        and value.layout is torch.strided  # type: ignore[attr-defined]
        and not value.is_quantized  # type: ignore[attr-defined]
        and not value.is_nested  # type: ignore[attr-defined]
    )


# ==== take ===================================================================================
# A contiguous CPU tensor (nearly every one) is written from its own memory, through views:
# whole in one range (``WholeTensor``, packed into a slab when small), or in chunks above the
# chunk size. Any other (prepared, conjugate or negated views, non-contiguous, on a device) is
# read through a ``TensorSource`` that staging resolves or gathers. The same memory under two
# paths (tied weights) is written once.


def _in_place(sink: TakeSink, tensor: torch.Tensor) -> bool:
    """Whether the bytes written are the tensor's memory as it lies."""
    return (
        sink.prepare is None
        and tensor.is_cpu
        and tensor.is_contiguous()
        and not tensor.is_neg()
        and not (tensor.dtype.is_complex and tensor.is_conj())
    )


def take_tensor(
    sink: TakeSink, path: str, logical: str, tensor: torch.Tensor, replicated: bool
) -> Planned:
    """The draft of a dense tensor's entry (its payloads handed to ``sink``), or its entry when
    it holds no bytes."""
    prepare = sink.prepare
    in_place = _in_place(sink, tensor)
    if not in_place:
        if tensor.is_meta:
            raise UnsupportedValueError(
                f"{path}: tensor is on the meta device and holds no data to snapshot"
            )
        if storage_shortfall(tensor) is not None:  # its bytes would be read out of bounds
            raise _without_memory(path, tensor)
    if prepare is not None:
        traced = call_prepare(prepare, path, logical, tensor, tracing=True)
        if traced.is_quantized:
            return _take_quantized(sink, path, logical, tensor, traced, replicated)
        dtype, shape = traced.dtype, tuple(traced.shape)
        del traced
    else:
        dtype, shape = tensor.dtype, tuple(tensor.shape)
    name = dtype_name(dtype)
    itemsize = dtype.itemsize
    numel = math.prod(shape)
    nbytes = numel * itemsize
    if nbytes == 0:
        return new_tensor_entry(name, shape, (), replicated)
    # Tied weights: found by address (and, where another view starts there, dtype and shape);
    # a tensor not written from its memory also by device, strides and flags.
    key: Any = None
    if in_place:
        held = tensor.untyped_storage().nbytes()
        if held < tensor.storage_offset() * itemsize + nbytes:  # read out of bounds
            raise _without_memory(path, tensor)
        if held != nbytes:  # a part of its storage: maybe a view of another leaf
            sink.views_possible = True
        key = tensor.data_ptr()
        earlier = sink.written.get(key)
        if earlier is not None and (earlier.dtype != name or earlier.shape != shape):
            sink.views_possible = True
            key = (key, name, shape)
    elif prepare is None:
        key = (
            tensor.data_ptr(),
            tensor.get_device(),
            dtype,
            shape,
            tensor.stride(),
            tensor.is_conj(),
            tensor.is_neg(),
        )
        if tensor.is_cpu:
            sink.views_possible = True
    if key is not None:
        earlier = sink.written.get(key)
        if earlier is not None and earlier.replicated == replicated:
            return TensorDraft(name, shape, earlier.payloads, replicated)
    draft: TensorDraft | WholeTensor
    if in_place and nbytes <= sink.chunk_bytes:
        draft = WholeTensor(
            logical, path, tensor, tensor.data_ptr(), nbytes, name, shape, replicated
        )
        sink.emit([draft])
    else:
        per_chunk = max(1, sink.chunk_bytes // itemsize)
        bounds = [(e, min(numel, e + per_chunk)) for e in range(0, numel, per_chunk)]
        if in_place:
            address = tensor.data_ptr()
            payloads = [
                Payload(logical, i, (b - a) * itemsize, path, replicated, tensor=tensor,
                        address=address + a * itemsize)
                for i, (a, b) in enumerate(bounds)
            ]  # fmt: skip
        else:
            source = TensorSource(path, logical, tensor, prepare, dtype, shape)
            payloads = [
                Payload(logical, i, (b - a) * itemsize, path, replicated, source=source,
                        start=a, stop=b)
                for i, (a, b) in enumerate(bounds)
            ]  # fmt: skip
        sink.emit(payloads)
        draft = TensorDraft(name, shape, payloads, replicated)
    if key is not None:
        sink.written[key] = draft
    return draft


def _without_memory(path: str, tensor: torch.Tensor) -> UnsupportedValueError:
    needed, held = storage_shortfall(tensor) or (0, 0)
    return UnsupportedValueError(
        f"{path}: the {dtype_name(tensor.dtype)}{list(tensor.shape)} tensor views {needed} bytes "
        f"of a storage that holds {held}: its memory was freed or shrunk (as FSDP frees a "
        "parameter's unsharded storage); snapshot the tensors that hold the data"
    )


def _take_quantized(
    sink: TakeSink,
    path: str,
    logical: str,
    tensor: torch.Tensor,
    traced: torch.Tensor,
    replicated: bool,
) -> ObjectDraft:
    """The object entry of the quantized tensor ``prepare`` returns (when not ``tracing``): its
    ``torch.save`` bytes, scales and zero points with them, as torchsnapshot stores one; a
    restore reads it back whole (``objects.restored``)."""
    assert sink.prepare is not None
    out = call_prepare(sink.prepare, path, logical, tensor, tracing=False)
    if not out.is_quantized or out.dtype != traced.dtype or out.shape != traced.shape:
        raise UnsupportedValueError(
            f"{path}: _custom_tensor_prepare_func returned a quantized "
            f"{dtype_name(traced.dtype)}{list(traced.shape)} tensor when tracing but "
            f"{dtype_name(out.dtype)}{list(out.shape)} when preparing; both calls must agree"
        )
    data = encode_object(out.detach().cpu())
    payload = Payload(logical, 0, len(data), path, replicated, data=data)
    sink.emit([payload])
    return ObjectDraft("torch_save", type_name(out), payload, replicated)


def call_prepare(
    prepare: PrepareFunc, path: str, logical: str, tensor: torch.Tensor, *, tracing: bool
) -> torch.Tensor:
    """The tensor ``prepare`` returns for a leaf (when planning, ``tracing``; when staging,
    not), checked to be a dense tensor, or a quantized one (stored whole: ``_take_quantized``)."""
    try:
        out = prepare(logical, tensor, tracing)
    except Exception as e:
        raise SnapshotError(
            f"{path}: _custom_tensor_prepare_func raised {type(e).__name__}: {e}"
        ) from e
    if not is_dense_tensor(out) and not _is_quantized(out):
        raise UnsupportedValueError(
            f"{path}: _custom_tensor_prepare_func must return a dense or quantized tensor, got "
            f"{type_name(out)}"
        )
    return out


def _is_quantized(value: Any) -> bool:
    """Whether ``value`` is a plain quantized tensor (``torch.quantize_per_tensor``'s)."""
    return type(value) is torch.Tensor and value.is_quantized


# ==== restore ================================================================================
# Into the caller's tensor in place: a tensor in one range straight into its memory
# (``direct_address``), else through ``plan_tensor_read``. With no tensor to fill, into new
# tensors that share storage as ``torch.load``'s do: entries recording the same bytes (tied
# weights, written once) get one tensor, a view entry becomes a view of its base's new tensor,
# and a Parameter or a tensor requiring grad is one object per kind over it.


class _Fresh:
    """A loader's new tensors (``ReadPlanner.kind_state``): by the bytes they hold; what was
    made of them (a view, a Parameter), each with its tensor (kept alive: its id is part of the
    key); and the view entries waiting for every other read to be planned."""

    def __init__(self) -> None:
        self.tensors: dict[tuple[Any, ...], torch.Tensor] = {}
        self.made: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self.views: list[tuple[str, TensorEntry]] = []


def _fresh(reader: ReadPlanner) -> _Fresh:
    state = reader.kind_state.get(Dense.name)
    if state is None:
        state = reader.kind_state[Dense.name] = _Fresh()
    return state  # type: ignore[no-any-return]


def plan_tensor_read(
    reader: ReadPlanner, path: str, entry: TensorEntry, target: torch.Tensor | None
) -> TensorRead:
    """Needs for ``entry``: into ``target`` in place when given (cast like ``copy_``), else into
    a new tensor. Bytes land in the destination's memory when it is a contiguous CPU tensor of
    the stored dtype, in pieces of at most the reader's ``piece_bytes``; else through scratch
    tiles of at most its ``tile_bytes`` that its ``landing`` copies in (``tile_need``). Each
    chunk is checked against its recorded CRC-32 as it lands when the reader ``verify``s."""
    dtype = check_tensor_entry(path, entry)
    if target is None:
        target = allocate(path, entry.nbytes, lambda: torch.empty(entry.shape, dtype=dtype))
    else:
        check_target(path, entry, target, dtype)
    itemsize = dtype.itemsize
    direct = lands_directly(target, dtype)
    if not direct:
        reader.landing.prepare(target)
    needs: list[Need] = []
    step = reader.piece_bytes if direct else tile_limit(target, reader.tile_bytes)
    step = max(itemsize, step - step % itemsize)
    address = target.data_ptr() if direct else 0
    base = 0
    for chunk in entry.chunks:
        for lo, n, check in pieces(path, chunk, step, reader.verify):
            if direct:
                need = direct_need(path, chunk, lo, n, address + base + lo)
            else:
                first = (base + lo) // itemsize
                need = tile_need(path, chunk, lo, n, first, dtype, target, reader.landing)
            need.verify = check
            needs.append(need)
        base += chunk.nbytes
    return TensorRead(needs=needs, result=target)


QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}


def direct_address(entry: TensorEntry, target: Any, piece_bytes: int, verify: bool) -> int | None:
    """Where the bytes of the most common read land (most tensors of a state), or None when
    ``plan_tensor_read`` must plan it: a tensor stored in one range of at most ``piece_bytes``
    (with a CRC-32 when reads ``verify``), into ``target`` (of a dense kind's value type) when
    it is a dense, contiguous CPU tensor of the stored dtype and shape whose storage holds the
    bytes. Anything else (an error included) is left to the general path, which words it."""
    chunks = entry.chunks
    if len(chunks) != 1:
        return None
    chunk = chunks[0]
    nbytes = chunk.nbytes
    dtype = DTYPES.get(entry.dtype)
    if (
        dtype is None
        or dtype in QUANTIZED  # (so a target of the stored dtype is not quantized)
        or not 0 < nbytes <= piece_bytes
        or (verify and chunk.crc32 is None)
        or target.dtype is not dtype
        or target.layout is not _STRIDED  # (before ``shape``: a nested tensor has none)
        or target.is_nested
        or target.shape != entry.shape
        or target.nbytes != nbytes  # (the manifest's length, checked against the shape)
        or not target.is_cpu
        or not target.is_contiguous()
        or (dtype.is_complex and target.is_conj())  # (only a complex tensor is conjugated)
        or target.is_neg()
        # A storage that ends before the bytes: the general path refuses it.
        or target.untyped_storage().nbytes() < target.storage_offset() * dtype.itemsize + nbytes
    ):
        return None
    return target.data_ptr()  # type: ignore[no-any-return]


_STRIDED = torch.strided


def plan_views(reader: ReadPlanner) -> None:
    """Plans each view entry read into no target, once every other read is planned: a view of
    its base's new tensor when the base is read into one too (one storage, as ``torch.load``
    gives), else a tensor of the view's own bytes. Every view is checked (``resolve_view``)."""
    fresh = _fresh(reader)
    views, fresh.views = fresh.views, []
    for path, entry in views:
        _, base = resolve_view(reader.entries, path, entry)
        key = _stored_key(base)
        raw = fresh.tensors.get(key) if key is not None else None
        if raw is None:
            value = _new_tensor(reader, path, entry)
        else:
            view = entry.view
            assert view is not None
            made_key = (id(raw), entry.shape, view.offset, view.stride)
            made = fresh.made.get(made_key)
            if made is None:
                out = raw.as_strided(entry.shape, view.stride, raw.storage_offset() + view.offset)
                made = fresh.made[made_key] = (raw, out)
            value = made[1]
        if entry.parameter or entry.requires_grad:
            value = _loaded(reader, path, entry, value)
        reader.tensors[path] = value


def _new_tensor(reader: ReadPlanner, path: str, entry: TensorEntry) -> torch.Tensor:
    """The new tensor that receives ``entry``'s bytes: the one planned already for an entry
    recording the same bytes (tied weights, written once), else one planned now."""
    fresh = _fresh(reader)
    key = _stored_key(entry)
    tensor = fresh.tensors.get(key) if key is not None else None
    if tensor is None:
        read = plan_tensor_read(reader, path, entry, None)
        reader.add_needs(read.needs, into_target=False)
        tensor = read.result
        if key is not None:
            fresh.tensors[key] = tensor
    return tensor


def _stored_key(entry: TensorEntry) -> tuple[Any, ...] | None:
    """What identifies the bytes an entry records (None for an empty tensor)."""
    return (entry.dtype, entry.shape, entry.chunks) if entry.chunks else None


def _loaded(
    reader: ReadPlanner, path: str, entry: TensorEntry, tensor: torch.Tensor
) -> torch.Tensor:
    """What ``torch.load`` gives for ``entry``, recorded as an ``nn.Parameter`` or as requiring
    grad, over ``tensor``'s storage: one object per kind, so tied entries of one kind are one."""
    parameter, requires_grad = entry.parameter, entry.requires_grad
    if requires_grad and not (tensor.is_floating_point() or tensor.is_complex()):
        raise CorruptSnapshotError(
            f"{path}: the manifest says this {entry.dtype} tensor requires grad, which only "
            "floating point and complex tensors can"
        )
    made = _fresh(reader).made
    key = (id(tensor), parameter, requires_grad)
    found = made.get(key)
    if found is None:
        out: torch.Tensor
        if parameter:
            out = torch.nn.Parameter(tensor, requires_grad=requires_grad)
        else:
            out = tensor.detach().requires_grad_()
        found = made[key] = (tensor, out)
    return found[1]


class TensorKind(Kind):
    """A kind storing tensors: filled in place when the target is a dense tensor or a piece of a
    sharded one, else read into new memory."""

    def check_target(self, label: str, entry: Any, target: Any) -> None:
        """Refuses a target that cannot receive the stored tensor (the rest of what a target
        must be, the reads check: shape, dtype, memory)."""
        if not self.allocates(entry, target):
            return
        what = type(target).__name__
        if isinstance(target, torch.Tensor):
            layout = "nested" if target.is_nested else str(target.layout).removeprefix("torch.")
            what += f" ({layout}{' quantized' if target.is_quantized else ''})"
        raise StateMismatchError(
            f"{label}: the snapshot holds a {entry.dtype}{list(entry.shape)} tensor, which "
            f"obj_out, {a_or_an(what)}, cannot receive in place; pass a dense tensor of that "
            "shape, or no obj_out"
        )

    def allocates(self, entry: Any, target: Any) -> bool:
        return not (is_dense_tensor(target) or is_sharded(target))


class Dense(TensorKind):
    """The dense kind. Another tensor type is stored as dense by registering one more instance
    for it: ``register(Dense(value_types=(cls,), entry_types=()))``."""

    name = "dense"

    def __init__(
        self,
        value_types: tuple[type, ...] = (torch.Tensor, torch.nn.Parameter),
        entry_types: tuple[type[TensorEntry], ...] = (TensorEntry,),
    ) -> None:
        self.value_types = value_types
        self.entry_types = entry_types

    def accepts(self, value: Any) -> bool:
        return is_dense_tensor(value)

    def take(
        self, sink: TakeSink, path: str, logical: str, value: torch.Tensor, replicated: bool
    ) -> Planned:
        reuse = sink.reuse
        planned: Planned | None = None
        if reuse is not None and _in_place(sink, value) and value.nbytes > 0:
            planned = reuse.reused(path, value)  # the base holds these bytes: nothing to write
        if planned is None:
            planned = take_tensor(sink, path, logical, value, replicated)
        # Whether it is an ``nn.Parameter`` or requires grad (``Collected.grads``); not for a
        # prepared tensor: what is written is the function's.
        if sink.prepare is None and (type(value) is not torch.Tensor or value.requires_grad):
            sink.out.grads[path] = (type(value) is not torch.Tensor, value.requires_grad)
        return planned

    def restore_all(self, reader: ReadPlanner, leaves: list[tuple[str, Any, Any]]) -> None:
        """Into each target that is a dense tensor (its needs write the live state): the reads
        straight into its memory (``direct_address``) planned in one batch; else into a new
        tensor (a view entry's waits until every other read is planned)."""
        piece_bytes, verify, tensors = reader.piece_bytes, reader.verify, reader.tensors
        direct = []
        last_type, dense_type = None, False  # the kind is looked up once per run of a type
        for path, entry, target in leaves:
            if type(target) is not last_type:
                last_type = type(target)
                dense_type = isinstance(by_value_type.get(last_type), Dense)
            address = direct_address(entry, target, piece_bytes, verify) if dense_type else None
            if address is not None:
                direct.append((path, entry.chunks[0], address))
            elif is_dense_tensor(target):
                read = plan_tensor_read(reader, path, entry, target)
                reader.add_needs(read.needs, into_target=True)
                if target.is_cpu:  # checked for memory shared with other targets
                    reader.indirect.append((path, target))
            else:
                self._restore_new(reader, path, entry, target)
                continue
            tensors[path] = target
        if direct:
            reader.add_direct(direct)

    def restore(self, reader: ReadPlanner, path: str, entry: TensorEntry, target: Any) -> None:
        self.restore_all(reader, [(path, entry, target)])

    def _restore_new(self, reader: ReadPlanner, path: str, entry: TensorEntry, target: Any) -> None:
        reader.claim()  # a new tensor, of the size the manifest records
        if is_sharded(target):
            raise StateMismatchError(
                f"{path}: the snapshot holds a whole tensor here, the object being restored "
                "is a piece of a sharded one; restore it into a plain tensor, or take the "
                "snapshot from sharded state"
            )
        if entry.view is not None:
            fresh = _fresh(reader)
            if not fresh.views:
                reader.later(functools.partial(plan_views, reader))
            fresh.views.append((path, entry))
            return
        tensor = _new_tensor(reader, path, entry)
        if entry.parameter or entry.requires_grad:
            tensor = _loaded(reader, path, entry, tensor)
        reader.tensors[path] = tensor

    def tensor_layout(self, path: str, entry: TensorEntry) -> TensorLayout:
        dtype = check_tensor_entry(path, entry)
        return TensorLayout(
            dtype, entry.shape, [((0,) * len(entry.shape), entry.shape, entry.chunks)]
        )


DENSE = Dense()
