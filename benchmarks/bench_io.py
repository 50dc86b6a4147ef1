"""Save/restore benchmarks of statesnap against raw file I/O, torch.save, DCP, safetensors and
torchsnapshot, in one process or across a process group. Prints paste-ready markdown tables;
see benchmarks/README.md.

Every measured operation runs in a fresh process (``benchmarks.worker``); methods are
interleaved in rounds (A B C ... A B C ...), and tables give medians over the rounds together
with each round's ratio to the ``raw`` method and to statesnap. Before its timed call each worker
waits until the kernel has stopped handing freed memory back to the host (``--settle-memory``,
on by default; a no-op on a machine without free page reporting): on a VM that reports free
pages, what the previous seconds freed otherwise decides how fast the next write to the page
cache runs (``common.settle_memory``).

Cases (``--case``):
  main            the generated model+optimizer state at each ``--size``: take to the page cache
                  and fsync'd, restore warm (files cached) and cold (dropped from the cache).
  many-small      20,000 tensors totalling 200 MiB vs one 200 MiB tensor; ratio many / single.
  restore-memory  peak RSS above baseline of an in-place statesnap restore of the 2 GiB state
                  with STATESNAP_MEMORY_BUDGET_BYTES=64MiB, against torch.load and raw reads.
  read-object     one 4 KiB tensor out of a 2 GiB snapshot: bytes read and time, separately
                  for Snapshot(path) (reads the manifest) and read_object.
  scaling         10,000 vs 100,000 leaves: take, restore, Snapshot(path)+get_manifest.
  dist            a process group of 1, 2 and 4 ranks (gloo, CPU, real processes): statesnap
                  take/restore with the model marked replicated against DCP save/load, which
                  also writes keys that every rank has once; time statesnap ÷ DCP per world size.
  async           how long statesnap's async_take blocks the caller (first call in a process,
                  later calls), against its take, plain CPU copies of the state, torchsnapshot's
                  async_take and DCP's async_save; totals to completion; whether each wrote the
                  state as it was at call time while the caller changed every tensor; RSS and
                  staging-pool bytes over a series of async takes in one process.
  async-loop      a small MLP trained on CPU: steps/s without snapshots, with a take and with
                  an async_take every N steps.
  checksums       the 2 GiB state taken and restored by statesnap with and without checksums
                  (STATESNAP_CHECKSUMS=0), and raw: what computing and verifying them costs.
  s3              the state at 128 MiB and 1 GiB taken to and restored from a local S3 server
                  (moto's, in a process of its own): statesnap's S3 plugin against one raw
                  multipart upload stream / one streaming GET, torch.save + s3fs pipe,
                  torchsnapshot's S3 plugin and DCP's fsspec writer/reader; the server's CPU
                  time during each call, and the targets.
  reshard         a state of DTensors (1 GiB of global tensors) saved by 4 ranks as [Shard(0)]
                  and restored into another sharding: 4 ranks [Shard(1)], 2 ranks, 1 process
                  (plain full tensors), and, saved by 2 ranks, 4 ranks; statesnap against DCP,
                  ratio DCP ÷ statesnap per scenario.

Example: ``python -m benchmarks.bench_io --case main --size 512MiB --reps 1``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from benchmarks.common import (
    GIB,
    MIB,
    READ_OBJECT_TARGET,
    SETTLE_QUIET_SECONDS,
    build_spec,
    check_restored,
    describe_spec,
    fmt_size,
    fsync_tree,
    library_commit,
    machine_description,
    parse_size,
    reap,
    resident_fraction,
    set_page_cache,
)
from benchmarks.methods import (
    ASYNC_METHODS,
    GROUP_READERS,
    GROUP_WRITERS,
    READERS,
    REPLICATED,
    RESHARD_METHODS,
    S3_READERS,
    S3_WRITERS,
    WRITERS,
    AsyncMethod,
    Reader,
    Writer,
    readers_of,
)
from benchmarks.s3server import S3Server

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_METHODS = [
    "raw",
    "raw-direct",
    "torch.save",
    "dcp",
    "safetensors",
    "torchsnapshot",
    "statesnap",
    "statesnap-buffered",
]
MODE_TITLES = {
    "cache": "Take, to the page cache (no fsync)",
    "fsync": "Take, fsync'd (methods that do not fsync get their files fsync'd by the harness, "
    "timed)",
    "warm": "Restore, warm (files in the page cache)",
    "cold": "Restore, cold (files dropped from the page cache first)",
}


# ---------------------------------------------------------------------------------------------
# What to run.


@dataclass
class Variant:
    """A row family: one writer, the readers that load its files, and env for its workers."""

    label: str
    writer: str
    readers: list[str]
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class StateCase:
    """A generated state to run the variants on."""

    label: str
    args: dict[str, Any]


@dataclass
class Row:
    """One measured operation."""

    case: str
    state: str
    round: int
    variant: str
    writer: str  # the variant's writer
    op: str  # take | restore | read-object
    mode: str  # cache | fsync | warm | cold
    method: str  # writer or reader name
    ok: bool
    seconds: float | None = None
    payload_bytes: int = 0
    peak_rss: int | None = None
    baseline_rss: int | None = None
    disk: dict[str, int] | None = None
    check: str = ""
    in_place: bool | None = None
    error: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """Table label: the reader's name, or the variant's for its main reader/writer."""
        return self.variant if self.method == self.writer else self.method


# A case's measurements and the markdown lines it prints.
CaseResult = tuple[list[Row], list[str]]

# ---------------------------------------------------------------------------------------------
# Running workers.


class Runner:
    """Starts one worker process per job (or, for a job of a process group, one per rank), each
    in its own session, and never leaves one behind.

    Data lives in ``<dir>/run-<pid>/``, removed on exit (also on Ctrl-C and SIGTERM).
    """

    def __init__(
        self,
        directory: str,
        timeout: float,
        base_env: dict[str, str],
        group_grace: float = 120.0,
        settle_memory: bool = False,
    ) -> None:
        self.created_dir = not os.path.isdir(directory)
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.run_dir = os.path.join(directory, f"run-{os.getpid()}")
        os.makedirs(self.run_dir)
        self.timeout = timeout
        self.group_grace = group_grace
        self.base_env = base_env
        self.procs: list[subprocess.Popen[bytes]] = []
        self.n = 0
        # Each worker waits for the memory to settle before its timed call
        # (``common.settle_memory``); the seconds each waited.
        self.settle_memory = settle_memory
        self.settle_waits: list[float] = []

    def data_dir(self, name: str) -> str:
        return os.path.join(self.run_dir, re.sub(r"[^A-Za-z0-9.]+", "-", name))

    def job(self, job: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
        """Runs one measured operation and returns its result.

        When the job's state names a ``world_size``, that many workers run it as the ranks of
        one gloo process group (a FileStore in the run directory, new for every operation), and
        their results are merged by :func:`merge_ranks`.
        """
        world_size = int(job.get("state", {}).get("world_size") or 0)
        if not world_size:
            return self._run([job], env)[0]
        store = os.path.join(self.run_dir, f"store{self.n + 1}")
        ranks = [
            {**job, "rank": r, "world_size": world_size, "store": store} for r in range(world_size)
        ]
        try:
            return merge_ranks(self._run(ranks, env))
        finally:
            if os.path.exists(store):
                os.remove(store)

    def _run(self, jobs: Sequence[dict[str, Any]], env: dict[str, str]) -> list[dict[str, Any]]:
        """Starts a worker per job, all at once, waits for all of them; their results in order."""
        stems = []
        for job in jobs:
            self.n += 1
            stem = os.path.join(self.run_dir, f"job{self.n}")
            with open(stem + ".json", "w") as f:
                json.dump(
                    {**job, "result": stem + ".result.json", "settle_memory": self.settle_memory},
                    f,
                )
            stems.append(stem)
        child_env = {**os.environ, **self.base_env, **env}
        with contextlib.ExitStack() as logs:
            try:
                for stem in stems:
                    log = logs.enter_context(open(stem + ".log", "wb"))
                    self.procs.append(
                        subprocess.Popen(
                            [sys.executable, "-m", "benchmarks.worker", stem + ".json"],
                            cwd=REPO,
                            env=child_env,
                            stdout=log,
                            stderr=subprocess.STDOUT,
                            start_new_session=True,
                        )
                    )
                killed = self._wait()
                codes = [p.returncode for p in self.procs]
            except BaseException:  # Ctrl-C or SIGTERM: each worker is in its own session
                self.kill()
                raise
            finally:
                self.procs = []
        return [
            self._result(stem, why or f"exit code {code}")
            for stem, why, code in zip(stems, killed, codes, strict=True)
        ]

    def _wait(self) -> list[str | None]:
        """Waits for every running worker. Kills those still running after ``timeout``, or
        ``group_grace`` seconds after another worker of the same operation exited (a rank that
        died leaves the others waiting in a collective). Per worker: why it was killed, or
        None."""
        start = time.monotonic()
        first_exit: float | None = None
        while True:
            codes = [p.poll() for p in self.procs]
            if all(c is not None for c in codes):
                return [None] * len(codes)
            now = time.monotonic()
            if first_exit is None and any(c is not None for c in codes):
                first_exit = now
            why = None
            if now - start > self.timeout:
                why = f"timed out after {self.timeout:.0f} s"
            elif first_exit is not None and now - first_exit > self.group_grace:
                why = f"still running {self.group_grace:.0f} s after another rank exited"
            if why is not None:
                self.kill()
                return [why if c is None else None for c in codes]
            time.sleep(0.02)

    def _result(self, stem: str, why: str) -> dict[str, Any]:
        """The worker's result file, or a failure built from its log; removes its files."""
        try:
            with open(stem + ".result.json") as f:
                result: dict[str, Any] = json.load(f)
        except (OSError, ValueError):
            with open(stem + ".log", "rb") as f:
                tail = f.read()[-600:].decode(errors="replace").strip().splitlines()
            result = {"ok": False, "error": f"worker {why}: {' | '.join(tail[-3:])}"}
        if isinstance(result.get("settled_seconds"), (int, float)):
            self.settle_waits.append(float(result["settled_seconds"]))
        for suffix in (".json", ".result.json", ".log"):
            if os.path.exists(stem + suffix):
                os.remove(stem + suffix)
        return result

    def kill(self) -> None:
        """Kills each running worker's process group (by its id) and reaps it."""
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                reap(proc)

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.run_dir, ignore_errors=True)
        if self.created_dir:
            try:
                os.rmdir(self.directory)
            except OSError:
                pass


