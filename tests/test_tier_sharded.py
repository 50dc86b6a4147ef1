"""The checkpoint manager's memory tier with sharded state: FSDP2 (``fully_shard`` on a 1-D
mesh) with AdamW on 2 ranks on 2 "hosts", and HSDP (a 2x2 replicate x shard mesh) on 4 ranks,
2 per host, saved through the README's Stateful (``get_state_dict`` / ``set_state_dict``,
DTensors kept).

Each rank's part holds its DTensors' local pieces and their layout. A job trains and saves
steps 1-3 (the third to durable storage too, written in the background from the memory copy:
the state is captured once per save), then records three more steps' losses, the
uninterrupted run. The durable step is the snapshot a take of the live state commits (the
same entries, boxes and bytes), and a plain restore of it into a fresh model, on the same
ranks or in one process unsharded, gives the saved state bitwise. Each case restarts every
process and restores:

(a) memory intact: every part from its node, nothing read from durable storage;
(b) host b's memory wiped: its ranks' parts from their replicas on host a, nothing read from
    durable storage;
(c) the model not sharded at restore (another layout): no part is restored from memory, the
    step comes from durable storage, and the logs say why.

(a) and (b) restore every parameter and moment bitwise (their ``full_tensor()``) and train on
with the uninterrupted run's losses; (c) restores the same full state.
"""

from __future__ import annotations

import logging
import os
import shutil
import warnings
from typing import Any

import pytest
import torch

from snapshot import CheckpointManager, MemoryTier, Snapshot
from snapshot._engine.manager.steps import step_name
from storage_plugins import register_storage_plugin
from tests.helpers import ModelAndOptimizer, train_step
from tests.multirank import run_ranks
from tests.test_tier import shards
from tests.test_tier_ranks import READS, CountingFS, Messages

pytestmark = pytest.mark.slow  # real processes


