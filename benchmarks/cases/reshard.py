"""``--case reshard``: a state of DTensors (``--size`` of global tensors, default 1 GiB) saved
by 4 ranks as [Shard(0)] and restored into another sharding: 4 ranks [Shard(1)], 2 ranks,
1 process (plain full tensors), and, saved by 2 ranks, 4 ranks; statesnap against DCP, ratio
DCP ÷ statesnap per scenario."""

from __future__ import annotations

import argparse
import shutil
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.common import (
    GIB,
    build_spec,
    describe_spec,
    fmt_size,
    fsync_tree,
    resident_fraction,
    set_page_cache,
)
from benchmarks.harness import (
    CaseResult,
    Row,
    Runner,
    StateCase,
    Variant,
    fmt_ratio,
    fmt_s,
    group_by,
    loads_into,
    log,
    make_row,
    median,
    mib,
    round_ratios,
    status,
)
from benchmarks.harness.cli import csv_list
from benchmarks.methods import (
    RESHARD_METHODS,
)

NAME = "reshard"
DEFAULTS = {"modes": ["fsync"], "temps": ["warm"]}
LIBRARY_VARIANTS = False


@dataclass(frozen=True)
class Scenario:
    """A resharding restore: what saved the state (``saved_world`` ranks, [Shard(0)]) and what
    restores it (``world`` ranks, targets of ``layout``; see ``common.LAYOUTS``)."""

    name: str
    saved_world: int
    world: int
    layout: str
    title: str


RESHARD_SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("dim0-to-dim1", 4, 4, "shard1", "4 ranks [Shard(0)] -> 4 ranks [Shard(1)]"),
        Scenario("4to2", 4, 2, "shard0", "4 ranks [Shard(0)] -> 2 ranks [Shard(0)]"),
        Scenario("4to1", 4, 1, "full", "4 ranks [Shard(0)] -> 1 process, plain full tensors"),
        Scenario("2to4", 2, 4, "shard0", "2 ranks [Shard(0)] -> 4 ranks [Shard(0)]"),
    )
}
RESHARD_METHOD_NAMES = ["statesnap", "dcp"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--scenarios",
        type=csv_list,
        help="reshard: which restores, comma-separated, default all: "
        + ", ".join(f"{sc.name} ({sc.title})" for sc in RESHARD_SCENARIOS.values()),
    )


def needed_bytes(args: argparse.Namespace) -> int:
    """Every method's save of the state is on disk at once."""
    size = (args.size or [GIB])[0]
    return int(size * 1.2) * len(args.methods or RESHARD_METHODS) + GIB


def _saved_label(world: int) -> str:
    return f"saved by {world} ranks, [Shard(0)]"


def run_reshard_rounds(
    runner: Runner,
    size: int,
    seed: int,
    scenarios: Sequence[Scenario],
    methods: Sequence[str],
    mode: str,
    temps: Sequence[str],
    reps: int,
    env: dict[str, str],
) -> list[Row]:
    """Per round and per saving world size (4 ranks first): each method saves the state to a
    fresh directory (untimed setup, recorded as a take), the harness fsyncs the files; then per
    scenario restored from that save, per page-cache state, each method restores; then the files
    are removed. Methods are interleaved within each scenario."""
    rows: list[Row] = []
    saved_worlds = sorted({sc.saved_world for sc in scenarios}, reverse=True)
    variants = {m: Variant(m, m, [m], dict(env) if m == "statesnap" else {}) for m in methods}
    base = {"kind": "dtensors", "size": size, "seed": seed}

    def restore(rnd: int, state: StateCase, temp: str, m: str, path: str | None) -> Row:
        if path is None:
            failed = {"ok": False, "error": "its save failed"}
            return make_row(NAME, state, rnd, variants[m], "restore", temp, m, failed)
        set_page_cache(path, temp)
        cached = resident_fraction(path)
        job = {
            "op": "reshard-restore",
            "method": m,
            "mode": temp,
            "state": state.args,
            "path": path,
        }
        result = runner.job(job, variants[m].env)
        extra = {"cached_before": cached}
        return make_row(NAME, state, rnd, variants[m], "restore", temp, m, result, extra)

    for rnd in range(reps):
        log(f"round {rnd + 1}/{reps}")
        for saved in saved_worlds:
            saved_state = StateCase(
                _saved_label(saved), {**base, "world_size": saved, "layout": "shard0"}
            )
            made: list[str] = []
            saved_ok: dict[str, str] = {}
            try:
                for m in methods:
                    path = runner.data_dir(f"reshard-{m}-{saved}")
                    shutil.rmtree(path, ignore_errors=True)
                    made.append(path)
                    job = {
                        "op": "reshard-take",
                        "method": m,
                        "mode": mode,
                        "state": saved_state.args,
                        "path": path,
                    }
                    take = runner.job(job, variants[m].env)
                    rows.append(
                        make_row(NAME, saved_state, rnd, variants[m], "take", mode, m, take)
                    )
                    if take.get("ok"):
                        fsync_tree(path)  # untimed: no dirty pages of the save linger
                        saved_ok[m] = path
                for sc in scenarios:
                    if sc.saved_world != saved:
                        continue
                    state = StateCase(
                        sc.name, {**base, "world_size": sc.world, "layout": sc.layout}
                    )
                    for temp in temps:
                        for m in methods:
                            rows.append(restore(rnd, state, temp, m, saved_ok.get(m)))
            finally:
                for path in made:
                    shutil.rmtree(path, ignore_errors=True)
    return rows


