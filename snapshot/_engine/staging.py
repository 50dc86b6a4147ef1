"""Staging for async take: a reusable pool of host buffers, and state dicts that lend out their
tensors and stage them on CPU."""

from __future__ import annotations

import abc
import ctypes
import functools
import logging
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from snapshot import knobs
from snapshot._engine import device
from snapshot._engine.flatten import join
from snapshot._engine.scheduler import BudgetShare, ByteBudget
from snapshot._engine.serialization import tensor_memoryview
from snapshot.errors import (
    HollowStateError,
    ShapeMismatchError,
    StateMismatchError,
    UnsupportedValueError,
)

logger = logging.getLogger(__name__)

# =================================================================================================
# Tensor-aware state dicts
#
# A state dict whose tensors can be lent out (pop_tensors), given back (insert_tensors), recreated
# empty (init_tensors) and staged on CPU (copy_tensors_to_cpu / restore_tensor_device). Nothing
# else in this module depends on this section, nor it on anything else here.
# =================================================================================================

_Leaf = TypeVar("_Leaf")


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorPlaceholder:
    """What a hollow state holds in place of a popped tensor: enough to recreate it empty.

    Attributes:
        shape: The tensor's shape.
        dtype: The tensor's dtype.
        device: The device the tensor belongs on: its original device if it was staged on CPU.
    """

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device

    def empty(self) -> torch.Tensor:
        """A new uninitialised tensor of this shape and dtype, on this device."""
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)


class TensorAwareStateDict(abc.ABC):
    """A state dict that can lend out its tensors and take them back.

    Call sequence. To write a state while training goes on, the owner calls
    ``copy_tensors_to_cpu`` (training may then keep mutating the device tensors), waits for the
    copies if they were asynchronous (on every device that held a tensor: see
    ``copy_tensors_to_cpu``), then ``pop_tensors`` and hands the tensors to the writer;
    the hollow remainder holds only placeholders and plain values, and is cheap to serialize.
    ``insert_tensors`` gives the tensors back. To restore, the reader takes a hollow state, calls
    ``init_tensors`` (or ``insert_tensors`` with tensors it read, on any device), fills the
    tensors, then ``restore_tensor_device`` moves each to the device it belongs on.

    The state is *hollow* from ``pop_tensors`` until ``insert_tensors`` or ``init_tensors``.
    ``pop_tensors``, ``tensors``, ``copy_tensors_to_cpu`` and ``restore_tensor_device`` need it
    full; ``insert_tensors`` and ``init_tensors`` need it hollow; out of turn they raise
    ``HollowStateError``.
    """

    @property
    @abc.abstractmethod
    def state_dict(self) -> Any:
        """The wrapped state, live (not a copy); placeholders stand for tensors while hollow."""

    @property
    @abc.abstractmethod
    def is_hollow(self) -> bool:
        """True iff the tensors were popped and have not been inserted back yet."""

    @property
    @abc.abstractmethod
    def tensors(self) -> list[torch.Tensor]:
        """The tensors the state holds, in ``pop_tensors`` order, without removing them.

        Raises:
            HollowStateError: The state is hollow (an empty list would hide that).
        """

    @abc.abstractmethod
    def pop_tensors(self) -> list[torch.Tensor]:
        """Takes the tensors out, leaving placeholders that keep their shape, dtype and device.

        Returns:
            The tensors, in a deterministic order that ``insert_tensors`` expects back.

        Raises:
            HollowStateError: The state is already hollow.
        """

    @abc.abstractmethod
    def insert_tensors(self, tensors: Iterable[torch.Tensor]) -> None:
        """Puts tensors back in place of the placeholders: the reverse of ``pop_tensors``.

        Args:
            tensors: One tensor per placeholder, in ``pop_tensors`` order, each of the
                placeholder's shape and dtype; the device may differ (see
                ``restore_tensor_device``).

        Raises:
            HollowStateError: The state is not hollow.
            StateMismatchError: Wrong number of tensors, or one does not fit its placeholder.
        """

    @abc.abstractmethod
    def init_tensors(self) -> None:
        """Inserts new uninitialised tensors of the placeholders' shape, dtype and device.

        Raises:
            HollowStateError: The state is not hollow.
        """

    @abc.abstractmethod
    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        """Replaces the tensors by CPU copies, remembering each one's device; the originals are
        left as they are.

        Args:
            non_blocking: Copy device tensors asynchronously; the copies may then be read only
                after the caller has waited for them on every device that held a tensor
                (``torch.cuda.synchronize(device)`` for each; ``torch.cuda.synchronize()``
                alone covers only the current device).

        Raises:
            HollowStateError: The state is hollow.
        """

    @abc.abstractmethod
    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        """Moves every tensor that is not on the device it belongs on back there.

        Args:
            non_blocking: Copy to devices asynchronously (ordered before later work on the
                current stream, so the tensors can be used at once).

        Raises:
            HollowStateError: The state is hollow.
        """