def _build(layout: str, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    warnings.filterwarnings("ignore", category=UserWarning)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    if layout != "plain":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        world = torch.distributed.get_world_size()
        if layout == "hsdp":  # ranks 0 and 1 (host a) one replica, 2 and 3 (host b) the other
            mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh("cpu", (world,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _step(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int, rank: int) -> float:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return train_step(
        model, optim, (torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g))
    )


def _full(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, bytes]:
    """Every parameter and moment, whole (a DTensor's ``full_tensor()``), as bytes."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optim)
    values = {f"model/{k}": v for k, v in model_sd.items()}
    for fqn, state in optim_sd["state"].items():
        values.update({f"optim/{fqn}/{name}": v for name, v in state.items()})
    out = {}
    for key, value in values.items():
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        out[key] = value.detach().numpy().tobytes() + str(value.dtype).encode()
    return out


def _tier(rank: int, world: int, base: str) -> MemoryTier:
    host = "a" if rank < world // 2 else "b"
    return MemoryTier(dir=os.path.join(base, host), host=host, durable_every=3)


class _Counted(ModelAndOptimizer):
    """Counts the calls of its ``state_dict()``: the captures of the live state."""

    calls = 0

    def state_dict(self) -> dict[str, Any]:
        self.calls += 1
        return super().state_dict()


def _train(rank: int, world: int, root: str, base: str, layout: str) -> dict[str, Any]:
    register_storage_plugin("counting", CountingFS)
    model, optim = _build(layout, seed=0)
    state = {"train": _Counted(model, optim)}
    with CheckpointManager(root, memory_tier=_tier(rank, world, base)) as manager:
        for step in range(1, 4):
            _step(model, optim, step, rank)
            manager.save(step, state)
        # While step 3 is written in the background: collectives on the training's groups.
        saved = _full(model, optim)
        calls = state["train"].calls
        Snapshot.take(os.path.join(base, "plain"), state)  # of the live state, for comparison
    durable = Snapshot(f"{root}/{step_name(3)}")
    fresh = _build(layout, seed=1)
    durable.restore({"train": ModelAndOptimizer(*fresh)})  # a plain restore, on the same ranks
    return {
        "saved": saved,
        "calls": calls,
        "durable": _full(*fresh),
        "shards": (
            shards(durable.get_manifest()),
            shards(Snapshot(f"{base}/plain").get_manifest()),
        ),
        "losses": [_step(model, optim, s, rank) for s in (4, 5, 6)],
    }


def _resume(rank: int, world: int, root: str, base: str, layout: str) -> dict[str, Any]:
    register_storage_plugin("counting", CountingFS)
    READS.clear()
    messages = Messages()
    logging.getLogger("snapshot").addHandler(messages)
    logging.getLogger("snapshot").setLevel(logging.INFO)
    model, optim = _build(layout, seed=1)  # other values: all must come from the restore
    with CheckpointManager(root, memory_tier=_tier(rank, world, base)) as manager:
        step = manager.restore({"train": ModelAndOptimizer(model, optim)})
    reads = list(READS)
    restored = _full(model, optim)
    placements = [str(p.placements) for p in model.parameters() if hasattr(p, "placements")]
    return {
        "step": step,
        "restored": restored,
        "placements": placements,
        "losses": [_step(model, optim, s, rank) for s in (4, 5, 6)],
        "reads": reads,
        "messages": messages.lines,
    }


@pytest.mark.parametrize(("layout", "world"), [("fsdp", 2), ("hsdp", 4)])
def test_fsdp2_state_restarts_from_memory_and_replicas(tmp_path, layout, world):
    root, base = f"counting://{tmp_path / 'durable'}", str(tmp_path / "tier")
    trained = run_ranks(world, _train, root, base, layout, timeout=300)
    # The durable step from the memory copy: one capture per save, the live take's snapshot.
    for rank, got in enumerate(trained):
        assert got["calls"] == 3, (rank, got["calls"])
        assert got["durable"] == got["saved"], rank  # bitwise
        written, plain = got["shards"]
        assert any(v[0] == "sharded_tensor" for v in plain.values())
        assert written == plain, rank
    register_storage_plugin("counting", CountingFS)
    model, optim = _build("plain", seed=1)  # one process, not sharded
    Snapshot(f"{root}/{step_name(3)}").restore({"train": ModelAndOptimizer(model, optim)})
    assert _full(model, optim) == trained[0]["saved"]
    shutil.rmtree(os.path.join(base, "plain"))

    def resume(sharded: bool = True) -> list[dict[str, Any]]:
        at = layout if sharded else "plain"
        out = run_ranks(world, _resume, root, base, at, timeout=300)
        for rank, got in enumerate(out):
            assert got["step"] == 3, (rank, got["step"])
            assert got["restored"].keys() == trained[rank]["saved"].keys()
            for key, value in trained[rank]["saved"].items():
                assert got["restored"][key] == value, (rank, key)  # bitwise
            if sharded:
                assert got["placements"] and all("Shard(dim=0)" in p for p in got["placements"])
                if layout == "hsdp":
                    assert all("Replicate()" in p for p in got["placements"])
                assert got["losses"] == trained[rank]["losses"], rank
        return out

    # (a) every process restarted on the same hosts: all from memory, no durable read.
    for rank, got in enumerate(resume()):
        assert got["reads"] == [], (rank, got["reads"], got["messages"])
        assert f"rank {rank}: step 3 restored from its node's memory" in got["messages"]

    # (b) host b replaced (its memory empty): its ranks' parts from the replicas on host a.
    shutil.rmtree(os.path.join(base, "b"))
    for rank, got in enumerate(resume()):
        assert got["reads"] == [], (rank, got["reads"], got["messages"])
        if rank >= world // 2:
            keeper = rank - world // 2
            assert (
                f"rank {rank}: step 3 restored from the replica of rank {keeper}"
                in (got["messages"])
            ), got["messages"]

    # (c) the model not sharded at restore: another layout, so durable storage.
    for rank, got in enumerate(resume(sharded=False)):
        assert got["reads"], rank
        text = "\n".join(got["messages"])
        assert f"rank {rank}: the part of step 3 from its node's memory was taken with " in text
        assert "another layout" in text and "DTensor" in text, text


class _TorchSharded:
    """Rows ``4 * rank`` to ``4 * rank + 3`` of a global 8x4 torch ShardedTensor; records what
    its load_state_dict was given."""

    def __init__(self, value: float) -> None:
        from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards
        from torch.distributed._shard.sharding_spec import ShardMetadata

        rank = torch.distributed.get_rank()
        local = torch.full((4, 4), value + rank)
        meta = ShardMetadata([4 * rank, 0], [4, 4], f"rank:{rank}/cpu")
        self.st = init_from_local_shards([Shard(local, meta)], [8, 4])
        self.loaded: Any = None
        self.calls = 0

    def state_dict(self) -> dict[str, Any]:
        self.calls += 1
        return {"st": self.st}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state


def _torch_sharded(rank: int, world: int, root: str, base: str) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    with CheckpointManager(root, memory_tier=_tier(rank, world, base)) as manager:
        manager.save(1, {"s": _TorchSharded(10.0)})  # memory only: durable_every is 3
    target = _TorchSharded(0.0)
    with CheckpointManager(root, memory_tier=_tier(rank, world, base)) as manager:
        step = manager.restore({"s": target})
    (shard,) = target.st.local_shards()
    # Steps 2-4, the manager's third save durable: written from the memory copy, the
    # ShardedTensor rebuilt around the shard read back, so each save calls state_dict() once.
    saved = _TorchSharded(20.0)
    with CheckpointManager(root, memory_tier=_tier(rank, world, base)) as manager:
        for later in (2, 3, 4):
            manager.save(later, {"s": saved})
    durable = _TorchSharded(0.0)
    Snapshot(os.path.join(root, "step_0000000004")).restore({"s": durable})
    return {
        "step": step,
        "same": target.loaded["st"] is target.st,
        "local": shard.tensor.tolist(),
        "calls": saved.calls,
        "durable": durable.st.local_shards()[0].tensor.tolist(),
    }


def test_torch_sharded_tensor_restarts_from_memory(tmp_path):
    """Torch's ShardedTensor: each rank's part holds its local shard, restored in place, and
    load_state_dict gets the ShardedTensor itself (no durable step exists to fall back on); a
    durable step is written from the memory copy and restores on the same ranks."""
    out = run_ranks(2, _torch_sharded, str(tmp_path / "root"), str(tmp_path / "tier"))
    for rank, got in enumerate(out):
        assert got["step"] == 1 and got["same"], got
        assert got["local"] == [[10.0 + rank] * 4] * 4, got
        assert got["calls"] == 3 and got["durable"] == [[20.0 + rank] * 4] * 4, got