def _rchar_share(rows: Sequence[Row]) -> str:
    """Median over rounds of the bytes all ranks read through read calls (``rchar``, page cache
    included) ÷ the global bytes restored."""
    shares = [
        r.extra["io"]["rchar"] / r.payload_bytes
        for r in rows
        if r.ok and r.payload_bytes and (r.extra.get("io") or {}).get("rchar") is not None
    ]
    return f"{statistics.median(shares):.2f}x" if shares else "—"


def reshard_tables(
    rows: Sequence[Row], scenarios: Sequence[Scenario], methods: Sequence[str], temp: str
) -> list[str]:
    """The restores of one page-cache state: a row per scenario and method (medians, GB/s,
    per-round seconds, peak RSS, bytes read, in place or not, check), then the ratio DCP ÷
    statesnap per scenario."""
    head = [
        "scenario",
        "method",
        "median s",
        "GB/s",
        "per round s",
        "peak RSS above baseline (max over ranks)",
        "read (rchar, all ranks) ÷ state",
        "loads into",
        "check",
    ]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for sc in scenarios:
        for m in methods:
            mine = [
                r
                for r in rows
                if r.state == sc.name and r.method == m and r.op == "restore" and r.mode == temp
            ]
            if not mine:
                continue
            ok = [r for r in mine if r.ok and r.seconds]
            med = median(r.seconds for r in ok)  # type: ignore[misc]
            rss = median(r.peak_rss for r in ok if r.peak_rss is not None)
            payload = mine[0].payload_bytes or next((r.payload_bytes for r in mine), 0)
            cells = [
                f"{sc.name}: {sc.title}",
                m,
                fmt_s(med),
                f"{payload / med / 1e9:.2f}" if med and payload else "—",
                ", ".join(fmt_s(r.seconds) if r.ok and r.seconds else "✗" for r in mine),
                fmt_size(rss) if rss is not None else "—",
                _rchar_share(ok),
                loads_into(mine),
                status(mine, "restore"),
            ]
            out.append("| " + " | ".join(cells) + " |")
    if "statesnap" not in methods or "dcp" not in methods:
        return out
    out += [
        "",
        "**resharding restore, statesnap vs DCP: ratio DCP ÷ statesnap per scenario (median, "
        "per round)** (above 1 means statesnap is faster; seconds are medians, each the slowest "
        "rank's time from a barrier before the call to a barrier after it)",
        "",
        "| scenario | statesnap s | dcp s | DCP ÷ statesnap |",
        "|---|---|---|---|",
    ]
    for sc in scenarios:
        sel = [r for r in rows if r.state == sc.name and r.op == "restore" and r.mode == temp]
        mine = [r for r in sel if r.method == "statesnap"]
        theirs = [r for r in sel if r.method == "dcp"]
        if not mine and not theirs:
            continue
        fails = [r for r in mine + theirs if not r.ok]
        note = f" — {status(fails, 'restore')} ({fails[0].method})" if fails else ""
        out.append(
            f"| {sc.name}: {sc.title} | "
            f"{fmt_s(median(r.seconds for r in mine if r.ok and r.seconds))} | "
            f"{fmt_s(median(r.seconds for r in theirs if r.ok and r.seconds))} | "
            f"{fmt_ratio(round_ratios(theirs, mine))}{note} |"
        )
    return out


