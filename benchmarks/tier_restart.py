"""Restart time of a checkpoint manager with a memory tier: the same state restored from the
memory tier, from a peer's replica (one host's memory wiped), from a local disk and from S3
(moto, in a process of its own; the memory tier wiped), and what a save costs the caller: a
save to memory against a plain copy of the state, a save that also goes to the durable root
(written from the memory copy in the background), and the step time of a tiny training loop
while that durable write runs against the same loop with nothing in the background.

    python -m benchmarks.tier_restart [--size 256MiB] [--reps 3]

Two ranks on this machine, as two "hosts" (a node-local folder each, ``MemoryTier(host=)``),
joined by gloo; the state is a model of float32 tensors (32 MiB each) per rank, each rank's
own. The time of a restore is the slowest rank's ``manager.restore``, barrier to barrier;
every restore is checked bitwise. The local-disk restores read warm (the page cache holds the
steps just written). The tier's folder is under ``--shm`` (default /dev/shm).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch
import torch.multiprocessing as mp

from benchmarks.common import parse_size
from benchmarks.s3server import S3Server

WORLD = 2
SAVES = 4  # steps saved per job; every second one also to the durable root
LOOP_STEPS = 40  # steps of the tiny loop timed before each save, and after a durable one


def _model(rank: int, total: int, fill: float | None = None) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(11 + rank)
    n = max(1, total // (32 << 20))
    model = {f"w{i}": torch.randn(8 << 20, generator=gen) for i in range(n)}
    return model if fill is None else {k: torch.full_like(v, fill) for k, v in model.items()}


def _loop(steps: int) -> list[float]:
    """The seconds of each step of a tiny training loop (a small model's forward, backward and
    optimizer step), on this process's one thread."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    x, out = torch.randn(64, 256), []
    for _ in range(steps):
        t = time.perf_counter()
        optim.zero_grad()
        model(x).square().mean().backward()
        optim.step()
        out.append(time.perf_counter() - t)
    return out


