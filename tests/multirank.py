"""Runs a test body in N real processes joined by gloo (a file-store rendezvous), on the CPU.

Usage: ``run_ranks(world_size, body, *args)`` where ``body(rank, world_size, *args)`` is a
module-level function (it is pickled into each process). Every rank's failure is reported, with
its traceback; a rank that neither finishes nor fails within the timeout is killed and reported.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

# Ranks start from a fork server that has imported torch once, not from a fresh interpreter
# each: importing torch is most of a rank's start-up, and a test run starts a few hundred ranks.
# A forked rank takes its environment from the server, so each rank is handed the caller's
# environment as it is at ``run_ranks`` (a test's ``monkeypatch.setenv`` reaches the ranks).
PROCESS_CONTEXT = mp.get_context("forkserver")
PROCESS_CONTEXT.set_forkserver_preload(["torch", "torch.distributed"])
# Ranks in network namespaces (``hosts``) are still spawned: under the fork server a rank of
# the host that stays up can find rank 0 gone (it raised and ended) before its own watch names
# the ranks that fell silent, and the host-cut test asserts what every such rank reports.
_SPAWN = mp.get_context("spawn")


def _entry(
    rank: int,
    world_size: int,
    store_path: str,
    body: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
    host: str | None,
    init_method: str | None,
    environ: dict[str, str],
) -> None:
    os.environ.clear()
    os.environ.update(environ)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # N processes share 2 cores
    try:
        if host is not None:  # a "host" of tests/netns.py: enter it before any socket opens
            from tests import netns

            netns.enter(host)
            os.environ["GLOO_SOCKET_IFNAME"] = netns.IFNAME
        import torch
        import torch.distributed as dist

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # (read by torch at import)
        timeout = timedelta(seconds=60)
        if init_method is not None:
            dist.init_process_group(
                "gloo", init_method=init_method, rank=rank, world_size=world_size, timeout=timeout
            )
        else:
            store = dist.FileStore(store_path, world_size)
            dist.init_process_group(
                "gloo", store=store, rank=rank, world_size=world_size, timeout=timeout
            )
        try:
            value = body(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, "ok", value))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(
    world_size: int,
    body: Callable[..., Any],
    *args: Any,
    timeout: float = 180,
    expect_dead: frozenset[int] = frozenset(),
    hosts: list[str] | None = None,
    init_method: str | None = None,
) -> list[Any]:
    """Runs ``body(rank, world_size, *args)`` on ``world_size`` ranks; returns each rank's
    return value (by rank), or raises AssertionError describing every rank that failed.

    A rank whose process ends without a result (killed) is a failure, found as soon as it
    ends, unless it is in ``expect_dead`` (its value is then None; one still there, frozen,
    when every other rank has reported is killed).

    ``hosts``: the network namespace each rank runs in (tests/netns.py), with
    ``init_method`` (``tcp://address:port``, rank 0's host) as the rendezvous; by default the
    ranks share this machine's network and meet through a file store."""
    with tempfile.TemporaryDirectory(prefix="statesnap-ranks-") as tmp:
        ctx = PROCESS_CONTEXT if hosts is None else _SPAWN
        results = ctx.Queue()
        procs = [
            ctx.Process(
                target=_entry,
                args=(
                    rank,
                    world_size,
                    os.path.join(tmp, "store"),
                    body,
                    args,
                    results,
                    None if hosts is None else hosts[rank],
                    init_method,
                    dict(os.environ),
                ),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        outcomes: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(outcomes) < world_size and time.monotonic() < deadline:
                try:
                    rank, status, value = results.get(timeout=0.2)
                    outcomes[rank] = (status, value)
                    continue
                except queue.Empty:
                    pass
                waiting = [r for r in range(world_size) if r not in outcomes]
                if waiting and set(waiting) <= expect_dead:
                    # Only the victims are left; one frozen (SIGSTOP) never ends by itself.
                    for r in waiting:
                        procs[r].kill()
                        procs[r].join()
                if all(procs[r].exitcode is not None for r in waiting):
                    # Every rank still missing has ended: what it sent is in the queue by
                    # now (a process flushes its queue before it exits), or it died.
                    try:
                        while True:
                            rank, status, value = results.get(timeout=1)
                            outcomes[rank] = (status, value)
                    except queue.Empty:
                        pass
                    for r in waiting:
                        if r not in outcomes:
                            outcomes[r] = ("died", f"exit code {procs[r].exitcode}, no result")
                    break
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
                    p.join()
    failures = []
    for rank in range(world_size):
        status, value = outcomes.get(rank, ("hung", f"no result within {timeout} s (killed)"))
        if status == "died" and rank in expect_dead:
            outcomes[rank] = ("ok", None)
            continue
        if status != "ok":
            failures.append(f"--- rank {rank} ({status}):\n{value}")
    if failures:
        raise AssertionError(
            f"{len(failures)} of {world_size} ranks failed:\n" + "\n".join(failures)
        )
    return [outcomes[r][1] for r in range(world_size)]