class BasicTensorAwareStateDict(TensorAwareStateDict):
    """A ``TensorAwareStateDict`` over a plain state dict, updated in place.

    Tensors are found inside dicts (incl. subclasses such as ``OrderedDict``), lists and tuples
    (incl. named tuples), nested in any way, in depth-first order: dict insertion order, then
    list and tuple index order. Anything else is a plain value, left alone even if it holds
    tensors. Dicts and lists are updated in place; a tuple holding a tensor is replaced by a new
    tuple of the same type. A container reached by two paths is walked once, at the first; one
    tensor held in two places (tied weights) is listed once per place, and stays tied when
    staged.

    Tensors may be on any device. ``init_tensors`` creates plain tensors: neither
    ``nn.Parameter`` nor ``requires_grad``. The structure must not be changed between calls
    except through these methods, since placeholders and devices are matched by position.

    Args:
        state_dict: The state to wrap; it is modified in place from now on.

    Raises:
        TypeError: ``state_dict`` is not a dict.
    """

    def __init__(self, state_dict: dict[Any, Any]) -> None:
        if not isinstance(state_dict, dict):
            raise TypeError(
                f"BasicTensorAwareStateDict wraps a dict, got {type(state_dict).__name__}; "
                "wrap the value in a dict"
            )
        self._state_dict = state_dict
        self._hollow = False
        # The device each tensor belongs on, in traversal order, once a tensor may be elsewhere
        # (staged on CPU, or inserted from another device); None while every tensor is at home.
        self._homes: list[torch.device] | None = None

    @property
    def state_dict(self) -> dict[Any, Any]:
        """The wrapped dict, live (not a copy); ``TensorPlaceholder``s stand for tensors while
        hollow."""
        return self._state_dict

    @property
    def is_hollow(self) -> bool:
        """True iff the tensors were popped and have not been inserted back yet."""
        return self._hollow

    @property
    def tensors(self) -> list[torch.Tensor]:
        """The tensors the state holds, in ``pop_tensors`` order, without removing them.

        Raises:
            HollowStateError: The state is hollow (an empty list would hide that).
        """
        self._require_full("tensors")
        return [tensor for _, tensor in self._find(torch.Tensor)]

    def pop_tensors(self) -> list[torch.Tensor]:
        """Takes the tensors out, leaving placeholders that keep their shape, dtype and device
        (the device a staged tensor belongs on, not CPU).

        Returns:
            The tensors, in traversal order: the order ``insert_tensors`` expects them back.

        Raises:
            HollowStateError: The state is already hollow.
        """
        if self._hollow:
            raise HollowStateError(
                "pop_tensors: the state is already hollow (its tensors were popped and not "
                "inserted back); call insert_tensors or init_tensors first"
            )
        popped: list[torch.Tensor] = []
        homes = self._homes

        def hollow_out(_: str, leaf: Any) -> Any:
            if not isinstance(leaf, torch.Tensor):
                return leaf
            home = homes[len(popped)] if homes is not None else leaf.device
            popped.append(leaf)
            return TensorPlaceholder(shape=leaf.shape, dtype=leaf.dtype, device=home)

        self._visit(hollow_out)
        self._hollow, self._homes = True, None  # the placeholders now say where tensors belong
        return popped

    def insert_tensors(self, tensors: Iterable[torch.Tensor]) -> None:
        """Puts tensors back in place of the placeholders: ``insert_tensors(pop_tensors())``
        leaves the state as it was, with the same tensor objects in the same places.

        Every tensor is checked before any is inserted, so on error the state stays hollow and
        unchanged.

        Args:
            tensors: One tensor per placeholder, in ``pop_tensors`` order, each of the
                placeholder's shape and dtype. A tensor may be on another device than its
                placeholder; ``restore_tensor_device`` then moves it there.

        Raises:
            HollowStateError: The state is not hollow.
            StateMismatchError: Wrong number of tensors, or a value that is not a tensor or has
                the wrong dtype; ``ShapeMismatchError`` for the wrong shape. The message names
                the path of the first misfit.
        """
        if not self._hollow:
            raise HollowStateError(
                "insert_tensors: the state is not hollow (it still holds its tensors); "
                "call pop_tensors first"
            )
        given = list(tensors)
        slots = self._placeholders()
        if len(given) != len(slots):
            raise StateMismatchError(
                f"insert_tensors got {len(given)} tensors for {len(slots)} placeholders; pass "
                "exactly the tensors pop_tensors returned, in the same order"
            )
        for (path, placeholder), tensor in zip(slots, given, strict=True):
            _check_fits(path, placeholder, tensor)
        fill = iter(given)
        self._visit(lambda _, leaf: next(fill) if isinstance(leaf, TensorPlaceholder) else leaf)
        homes = [placeholder.device for _, placeholder in slots]
        at_home = all(t.device == home for t, home in zip(given, homes, strict=True))
        self._hollow, self._homes = False, None if at_home else homes

    def init_tensors(self) -> None:
        """Inserts new uninitialised tensors of the placeholders' shape, dtype and device.

        Raises:
            HollowStateError: The state is not hollow.
        """
        if not self._hollow:
            raise HollowStateError(
                "init_tensors: the state is not hollow (it still holds its tensors); "
                "call pop_tensors first"
            )
        self.insert_tensors([placeholder.empty() for _, placeholder in self._placeholders()])

    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        """Replaces the tensors by new CPU copies, remembering each one's device; the originals
        are not modified (CPU tensors are copied too, so the copies are always independent).

        Args:
            non_blocking: Copy CUDA tensors asynchronously into pinned memory. Each copy is
                queued on the current stream of its tensor's device (the calling thread's), so
                the copies may be read only after the caller has waited for each device that
                held a tensor: ``torch.cuda.current_stream(device).synchronize()`` or
                ``torch.cuda.synchronize(device)`` for every such device
                (``torch.cuda.synchronize()`` alone waits for the current device only). If
                pinning fails the copies are made into pageable memory, synchronously.

        Raises:
            HollowStateError: The state is hollow.
            UnsupportedValueError: A tensor cannot be copied (not dense, or on the meta device
                so it has no data); the state is then left as it was.
        """
        self._require_full("copy_tensors_to_cpu")
        found = self._find(torch.Tensor)
        # Every copy is made before any is installed, so a failed copy leaves the state as it
        # was. A tensor reached by two paths (tied weights) is copied once and stays tied.
        copies: dict[int, torch.Tensor] = {}
        for path, tensor in found:
            if id(tensor) not in copies:
                copies[id(tensor)] = _cpu_copy(path, tensor, non_blocking)
        old_homes = self._homes
        self._visit(lambda _, leaf: copies[id(leaf)] if isinstance(leaf, torch.Tensor) else leaf)
        self._homes = old_homes or [tensor.device for _, tensor in found]

    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        """Moves every tensor that is not on the device it belongs on back there; a tensor that
        is already there stays the same object.

        Args:
            non_blocking: Copy to devices asynchronously (ordered before later work on the
                current stream, so the tensors can be used at once).

        Raises:
            HollowStateError: The state is hollow.
        """
        self._require_full("restore_tensor_device")
        if self._homes is None:
            return
        homes = iter(self._homes)
        moved: dict[int, torch.Tensor] = {}  # keeps tied tensors tied

        def move(_: str, leaf: Any) -> Any:
            if not isinstance(leaf, torch.Tensor):
                return leaf
            home = next(homes, leaf.device)
            if leaf.device == home:
                return leaf
            if id(leaf) not in moved:
                # GPU only: from pinned memory this host-to-device copy is asynchronous yet
                # ordered on the current stream, and torch's host allocator keeps the pinned
                # block until the copy ends. Only a CUDA run proves this line.
                with torch.no_grad():
                    moved[id(leaf)] = leaf.to(home, non_blocking=non_blocking)
            return moved[id(leaf)]

        self._visit(move)
        self._homes = None

    def _require_full(self, operation: str) -> None:
        if self._hollow:
            raise HollowStateError(
                f"{operation}: the state is hollow (its tensors were popped and not inserted "
                "back); call insert_tensors or init_tensors first"
            )

    def _placeholders(self) -> list[tuple[str, TensorPlaceholder]]:
        return self._find(TensorPlaceholder)

    def _find(self, kind: type[_Leaf]) -> list[tuple[str, _Leaf]]:
        """(path, leaf) of every leaf of type ``kind``, in traversal order."""
        found: list[tuple[str, _Leaf]] = []
        self._visit(
            lambda path, leaf: found.append((path, leaf)) if isinstance(leaf, kind) else None
        )
        return found

    def _visit(self, fn: Callable[[str, Any], Any]) -> None:
        """Calls ``fn(path, leaf)`` on every leaf in traversal order and puts what it returns in
        the leaf's place; a ``None`` result keeps the leaf (for visits that only read)."""
        self._state_dict = _map_leaves(self._state_dict, "", fn, {})


