"""Shared pieces of the benchmark harness: generated states, measurements, page-cache control.

States
    A state is described by a :class:`StateSpec` (names, shapes, dtypes, seeds and Python
    objects; no tensor memory), built by :func:`build_spec` from a small JSON-able dict so the
    harness can hand it to a worker process. :func:`make_tensor` fills one tensor
    deterministically from its seed, so a worker can regenerate the expected bytes one tensor at
    a time after a restore instead of keeping a second copy of the state around.

    Kinds:
      ``model``   looks like a model plus its Adam state: six large fp32 tensors (two weights and
                  their ``exp_avg`` / ``exp_avg_sq``) holding most of the bytes, one bf16 tensor
                  (~6 %), one int64 tensor (~1 %), thousands of 4-64 KiB fp32 tensors (small
                  parameters and their two optimizer states), and Python objects (ints, floats,
                  strings, lists) in the optimizer group.
      ``tensors`` ``count`` fp32 tensors of equal size (``many-small``: 20,000; ``single``: 1).
      ``leaves``  ``leaves`` leaves: 90 % tiny fp32 tensors (16-256 elements), 10 % primitives.
      ``dp``      one rank of a data-parallel job (the ``dist`` case): a ``model`` group that is the
                  same on every rank (large fp32 weights and small fp32 norms/biases, seeded by
                  ``seed`` only) and an ``optim`` group of about a tenth of its size that differs
                  per rank (seeded by ``seed`` and ``rank``): two fp32 moment shards, a uint8 RNG
                  state, int64 counters, and Python objects.
      ``dtensors`` the global tensors of a sharded model (the ``reshard`` case): eight 2-D fp32
                  weights of equal size and a few hundred KiB of 1-D fp32 norm weights and biases,
                  every size divisible by 4 so that they shard evenly over 1, 2 and 4 ranks.
                  Each rank takes its piece of each global tensor (:func:`sharded_state`, as
                  DTensors of a layout of :data:`LAYOUTS`) and checks what it restored against
                  the piece of the regenerated global tensor (:func:`check_pieces`).

    Python objects only reach the methods that can store them (statesnap, torchsnapshot,
    torch.save, DCP); ``raw`` and safetensors store tensors only.

Measurements
    :class:`PeakRSS` resets the kernel's high-water mark (``/proc/self/clear_refs``) and reports
    the peak resident set above the RSS right before the operation, falling back to sampling
    when the reset does not work. :func:`proc_io` reads ``/proc/self/io``. :func:`tree_size`
    gives bytes on disk. :func:`check_restored` compares restored tensors with the generated
    ones bitwise (raw bytes, so bf16 and NaN payloads compare exactly); :func:`flip_bits`
    changes every byte of a state in place (the async case's caller mutating its tensors), and
    flipping twice gives the generated state back.

Page cache
    :func:`fsync_tree` fsyncs every file and directory under a path; :func:`set_page_cache`
    reads a tree into the page cache (a warm restore), or (:func:`drop_page_cache`) fsyncs each
    file and then ``posix_fadvise(POSIX_FADV_DONTNEED)`` so the next read comes from the disk
    (no root needed); :func:`resident_fraction` asks ``mincore`` how much of a tree is cached,
    to verify either. :func:`settle_memory` waits until the kernel has stopped handing freed
    memory back to the host (a VM with free page reporting), so that the page-cache writes of
    every method start from memory in the same state.

``python -m benchmarks.common --dir /tmp/statesnap-bench`` checks on this machine that the
peak-RSS reset and the page-cache drop work, and prints the machine description.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import mmap
import os
import platform
import random
import re
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30

# ---------------------------------------------------------------------------------------------
# Sizes.

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": KIB,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": MIB,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": GIB,
}


def parse_size(text: str) -> int:
    """``"512MiB"`` -> 536870912; accepts B, KB/KiB, MB/MiB, GB/GiB (case-insensitive)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (try 512MiB, 2GiB, 1000000)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def fmt_size(nbytes: float) -> str:
    """Binary units, as the tables use them: ``2.0 GiB``, ``512 MiB``, ``4.0 KiB``."""
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if abs(nbytes) >= scale:
            value = nbytes / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{nbytes:.0f} B"


