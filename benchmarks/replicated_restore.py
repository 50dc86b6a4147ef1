"""Replicated state restored across ranks: every rank reading it, against one rank reading each
tensor and broadcasting it to the others (``Options.read_replicated_once``), and the library's
own choice, at 2 and 4 ranks, from a local directory (cold and warm page cache) and from a local
S3 server (moto, in a process of its own).

    python -m benchmarks.replicated_restore [--size 256MiB] [--worlds 2,4] [--reps 3]

The state: a model of large float32 tensors (32 MiB each) and 1,000 small ones (16 KiB), the
same on every rank (``replicated=["model/**"]``), plus 1 MiB of each rank's own. Each round
takes it once per storage and world size, then restores it with each setting, the settings in
a rotated order per round; the time of a restore is the slowest rank's, barrier to barrier.
Ratios are per round, "every rank reads" ÷ the setting (above 1: the setting is faster).
Every restore is checked bitwise. Ranks are processes joined by gloo on this machine's cores.
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

from benchmarks.common import drop_page_cache, parse_size
from benchmarks.s3server import S3Server

SETTINGS = {"every rank reads": False, "read once, broadcast": True, "library's choice": None}


def _model(total: int, fill: float | None = None) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    small = {f"s{i}": torch.randn(4096, generator=gen) for i in range(1000)}
    large_bytes = max(total - 1000 * 4096 * 4, 32 << 20)
    large = {f"w{i}": torch.randn(8 << 20, generator=gen) for i in range(large_bytes // (32 << 20))}
    model = {**large, **small}
    if fill is not None:
        model = {k: torch.full_like(v, fill) for k, v in model.items()}
    return model


def _rank(rank: int, world: int, store: str, job: dict[str, Any], out: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.distributed as dist

    from snapshot import Options, Snapshot, StateDict

    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store, world),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=600),
    )
    try:
        opts = job["storage_options"]
        if job["op"] == "take":
            state = {
                "model": StateDict(**_model(job["size"])),
                "own": StateDict(x=torch.full((1 << 18,), float(rank))),
            }
            Snapshot.take(job["path"], state, replicated=["model/**"], storage_options=opts)
            out.put((rank, 0.0, True))
            return
        expected = _model(job["size"])
        targets = {
            "model": StateDict(**_model(job["size"], fill=0.0)),
            "own": StateDict(x=torch.zeros(1 << 18)),
        }
        dist.barrier()
        t = time.perf_counter()
        Snapshot(job["path"], storage_options=opts).restore(
            targets, options=Options(read_replicated_once=job["once"])
        )
        dist.barrier()
        seconds = time.perf_counter() - t
        ok = all(torch.equal(targets["model"][k], v) for k, v in expected.items())
        ok = ok and torch.equal(targets["own"]["x"], torch.full((1 << 18,), float(rank)))
        out.put((rank, seconds, ok))
    finally:
        dist.destroy_process_group()


def _run(world: int, job: dict[str, Any]) -> tuple[float, bool]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=_rank, args=(r, world, os.path.join(tmp, "store"), job, out))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        results = [out.get(timeout=900) for _ in range(world)]
        for p in procs:
            p.join()
    return max(s for _, s, _ in results), all(ok for _, _, ok in results)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="256MiB")
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", default="/tmp/statesnap-bench")
    p.add_argument("--storages", default="local cold,local warm,s3")
    args = p.parse_args()
    size = parse_size(args.size)
    worlds = [int(w) for w in args.worlds.split(",")]
    storages = args.storages.split(",")
    root = tempfile.mkdtemp(prefix="replicated-", dir=args.dir if os.path.isdir(args.dir) else None)
    server = S3Server() if "s3" in storages else None
    times: dict[tuple[str, int, str], list[float]] = {}
    checks: list[bool] = []
    try:
        if server is not None:
            server.start()
        for rnd in range(args.reps):
            print(f"round {rnd + 1}/{args.reps}", file=sys.stderr)
            for storage in storages:
                for world in worlds:
                    if storage == "s3":
                        assert server is not None
                        path = f"s3://{server.new_bucket()}/snap"
                        opts = server.storage_options()
                    else:
                        path, opts = os.path.join(root, f"{world}-{storage.split()[1]}"), None
                        shutil.rmtree(path, ignore_errors=True)
                    base = {"path": path, "storage_options": opts, "size": size}
                    _run(world, {**base, "op": "take"})
                    names = list(SETTINGS)
                    names = names[rnd % len(names) :] + names[: rnd % len(names)]
                    for name in names:
                        if storage == "local cold":
                            drop_page_cache(path)
                        elif storage == "local warm":
                            _run(world, {**base, "op": "restore", "once": False})  # warms
                        seconds, ok = _run(world, {**base, "op": "restore", "once": SETTINGS[name]})
                        checks.append(ok)
                        times.setdefault((storage, world, name), []).append(seconds)
                        print(
                            f"  {storage} {world} ranks {name}: {seconds:.3f} s ok={ok}",
                            file=sys.stderr,
                        )
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"replicated restore, {args.size} model + 1 MiB per rank, {args.reps} rounds, "
        f"{sum(checks)}/{len(checks)} restores bitwise equal\n"
    )
    print("| storage | ranks | setting | median s | every rank reads ÷ setting (per round) |")
    print("|---|---|---|---|---|")
    for storage in storages:
        for world in worlds:
            base = times[(storage, world, "every rank reads")]
            for name in SETTINGS:
                ts = times[(storage, world, name)]
                ratios = [b / t for b, t in zip(base, ts, strict=True)]
                rounds = ", ".join(f"{r:.2f}" for r in ratios)
                print(
                    f"| {storage} | {world} | {name} | {statistics.median(ts):.3f} | "
                    f"{statistics.median(ratios):.2f} ({rounds}) |"
                )


if __name__ == "__main__":
    main()