def _map_leaves(
    obj: Any, path: str, fn: Callable[[str, Any], Any], memo: dict[int, tuple[Any, Any]]
) -> Any:
    """``obj`` with every leaf replaced by ``fn(path, leaf)`` (kept if that is None).

    ``memo`` maps a visited container's id to (container, result): the container is kept so its
    id cannot be reused by a new object during the walk, and a shared container is walked once.
    """
    if not isinstance(obj, (dict, list, tuple)):
        new = fn(path, obj)
        return obj if new is None else new
    if id(obj) in memo:
        return memo[id(obj)][1]
    if isinstance(obj, tuple):
        items = [_map_leaves(v, join(path, i), fn, memo) for i, v in enumerate(obj)]
        if all(new is old for new, old in zip(items, obj, strict=True)):
            result: Any = obj
        elif hasattr(type(obj), "_fields"):  # a named tuple takes its fields as arguments
            result = type(obj)(*items)
        else:
            result = type(obj)(items)
        memo[id(obj)] = (obj, result)
        return result
    # Registered before descending, so a cycle through a dict or list ends here.
    memo[id(obj)] = (obj, obj)
    keys = list(obj) if isinstance(obj, dict) else range(len(obj))
    for key in keys:
        old = obj[key]
        new = _map_leaves(old, join(path, key), fn, memo)
        if new is not old:
            obj[key] = new
    return obj