# ---------------------------------------------------------------------------------------------
# State descriptions.


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a generated state: where it lives, its shape and dtype, and its seed."""

    group: str
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    seed: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def flat_key(self) -> str:
        return f"{self.group}.{self.name}"


@dataclass(frozen=True)
class StateSpec:
    """A whole generated state: tensors in order, and Python objects per group."""

    description: str
    tensors: tuple[TensorSpec, ...]
    objects: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Tensor payload in bytes (what GB/s figures are computed from)."""
        return sum(t.nbytes for t in self.tensors)

    def group_nbytes(self, group: str) -> int:
        """Tensor payload of one group in bytes."""
        return sum(t.nbytes for t in self.tensors if t.group == group)

    @property
    def groups(self) -> list[str]:
        seen: dict[str, None] = {}
        for t in self.tensors:
            seen.setdefault(t.group, None)
        for g in self.objects:
            seen.setdefault(g, None)
        return list(seen)

    @property
    def n_objects(self) -> int:
        return sum(len(v) for v in self.objects.values())

    def flat_objects(self) -> dict[str, Any]:
        return {f"{g}.{k}": v for g, objs in self.objects.items() for k, v in objs.items()}

    def find(self, group: str, name: str) -> TensorSpec:
        for t in self.tensors:
            if t.group == group and t.name == name:
                return t
        raise KeyError(f"{group}.{name}")


# Name of the 4 KiB tensor of a ``model`` state that the read-object case reads back.
READ_OBJECT_TARGET = ("model", "blocks.0.norm.weight")


