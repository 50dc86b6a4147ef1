"""Runs a test body in N real processes joined by gloo (a file-store rendezvous), on the CPU.

Usage: ``run_ranks(world_size, body, *args)`` where ``body(rank, world_size, *args)`` is a
module-level function (it is pickled into each process). Every rank's failure is reported, with
its traceback; a rank that neither finishes nor fails within the timeout is killed and reported.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

_CTX = mp.get_context("spawn")


def _entry(
    rank: int,
    world_size: int,
    store_path: str,
    body: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
) -> None:
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # N processes share 2 cores
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
        )
        try:
            value = body(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, "ok", value))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(
    world_size: int, body: Callable[..., Any], *args: Any, timeout: float = 180
) -> list[Any]:
    """Runs ``body(rank, world_size, *args)`` on ``world_size`` ranks; returns each rank's
    return value (by rank), or raises AssertionError describing every rank that failed."""
    with tempfile.TemporaryDirectory(prefix="statesnap-ranks-") as tmp:
        results = _CTX.Queue()
        procs = [
            _CTX.Process(
                target=_entry,
                args=(rank, world_size, os.path.join(tmp, "store"), body, args, results),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        outcomes: dict[int, tuple[str, Any]] = {}
        try:
            for _ in range(world_size):
                rank, status, value = results.get(timeout=timeout)
                outcomes[rank] = (status, value)
        except Exception:  # queue.Empty: some rank hung
            pass
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
                    p.join()
    failures = []
    for rank in range(world_size):
        status, value = outcomes.get(rank, ("hung", f"no result within {timeout} s (killed)"))
        if status != "ok":
            failures.append(f"--- rank {rank} ({status}):\n{value}")
    if failures:
        raise AssertionError(
            f"{len(failures)} of {world_size} ranks failed:\n" + "\n".join(failures)
        )
    return [outcomes[r][1] for r in range(world_size)]