def _check_fits(path: str, placeholder: TensorPlaceholder, tensor: Any) -> None:
    hint = "pass the tensors pop_tensors returned, in the same order"
    if not isinstance(tensor, torch.Tensor):
        raise StateMismatchError(
            f"{path}: insert_tensors got a {type(tensor).__name__} where a tensor was popped; "
            + hint
        )
    if tensor.shape != placeholder.shape:
        raise ShapeMismatchError(
            f"{path}: insert_tensors got a tensor of shape {tuple(tensor.shape)} where the "
            f"popped tensor had shape {tuple(placeholder.shape)}; {hint}"
        )
    if tensor.dtype != placeholder.dtype:
        raise StateMismatchError(
            f"{path}: insert_tensors got a {tensor.dtype} tensor where the popped tensor was "
            f"{placeholder.dtype}; {hint}"
        )


_pin_warned = False


def _cpu_copy(path: str, tensor: torch.Tensor, non_blocking: bool) -> torch.Tensor:
    global _pin_warned
    index = device.cuda_index(tensor)
    copy = None
    if non_blocking and index is not None:
        # A device-to-host copy is asynchronous only into page-locked memory, so the
        # destination is pinned when the copy may be asynchronous; if pinning fails, the copy
        # goes to pageable memory, synchronously. Only a GPU run proves these lines for real.
        try:
            copy = device.pinned_empty(tuple(tensor.shape), tensor.dtype)
        except RuntimeError as e:
            if not _pin_warned:
                _pin_warned = True
                logger.warning(
                    "copy_tensors_to_cpu: cannot pin host memory (%s); copying into pageable "
                    "memory, synchronously",
                    e,
                )
            non_blocking = False
    if copy is None:
        copy = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
    try:
        # no_grad: a copy of a tensor that requires grad would otherwise join its graph.
        with torch.no_grad():
            if index is None:
                copy.copy_(tensor)
            else:  # queued on the current stream of the tensor's device
                device.copy(copy, tensor, non_blocking)
    except (RuntimeError, NotImplementedError) as e:
        raise UnsupportedValueError(
            f"{path}: cannot copy this {tensor.layout} tensor on {tensor.device} to CPU ({e}); "
            "only dense tensors that hold data (not on the meta device) can be staged"
        ) from e
    return copy


