"""Peak memory and time of exporting a snapshot to safetensors, streamed by statesnap against
the way other tools do it (the whole state read into memory, then ``safetensors.torch.
save_file``), in one run.

Run from the repository root::

    python -m benchmarks.export_memory                   # 2 GiB state, 64 MiB budget
    python -m benchmarks.export_memory --size-mib 256    # quicker

A first process takes the snapshot (dense tensors, and a tensor stored as boxes along its
second axis, which the export consolidates); then each method runs in a fresh process of its
own, in turn, twice (the order reversed the second time). A thread samples the process's
resident memory (``/proc/self/statm``) every 2 ms; the figure is its peak during the export
minus its value just before. Prints Markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

MIB = 1 << 20


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Peak:
    """The highest RSS seen while running, sampled on a thread."""

    def __init__(self) -> None:
        self.base = rss()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(0.002)

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())


def take(path: str, size_mib: int) -> None:
    import torch

    from snapshot import Snapshot, StateDict
    from snapshot.sharding import ShardedTensor

    g = torch.Generator().manual_seed(0)
    per = 64 * MIB // 4
    n = max(1, (size_mib - 64) // 64)
    tensors = {f"layer{i}.weight": torch.randn(per, generator=g).view(4096, -1) for i in range(n)}
    wide = torch.randn(2048, 8192, generator=g)  # 64 MiB, stored as two column boxes
    halves = [
        ShardedTensor.from_rank_offsets("wide", wide[:, :4096].clone(), (1, 0, 2)),
        ShardedTensor.from_rank_offsets("wide", wide[:, 4096:].clone(), (1, 1, 2)),
    ]
    state = StateDict(**tensors, wide_a=halves[0], wide_b=halves[1])
    Snapshot.take(path, {"model": state})


def run_method(method: str, path: str, out: str, budget: int) -> dict[str, float]:
    import torch  # noqa: F401 - imported before the baseline, by both methods

    from snapshot import Options, Snapshot
    from snapshot.export import export

    snap = Snapshot(path)
    t = time.perf_counter()
    with Peak() as peak:
        if method == "statesnap":
            export(snap, out, key="model", options=Options(memory_budget_bytes=budget))
        else:
            from safetensors.torch import save_file

            state = snap.read_object("0/model")
            tensors = {}
            for k, v in state.items():
                if hasattr(v, "local_shards"):  # a sharded value: take it whole
                    continue
                tensors[k] = v.contiguous()
            os.makedirs(out, exist_ok=True)
            save_file(tensors, os.path.join(out, "model.safetensors"))
            del state, tensors
    return {"seconds": time.perf_counter() - t, "peak_extra": peak.peak - peak.base}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=2048)
    parser.add_argument("--budget-mib", type=int, default=64)
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--take", help=argparse.SUPPRESS)
    args = parser.parse_args()
    budget = args.budget_mib * MIB
    if args.take:
        take(args.take, args.size_mib)
        return
    if args.worker:
        method, path, out = args.worker
        print(json.dumps(run_method(method, path, out, budget)))
        return
    scratch = tempfile.mkdtemp(prefix="statesnap-export-")
    try:
        snap = os.path.join(scratch, "snap")
        cmd = [sys.executable, "-m", "benchmarks.export_memory", "--size-mib", str(args.size_mib)]
        subprocess.run([*cmd, "--take", snap], check=True)
        methods = ["statesnap", "read-all+save_file"]
        results: dict[str, list[dict[str, float]]] = {m: [] for m in methods}
        for rnd in range(2):
            for method in methods if rnd == 0 else methods[::-1]:
                out = os.path.join(scratch, f"out-{method}-{rnd}")
                run = subprocess.run(
                    [*cmd, "--budget-mib", str(args.budget_mib), "--worker", method, snap, out],
                    check=True,
                    capture_output=True,
                    text=True,
                )
                results[method].append(json.loads(run.stdout.strip().splitlines()[-1]))
                shutil.rmtree(out, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    import torch

    print(f"### export — {time.strftime('%Y-%m-%d %H:%M')}\n")
    print(
        f"Command: `python -m benchmarks.export_memory --size-mib {args.size_mib} "
        f"--budget-mib {args.budget_mib}`; {os.cpu_count()} cores, torch {torch.__version__}. "
        "Two rounds, each method in a fresh process.\n"
    )
    print("| method | peak RSS above the start, MiB (rounds) | seconds (rounds) |")
    print("|---|---|---|")
    for method, rows in results.items():
        peaks = ", ".join(f"{r['peak_extra'] / MIB:.1f}" for r in rows)
        secs = ", ".join(f"{r['seconds']:.2f}" for r in rows)
        print(f"| {method} | {peaks} | {secs} |")
    worst = max(r["peak_extra"] for r in results["statesnap"])
    print(
        f"\nstatesnap's worst peak: {worst / MIB:.1f} MiB above the start, with a budget of "
        f"{args.budget_mib} MiB (bound checked: budget + 64 MiB = {args.budget_mib + 64} MiB: "
        f"{'within' if worst <= budget + 64 * MIB else 'ABOVE'})."
    )


if __name__ == "__main__":
    main()
