"""FSDP2 x TP (real processes, gloo, CPU): a small MLP with fc1 ColwiseParallel and fc2
RowwiseParallel on the "tp" dimension of a 2x2 ("dp", "tp") mesh, then ``fully_shard`` over
"dp" (which makes ``_StridedShard`` placements), and a head left out of the TP plan, sharded by
``fully_shard`` alone on the "dp" submesh (so identical on both tp ranks). Trained with AdamW a
couple of steps, taken through torch's ``get_state_dict`` (DTensors kept), and restored on
2x2, 4x1, 1x2, 2x1, a 1-D FSDP2 mesh of 2 ranks and 1 rank without parallelism.

Dimensions (6 -> 10 -> 6 -> 3) are not divisible by the mesh sizes: the shards are uneven.

After each restore, the full model and optimizer state equal, bitwise, the full state gathered
at the take; three more steps' losses then equal those of the same layout run uninterrupted
from that state: the losses of the take's own run on 2x2, and, on the other layouts, those of
the same layout given the full state at the take through torch's ``set_state_dict``
(``full_state_dict=True``). A layout's losses differ from another layout's in the last bits
(TP's Rowwise sums partial products in another order), so layouts are not compared with each
other.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch

from manifest import ShardedTensorEntry
from snapshot import Options, Snapshot, StateDict
from tests.helpers import ModelAndOptimizer, train_step
from tests.multirank import run_ranks

pytestmark = pytest.mark.slow  # 4 ranks for the take (about 15 s on a quiet machine)

STEPS_BEFORE, STEPS_AFTER = 2, 3


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 10)
        self.fc2 = torch.nn.Linear(10, 6)
        self.head = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same data on every rank (every layout then trains the same model)."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def _build(layout: str, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model in ``layout``: "DPxTP" (a 2-D mesh), "fsdp" (FSDP2 on a 1-D mesh of every
    rank) or "plain" (one rank, no parallelism); and its AdamW."""
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.manual_seed(seed)
    model = MLP()
    if layout == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        for m in (model.fc1, model.fc2, model.head, model):
            fully_shard(m, mesh=mesh)
    elif layout != "plain":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        dp, tp = (int(n) for n in layout.split("x"))
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
        parallelize_module(model, mesh["tp"], plan)
        for m in (model.fc1, model.fc2, model.head, model):
            fully_shard(m, mesh=mesh["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _full(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer value, whole (on every rank), by a flat name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    opts = StateDictOptions(full_state_dict=True)
    model_sd, optim_sd = get_state_dict(model, optim, options=opts)
    out = {f"model/{k}": v.detach().clone() for k, v in model_sd.items()}
    for fqn, state in optim_sd["state"].items():
        for name, value in state.items():
            out[f"optim/{fqn}/{name}"] = torch.as_tensor(value).detach().clone()
    return out


def _load_full(model: torch.nn.Module, optim: torch.optim.Optimizer, full: dict) -> None:
    """The full state ``full`` (as ``_full`` made it) given to the model through torch."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    model_sd = {k[len("model/") :]: v.clone() for k, v in full.items() if k.startswith("model/")}
    state: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in full.items():
        if k.startswith("optim/"):
            fqn, name = k[len("optim/") :].rsplit("/", 1)
            state.setdefault(fqn, {})[name] = v.clone()
    _, optim_sd = _state_dicts(model, optim, full_state_dict=True)
    optim_sd = {"state": state, "param_groups": optim_sd["param_groups"]}
    set_state_dict(
        model,
        optim,
        model_state_dict=model_sd,
        optim_state_dict=optim_sd,
        options=StateDictOptions(full_state_dict=True),
    )


def _state_dicts(model: torch.nn.Module, optim: torch.optim.Optimizer, **kw: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, optim, options=StateDictOptions(**kw))


def _step(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int) -> float:
    return train_step(model, optim, _batch(step))


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Bitwise equal, every entry."""
    assert got.keys() == want.keys()
    for key, value in want.items():
        other = got[key]
        assert other.dtype == value.dtype and other.shape == value.shape, key
        assert torch.equal(other, value), key  # no tolerance


def _refusals(rank: int, path: str) -> list[str]:
    """The take's messages for a Partial DTensor and for a ``_StridedShard`` layout whose
    pieces are not boxes (rows {0, 2}, {1, 3}, {4, 6}, {5, 7} of 8), on a 2x2 mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    partial = DTensor.from_local(torch.ones(4), mesh, [Partial(), Replicate()])
    strided = DTensor.from_local(
        torch.zeros(2, 3),
        mesh,
        [Shard(0), _StridedShard(0, split_factor=2)],
        shape=torch.Size((8, 3)),
        stride=(3, 1),
    )
    messages = []
    for name, value in (("partial", partial), ("strided", strided)):
        try:
            Snapshot.take(f"{path}-{name}", {"s": StateDict(x=value)})
        except Exception as e:  # the message is what is checked
            messages.append(str(e))
        else:
            messages.append("")
    return messages


def _train_and_take(rank: int, world: int, path: str, out: str) -> dict[str, Any]:
    """The run on 2x2: a couple of steps, the take, more steps (and, fresh, a restore on 2x2
    that continues the same way). Rank 0 saves the full state at the take."""
    model, optim = _build("2x2", seed=0)
    for step in range(STEPS_BEFORE):
        _step(model, optim, step)
    Snapshot.take(path, {"app": ModelAndOptimizer(model, optim)})
    taken = _full(model, optim)
    if rank == 0:
        torch.save(taken, os.path.join(out, "taken.pt"))
    losses = [_step(model, optim, STEPS_BEFORE + i) for i in range(STEPS_AFTER)]
    # Restored on 2x2, into another initialisation.
    model, optim = _build("2x2", seed=1)
    Snapshot(path).restore({"app": ModelAndOptimizer(model, optim)})
    _assert_same(_full(model, optim), taken)
    again = [_step(model, optim, STEPS_BEFORE + i) for i in range(STEPS_AFTER)]
    assert again == losses, (again, losses)
    return {"losses": losses, "refused": _refusals(rank, path)}


def _restore(rank: int, world: int, layout: str, path: str, out: str) -> list[float]:
    """Restores in ``layout`` (in place, within a memory budget smaller than a tensor), checks
    the full state against the one at the take, and that three more steps go as in the same
    layout given that full state through torch."""
    taken = torch.load(os.path.join(out, "taken.pt"))
    model, optim = _build(layout, seed=1)
    app = ModelAndOptimizer(model, optim)
    before = {k: v for k, v in app.state_dict()["model"].items()}
    # A budget smaller than the largest tensor (240 bytes): regions are read piece by piece.
    Snapshot(path).restore({"app": app}, options=Options(memory_budget_bytes=128))
    after = app.state_dict()["model"]
    for k, v in before.items():  # in place: the same local tensors, now filled
        local = v.to_local() if hasattr(v, "to_local") else v
        new = after[k].to_local() if hasattr(after[k], "to_local") else after[k]
        assert local.data_ptr() == new.data_ptr(), k
    _assert_same(_full(model, optim), taken)
    losses = [_step(model, optim, STEPS_BEFORE + i) for i in range(STEPS_AFTER)]
    model, optim = _build(layout, seed=2)
    _load_full(model, optim, taken)
    want = [_step(model, optim, STEPS_BEFORE + i) for i in range(STEPS_AFTER)]
    assert losses == want, (losses, want)
    return losses


@pytest.fixture(scope="module")
def taken(tmp_path_factory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("parallel_2d")
    path = str(root / "snap")
    results = run_ranks(4, _train_and_take, path, str(root))
    return {"path": path, "root": str(root), "results": results}


def test_fsdp_tp_restores_on_the_same_mesh_and_continues_bitwise(taken):
    # The take's own run and a fresh restore on 2x2 give the same losses (checked on each
    # rank); every rank of the run saw the same losses.
    losses = [r["losses"] for r in taken["results"]]
    assert all(lo == losses[0] for lo in losses)


def test_strided_shards_and_the_submesh_head_are_stored_once(taken):
    manifest = Snapshot(taken["path"]).get_manifest()
    for name, shape in (("fc1.weight", (10, 6)), ("head.weight", (3, 6)), ("fc2.weight", (6, 10))):
        entry = manifest[f"0/app/model/{name}"]
        assert isinstance(entry, ShardedTensorEntry) and entry.shape == shape, name
        for rank in range(1, 4):
            assert manifest[f"{rank}/app/model/{name}"] == entry
        stored = sum(c.nbytes for s in entry.shards for c in s.chunks)
        assert stored == 4 * shape[0] * shape[1], name  # each element once
    # The head: two pieces (uneven, 2 and 1 rows), written by the ranks at tp coordinate 0
    # (ranks 0 and 2) only, the lower rank of each pair of copies.
    head = manifest["0/app/model/head.weight"]
    assert sorted(s.sizes for s in head.shards) == [(1, 6), (2, 6)]
    assert {c.blob.split("/")[0] for s in head.shards for c in s.chunks} == {"0", "2"}
    moment = manifest["0/app/optim/state/head.weight/exp_avg"]
    assert sum(c.nbytes for s in moment.shards for c in s.chunks) == 4 * 3 * 6


def test_partial_and_strided_layouts_that_are_not_boxes_are_refused(taken):
    for result in taken["results"]:
        partial, strided = result["refused"]
        assert "s/x: a DTensor with placement P(sum)" in partial
        assert "reduce it first" in partial and "redistribute" in partial
        assert "placements (S(0), _S(0, 2)) on a mesh of shape [2, 2]" in strided
        assert "a rank's local piece is not one box of the tensor" in strided
        assert "redistribute it to Shard / Replicate placements first" in strided


@pytest.mark.parametrize(
    ("world", "layout"), [(4, "4x1"), (2, "1x2"), (2, "2x1"), (2, "fsdp"), (1, "plain")]
)
def test_fsdp_tp_restores_on_other_meshes(taken, world, layout):
    losses = run_ranks(world, _restore, layout, taken["path"], taken["root"])
    assert all(lo == losses[0] for lo in losses)
