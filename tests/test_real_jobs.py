"""Real training jobs (real processes, gloo, CPU): FSDP2 (``fully_shard``, DTensors) and FSDP1
(``FullyShardedDataParallel`` with ``SHARDED_STATE_DICT``, torch's ShardedTensors), model and
Adam state through the library with its defaults, taken on 2 ranks and restored on 1, 2 and 4.

On 2 ranks, training continues bitwise: the losses and parameters of the steps after a restore
in a fresh job equal those of the run that was never interrupted. On 1 and 4 ranks, the full
parameters and optimizer state after the restore equal those at the take.

The parameters and Adam moments are pieces of global tensors, readable by any rank. Restoring
the optimizer on 4 ranks also needs its values that are the same on every rank but not sharded
(FSDP's 0-d ``step`` tensors, ``param_groups``) to be readable by the two ranks the snapshot did
not have: the take stores values equal on every rank once, for any rank (without that, the
restore fails with "rank 2 has no state of its own"; the model alone restores either way).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch

from manifest import ShardedTensorEntry
from snapshot import Snapshot
from tests.helpers import train_step
from tests.multirank import run_ranks

pytestmark = pytest.mark.slow  # real processes (gloo); -m 'not slow' skips them

STEPS_BEFORE, STEPS_AFTER = 3, 2


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _build(kind: str, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model wrapped by FSDP of ``kind`` over every rank, and its Adam optimizer."""
    warnings.filterwarnings("ignore", category=FutureWarning)  # FSDP1 and ShardedTensor
    warnings.filterwarnings("ignore", category=UserWarning)
    model = _model(seed)
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        # On the CPU: device_id names it (without it FSDP1 raises "FSDP needs a non-CPU
        # accelerator device" on a machine without one).
        model = FSDP(model, device_id=torch.device("cpu"))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


class _Model:
    """A model as a Stateful. FSDP2's through torch.distributed.checkpoint's
    ``get_model_state_dict`` / ``set_model_state_dict`` (DTensors); FSDP1's through
    ``SHARDED_STATE_DICT`` (torch ShardedTensors)."""

    def __init__(self, kind: str, model: torch.nn.Module) -> None:
        self.kind, self.model = kind, model

    def state_dict(self) -> dict[str, Any]:
        if self.kind == "fsdp2":
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            return get_model_state_dict(self.model)
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import StateDictType

        with FSDP.state_dict_type(self.model, StateDictType.SHARDED_STATE_DICT):
            return self.model.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.kind == "fsdp2":
            from torch.distributed.checkpoint.state_dict import set_model_state_dict

            set_model_state_dict(self.model, state)
            return
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import StateDictType

        with FSDP.state_dict_type(self.model, StateDictType.SHARDED_STATE_DICT):
            self.model.load_state_dict(state)


class _Optim:
    """An optimizer as a Stateful, through ``get_optimizer_state_dict`` /
    ``set_optimizer_state_dict`` (DTensors under FSDP2, torch ShardedTensors under FSDP1's
    sharded state dict), which also give a fresh optimizer the state to restore into."""

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.optim)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.optim, state)


