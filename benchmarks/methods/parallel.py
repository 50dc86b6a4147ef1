"""Real parallel training jobs (the parallel-2d case): a small MLP with AdamW, wrapped by
torch's parallelism APIs on a CPU device mesh, and its state saved and loaded through the
Stateful an FSDP2 / TP job writes (``get_state_dict`` / ``set_state_dict``, DTensors kept) by
statesnap and by DCP.

A layout is ``<kind>:<shape>``:

``fsdp-tp:DxT``  a 2-D mesh ("dp", "tp"): fc1 ``ColwiseParallel``, fc2 ``RowwiseParallel`` on
                 "tp", then ``fully_shard`` over "dp" (the head, then the root); the head is
                 FSDP only, a DTensor on the "dp" submesh (replicated across "tp").
``hsdp:RxS``     ``fully_shard`` on a 2-D mesh ("replicate", "shard"): HSDP.
``fsdp:N``       ``fully_shard`` on a 1-D mesh of N ranks.
``plain:1``      no wrapping, one rank: plain tensors.

Values: every parameter and AdamW moment is a piece of a global tensor drawn from a generator
seeded by the job's seed and the tensor's name (``step`` is set to ``STEP``), so any layout
can build its pieces and check what a restore left, bitwise (``full_tensor()`` of each).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

STEP = 7.0


@dataclass(frozen=True)
class Layout:
    kind: str
    shape: tuple[int, ...]

    @classmethod
    def parse(cls, text: str) -> Layout:
        kind, _, shape = text.partition(":")
        if kind not in ("fsdp-tp", "hsdp", "fsdp", "plain"):
            raise ValueError(f"unknown layout kind {kind!r} in {text!r}")
        dims = tuple(int(d) for d in shape.split("x"))
        if len(dims) != (2 if kind in ("fsdp-tp", "hsdp") else 1):
            raise ValueError(f"layout {text!r}: wrong number of mesh dimensions")
        return cls(kind, dims)

    @property
    def world(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class MLP(torch.nn.Module):
    def __init__(self, dim: int, hidden: int, out: int) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(dim, hidden)
        self.fc2 = torch.nn.Linear(hidden, dim)
        self.head = torch.nn.Linear(dim, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc2(torch.relu(self.fc1(x))))


def model_bytes(dim: int) -> int:
    """Bytes of the parameters and AdamW moments of ``MLP(dim, 2 * dim, dim)``."""
    params = 2 * dim * 2 * dim + 2 * dim + dim + dim * dim + dim
    return 3 * 4 * params


def build(layout: Layout, dim: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model of ``layout`` on the ranks of the default group, with its AdamW state made
    (one step with zero gradients)."""
    torch.manual_seed(0)
    model = MLP(dim, 2 * dim, dim)
    if layout.kind != "plain":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if layout.kind == "fsdp-tp":
            from torch.distributed.tensor.parallel import (
                ColwiseParallel,
                RowwiseParallel,
                parallelize_module,
            )

            mesh = init_device_mesh("cpu", layout.shape, mesh_dim_names=("dp", "tp"))
            parallelize_module(
                model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
            )
            fully_shard(model.head, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
        elif layout.kind == "hsdp":
            mesh = init_device_mesh("cpu", layout.shape, mesh_dim_names=("replicate", "shard"))
            fully_shard(model.head, mesh=mesh)
            fully_shard(model, mesh=mesh)
        else:
            mesh = init_device_mesh("cpu", layout.shape)
            fully_shard(model.head, mesh=mesh)
            fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optim.step()
    optim.zero_grad(set_to_none=True)
    return model, optim


def _values(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """name -> each parameter and AdamW moment (this rank's DTensor or plain tensor)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        out[name] = p
        for moment, value in optim.state[p].items():
            out[f"{name}.{moment}"] = value
    return out


def _full(seed: int, name: str, shape: torch.Size) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=g)


def fill(model: torch.nn.Module, optim: torch.optim.Optimizer, seed: int) -> None:
    """Sets every value to its piece of the global tensor of ``seed`` (``step``: STEP)."""
    with torch.no_grad():
        for name, value in _values(model, optim).items():
            if name.endswith(".step"):
                value.fill_(STEP)
                continue
            full = _full(seed, name, value.shape)
            if hasattr(value, "device_mesh"):
                from torch.distributed.tensor import distribute_tensor

                piece = distribute_tensor(full, value.device_mesh, value.placements)
                value.to_local().copy_(piece.to_local())
            else:
                value.copy_(full)


def zero(model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    """Every value zeroed, so a restore that leaves one untouched is caught."""
    with torch.no_grad():
        for value in _values(model, optim).values():
            local = value.to_local() if hasattr(value, "to_local") else value
            local.zero_()


def check(model: torch.nn.Module, optim: torch.optim.Optimizer, seed: int) -> dict[str, Any]:
    """Each value's full tensor against the global tensor of ``seed``, bitwise."""
    values = _values(model, optim)
    bad = []
    for name, value in values.items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        want = (
            torch.full_like(full, STEP) if name.endswith(".step") else _full(seed, name, full.shape)
        )
        if not torch.equal(full, want):
            bad.append(name)
    if bad:
        return {"ok": False, "detail": f"{len(bad)} of {len(values)} values differ: {bad[:4]}"}
    return {"ok": True, "detail": f"ok ({len(values)} values bitwise)"}


class AppState:
    """The Stateful of an FSDP2 / TP job: its model and optimizer state as DTensors."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )


def _ss_save(app: AppState, path: str) -> None:
    from snapshot import Snapshot

    Snapshot.take(path, {"app": app})


def _ss_load(app: AppState, path: str) -> None:
    from snapshot import Snapshot

    Snapshot(path).restore({"app": app})


def _dcp_save(app: AppState, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"app": app}, checkpoint_id=path)


def _dcp_load(app: AppState, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.load({"app": app}, checkpoint_id=path)


@dataclass(frozen=True)
class ParallelMethod:
    name: str
    save: Callable[[AppState, str], None]
    load: Callable[[AppState, str], None]
    note: str


PARALLEL_METHODS = {
    m.name: m
    for m in (
        ParallelMethod(
            "statesnap",
            _ss_save,
            _ss_load,
            'Snapshot.take(path, {"app": AppState}) / Snapshot(path).restore({"app": '
            "AppState}) on every rank, defaults (fsync'd)",
        ),
        ParallelMethod(
            "dcp",
            _dcp_save,
            _dcp_load,
            'dcp.save({"app": AppState}, checkpoint_id=dir) / dcp.load(...) on every rank, '
            "default planner, FileSystemWriter defaults (sync_files=True)",
        ),
    )
}
