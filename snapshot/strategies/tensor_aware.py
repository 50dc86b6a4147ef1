"""State dicts that lend out their tensors and stage them on CPU (the Megatron-style
``TensorAwareStateDict`` API): ``TensorPlaceholder``, ``TensorAwareStateDict``,
``BasicTensorAwareStateDict``."""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from snapshot._engine.io import device
from snapshot._engine.state_dicts import join
from snapshot.errors import (
    HollowStateError,
    ShapeMismatchError,
    StateMismatchError,
    UnsupportedValueError,
    a_or_an,
)

logger = logging.getLogger(__name__)

_Leaf = TypeVar("_Leaf")


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorPlaceholder:
    """What a hollow state holds in place of a popped tensor: its shape, dtype and the device
    it belongs on (its original one if it was staged on CPU)."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device

    def empty(self) -> torch.Tensor:
        """A new uninitialised tensor of this shape and dtype, on this device."""
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)


class TensorAwareStateDict(abc.ABC):
    """A state dict that can lend out its tensors and take them back.

    To write a state while training goes on: ``copy_tensors_to_cpu`` (training may then
    change the device tensors), wait for the copies if asynchronous, ``pop_tensors`` and hand
    them to the writer; the hollow remainder is cheap to serialize; ``insert_tensors`` gives
    them back. To restore: ``init_tensors`` (or ``insert_tensors`` with tensors read), fill
    them, then ``restore_tensor_device``.

    The state is *hollow* from ``pop_tensors`` until ``insert_tensors`` or ``init_tensors``;
    a method called out of turn raises ``HollowStateError``.
    """

    @property
    @abc.abstractmethod
    def state_dict(self) -> Any:
        """The wrapped state, live; placeholders stand for tensors while hollow."""

    @property
    @abc.abstractmethod
    def is_hollow(self) -> bool:
        """True iff the tensors were popped and have not been inserted back yet."""

    @property
    @abc.abstractmethod
    def tensors(self) -> list[torch.Tensor]:
        """The tensors, in ``pop_tensors`` order, without removing them (needs it full)."""

    @abc.abstractmethod
    def pop_tensors(self) -> list[torch.Tensor]:
        """Takes the tensors out, in the order ``insert_tensors`` expects them back, leaving
        placeholders of their shape, dtype and device."""

    @abc.abstractmethod
    def insert_tensors(self, tensors: Iterable[torch.Tensor]) -> None:
        """Puts tensors (one per placeholder, in order; the device may differ) back."""

    @abc.abstractmethod
    def init_tensors(self) -> None:
        """Inserts new uninitialised tensors of the placeholders' shape, dtype and device."""

    @abc.abstractmethod
    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        """Replaces the tensors by CPU copies, remembering each one's device."""

    @abc.abstractmethod
    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        """Moves every tensor that is not on the device it belongs on back there."""


class BasicTensorAwareStateDict(TensorAwareStateDict):
    """A ``TensorAwareStateDict`` over a plain state dict (modified in place from now on).

    Tensors are found in dicts, lists and tuples (named ones too), depth first in insertion and
    index order; anything else is a plain value. A tuple holding a tensor is replaced by a new
    one of its type. A container reached by two paths is walked once; a tensor held in two
    places (tied weights) is listed once per place and stays tied when staged. Placeholders and
    devices are matched by position, so the structure must not change between calls.
    ``init_tensors`` makes plain tensors (no ``nn.Parameter``, no ``requires_grad``).
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
        return self._state_dict

    @property
    def is_hollow(self) -> bool:
        return self._hollow

    @property
    def tensors(self) -> list[torch.Tensor]:
        """The tensors, in ``pop_tensors`` order (hollow: an error, not an empty list)."""
        self._require("tensors", hollow=False)
        return [tensor for _, tensor in self._find(torch.Tensor)]

    def pop_tensors(self) -> list[torch.Tensor]:
        """Takes the tensors out in traversal order, leaving placeholders (a staged tensor's
        records the device it belongs on, not CPU)."""
        self._require("pop_tensors", hollow=False)
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
        """Puts tensors back in place of the placeholders, each of its placeholder's shape
        and dtype (on any device: ``restore_tensor_device`` moves it home). All are checked
        before any is inserted: ``StateMismatchError`` (``ShapeMismatchError``) names the
        first misfit's path, and the state stays hollow."""
        self._require("insert_tensors", hollow=True)
        given = list(tensors)
        slots = self._find(TensorPlaceholder)
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
        self._require("init_tensors", hollow=True)
        self.insert_tensors(
            [placeholder.empty() for _, placeholder in self._find(TensorPlaceholder)]
        )

    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        """Replaces the tensors by new CPU copies (CPU ones too), remembering each one's
        device. ``non_blocking``: CUDA tensors are copied asynchronously into pinned memory on
        their device's current stream, so the caller must synchronize every such device before
        reading them (pageable and synchronous where pinning fails). A tensor that cannot be
        copied raises ``UnsupportedValueError``, the state left as it was."""
        self._require("copy_tensors_to_cpu", hollow=False)
        found = self._find(torch.Tensor)
        # Every copy is made before any is installed, so a failed copy leaves the state as it
        # was. A tensor reached by two paths (tied weights) is copied once and stays tied.
        copies: dict[int, torch.Tensor] = {}
        for path, tensor in found:
            if id(tensor) not in copies:
                copies[id(tensor)] = _cpu_copy(path, tensor, non_blocking)
        self._visit(lambda _, leaf: copies[id(leaf)] if isinstance(leaf, torch.Tensor) else leaf)
        self._homes = self._homes or [tensor.device for _, tensor in found]

    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        """Moves every tensor not on the device it belongs on back there (asynchronously with
        ``non_blocking``, ordered on the current stream); one already there stays as it is."""
        self._require("restore_tensor_device", hollow=False)
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

    def _require(self, operation: str, hollow: bool) -> None:
        """Raises ``HollowStateError`` unless the state is hollow (``hollow``) or full."""
        if self._hollow != hollow:
            raise HollowStateError(
                f"{operation}: the state is hollow (its tensors were popped and not inserted "
                "back); call insert_tensors or init_tensors first"
                if self._hollow
                else f"{operation}: the state is not hollow (it still holds its tensors); "
                "call pop_tensors first"
            )

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
            f"{path}: insert_tensors got {a_or_an(type(tensor).__name__)} where a tensor was "
            "popped; " + hint
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
    copy = None
    if non_blocking and tensor.is_cuda:
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
    if copy is None:
        copy, non_blocking = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu"), False
    try:
        # no_grad: a copy of a tensor that requires grad would otherwise join its graph.
        # A CUDA copy is queued on the current stream of the tensor's device.
        with torch.no_grad():
            device.copy(copy, tensor, non_blocking)
    except (RuntimeError, NotImplementedError) as e:
        raise UnsupportedValueError(
            f"{path}: cannot copy this {tensor.layout} tensor on {tensor.device} to CPU ({e}); "
            "only dense tensors that hold data (not on the meta device) can be staged"
        ) from e
    return copy