def _app_state(kind: str, model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict:
    return {"model": _Model(kind, model), "optim": _Optim(model, optim)}


def _step(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int, rank: int) -> float:
    return train_step(model, optim, _batch(step, rank))


def _full(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """Every parameter and every optimizer value, gathered whole (on every rank)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(
        model, optim, options=StateDictOptions(full_state_dict=True)
    )
    out = {f"model/{k}": v.detach().clone() for k, v in model_sd.items()}
    for fqn, state in optim_sd["state"].items():
        for name, value in state.items():
            out[f"optim/{fqn}/{name}"] = value.detach().clone()
    return out


def _train_and_take(rank: int, world: int, kind: str, path: str, out: str) -> list[float]:
    """The uninterrupted run: a few steps, the take, more steps. Rank 0 saves the full state
    at the take and at the end; each rank returns its losses after the take."""
    model, optim = _build(kind, seed=0)
    for step in range(STEPS_BEFORE):
        _step(model, optim, step, rank)
    Snapshot.take(path, _app_state(kind, model, optim))
    taken = _full(model, optim)
    losses = [_step(model, optim, STEPS_BEFORE + i, rank) for i in range(STEPS_AFTER)]
    final = _full(model, optim)
    if rank == 0:
        torch.save({"taken": taken, "final": final}, os.path.join(out, f"{kind}.pt"))
    return losses


def _restore_and_continue(
    rank: int, world: int, kind: str, path: str, keys: list[str], out: str
) -> None:
    """A fresh job (another initialisation): restores the app_state ``keys``, then runs the
    steps after the take. Saves this rank's losses, and the full state right after the
    restore and at the end. (Saved to a file: tensors sent back through the result queue would
    live in the shared memory of a process that has exited.)"""
    model, optim = _build(kind, seed=1)
    app_state = _app_state(kind, model, optim)
    Snapshot(path).restore({k: app_state[k] for k in keys})
    restored = _full(model, optim)
    losses = [_step(model, optim, STEPS_BEFORE + i, rank) for i in range(STEPS_AFTER)]
    found = {"losses": losses, "restored": restored, "final": _full(model, optim)}
    torch.save(found, os.path.join(out, f"{kind}-{world}-{rank}.pt"))


def _restored(
    tmp_path, kind: str, world: int, path: str, keys: tuple[str, ...] = ("model", "optim")
) -> list[dict[str, Any]]:
    """Each rank's ``_restore_and_continue`` on ``world`` ranks."""
    run_ranks(world, _restore_and_continue, kind, path, list(keys), str(tmp_path))
    return [torch.load(tmp_path / f"{kind}-{world}-{rank}.pt") for rank in range(world)]


def _assert_same(got: dict[str, Any], want: dict[str, Any], prefix: str = "") -> None:
    """Bitwise equal, in the entries whose keys start with ``prefix``."""
    want = {k: v for k, v in want.items() if k.startswith(prefix)}
    got = {k: v for k, v in got.items() if k.startswith(prefix)}
    assert got.keys() == want.keys() and want
    for key, value in want.items():
        other = got[key]
        assert other.dtype == value.dtype and other.shape == value.shape, key
        assert torch.equal(other, value), key  # bitwise: no tolerance


@pytest.fixture(scope="module")
def taken(tmp_path_factory) -> dict[str, Any]:
    """For each FSDP kind, a snapshot taken on 2 ranks, the uninterrupted run's losses after
    it, and its full state at the take and at the end."""
    root = tmp_path_factory.mktemp("real_jobs")
    found = {}
    for kind in ("fsdp2", "fsdp1"):
        path = str(root / kind)
        losses = run_ranks(2, _train_and_take, kind, path, str(root))
        found[kind] = {"path": path, "losses": losses, **torch.load(root / f"{kind}.pt")}
    return found


@pytest.mark.parametrize("kind", ["fsdp2", "fsdp1"])
def test_sharded_state_is_stored_as_pieces(taken, kind):
    # FSDP2's parameters and Adam moments are DTensors, FSDP1's torch ShardedTensors: every
    # one is stored as pieces of its global tensor (the same entry under both ranks), none
    # pickled.
    manifest = Snapshot(taken[kind]["path"]).get_manifest()
    weight = manifest["0/model/0.weight"]
    assert isinstance(weight, ShardedTensorEntry) and weight.shape == (16, 8)
    assert manifest["1/model/0.weight"] == weight
    assert sum(s.sizes[0] for s in weight.shards) == 16
    moments = [p for p in manifest if p.startswith("0/optim/state/") and "exp_avg" in p]
    assert len(moments) == 8 and all(isinstance(manifest[p], ShardedTensorEntry) for p in moments)


@pytest.mark.parametrize("kind", ["fsdp2", "fsdp1"])
def test_training_continues_bitwise_on_two_ranks(taken, kind, tmp_path):
    found = taken[kind]
    for rank, result in enumerate(_restored(tmp_path, kind, 2, found["path"])):
        _assert_same(result["restored"], found["taken"])
        assert result["losses"] == found["losses"][rank], rank
        _assert_same(result["final"], found["final"])


@pytest.mark.parametrize("world", [1, 4])
@pytest.mark.parametrize("kind", ["fsdp2", "fsdp1"])
def test_restored_on_another_world_size(taken, kind, world, tmp_path):
    found = taken[kind]
    for result in _restored(tmp_path, kind, world, found["path"]):
        _assert_same(result["restored"], found["taken"])
    # Whole, as any reader sees it.
    snap = Snapshot(found["path"])
    assert torch.equal(snap.read_object("0/model/2.weight"), found["taken"]["model/2.weight"])


@pytest.mark.parametrize("kind", ["fsdp2", "fsdp1"])
def test_the_model_alone_is_restored_on_four_ranks(taken, kind, tmp_path):
    # Parameters only: every value is a piece of a global tensor, readable by any rank, also
    # by the two ranks the snapshot did not have.
    found = taken[kind]
    for result in _restored(tmp_path, kind, 4, found["path"], keys=("model",)):
        _assert_same(result["restored"], found["taken"], prefix="model/")


@pytest.mark.parametrize(("saved", "restored"), [("fsdp1", "fsdp2"), ("fsdp2", "fsdp1")])
def test_restored_by_the_other_fsdp(taken, saved, restored, tmp_path):
    # Migration: torch ShardedTensors and DTensors are both pieces of global tensors named by
    # their logical paths, so either FSDP restores what the other took (here on 2 ranks).
    found = taken[saved]
    for result in _restored(tmp_path, restored, 2, found["path"]):
        _assert_same(result["restored"], found["taken"])
