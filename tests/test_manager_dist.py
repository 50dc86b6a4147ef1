"""CheckpointManager on two ranks (gloo, real processes): every rank saves and restores, rank 0
lists, decides and deletes, and every rank agrees on the steps and on what was restored."""

from __future__ import annotations

import os

import pytest
import torch

from snapshot import CheckpointManager, InvalidArgumentError, StateDict
from tests.multirank import run_ranks

pytestmark = pytest.mark.slow  # real processes


def make_state(rank: int) -> dict:
    return {
        "model": StateDict(w=torch.full((100,), 1.0)),  # the same on every rank
        "own": StateDict(x=torch.full((10,), float(rank))),  # each rank's own
        "progress": StateDict(step=0),
    }


def blank() -> dict:
    return {
        "model": StateDict(w=torch.zeros(100)),
        "own": StateDict(x=torch.zeros(10)),
        "progress": StateDict(step=-1),
    }


def train(state: dict, rank: int, step: int) -> None:
    state["model"]["w"].add_(1)
    state["own"]["x"].add_(rank + 1)
    state["progress"]["step"] = step


def _two_ranks(rank: int, world_size: int, root: str) -> dict:
    state = make_state(rank)
    out = {}
    with CheckpointManager(root, keep_last=2) as manager:
        assert manager.restore(blank()) is None
        for step in range(1, 5):
            train(state, rank, step)
            manager.save(step, state, metrics={"loss": 1.0 / step})
        manager.wait()
        out["steps"] = manager.steps()
        # Only rank 0 runs retention: no other rank ever starts the deleting thread.
        out["deleter"] = manager._cleaner.last_round is not None
    # A restart: both ranks resume from the same step, each with its own part.
    with CheckpointManager(root, keep_last=2) as again:
        target = blank()
        out["restored"] = again.restore(target)
        assert torch.equal(target["own"]["x"], state["own"]["x"])
        assert torch.equal(target["model"]["w"], state["model"]["w"])
        out["progress"] = target["progress"]["step"]
        with pytest.raises(InvalidArgumentError, match="not committed"):
            again.restore(blank(), step=1)  # deleted by retention, on every rank alike
        train(state, rank, 5)
        again.save(5, state)
        again.wait()
        out["after"] = again.latest_step()
    return out


def test_two_ranks_agree_and_one_deletes(tmp_path):
    root = str(tmp_path / "ckpt")
    results = run_ranks(2, _two_ranks, root)
    common = {"steps": [3, 4], "restored": 4, "progress": 4, "after": 5}
    for rank, out in enumerate(results):
        assert out == {**common, "deleter": rank == 0}, (rank, out)
    assert sorted(os.listdir(root)) == ["step_0000000004", "step_0000000005"]
