"""README, "Process groups and sharded state": the Stateful an FSDP2 / TP job writes, run as
the README shows it (the code block after the marker naming this file), on 2 real ranks (gloo,
CPU) with an FSDP2 model on a 1-D mesh. The take must store DTensor pieces (nothing gathered),
and the restore must bring a fresh model and AdamW state back to the values taken, bitwise."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.multirank import run_ranks

pytestmark = pytest.mark.slow  # real processes (gloo)

README = Path(__file__).resolve().parent.parent / "README.md"
MARKER = "<!-- run: ranks=2 (tests/test_readme_parallel.py runs this block) -->"


def readme_block() -> str:
    """The python block right after the marker."""
    text = README.read_text()
    after = text[text.index(MARKER) + len(MARKER) :].lstrip("\n")
    assert after.startswith("```python\n"), "the marker must be right above a python block"
    return after.removeprefix("```python\n").split("\n```", 1)[0]


def _job(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """An FSDP2 model over every rank and its AdamW optimizer, after one step (its state made
    and different for each seed)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def _full(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer value, gathered whole."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        out[name] = p.full_tensor().clone()
        for key, value in optimizer.state[p].items():
            out[f"{name}/{key}"] = (
                value.full_tensor() if hasattr(value, "full_tensor") else value
            ).clone()
    return out


def _run_readme(rank: int, world: int, code: str, folder: str) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    from snapshot import Snapshot

    os.chdir(folder)  # the block's relative path "ckpt/step_100" lands here
    model, optimizer = _job(seed=0)
    taken = _full(model, optimizer)
    namespace: dict[str, Any] = {"model": model, "optimizer": optimizer}
    exec(compile(code, "README.md", "exec"), namespace)  # the block: take, then restore

    # The take kept DTensors: the Stateful hands over this rank's pieces, not full tensors.
    app = namespace["AppState"](model, optimizer)
    state = app.state_dict()
    assert all(isinstance(v, DTensor) for v in state["model"].values())
    assert isinstance(state["optim"]["state"]["0.weight"]["exp_avg"], DTensor)

    # A fresh job (other values) restored with the README's class gets the taken state back.
    fresh_model, fresh_optimizer = _job(seed=1)
    assert not torch.equal(_full(fresh_model, fresh_optimizer)["0.weight"], taken["0.weight"])
    Snapshot("ckpt/step_100").restore({"app": namespace["AppState"](fresh_model, fresh_optimizer)})
    restored = _full(fresh_model, fresh_optimizer)
    assert restored.keys() == taken.keys()
    return {k: bool(torch.equal(restored[k], taken[k])) for k in taken}


def test_readme_parallel_stateful_takes_and_restores_on_two_ranks(tmp_path):
    code = readme_block()
    assert "class AppState" in code and "get_state_dict" in code and "set_state_dict" in code
    results = run_ranks(2, _run_readme, code, str(tmp_path))
    for rank, equal in enumerate(results):
        assert equal and all(equal.values()), (rank, [k for k, ok in equal.items() if not ok])
    manifest = (tmp_path / "ckpt" / "step_100" / "manifest.yaml").read_text()
    assert '"0/app/model/0.weight": {"type": "sharded_tensor"' in manifest  # pieces, not gathered
