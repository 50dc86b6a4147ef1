"""``--case read-object``: one 4 KiB tensor out of the ``--size`` snapshot (default 2 GiB): the
bytes read and the time, separately for ``Snapshot(path)`` (reads the manifest) and
``read_object``."""

from __future__ import annotations

import argparse
import shutil
import statistics

from benchmarks.common import (
    GIB,
    READ_OBJECT_TARGET,
    build_spec,
    describe_spec,
    fmt_size,
    set_page_cache,
)
from benchmarks.harness import (
    CaseResult,
    Row,
    Runner,
    StateCase,
    Variant,
    make_row,
)

NAME = "read-object"
DEFAULTS = {"modes": ["fsync"], "temps": ["cold", "warm"]}
LIBRARY_VARIANTS = False


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options of its own."""


def run(args: argparse.Namespace, runner: Runner) -> CaseResult:
    env = args.statesnap_env
    size = (args.size or [2 * GIB])[0]
    state = StateCase(fmt_size(size), {"kind": "model", "size": size, "seed": args.seed})
    variant = Variant("statesnap", "statesnap", [], dict(env))
    path = runner.data_dir("read-object")
    rows: list[Row] = []
    try:
        take = runner.job(
            {
                "op": "take",
                "method": "statesnap",
                "mode": "fsync",
                "state": state.args,
                "path": path,
            },
            env,
        )
        rows.append(make_row(NAME, state, 0, variant, "take", "fsync", "statesnap", take))
        if take.get("ok"):
            for rnd in range(args.reps):
                for temp in args.temps:
                    set_page_cache(path, temp)
                    result = runner.job(
                        {
                            "op": "read-object",
                            "object": list(READ_OBJECT_TARGET),
                            "state": state.args,
                            "path": path,
                        },
                        env,
                    )
                    rows.append(
                        make_row(
                            NAME,
                            state,
                            rnd,
                            variant,
                            "read-object",
                            temp,
                            "statesnap",
                            result,
                        )
                    )
    finally:
        shutil.rmtree(path, ignore_errors=True)
    reads = [r for r in rows if r.op == "read-object"]
    ok = [r for r in reads if r.ok]
    out = ["", f"#### {describe_spec(build_spec(state.args))}", ""]
    if ok:
        total = ok[0].extra.get("snapshot_bytes")
        man = ok[0].extra.get("manifest_bytes")
        out.append(
            f"Snapshot: {fmt_size(total or 0)} on disk, manifest.yaml "
            f"{fmt_size(man or 0)} ({man} bytes). Object read: "
            f"`0/{READ_OBJECT_TARGET[0]}/{READ_OBJECT_TARGET[1]}` "
            f"({ok[0].payload_bytes} bytes)."
        )
        out.append("")
    head = [
        "step",
        "cache",
        "median ms",
        "per round ms",
        "rchar (bytes through read calls)",
        "read_bytes (from the block device)",
    ]
    out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    phases: dict[str, None] = {}
    for r in ok:
        for p in r.extra.get("phases", {}):
            phases.setdefault(p, None)
    for temp in args.temps:
        sel = [r for r in ok if r.mode == temp]
        for p in phases:
            vals = [r.extra["phases"][p] for r in sel if p in r.extra.get("phases", {})]
            if not vals:
                continue
            med = statistics.median(v["seconds"] for v in vals)
            out.append(
                "| "
                + " | ".join(
                    [
                        f"`{p}`" if not p.startswith("(") else p,
                        temp,
                        f"{med * 1000:.2f}",
                        ", ".join(f"{v['seconds'] * 1000:.2f}" for v in vals),
                        ", ".join(f"{v['rchar']:,}" for v in vals),
                        ", ".join(f"{v['read_bytes']:,}" for v in vals),
                    ]
                )
                + " |"
            )
    out += [
        "",
        "Each run is a fresh process; the two read_object calls read the same bytes, so the "
        "second one finds them in the page cache even in a cold run.",
    ]
    bad = [r for r in rows if not r.ok]
    if bad:
        out += ["", f"FAILED: {bad[0].op} {bad[0].mode}: {bad[0].error}"]
    elif ok:
        out += ["", f"check: {ok[0].check}"]
    return rows, out
