"""Whole-application round trips: training resumes bitwise identically after restore."""

from __future__ import annotations

import copy
import random
import subprocess
import sys
from collections import OrderedDict

import numpy as np
import pytest
import torch
from torch import nn

from snapshot import RNGState, Snapshot, StateDict


def build(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1)
    )
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    return model, optim, sched


def train(model, optim, sched, extra: StateDict, steps: int) -> list[torch.Tensor]:
    losses = []
    for _ in range(steps):
        # Every source of randomness a training loop may use draws here.
        x = torch.randn(32, 8) + float(np.random.rand()) + random.random()
        loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        optim.zero_grad()
        loss.backward()
        optim.step()
        sched.step()
        extra["step"] += 1
        extra["history"].append(loss.item())
        losses.append(loss.detach().clone())
    return losses


def app_state(model, optim, sched, extra):
    return {"model": model, "optim": optim, "sched": sched, "extra": extra, "rng": RNGState()}


def test_training_resumes_bitwise_identically(snapshot_url):
    model, optim, sched = build(0)
    extra = StateDict(
        step=0,
        history=[],
        config=OrderedDict(name="run/1", lr=0.01, tags=("a", "b"), flags={1: True, 2: None}),
        blob=b"\x00\x01binary",
        inf=float("inf"),
    )
    train(model, optim, sched, extra, 3)
    Snapshot.take(snapshot_url, app_state(model, optim, sched, extra))
    sched_at_take = copy.deepcopy(sched.state_dict())
    expected = train(model, optim, sched, extra, 4)

    model2, optim2, sched2 = build(123)
    extra2 = StateDict(step=-1, history=None)
    Snapshot(snapshot_url).restore(app_state(model2, optim2, sched2, extra2))
    assert extra2["step"] == 3
    assert extra2["config"] == extra["config"] and type(extra2["config"]) is OrderedDict
    assert extra2["blob"] == b"\x00\x01binary" and extra2["inf"] == float("inf")
    assert sched2.state_dict() == sched_at_take
    resumed = train(model2, optim2, sched2, extra2, 4)
    assert [loss.item() for loss in resumed] == [loss.item() for loss in expected]
    for a, b in zip(resumed, expected, strict=True):
        assert torch.equal(a, b)
    for (name, p), p2 in zip(model.state_dict().items(), model2.state_dict().values(), strict=True):
        assert torch.equal(p, p2), name


@pytest.mark.slow
def test_restore_in_a_fresh_process(tmp_path):
    """The snapshot carries everything: another interpreter resumes to the same losses."""
    path = tmp_path / "snap"
    script = f"""
import sys, torch
sys.path.insert(0, {str(__import__("pathlib").Path(__file__).parent.parent)!r})
from tests.test_roundtrip import build, train, app_state
from snapshot import Snapshot, StateDict
model, optim, sched = build(7)
extra = StateDict(step=0, history=[])
if sys.argv[1] == "take":
    train(model, optim, sched, extra, 2)
    Snapshot.take({str(path)!r}, app_state(model, optim, sched, extra))
else:
    Snapshot({str(path)!r}).restore(app_state(model, optim, sched, extra))
print(repr([l.item() for l in train(model, optim, sched, extra, 3)]))
"""
    take = subprocess.run([sys.executable, "-c", script, "take"], capture_output=True, text=True)
    assert take.returncode == 0, take.stderr
    restore = subprocess.run(
        [sys.executable, "-c", script, "restore"], capture_output=True, text=True
    )
    assert restore.returncode == 0, restore.stderr
    assert take.stdout == restore.stdout and take.stdout.startswith("[")


@pytest.mark.slow
def test_demo_command_succeeds(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "snapshot", "demo", "--path", str(tmp_path / "demo")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK: training continued bitwise identically" in result.stdout
