"""Generated states, described without their memory: sizes, :class:`StateSpec` and the kinds
of state the cases use (:func:`build_spec`), and a one-line description of a spec."""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
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