def reshard_save_table(rows: Sequence[Row], mode: str) -> list[str]:
    """The saves (untimed setup of the restores, shown for the record): seconds, bytes on
    disk."""
    saves = [r for r in rows if r.op == "take"]
    head = ["saved by", "method", "median s", "per round s", "on disk", "status"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (state, label), mine in group_by(saves, lambda r: (r.state, r.label)).items():
        ok = [r for r in mine if r.ok and r.seconds]
        disk = next((r.disk for r in reversed(ok) if r.disk), None)
        out.append(
            "| "
            + " | ".join(
                [
                    state,
                    label,
                    fmt_s(median(r.seconds for r in ok)),  # type: ignore[misc]
                    ", ".join(fmt_s(r.seconds) if r.ok and r.seconds else "✗" for r in mine),
                    f"{mib(disk['apparent'])} in {disk['files']} files" if disk else "—",
                    status(mine, "take"),
                ]
            )
            + " |"
        )
    return out


def run(args: argparse.Namespace, runner: Runner) -> CaseResult:
    env = args.statesnap_env
    size = (args.size or [GIB])[0]
    methods = args.methods or RESHARD_METHOD_NAMES
    for m in methods:
        if m not in RESHARD_METHODS:
            raise SystemExit(
                f"--case reshard: unknown method {m!r}; known: {', '.join(RESHARD_METHODS)}"
            )
    names = args.scenarios or list(RESHARD_SCENARIOS)
    for n in names:
        if n not in RESHARD_SCENARIOS:
            raise SystemExit(
                f"--case reshard: unknown scenario {n!r}; known: {', '.join(RESHARD_SCENARIOS)}"
            )
    scenarios = [RESHARD_SCENARIOS[n] for n in names]
    if len(args.modes) != 1:
        raise SystemExit("--case reshard: one --modes (how the saves are made): fsync or cache")
    mode = args.modes[0]
    rows = run_reshard_rounds(
        runner, size, args.seed, scenarios, methods, mode, args.temps, args.reps, env
    )
    spec = build_spec({"kind": "dtensors", "size": size, "seed": args.seed})
    saves = (
        "fsync'd (statesnap's default; DCP `sync_files=True`, its default)"
        if mode == "fsync"
        else 'to the page cache (statesnap `storage_options={"fsync": False}`, DCP '
        "`sync_files=False`)"
    )
    out = [
        "",
        f"#### {describe_spec(spec)}",
        "",
        'Every tensor is a DTensor on a CPU device mesh `init_device_mesh("cpu", (world,))` '
        "of a gloo process group, new for every operation (one process per rank on this "
        "machine); its values are deterministic from the seed, and each rank builds its piece "
        "with `DTensor.from_local` (no communication). Per round, each method saves the state "
        "with every tensor [Shard(0)] (on 4 ranks; on 2 for 2to4) to a fresh directory, "
        f"{saves}, untimed setup (the harness then fsyncs the files); then each scenario "
        "restores it, the methods one after the other. Targets are zero-filled DTensors of the "
        "new placement on a mesh of the restoring group (1-D tensors [Shard(0)]), or plain "
        "full tensors in one process; they are filled in place. Restores are "
        + ", ".join(
            "warm (the files in the page cache)" if t == "warm" else "cold (dropped first)"
            for t in args.temps
        )
        + ".",
        "",
        "Seconds: the slowest rank's, from a barrier before the call to a barrier after it. "
        "GB/s: the global bytes restored (the whole state, however it is split) ÷ seconds, "
        "GB = 10⁹ bytes. Peak RSS: each rank's peak above its RSS right before the call (its "
        "targets already allocated), the largest of the ranks, median over rounds. Read: bytes "
        "all ranks passed through read calls (`rchar`, page cache included, manifests and "
        "metadata too) ÷ the global bytes. Check: after the call each rank compares every "
        "target's local tensor with its piece of the regenerated global tensor, bitwise; "
        "'preallocated' means every target and its local memory were kept.",
    ]
    for temp in args.temps:
        title = "warm (files in the page cache)" if temp == "warm" else "cold (files dropped first)"
        out += ["", f"**Restore into another sharding, {title}**", ""]
        out += reshard_tables(rows, scenarios, methods, temp)
    out += [
        "",
        "**The saves** (untimed setup of the restores, for the record)",
        "",
        *reshard_save_table(rows, mode),
    ]
    notes = []
    for m in methods:
        notes.append(f"- {m} save: {RESHARD_METHODS[m].save_note}")
        notes.append(f"- {m} restore: {RESHARD_METHODS[m].load_note}")
    out += ["", "Methods:", *notes]
    return rows, out
