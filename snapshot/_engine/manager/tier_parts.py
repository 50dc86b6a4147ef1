"""What a memory tier part holds of sharded state: each rank's local pieces, described.

A tier part is taken by one process alone, and the tier restores it only to a job of the same
world size, so it needs no global view of a sharded value: ``LocalPart`` wraps an app_state
value so that its ``state_dict()`` hands the take each DTensor as its ``to_local()`` tensor,
torch's ShardedTensor as the list of its local shards' tensors and our ``ShardedTensor`` as
its data, and records each one's layout (global shape, dtype, placements or offsets and
sizes, the mesh's ranks and this rank's coordinate). At restore it is given the layout the
part was taken with: a target of another layout raises ``LayoutMismatch`` from its
``state_dict()``, before anything is read; otherwise the pieces land in the targets' local
tensors and ``load_state_dict`` gets the values of the types the target's ``state_dict()``
gave (a DTensor and torch's ShardedTensor themselves, ours its data, as a plain restore does).
For a durable step written from the part, ``rebuilders`` records at the take how to put each
DTensor, torch's ShardedTensor on the CPU and ours back around its pieces read back
(``rebuilt``): the take of that state
sees the values the live ``state_dict()`` gave.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
from typing import Any

from snapshot._engine.state_dicts import check_app_state
from snapshot.errors import SnapshotError
from snapshot.sharding.mapping import ShardedTensor, ShardedTensorFactory
from snapshot.stateful import RNGState

LAYOUT_NAME = "tier_layout.json"  # in a part's folder, beside its snapshot, when not empty

Layout = dict[str, dict[str, Any]]  # path of a sharded value in the state -> its description


class LayoutMismatch(SnapshotError):
    """A target's sharded values are not laid out as those of the tier's part."""


def _type(module: str, name: str) -> Any:
    # Looked up, not imported: no such value exists before its module is imported.
    return getattr(sys.modules.get(module), name, None)


def _describe(value: Any) -> tuple[dict[str, Any], list[Any]] | None:
    """A sharded value's description and local tensors; None for any other value."""
    dtensor = _type("torch.distributed.tensor", "DTensor")
    if dtensor is not None and isinstance(value, dtensor):
        mesh = value.device_mesh
        local, coordinate = value.to_local(), mesh.get_coordinate()
        return {
            "kind": "DTensor",
            "shape": list(value.shape),
            "dtype": str(value.dtype),
            "placements": [str(p) for p in value.placements],
            "mesh": mesh.mesh.tolist(),
            "coordinate": None if coordinate is None else list(coordinate),
            "local": list(local.shape),
        }, [local]
    if isinstance(value, ShardedTensor):
        return {
            "kind": "ShardedTensor",
            "key": value.key,
            "shape": list(value.global_shape),
            "dtype": str(value.dtype),
            "offset": list(value.global_offset),
            "local": list(value.local_shape),
            "prepend_axis_num": value.prepend_axis_num,
        }, [value.data]
    sharded = _type("torch.distributed._shard.sharded_tensor.api", "ShardedTensorBase")
    if sharded is not None and isinstance(value, sharded):
        shards = value.local_shards()
        return {
            "kind": "torch ShardedTensor",
            "shape": list(value.size()),
            "dtype": str(value.dtype),
            "shards": [
                [list(s.metadata.shard_offsets), list(s.metadata.shard_sizes)] for s in shards
            ],
        }, [s.tensor for s in shards]
    return None


def _localize(state: Any, path: str, layout: Layout, originals: dict[str, Any]) -> Any:
    """``state`` with each sharded value replaced by its local tensor(s), recorded under its
    path in ``layout`` (description) and ``originals`` (the value and its local tensors; a
    ``ShardedTensorFactory``, built here, under ``<path>#factory``)."""
    if isinstance(state, dict):
        out = {k: _localize(v, f"{path}/{k!r}", layout, originals) for k, v in state.items()}
        return _same_or_new(state, out)
    if isinstance(state, list | tuple) and type(state) in (list, tuple):
        return _same_or_new(
            state, [_localize(v, f"{path}/{i}", layout, originals) for i, v in enumerate(state)]
        )
    if isinstance(state, ShardedTensorFactory):
        originals[f"{path}#factory"] = state
        return _localize(state.build(), path, layout, originals)
    found = _describe(state)
    if found is None:
        return state
    layout[path], pieces = found
    originals[path] = (state, pieces)
    return pieces[0] if found[0]["kind"] != "torch ShardedTensor" else list(pieces)