def merge_ranks(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One result for an operation of a process group, from each rank's.

    It is ok when every rank's is; seconds, peak RSS and baseline RSS are the largest of any
    rank, bytes on disk and the payload rank 0's, I/O counters the sum over ranks; each rank's
    own figures (and any error with its traceback) are kept under ``ranks``.
    """
    per_rank = [
        {
            "rank": r,
            **{
                k: res.get(k)
                for k in (
                    "ok",
                    "seconds",
                    "own_seconds",
                    "peak_rss_above_baseline",
                    "io",
                    "check",
                    "in_place",
                    "error",
                    "traceback",
                )
                if k in res
            },
        }
        for r, res in enumerate(results)
    ]
    failed = [(r, res) for r, res in enumerate(results) if not res.get("ok")]
    if failed:
        # A rank that died or was killed first: the others' errors are usually its echo.
        r, res = min(failed, key=lambda f: not str(f[1].get("error", "")).startswith("worker "))
        others = f" (ranks {[f[0] for f in failed]} of {len(results)} failed)"
        return {
            "ok": False,
            "error": f"rank {r}: {res.get('error', 'no result')}{others}",
            "ranks": per_rank,
        }
    checks = [res.get("check") or {"ok": True, "detail": ""} for res in results]
    bad = [(r, c) for r, c in enumerate(checks) if not c.get("ok")]
    if bad:
        check = {"ok": False, "detail": f"rank {bad[0][0]}: {bad[0][1].get('detail')}"}
    elif all(c.get("detail") == checks[0].get("detail") for c in checks):
        inner = str(checks[0].get("detail", "")).removeprefix("ok ").strip("()")
        who = f"each of {len(results)} ranks" if len(results) > 1 else "1 rank"
        check = {"ok": True, "detail": f"ok ({who}: {inner})"}
    else:
        check = {
            "ok": True,
            "detail": "ok ("
            + "; ".join(
                f"rank {r}: {str(c.get('detail')).removeprefix('ok ').strip('()')}"
                for r, c in enumerate(checks)
            )
            + ")",
        }
    flags = {res.get("in_place") for res in results}
    ios = [res["io"] for res in results if res.get("io")]
    return {
        "ok": True,
        "seconds": max(res["seconds"] for res in results),
        "payload_bytes": results[0].get("payload_bytes", 0),
        "peak_rss_above_baseline": max(res["peak_rss_above_baseline"] for res in results),
        "baseline_rss": max(res["baseline_rss"] for res in results),
        "rss_method": results[0].get("rss_method"),
        "disk": results[0].get("disk"),
        "io": {k: sum(io[k] for io in ios) for k in ios[0]} if ios else None,
        "check": check,
        "in_place": flags.pop() if len(flags) == 1 else False,
        "ranks": per_rank,
    }


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _row(
    case: str,
    state: StateCase,
    rnd: int,
    variant: Variant,
    op: str,
    mode: str,
    method: str,
    result: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> Row:
    check = result.get("check") or {}
    ok = bool(result.get("ok")) and bool(check.get("ok", True))
    row = Row(
        case=case,
        state=state.label,
        round=rnd,
        variant=variant.label,
        writer=variant.writer,
        op=op,
        mode=mode,
        method=method,
        ok=ok,
        seconds=result.get("seconds"),
        payload_bytes=result.get("payload_bytes", 0),
        peak_rss=result.get("peak_rss_above_baseline"),
        baseline_rss=result.get("baseline_rss"),
        disk=result.get("disk"),
        check=check.get("detail", ""),
        in_place=result.get("in_place"),
        error=result.get("error", "") or ("" if check.get("ok", True) else check.get("detail")),
        extra={
            k: v
            for k, v in result.items()
            if k
            in (
                "io",
                "phases",
                "manifest_bytes",
                "snapshot_bytes",
                "rss_method",
                "ranks",
                "traceback",
            )
        }
        | (extra or {}),
    )
    speed = (
        f"{row.seconds:.3f} s ({row.payload_bytes / row.seconds / 1e9:.2f} GB/s)"
        if row.ok and row.seconds
        else ""
    )
    _log(
        f"  [{state.label} round {rnd + 1}] {row.label} {op} {mode}: "
        f"{speed if row.ok else 'FAILED ' + row.error}"
    )
    return row


def run_rounds(
    runner: Runner,
    case: str,
    states: Sequence[StateCase],
    variants: Sequence[Variant],
    modes: Sequence[str],
    temps: Sequence[str],
    reps: int,
) -> list[Row]:
    """For each round, each state and each variant: a take in every mode (the last one's files
    stay), then every reader warm, then every reader cold; then the files are removed."""
    rows: list[Row] = []
    for rnd in range(reps):
        _log(f"round {rnd + 1}/{reps}")
        for state in states:
            for v in variants:
                path = runner.data_dir(v.label)
                take: dict[str, Any] = {"ok": False, "error": "no take ran"}
                try:
                    for mode in modes:
                        shutil.rmtree(path, ignore_errors=True)
                        take = runner.job(
                            {
                                "op": "take",
                                "method": v.writer,
                                "mode": mode,
                                "state": state.args,
                                "path": path,
                            },
                            v.env,
                        )
                        rows.append(_row(case, state, rnd, v, "take", mode, v.writer, take))
                    if not v.readers or not temps:
                        continue
                    if take.get("ok"):
                        fsync_tree(path)  # untimed: no dirty pages of the take linger
                    for temp in temps:
                        for reader in v.readers:
                            if not take.get("ok"):
                                failed = {"ok": False, "error": "its take failed"}
                                rows.append(
                                    _row(case, state, rnd, v, "restore", temp, reader, failed)
                                )
                                continue
                            set_page_cache(path, temp)
                            cached = resident_fraction(path)
                            result = runner.job(
                                {
                                    "op": "restore",
                                    "method": reader,
                                    "mode": temp,
                                    "state": state.args,
                                    "path": path,
                                },
                                v.env,
                            )
                            rows.append(
                                _row(
                                    case,
                                    state,
                                    rnd,
                                    v,
                                    "restore",
                                    temp,
                                    reader,
                                    result,
                                    {"cached_before": cached},
                                )
                            )
                finally:
                    shutil.rmtree(path, ignore_errors=True)
    return rows


# ---------------------------------------------------------------------------------------------
# Tables.


def fmt_s(seconds: float | None) -> str:
    """Seconds with about three significant digits."""
    if seconds is None:
        return "—"
    if seconds < 0.1:
        return f"{seconds:.4f}"
    return f"{seconds:.3f}" if seconds < 10 else f"{seconds:.2f}"


def _median(values: Iterable[float]) -> float | None:
    vals = list(values)
    return statistics.median(vals) if vals else None


def _fmt_ratio(ratios: Sequence[float]) -> str:
    if not ratios:
        return "—"
    med = statistics.median(ratios)
    if len(ratios) == 1:
        return f"{med:.2f}"
    return f"{med:.2f} ({', '.join(f'{r:.2f}' for r in ratios)})"


def _round_ratios(mine: Sequence[Row], ref: Sequence[Row]) -> list[float]:
    by_round = {r.round: r for r in ref if r.ok and r.seconds}
    return [
        m.seconds / by_round[m.round].seconds
        for m in mine
        if m.ok and m.seconds and m.round in by_round
    ]


def _group(rows: Iterable[Row]) -> dict[str, list[Row]]:
    out: dict[str, list[Row]] = {}
    for r in rows:
        out.setdefault(r.label, []).append(r)
    return out


def _status(rows: Sequence[Row], op: str) -> str:
    bad = [r for r in rows if not r.ok]
    good = [r for r in rows if r.ok]
    text = ""
    if good:
        text = "ok" if op == "take" else good[0].check.removeprefix("ok ").strip("()")
        text = "ok" if op == "take" else f"ok, {text}"
    if bad:
        err = bad[0].error.replace("|", "\\|").replace("\n", " ")[:200]
        text = f"FAILED {len(bad)}/{len(rows)}: {err}" + (f"; otherwise {text}" if text else "")
    return text


def _loads_into(rows: Sequence[Row]) -> str:
    if rows and rows[0].method in READERS and READERS[rows[0].method].verify is not check_restored:
        return "n/a"
    flags = {r.in_place for r in rows if r.ok}
    if flags == {True}:
        return "preallocated"
    if flags == {None}:
        return "new tensors"
    if flags == {False}:
        return "new tensors (targets replaced)"
    return "—"


def op_table(
    rows: Sequence[Row],
    op: str,
    mode: str,
    refs: Sequence[str] = ("raw", "statesnap"),
) -> list[str]:
    """Markdown table of one op/mode of one state: medians, ratios per round, RSS, disk, check."""
    rows = [r for r in rows if r.op == op and r.mode == mode]
    if not rows:
        return []
    groups = _group(rows)
    refs = [ref for ref in refs if ref in groups]
    head = ["method", "median s", "GB/s"] + [f"time ÷ {ref}" for ref in refs]
    head += ["per round s", "peak RSS above baseline"]
    head += ["on disk"] if op == "take" else ["loads into"]
    head += ["check"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, mine in groups.items():
        ok = [r for r in mine if r.ok and r.seconds is not None]
        med = _median(r.seconds for r in ok)  # type: ignore[misc]
        payload = mine[0].payload_bytes
        cells = [label, fmt_s(med), f"{payload / med / 1e9:.2f}" if med else "—"]
        cells += [_fmt_ratio(_round_ratios(mine, groups[ref])) for ref in refs]
        cells.append(", ".join(fmt_s(r.seconds) if r.ok and r.seconds else "✗" for r in mine))
        rss = _median(r.peak_rss for r in ok if r.peak_rss is not None)
        cells.append(fmt_size(rss) if rss is not None else "—")
        if op == "take":
            disk = next((r.disk for r in reversed(ok) if r.disk), None)
            cells.append(f"{fmt_size(disk['apparent'])} in {disk['files']} files" if disk else "—")
        else:
            cells.append(_loads_into(mine))
        cells.append(_status(mine, op))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def state_tables(
    rows: Sequence[Row],
    state: str,
    modes: Sequence[str],
    temps: Sequence[str],
    refs: Sequence[str] = ("raw", "statesnap"),
) -> list[str]:
    out: list[str] = []
    mine = [r for r in rows if r.state == state]
    for op, mode in [("take", m) for m in modes] + [("restore", t) for t in temps]:
        table = op_table(mine, op, mode, refs)
        if table:
            out += ["", f"**{MODE_TITLES[mode]}**", "", *table]
    return out


def ratio_table(rows: Sequence[Row], numerator: str, denominator: str, title: str) -> list[str]:
    """Per method and op/mode: median seconds of two states and their per-round ratio."""
    keys: dict[tuple[str, str, str], None] = {}
    for r in rows:
        keys.setdefault((r.label, r.op, r.mode), None)
    head = ["method", "op", denominator + " s", numerator + " s", title]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, op, mode in keys:
        sel = [r for r in rows if (r.label, r.op, r.mode) == (label, op, mode)]
        num = [r for r in sel if r.state == numerator]
        den = [r for r in sel if r.state == denominator]
        mn = _median(r.seconds for r in num if r.ok and r.seconds)
        md = _median(r.seconds for r in den if r.ok and r.seconds)
        ratios = _round_ratios(num, den)
        fail = [r for r in num + den if not r.ok]
        lines.append(
            "| "
            + " | ".join(
                [
                    label,
                    f"{op} {mode}",
                    fmt_s(md),
                    fmt_s(mn),
                    _fmt_ratio(ratios) + (f" — FAILED: {fail[0].error[:120]}" if fail else ""),
                ]
            )
            + " |"
        )
    return lines


# ---------------------------------------------------------------------------------------------
# Cases.


def _variants(
    methods: Sequence[str], env: dict[str, str], readers: dict[str, list[str]] | None = None
) -> list[Variant]:
    out = []
    for m in methods:
        if m not in WRITERS:
            raise SystemExit(f"unknown method {m!r}; known: {', '.join(WRITERS)}")
        rs = readers.get(m, readers_of(m)) if readers is not None else readers_of(m)
        out.append(Variant(m, m, rs, dict(env) if m == "statesnap" else {}))
    return out


def case_main(args: argparse.Namespace, runner: Runner, env: dict[str, str]) -> CaseResult:
    sizes = args.size or [512 * MIB, 2 * GIB]
    states = [
        StateCase(fmt_size(s), {"kind": "model", "size": s, "seed": args.seed}) for s in sizes
    ]
    variants = _variants(args.methods or DEFAULT_METHODS, env)
    rows = run_rounds(runner, "main", states, variants, args.modes, args.temps, args.reps)
    out: list[str] = []
    for s in states:
        out += ["", f"#### {describe_spec(build_spec(s.args))}"]
        out += state_tables(rows, s.label, args.modes, args.temps)
    out += ["", _method_notes(variants)]
    return rows, out


def case_many_small(args: argparse.Namespace, runner: Runner, env: dict[str, str]) -> CaseResult:
    total = (args.size or [200 * MIB])[0]
    many = StateCase(
        "many", {"kind": "tensors", "size": total, "count": args.count, "seed": args.seed}
    )
    single = StateCase("single", {"kind": "tensors", "size": total, "count": 1, "seed": args.seed})
    methods = args.methods or ["raw", "torch.save", "statesnap"]
    variants = _variants(methods, env, {"raw": ["raw"], "torch.save": ["torch.load"]})
    rows = run_rounds(
        runner, "many-small", [many, single], variants, args.modes, args.temps, args.reps
    )
    out = [
        "",
        f"many = {describe_spec(build_spec(many.args))}; "
        f"single = {describe_spec(build_spec(single.args))}",
        "",
        "**Ratio many / single (time of the many-tensor state ÷ time of the single tensor; "
        "per round in parentheses)**",
        "",
    ]
    out += ratio_table(rows, "many", "single", "many ÷ single")
    for s in (many, single):
        out += ["", f"#### {s.label}: {describe_spec(build_spec(s.args))}"]
        out += state_tables(rows, s.label, args.modes, args.temps)
    return rows, out


def case_restore_memory(
    args: argparse.Namespace, runner: Runner, env: dict[str, str]
) -> CaseResult:
    size = (args.size or [2 * GIB])[0]
    state = StateCase(fmt_size(size), {"kind": "model", "size": size, "seed": args.seed})
    budget = args.budget
    low = f"statesnap (budget {fmt_size(budget)})"
    variants = [
        Variant(
            low, "statesnap", ["statesnap"], {**env, "STATESNAP_MEMORY_BUDGET_BYTES": str(budget)}
        ),
        Variant("statesnap (default budget)", "statesnap", ["statesnap"], dict(env)),
        Variant("torch.save", "torch.save", ["torch.load", "torch.load mmap"]),
        Variant("raw", "raw", ["raw", "raw fresh"]),
    ]
    rows = run_rounds(
        runner, "restore-memory", [state], variants, args.modes, args.temps, args.reps
    )
    head = [
        "method",
        "op",
        "peak RSS above baseline (median)",
        "per round",
        "baseline RSS",
        "median s",
        "check",
    ]
    out = [
        "",
        f"#### {describe_spec(build_spec(state.args))}",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for (label, op, mode), sel in _group_by(rows, lambda r: (r.label, r.op, r.mode)).items():
        ok = [r for r in sel if r.ok]
        rss = _median(r.peak_rss for r in ok if r.peak_rss is not None)
        base = _median(r.baseline_rss for r in ok if r.baseline_rss is not None)
        med = _median(r.seconds for r in ok if r.seconds)
        out.append(
            "| "
            + " | ".join(
                [
                    label,
                    f"{op} {mode}",
                    fmt_size(rss) if rss is not None else "—",
                    ", ".join(
                        fmt_size(r.peak_rss) if r.ok and r.peak_rss is not None else "✗"
                        for r in sel
                    ),
                    fmt_size(base) if base is not None else "—",
                    fmt_s(med),
                    _status(sel, op),
                ]
            )
            + " |"
        )
    out += [
        "",
        "Baseline RSS is the worker's RSS right before the operation: the generated "
        "state for a take, the preallocated targets (if any) for a restore.",
    ]
    out += state_tables(rows, state.label, args.modes, args.temps)
    return rows, out


NO_CHECKSUMS = "statesnap (STATESNAP_CHECKSUMS=0)"


def case_checksums(args: argparse.Namespace, runner: Runner, env: dict[str, str]) -> CaseResult:
    """What checksums cost: statesnap with and without them, on the same state, in one run."""
    size = (args.size or [2 * GIB])[0]
    state = StateCase(fmt_size(size), {"kind": "model", "size": size, "seed": args.seed})
    variants = [
        Variant("statesnap", "statesnap", ["statesnap"], dict(env)),
        Variant(NO_CHECKSUMS, "statesnap", ["statesnap"], {**env, "STATESNAP_CHECKSUMS": "0"}),
        Variant("raw", "raw", ["raw"]),
    ]
    rows = run_rounds(runner, "checksums", [state], variants, args.modes, args.temps, args.reps)
    out = [
        "",
        f"#### {describe_spec(build_spec(state.args))}",
        "",
        f"The cost of checksums is the column `time ÷ {NO_CHECKSUMS}` of the statesnap row: "
        "computing a CRC-32 of every range as it is written (take), verifying every range "
        "as it is read (restore).",
    ]
    out += state_tables(rows, state.label, args.modes, args.temps, refs=(NO_CHECKSUMS, "raw"))
    return rows, out


def _group_by(rows: Iterable[Row], key: Any) -> dict[Any, list[Row]]:
    out: dict[Any, list[Row]] = {}
    for r in rows:
        out.setdefault(key(r), []).append(r)
    return out


def case_read_object(args: argparse.Namespace, runner: Runner, env: dict[str, str]) -> CaseResult:
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
        rows.append(_row("read-object", state, 0, variant, "take", "fsync", "statesnap", take))
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
                        _row(
                            "read-object",
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


def case_scaling(args: argparse.Namespace, runner: Runner, env: dict[str, str]) -> CaseResult:
    leaves = args.leaves
    states = [
        StateCase(f"{n:,} leaves", {"kind": "leaves", "leaves": n, "seed": args.seed})
        for n in leaves
    ]
    methods = args.methods or ["statesnap"]
    readers = {
        "statesnap": ["statesnap", "statesnap get_manifest"],
        "raw": ["raw"],
        "torch.save": ["torch.load"],
    }
    variants = _variants(methods, env, readers)
    rows = run_rounds(runner, "scaling", states, variants, args.modes, args.temps, args.reps)
    out: list[str] = []
    if len(states) >= 2:
        lo, hi = states[0].label, states[-1].label
        out += [
            "",
            f"**Ratio {hi} ÷ {lo}** ({leaves[-1] / leaves[0]:.0f}x the leaves; linear "
            f"scaling gives ~{leaves[-1] / leaves[0]:.0f}; per round in parentheses)",
            "",
        ]
        out += ratio_table(rows, hi, lo, f"{hi} ÷ {lo}")
    for s in states:
        out += ["", f"#### {describe_spec(build_spec(s.args))}"]
        out += state_tables(rows, s.label, args.modes, args.temps)
    return rows, out


# ---------------------------------------------------------------------------------------------
# dist: a process group of world_size ranks on this machine.


SHORT_TITLES = {
    "cache": "take to page cache",
    "fsync": "take fsync'd",
    "warm": "restore warm",
    "cold": "restore cold",
}


def _mib(nbytes: float) -> str:
    """MiB with one decimal, for byte counts compared across methods."""
    return f"{nbytes / MIB:,.1f} MiB"


def _per_rank(rows: Sequence[Row], key: Any) -> list[float]:
    """Median over the rounds that worked of ``key(one rank's figures)``, per rank, rank 0
    first."""
    by_rank: dict[int, list[float]] = {}
    for r in rows:
        for fig in r.extra.get("ranks", []):
            value = key(fig)
            if r.ok and value is not None:
                by_rank.setdefault(fig["rank"], []).append(value)
    return [statistics.median(by_rank[k]) for k in sorted(by_rank)]


def dist_tables(
    rows: Sequence[Row],
    states: Sequence[StateCase],
    num: str,
    den: str,
    ops: Sequence[tuple[str, str]],
) -> list[str]:
    """The dist case's summary: time ``num`` ÷ ``den`` per world size and op, bytes on disk
    against the expected (model once, each rank's own state once per rank), and per-rank
    figures."""
    out = [
        "",
        f"**{num} ÷ {den}** (median of the per-round ratios, each round in parentheses; below 1 "
        f"means {num} is faster; seconds are the medians, each the slowest rank's time from a "
        "barrier before the call to a barrier after it)",
        "",
        f"| world size | op | {num} s | {den} s | {num} ÷ {den} |",
        "|---|---|---|---|---|",
    ]
    for st in states:
        for op, mode in ops:
            sel = [r for r in rows if r.state == st.label and (r.op, r.mode) == (op, mode)]
            mine = [r for r in sel if r.label == num]
            ref = [r for r in sel if r.label == den]
            fails = [r for r in mine + ref if not r.ok]
            note = f" — {_status(fails, op)} ({fails[0].label})" if fails else ""
            med_num = _median(r.seconds for r in mine if r.ok and r.seconds)
            med_den = _median(r.seconds for r in ref if r.ok and r.seconds)
            out.append(
                f"| {st.args['world_size']} | {SHORT_TITLES[mode]} | {fmt_s(med_num)} | "
                f"{fmt_s(med_den)} | {_fmt_ratio(_round_ratios(mine, ref))}{note} |"
            )
    labels = list(_group(rows))
    out += [
        "",
        "**Bytes on disk** after the take (every file under the snapshot directory; expected = "
        "the model's tensors once + each rank's own tensors x world size, so a method that "
        "wrote the model once per rank would show about world size x the model)",
        "",
        "| world size | expected | " + " | ".join(labels) + " |",
        "|---|---|" + "---|" * len(labels),
    ]
    for st in states:
        spec = build_spec(st.args)
        model = spec.group_nbytes("model")
        expected = model + st.args["world_size"] * (spec.nbytes - model)
        cells = [str(st.args["world_size"]), _mib(expected)]
        for label in labels:
            takes = [r for r in rows if r.state == st.label and r.label == label and r.op == "take"]
            disk = next((r.disk for r in reversed(takes) if r.ok and r.disk), None)
            cells.append(
                f"{_mib(disk['apparent'])} in {disk['files']} files "
                f"({disk['apparent'] / expected:.3f}x expected)"
                if disk
                else "—"
            )
        out.append("| " + " | ".join(cells) + " |")
    out += [
        "",
        "**Per rank** (medians over rounds, rank 0 first): how long each rank's own call took "
        "(to its return, before the closing barrier), and what each rank wrote (take: `wchar`, "
        "bytes through write calls) or read (restore: `rchar`, bytes through read calls, page "
        "cache included)",
        "",
        "| world size | method | op | own call s per rank | bytes per rank |",
        "|---|---|---|---|---|",
    ]
    for st in states:
        if st.args["world_size"] < 2:
            continue
        for label in labels:
            for op, mode in ops:
                sel = [
                    r
                    for r in rows
                    if r.state == st.label and r.label == label and (r.op, r.mode) == (op, mode)
                ]
                counter = "wchar" if op == "take" else "rchar"
                secs = _per_rank(sel, lambda f: f.get("own_seconds"))
                nbytes = _per_rank(sel, lambda f, c=counter: (f.get("io") or {}).get(c))
                out.append(
                    f"| {st.args['world_size']} | {label} | {op} {mode} | "
                    f"{', '.join(fmt_s(x) for x in secs) or '—'} | "
                    f"{counter} {', '.join(_mib(x) for x in nbytes) or '—'} |"
                )
    return out


def case_dist(args: argparse.Namespace, runner: Runner, env: dict[str, str]) -> CaseResult:
    size = (args.size or [GIB])[0]
    states = [
        StateCase(
            f"world size {w}", {"kind": "dp", "size": size, "seed": args.seed, "world_size": w}
        )
        for w in args.worlds
    ]
    methods = args.methods or ["statesnap", "dcp"]
    for m in methods:
        if m not in GROUP_WRITERS:
            raise SystemExit(
                f"--case dist: unknown method {m!r}; known: {', '.join(GROUP_WRITERS)}"
            )
    variants = [Variant(m, m, [m], dict(env) if m == "statesnap" else {}) for m in methods]
    rows = run_rounds(runner, "dist", states, variants, args.modes, args.temps, args.reps)
    spec0 = build_spec({**states[0].args, "rank": 0})
    model = spec0.group_nbytes("model")
    own = spec0.nbytes - model
    out = [
        "",
        f"World sizes {', '.join(str(w) for w in args.worlds)}: one gloo process group of "
        "that many processes on this machine (CPU), new for every operation. Each rank holds "
        f"the same model ({fmt_size(model)}, replicated: statesnap is told "
        f"`replicated={REPLICATED}`) and its own state ({fmt_size(own)}, different on every "
        f"rank). Rank 0: {describe_spec(spec0)}.",
        "",
        "GB/s: takes count the bytes the group must write (the model once, each rank's own "
        "state once); restores the bytes loaded into every rank's tensors.",
    ]
    ops = [("take", m) for m in args.modes] + [("restore", t) for t in args.temps]
    if "statesnap" in methods and "dcp" in methods:
        out += dist_tables(rows, states, "statesnap", "dcp", ops)
    for st in states:
        out += ["", f"#### {st.label}"]
        out += state_tables(rows, st.label, args.modes, args.temps, refs=("dcp", "statesnap"))
    out += ["", _method_notes(variants, GROUP_WRITERS, GROUP_READERS)]
    return rows, out


def _method_notes(
    variants: Sequence[Variant],
    writers: dict[str, Writer] = WRITERS,
    readers: dict[str, Reader] = READERS,
) -> str:
    notes = []
    for v in variants:
        w = writers[v.writer]
        notes.append(
            f"- {v.writer} take: {w.note}" + ("" if w.objects else "; Python objects not stored")
        )
        for r in v.readers:
            notes.append(f"- {r} restore: {readers[r].note}")
    return "Methods:\n" + "\n".join(notes)


# ---------------------------------------------------------------------------------------------
# reshard: a state of DTensors saved sharded one way, restored into another sharding.


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
            return _row("reshard", state, rnd, variants[m], "restore", temp, m, failed)
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
        return _row("reshard", state, rnd, variants[m], "restore", temp, m, result, extra)

    for rnd in range(reps):
        _log(f"round {rnd + 1}/{reps}")
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
                        _row("reshard", saved_state, rnd, variants[m], "take", mode, m, take)
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
            med = _median(r.seconds for r in ok)  # type: ignore[misc]
            rss = _median(r.peak_rss for r in ok if r.peak_rss is not None)
            payload = mine[0].payload_bytes or next((r.payload_bytes for r in mine), 0)
            cells = [
                f"{sc.name}: {sc.title}",
                m,
                fmt_s(med),
                f"{payload / med / 1e9:.2f}" if med and payload else "—",
                ", ".join(fmt_s(r.seconds) if r.ok and r.seconds else "✗" for r in mine),
                fmt_size(rss) if rss is not None else "—",
                _rchar_share(ok),
                _loads_into(mine),
                _status(mine, "restore"),
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
        note = f" — {_status(fails, 'restore')} ({fails[0].method})" if fails else ""
        out.append(
            f"| {sc.name}: {sc.title} | "
            f"{fmt_s(_median(r.seconds for r in mine if r.ok and r.seconds))} | "
            f"{fmt_s(_median(r.seconds for r in theirs if r.ok and r.seconds))} | "
            f"{_fmt_ratio(_round_ratios(theirs, mine))}{note} |"
        )
    return out


def reshard_save_table(rows: Sequence[Row], mode: str) -> list[str]:
    """The saves (untimed setup of the restores, shown for the record): seconds, bytes on
    disk."""
    saves = [r for r in rows if r.op == "take"]
    head = ["saved by", "method", "median s", "per round s", "on disk", "status"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (state, label), mine in _group_by(saves, lambda r: (r.state, r.label)).items():
        ok = [r for r in mine if r.ok and r.seconds]
        disk = next((r.disk for r in reversed(ok) if r.disk), None)
        out.append(
            "| "
            + " | ".join(
                [
                    state,
                    label,
                    fmt_s(_median(r.seconds for r in ok)),  # type: ignore[misc]
                    ", ".join(fmt_s(r.seconds) if r.ok and r.seconds else "✗" for r in mine),
                    f"{_mib(disk['apparent'])} in {disk['files']} files" if disk else "—",
                    _status(mine, "take"),
                ]
            )
            + " |"
        )
    return out


def case_reshard(args: argparse.Namespace, runner: Runner, env: dict[str, str]) -> CaseResult:
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


# ---------------------------------------------------------------------------------------------
# async: how long an async snapshot blocks the caller, what it captured, and its memory.

DEFAULT_ASYNC_METHODS = [
    "statesnap-async",
    "statesnap-async-budget",
    "statesnap-take",
    "copy-fresh",
    "copy-prealloc",
    "torchsnapshot-async",
    "dcp-async",
]
# Modes do not apply to the plain copies (they write nothing): they run once per round.
MEMORY = "memory"
ASYNC_MODE_TITLES = {
    "fsync": "fsync'd (every library's default: statesnap fsyncs, DCP `sync_files=True`; "
    "torchsnapshot's files are fsync'd by the harness after its wait, timed)",
    "cache": 'to the page cache (statesnap `storage_options={"fsync": False}`, DCP '
    "`sync_files=False`, torchsnapshot as it is)",
}


def _async_rows(
    state: StateCase, rnd: int, method: AsyncMethod, mode: str, result: dict[str, Any]
) -> list[Row]:
    """One row per call of an async worker (``seconds`` is the stall), and one failed row for
    the call that raised or the worker that died. A call whose check failed keeps ``ok``
    (its timings are valid); its check verdict is in ``extra["check_ok"]``."""
    rows: list[Row] = []
    common = {
        "case": "async",
        "state": state.label,
        "round": rnd,
        "variant": method.label,
        "writer": method.name,
        "op": "async",
        "mode": mode,
        "method": method.name,
        "payload_bytes": result.get("payload_bytes", 0),
        "baseline_rss": result.get("baseline_rss"),
    }
    for c in result.get("calls", []):
        check = c.get("check") or {"ok": False, "detail": "no check"}
        rows.append(
            Row(
                **common,
                ok=True,
                seconds=c["stall"],
                peak_rss=c.get("peak_rss_above_call"),
                check=check["detail"],
                extra={k: v for k, v in c.items() if k != "check"} | {"check_ok": check["ok"]},
            )
        )
        _log(
            f"  [{state.label} {mode} round {rnd + 1}] {method.label} call {c['call'] + 1}: "
            f"stall {c['stall']:.3f} s, total {c['total']:.3f} s, check {check['detail']}"
        )
    if not result.get("ok"):
        n = len(result.get("calls", []))
        rows.append(
            Row(
                **common,
                ok=False,
                error=result.get("error", "no result"),
                extra={"call": n, "traceback": result.get("traceback", "")},
            )
        )
        _log(
            f"  [{state.label} {mode} round {rnd + 1}] {method.label} call {n + 1}: FAILED "
            f"{result.get('error')}\n{result.get('traceback', '')}"
        )
    return rows


def run_async_rounds(
    runner: Runner,
    states: Sequence[StateCase],
    methods: Sequence[AsyncMethod],
    modes: Sequence[str],
    calls: int,
    series: int,
    reps: int,
    env: dict[str, str],
) -> list[Row]:
    """Per round, state and mode, each method in a fresh worker (statesnap's async take makes
    ``series`` calls, the others ``calls``); the plain copies only in the first mode."""
    rows: list[Row] = []
    for rnd in range(reps):
        _log(f"round {rnd + 1}/{reps}")
        for state in states:
            for i, mode in enumerate(modes):
                for m in methods:
                    if not m.files and i > 0:
                        continue
                    path = runner.data_dir(f"{m.name}-{mode}")
                    shutil.rmtree(path, ignore_errors=True)
                    try:
                        result = runner.job(
                            {
                                "op": "async",
                                "method": m.name,
                                "mode": mode,
                                "state": state.args,
                                "path": path,
                                "calls": series if m.name == "statesnap-async" else calls,
                            },
                            env if m.name.startswith("statesnap") else {},
                        )
                    finally:
                        shutil.rmtree(path, ignore_errors=True)
                    rows += _async_rows(state, rnd, m, mode if m.files else MEMORY, result)
    return rows


def _first(rows: Iterable[Row], key: str = "") -> dict[int, float]:
    """Round -> the first call's stall (or ``extra[key]``)."""
    return {
        r.round: (r.extra[key] if key else r.seconds)
        for r in rows
        if r.ok and r.extra.get("call") == 0 and r.seconds is not None
    }


def _later(rows: Iterable[Row], key: str = "") -> dict[int, float]:
    """Round -> median over the later calls (2nd on) of the stall (or ``extra[key]``)."""
    by_round: dict[int, list[float]] = {}
    for r in rows:
        if r.ok and (r.extra.get("call") or 0) >= 1 and r.seconds is not None:
            by_round.setdefault(r.round, []).append(r.extra[key] if key else r.seconds)
    return {k: statistics.median(v) for k, v in by_round.items()}


def _fmt_rounds(values: dict[int, float], fmt: Any = fmt_s) -> str:
    """Median of per-round values, each round in parentheses."""
    if not values:
        return "—"
    med = fmt(statistics.median(values.values()))
    if len(values) == 1:
        return med
    return f"{med} ({', '.join(fmt(values[k]) for k in sorted(values))})"


def _ratios(num: dict[int, float], den: dict[int, float]) -> list[float]:
    return [num[k] / den[k] for k in sorted(num) if den.get(k)]


def _async_check(rows: Sequence[Row]) -> str:
    """Check column: calls whose written state equals the state at call time; failures."""
    done = [r for r in rows if r.ok]
    bad = [r for r in done if not r.extra.get("check_ok")]
    text = ""
    if done and not bad:
        text = f"ok: {len(done)}/{len(done)} calls bitwise equal to the state at call time"
    elif bad:
        details = list(dict.fromkeys(r.check.replace("|", "\\|")[:200] for r in bad))
        text = f"**INCONSISTENT in {len(bad)}/{len(done)} calls**: " + "; ".join(details[:3])
    failed = [r for r in rows if not r.ok]
    if failed:
        err = failed[0].error.replace("|", "\\|").replace("\n", " ")[:200]
        text = f"FAILED {len(failed)} worker(s): {err}" + (f"; otherwise {text}" if text else "")
    return text


def async_stall_table(rows: Sequence[Row], labels: Sequence[str]) -> list[str]:
    """The stall table of one state and mode: each method's first and later stalls, ratios to
    the CPU copies and to statesnap's async take (per round), totals, peak RSS, check."""
    groups = _group(rows)
    fresh = groups.get(ASYNC_METHODS["copy-fresh"].label, [])
    prealloc = groups.get(ASYNC_METHODS["copy-prealloc"].label, [])
    ss = groups.get(ASYNC_METHODS["statesnap-async"].label, [])
    head = [
        "method",
        "stall, 1st call s",
        "stall, later calls s",
        "1st ÷ copy into fresh (1st)",
        "later ÷ copy into preallocated (later)",
        "÷ statesnap async_take (1st; later)",
        "total (call + wait), 1st s",
        "total, later s",
        "peak RSS above RSS at call (1st; later)",
        "check: what the call wrote, after the caller changed every tensor",
    ]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label in labels:
        mine = groups.get(label)
        if not mine:
            continue
        first, later = _first(mine), _later(mine)
        rss_first = {r.round: float(r.peak_rss) for r in mine if r.ok and r.extra.get("call") == 0}
        rss_later = _later(mine, "peak_rss_above_call")
        vs_ss = (
            f"{_fmt_ratio(_ratios(first, _first(ss)))}; {_fmt_ratio(_ratios(later, _later(ss)))}"
        )
        out.append(
            "| "
            + " | ".join(
                [
                    label,
                    _fmt_rounds(first),
                    _fmt_rounds(later),
                    _fmt_ratio(_ratios(first, _first(fresh))),
                    _fmt_ratio(_ratios(later, _later(prealloc))),
                    vs_ss,
                    _fmt_rounds(_first(mine, "total")),
                    _fmt_rounds(_later(mine, "total")),
                    f"{_fmt_median_size(rss_first)}; {_fmt_median_size(rss_later)}",
                    _async_check(mine),
                ]
            )
            + " |"
        )
    return out


def _fmt_median_size(values: dict[int, float]) -> str:
    return fmt_size(statistics.median(values.values())) if values else "—"


def async_targets(rows: Sequence[Row]) -> list[str]:
    """The two targets, per round: statesnap's first stall ≤ 1.3x the copy into fresh tensors,
    its later stalls ≤ 2x the copy into preallocated ones."""
    groups = _group(rows)
    ss = groups.get(ASYNC_METHODS["statesnap-async"].label, [])
    fresh = groups.get(ASYNC_METHODS["copy-fresh"].label, [])
    prealloc = groups.get(ASYNC_METHODS["copy-prealloc"].label, [])
    out = []
    for what, mine, ref, limit, name in (
        ("first", _first(ss), _first(fresh), 1.3, "the copy into fresh tensors"),
        ("later", _later(ss), _later(prealloc), 2.0, "the copy into preallocated tensors"),
    ):
        ratios = _ratios(mine, ref)
        if not ratios:
            out.append(f"- statesnap {what} stall ÷ {name}: not measured (a run failed)")
            continue
        med = statistics.median(ratios)
        verdict = "met" if med <= limit else "**NOT met**"
        out.append(
            f"- statesnap async_take, {what} stall ÷ {name}: {_fmt_ratio(ratios)} "
            f"(target ≤ {limit}: {verdict}; {fmt_s(statistics.median(mine.values()))} s vs "
            f"{fmt_s(statistics.median(ref.values()))} s)"
        )
    return out


def async_series_table(rows: Sequence[Row]) -> list[str]:
    """statesnap's async take, call by call in one process: stall, peak RSS and RSS after the
    wait above the RSS before the first call, and the staging pool's bytes (every round)."""
    mine = [r for r in rows if r.method == "statesnap-async" and r.ok]
    if not mine:
        return []
    calls = sorted({r.extra["call"] for r in mine})
    rounds = sorted({r.round for r in mine})

    def cells(call: int, key: str, fmt: Any) -> str:
        vals = {r.round: r.extra[key] for r in mine if r.extra["call"] == call and key in r.extra}
        if not vals:
            return "—"
        if len(set(vals.values())) == 1 and len(vals) > 1:
            return f"{fmt(next(iter(vals.values())))} (every round)"
        return ", ".join(fmt(vals[k]) for k in sorted(vals))

    head = [
        "call",
        "stall s (per round)",
        "total s (per round)",
        "peak RSS above the RSS before call 1 (per round)",
        "RSS after the wait, above it (per round)",
        "pool `allocated_bytes` (per round)",
        "pool `free_bytes` (per round)",
        "memory budget before the call (per round)",
    ]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in calls:
        out.append(
            "| "
            + " | ".join(
                [
                    str(c + 1),
                    cells(c, "stall", fmt_s),
                    cells(c, "total", fmt_s),
                    cells(c, "peak_rss_above_start", fmt_size),
                    cells(c, "rss_after_above_start", fmt_size),
                    cells(c, "pool_allocated", _mib),
                    cells(c, "pool_free", _mib),
                    cells(c, "budget_before", _mib),
                ]
            )
            + " |"
        )
    verdicts = []
    for rnd in rounds:
        series = [
            r.extra["pool_allocated"]
            for r in sorted(mine, key=lambda r: r.extra["call"])
            if r.round == rnd and "pool_allocated" in r.extra
        ]
        peaks = [
            r.extra["peak_rss_above_start"]
            for r in sorted(mine, key=lambda r: r.extra["call"])
            if r.round == rnd
        ]
        if len(series) < 2:
            continue
        grew = max(series[1:]) - series[0]
        verdicts.append(
            f"round {rnd + 1}: allocated {_mib(series[0])} after call 1, "
            f"{_mib(max(series[1:]))} at most after calls 2-{len(series)} "
            + ("(**grew** by " + _mib(grew) + ")" if grew > 0 else "(no growth)")
            + f"; peak RSS above the start {fmt_size(peaks[0])} after call 1, "
            f"{fmt_size(max(peaks[1:]))} at most after"
        )
    out += ["", "Growth after the first call: " + "; ".join(verdicts) + "."] if verdicts else []
    return out


def case_async(args: argparse.Namespace, runner: Runner, env: dict[str, str]) -> CaseResult:
    sizes = args.size or [512 * MIB]
    states = [
        StateCase(fmt_size(s), {"kind": "model", "size": s, "seed": args.seed}) for s in sizes
    ]
    names = args.methods or DEFAULT_ASYNC_METHODS
    for n in names:
        if n not in ASYNC_METHODS:
            raise SystemExit(
                f"--case async: unknown method {n!r}; known: {', '.join(ASYNC_METHODS)}"
            )
    methods = [ASYNC_METHODS[n] for n in names]
    rows = run_async_rounds(
        runner, states, methods, args.modes, args.calls, args.series, args.reps, env
    )
    labels = [m.label for m in methods]
    out = [
        "",
        f"Calls per worker: statesnap async_take {args.series}, the others {args.calls} "
        "(call 1 in a fresh process; *later* = the median of calls 2 on, per round). Stall = "
        "the call's duration; total = stall + wait (the caller flips every tensor between "
        "them, timed apart: see the JSON's `mutate`).",
    ]
    for s in states:
        out += ["", f"#### {describe_spec(build_spec(s.args))}"]
        for mode in args.modes:
            sel = [r for r in rows if r.state == s.label and r.mode in (mode, MEMORY)]
            out += ["", f"**Stall and total, {ASYNC_MODE_TITLES[mode]}**", ""]
            out += async_stall_table(sel, labels)
            out += ["", *async_targets(sel)]
            budgets = [
                r.extra["budget_before"]
                for r in sel
                if "budget_before" in r.extra and r.method == "statesnap-async"
            ]
            if budgets:
                out.append(
                    "- statesnap async_take's memory budget (`STATESNAP_MEMORY_BUDGET_BYTES` "
                    "unset: a quarter of the available memory, the staging pool's free blocks "
                    "included, clamped to [64 MiB, 4 GiB]) right before its calls: "
                    f"{_mib(min(budgets))} to {_mib(max(budgets))}"
                )
        for mode in args.modes:
            sel = [r for r in rows if r.state == s.label and r.mode == mode]
            table = async_series_table(sel)
            if table:
                out += [
                    "",
                    f"**statesnap async_take, {args.series} calls in one process, each waited "
                    f"for ({mode})**: RSS above the RSS before the first call (state, check "
                    "targets and libraries already resident; the harness trims the C heap "
                    "after each check), and the staging pool "
                    "(`snapshot._engine.staging.default_pool()`) after each wait",
                    "",
                    *table,
                ]
    notes = [f"- {m.label}: {m.note}" for m in methods]
    out += ["", "Methods:", *notes]
    return rows, out


# ---------------------------------------------------------------------------------------------
# async-loop: a small training loop with snapshots every N steps.

LOOP_LABELS = {
    "none": "no snapshots",
    "take": "statesnap take",
    "async_take": "statesnap async_take",
}


def case_async_loop(args: argparse.Namespace, runner: Runner, env: dict[str, str]) -> CaseResult:
    from benchmarks.train_loop import METHODS as LOOP_METHODS
    from benchmarks.train_loop import LoopConfig

    methods = args.methods or list(LOOP_METHODS)
    for m in methods:
        if m not in LOOP_METHODS:
            raise SystemExit(f"--case async-loop: unknown method {m!r}; known: {LOOP_METHODS}")
    rows: list[Row] = []
    for mode in args.modes:
        cfg = LoopConfig(
            steps=args.steps,
            interval=args.interval,
            batch=args.batch,
            dims=tuple(args.dims),
            seed=args.seed,
            fsync=mode == "fsync",
        )
        state = StateCase(f"loop {mode}", {"kind": "loop"})
        for rnd in range(args.reps):
            _log(f"round {rnd + 1}/{args.reps} ({mode})")
            for m in methods:
                path = runner.data_dir(f"loop-{m}")
                shutil.rmtree(path, ignore_errors=True)
                os.makedirs(path)
                try:
                    result = runner.job(
                        {"op": "train", "method": m, "loop": asdict(cfg), "path": path}, env
                    )
                finally:
                    shutil.rmtree(path, ignore_errors=True)
                check = result.get("check") or {}
                row = Row(
                    case="async-loop",
                    state=state.label,
                    round=rnd,
                    variant=LOOP_LABELS[m],
                    writer=m,
                    op="train",
                    mode=mode,
                    method=m,
                    ok=bool(result.get("ok")) and bool(check.get("ok", True)),
                    seconds=result.get("seconds"),
                    check=check.get("detail", ""),
                    error=result.get("error", ""),
                    extra={
                        k: result[k]
                        for k in (
                            "steps",
                            "steps_per_s",
                            "step_median",
                            "state_bytes",
                            "snapshots",
                            "traceback",
                        )
                        if k in result
                    },
                )
                _log(
                    f"  [loop {mode} round {rnd + 1}] {LOOP_LABELS[m]}: "
                    + (
                        f"{result['steps_per_s']:.2f} steps/s, {len(result['snapshots'])} snapshots"
                        if row.ok
                        else f"FAILED {row.error}\n{result.get('traceback', '')}"
                    )
                )
                rows.append(row)
    out = [
        "",
        f"MLP {'-'.join(str(d) for d in args.dims)} (Linear + GELU), Adam, batch {args.batch}, "
        f"synthetic data, CPU; {args.steps} timed steps after 10 untimed; a snapshot before "
        f"every {args.interval}th step ({(args.steps - 1) // args.interval} per run).",
    ]
    for mode in args.modes:
        sel = [r for r in rows if r.mode == mode]
        out += ["", f"**{ASYNC_MODE_TITLES[mode].split(' (')[0].capitalize()}**", ""]
        out += loop_table(sel, args.interval)
    return rows, out


def loop_table(rows: Sequence[Row], interval: int) -> list[str]:
    """Steps per second of each loop, its ratio to the loop without snapshots (per round), and
    what the snapshots cost it."""
    groups = _group(rows)
    ref = groups.get(LOOP_LABELS["none"], [])
    ref_rate = {r.round: r.extra["steps_per_s"] for r in ref if r.ok}
    ref_step = {r.round: r.extra["step_median"] for r in ref if r.ok}
    head = [
        "loop",
        "steps/s",
        "÷ no snapshots (per round)",
        "loop s",
        "median step ms",
        "median step ÷ no snapshots (per round)",
        "loop blocked by snapshots (calls + waits), % of loop time",
        "call blocks per snapshot s (median, max)",
        "blocked in wait per snapshot s (median, max)",
        "snapshot write time s (median)",
        "check",
    ]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    state_bytes = None
    for label, mine in groups.items():
        ok = [r for r in mine if r.ok]
        rate = {r.round: r.extra["steps_per_s"] for r in ok}
        step = {r.round: r.extra["step_median"] for r in ok}
        blocked = {
            r.round: 100
            * sum(s["call"] + s["blocked_in_wait"] for s in r.extra.get("snapshots", []))
            / r.seconds
            for r in ok
            if r.seconds
        }
        snaps = [s for r in ok for s in r.extra.get("snapshots", [])]
        state_bytes = state_bytes or next((r.extra.get("state_bytes") for r in ok), None)

        def med_max(key: str, snaps: list[dict[str, Any]] = snaps) -> str:
            vals = [s[key] for s in snaps if s.get(key) is not None]
            return f"{fmt_s(statistics.median(vals))}, {fmt_s(max(vals))}" if vals else "—"

        if mine[0].method == "take":
            write = [s["call"] for s in snaps]
        else:
            write = [s["seen_done"] for s in snaps if s.get("seen_done") is not None]
        out.append(
            "| "
            + " | ".join(
                [
                    label,
                    _fmt_rounds(rate, lambda v: f"{v:.2f}"),
                    _fmt_ratio([rate[k] / ref_rate[k] for k in sorted(rate) if k in ref_rate]),
                    fmt_s(_median(r.seconds for r in ok if r.seconds)),
                    _fmt_rounds(step, lambda v: f"{v * 1000:.1f}"),
                    _fmt_ratio([step[k] / ref_step[k] for k in sorted(step) if k in ref_step]),
                    _fmt_rounds(blocked, lambda v: f"{v:.1f}") if snaps else "—",
                    med_max("call"),
                    med_max("blocked_in_wait") if mine[0].method == "async_take" else "—",
                    fmt_s(statistics.median(write)) if write else "—",
                    _status(mine, "train"),
                ]
            )
            + " |"
        )
    step = _median(r.extra["step_median"] for r in ref if r.ok)
    if step is not None:
        out += [
            "",
            f"Compute per interval: {interval} steps x {step * 1000:.1f} ms (median step of the "
            f"loop without snapshots) = {interval * step:.2f} s. State: "
            f"{fmt_size(state_bytes or 0)} (model + Adam). Snapshot write time: the whole call "
            "for take; for async_take, from the call until `done()` was first seen true (polled "
            "after every step, so up to one step late).",
        ]
    return out


# ---------------------------------------------------------------------------------------------
# s3: take and restore through a local S3 server (moto, in a process of its own).

DEFAULT_S3_METHODS = ["raw-stream", "torch.save", "dcp", "torchsnapshot", "statesnap"]
S3_REF = "raw-stream"
# (op, other method, least speedup of statesnap over it = other's time ÷ statesnap's, what).
S3_TARGETS = [
    ("take", "torchsnapshot", 1.3, "statesnap take at least 1.3x faster than torchsnapshot"),
    ("take", "dcp", 3.0, "statesnap take at least 3x faster than DCP"),
    ("restore", "raw-stream", 1.0, "statesnap restore at least as fast as the raw stream load"),
]
# Median seconds (take, restore) of 3 rounds measured earlier on this machine at 128 MiB
# against moto's server (no statesnap figure among them), shown next to a run's medians.
S3_EARLIER_128MIB = {
    "raw-stream": (2.76, 1.28),
    "torch.save": (2.50, 1.86),
    "torchsnapshot": (2.17, 2.10),
    "dcp": (5.15, 5.68),
}


def _s3_option_value(text: str) -> Any:
    """``--s3-option`` values: sizes (``16MiB``) and integers become ints, ``true``/``false``
    bools, JSON objects and lists (``config_kwargs={...}``) what they say; else the string."""
    if re.fullmatch(r"-?[0-9]+", text):
        return int(text)
    if re.fullmatch(r"[0-9.]+\s*[A-Za-z]+", text):
        with contextlib.suppress(ValueError):
            return parse_size(text)
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if text[:1] in "{[":
        return json.loads(text)
    with contextlib.suppress(ValueError):
        return float(text)
    return text


def _parse_s3_options(items: Sequence[str]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--s3-option wants KEY=VALUE, got {item!r}")
        options[key.strip()] = _s3_option_value(value.strip())
    return options


def run_s3_rounds(
    runner: Runner,
    server: S3Server,
    states: Sequence[StateCase],
    variants: Sequence[Variant],
    reps: int,
    statesnap_options: dict[str, Any],
) -> list[Row]:
    """Per round, state and variant: a fresh bucket, the take into it, the restore from it,
    then every object and the bucket deleted (the server keeps at most one snapshot)."""
    rows: list[Row] = []
    s3 = {
        "storage_options": server.storage_options(),
        "statesnap_options": statesnap_options,
        "server_pid": server.pid,
    }

    def job(op: str, v: Variant, state: StateCase, url: str) -> dict[str, Any]:
        if not server.alive():
            code = server.proc.returncode if server.proc is not None else None
            return {"ok": False, "error": f"the S3 server is gone (exit code {code})"}
        return runner.job(
            {
                "op": op,
                "method": v.writer,
                "mode": "s3",
                "state": state.args,
                "path": url,
                "s3": s3,
            },
            v.env,
        )

    def server_extra(result: dict[str, Any]) -> dict[str, Any]:
        extra: dict[str, Any] = {"server_rss_after": server.rss() if server.alive() else None}
        if result.get("server_cpu_seconds") is not None:
            extra["server_cpu_seconds"] = result["server_cpu_seconds"]
        return extra

    for rnd in range(reps):
        _log(f"round {rnd + 1}/{reps}")
        for state in states:
            for v in variants:
                bucket = ""
                try:
                    if server.alive():
                        bucket = server.new_bucket()
                    url = f"s3://{bucket}/{re.sub(r'[^A-Za-z0-9.]+', '-', v.label)}"
                    take = job("take", v, state, url)
                    if take.get("ok"):
                        take["disk"] = server.stored(bucket)
                    rows.append(
                        _row("s3", state, rnd, v, "take", "s3", v.writer, take, server_extra(take))
                    )
                    for reader in v.readers:
                        result = (
                            job("restore", v, state, url)
                            if take.get("ok")
                            else {"ok": False, "error": "its take failed"}
                        )
                        rows.append(
                            _row(
                                "s3",
                                state,
                                rnd,
                                v,
                                "restore",
                                "s3",
                                reader,
                                result,
                                server_extra(result),
                            )
                        )
                finally:
                    if bucket and server.alive():
                        server.remove_bucket(bucket)
    return rows


def _server_share(rows: Sequence[Row]) -> list[float]:
    """Per round: the server's CPU seconds during the call ÷ the call's wall seconds."""
    return [
        r.extra["server_cpu_seconds"] / r.seconds
        for r in rows
        if r.ok and r.seconds and r.extra.get("server_cpu_seconds") is not None
    ]


def s3_op_table(
    rows: Sequence[Row], op: str, refs: Sequence[str] = (S3_REF, "statesnap")
) -> list[str]:
    """One op of one state: medians, MB/s, ratios per round, the server's CPU share, RSS,
    bytes stored (take) or where the restore loads into, check."""
    rows = [r for r in rows if r.op == op]
    if not rows:
        return []
    groups = _group(rows)
    refs = [ref for ref in refs if ref in groups]
    head = ["method", "median s", "MB/s"] + [f"time ÷ {ref}" for ref in refs]
    head += ["per round s", "server CPU ÷ wall", "peak RSS above baseline"]
    head += ["stored" if op == "take" else "loads into", "check"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, mine in groups.items():
        ok = [r for r in mine if r.ok and r.seconds is not None]
        med = _median(r.seconds for r in ok)  # type: ignore[misc]
        payload = mine[0].payload_bytes or next((r.payload_bytes for r in mine), 0)
        cells = [label, fmt_s(med), f"{payload / med / 1e6:.0f}" if med else "—"]
        cells += [_fmt_ratio(_round_ratios(mine, groups[ref])) for ref in refs]
        cells.append(", ".join(fmt_s(r.seconds) if r.ok and r.seconds else "✗" for r in mine))
        cells.append(_fmt_ratio(_server_share(mine)))
        rss = _median(r.peak_rss for r in ok if r.peak_rss is not None)
        cells.append(fmt_size(rss) if rss is not None else "—")
        if op == "take":
            disk = next((r.disk for r in reversed(ok) if r.disk), None)
            cells.append(
                f"{fmt_size(disk['apparent'])} in {disk['files']} "
                f"object{'' if disk['files'] == 1 else 's'}"
                if disk
                else "—"
            )
        else:
            cells.append(_loads_into(mine))
        cells.append(_status(mine, op))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def s3_targets(rows: Sequence[Row]) -> list[str]:
    """Each target on a line: the per-round speedups of statesnap (other's time ÷ statesnap's),
    their median against the target, pass or miss."""
    out = []
    for op, other, least, what in S3_TARGETS:
        sel = _group(r for r in rows if r.op == op)
        mine, theirs = sel.get("statesnap", []), sel.get(other, [])
        ratios = _round_ratios(theirs, mine)
        if not ratios:
            missing = [
                f"{name}: " + (_status(got, op) if got else "not in --methods")
                for name, got in (("statesnap", mine), (other, theirs))
                if not any(r.ok for r in got)
            ]
            why = "; ".join(missing) or "no round in which both worked"
            out.append(f"- {what}: **miss**, not measured ({why})")
            continue
        med = statistics.median(ratios)
        verdict = "**pass**" if med >= least else "**MISS**"
        mine_s = _median(r.seconds for r in mine if r.ok and r.seconds)
        theirs_s = _median(r.seconds for r in theirs if r.ok and r.seconds)
        out.append(
            f"- {what} ({op}: {other} s ÷ statesnap s ≥ {least:g}): {_fmt_ratio(ratios)}: "
            f"{verdict} ({fmt_s(theirs_s)} s vs {fmt_s(mine_s)} s)"
        )
    return out


def s3_earlier_table(rows: Sequence[Row]) -> list[str]:
    """This run's medians next to the figures measured earlier at 128 MiB."""
    head = ["method", "take s, earlier", "take s, this run", "restore s, earlier"]
    head += ["restore s, this run"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label in [*S3_EARLIER_128MIB, "statesnap"]:
        earlier = S3_EARLIER_128MIB.get(label)
        cells = [label]
        for i, op in enumerate(("take", "restore")):
            now = _median(r.seconds for r in rows if r.label == label and r.op == op and r.ok)
            cells += [fmt_s(earlier[i]) if earlier else "—", fmt_s(now)]
        out.append("| " + " | ".join(cells) + " |")
    return out


def case_s3(args: argparse.Namespace, runner: Runner, env: dict[str, str]) -> CaseResult:
    sizes = args.size or [128 * MIB, GIB]
    states = [
        StateCase(fmt_size(s), {"kind": "model", "size": s, "seed": args.seed}) for s in sizes
    ]
    methods = args.methods or DEFAULT_S3_METHODS
    for m in methods:
        if m not in S3_WRITERS:
            raise SystemExit(f"--case s3: unknown method {m!r}; known: {', '.join(S3_WRITERS)}")
    statesnap_options = _parse_s3_options(args.s3_option)
    aws = sorted(k for k in os.environ if k.startswith("AWS_"))
    if aws:
        _log(f"note: the harness's environment sets {', '.join(aws)}; every worker inherits them")
    with S3Server(cwd=REPO) as server:
        _log(f"S3 server (moto) at {server.endpoint_url}, pid {server.pid}")
        rss_start = server.rss()
        variants = [
            Variant(
                m,
                m,
                [m],
                dict(env) if m == "statesnap" else server.environ() if m == "torchsnapshot" else {},
            )
            for m in methods
        ]
        rows = run_s3_rounds(runner, server, states, variants, args.reps, statesnap_options)
        rss_end = server.rss() if server.alive() else None
    try:
        from importlib.metadata import version

        versions = ", ".join(f"{p} {version(p)}" for p in ("moto", "s3fs", "aiobotocore"))
    except Exception:
        versions = "versions unknown"
    rss_after = [r.extra["server_rss_after"] for r in rows if r.extra.get("server_rss_after")]
    out = [
        "",
        f"S3 server: moto's (`moto.server.ThreadedMotoServer`: werkzeug, a thread per "
        f"connection, request logging off) on 127.0.0.1, in a process of its own started once "
        f"for the run; {versions}. A fresh bucket per take, read back by its restore, then "
        "emptied and deleted. statesnap's storage_options: endpoint_url, key, secret, "
        "client_kwargs={'region_name': ...}"
        + (
            f" + {statesnap_options} (--s3-option)"
            if statesnap_options
            else " (plugin defaults otherwise)"
        )
        + ".",
        "",
        f"**This machine has {os.cpu_count()} logical cores, shared by the client (the worker) "
        "and the S3 server.** *Server CPU ÷ wall*: the server process's CPU time (utime + stime "
        "of all its threads, `/proc/PID/stat`) during the timed call ÷ the call's wall time, "
        "per round in parentheses: 0.5 means the server kept one core busy half the time; the "
        "rest of each figure is the client, the loopback network and waiting. MB/s = tensor "
        "payload ÷ seconds, MB = 10⁶ bytes.",
        "",
        f"Server RSS: {fmt_size(rss_start)} at the start, at most "
        f"{fmt_size(max(rss_after)) if rss_after else '—'} after an operation (its objects "
        f"deleted after each restore), {fmt_size(rss_end) if rss_end else '—'} at the end.",
    ]
    for s in states:
        sel = [r for r in rows if r.state == s.label]
        out += ["", f"#### {describe_spec(build_spec(s.args))}"]
        for op, title in (
            ("take", "Take, to the S3 server"),
            ("restore", "Restore, from the S3 server"),
        ):
            table = s3_op_table(sel, op)
            if table:
                out += ["", f"**{title}**", "", *table]
        out += ["", "Targets (per-round ratios, median first):", "", *s3_targets(sel)]
        if s.args["size"] == 128 * MIB:
            out += [
                "",
                "Figures measured earlier on this machine at 128 MiB (moto's server, median of "
                "3 rounds), next to this run's medians:",
                "",
                *s3_earlier_table(sel),
            ]
    out += ["", _method_notes(variants, S3_WRITERS, S3_READERS)]
    return rows, out


CASES = {
    "main": case_main,
    "many-small": case_many_small,
    "restore-memory": case_restore_memory,
    "read-object": case_read_object,
    "scaling": case_scaling,
    "dist": case_dist,
    "async": case_async,
    "async-loop": case_async_loop,
    "checksums": case_checksums,
    "s3": case_s3,
    "reshard": case_reshard,
}

CASE_DEFAULTS: dict[str, dict[str, Any]] = {
    "main": {"modes": ["cache", "fsync"], "temps": ["warm", "cold"]},
    "many-small": {"modes": ["cache", "fsync"], "temps": ["warm", "cold"]},
    "restore-memory": {"modes": ["cache"], "temps": ["warm"]},
    "read-object": {"modes": ["fsync"], "temps": ["cold", "warm"]},
    "scaling": {"modes": ["cache"], "temps": ["warm"]},
    "dist": {"modes": ["cache", "fsync"], "temps": ["warm"]},
    "async": {"modes": ["fsync", "cache"], "temps": []},
    "async-loop": {"modes": ["fsync"], "temps": []},
    "checksums": {"modes": ["cache", "fsync"], "temps": ["warm", "cold"]},
    "s3": {"modes": ["cache"], "temps": []},
    "reshard": {"modes": ["fsync"], "temps": ["warm"]},
}


# ---------------------------------------------------------------------------------------------
# Command line.


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _sizes(values: list[str] | None) -> list[int]:
    return [parse_size(x) for v in values or [] for x in _csv(v)]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Each case prints markdown to stdout (progress goes to stderr).",
    )
    p.add_argument("--case", choices=list(CASES), default="main")
    p.add_argument(
        "--size",
        action="append",
        metavar="SIZE",
        help="state size(s), e.g. 512MiB,2GiB (repeatable). main: 512MiB,2GiB; "
        "many-small: total 200MiB; restore-memory, read-object, checksums: 2GiB; dist: 1GiB "
        "(the model; each rank's own state is a tenth of it); async: 512MiB; s3: 128MiB,1GiB; "
        "reshard: 1GiB (the global tensors)",
    )
    p.add_argument("--reps", type=int, default=3, help="rounds (median over them); default 3")
    p.add_argument(
        "--methods",
        type=_csv,
        help=f"comma-separated writers: {','.join(WRITERS)} (their readers follow); "
        f"async: {','.join(ASYNC_METHODS)}; async-loop: none,take,async_take; "
        f"s3: {','.join(S3_WRITERS)}; reshard: {','.join(RESHARD_METHODS)}",
    )
    p.add_argument(
        "--modes", type=_csv, help="take modes: cache (no fsync), fsync; default per case"
    )
    p.add_argument("--temps", type=_csv, help="restore page-cache states: warm, cold")
    p.add_argument(
        "--dir",
        default="/tmp/statesnap-bench",
        help="scratch directory (a run-<pid> subdirectory is made and removed)",
    )
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="STATESNAP_* variable for the statesnap workers (repeatable)",
    )
    p.add_argument("--json", metavar="PATH", help="save every measurement as JSON")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--count", type=int, default=20_000, help="many-small: number of tensors")
    p.add_argument(
        "--leaves",
        type=lambda s: [int(x) for x in _csv(s)],
        default=[10_000, 100_000],
        help="scaling: leaf counts, e.g. 10000,100000",
    )
    p.add_argument(
        "--worlds",
        type=lambda s: [int(x) for x in _csv(s)],
        default=[1, 2, 4],
        help="dist: world sizes, e.g. 1,2,4 (that many processes per operation)",
    )
    p.add_argument(
        "--scenarios",
        type=_csv,
        help="reshard: which restores, comma-separated, default all: "
        + ", ".join(f"{sc.name} ({sc.title})" for sc in RESHARD_SCENARIOS.values()),
    )
    p.add_argument(
        "--calls",
        type=int,
        default=3,
        help="async: calls per worker (the first in a fresh process, then later ones)",
    )
    p.add_argument(
        "--series",
        type=int,
        default=10,
        help="async: calls of statesnap's async_take per worker (its RSS and pool series)",
    )
    p.add_argument("--steps", type=int, default=300, help="async-loop: timed training steps")
    p.add_argument("--interval", type=int, default=25, help="async-loop: steps between snapshots")
    p.add_argument("--batch", type=int, default=64, help="async-loop: batch size")
    p.add_argument(
        "--dims",
        type=lambda s: [int(x) for x in _csv(s)],
        default=[512, 1536, 1536, 512],
        help="async-loop: MLP layer widths, e.g. 512,1536,1536,512",
    )
    p.add_argument(
        "--budget",
        type=parse_size,
        default=64 * MIB,
        help="restore-memory: STATESNAP_MEMORY_BUDGET_BYTES for the low-budget run",
    )
    p.add_argument(
        "--s3-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="s3: an option for statesnap's storage_options (repeatable), e.g. part_bytes=16MiB, "
        "max_concurrent_requests=32; sizes become bytes, integers ints, JSON objects dicts",
    )
    p.add_argument(
        "--settle-memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="before each timed operation, wait until the kernel has stopped handing freed "
        "memory back to the host (VMs with free page reporting; elsewhere a no-op); default on",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=1800.0,
        help="seconds before a worker is killed and its op reported failed",
    )
    args = p.parse_args(argv)
    args.size = _sizes(args.size)
    defaults = CASE_DEFAULTS[args.case]
    args.modes = args.modes or defaults["modes"]
    args.temps = args.temps if args.temps is not None else defaults["temps"]
    for m in args.modes:
        if m not in ("cache", "fsync"):
            p.error(f"unknown mode {m!r}")
    for t in args.temps:
        if t not in ("warm", "cold"):
            p.error(f"unknown restore temperature {t!r}")
    return args


def _parse_env(items: Sequence[str]) -> dict[str, str]:
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("STATESNAP_"):
            raise SystemExit(f"--env wants STATESNAP_NAME=VALUE, got {item!r}")
        # The library parses plain integers; accept sizes like 64MiB for convenience.
        if value and not value.isdigit() and re.fullmatch(r"[0-9.]+\s*[A-Za-z]+", value):
            value = str(parse_size(value))
        env[key] = value
    return env


def _needed_bytes(args: argparse.Namespace) -> int:
    if args.case == "reshard":  # every method's save of the state is on disk at once
        size = (args.size or [GIB])[0]
        return int(size * 1.2) * len(args.methods or RESHARD_METHODS) + GIB
    sizes = args.size or ([2 * GIB] if args.case != "many-small" else [200 * MIB])
    return int(max(sizes) * 1.2) + GIB


def _settle_line(asked: bool, waits: Sequence[float]) -> str:
    if not asked:
        return "Memory: not settled before the timed operations (`--no-settle-memory`)."
    if not waits:
        return "Memory: no free page reporting seen on this machine; nothing to settle."
    return (
        "Memory: before each timed operation the worker waited until the kernel had handed no "
        f"freed memory back to the host for {SETTLE_QUIET_SECONDS:g} s (waits: median "
        f"{statistics.median(waits):.1f} s, "
        f"{min(waits):.1f}-{max(waits):.1f} s, {len(waits)} operations)."
    )


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    env = _parse_env(args.env)
    inherited = sorted(k for k in os.environ if k.startswith("STATESNAP_"))
    if inherited:
        _log(
            f"note: the harness's own environment sets {', '.join(inherited)}; every worker "
            "inherits them"
        )
    free = shutil.disk_usage(
        args.dir if os.path.isdir(args.dir) else os.path.dirname(os.path.abspath(args.dir))
    ).free
    if free < _needed_bytes(args):
        raise SystemExit(
            f"{args.dir}: {fmt_size(free)} free, this case needs about "
            f"{fmt_size(_needed_bytes(args))}"
        )
    runner = Runner(args.dir, args.timeout, {}, settle_memory=args.settle_memory)
    machine = machine_description(runner.run_dir)
    commit = library_commit(REPO)

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(f"stopped by signal {signum}")

    previous = signal.signal(signal.SIGTERM, on_term)
    started = time.time()
    try:
        rows, body = CASES[args.case](args, runner, env)
    finally:
        runner.close()
        signal.signal(signal.SIGTERM, previous)
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    commit_after = library_commit(REPO)
    if commit_after != commit:
        commit = f"{commit} at the start, {commit_after} at the end (it changed during the run)"
    argv_used = list(sys.argv[1:] if argv is None else argv)
    header = [
        f"### {args.case} — {when}, library commit {commit}",
        "",
        "Command: `python -m benchmarks.bench_io " + " ".join(argv_used) + "`",
        "",
        f"Reps: {args.reps} (rounds, methods interleaved; medians, with each round in "
        f"parentheses); statesnap env: {env or 'library defaults'}; wall time "
        f"{(time.time() - started) / 60:.1f} min.",
        "",
        _settle_line(args.settle_memory, runner.settle_waits),
        "",
        "Machine:",
        "",
        *machine,
    ]
    print("\n".join(header + body))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(
                {
                    "case": args.case,
                    "date": when,
                    "commit": commit,
                    "argv": argv_used,
                    "env": env,
                    "machine": machine,
                    "rows": [asdict(r) for r in rows],
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
