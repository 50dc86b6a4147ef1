"""Dense tensors (``torch.Tensor`` and ``nn.Parameter``, strided, not quantized or nested): written
from their memory, in chunks, packed into slabs when small; restored into the caller's tensor in
place, or into new tensors."""

from __future__ import annotations

import torch

from snapshot._engine.handlers.table import Handler, handler_of_type

_STRIDED = torch.strided
NAME = "dense"


def is_dense_tensor(value: object) -> bool:
    """Whether ``value`` is stored as raw bytes: of a type the table gives this kind
    (``torch.Tensor``, ``nn.Parameter``, or one registered since), strided and not quantized
    (and not nested: its layout says strided but it has no one shape; torch.save stores it)."""
    handler = handler_of_type(type(value))
    return (
        handler is not None
        and handler.name == NAME
        and value.layout is _STRIDED  # type: ignore[union-attr]
        and not value.is_quantized  # type: ignore[union-attr]
        and not value.is_nested  # type: ignore[union-attr]
    )


# ==== take ===================================================================================
# A tensor whose bytes are its memory as it lies (a contiguous CPU tensor: nearly every one) is
# written from that memory, through views: whole in one range (``WholeTensor``), or in chunks
# above the chunk size. Any other (prepared, conjugate or negated views, non-contiguous, on a
# device) is read through a ``TensorSource`` that staging resolves or gathers. The same memory
# under two paths (tied weights) is written once.

import math  # noqa: E402
import typing  # noqa: E402
from collections.abc import Sequence  # noqa: E402

from manifest import new_tensor_entry  # noqa: E402
from snapshot._engine.format.serialization import dtype_name, storage_shortfall  # noqa: E402
from snapshot._engine.take.plan import (  # noqa: E402
    Payload,
    PrepareFunc,
    TensorDraft,
    TensorSource,
    WholeTensor,
    payloads_of,
    type_name,
)
from snapshot.errors import SnapshotError, UnsupportedValueError  # noqa: E402

if typing.TYPE_CHECKING:
    from snapshot._engine.take.plan import Collector, Planned

_TENSOR = torch.Tensor


def take(
    planner: Collector, path: str, logical: str, value: torch.Tensor, replicated: bool
) -> Planned:
    """A dense tensor leaf's draft (``take_tensor``), and what it records beyond its bytes."""
    draft = take_tensor(planner, path, logical, value, replicated)
    if type(value) is not _TENSOR or value.requires_grad:
        record_grads(planner, path, value)
    return draft


def record_grads(planner: Collector, path: str, tensor: torch.Tensor) -> None:
    """Records that a tensor leaf is an ``nn.Parameter`` or requires grad
    (``Collected.grads``). Not for a tensor given to a prepare function: what is written is
    the function's tensor, of its own dtype."""
    if planner.prepare is None:
        planner.out.grads[path] = (type(tensor) is not _TENSOR, tensor.requires_grad)


