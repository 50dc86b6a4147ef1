"""Restoring a state onto a GPU from local disk: statesnap against the peers, in one run.

Run on a machine with one CUDA GPU, from the repository root::

    python -m benchmarks.gpu_restore                     # 2 GiB, 3 rounds, warm and cold
    python -m benchmarks.gpu_restore --size 512MiB --reps 2

The state is model-like (``benchmarks.common.states``' "main" mix of large and small tensors,
bf16 and fp32) and lives on the GPU, as a model resumed on the device it trains on: each
method fills preallocated CUDA tensors of the same shapes, as ``load_state_dict`` would.

- ``raw``: the same bytes as one file, read in chunks of at most 64 MiB by 4 threads with
  ``os.preadv`` into pinned buffers, each copied to the device non-blocking on its reader's
  stream while the next is read (a floor: no format, no checks, one file).
- ``statesnap``: ``Snapshot(path).restore`` into the CUDA tensors (CRC-32s checked).
- ``torch.load``: ``torch.load(map_location="cuda")`` then ``copy_`` into the targets.
- ``safetensors``: ``safetensors.torch.load_file(device="cuda:0")`` then ``copy_``.

The first round of the first temperature holds each method's first restore in the process
(``raw``'s pinned buffers are made beforehand, untimed; statesnap pins its tiles as it reads,
and torch's pinned-memory cache keeps them for later restores): the tables give it beside the
median. Each round runs every method once, in a rotated order, with the files in the page cache
("warm") or evicted from it first ("cold": fsync and ``posix_fadvise(DONTNEED)``); every
restore is checked bitwise against the state written. Prints a table per temperature: median
seconds, GB/s, and each method's median over statesnap's (above 1: statesnap is faster).

``--cpu-dry-run`` runs the same steps with CPU targets (no pinning, no device): the script's
own logic, nothing about CUDA.
"""

from __future__ import annotations

import argparse
import os
import queue
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from benchmarks.common import (
    build_spec,
    flatten_state,
    fmt_size,
    generate_state,
    parse_size,
    resident_fraction,
    set_page_cache,
)
from benchmarks.common.states import GIB, MIB
from benchmarks.gpu_check import same
from snapshot import Snapshot, StateDict

CHUNK = 64 * MIB
READERS = 4


