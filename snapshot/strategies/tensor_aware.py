"""State dicts that can lend out their tensors and stage them on CPU (the Megatron-style
``TensorAwareStateDict`` API): ``TensorPlaceholder``, ``TensorAwareStateDict``,
``BasicTensorAwareStateDict``.

A state dict whose tensors can be lent out (``pop_tensors``), given back (``insert_tensors``),
recreated empty (``init_tensors``) and staged on CPU (``copy_tensors_to_cpu`` /
``restore_tensor_device``).
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from snapshot._engine.flatten import join
from snapshot._engine.io import device
from snapshot.errors import (
    HollowStateError,
    ShapeMismatchError,
    StateMismatchError,
    UnsupportedValueError,
)

logger = logging.getLogger(__name__)

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
