"""``statesnap demo``: train a little, snapshot, restore into fresh objects, and check that
training continues exactly as it would have without the interruption."""

from __future__ import annotations

import argparse
import tempfile
import time
from typing import Any

import torch
from torch import nn

from snapshot.snapshot import Snapshot
from snapshot.stateful import RNGState, StateDict


def _build(seed: int) -> dict[str, Any]:
    """A fresh app_state: model, optimizer, LR scheduler, progress and the global RNGs."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    progress = StateDict(step=0, note="statesnap demo")
    return {
        "model": model,
        "optim": optimizer,
        "sched": scheduler,
        "progress": progress,
        "rng": RNGState(),
    }


def _train(state: dict[str, Any], steps: int) -> list[float]:
    model, optimizer = state["model"], state["optim"]
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 32)  # drawn from the global RNG, which the snapshot restores
        y = x.sum(dim=1, keepdim=True)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        state["sched"].step()
        state["progress"]["step"] += 1
        losses.append(loss.item())
    return losses


def demo(args: argparse.Namespace) -> int:
    """Runs the demo with the snapshot at ``--path`` (or in a temporary folder); returns a
    process exit code."""
    if not args.path:
        with tempfile.TemporaryDirectory(prefix="statesnap-demo-") as tmp:
            args.path = f"{tmp}/snapshot"
            return demo(args)
    path, steps = args.path, args.steps
    app_state = _build(seed=0)
    _train(app_state, steps)
    t0 = time.perf_counter()
    snapshot = Snapshot.take(path, app_state)
    took = time.perf_counter() - t0
    entries = snapshot.get_manifest()
    size = sum(e.nbytes for e in entries.values())
    print(f"took snapshot at {path}: {len(entries)} entries, {size} bytes, {took * 1e3:.1f} ms")

    expected = _train(app_state, steps)

    # A fresh process would build everything from scratch; so do we, with another seed.
    fresh = _build(seed=1)
    t0 = time.perf_counter()
    Snapshot(path).restore(fresh)
    print(
        f"restored into fresh objects in {(time.perf_counter() - t0) * 1e3:.1f} ms "
        f"(step {fresh['progress']['step']})"
    )
    resumed = _train(fresh, steps)

    for i, (a, b) in enumerate(zip(expected, resumed, strict=True)):
        print(f"step {steps + i + 1}: uninterrupted loss {a:.6f}   restored loss {b:.6f}")
    if expected != resumed:
        print("FAILED: training after restore differs from uninterrupted training")
        return 1
    print("OK: training continued bitwise identically after restore")
    return 0
