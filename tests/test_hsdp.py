"""HSDP: FSDP2 on a 2x2 mesh (replicate x shard), model and AdamW state taken on 4 ranks and
restored on a 1-D FSDP2 mesh of 4 ranks, on the 2x2 mesh again, and on 1 rank holding a plain
model.

Each parameter and moment is a DTensor placed ``(Replicate(), Shard(0))``: each piece is held
by the two ranks of its replica dimension. After the restore the full model and optimizer
state equal, bitwise, the full state gathered at the take (``get_state_dict`` with
``full_state_dict=True``, saved with ``torch.save``); and three more steps' losses equal those
of the same layout given that full state by torch itself (``set_state_dict``), so the restored
job trains as one that never went through the snapshot (on the 2x2 mesh: as the job that took
it and went on). Real processes joined by gloo on the
CPU (tests/multirank.py); the 1-rank side runs in the test's own process.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import Replicate, Shard

from manifest import ShardedTensorEntry
from snapshot import Snapshot
from tests.helpers import ModelAndOptimizer, full_state, train_step
from tests.multirank import run_ranks

pytestmark = pytest.mark.slow  # 4-rank launches (gloo) on the CPU

STEPS_BEFORE, STEPS_AFTER = 2, 3
FULL = StateDictOptions(full_state_dict=True)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _build(layout: str, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model sharded by ``layout`` ("hsdp": a 2x2 replicate x shard mesh, "fsdp": a 1-D
    mesh over every rank, "plain": not wrapped), and its AdamW."""
    warnings.filterwarnings("ignore", category=UserWarning)
    model = _model(seed)
    if layout != "plain":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        world = torch.distributed.get_world_size()
        if layout == "hsdp":
            mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh("cpu", (world,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def _step(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int, rank: int) -> float:
    return train_step(model, optim, _batch(step, rank))


def _assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            other = got[key]
            assert other.dtype == value.dtype and other.shape == value.shape, key
            assert torch.equal(other, value), key  # bitwise
        else:
            assert got[key] == value, key


def _restored_and_reference(
    layout: str, path: str, reference: dict[str, Any], rank: int
) -> dict[str, Any]:
    """Restores a fresh model of ``layout`` from the snapshot, and gives another the full
    state at the take through torch's own ``set_state_dict``; trains both on. The restored
    full state, and both runs' losses."""
    model, optim = _build(layout, seed=1)
    Snapshot(path).restore({"train": ModelAndOptimizer(model, optim)})
    restored = full_state(model, optim)
    ref_model, ref_optim = _build(layout, seed=2)
    model_sd = {k[len("model/") :]: v for k, v in reference.items() if k.startswith("model/")}
    optim_sd: dict[str, Any] = {"state": {}, "param_groups": reference["param_groups"]}
    for k, v in reference.items():
        if k.startswith("optim/") and not k.startswith("optim/param_groups/"):
            fqn, name = k[len("optim/") :].rsplit("/", 1)
            optim_sd["state"].setdefault(fqn, {})[name] = v.clone()
    set_state_dict(
        ref_model, ref_optim, model_state_dict=model_sd, optim_state_dict=optim_sd, options=FULL
    )
    after = [STEPS_BEFORE + i for i in range(STEPS_AFTER)]
    return {
        "restored": restored,
        "losses": [_step(model, optim, step, rank) for step in after],
        "reference": [_step(ref_model, ref_optim, step, rank) for step in after],
    }


def _take(rank: int, world: int, path: str, out: str) -> list[float]:
    model, optim = _build("hsdp", seed=0)
    weight = model[0].weight
    assert weight.placements == (Replicate(), Shard(0)), weight.placements
    for step in range(STEPS_BEFORE):
        _step(model, optim, step, rank)
    Snapshot.take(path, {"train": ModelAndOptimizer(model, optim)})
    taken = full_state(model, optim)
    _, optim_sd = get_state_dict(model, optim, options=FULL)
    if rank == 0:
        torch.save({**taken, "param_groups": optim_sd["param_groups"]}, out)
    return [_step(model, optim, STEPS_BEFORE + i, rank) for i in range(STEPS_AFTER)]


def _restore(rank: int, world: int, path: str, out: str) -> None:
    reference = torch.load(out, weights_only=False)
    for layout in ("fsdp", "hsdp"):
        found = _restored_and_reference(layout, path, reference, rank)
        torch.save(found, f"{out}.{layout}{rank}")


def test_hsdp_restores_on_a_1d_mesh_and_on_one_rank(tmp_path):
    path, out = str(tmp_path / "snap"), str(tmp_path / "full.pt")
    uninterrupted = run_ranks(4, _take, path, out)
    reference = torch.load(out, weights_only=False)
    taken = {k: v for k, v in reference.items() if k != "param_groups"}
    weight = Snapshot(path).get_manifest()["0/train/model/0.weight"]
    assert isinstance(weight, ShardedTensorEntry) and weight.shape == (16, 8)
    assert sorted(s.offsets for s in weight.shards) == [(0, 0), (8, 0)]  # each piece once
    # Each piece is held by both replica groups; the writes spread over all four ranks.
    writers = {
        c.blob.split("/")[0]
        for e in Snapshot(path).get_manifest().values()
        if isinstance(e, ShardedTensorEntry)
        for s in e.shards
        for c in s.chunks
    }
    assert writers == {"0", "1", "2", "3"}

    # A 1-D mesh of 4 ranks, and the 2x2 mesh again (in one launch).
    run_ranks(4, _restore, path, out)
    for layout, rank in [(layout, rank) for layout in ("fsdp", "hsdp") for rank in range(4)]:
        found = torch.load(f"{out}.{layout}{rank}", weights_only=False)
        _assert_same(found["restored"], taken)
        assert found["losses"] == found["reference"], (layout, rank)
        if layout == "hsdp":  # the run that took the snapshot and went on
            assert found["losses"] == uninterrupted[rank], rank

    # One rank, a plain model.
    found = _restored_and_reference("plain", path, reference, 0)
    _assert_same(found["restored"], taken)
    assert found["losses"] == found["reference"]