# =================================================================================================
# The staging-buffer pool
#
# Host buffers that async take copies tensors into, reused from one snapshot to the next.
# =================================================================================================


class Lease:
    """A pooled staging buffer lent to one write: ``tensor`` is a 1-d uint8 CPU tensor of the
    requested size (``pinned`` says whether its memory is page-locked), ``view`` the same memory
    as a memoryview.

    Copies from a device into it are issued on the staging stream of that device
    (``stream``); ``ready`` waits for every stream this lease used, and only then may its bytes
    be read (checksummed, written). ``release`` gives the buffer back to the pool once the write
    is done with it, after waiting for copies still in flight (a stage that failed midway).
    """

    __slots__ = ("_block", "_keep", "_pool", "_streams", "fresh", "pinned", "tensor", "view")

    def __init__(
        self, pool: StagingPool, block: torch.Tensor, nbytes: int, fresh: bool, pinned: bool
    ) -> None:
        self._pool: StagingPool | None = pool
        self._block = block
        self.fresh = fresh  # newly allocated: its pages are not yet touched
        self.pinned = pinned
        self.tensor = block[:nbytes]
        self.view = tensor_memoryview(self.tensor)
        # Device index -> the staging stream this lease's copies from that device were issued
        # on, until ``ready`` has waited for them; None while there are none (host state).
        self._streams: dict[int, device.Stream] | None = None
        # Tensors the copies in flight read (a prepared or resolved tensor may have no other
        # owner), held until ``ready``.
        self._keep: list[torch.Tensor] | None = None

    def touch(self) -> None:
        """Faults a fresh buffer's pages in with torch's multi-threaded fill, before it is
        filled by many small single-threaded copies (which would each take their page faults
        one core at a time: about 1.5x slower in all on 2 cores). Pinned memory is resident
        already."""
        if self.fresh and not self.pinned:
            self.tensor.zero_()
        self.fresh = False

    def stream(self, index: int, reads: torch.Tensor) -> device.Stream:
        """The stream to issue this lease's copies from device ``index`` on: the pool's staging
        stream for that device, which the first time this lease asks is made to wait for the
        work queued so far on the device's current stream (the kernels that computed the
        tensors being copied; each device has its own current stream, so each device's
        staging stream waits on its own). ``reads`` (the tensor the copy reads) is kept alive
        until ``ready``.

        Only a machine with a GPU runs this for real: that the wait covers the kernels queued
        before the call, and no later ones, is CUDA's stream semantics (tested on CPU with
        ``tests/cuda_double.py``; benchmarks/gpu_check.py checks it on a GPU).
        """
        assert self._pool is not None, "a released lease"
        streams = self._streams
        if streams is None:
            streams = self._streams = {}
            self._keep = []
        stream = streams.get(index)
        if stream is None:
            stream = self._pool.stream(index)
            device.wait_stream(stream, device.current_stream(index))
            streams[index] = stream
        self._keep.append(reads)  # type: ignore[union-attr]
        return stream

    def ready(self) -> None:
        """Makes the copies into the buffer complete before anyone reads it: waits for every
        staging stream this lease issued copies on (one per device it copied from). Nothing to
        do for copies from host memory, which are synchronous."""
        streams = self._streams
        if streams is not None:
            self._streams = None
            # Only a machine with a GPU runs this line for real: one synchronization per
            # device per staged write.
            for stream in streams.values():
                device.synchronize(stream)
            self._keep = None

    def release(self) -> None:
        """Gives the buffer back; the lease then holds no memory, even if it is kept around.

        Copies issued and not yet waited for (a stage that failed between issuing them and
        ``ready``) are waited for first: the block must not be lent again while a copy may
        still land in it. If that wait fails (a device error), the block is never lent again.
        """
        pool, self._pool = self._pool, None
        if pool is None:
            return
        try:
            self.ready()
        except BaseException:
            logger.warning(
                "staging: waiting for the copies into a staging buffer failed; the buffer is "
                "set aside, never reused",
                exc_info=True,
            )
            pool._set_aside(self._block, self._keep)
        else:
            pool._give_back(self._block, self.pinned)
        self._block = self.tensor = self.view = None  # type: ignore[assignment]
        self._keep = None


