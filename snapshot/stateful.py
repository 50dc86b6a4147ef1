"""What can be snapshotted: the Stateful protocol, StateDict, and RNGState."""

from __future__ import annotations

import logging
import random
from collections import UserDict
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np
import torch

logger = logging.getLogger(__name__)


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict()``: modules, optimizers, LR
    schedulers, :class:`StateDict`, :class:`RNGState`, and your own classes."""

    def state_dict(self) -> dict[str, Any]:
        """The object's state: a dict of tensors, primitives, containers and objects."""
        ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Sets the object's state from ``state_dict`` (one ``state_dict()`` returned)."""
        ...


_S = TypeVar("_S", bound=Stateful)

# What ``Snapshot.take`` / ``restore`` accept: torchsnapshot's ``AppState``, generic like theirs.
AppState = dict[str, _S]


class StateDict(UserDict):  # type: ignore[type-arg]
    """A :class:`Stateful` dict for tensors and plain values in ``app_state``: its live
    contents are its state, so a restore loads tensors in place, then updates the dict."""

    def state_dict(self) -> dict[str, Any]:
        """The dict's own contents (not a copy): a restore loads tensors into them in place."""
        return self.data

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Updates the dict with ``state_dict``'s items (keys it lacks are kept)."""
        self.data.update(state_dict)


class RNGState:
    """The process's global random number generators, as one :class:`Stateful`: Python's,
    NumPy's, torch's CPU one and every CUDA device's. Capturing advances none of them, and a
    restore sets them after every other entry, so the numbers drawn after ``restore`` equal
    those drawn after ``take``."""

    def state_dict(self) -> dict[str, Any]:
        """The generators' states (``torch``, ``python``, ``numpy``, ``cuda``), captured
        without advancing them."""
        version, internal, gauss_next = random.getstate()
        state: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "python": {
                "version": version,
                "state": torch.tensor(internal, dtype=torch.int64),
                "gauss_next": gauss_next,
            },
        }
        name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state["numpy"] = {
            "bit_generator": name,
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Sets every generator from ``state_dict`` (ours, or torchsnapshot's ``rng_state``)."""
        if "torch" not in state_dict and set(state_dict) == {"rng_state"}:
            # torchsnapshot's RNGState held torch's CPU generator alone, under this name: a
            # snapshot it wrote restores that generator and leaves the others as they are.
            torch.set_rng_state(state_dict["rng_state"])
            return
        torch.set_rng_state(state_dict["torch"])
        py = state_dict["python"]
        internal = tuple(int(x) for x in py["state"].tolist())
        random.setstate((py["version"], internal, py["gauss_next"]))
        if "numpy" in state_dict:
            s = state_dict["numpy"]
            keys = s["keys"].numpy().astype(np.uint32)
            np.random.set_state(
                (s["bit_generator"], keys, s["pos"], s["has_gauss"], s["cached_gaussian"])
            )
        if "cuda" in state_dict:
            _set_cuda_rng_states(list(state_dict["cuda"]))


def _set_cuda_rng_states(states: list[torch.Tensor]) -> None:
    """Sets each visible GPU's generator to the state taken on the GPU of that index. With
    another number of GPUs than at take, those both have are set and the difference is logged
    (``torch.cuda.set_rng_state_all`` would raise, or skip the extra ones silently)."""
    if not torch.cuda.is_available():
        logger.warning(
            "snapshot holds the RNG states of %d CUDA device(s), but CUDA is not available "
            "here: they are not restored",
            len(states),
        )
        return
    visible = torch.cuda.device_count()
    for index in range(min(visible, len(states))):
        torch.cuda.set_rng_state(states[index], device=index)
    if visible != len(states):
        logger.warning(
            "snapshot holds the RNG states of %d CUDA device(s) and %d are visible here: %s",
            len(states),
            visible,
            f"devices {len(states)}..{visible - 1} keep their own state"
            if visible > len(states)
            else f"the states of devices {visible}..{len(states) - 1} are not restored",
        )
