"""Staging for async take: a reusable pool of host buffers, and state dicts that lend out their
tensors and stage them on CPU."""

from __future__ import annotations

import abc
import contextlib
import ctypes
import functools
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from snapshot import knobs
from snapshot.errors import (
    HollowStateError,
    ShapeMismatchError,
    StateMismatchError,
    UnsupportedValueError,
)
from snapshot.flatten import join
from snapshot.serialization import tensor_memoryview

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
    copies if they were asynchronous, then ``pop_tensors`` and hands the tensors to the writer;
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
                after the caller synchronizes (e.g. ``torch.cuda.synchronize()``).

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
            device = homes[len(popped)] if homes is not None else leaf.device
            popped.append(leaf)
            return TensorPlaceholder(shape=leaf.shape, dtype=leaf.dtype, device=device)

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
            non_blocking: Copy CUDA tensors asynchronously into pinned memory; the copies may
                then be read only after the caller synchronizes (``torch.cuda.synchronize()``).

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


def _cpu_copy(path: str, tensor: torch.Tensor, non_blocking: bool) -> torch.Tensor:
    # GPU only: a device-to-host copy is asynchronous only into page-locked memory (from pageable
    # memory CUDA copies synchronously), so the destination is pinned when the copy may be
    # asynchronous. Only a CUDA run proves these two lines; on CPU both are plain copies.
    pin = non_blocking and tensor.device.type == "cuda" and torch.cuda.is_available()
    copy = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
    try:
        # no_grad: a copy of a tensor that requires grad would otherwise join its graph.
        with torch.no_grad():
            copy.copy_(tensor, non_blocking=non_blocking)
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
    requested size (pinned when CUDA is available), ``view`` the same memory as a memoryview.

    ``ready`` waits for the asynchronous device-to-host copies into it; ``release`` gives the
    buffer back to the pool once the write is done with it.
    """

    __slots__ = ("_block", "_pool", "fresh", "tensor", "view")

    def __init__(self, pool: StagingPool, block: torch.Tensor, nbytes: int, fresh: bool) -> None:
        self._pool: StagingPool | None = pool
        self._block = block
        self.fresh = fresh  # newly allocated: its pages are not yet touched
        self.tensor = block[:nbytes]
        self.view = tensor_memoryview(self.tensor)

    def touch(self) -> None:
        """Faults a fresh buffer's pages in with torch's multi-threaded fill, before it is
        filled by many small single-threaded copies (which would each take their page faults
        one core at a time: about 1.5x slower in all on 2 cores). Pinned memory is resident
        already."""
        if self.fresh and not self.tensor.is_pinned():
            self.tensor.zero_()
        self.fresh = False

    def ready(self) -> None:
        """Makes the copies into the buffer complete before anyone reads it."""
        stream = self._pool.stream if self._pool is not None else None
        if stream is not None:
            # Only a machine with a GPU runs this line: the device-to-host copies into this
            # pinned buffer were issued non_blocking on the side stream; one synchronization per
            # staged write.
            stream.synchronize()

    def release(self) -> None:
        """Gives the buffer back; the lease then holds no memory, even if it is kept around."""
        pool, self._pool = self._pool, None
        if pool is not None:
            block = self._block
            self._block = self.tensor = self.view = None  # type: ignore[assignment]
            pool._give_back(block)


class StagingPool:
    """Host buffers for async take, kept and reused across snapshots.

    Blocks come in size classes (powers of two and 1.5 times them, at least 64 KiB), so a
    buffer freed by one write fits the next write of a similar size; the pool keeps at most
    ``keep_bytes`` of free blocks (the rest go back to the allocator). Blocks are pinned when
    CUDA is available, so device-to-host copies into them can run asynchronously. How many
    bytes are lent out at once is bounded by the caller (the write pipeline's byte budget), not
    here: the pool never blocks.

    Why a pool: fresh memory costs far more than copying into memory already touched (on the
    machine the benchmarks ran on, a copy into new memory ran at 2-3 GB/s, page faults included,
    and into reused memory at 7-10 GB/s), and an async take's stall is mostly that copy.
    """

    _MIN_BLOCK = 64 * 1024

    def __init__(self, keep_bytes: int, pin: bool | None = None) -> None:
        self.keep_bytes = keep_bytes
        self.pin = torch.cuda.is_available() if pin is None else pin
        # Device-to-host copies run on a stream of their own, so training kernels queued on the
        # current stream are not held up behind them. Only a GPU run creates or uses it.
        self.stream = torch.cuda.Stream() if self.pin and torch.cuda.is_available() else None
        self._free: dict[int, list[torch.Tensor]] = {}
        self._free_bytes = 0
        self._lock = threading.Lock()
        self.allocated_bytes = 0  # every block this pool ever allocated, for tests and logs

    @classmethod
    def size_class(cls, nbytes: int) -> int:
        size = max(nbytes, cls._MIN_BLOCK)
        power = 1 << (size - 1).bit_length()
        three_quarters = power // 4 * 3
        return three_quarters if size <= three_quarters else power

    @contextlib.contextmanager
    def copying(self) -> Iterator[None]:
        """The context to issue copies into leased buffers in: on CPU, nothing; with CUDA, the
        side stream, after the work already queued on the current stream (the kernels that
        computed the tensors being copied)."""
        if self.stream is None:
            yield
            return
        # Only a machine with a GPU runs the lines below.
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            yield

    def acquire(self, nbytes: int) -> Lease:
        """A buffer of at least ``nbytes``: a free block of its size class, or a new one."""
        size = self.size_class(nbytes)
        with self._lock:
            blocks = self._free.get(size)
            block = blocks.pop() if blocks else None
            if block is not None:
                self._free_bytes -= size
        fresh = block is None
        if block is None:
            # pin_memory needs CUDA; only a machine with a GPU allocates pinned blocks.
            block = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
            if not self.pin:
                advise_huge_pages(block)
            self.allocated_bytes += size
        return Lease(self, block, nbytes, fresh)

    def _give_back(self, block: torch.Tensor) -> None:
        size = block.numel()
        with self._lock:
            if self._free_bytes + size <= self.keep_bytes:
                self._free.setdefault(size, []).append(block)
                self._free_bytes += size

    @property
    def free_bytes(self) -> int:
        return self._free_bytes

    def clear(self) -> None:
        """Gives every free block back to the allocator."""
        with self._lock:
            self._free.clear()
            self._free_bytes = 0


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
    """The process's staging pool, keeping up to the memory budget of free blocks."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = StagingPool(keep_bytes=knobs.memory_budget_bytes())
        return _pool