class StagingPool:
    """Host buffers for async take, kept and reused across snapshots, within one staging budget
    for the process.

    Blocks come in size classes, at least 64 KiB, so a buffer freed by one write fits the next
    write of a similar size: powers of two and 1.5 times them in pageable memory; powers of two
    only when pinned, since torch's host allocator rounds every pinned allocation up to a power
    of two (a class of 1.5 times a power would cost the next power anyway, uncounted). The pool
    keeps at most ``keep_bytes`` of free blocks; ``trim`` drops the rest and hands pinned memory
    dropped since the last trim back to the system (torch keeps freed pinned blocks locked in
    its host cache until that cache is emptied).

    A block is pinned only for a write that copies from a device (``from_device=True``), so
    a state without device tensors never pins memory nor touches CUDA, and one with them gets
    asynchronous device-to-host copies. When pinning fails (locked memory exhausted, say), the
    pool warns once and stages in pageable memory from then on (the copies are then
    synchronous). Each device gets one staging stream, made when its first tensor is staged.

    ``budget`` is the process's staging budget: every async take's write pipeline charges it
    through a ``share``, so snapshots pending at once stage at most one budget together (a
    second one waits for the first one's writes to give blocks back).

    Why a pool: fresh memory costs far more than copying into memory already touched (on the
    machine the benchmarks ran on, a copy into new memory ran at 2-3 GB/s, page faults included,
    and into reused memory at 7-10 GB/s), and an async take's stall is mostly that copy.
    """

    _MIN_BLOCK = 64 * 1024

    def __init__(self, keep_bytes: int, pin: bool | None = None) -> None:
        self.keep_bytes = keep_bytes
        # Whether blocks for copies from a device may be pinned (None: yes).
        self.pin = pin is not False
        self.budget = ByteBudget(keep_bytes)
        self._streams: dict[int, device.Stream] = {}
        self._free: dict[tuple[bool, int], list[torch.Tensor]] = {}
        self._free_bytes = 0
        self._leased_bytes = 0
        self._lock = threading.Lock()
        self._pin_failed = False
        self._dropped_pinned = False  # a pinned block was dropped since the last trim
        self._aside: list[object] = []  # blocks a failed wait left possibly still being written
        self.allocated_bytes = 0  # every block this pool ever allocated, for tests and logs
        self.pinned_bytes = 0  # the pinned part of allocated_bytes

    @classmethod
    def size_class(cls, nbytes: int, pinned: bool = False) -> int:
        size = max(nbytes, cls._MIN_BLOCK)
        power = 1 << (size - 1).bit_length()
        if pinned:
            return power
        three_quarters = power // 4 * 3
        return three_quarters if size <= three_quarters else power

    def _pins(self, from_device: bool) -> bool:
        return from_device and self.pin and not self._pin_failed

    def block_bytes(self, nbytes: int, from_device: bool) -> int:
        """The bytes of the block ``acquire(nbytes, from_device)`` lends: what a write staged
        through this pool costs the staging budget."""
        return self.size_class(nbytes, self._pins(from_device))

    def share(self, budget_bytes: int) -> BudgetShare:
        """A write pipeline's share of the process's staging budget, which becomes
        ``budget_bytes`` (the budget as of this take; the pool keeps as many free bytes)."""
        with self._lock:
            self.keep_bytes = budget_bytes
        self.budget.capacity = max(1, budget_bytes)
        self.budget.wake()  # waiters re-check against the new capacity
        return BudgetShare(self.budget)

    def stream(self, index: int) -> device.Stream:
        """The staging stream of device ``index``, made the first time one is needed."""
        stream = self._streams.get(index)
        if stream is None:
            with self._lock:
                stream = self._streams.get(index)
                if stream is None:
                    # Only a machine with a GPU creates a real one.
                    stream = self._streams[index] = device.new_stream(index)
        return stream

    def acquire(self, nbytes: int, from_device: bool = False) -> Lease:
        """A buffer of at least ``nbytes``: a free block of its size class, or a new one;
        pinned when ``from_device`` (its copies come from a device) and pinning works."""
        pinned = self._pins(from_device)
        size = self.size_class(nbytes, pinned)
        with self._lock:
            blocks = self._free.get((pinned, size))
            block = blocks.pop() if blocks else None
            if block is not None:
                self._free_bytes -= size
                self._leased_bytes += size
        fresh = block is None
        if block is None:
            block, pinned = self._new_block(nbytes, pinned)
            with self._lock:
                self._leased_bytes += block.numel()
        return Lease(self, block, nbytes, fresh, pinned)

    def _new_block(self, nbytes: int, pinned: bool) -> tuple[torch.Tensor, bool]:
        if pinned:
            size = self.size_class(nbytes, True)
            try:
                # Only a machine with a GPU allocates pinned blocks for real.
                block = device.pinned_empty((size,), torch.uint8)
            except RuntimeError as e:
                with self._lock:
                    first, self._pin_failed = not self._pin_failed, True
                if first:
                    logger.warning(
                        "staging: cannot pin %d bytes of host memory (%s); async take stages "
                        "device tensors in pageable memory from now on, with synchronous "
                        "copies (raise the locked-memory limit, ulimit -l, to pin)",
                        size,
                        e,
                    )
            else:
                self.allocated_bytes += size
                self.pinned_bytes += size
                return block, True
        size = self.size_class(nbytes)
        block = torch.empty(size, dtype=torch.uint8)
        advise_huge_pages(block)
        self.allocated_bytes += size
        return block, False

    def _give_back(self, block: torch.Tensor, pinned: bool) -> None:
        size = block.numel()
        with self._lock:
            self._leased_bytes -= size
            if self._free_bytes + size <= self.keep_bytes:
                self._free.setdefault((pinned, size), []).append(block)
                self._free_bytes += size
            elif pinned:
                self._dropped_pinned = True  # still locked in torch's host cache until trim

    def _set_aside(self, block: torch.Tensor, keep: object) -> None:
        with self._lock:
            self._leased_bytes -= block.numel()
            self._aside.append((block, keep))

    @property
    def free_bytes(self) -> int:
        """Bytes of the free blocks the pool keeps."""
        return self._free_bytes

    @property
    def leased_bytes(self) -> int:
        """Bytes of the blocks lent out now."""
        return self._leased_bytes

    def trim(self) -> None:
        """Drops free blocks beyond ``keep_bytes``; if pinned blocks were dropped since the last
        trim, empties torch's host cache so their memory is unlocked and returned (run off the
        caller's thread: async take's background commit runs it once its writes are done)."""
        with self._lock:
            dropped = self._drop(self.keep_bytes)
            pinned = self._dropped_pinned or any(p for p, _ in dropped)
            self._dropped_pinned = False
        del dropped
        if pinned:
            # Only a machine with a GPU runs this for real.
            device.empty_host_cache()

    def clear(self) -> None:
        """Gives every free block back (pinned memory back to the system)."""
        with self._lock:
            keep, self.keep_bytes = self.keep_bytes, 0
        try:
            self.trim()
        finally:
            with self._lock:
                self.keep_bytes = keep

    def _drop(self, limit: int) -> list[tuple[bool, torch.Tensor]]:
        """Takes free blocks out, largest first, until at most ``limit`` bytes are kept (with
        the lock held; the caller frees them outside it)."""
        dropped: list[tuple[bool, torch.Tensor]] = []
        for pinned, size in sorted(self._free, key=lambda k: -k[1]):
            blocks = self._free[(pinned, size)]
            while blocks and self._free_bytes > limit:
                dropped.append((pinned, blocks.pop()))
                self._free_bytes -= size
            if not blocks:
                del self._free[(pinned, size)]
        return dropped


