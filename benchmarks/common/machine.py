"""The machine a run measures, and a check of the harness's tools on it:
``python -m benchmarks.common`` prints the machine description, then whether the peak-RSS reset
and the page-cache drop work here."""

from __future__ import annotations

import argparse
import gc
import os
import platform
import re
import subprocess
import time

import torch

from benchmarks.common.states import GIB, KIB, MIB, build_spec, describe_spec, fmt_size
from benchmarks.common.system import (
    drop_page_cache,
    fsync_tree,
    peak_rss,
    reported_kib,
    reset_peak_rss,
    resident_fraction,
)
from benchmarks.common.tensors import writable_buffer

# ---------------------------------------------------------------------------------------------
# Machine description.


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def library_commit(repo: str) -> str:
    """Short commit of the library checkout, with ``+dirty`` when its library code has changes
    not committed (the benchmarks directory itself is not counted)."""
    try:
        head = subprocess.run(
            ["git", "-C", repo, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            [
                "git",
                "-C",
                repo,
                "status",
                "--porcelain",
                "--",
                "snapshot",
                "storage_plugins",
                "manifest",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def machine_description(directory: str) -> list[str]:
    """Markdown bullet lines: CPU, cores, RAM, kernel, filesystem of ``directory``, versions."""
    cpuinfo = _read("/proc/cpuinfo")
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
    meminfo = _read("/proc/meminfo")
    mem = re.search(r"^MemTotal:\s*(\d+) kB", meminfo, re.M)
    swap = re.search(r"^SwapTotal:\s*(\d+) kB", meminfo, re.M)
    lines = [
        f"- CPU: {model.group(1).strip() if model else platform.processor() or 'unknown'}, "
        f"{os.cpu_count()} logical cores (torch uses {torch.get_num_threads()} threads)",
        f"- RAM: {fmt_size(int(mem.group(1)) * KIB) if mem else 'unknown'}, swap "
        f"{fmt_size(int(swap.group(1)) * KIB) if swap else 'unknown'}",
        f"- kernel: {platform.release()}",
    ]
    try:
        df = (
            subprocess.run(
                ["df", "-T", "-h", directory], capture_output=True, text=True, check=True
            )
            .stdout.splitlines()[-1]
            .split()
        )
        lines.append(f"- scratch dir {directory}: {df[1]} on {df[0]}, {df[2]} in all, {df[4]} free")
    except (OSError, subprocess.CalledProcessError, IndexError):
        lines.append(f"- scratch dir {directory}: filesystem unknown")
    versions = [f"Python {platform.python_version()}", f"torch {torch.__version__}"]
    for name in ("safetensors", "torchsnapshot", "numpy"):
        try:
            from importlib.metadata import version

            versions.append(f"{name} {version(name)}")
        except Exception:
            versions.append(f"{name} not installed")
    lines.append("- " + ", ".join(versions))
    reported = reported_kib()
    if reported is not None:
        lines.append(
            f"- free page reporting: on ({fmt_size(reported * KIB)} handed back to the host so "
            "far): memory freed a few seconds ago costs host faults when allocated again"
        )
    return lines


# ---------------------------------------------------------------------------------------------
# Self-check: does the peak reset work here, does the page-cache drop work here?


def _read_speed(path: str, buf: memoryview) -> float:
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        pos = 0
        while pos < len(buf):
            n = f.readinto(buf[pos:])
            if not n:
                break
            pos += n
    return len(buf) / (time.perf_counter() - t0) / 1e9


def self_check(directory: str, nbytes: int = 512 * MIB) -> list[str]:
    """Verifies the measuring tools on this machine; returns markdown bullet lines."""
    lines: list[str] = []
    # 1. Peak RSS reset.
    before = peak_rss()
    blob = torch.ones(256 * MIB // 4)
    grown = peak_rss()
    del blob
    gc.collect()
    ok = reset_peak_rss()
    after = peak_rss()
    lines.append(
        f"- peak-RSS reset (`echo 5 > /proc/self/clear_refs`): "
        f"{'works' if ok else 'does NOT work (the harness samples VmRSS instead)'}: VmHWM "
        f"{fmt_size(before)} -> {fmt_size(grown)} after touching 256 MiB -> {fmt_size(after)} "
        f"after freeing it and resetting"
    )
    # 2. Page-cache drop.
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"cache-check-{os.getpid()}.bin")
    try:
        data = torch.empty(nbytes, dtype=torch.uint8)
        data.random_(0, 256, generator=torch.Generator().manual_seed(0))
        buf = writable_buffer(data)
        with open(path, "wb") as f:
            f.write(buf)
        fsync_tree(path)
        warm = [_read_speed(path, buf) for _ in range(2)]
        res_warm = resident_fraction(path)
        cold = []
        res_cold = []
        for _ in range(2):
            drop_page_cache(path)
            res_cold.append(resident_fraction(path))
            cold.append(_read_speed(path, buf))
        lines.append(
            f"- page-cache drop (fsync + `posix_fadvise(DONTNEED)`): "
            f"{'works' if max(res_cold) < 0.01 and min(warm) > 1.3 * max(cold) else 'UNCLEAR'}"
            f": {fmt_size(nbytes)} file, resident {res_warm:.0%} before / "
            f"{max(res_cold):.0%} after the drop (mincore); read into preallocated memory "
            f"{min(warm):.2f}-{max(warm):.2f} GB/s warm vs {min(cold):.2f}-{max(cold):.2f} GB/s "
            f"after the drop"
        )
    finally:
        if os.path.exists(path):
            os.remove(path)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description="Checks the harness's measuring tools here.")
    parser.add_argument("--dir", default="/tmp/statesnap-bench", help="scratch directory")
    parser.add_argument(
        "--describe",
        action="store_true",
        help="print only the machine description and the state layouts",
    )
    args = parser.parse_args()
    created = not os.path.isdir(args.dir)
    os.makedirs(args.dir, exist_ok=True)
    try:
        for line in machine_description(args.dir):
            print(line)
        if args.describe:
            for size in (512 * MIB, 2 * GIB):
                print("- " + describe_spec(build_spec({"kind": "model", "size": size})))
            return
        for line in self_check(args.dir):
            print(line)
    finally:
        if created:
            os.rmdir(args.dir)


if __name__ == "__main__":
    main()
