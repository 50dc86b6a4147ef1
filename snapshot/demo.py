"""The demo: train a little, snapshot, restore into fresh objects, and check training continues
exactly as it would have without the interruption."""

from __future__ import annotations

import time

import torch
from torch import nn

from snapshot import RNGState, Snapshot, StateDict


def _build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.StepLR]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    return model, optimizer, scheduler


def _train(
    model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, progress: StateDict, steps: int
) -> list[float]:
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 32)  # drawn from the global RNG, which the snapshot restores
        y = x.sum(dim=1, keepdim=True)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        progress["step"] += 1
        losses.append(loss.item())
    return losses


def run_demo(path: str, steps: int = 5) -> int:
    """Runs the demo with the snapshot at ``path``; returns a process exit code."""
    model, optimizer, scheduler = _build(seed=0)
    progress = StateDict(step=0, note="statesnap demo")
    _train(model, optimizer, scheduler, progress, steps)

    app_state = {
        "model": model,
        "optim": optimizer,
        "sched": scheduler,
        "progress": progress,
        "rng": RNGState(),
    }
    t0 = time.perf_counter()
    snapshot = Snapshot.take(path, app_state)
    took = time.perf_counter() - t0
    entries = snapshot.get_manifest()
    size = sum(e.nbytes for e in entries.values())
    print(f"took snapshot at {path}: {len(entries)} entries, {size} bytes, {took * 1e3:.1f} ms")

    expected = _train(model, optimizer, scheduler, progress, steps)

    # A fresh process would build everything from scratch; so do we, with another seed.
    model2, optimizer2, scheduler2 = _build(seed=1)
    progress2 = StateDict(step=0)
    t0 = time.perf_counter()
    Snapshot(path).restore(
        {
            "model": model2,
            "optim": optimizer2,
            "sched": scheduler2,
            "progress": progress2,
            "rng": RNGState(),
        }
    )
    print(
        f"restored into fresh objects in {(time.perf_counter() - t0) * 1e3:.1f} ms "
        f"(step {progress2['step']})"
    )
    resumed = _train(model2, optimizer2, scheduler2, progress2, steps)

    for i, (a, b) in enumerate(zip(expected, resumed, strict=True)):
        print(f"step {steps + i + 1}: uninterrupted loss {a:.6f}   restored loss {b:.6f}")
    if expected != resumed:
        print("FAILED: training after restore differs from uninterrupted training")
        return 1
    print("OK: training continued bitwise identically after restore")
    return 0
