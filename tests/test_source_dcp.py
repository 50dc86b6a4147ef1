"""torch.distributed.checkpoint (DCP) directories as read-only sources.

``dcp.save`` writes an FSDP2 job's model and AdamW state through the README's Stateful on
1 and 2 ranks (gloo on the CPU, tests/multirank.py); ``Snapshot(dir).restore({"app": app})``
loads it into a fresh FSDP2 job on 1, 2 and 4 ranks, resharded: the full state gathered after
the restore equals, bitwise, the full state gathered when DCP saved it. The CLI lists, shows,
verifies and exports the directory; ``read_object`` reads one tensor and one bytes item.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch

from manifest import ShardedTensorEntry
from snapshot import Snapshot
from tests.helpers import ModelAndOptimizer, full_state
from tests.multirank import run_ranks


def _build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    warnings.filterwarnings("ignore", category=UserWarning)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _save(rank: int, world: int, path: str, out: str) -> None:
    import torch.distributed.checkpoint as dcp

    model, optim = _build(seed=0)
    for step in range(2):
        g = torch.Generator().manual_seed(100 * step + rank)
        model(torch.randn(4, 8, generator=g)).square().mean().backward()
        optim.step()
        optim.zero_grad()
    dcp.save({"app": ModelAndOptimizer(model, optim)}, checkpoint_id=path)
    full = full_state(model, optim)
    if rank == 0:
        torch.save(full, out)


def _restore(rank: int, world: int, cases: list[tuple[str, str]]) -> list[list[str]]:
    """Restores each ``(dcp dir, reference)`` into a fresh job (the second within a memory
    budget of 200 bytes); the paths that differ."""
    from snapshot import Options

    found = []
    for i, (path, out) in enumerate(cases):
        model, optim = _build(seed=1)
        # The second within a memory budget smaller than one chunk: read through tiles.
        options = Options(memory_budget_bytes=200) if i else None
        Snapshot(path).restore({"app": ModelAndOptimizer(model, optim)}, options=options)
        got, want = full_state(model, optim), torch.load(out, weights_only=False)
        assert got.keys() == want.keys(), (sorted(got), sorted(want))
        bad = []
        for key, value in want.items():
            other = got[key]
            if isinstance(value, torch.Tensor):
                if other.dtype != value.dtype or not torch.equal(other, value):
                    bad.append(key)
            elif other != value:
                bad.append(key)
        found.append(bad)
    return found


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[str, str]]:
    """DCP checkpoints saved on 1 and 2 ranks, with the full state at the save."""
    root = tmp_path_factory.mktemp("dcp")
    made = {}
    for world in (1, 2):
        path, out = str(root / f"ckpt{world}"), str(root / f"full{world}.pt")
        run_ranks(world, _save, path, out)
        made[world] = (path, out)
    return made


@pytest.mark.parametrize("world", [1, 2])
def test_dcp_restored_bitwise(saved: dict[int, tuple[str, str]], world: int) -> None:
    cases = [saved[1], saved[2]]
    results = run_ranks(world, _restore, cases)
    assert all(r == [[], []] for r in results), results


@pytest.mark.slow
def test_dcp_restored_on_four_ranks(saved: dict[int, tuple[str, str]]) -> None:
    results = run_ranks(4, _restore, [saved[1], saved[2]])
    assert all(r == [[], []] for r in results), results


def test_dcp_entries_and_read_object(saved: dict[int, tuple[str, str]]) -> None:
    path, out = saved[2]
    want = torch.load(out, weights_only=False)
    snap = Snapshot(path)
    manifest = snap.get_manifest()
    entry = manifest["0/app/model/0.weight"]
    assert isinstance(entry, ShardedTensorEntry) and len(entry.shards) == 2
    assert entry.shape == (16, 8) and entry.dtype == "float32"
    assert torch.equal(snap.read_object("0/app/model/0.weight"), want["model/0.weight"])
    step = snap.read_object("0/app/optim/state/2.bias/step")
    assert torch.equal(step, want["optim/2.bias/step"])
    params = snap.read_object("0/app/optim/param_groups/0/params")
    assert params == want["optim/param_groups/0/params"]
    assert snap.read_object("0/app/optim/param_groups/0/lr") == 0.01


def test_dcp_cli(saved: dict[int, tuple[str, str]], tmp_path: Any) -> None:
    from snapshot.cli import main

    path, out = saved[2]
    for args in (["ls", path], ["show", path, "0/app/model/2.bias"], ["verify", path]):
        assert main(args) == 0, args
    target = str(tmp_path / "export")
    assert main(["export", path, target]) == 0
    from safetensors.torch import load_file

    exported = load_file(os.path.join(target, "model.safetensors"))
    want = torch.load(out, weights_only=False)
    print(sorted(exported))
    assert torch.equal(exported["app.model.0.weight"], want["model/0.weight"])


def test_dcp_dtypes_views_and_values(tmp_path: Any) -> None:
    """Several dtypes, an empty tensor, a transposed view (which DCP saves with its strides:
    read through the safe loader), ints and lists, restored into a StateDict."""
    import torch.distributed.checkpoint as dcp

    from snapshot import StateDict

    base = torch.randn(6, 5)
    state = {
        "bf": torch.randn(3, 4).bfloat16(),
        "b": torch.tensor([True, False]),
        "e": torch.zeros(0, 3),
        "tr": base.t(),
        "i8": torch.arange(5, dtype=torch.int8),
        "s": 7,
        "lst": [1, 2],
    }
    path = str(tmp_path / "kinds")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"x": state}, checkpoint_id=path)
    snap = Snapshot(path)
    assert isinstance(snap.get_manifest()["0/x/bf"], ShardedTensorEntry)
    target = StateDict(
        **{
            k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None
            for k, v in state.items()
        }
    )
    snap.restore({"x": target})
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert target[key].dtype == value.dtype and torch.equal(target[key], value), key
        else:
            assert target[key] == value, key
