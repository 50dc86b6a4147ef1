"""The bytes of generated states: tensors filled from their seeds, restore targets, the bitwise
check of what a method restored, bit flips of a whole state, and each rank's pieces of a
sharded state (the reshard case)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.common.states import StateSpec, TensorSpec, fmt_size

# ---------------------------------------------------------------------------------------------
# Tensor contents.

# Large float tensors are filled from a random pool of this many elements, each tile scaled
# differently: one random draw per pool and a multiply per tile, instead of a draw for every
# element, and still distinct everywhere.
_POOL = 1 << 20
_generator = torch.Generator()


def make_tensor(spec: TensorSpec) -> torch.Tensor:
    """The tensor ``spec`` describes, with its deterministic contents."""
    g = _generator.manual_seed(spec.seed)
    out = torch.empty(spec.shape, dtype=spec.dtype)
    flat = out.view(-1)
    n = flat.numel()
    if spec.dtype == torch.int64:
        flat.copy_(torch.randint(0, 50_257, (n,), generator=g, dtype=torch.int64))
    elif spec.dtype == torch.uint8:
        flat.copy_(torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8))
    elif n <= _POOL:
        if spec.dtype == torch.float32:
            flat.normal_(generator=g)
        else:
            flat.copy_(torch.randn(n, generator=g))
    else:
        pool = torch.randn(_POOL, generator=g) * 0.02
        for k, start in enumerate(range(0, n, _POOL)):
            stop = min(n, start + _POOL)
            torch.mul(pool[: stop - start], 1.0 + (k + 1) * 1e-3, out=flat[start:stop])
    return out


def generate_state(spec: StateSpec, with_objects: bool = True) -> dict[str, dict[str, Any]]:
    """group -> {name -> tensor or object}: the state to save."""
    state: dict[str, dict[str, Any]] = {g: {} for g in spec.groups}
    for t in spec.tensors:
        state[t.group][t.name] = make_tensor(t)
    if with_objects:
        for g, objs in spec.objects.items():
            # Copies of the lists, so a method that mutates them cannot change the spec.
            state[g].update({k: list(v) if isinstance(v, list) else v for k, v in objs.items()})
    return state


def _placeholder(value: Any) -> Any:
    """A value of the same kind that differs from ``value`` (restores must replace it)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return -1
    if isinstance(value, float):
        return -1.0
    if isinstance(value, str):
        return ""
    if isinstance(value, list):
        return []
    return None


def make_targets(spec: StateSpec, with_objects: bool = True) -> dict[str, dict[str, Any]]:
    """Preallocated restore targets: zero-filled tensors (so their pages exist before the timed
    restore) and placeholder objects, in the same layout as :func:`generate_state`."""
    state: dict[str, dict[str, Any]] = {g: {} for g in spec.groups}
    for t in spec.tensors:
        state[t.group][t.name] = torch.zeros(t.shape, dtype=t.dtype)
    if with_objects:
        for g, objs in spec.objects.items():
            state[g].update((k, _placeholder(v)) for k, v in objs.items())
    return state


def flatten_state(state: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """group -> name -> value  as  ``"group.name" -> value`` (for single-dict methods)."""
    return {f"{g}.{k}": v for g, d in state.items() for k, v in d.items()}


def unflatten_state(flat: Mapping[str, Any], spec: StateSpec) -> dict[str, dict[str, Any]]:
    """Inverse of :func:`flatten_state` for the groups of ``spec``."""
    state: dict[str, dict[str, Any]] = {g: {} for g in spec.groups}
    for key, value in flat.items():
        group, _, name = key.partition(".")
        state.setdefault(group, {})[name] = value
    return state


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a contiguous tensor as a flat uint8 view (works for bf16 too)."""
    if not t.is_contiguous():
        raise ValueError("tensor_bytes needs a contiguous tensor")
    return t.reshape(-1).view(torch.uint8)


def writable_buffer(t: torch.Tensor) -> memoryview:
    """A writable memoryview over a contiguous CPU tensor's bytes (for readinto / write)."""
    return memoryview(tensor_bytes(t).numpy()).cast("B")


@dataclass
class CheckResult:
    ok: bool
    detail: str

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "detail": self.detail}