# Linux's madvise(MADV_HUGEPAGE): back the range with 2 MiB pages where the kernel can.
_MADV_HUGEPAGE = 14
_HUGE_PAGE = 2 << 20


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def advise_huge_pages(block: torch.Tensor) -> bool:
    """Asks Linux to back the 2 MiB-aligned interior of a fresh CPU buffer with huge pages.

    A staging buffer's first fill is mostly page faults: a 512 MiB buffer takes 131,072 of them
    with 4 KiB pages, 256 with 2 MiB ones, and its first copy was 20-25% faster here with the
    advice (where transparent huge pages are in "madvise" mode, as on this machine, nothing
    else gives them). Returns whether the advice was taken; where it is not (another OS, huge
    pages off), nothing changes.
    """
    madvise = _madvise()
    nbytes = block.numel() * block.element_size()
    if madvise is None or nbytes < 2 * _HUGE_PAGE:
        return False
    start = block.data_ptr()
    lo = -(-start // _HUGE_PAGE) * _HUGE_PAGE
    hi = (start + nbytes) // _HUGE_PAGE * _HUGE_PAGE
    return hi > lo and madvise(lo, hi - lo, _MADV_HUGEPAGE) == 0


_pool: StagingPool | None = None
_pool_lock = threading.Lock()


def default_pool() -> StagingPool:
    """The process's staging pool, keeping up to the memory budget of free blocks; its
    ``budget`` is the staging budget every async take of the process shares."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = StagingPool(keep_bytes=knobs.memory_budget_bytes())
        return _pool