def _rebuild(value: Any, path: str, originals: dict[str, Any], built: bool = False) -> Any:
    """The loaded ``value`` with each sharded target put back, its local tensors holding the
    loaded pieces (and what a factory built merged back by its ``merge_fn``)."""
    factory = None if built else originals.get(f"{path}#factory")
    if factory is not None:
        return factory.merge_fn(_rebuild(value, path, originals, built=True))
    if path in originals:
        target, pieces = originals[path]
        loaded = (
            [value] if isinstance(target, ShardedTensor) or not isinstance(value, list) else value
        )
        if len(loaded) != len(pieces):
            raise LayoutMismatch(f"{path}: {len(loaded)} pieces loaded for {len(pieces)} targets")
        import torch

        with torch.no_grad():
            for got, piece in zip(loaded, pieces, strict=True):
                if got is not piece:  # loaded elsewhere than in place: copied in
                    piece.copy_(got)
        return target.data if isinstance(target, ShardedTensor) else target
    if isinstance(value, dict):
        out = {k: _rebuild(v, f"{path}/{k!r}", originals) for k, v in value.items()}
        return _same_or_new(value, out)
    if isinstance(value, list | tuple) and type(value) in (list, tuple):
        return _same_or_new(
            value, [_rebuild(v, f"{path}/{i}", originals) for i, v in enumerate(value)]
        )
    return value


def _rebuilder(value: Any) -> Any:
    """How to put ``value`` (a sharded value ``_localize`` replaced) back around its local tensor
    read back from a part, taken at the save (no data kept); None: not this plainly (a factory's
    values, torch's ShardedTensor placed off the CPU)."""
    if isinstance(value, ShardedTensor):
        bare = value.without_data()
        return lambda local: dataclasses.replace(bare, data=local)
    torch_sharded = _type("torch.distributed._shard.sharded_tensor.api", "ShardedTensor")
    if torch_sharded is not None and isinstance(value, torch_sharded):
        return _torch_rebuilder(value, torch_sharded)
    dtensor = _type("torch.distributed.tensor", "DTensor")
    if dtensor is None or not isinstance(value, dtensor):
        return None
    # The DTensor's own constructor, not ``from_local``: that moves the piece onto the mesh's
    # device (an accelerator's memory); a take only reads the piece and the layout, which the
    # spec gives as the live value had it (mesh, placements, global shape and stride).
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    meta = TensorMeta(value.shape, value.stride(), value.dtype)
    spec = DTensorSpec(value.device_mesh, tuple(value.placements), tensor_meta=meta)
    return lambda local: dtensor(local, spec, requires_grad=False)


def _torch_rebuilder(value: Any, cls: Any) -> Any:
    """Torch's ShardedTensor around the local shards' tensors read back (a list): its shards'
    and its global metadata, through the constructor that checks them against each other and,
    without RRefs, runs no collective. None when a shard is placed off the CPU: the tensors
    read back are on the CPU, and moving them is the live take's job."""
    from torch.distributed._shard.sharded_tensor import Shard

    metas = [s.metadata for s in value.local_shards()]
    if any(m.placement is None or m.placement.device().type != "cpu" for m in metas):
        return None
    whole, pg = value.metadata(), value._process_group
    return lambda locals_: cls._init_from_local_shards_and_global_metadata(
        [Shard(t, m) for t, m in zip(locals_, metas, strict=True)], whole, process_group=pg
    )


def rebuilders(wrapped: dict[str, Any]) -> dict[str, dict[str, Any]] | None:
    """For a part just taken: per app_state key, each sharded value's path and its
    ``_rebuilder`` (nothing for a key holding none); None when one is not rebuilt plainly."""
    out: dict[str, dict[str, Any]] = {}
    for k, v in wrapped.items():
        if not isinstance(v, LocalPart) or not v.layout:
            continue
        found = {p: _rebuilder(v._originals[p][0]) for p in v.layout}
        factory = any(p.endswith("#factory") for p in v._originals)
        if factory or any(f is None for f in found.values()):
            return None
        out[k] = found
    return out