def check_restored(
    spec: StateSpec,
    restored: Mapping[str, Mapping[str, Any]],
    with_objects: bool,
    tensors: Iterator[TensorSpec] | None = None,
    count_all: bool = False,
) -> CheckResult:
    """Compares ``restored`` (group -> name -> value) with the generated state, bitwise.

    Each expected tensor is regenerated, compared as raw bytes, and dropped, so the check holds
    at most one extra tensor in memory. ``tensors`` limits the check to some tensors.
    ``count_all``: go on past tensors whose bytes differ and say how many (and how many bytes)
    differ, instead of stopping at the first.
    """
    n_tensors = n_objects = 0
    differ: list[TensorSpec] = []
    for t in spec.tensors if tensors is None else tensors:
        got = restored.get(t.group, {}).get(t.name)
        where = f"{t.group}.{t.name}"
        if not isinstance(got, torch.Tensor):
            return CheckResult(False, f"MISMATCH {where}: got {type(got).__name__}")
        if got.dtype != t.dtype or tuple(got.shape) != t.shape:
            return CheckResult(
                False, f"MISMATCH {where}: {got.dtype} {tuple(got.shape)} != {t.dtype} {t.shape}"
            )
        expected = make_tensor(t)
        if not torch.equal(tensor_bytes(got.contiguous()), tensor_bytes(expected)):
            if not count_all:
                return CheckResult(False, f"MISMATCH {where}: bytes differ")
            differ.append(t)
        n_tensors += 1
    if differ:
        nbytes = sum(t.nbytes for t in differ)
        return CheckResult(
            False,
            f"MISMATCH: {len(differ)} of {n_tensors} tensors ({fmt_size(nbytes)} of "
            f"{fmt_size(spec.nbytes)}) differ, e.g. {differ[0].flat_key}",
        )
    if with_objects and tensors is None:
        for g, objs in spec.objects.items():
            for k, v in objs.items():
                got = restored.get(g, {}).get(k)
                if type(got) is not type(v) or got != v:
                    return CheckResult(False, f"MISMATCH {g}.{k}: {got!r} != {v!r}")
                n_objects += 1
    objects = f" + {n_objects} objects" if with_objects and spec.objects else ""
    return CheckResult(True, f"ok ({n_tensors} tensors{objects} bitwise equal)")


def flip_bits(state: Mapping[str, Mapping[str, Any]]) -> None:
    """Inverts every bit of every tensor of ``state`` in place (its Python objects are left as
    they are): a change of every byte that a second call undoes, so a state flipped an even
    number of times is the generated one again, and the check needs no second copy."""
    with torch.no_grad():
        for group in state.values():
            for value in group.values():
                if isinstance(value, torch.Tensor):
                    tensor_bytes(value).bitwise_not_()


# ---------------------------------------------------------------------------------------------
# Sharded states (the reshard case): each rank's pieces of the global tensors of a spec.

# How a rank holds a ``dtensors`` state: "shard0" / "shard1": DTensors on a 1-D CPU mesh of the
# group's ranks, each 2-D tensor with placement [Shard(0)] / [Shard(1)] (1-D tensors [Shard(0)]
# in both); "full": plain tensors, the whole of every global tensor (one process).
LAYOUTS = {
    "shard0": "[Shard(0)]",
    "shard1": "[Shard(1)] (1-D tensors [Shard(0)])",
    "full": "plain full tensors",
}


