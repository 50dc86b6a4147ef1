"""A small training loop on the CPU that snapshots its model and optimizer every few steps (the
``async-loop`` case; the worker's ``train`` op runs one loop in a fresh process).

The model is an MLP (``Linear`` + ``GELU`` layers of ``LoopConfig.dims``) trained with Adam on
synthetic data (a fixed pool of random batches, cycled), so that the model plus Adam's two
moments are a few tens of MiB. ``warmup`` steps run untimed first (Adam creates its state at
the first step, so every snapshot holds it). Then ``steps`` steps are timed, with a snapshot
before every ``interval``-th step (not before the first):

``none``        no snapshots: the reference.
``take``        ``Snapshot.take``: the loop stops for the whole take.
``async_take``  ``Snapshot.async_take``, after waiting for the previous pending snapshot (as a
                user must, so that at most one is in flight); the last one is waited for after
                the last step, inside the timed region.

Each snapshot goes to a directory of its own under the job's path; after the loop (untimed)
every one is opened with ``Snapshot(path)``, which reads its manifest.
"""

from __future__ import annotations

import itertools
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

METHODS = ("none", "take", "async_take")


@dataclass(frozen=True)
class LoopConfig:
    """What the loop trains and how often it snapshots (JSON-able: the harness passes it to the
    worker as a dict)."""

    steps: int = 300
    interval: int = 25
    warmup: int = 10
    batch: int = 64
    dims: tuple[int, ...] = (512, 1536, 1536, 512)
    seed: int = 0
    fsync: bool = True
    data_batches: int = 16


def build(cfg: LoopConfig) -> tuple[nn.Module, torch.optim.Optimizer, list[torch.Tensor]]:
    """The model, its Adam optimizer, and the pool of (input, target) batches, all seeded."""
    torch.manual_seed(cfg.seed)
    layers: list[nn.Module] = []
    dims = list(cfg.dims)
    for i, (d_in, d_out) in enumerate(itertools.pairwise(dims)):
        layers.append(nn.Linear(d_in, d_out))
        if i < len(dims) - 2:
            layers.append(nn.GELU())
    model = nn.Sequential(*layers)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    data = [
        torch.randn(cfg.data_batches, cfg.batch, dims[0], generator=gen),
        torch.randn(cfg.data_batches, cfg.batch, dims[-1], generator=gen),
    ]
    return model, optimizer, data


def state_nbytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Tensor bytes of the model's and the optimizer's state dicts."""
    total = sum(t.nbytes for t in model.state_dict().values())
    for per_param in optimizer.state_dict()["state"].values():
        total += sum(v.nbytes for v in per_param.values() if isinstance(v, torch.Tensor))
    return total


def _step(
    model: nn.Module, optimizer: torch.optim.Optimizer, data: list[torch.Tensor], i: int
) -> None:
    x, y = data[0][i % len(data[0])], data[1][i % len(data[1])]
    optimizer.zero_grad(set_to_none=True)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()


@dataclass
class _Snap:
    """One snapshot of the loop: where, how long the call blocked, how long the loop later
    blocked in ``wait`` for it, and (async) when ``done()`` was first seen true."""

    path: str
    call: float
    started: float
    blocked_in_wait: float = 0.0
    seen_done: float | None = None


def run_loop(cfg: LoopConfig, method: str, path: str) -> dict[str, Any]:
    """Runs the loop with ``method``'s snapshots; returns its timings as a JSON-able dict."""
    from snapshot import Snapshot

    if method not in METHODS:
        raise ValueError(f"unknown loop method {method!r}; known: {', '.join(METHODS)}")
    cfg = LoopConfig(**{**cfg.__dict__, "dims": tuple(cfg.dims)})
    model, optimizer, data = build(cfg)
    for i in range(cfg.warmup):
        _step(model, optimizer, data, i)
    app_state = {"model": model, "optim": optimizer}
    options = None if cfg.fsync else {"fsync": False}
    snaps: list[_Snap] = []
    pending: Any = None
    step_times: list[float] = []
    t_start = time.perf_counter()
    for i in range(cfg.steps):
        if method != "none" and i > 0 and i % cfg.interval == 0:
            where = os.path.join(path, f"snap{len(snaps)}")
            if pending is not None:
                t0 = time.perf_counter()
                pending.wait()
                snaps[-1].blocked_in_wait = time.perf_counter() - t0
            t0 = time.perf_counter()
            if method == "take":
                Snapshot.take(where, app_state, storage_options=options)
            else:
                pending = Snapshot.async_take(where, app_state, storage_options=options)
            snaps.append(_Snap(where, time.perf_counter() - t0, t0))
        t0 = time.perf_counter()
        _step(model, optimizer, data, cfg.warmup + i)
        step_times.append(time.perf_counter() - t0)
        if pending is not None and snaps[-1].seen_done is None and pending.done():
            snaps[-1].seen_done = time.perf_counter() - snaps[-1].started
    if pending is not None:
        t0 = time.perf_counter()
        pending.wait()
        snaps[-1].blocked_in_wait = time.perf_counter() - t0
        if snaps[-1].seen_done is None:
            snaps[-1].seen_done = time.perf_counter() - snaps[-1].started
    seconds = time.perf_counter() - t_start
    entries = [len(Snapshot(s.path).get_manifest()) for s in snaps]  # untimed: all committed
    return {
        "seconds": seconds,
        "steps": cfg.steps,
        "steps_per_s": cfg.steps / seconds,
        "step_median": statistics.median(step_times),
        "state_bytes": state_nbytes(model, optimizer),
        "snapshots": [
            {
                "call": s.call,
                "blocked_in_wait": s.blocked_in_wait,
                "seen_done": s.seen_done,
                "entries": n,
            }
            for s, n in zip(snaps, entries, strict=True)
        ],
        "check": {
            "ok": True,
            "detail": f"ok ({len(snaps)} snapshots committed)" if snaps else "ok (no snapshots)",
        },
    }