def take_tensor(
    planner: Collector, path: str, logical: str, tensor: torch.Tensor, replicated: bool
) -> Planned:
    """The draft of a dense tensor's entry (its payloads handed to the planner), or its entry
    when it holds no bytes."""
    if (
        planner.prepare is None
        and tensor.is_cpu
        and tensor.is_contiguous()
        and not tensor.is_neg()
        # Only a complex tensor can carry the conjugate bit.
        and not ((dtype := tensor.dtype).is_complex and tensor.is_conj())
    ):
        # The common case, kept lean (a take of 20,000 small tensors runs this 20,000
        # times): the tensor's own memory is written, through views.
        shape = tuple(tensor.shape)
        nbytes = tensor.nbytes
        name = dtype_name(dtype)
        if nbytes == 0:
            return new_tensor_entry(name, shape, (), replicated)
        # Its bytes are read through its address: a storage that ends before them (freed,
        # as FSDP frees unsharded parameters) would be read out of bounds.
        # (``serialization.storage_shortfall`` for a contiguous tensor, inline.)
        held = tensor.untyped_storage().nbytes()
        if held < tensor.storage_offset() * dtype.itemsize + nbytes:
            raise _without_memory(path, tensor)
        if held != nbytes:  # a part of its storage, which another leaf may hold too
            planner.views_possible = True
        # The same memory under two paths (tied weights) is written once. It is found by
        # its address (a tuple key cost more to make and hash than checking a hit), and
        # another dtype or shape at an address known already by those too.
        address = tensor.data_ptr()
        key: int | tuple[typing.Any, ...] = address
        written = planner.written
        earlier = written.get(address)
        if earlier is not None and (earlier.dtype != name or earlier.shape != shape):
            planner.views_possible = True  # another view of the same memory (``relate``)
            key = (address, name, shape)
            earlier = written.get(key)
        if earlier is not None and earlier.replicated == replicated:
            return TensorDraft(name, shape, payloads_of(earlier), replicated)
        if nbytes <= planner.chunk_bytes:
            whole = WholeTensor(logical, path, tensor, address, nbytes, name, shape, replicated)
            written[key] = whole
            planner.emit([whole])
            return whole
        itemsize = dtype.itemsize
        payloads = [
            Payload(
                logical,
                i,
                (stop - start) * itemsize,
                path,
                replicated,
                tensor=tensor,
                address=address + start * itemsize,
            )
            for i, (start, stop) in enumerate(_bounds(planner, nbytes // itemsize, itemsize))
        ]
        planner.emit(payloads)
        draft = TensorDraft(name, shape, payloads, replicated)
        written[key] = draft
        return draft
    return _tensor_source(planner, path, logical, tensor, replicated)


def _bounds(planner: Collector, numel: int, itemsize: int) -> Sequence[tuple[int, int]]:
    """The element ranges of a tensor's chunks."""
    per_chunk = max(1, planner.chunk_bytes // itemsize)
    if numel <= per_chunk:
        return ((0, numel),)
    return [(e, min(numel, e + per_chunk)) for e in range(0, numel, per_chunk)]


def _tensor_source(
    planner: Collector, path: str, logical: str, tensor: torch.Tensor, replicated: bool
) -> Planned:
    """A tensor whose bytes are not simply its memory: prepared, conjugate or negated
    views, non-contiguous, on a device (or on the meta device: refused)."""
    if tensor.is_meta:
        raise UnsupportedValueError(
            f"{path}: tensor is on the meta device and holds no data to snapshot"
        )
    if storage_shortfall(tensor) is not None:
        raise _without_memory(path, tensor)
    prepare = planner.prepare
    if prepare is not None:
        traced = call_prepare(prepare, path, logical, tensor, tracing=True)
        dtype, shape = traced.dtype, tuple(traced.shape)
        del traced
    else:
        dtype, shape = tensor.dtype, tuple(tensor.shape)
    name = dtype_name(dtype)
    itemsize = dtype.itemsize
    numel = math.prod(shape)
    if numel == 0:
        return new_tensor_entry(name, shape, (), replicated)
    # Tied weights again; a conjugate or negated view of the same memory holds other
    # values, so those flags are part of the key.
    key = None
    if prepare is None:
        key = (
            tensor.data_ptr(),
            tensor.get_device(),
            dtype,
            shape,
            tensor.stride(),
            tensor.is_conj(),
            tensor.is_neg(),
        )
        earlier = planner.written.get(key)
        if earlier is not None and earlier.replicated == replicated:
            return TensorDraft(name, shape, payloads_of(earlier), replicated)
        if key[1] < 0:  # on the CPU: perhaps a view of another leaf (``relate``)
            planner.views_possible = True
    source = TensorSource(path, logical, tensor, prepare, dtype, shape)
    payloads = [
        Payload(
            logical,
            i,
            (stop - start) * itemsize,
            path,
            replicated,
            source=source,
            start=start,
            stop=stop,
        )
        for i, (start, stop) in enumerate(_bounds(planner, numel, itemsize))
    ]
    planner.emit(payloads)
    draft = TensorDraft(name, shape, payloads, replicated)
    if key is not None:
        planner.written[key] = draft
    return draft


def _without_memory(path: str, tensor: torch.Tensor) -> UnsupportedValueError:
    """The error for a tensor whose storage does not hold the elements it views (its bytes
    would be read out of bounds)."""
    needed, held = storage_shortfall(tensor) or (0, 0)
    return UnsupportedValueError(
        f"{path}: the {dtype_name(tensor.dtype)}{list(tensor.shape)} tensor views {needed} bytes "
        f"of a storage that holds {held}: its memory was freed or shrunk (as FSDP frees a "
        "parameter's unsharded storage); snapshot the tensors that hold the data"
    )


def call_prepare(
    prepare: PrepareFunc, path: str, logical: str, tensor: torch.Tensor, *, tracing: bool
) -> torch.Tensor:
    """The tensor ``prepare`` returns for a leaf (when planning, ``tracing``; when staging,
    not), checked to be a dense tensor."""
    try:
        out = prepare(logical, tensor, tracing)
    except Exception as e:
        raise SnapshotError(
            f"{path}: _custom_tensor_prepare_func raised {type(e).__name__}: {e}"
        ) from e
    if not is_dense_tensor(out):
        raise UnsupportedValueError(
            f"{path}: _custom_tensor_prepare_func must return a dense tensor, got {type_name(out)}"
        )
    return out


# ==== restore ================================================================================
# Into the caller's tensor in place: most leaves in one read straight into its memory
# (``direct_address``, which the loader also runs inline for every tensor entry), else through
# ``plan_tensor_read``. With no tensor to fill, into new tensors that share storage as
# ``torch.load``'s do: entries recording the same bytes (tied weights, written once) get one
# tensor, a view entry becomes a view of its base's new tensor, and a Parameter or a tensor
# requiring grad is one object per kind over it.

import functools  # noqa: E402
from typing import TYPE_CHECKING, Any  # noqa: E402

from manifest import TensorEntry  # noqa: E402
from snapshot._engine.format.serialization import DTYPES  # noqa: E402
from snapshot._engine.handlers import sharded  # noqa: E402
from snapshot._engine.restore.reads import (  # noqa: E402  # noqa: E402
    Landing,
    Need,
    TensorRead,
    allocate,
    check_target,
    check_tensor_entry,
    direct_need,
    lands_directly,
    location_check,
    piece_verify,
    resolve_view,
    tile_limit,
    tile_need,
)
from snapshot.errors import CorruptSnapshotError, StateMismatchError  # noqa: E402

if TYPE_CHECKING:
    from snapshot._engine.restore.loader import Loader


def restore(loader: Loader, path: str, entry: TensorEntry, target: Any) -> None:
    """Plans the reads of ``entry``: into ``target`` when it is a dense tensor (its needs
    write the live state of the loader's ``owner``), else into a new tensor (a view entry's
    waits until every other read is planned: ``plan_views``). A piece of a sharded tensor
    cannot receive a whole one."""
    if is_dense_tensor(target):
        address = direct_address(path, entry, target, loader.piece_bytes, loader.verify)
        if address is None:
            read = plan_tensor_read(
                path,
                entry,
                target,
                loader.tile_bytes,
                loader.piece_bytes,
                verify=loader.verify,
                landing=loader.landing,
            )
            loader.add_needs(read.needs, into_target=True)
            if target.is_cpu:  # device memory is another address space: not compared
                loader.indirect.append((path, target))
        else:
            loader.add_direct(path, entry.chunks[0], address)
        loader.tensors[path] = target
        return
    loader.claim()  # a new tensor, of the size the manifest records
    if sharded.is_sharded(target):
        raise StateMismatchError(
            f"{path}: the snapshot holds a whole tensor here, the object being restored "
            "is a piece of a sharded one; restore it into a plain tensor, or take the "
            "snapshot from sharded state"
        )
    if entry.view is not None:
        if not loader.views:
            loader.later(functools.partial(plan_views, loader))
        loader.views.append((path, entry))
        return
    tensor = _new_tensor(loader, path, entry)
    if entry.parameter or entry.requires_grad:
        tensor = _loaded(loader, path, entry, tensor)
    loader.tensors[path] = tensor


def plan_tensor_read(
    path: str,
    entry: TensorEntry,
    target: torch.Tensor | None,
    tile_bytes: int,
    piece_bytes: int,
    verify: bool = True,
    landing: Landing | None = None,
) -> TensorRead:
    """Needs for ``entry``: into ``target`` in place when given (cast like ``copy_``), else into
    a new tensor.

    Bytes land directly in the destination's memory when it is a contiguous CPU tensor of the
    stored dtype, in pieces of at most ``piece_bytes`` (so one large tensor is read by several
    workers); otherwise they go through scratch tiles of at most ``tile_bytes`` (whole elements,
    never across chunks) copied into the target by ``landing``, whatever its layout or device
    (``tile_need``; without a ``landing``, device copies are waited for one by one). With
    ``verify``, each chunk's bytes are checked against its recorded CRC-32 as they land.

    Callers try ``direct_address`` first: it plans the most common read in fewer steps (the
    read this plans for it as one need, kept as a row of columns).
    """
    dtype = check_tensor_entry(path, entry)
    if target is None:
        target = allocate(path, entry.nbytes, lambda: torch.empty(entry.shape, dtype=dtype))
    else:
        check_target(path, entry, target, dtype)
    itemsize = dtype.itemsize
    direct = lands_directly(target, dtype)
    if landing is None:
        landing = Landing()
    if not direct:
        landing.prepare(target)
    needs: list[Need] = []
    step = piece_bytes if direct else tile_limit(target, tile_bytes)
    step = max(itemsize, step - step % itemsize)
    address = target.data_ptr() if direct else 0
    base = 0
    for chunk in entry.chunks:
        check = location_check(path, chunk, -(-chunk.nbytes // step), verify)
        for lo in range(0, chunk.nbytes, step):
            n = min(step, chunk.nbytes - lo)
            if direct:
                need = direct_need(path, chunk, lo, n, address + base + lo)
            else:
                need = tile_need(
                    path, chunk, lo, n, (base + lo) // itemsize, dtype, target, landing
                )
            if check is not None:
                need.verify = piece_verify(check, lo, n)
            needs.append(need)
        base += chunk.nbytes
    return TensorRead(needs=needs, result=target)


def direct_address(
    path: str, entry: TensorEntry, target: Any, piece_bytes: int, verify: bool
) -> int | None:
    """Where the bytes of the most common read land (most tensors of a state), or None when
    ``plan_tensor_read`` must plan it: a tensor stored in one range of at most ``piece_bytes``,
    with a recorded CRC-32 when reads ``verify``, into a contiguous CPU tensor of the stored
    dtype and shape, whose memory the bytes land in. The loader keeps such reads as columns
    (``direct_reads.DirectReads``), not as needs.

    The checks are ``plan_tensor_read``'s for that case, in fewer steps: a target of the stored
    dtype and shape holding exactly the stored number of bytes is one the bytes fit, and
    anything else (an error included) is left to the general path.
    """
    chunks = entry.chunks
    if len(chunks) != 1 or (kind := handler_of_type(type(target))) is None or kind.name != NAME:
        return None
    chunk = chunks[0]
    nbytes = chunk.nbytes
    dtype = DTYPES.get(entry.dtype)
    if (
        dtype is None
        or not 0 < nbytes <= piece_bytes
        or (verify and chunk.crc32 is None)
        or target.dtype is not dtype
        # Before ``nbytes``, which a sparse tensor raises on: the general path words it.
        or target.layout is not _STRIDED
        or target.nbytes != nbytes
        or target.is_nested
        or target.shape != entry.shape
        or not target.is_cpu
        or target.is_quantized
        or not target.is_contiguous()
        or target.is_neg()
        or (dtype.is_complex and target.is_conj())
        # A storage that ends before the bytes would be written out of bounds: the general
        # path refuses it (``check_receivable``).
        or target.untyped_storage().nbytes() < target.storage_offset() * dtype.itemsize + nbytes
    ):
        return None
    return target.data_ptr()


def plan_views(loader: Loader) -> None:
    """Plans each view entry read into no target, once every other read is planned: a view
    of its base's new tensor when the base is read into one too (one storage, as
    ``torch.load`` gives), else a tensor of the view's own bytes (a view read alone reads
    no more than itself). Every view is checked (``resolve_view``) either way."""
    views, loader.views = loader.views, []
    for path, entry in views:
        _, base = resolve_view(loader.entries, path, entry)
        key = _stored_key(base)
        raw = loader.fresh.get(key) if key is not None else None
        if raw is None:
            value = _new_tensor(loader, path, entry)
        else:
            value = _as_view(loader, raw, entry)
        if entry.parameter or entry.requires_grad:
            value = _loaded(loader, path, entry, value)
        loader.tensors[path] = value


def _new_tensor(loader: Loader, path: str, entry: TensorEntry) -> torch.Tensor:
    """The new tensor that receives ``entry``'s bytes: the one planned already for an entry
    recording the same bytes (tied weights, written once), else one planned now."""
    key = _stored_key(entry)
    tensor = loader.fresh.get(key) if key is not None else None
    if tensor is None:
        read = plan_tensor_read(
            path,
            entry,
            None,
            loader.tile_bytes,
            loader.piece_bytes,
            verify=loader.verify,
            landing=loader.landing,
        )
        loader.add_needs(read.needs, into_target=False)
        tensor = read.result
        if key is not None:
            loader.fresh[key] = tensor
    return tensor


def _stored_key(entry: TensorEntry) -> tuple[Any, ...] | None:
    """What identifies the bytes an entry records, for sharing one new tensor among the
    entries that record the same ones (None for an empty tensor: no bytes to share)."""
    chunks = entry.chunks
    if len(chunks) == 1:  # most tensors: the fields of the one range, not its record's hash
        c = chunks[0]
        return (entry.dtype, entry.shape, c.blob, c.offset, c.nbytes, c.crc32)
    return (entry.dtype, entry.shape, chunks) if chunks else None


def _as_view(loader: Loader, raw: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    """``entry``'s view of ``raw``, its base's new tensor; one object for equal views."""
    view = entry.view
    assert view is not None
    key = (id(raw), entry.shape, view.offset, view.stride)
    made = loader.made.get(key)
    if made is None:
        out = raw.as_strided(entry.shape, view.stride, raw.storage_offset() + view.offset)
        made = loader.made[key] = (raw, out)
    return made[1]


def _loaded(loader: Loader, path: str, entry: TensorEntry, tensor: torch.Tensor) -> torch.Tensor:
    """What ``torch.load`` gives for ``entry``, recorded as an ``nn.Parameter`` or as
    requiring grad, holding ``tensor``'s values: a new object sharing its storage, one per
    kind, so that tied entries of one kind are one object."""
    parameter, requires_grad = entry.parameter, entry.requires_grad
    if requires_grad and not (tensor.is_floating_point() or tensor.is_complex()):
        raise CorruptSnapshotError(
            f"{path}: the manifest says this {entry.dtype} tensor requires grad, which only "
            "floating point and complex tensors can"
        )
    key = (id(tensor), parameter, requires_grad)
    made = loader.made.get(key)
    if made is None:
        if parameter:
            out = torch.nn.Parameter(tensor, requires_grad=requires_grad)
        else:
            out = tensor.detach().requires_grad_()
        made = loader.made[key] = (tensor, out)
    return made[1]


# ==== registration ===========================================================================
# Found by exact type, then confirmed by ``is_dense_tensor`` (a nested tensor is a plain
# ``torch.Tensor`` too). Another tensor type is made dense by registering a handler of this
# name for it (``register(dataclasses.replace(HANDLER, value_types=(cls,), entry_types=()))``).
HANDLER = Handler(
    name=NAME,
    take=take,
    restore=restore,
    value_types=(torch.Tensor, torch.nn.Parameter),
    accepts=is_dense_tensor,
    entry_types=(TensorEntry,),
)