def _rank(rank: int, world: int, store: str, job: dict[str, Any], out: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.distributed as dist

    from snapshot import CheckpointManager, MemoryTier, StateDict

    dist.init_process_group(
        "gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
        timeout=timedelta(seconds=600),
    )  # fmt: skip
    try:
        host = "ab"[rank]
        tier = MemoryTier(dir=os.path.join(job["shm"], host), host=host, durable_every=2)
        opts = job["storage_options"]
        if job["op"] == "save":
            state = {"model": StateDict(**_model(rank, job["size"]))}
            memory, durable, written = [], [], []
            quiet, busy = [], []  # a tiny loop's step times: nothing running, a durable write
            with CheckpointManager(job["root"], storage_options=opts, memory_tier=tier) as m:
                for step in range(1, SAVES + 1):
                    dist.barrier()
                    quiet += _loop(LOOP_STEPS)
                    dist.barrier()
                    t = time.perf_counter()
                    m.save(step, state)
                    (durable if step % 2 == 0 else memory).append(time.perf_counter() - t)
                    if step % 2 == 0:  # the loop runs while the durable write does
                        busy += _loop(LOOP_STEPS)
                    m.wait()  # each save measured alone
                    if step % 2 == 0:
                        written.append(time.perf_counter() - t)
            t = time.perf_counter()
            copy = {k: v.clone() for k, v in state["model"].items()}
            copied = time.perf_counter() - t
            del copy
            times = {"memory": memory, "durable": durable, "copy": [copied], "written": written}
            times.update(quiet=[statistics.median(quiet)], busy=[statistics.median(busy)])
            out.put((rank, times, True))
            return
        target = {"model": StateDict(**_model(rank, job["size"], fill=0.0))}
        with CheckpointManager(job["root"], storage_options=opts, memory_tier=tier) as m:
            dist.barrier()
            t = time.perf_counter()
            step = m.restore(target)
            dist.barrier()
            seconds = time.perf_counter() - t
        expected = _model(rank, job["size"])
        ok = step == SAVES and all(torch.equal(target["model"][k], v) for k, v in expected.items())
        out.put((rank, {"restore": [seconds]}, ok))
    finally:
        dist.destroy_process_group()


def _run(job: dict[str, Any]) -> tuple[dict[str, float], bool]:
    """Each measure's slowest rank (the median of its repeats within the job), and whether
    every rank's check passed."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=_rank, args=(r, WORLD, os.path.join(tmp, "store"), job, out))
            for r in range(WORLD)
        ]
        for p in procs:
            p.start()
        results = [out.get(timeout=900) for _ in range(WORLD)]
        for p in procs:
            p.join()
    keys = results[0][1].keys()
    worst = {k: max(statistics.median(r[1][k]) for r in results) for k in keys}
    return worst, all(ok for _, _, ok in results)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="256MiB", help="the state of each rank")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--shm", default="/dev/shm")
    p.add_argument("--dir", default="/tmp/statesnap-bench")
    args = p.parse_args()
    size = parse_size(args.size)
    base = tempfile.mkdtemp(prefix="tier-", dir=args.dir if os.path.isdir(args.dir) else None)
    shm = tempfile.mkdtemp(prefix="statesnap-tier-bench-", dir=args.shm)
    server = S3Server()
    times: dict[str, list[float]] = {}
    checks: list[bool] = []

    def record(name: str, job: dict[str, Any], key: str) -> None:
        got, ok = _run(job)
        checks.append(ok)
        times.setdefault(name, []).append(got[key])
        print(f"  {name}: {got[key]:.3f} s ok={ok}", file=sys.stderr)

    try:
        server.start()
        for rnd in range(args.reps):
            print(f"round {rnd + 1}/{args.reps}", file=sys.stderr)
            for tier_dir in (os.path.join(shm, "local"), os.path.join(shm, "s3")):
                shutil.rmtree(tier_dir, ignore_errors=True)
            local = {
                "root": os.path.join(base, f"local-{rnd}"),
                "storage_options": None,
                "shm": os.path.join(shm, "local"),
                "size": size,
            }
            s3 = {
                "root": f"s3://{server.new_bucket()}/job",
                "storage_options": server.storage_options(),
                "shm": os.path.join(shm, "s3"),
                "size": size,
            }
            saved, ok = _run({**local, "op": "save"})
            checks.append(ok)
            for key in ("copy", "memory", "durable", "written", "quiet", "busy"):
                times.setdefault(f"save: {key}", []).append(saved[key])
            _run({**s3, "op": "save"})
            record("restore: memory tier", {**local, "op": "restore"}, "restore")
            shutil.rmtree(os.path.join(local["shm"], "b"))
            record("restore: peer replica (host b wiped)", {**local, "op": "restore"}, "restore")
            shutil.rmtree(local["shm"])
            record("restore: local disk (memory wiped)", {**local, "op": "restore"}, "restore")
            shutil.rmtree(s3["shm"])
            record("restore: S3 (memory wiped)", {**s3, "op": "restore"}, "restore")
            shutil.rmtree(local["root"], ignore_errors=True)
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    print(
        f"memory tier, {WORLD} ranks on 2 hosts, {args.size} per rank, {args.reps} rounds, "
        f"{sum(checks)}/{len(checks)} jobs checked bitwise\n"
    )
    print("| what | median s | per round |")
    print("|---|---|---|")
    labels = {
        "save: copy": "a plain copy of the state (clone)",
        "save: memory": "save, memory tier only (returns after the memory take)",
        "save: durable": "save, memory tier and durable root (returns after the memory take)",
        "save: written": "that save until its durable write committed (wait returns)",
        "save: quiet": "tiny loop step, nothing in the background",
        "save: busy": "tiny loop step, while the durable write runs",
    }
    for name, ts in times.items():
        digits = 4 if statistics.median(ts) < 0.01 else 3  # a tiny loop's step: milliseconds
        rounds = ", ".join(f"{t:.{digits}f}" for t in ts)
        print(f"| {labels.get(name, name)} | {statistics.median(ts):.{digits}f} | {rounds} |")


if __name__ == "__main__":
    main()
