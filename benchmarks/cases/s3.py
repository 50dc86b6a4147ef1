"""``--case s3``: the state at ``--size`` (default 128 MiB and 1 GiB) taken to and restored from
a local S3 server (moto's, in a process of its own, ``benchmarks.s3server``): statesnap's S3
plugin against one raw multipart upload stream / one streaming GET, torch.save + s3fs pipe,
torchsnapshot's S3 plugin and DCP's fsspec writer/reader; the server's CPU time during each
call, and the targets."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks.common import (
    GIB,
    MIB,
    build_spec,
    describe_spec,
    fmt_size,
    parse_size,
)
from benchmarks.harness import (
    REPO,
    CaseResult,
    Row,
    Runner,
    StateCase,
    Variant,
    fmt_ratio,
    fmt_s,
    group,
    loads_into,
    log,
    make_row,
    median,
    method_notes,
    round_ratios,
    status,
)
from benchmarks.methods import (
    S3_READERS,
    S3_WRITERS,
)
from benchmarks.s3server import S3Server

NAME = "s3"
DEFAULTS = {"modes": ["cache"], "temps": []}
LIBRARY_VARIANTS = False
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--s3-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="s3: an option for statesnap's storage_options (repeatable), e.g. part_bytes=16MiB, "
        "max_concurrent_requests=32; sizes become bytes, integers ints, JSON objects dicts",
    )


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
        log(f"round {rnd + 1}/{reps}")
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
                        make_row(
                            NAME, state, rnd, v, "take", "s3", v.writer, take, server_extra(take)
                        )
                    )
                    for reader in v.readers:
                        result = (
                            job("restore", v, state, url)
                            if take.get("ok")
                            else {"ok": False, "error": "its take failed"}
                        )
                        rows.append(
                            make_row(
                                NAME,
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
    groups = group(rows)
    refs = [ref for ref in refs if ref in groups]
    head = ["method", "median s", "MB/s"] + [f"time ÷ {ref}" for ref in refs]
    head += ["per round s", "server CPU ÷ wall", "peak RSS above baseline"]
    head += ["stored" if op == "take" else "loads into", "check"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, mine in groups.items():
        ok = [r for r in mine if r.ok and r.seconds is not None]
        med = median(r.seconds for r in ok)  # type: ignore[misc]
        payload = mine[0].payload_bytes or next((r.payload_bytes for r in mine), 0)
        cells = [label, fmt_s(med), f"{payload / med / 1e6:.0f}" if med else "—"]
        cells += [fmt_ratio(round_ratios(mine, groups[ref])) for ref in refs]
        cells.append(", ".join(fmt_s(r.seconds) if r.ok and r.seconds else "✗" for r in mine))
        cells.append(fmt_ratio(_server_share(mine)))
        rss = median(r.peak_rss for r in ok if r.peak_rss is not None)
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
            cells.append(loads_into(mine))
        cells.append(status(mine, op))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def s3_targets(rows: Sequence[Row]) -> list[str]:
    """Each target on a line: the per-round speedups of statesnap (other's time ÷ statesnap's),
    their median against the target, pass or miss."""
    out = []
    for op, other, least, what in S3_TARGETS:
        sel = group(r for r in rows if r.op == op)
        mine, theirs = sel.get("statesnap", []), sel.get(other, [])
        ratios = round_ratios(theirs, mine)
        if not ratios:
            missing = [
                f"{name}: " + (status(got, op) if got else "not in --methods")
                for name, got in (("statesnap", mine), (other, theirs))
                if not any(r.ok for r in got)
            ]
            why = "; ".join(missing) or "no round in which both worked"
            out.append(f"- {what}: **miss**, not measured ({why})")
            continue
        med = statistics.median(ratios)
        verdict = "**pass**" if med >= least else "**MISS**"
        mine_s = median(r.seconds for r in mine if r.ok and r.seconds)
        theirs_s = median(r.seconds for r in theirs if r.ok and r.seconds)
        out.append(
            f"- {what} ({op}: {other} s ÷ statesnap s ≥ {least:g}): {fmt_ratio(ratios)}: "
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
            now = median(r.seconds for r in rows if r.label == label and r.op == op and r.ok)
            cells += [fmt_s(earlier[i]) if earlier else "—", fmt_s(now)]
        out.append("| " + " | ".join(cells) + " |")
    return out


def run(args: argparse.Namespace, runner: Runner) -> CaseResult:
    env = args.statesnap_env
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
        log(f"note: the harness's environment sets {', '.join(aws)}; every worker inherits them")
    with S3Server(cwd=REPO) as server:
        log(f"S3 server (moto) at {server.endpoint_url}, pid {server.pid}")
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
    out += ["", method_notes(variants, S3_WRITERS, S3_READERS)]
    return rows, out