def rebuilt(state: Any, found: dict[str, Any], path: str = "") -> Any:
    """``state`` read back from a part with each sharded value at its path in ``found``
    (``rebuilders``) put back around its local tensor, as the live ``state_dict()`` gave it."""
    if path in found:
        return found[path](state)
    if isinstance(state, dict):
        out = {k: rebuilt(v, found, f"{path}/{k!r}") for k, v in state.items()}
        return _same_or_new(state, out)
    if isinstance(state, list | tuple) and type(state) in (list, tuple):
        return _same_or_new(state, [rebuilt(v, found, f"{path}/{i}") for i, v in enumerate(state)])
    return state


def _same_or_new(old: Any, new: dict[Any, Any] | list[Any]) -> Any:
    """``old`` itself when none of its children changed (a state with nothing sharded goes
    through untouched, a module's ``_metadata`` with it), else ``new`` as ``old``'s type."""
    olds = old.values() if isinstance(new, dict) else old
    news = new.values() if isinstance(new, dict) else new
    if all(a is b for a, b in zip(olds, news, strict=True)):
        return old
    out: Any = new if type(new) is type(old) else type(old)(new)
    if hasattr(old, "_metadata"):  # a module's state dict: its version records go along
        out._metadata = old._metadata
    return out


class LocalPart:
    """An app_state value as a tier part holds it (see the module). ``expected``: the layout
    of the part being restored (None: a take)."""

    def __init__(self, inner: Any, expected: Layout | None = None) -> None:
        self.inner, self.expected = inner, expected
        self.layout: Layout = {}
        self.mismatch: str | None = None
        self._originals: dict[str, Any] = {}

    def state_dict(self) -> Any:
        self.layout, self._originals = {}, {}
        local = _localize(self.inner.state_dict(), "", self.layout, self._originals)
        if self.expected is not None and self.layout != self.expected:
            self.mismatch = _difference(self.expected, self.layout)
            raise LayoutMismatch(
                f"the target's sharded state is laid out otherwise: {self.mismatch}"
            )
        return local

    def load_state_dict(self, state: Any) -> None:
        self.inner.load_state_dict(_rebuild(state, "", self._originals))


def _difference(saved: Layout, target: Layout) -> str:
    for path in sorted(saved.keys() | target.keys()):
        if saved.get(path) != target.get(path):
            return f"{path or 'the value'}: saved {saved.get(path)}, target {target.get(path)}"
    return "none"


def wrap(app_state: Any, layouts: dict[str, Layout] | None, path: str) -> dict[str, Any]:
    """``app_state`` with each value (RNGState aside: it holds nothing sharded, and the
    restore orders it last by its type) a ``LocalPart``; ``layouts``: the part's, at restore.
    An app_state a take or restore refuses is refused here, as they would (``path``: the
    part's)."""
    check_app_state(app_state, path)
    return {
        k: v
        if isinstance(v, RNGState)
        else LocalPart(v, None if layouts is None else layouts.get(k, {}))
        for k, v in app_state.items()
    }


def mismatch(wrapped: dict[str, Any]) -> str | None:
    """Why the targets are not laid out as the part (None: they are, or were not checked)."""
    for k, v in wrapped.items():
        if isinstance(v, LocalPart) and v.mismatch is not None:
            return f"app_state[{k!r}]: {v.mismatch}"
    return None


def write_layouts(folder: str, wrapped: dict[str, Any]) -> None:
    """Records the layouts of a part just taken in ``folder`` (nothing when none is sharded)."""
    layouts = {k: v.layout for k, v in wrapped.items() if isinstance(v, LocalPart) and v.layout}
    if not layouts:
        return
    path = os.path.join(folder, LAYOUT_NAME)
    with open(path + ".tmp", "w") as f:
        json.dump(layouts, f)
    os.replace(path + ".tmp", path)


def read_layouts(folder: str) -> dict[str, Layout]:
    """The layouts of the part in ``folder`` (none: nothing sharded, or unreadable, which the
    check at restore then finds different from a sharded target's)."""
    with contextlib.suppress(OSError, ValueError), open(os.path.join(folder, LAYOUT_NAME)) as f:
        found = json.load(f)
        if isinstance(found, dict):
            return found
    return {}