def _state(size: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The main case's model-like state (its tensors alone, by flat key), on ``device``."""
    spec = build_spec({"kind": "model", "size": size, "seed": 0})
    host = flatten_state(generate_state(spec, with_objects=False))
    return {k: v.to(device) for k, v in host.items()}


class Methods:
    """Writes the state in each format once; ``restore[name]()`` fills ``targets``."""

    def __init__(
        self,
        root: str,
        state: dict[str, torch.Tensor],
        device: torch.device,
        only: set[str] | None = None,
    ) -> None:
        self.root, self.device, self.state = root, device, state
        self.targets = {k: torch.empty_like(v) for k, v in state.items()}
        self.on_gpu = device.type == "cuda"
        host = {k: v.cpu() for k, v in state.items()}
        self.paths: dict[str, str] = {}
        # raw: one file of the tensors' bytes back to back, in key order.
        self.paths["raw"] = os.path.join(root, "raw")
        os.makedirs(self.paths["raw"])
        with open(os.path.join(self.paths["raw"], "state.bin"), "wb") as f:
            for v in host.values():
                f.write(memoryview(v.contiguous().view(torch.uint8).numpy()))
        self.paths["statesnap"] = os.path.join(root, "statesnap")
        Snapshot.take(self.paths["statesnap"], {"m": StateDict(state)})
        self.restore: dict[str, Callable[[], None]] = {
            "raw": self._raw,
            "statesnap": self._statesnap,
        }
        if only is None or "torch.load" in only:
            self.paths["torch.load"] = os.path.join(root, "torch")
            os.makedirs(self.paths["torch.load"])
            torch.save(host, os.path.join(self.paths["torch.load"], "state.pt"))
            self.restore["torch.load"] = self._torch_load
        try:
            if only is not None and "safetensors" not in only:
                raise ImportError("not asked for")
            from safetensors.torch import save_file

            self.paths["safetensors"] = os.path.join(root, "safetensors")
            os.makedirs(self.paths["safetensors"])
            save_file(host, os.path.join(self.paths["safetensors"], "state.safetensors"))
            self.restore["safetensors"] = self._safetensors
        except ImportError:
            if only is None or "safetensors" in only:
                print("safetensors is not installed: its method is left out", flush=True)
        self.buffers = [
            torch.empty(CHUNK, dtype=torch.uint8, pin_memory=self.on_gpu)
            for _ in range(2 * READERS)
        ]

    def sync(self) -> None:
        if self.on_gpu:
            torch.cuda.synchronize()

    def _raw(self) -> None:
        """Chunks of at most 64 MiB read by ``READERS`` threads with ``os.preadv`` into pinned
        buffers (twice as many as readers), each copied to the device non-blocking on its
        reader's stream; a buffer is reused once the event after its copy has passed."""
        jobs, pos = [], 0
        for t in self.targets.values():
            flat = t.view(-1).view(torch.uint8)
            for at in range(0, flat.numel(), CHUNK):
                n = min(CHUNK, flat.numel() - at)
                jobs.append((flat[at : at + n], pos + at, n))
            pos += flat.numel()
        free: queue.SimpleQueue[tuple[torch.Tensor, list[Any]]] = queue.SimpleQueue()
        for buf in self.buffers:
            free.put((buf, [None]))
        local = threading.local()
        fd = os.open(os.path.join(self.paths["raw"], "state.bin"), os.O_RDONLY)

        def work(job: tuple[torch.Tensor, int, int]) -> None:
            dst, offset, n = job
            buf, event = free.get()
            if event[0] is not None:
                event[0].synchronize()  # the copy that last read this buffer is done
            got = 0
            view = memoryview(buf.numpy())[:n]
            while got < n:
                r = os.preadv(fd, [view[got:]], offset + got)
                if not r:
                    raise EOFError("raw: short file")
                got += r
            if self.on_gpu:
                if not hasattr(local, "stream"):
                    local.stream = torch.cuda.Stream()
                with torch.cuda.stream(local.stream):
                    dst.copy_(buf[:n], non_blocking=True)
                    event[0] = torch.cuda.Event()
                    event[0].record()
            else:
                dst.copy_(buf[:n])
            free.put((buf, event))

        try:
            with ThreadPoolExecutor(READERS) as pool:
                list(pool.map(work, jobs))
        finally:
            os.close(fd)
        self.sync()

    def _statesnap(self) -> None:
        Snapshot(self.paths["statesnap"]).restore({"m": StateDict(self.targets)})
        self.sync()

    def _torch_load(self) -> None:
        loaded = torch.load(
            os.path.join(self.paths["torch.load"], "state.pt"),
            map_location=self.device,
            weights_only=True,
        )
        for k, t in self.targets.items():
            t.copy_(loaded[k])
        self.sync()

    def _safetensors(self) -> None:
        from safetensors.torch import load_file

        loaded = load_file(
            os.path.join(self.paths["safetensors"], "state.safetensors"),
            device=str(self.device) if self.on_gpu else "cpu",
        )
        for k, t in self.targets.items():
            t.copy_(loaded[k])
        self.sync()

    def check(self, name: str) -> None:
        bad = [k for k, v in self.state.items() if not same(self.targets[k], v)]
        if bad:
            raise AssertionError(f"{name}: restored bytes differ for {bad[:5]}")
        for t in self.targets.values():
            t.view(torch.uint8).fill_(0xA5)  # the next method starts from other bytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="2GiB", type=parse_size)
    parser.add_argument("--reps", default=3, type=int)
    parser.add_argument("--temps", default="warm,cold")
    parser.add_argument("--dir", help="where the files go (default: a temp directory)")
    parser.add_argument("--methods", help="comma-separated subset (default: every method)")
    parser.add_argument(
        "--device-tile-mib",
        type=int,
        help="an experiment: the longest tile statesnap lands device bytes through "
        "(snapshot._engine.restore.reads.DEVICE_TILE_BYTES) for this run",
    )
    parser.add_argument("--cpu-dry-run", action="store_true")
    args = parser.parse_args(argv)
    if args.device_tile_mib:
        from snapshot._engine.restore import reads as landing

        landing.DEVICE_TILE_BYTES = args.device_tile_mib * MIB
    if not args.cpu_dry_run and not torch.cuda.is_available():
        print(
            "gpu_restore: no CUDA GPU is available; run it on a machine with one", file=sys.stderr
        )
        return 2
    device = torch.device("cpu") if args.cpu_dry_run else torch.device("cuda", 0)
    name = "CPU dry run" if args.cpu_dry_run else torch.cuda.get_device_name(0)
    root = tempfile.mkdtemp(prefix="gpu-restore-", dir=args.dir)
    tile = ""
    if args.device_tile_mib:
        tile = f", device tiles of {args.device_tile_mib} MiB"
    print(
        f"gpu_restore on {name}, torch {torch.__version__}, {fmt_size(args.size)}{tile}",
        flush=True,
    )
    try:
        state = _state(args.size, device)
        only = set(args.methods.split(",")) if args.methods else None
        methods = Methods(root, state, device, only)
        print(f"  {len(state)} tensors, {sum(v.nbytes for v in state.values()) / GIB:.2f} GiB")
        names = [n for n in methods.restore if only is None or n in only]
        for temp in args.temps.split(","):
            times: dict[str, list[float]] = {n: [] for n in names}
            for rep in range(args.reps):
                order = names[rep % len(names) :] + names[: rep % len(names)]
                for n in order:
                    set_page_cache(methods.paths[n], temp)
                    cached = resident_fraction(methods.paths[n])
                    t0 = time.perf_counter()
                    methods.restore[n]()
                    times[n].append(time.perf_counter() - t0)
                    methods.check(n)
                    print(f"  {temp} round {rep} {n}: {times[n][-1]:.3f} s (cached {cached:.0%})")
            total = sum(v.nbytes for v in state.values())
            base = statistics.median(times["statesnap"])
            print(f"\n{temp}, {fmt_size(args.size)} onto {name}, median of {args.reps}:\n")
            print("| method | median s | GB/s | ÷ statesnap's median | round 0 s |")
            print("| --- | --- | --- | --- | --- |")
            for n in names:
                m = statistics.median(times[n])
                print(
                    f"| {n} | {m:.3f} | {total / m / 1e9:.2f} | {m / base:.2f} | "
                    f"{times[n][0]:.3f} |"
                )
            print(flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