def _model_spec(total: int, seed: int, n_small: int) -> StateSpec:
    rng = random.Random(seed)
    seeds = iter(range(seed * 1_000_003 + 1, seed * 1_000_003 + 10_000_000))
    tensors: list[TensorSpec] = []
    small_budget = total // 4
    small_model: list[TensorSpec] = []
    small_optim: list[TensorSpec] = []
    small_bytes = 0
    for i in range(max(1, n_small // 3)):
        # 4..64 KiB of fp32; the first is exactly 4 KiB (the read-object case reads it).
        numel = 1024 if i == 0 else rng.randint(1024, 16 * 1024)
        if i > 0 and small_bytes + 3 * numel * 4 > small_budget:
            break
        name = f"blocks.{i}.norm.weight"
        small_model.append(TensorSpec("model", name, (numel,), torch.float32, next(seeds)))
        for moment in ("exp_avg", "exp_avg_sq"):
            small_optim.append(
                TensorSpec("optim", f"state.{name}.{moment}", (numel,), torch.float32, next(seeds))
            )
        small_bytes += 3 * numel * 4

    cols = 1024
    bf16_rows = max(1, int(total * 0.06) // (cols * 2))
    int64_numel = max(1, int(total * 0.01) // 8)
    rest = max(0, total - small_bytes - bf16_rows * cols * 2 - int64_numel * 8)
    per_param = rest // 3  # each large weight has exp_avg and exp_avg_sq of its size
    big = [("embed.weight", 0.4), ("mlp.weight", 0.6)]
    big_specs: dict[str, list[TensorSpec]] = {}
    for name, share in big:
        rows = max(1, int(per_param * share) // (cols * 4))
        big_specs[name] = [
            TensorSpec(group, key, (rows, cols), torch.float32, next(seeds))
            for group, key in (
                ("model", name),
                ("optim", f"state.{name}.exp_avg"),
                ("optim", f"state.{name}.exp_avg_sq"),
            )
        ]

    # Model group first, then the optimizer, in an order a real state dict might have.
    tensors.append(big_specs["embed.weight"][0])
    tensors.extend(small_model)
    tensors.append(big_specs["mlp.weight"][0])
    tensors.append(
        TensorSpec("model", "lm_head.weight", (bf16_rows, cols), torch.bfloat16, next(seeds))
    )
    tensors.append(
        TensorSpec("model", "buffers.token_ids", (int64_numel,), torch.int64, next(seeds))
    )
    tensors.extend(big_specs["embed.weight"][1:])
    tensors.extend(small_optim)
    tensors.extend(big_specs["mlp.weight"][1:])
    objects = {
        "optim": {
            "step": 12000 + seed,
            "lr": 3.0e-4,
            "weight_decay": 0.1,
            "schedule": "cosine-with-warmup",
            "betas": [0.9, 0.999],
            "param_names": ["embed.weight", "mlp.weight", "lm_head.weight"],
        }
    }
    return StateSpec(
        f"model+optimizer, {fmt_size(total)}, {len(tensors)} tensors", tuple(tensors), objects
    )


def _tensors_spec(total: int, count: int, seed: int) -> StateSpec:
    numel = max(1, total // count // 4)
    tensors = tuple(
        TensorSpec(
            "model",
            f"t{i}" if count > 1 else "weight",
            (numel,),
            torch.float32,
            seed * 1_000_003 + 1 + i,
        )
        for i in range(count)
    )
    what = "1 tensor" if count == 1 else f"{count:,} tensors of {fmt_size(numel * 4)}"
    return StateSpec(f"{what}, {fmt_size(numel * 4 * count)} in all", tensors)


def _leaves_spec(leaves: int, seed: int) -> StateSpec:
    rng = random.Random(seed)
    n_prims = leaves // 10
    tensors = tuple(
        TensorSpec(
            "model", f"p{i}", (rng.randint(16, 256),), torch.float32, seed * 1_000_003 + 1 + i
        )
        for i in range(leaves - n_prims)
    )
    prims: dict[str, Any] = {}
    for i in range(n_prims):
        kind = i % 3
        prims[f"v{i}"] = i if kind == 0 else (i * 0.5 + 0.25 if kind == 1 else f"value-{i}")
    return StateSpec(
        f"{leaves:,} leaves ({len(tensors):,} small tensors, {n_prims:,} primitives)",
        tensors,
        {"optim": prims},
    )


# Share of the model's bytes that each rank's own state has in the ``dp`` kind.
DP_RANK_SHARE = 0.10


def _dp_spec(total: int, seed: int, rank: int, n_small: int) -> StateSpec:
    rng = random.Random(seed)
    model_seeds = iter(range(seed * 1_000_003 + 1, seed * 1_000_003 + 1_000_000))
    # Per-rank seeds in a range of their own, so no rank shares a seed with the model.
    rank_base = seed * 1_000_003 + 1_000_000 * (rank + 2)
    rank_seeds = iter(range(rank_base, rank_base + 1_000_000))
    cols = 1024
    small: list[TensorSpec] = []
    small_bytes = 0
    for i in range(n_small):
        # 4..64 KiB each (norm weights and biases); at most 1/64 of the model in all.
        numel = rng.randint(1024, 16 * 1024)
        if small_bytes + numel * 4 > total // 64:
            break
        kind = "norm.weight" if i % 2 == 0 else "bias"
        small.append(
            TensorSpec(
                "model", f"layers.{i // 2}.{kind}", (numel,), torch.float32, next(model_seeds)
            )
        )
        small_bytes += numel * 4
    n_large = 8
    rows = max(1, (total - small_bytes) // n_large // (cols * 4))
    large = [
        TensorSpec("model", f"layers.{i}.weight", (rows, cols), torch.float32, next(model_seeds))
        for i in range(n_large)
    ]
    model_bytes = small_bytes + n_large * rows * cols * 4
    moment_rows = max(1, int(model_bytes * DP_RANK_SHARE) // 2 // (cols * 4))
    optim = [
        TensorSpec("optim", f"state.{name}", (moment_rows, cols), torch.float32, next(rank_seeds))
        for name in ("exp_avg_shard", "exp_avg_sq_shard")
    ]
    # torch.get_rng_state() is a 5056-byte uint8 tensor.
    optim.append(TensorSpec("optim", "rng_state", (5056,), torch.uint8, next(rank_seeds)))
    optim.append(TensorSpec("optim", "counters", (16,), torch.int64, next(rank_seeds)))
    objects = {
        "optim": {
            "step": 12000 + seed,
            "rank": rank,
            "samples_seen": 3_072_000 + 17 * rank,
            "lr": 3.0e-4,
            "loader_position": [3, rank, 40_960 + rank],
        }
    }
    tensors = tuple(large[:1] + small + large[1:] + optim)
    return StateSpec(
        f"data-parallel rank {rank}: model {fmt_size(model_bytes)} (replicated), own state "
        f"{fmt_size(sum(t.nbytes for t in optim))}",
        tensors,
        objects,
    )


# Every size of a ``dtensors`` state divides by this: its tensors shard evenly over 1, 2, 4 ranks.
DTENSOR_SPLIT = 4


def _dtensors_spec(total: int, seed: int, n_small: int) -> StateSpec:
    rng = random.Random(seed)
    seeds = iter(range(seed * 1_000_003 + 1, seed * 1_000_003 + 1_000_000))
    cols = 1024
    small: list[TensorSpec] = []
    for i in range(n_small):
        # 4..32 KiB each, a multiple of 64 elements.
        numel = 64 * rng.randint(16, 128)
        kind = "norm.weight" if i % 2 == 0 else "bias"
        small.append(
            TensorSpec("model", f"layers.{i // 2}.{kind}", (numel,), torch.float32, next(seeds))
        )
    small_bytes = sum(t.nbytes for t in small)
    n_large = 8
    rows = (total - small_bytes) // n_large // (cols * 4) // DTENSOR_SPLIT * DTENSOR_SPLIT
    rows = max(DTENSOR_SPLIT, rows)
    large = [
        TensorSpec("model", f"layers.{i}.weight", (rows, cols), torch.float32, next(seeds))
        for i in range(n_large)
    ]
    # A weight, then its layer's small tensors, as a model's state dict orders them.
    tensors: list[TensorSpec] = []
    for i, weight in enumerate(large):
        tensors.append(weight)
        tensors.extend(t for t in small if t.name.startswith(f"layers.{i}."))
    tensors.extend(t for t in small if t not in tensors)
    return StateSpec(
        f"sharded model, {fmt_size(n_large * rows * cols * 4 + small_bytes)} of global "
        f"tensors ({n_large} weights [{rows}, {cols}], {len(small)} 1-D tensors)",
        tuple(tensors),
    )


def build_spec(args: Mapping[str, Any]) -> StateSpec:
    """The state described by ``args`` (JSON-able, passed to workers):

    ``{"kind": "model", "size": bytes, "seed": 0, "n_small": 2000}``,
    ``{"kind": "tensors", "size": bytes, "count": 20000, "seed": 0}``,
    ``{"kind": "leaves", "leaves": 10000, "seed": 0}``,
    ``{"kind": "dp", "size": bytes, "seed": 0, "rank": 0, "n_small": 192}`` (``size`` is the
    model's; other keys, such as the ``world_size`` the harness adds, are ignored),
    ``{"kind": "dtensors", "size": bytes, "seed": 0, "n_small": 24}`` (the global tensors; the
    ``world_size`` and ``layout`` the reshard case adds are ignored here).
    """
    kind = args["kind"]
    seed = int(args.get("seed", 0))
    if kind == "model":
        return _model_spec(int(args["size"]), seed, int(args.get("n_small", 2000)))
    if kind == "tensors":
        return _tensors_spec(int(args["size"]), int(args["count"]), seed)
    if kind == "leaves":
        return _leaves_spec(int(args["leaves"]), seed)
    if kind == "dp":
        return _dp_spec(
            int(args["size"]), seed, int(args.get("rank", 0)), int(args.get("n_small", 192))
        )
    if kind == "dtensors":
        return _dtensors_spec(int(args["size"]), seed, int(args.get("n_small", 24)))
    raise ValueError(f"unknown state kind {kind!r}")


# ---------------------------------------------------------------------------------------------
# Tensor contents.

# Large float tensors are filled from a random pool of this many elements, each tile scaled
# differently: ~10x faster than randn over the whole tensor, and still distinct everywhere.
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


# ---------------------------------------------------------------------------------------------
# Memory.


def _status_kib(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * KIB
    raise RuntimeError(f"{field_name} not in /proc/self/status")


def current_rss() -> int:
    return _status_kib("VmRSS")


def peak_rss() -> int:
    return _status_kib("VmHWM")


def reset_peak_rss() -> bool:
    """Resets VmHWM to the current RSS (Linux >= 4.0); False when that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    # Allow a little slack: RSS may move between the two reads.
    return peak_rss() <= current_rss() + 4 * MIB


class PeakRSS:
    """Peak RSS above the RSS at entry, for the ``with`` block.

    Uses the kernel's high-water mark after resetting it; if the reset fails, samples VmRSS in a
    thread every ``interval`` seconds instead (``method`` says which was used).
    """

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.baseline = 0
        self.peak = 0
        self.method = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakRSS:
        gc.collect()
        if reset_peak_rss():
            self.method = "VmHWM after clear_refs"
        else:
            self.method = f"VmRSS sampled every {self.interval * 1000:.0f} ms"
            self._thread = threading.Thread(target=self._sample, daemon=True)
        self.baseline = current_rss()
        self.peak = self.baseline
        if self._thread is not None:
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, current_rss())
            time.sleep(self.interval)

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, current_rss())
        else:
            self.peak = peak_rss()

    @property
    def above_baseline(self) -> int:
        return max(0, self.peak - self.baseline)


def trim_heap() -> None:
    """Collects garbage and returns the C heap's free memory to the kernel (glibc's
    ``malloc_trim(0)``), so that RSS measured next counts live memory, not what an earlier,
    untimed step (the async case's check) freed but the allocator kept."""
    gc.collect()
    try:
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim with
        pass


def proc_io() -> dict[str, int]:
    """``/proc/self/io``: rchar/wchar (bytes through read/write calls, cached or not) and
    read_bytes/write_bytes (bytes the block layer moved for this process)."""
    out: dict[str, int] = {}
    with open("/proc/self/io") as f:
        for line in f:
            key, _, value = line.partition(":")
            out[key.strip()] = int(value)
    return out


def io_delta(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in ("rchar", "wchar", "read_bytes", "write_bytes")}


# ---------------------------------------------------------------------------------------------
# Disk and page cache.


def _files(path: str) -> Iterator[str]:
    if os.path.isfile(path):
        yield path
        return
    for root, _dirs, files in os.walk(path):
        for name in files:
            yield os.path.join(root, name)


def tree_size(path: str) -> dict[str, int]:
    """Apparent bytes, allocated bytes (st_blocks) and number of files under ``path``."""
    apparent = allocated = files = 0
    for p in _files(path):
        st = os.stat(p)
        apparent += st.st_size
        allocated += st.st_blocks * 512
        files += 1
    return {"apparent": apparent, "allocated": allocated, "files": files}


def fsync_tree(path: str) -> None:
    """fsyncs every file under ``path``, then every directory (deepest first) and the parent."""
    dirs: list[str] = []
    if os.path.isdir(path):
        for root, _d, _f in os.walk(path):
            dirs.append(root)
    for p in _files(path):
        _fsync(p)
    dirs.append(os.path.dirname(os.path.abspath(path)))
    for d in reversed(dirs):
        _fsync(d)


# Free page reporting. A VM guest whose kernel reports free memory to its host (virtio-balloon)
# hands freed pages back a second or two after they are freed; the next allocation of that
# memory then faults on the host. Here that made a 2 GiB write through the page cache take
# 0.6 s right after a 2 GiB file was removed and 6-9 s a few seconds later: what the previous
# seconds freed decides the figure. ``settle_memory`` waits until the reporting has gone quiet,
# so that every timed operation starts with its memory in the same state (handed back).
_REPORTED_KIB = "/sys/module/page_reporting/parameters/reported_kib"
# Reports come in bursts about 2 s apart: this long without one means the reporting is done.
SETTLE_QUIET_SECONDS = 3.0


def reported_kib() -> int | None:
    """KiB of free memory the kernel has reported to the host so far (None: not visible)."""
    try:
        with open(_REPORTED_KIB) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def settle_memory(
    quiet: float = SETTLE_QUIET_SECONDS, limit: float = 30.0, poll: float = 0.1
) -> float | None:
    """Waits until the kernel has reported no free memory to the host for ``quiet`` seconds,
    at most ``limit`` seconds; the seconds waited, or None when this machine does not show such
    reporting."""
    last = reported_kib()
    if last is None:
        return None
    start = changed = time.monotonic()
    while True:
        now = time.monotonic()
        if now - changed >= quiet or now - start >= limit:
            return now - start
        time.sleep(poll)
        current = reported_kib()
        if current != last:
            last, changed = current, time.monotonic()


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_page_cache(path: str) -> None:
    """Evicts every file under ``path`` from the page cache: fsync (dirty pages cannot be
    dropped), then ``posix_fadvise(POSIX_FADV_DONTNEED)``. Needs no privileges."""
    for p in _files(path):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_page_cache(path: str) -> None:
    """Reads every file under ``path`` once, so that a warm restore finds it in the page cache
    whichever way it was written (statesnap's fsync'd takes write past the page cache)."""
    buf = bytearray(16 << 20)
    for p in _files(path):
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def set_page_cache(path: str, temp: str) -> None:
    """Puts the files under ``path`` in the page cache ("warm") or out of it ("cold")."""
    if temp == "cold":
        drop_page_cache(path)
    elif temp == "warm":
        warm_page_cache(path)
    else:
        raise ValueError(f"page-cache state {temp!r}: warm or cold")


_libc: ctypes.CDLL | None = None


def _libc_calls() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        libc.mmap.restype = ctypes.c_void_p
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        _libc = libc
    return _libc


def _mincore_resident(p: str) -> tuple[int, int]:
    """(resident pages, pages) of one file, from mmap(2) + mincore(2); touches no page."""
    size = os.path.getsize(p)
    if size == 0:
        return 0, 0
    libc = _libc_calls()
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    fd = os.open(p, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), p)
        try:
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(addr, size, vec) != 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err), p)
            resident = sum(b & 1 for b in vec)
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return resident, pages


def resident_fraction(path: str) -> float:
    """Fraction of the pages of the files under ``path`` that are in the page cache."""
    resident = total = 0
    for p in _files(path):
        r, n = _mincore_resident(p)
        resident += r
        total += n
    return resident / total if total else 0.0


# ---------------------------------------------------------------------------------------------
# Processes.


def reap(proc: subprocess.Popen[Any], timeout: float = 5.0) -> None:
    """Waits for ``proc``, which was killed or told to exit. A signal handler that raises inside
    ``Popen.poll()`` (Ctrl-C, or SIGTERM turned into SystemExit) can leave ``Popen``'s internal
    wait lock held, after which ``proc.wait()`` blocks for ever; so after ``timeout`` seconds
    the process is reaped with ``os.waitpid`` directly."""
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        try:
            _pid, status = os.waitpid(proc.pid, 0)
        except ChildProcessError:  # reaped meanwhile
            return
        proc.returncode = os.waitstatus_to_exitcode(status)


# ---------------------------------------------------------------------------------------------
# Machine description.


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def library_commit(repo: str) -> str:
    """Short commit of the library checkout, with ``+dirty`` when its library code has changes
    not committed (the benchmarks directory itself is not counted)."""
    try:
        head = subprocess.run(
            ["git", "-C", repo, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            [
                "git",
                "-C",
                repo,
                "status",
                "--porcelain",
                "--",
                "snapshot",
                "storage_plugins",
                "manifest",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def machine_description(directory: str) -> list[str]:
    """Markdown bullet lines: CPU, cores, RAM, kernel, filesystem of ``directory``, versions."""
    cpuinfo = _read("/proc/cpuinfo")
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
    meminfo = _read("/proc/meminfo")
    mem = re.search(r"^MemTotal:\s*(\d+) kB", meminfo, re.M)
    swap = re.search(r"^SwapTotal:\s*(\d+) kB", meminfo, re.M)
    lines = [
        f"- CPU: {model.group(1).strip() if model else platform.processor() or 'unknown'}, "
        f"{os.cpu_count()} logical cores (torch uses {torch.get_num_threads()} threads)",
        f"- RAM: {fmt_size(int(mem.group(1)) * KIB) if mem else 'unknown'}, swap "
        f"{fmt_size(int(swap.group(1)) * KIB) if swap else 'unknown'}",
        f"- kernel: {platform.release()}",
    ]
    try:
        df = (
            subprocess.run(
                ["df", "-T", "-h", directory], capture_output=True, text=True, check=True
            )
            .stdout.splitlines()[-1]
            .split()
        )
        lines.append(f"- scratch dir {directory}: {df[1]} on {df[0]}, {df[2]} in all, {df[4]} free")
    except (OSError, subprocess.CalledProcessError, IndexError):
        lines.append(f"- scratch dir {directory}: filesystem unknown")
    versions = [f"Python {platform.python_version()}", f"torch {torch.__version__}"]
    for name in ("safetensors", "torchsnapshot", "numpy"):
        try:
            from importlib.metadata import version

            versions.append(f"{name} {version(name)}")
        except Exception:
            versions.append(f"{name} not installed")
    lines.append("- " + ", ".join(versions))
    reported = reported_kib()
    if reported is not None:
        lines.append(
            f"- free page reporting: on ({fmt_size(reported * KIB)} handed back to the host so "
            "far): memory freed a few seconds ago costs host faults when allocated again"
        )
    return lines


# ---------------------------------------------------------------------------------------------
# Self-check: does the peak reset work here, does the page-cache drop work here?


def _read_speed(path: str, buf: memoryview) -> float:
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        pos = 0
        while pos < len(buf):
            n = f.readinto(buf[pos:])
            if not n:
                break
            pos += n
    return len(buf) / (time.perf_counter() - t0) / 1e9


def self_check(directory: str, nbytes: int = 512 * MIB) -> list[str]:
    """Verifies the measuring tools on this machine; returns markdown bullet lines."""
    lines: list[str] = []
    # 1. Peak RSS reset.
    before = peak_rss()
    blob = torch.ones(256 * MIB // 4)
    grown = peak_rss()
    del blob
    gc.collect()
    ok = reset_peak_rss()
    after = peak_rss()
    lines.append(
        f"- peak-RSS reset (`echo 5 > /proc/self/clear_refs`): "
        f"{'works' if ok else 'does NOT work (the harness samples VmRSS instead)'}: VmHWM "
        f"{fmt_size(before)} -> {fmt_size(grown)} after touching 256 MiB -> {fmt_size(after)} "
        f"after freeing it and resetting"
    )
    # 2. Page-cache drop.
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"cache-check-{os.getpid()}.bin")
    try:
        data = torch.empty(nbytes, dtype=torch.uint8)
        data.random_(0, 256, generator=torch.Generator().manual_seed(0))
        buf = writable_buffer(data)
        with open(path, "wb") as f:
            f.write(buf)
        fsync_tree(path)
        warm = [_read_speed(path, buf) for _ in range(2)]
        res_warm = resident_fraction(path)
        cold = []
        res_cold = []
        for _ in range(2):
            drop_page_cache(path)
            res_cold.append(resident_fraction(path))
            cold.append(_read_speed(path, buf))
        lines.append(
            f"- page-cache drop (fsync + `posix_fadvise(DONTNEED)`): "
            f"{'works' if max(res_cold) < 0.01 and min(warm) > 1.3 * max(cold) else 'UNCLEAR'}"
            f": {fmt_size(nbytes)} file, resident {res_warm:.0%} before / "
            f"{max(res_cold):.0%} after the drop (mincore); read into preallocated memory "
            f"{min(warm):.2f}-{max(warm):.2f} GB/s warm vs {min(cold):.2f}-{max(cold):.2f} GB/s "
            f"after the drop"
        )
    finally:
        if os.path.exists(path):
            os.remove(path)
    return lines


def describe_spec(spec: StateSpec) -> str:
    """One line: the state's bytes by dtype and tensor-size class, and its objects."""
    by_kind: dict[str, list[int]] = {}
    for t in spec.tensors:
        size_class = "small" if t.nbytes <= 64 * KIB else "large"
        by_kind.setdefault(f"{size_class} {str(t.dtype).removeprefix('torch.')}", []).append(
            t.nbytes
        )
    parts = [f"{len(v):,} {k} ({fmt_size(sum(v))})" for k, v in by_kind.items()]
    if spec.objects:
        parts.append(f"{spec.n_objects} Python objects")
    return f"{spec.description}: " + ", ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description="Checks the harness's measuring tools here.")
    parser.add_argument("--dir", default="/tmp/statesnap-bench", help="scratch directory")
    parser.add_argument(
        "--describe",
        action="store_true",
        help="print only the machine description and the state layouts",
    )
    args = parser.parse_args()
    created = not os.path.isdir(args.dir)
    os.makedirs(args.dir, exist_ok=True)
    try:
        for line in machine_description(args.dir):
            print(line)
        if args.describe:
            for size in (512 * MIB, 2 * GIB):
                print("- " + describe_spec(build_spec({"kind": "model", "size": size})))
            return
        for line in self_check(args.dir):
            print(line)
    finally:
        if created:
            os.rmdir(args.dir)


if __name__ == "__main__":
    main()