def shard_dim(t: TensorSpec, layout: str) -> int | None:
    """The dimension ``layout`` shards ``t`` along (None: not sharded)."""
    if layout == "full":
        return None
    if layout == "shard0" or len(t.shape) == 1:
        return 0
    if layout == "shard1":
        return 1
    raise ValueError(f"unknown layout {layout!r}; known: {', '.join(LAYOUTS)}")


def global_piece(t: TensorSpec, layout: str, rank: int, world: int) -> torch.Tensor:
    """This rank's piece of ``t``'s global tensor under ``layout``, as DTensor's ``Shard(dim)``
    splits it (``torch.chunk``), in memory of its own: the global tensor is regenerated, cut,
    and dropped, so at most one global tensor is held at a time."""
    full = make_tensor(t)
    dim = shard_dim(t, layout)
    if dim is None:
        return full
    if t.shape[dim] % world:
        raise ValueError(f"{t.flat_key} {t.shape}: dim {dim} does not split over {world} ranks")
    return full.chunk(world, dim)[rank].clone(memory_format=torch.contiguous_format)


_meshes: dict[int, Any] = {}


def sharded_state(
    spec: StateSpec, layout: str, rank: int, world: int, filled: bool
) -> dict[str, Any]:
    """name -> this rank's value of each tensor of ``spec`` under ``layout``: a DTensor built
    from its local piece without communication (``DTensor.from_local`` with the global shape and
    stride), or the plain tensor for "full". ``filled``: the generated values (a take); else
    zero-filled pieces, touched before the timed region (a restore's targets).

    A DTensor layout needs the process group initialized (the mesh spans all its ranks)."""
    out: dict[str, Any] = {}
    mesh = None
    if layout != "full":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        if world not in _meshes:
            _meshes[world] = init_device_mesh("cpu", (world,))
        mesh = _meshes[world]
    for t in spec.tensors:
        dim = shard_dim(t, layout)
        if filled:
            local = global_piece(t, layout, rank, world)
        else:
            shape = list(t.shape)
            if dim is not None:
                shape[dim] //= world
            local = torch.zeros(shape, dtype=t.dtype)
        if dim is None:
            out[t.name] = local
            continue
        stride = tuple(_strides_of(t.shape))
        out[t.name] = DTensor.from_local(
            local, mesh, [Shard(dim)], run_check=False, shape=torch.Size(t.shape), stride=stride
        )
    return out


def _strides_of(shape: tuple[int, ...]) -> list[int]:
    """The strides of a contiguous tensor of ``shape``."""
    out = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        out[d] = out[d + 1] * shape[d + 1]
    return out


def local_tensor(value: Any) -> Any:
    """A DTensor's local tensor; anything else as it is."""
    to_local = getattr(value, "to_local", None)
    return to_local() if callable(to_local) else value


def check_pieces(
    spec: StateSpec, restored: Mapping[str, Any], layout: str, rank: int, world: int
) -> CheckResult:
    """Compares each restored value's local tensor (name -> DTensor or tensor) bitwise with this
    rank's piece of the regenerated global tensor, dtype and shape included. The detail is the
    same on every rank that passes (the harness merges them)."""
    for t in spec.tensors:
        got = local_tensor(restored.get(t.name))
        where = t.flat_key
        if not isinstance(got, torch.Tensor):
            return CheckResult(False, f"MISMATCH {where}: got {type(got).__name__}")
        expected = global_piece(t, layout, rank, world)
        if got.dtype != expected.dtype or got.shape != expected.shape:
            return CheckResult(
                False,
                f"MISMATCH {where}: {got.dtype} {tuple(got.shape)} != {expected.dtype} "
                f"{tuple(expected.shape)}",
            )
        if not torch.equal(tensor_bytes(got.contiguous()), tensor_bytes(expected)):
            return CheckResult(False, f"MISMATCH {where}: bytes differ")
    what = "global tensors" if layout == "full" else "pieces"
    return CheckResult(True, f"ok ({len(spec.tensors)} {what} bitwise equal to the generated)")
