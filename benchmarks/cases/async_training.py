"""``--case async-training``: snapshots during a CPU training loop (an MLP and a small
transformer, AdamW), statesnap's async_take and take beside DCP's async_save in thread mode,
process mode and with its ``DefaultStager`` (``benchmarks.async_training``): (a) what a call
blocks the loop for, as a multiple of a plain copy of the state; (b) the loop's time per step
÷ the loop without snapshots; (c) peak RSS above the loop's start; (d) RSS over a series of
snapshots in one process. Then a cProfile of statesnap's snapshot calls in the loop."""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from typing import Any

from benchmarks.async_training import METHODS, TrainConfig
from benchmarks.common import MIB, fmt_size
from benchmarks.harness import CaseResult, Row, Runner, fmt_ratio, fmt_s, log
from benchmarks.harness.cli import csv_list, int_list

NAME = "async-training"
DEFAULTS: dict[str, list[str]] = {"modes": ["fsync"], "temps": []}
LIBRARY_VARIANTS = False
LABELS = {
    "none": "no snapshots",
    "ss-async": "statesnap async_take",
    "ss-overlap": "statesnap async_take, staged in the background",
    "ss-overlap-budget": "statesnap async_take, staged in the background, budget 1/4 state",
    "ss-take": "statesnap take",
    "dcp-thread": "DCP async_save, thread",
    "dcp-process": "DCP async_save, process",
    "dcp-stager": "DCP async_save, DefaultStager",
}
SNAPSHOT_METHODS = [m for m in METHODS if m != "none"]
SERIES_MARKS = (1, 5, 10, 20, 30, 40, 50)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--models", type=csv_list, default=["mlp", "transformer"], help="async-training: models"
    )
    parser.add_argument(
        "--train-steps", type=int, default=60, help="async-training: timed steps per loop"
    )
    parser.add_argument(
        "--train-interval", type=int, default=10, help="async-training: steps between snapshots"
    )
    parser.add_argument(
        "--mlp-dims",
        type=int_list,
        default=[2048, 2560, 2560, 2048],
        help="async-training: MLP widths",
    )
    parser.add_argument("--mlp-batch", type=int, default=16, help="async-training: MLP batch")
    parser.add_argument(
        "--transformer",
        type=int_list,
        default=[640, 4, 2560, 10, 2, 32],
        help="async-training: d_model,layers,ff,heads,batch,seq of the transformer",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="async-training: torch threads of the loop"
    )
    parser.add_argument(
        "--series-count", type=int, default=50, help="async-training: snapshots in the series"
    )
    parser.add_argument(
        "--series-dims",
        type=int_list,
        default=[512, 1024, 1024, 512],
        help="async-training: MLP widths of the series' state",
    )
    parser.add_argument(
        "--paired",
        action="store_true",
        help="async-training: a snapshot in every other window of --train-interval steps, so "
        "that (b) compares windows with and without one in the same loop (use --train-steps "
        "of many windows, e.g. 200)",
    )
    parser.add_argument(
        "--no-profile",
        action="store_true",
        help="async-training: skip the cProfile runs of statesnap's snapshots in the loop",
    )


def configs(args: argparse.Namespace) -> dict[str, TrainConfig]:
    base = TrainConfig(
        steps=args.train_steps,
        interval=args.train_interval,
        seed=args.seed,
        threads=args.threads,
        paired=args.paired,
    )
    d_model, layers, ff, heads, batch, seq = args.transformer
    out = {
        "mlp": replace(base, model="mlp", dims=tuple(args.mlp_dims), batch=args.mlp_batch),
        "transformer": replace(
            base,
            model="transformer",
            d_model=d_model,
            layers=layers,
            ff=ff,
            heads=heads,
            batch=batch,
            seq=seq,
        ),
    }
    return {m: out[m] for m in args.models}


def _job(runner: Runner, env: dict[str, str], name: str, job: dict[str, Any]) -> dict[str, Any]:
    path = runner.data_dir(name)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    try:
        return runner.job({"op": "async-training", "path": path, **job}, env)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _row(model: str, rnd: int, method: str, op: str, result: dict[str, Any]) -> Row:
    extra = {k: v for k, v in result.items() if k not in ("ok", "error", "seconds")}
    row = Row(
        case=NAME,
        state=model,
        round=rnd,
        variant=LABELS[method],
        writer=method,
        op=op,
        mode="fsync",
        method=method,
        ok=bool(result.get("ok")),
        seconds=result.get("seconds"),
        peak_rss=result.get("peak_rss_above_start"),
        payload_bytes=result.get("state_bytes", 0),
        error=result.get("error", ""),
        extra=extra,
    )
    if row.ok:
        what = f"{fmt_s(row.seconds)} s" if op != "series" else f"{len(extra['calls'])} calls"
        log(f"  [{model} {op} round {rnd + 1}] {LABELS[method]}: {what}")
    else:
        log(f"  [{model} {op} round {rnd + 1}] {LABELS[method]}: FAILED {row.error}")
        log(result.get("traceback", ""))
    return row


def run(args: argparse.Namespace, runner: Runner) -> CaseResult:
    env = args.statesnap_env
    methods = args.methods or list(METHODS)
    for m in methods:
        if m not in METHODS:
            raise SystemExit(f"--case {NAME}: unknown method {m!r}; known: {', '.join(METHODS)}")
    cfgs = configs(args)
    rows: list[Row] = []
    for rnd in range(args.reps):
        log(f"round {rnd + 1}/{args.reps}")
        for model, cfg in cfgs.items():
            for m in methods if rnd % 2 == 0 else methods[::-1]:
                job = {"kind": "loop", "method": m, "config": asdict(cfg)}
                rows.append(_row(model, rnd, m, "loop", _job(runner, env, f"{model}-{m}", job)))
    if not args.no_profile:
        for model, cfg in cfgs.items():
            for m in ("ss-async", "ss-take"):
                if m in methods:
                    job = {"kind": "loop", "method": m, "config": asdict(cfg), "profile": True}
                    rows.append(_row(model, 0, m, "profile", _job(runner, env, "prof", job)))
    series_cfg = TrainConfig(
        dims=tuple(args.series_dims), batch=16, seed=args.seed, threads=args.threads
    )
    for m in [m for m in methods if m != "none"]:
        job = {"kind": "series", "method": m, "config": asdict(series_cfg)}
        job["count"] = args.series_count
        rows.append(_row("series", 0, m, "series", _job(runner, env, f"series-{m}", job)))
    out = ["", *describe(args, cfgs, rows)]
    for model in cfgs:
        loops = [r for r in rows if r.state == model and r.op == "loop"]
        out += ["", f"### {model}", ""]
        out += ["**(a) what a snapshot blocks the loop for ÷ a plain copy of the state**", ""]
        out += table_a(loops, methods)
        out += ["", "**(b) loop time per step ÷ the loop without snapshots**", ""]
        out += table_b(loops, methods)
        out += table_b_split(loops, methods)
        out += ["", "**(c) peak RSS above the RSS at the loop's start**", ""]
        out += table_c(loops, methods)
    out += ["", f"### (d) {args.series_count} snapshots in a row in one process", ""]
    out += table_d([r for r in rows if r.op == "series"], methods)
    out += errors(rows)
    for r in rows:
        if r.op == "profile" and r.ok and r.extra.get("profile"):
            out += [
                "",
                f"**cProfile of the loop thread's snapshot calls and waits: {r.state}, "
                f"{LABELS[r.method]}** (tottime order; background threads not included)",
                "",
                "```",
                *_trim_profile(r.extra["profile"]),
                "```",
            ]
    return rows, out


def _trim_profile(text: str) -> list[str]:
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    return [ln.replace("/work/main/.venv/lib/python3.11/site-packages/", "") for ln in lines]


def describe(args: argparse.Namespace, cfgs: dict[str, TrainConfig], rows: list[Row]) -> list[str]:
    out = []
    for model, cfg in cfgs.items():
        size = next((r.payload_bytes for r in rows if r.state == model and r.ok), 0)
        what = (
            f"MLP {'-'.join(map(str, cfg.dims))} (Linear + GELU), batch {cfg.batch}"
            if cfg.model == "mlp"
            else f"TransformerEncoder, {cfg.layers} pre-norm layers, d_model {cfg.d_model}, "
            f"ff {cfg.ff}, {cfg.heads} heads, batch {cfg.batch} x {cfg.seq} tokens"
        )
        out.append(
            f"- {model}: {what}, AdamW; state {fmt_size(size)} (model + AdamW); "
            f"{cfg.steps} timed steps after {cfg.warmup} untimed, a snapshot before every "
            f"{cfg.interval}th ({(cfg.steps - 1) // cfg.interval} per loop); torch threads "
            f"{cfg.threads}."
        )
    return out


def _snaps(r: Row) -> list[dict[str, Any]]:
    return list(r.extra.get("snapshots", []))


def _per_round(rows: Sequence[Row], fn: Callable[[Row], float | None]) -> dict[int, float]:
    out = {}
    for r in rows:
        if r.ok:
            v = fn(r)
            if v is not None:
                out[r.round] = v
    return out


def _ratios(num: dict[int, float], den: dict[int, float]) -> list[float]:
    return [num[k] / den[k] for k in sorted(num) if den.get(k)]


def _med(vals: Sequence[float]) -> float | None:
    return statistics.median(vals) if vals else None


def _call_block(s: dict[str, Any]) -> float:
    """What the call itself blocked the loop for: the call, plus DCP's stager's staging wait."""
    return float(s["call"]) + float(s.get("staging_wait", 0.0))


def _later_block(r: Row) -> float | None:
    return _med([_call_block(s) for s in _snaps(r)[1:]])


def _first_block(r: Row) -> float | None:
    snaps = _snaps(r)
    return _call_block(snaps[0]) if snaps else None


def _by_method(rows: Sequence[Row], methods: Sequence[str]) -> list[tuple[str, list[Row]]]:
    return [(m, [r for r in rows if r.method == m]) for m in methods]


def _cell(values: dict[int, float], fmt: Callable[[float], str] = fmt_s) -> str:
    if not values:
        return "—"
    med = fmt(statistics.median(values.values()))
    if len(values) == 1:
        return med
    return f"{med} ({', '.join(fmt(values[k]) for k in sorted(values))})"


def table_a(rows: Sequence[Row], methods: Sequence[str]) -> list[str]:
    head = [
        "method",
        "1st call blocks s",
        "later calls block s (median)",
        "plain copy s (same process)",
        "1st ÷ copy",
        "later ÷ copy",
        "statesnap async_take ÷ this (later)",
        "waits for the previous snapshot s (sum)",
    ]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ss = _per_round([r for r in rows if r.method == "ss-async"], _later_block)
    for m, mine in _by_method(rows, methods):
        if m == "none":
            continue
        first, later = _per_round(mine, _first_block), _per_round(mine, _later_block)
        copy = _per_round(mine, lambda r: r.extra.get("copy_seconds"))
        waits = _per_round(mine, lambda r: sum(s["blocked_in_wait"] for s in _snaps(r)))
        out.append(
            "| "
            + " | ".join(
                [
                    LABELS[m],
                    _cell(first),
                    _cell(later),
                    _cell(copy),
                    fmt_ratio(_ratios(first, copy)),
                    fmt_ratio(_ratios(later, copy)),
                    fmt_ratio(_ratios(ss, later)),
                    _cell(waits),
                ]
            )
            + " |"
        )
    return out


def table_b(rows: Sequence[Row], methods: Sequence[str]) -> list[str]:
    head = [
        "method",
        "loop s",
        "ms per step (loop ÷ steps)",
        "÷ no snapshots",
        "median step ms",
        "median step ÷ no snapshots",
        "statesnap async_take ÷ this",
        "snapshot written after s (median)",
        "CPU s of other threads / helper per snapshot",
    ]
    paired = any("paired" in r.extra for r in rows)
    if paired:  # windows with a snapshot ÷ those without, alternating in the same loop
        head.append("paired: windows with ÷ without a snapshot")
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def per_step(r: Row) -> float:
        return float(r.extra["step_mean"])

    def pair_ratio(r: Row) -> float | None:
        p = r.extra.get("paired")
        return p["with"] / p["without"] if p and p["without"] else None

    ref = _per_round([r for r in rows if r.method == "none"], per_step)
    ref_med = _per_round([r for r in rows if r.method == "none"], lambda r: r.extra["step_median"])
    ss = _per_round([r for r in rows if r.method == "ss-async"], per_step)
    for m, mine in _by_method(rows, methods):
        step = _per_round(mine, per_step)
        med = _per_round(mine, lambda r: r.extra["step_median"])
        written = _per_round(mine, lambda r: _med([s["seen_done"] or s["call"] for s in _snaps(r)]))

        def cpu(r: Row) -> float | None:
            n = len(_snaps(r))
            helper = r.extra.get("helper", {}).get("cpu_s", 0.0)
            return (r.extra["cpu_other_threads"] + helper) / n if n else None

        out.append(
            "| "
            + " | ".join(
                [
                    LABELS[m],
                    _cell(_per_round(mine, lambda r: r.seconds)),
                    _cell(step, lambda v: f"{v * 1000:.1f}"),
                    fmt_ratio(_ratios(step, ref)),
                    _cell(med, lambda v: f"{v * 1000:.1f}"),
                    fmt_ratio(_ratios(med, ref_med)),
                    fmt_ratio(_ratios(ss, step)) if m != "none" else "",
                    _cell(written) if m != "none" else "",
                    _cell(_per_round(mine, cpu), lambda v: f"{v:.2f}") if m != "none" else "",
                    *(
                        [_cell(_per_round(mine, pair_ratio), lambda v: f"{v:.3f}")]
                        if paired
                        else []
                    ),
                ]
            )
            + " |"
        )
    return out


def table_b_split(rows: Sequence[Row], methods: Sequence[str]) -> list[str]:
    """``--paired``: what a window with a snapshot added to the loop thread's time, per window,
    split by the thread's scheduler statistics into time on a CPU, time runnable but waiting
    for a core, and time asleep (the interpreter lock, a wait, I/O)."""
    parts = ("wall", "on_cpu", "runqueue", "asleep")

    def extra(part: str) -> Callable[[Row], float | None]:
        def ms(r: Row) -> float | None:
            p = r.extra.get("paired") or {}
            w, wo = p.get("with_split"), p.get("without_split")
            if not w or not wo or not w["windows"] or not wo["windows"]:
                return None
            if part == "wall":
                mine, other = p["with"], p["without"]
            else:
                mine, other = w[part], wo[part]
            return (mine / w["windows"] - other / wo["windows"]) * 1000

        return ms

    if not any((r.extra.get("paired") or {}).get("with_split") for r in rows):
        return []
    head = [
        "method",
        "window without a snapshot, ms",
        "added: wall ms",
        "on a CPU",
        "waiting for a core",
        "asleep",
    ]
    out = [
        "",
        "**(b) split: what a window with a snapshot added to the loop thread's time, ms per "
        "window** (scheduler statistics of the loop thread; positive: the window took longer)",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]

    def base(r: Row) -> float | None:
        p = r.extra.get("paired") or {}
        wo = p.get("without_split")
        return p["without"] / wo["windows"] * 1000 if wo and wo["windows"] else None

    for m, mine in _by_method(rows, methods):
        cells = [_cell(_per_round(mine, base), lambda v: f"{v:.0f}")]
        cells += [_cell(_per_round(mine, extra(part)), lambda v: f"{v:+.1f}") for part in parts]
        out.append("| " + " | ".join([LABELS[m], *cells]) + " |")
    return out


def table_c(rows: Sequence[Row], methods: Sequence[str]) -> list[str]:
    head = [
        "method",
        "peak RSS above the start",
        "above the loop without snapshots",
        "÷ state",
        "statesnap async_take ÷ this (above the loop without)",
        "DCP helper process's own peak RSS",
    ]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def peak(r: Row) -> float:
        return float(r.peak_rss or 0)

    ref = _per_round([r for r in rows if r.method == "none"], peak)
    ss = _per_round([r for r in rows if r.method == "ss-async"], peak)
    ss_above = {k: v - ref[k] for k, v in ss.items() if k in ref}
    state = next((r.payload_bytes for r in rows if r.ok), 0)
    for m, mine in _by_method(rows, methods):
        mp = _per_round(mine, peak)
        above = {k: v - ref[k] for k, v in mp.items() if k in ref}
        helper = _per_round(mine, lambda r: r.extra.get("helper", {}).get("peak_rss"))
        out.append(
            "| "
            + " | ".join(
                [
                    LABELS[m],
                    _cell(mp, fmt_size),
                    _cell(above, fmt_size) if m != "none" else "",
                    _cell({k: v / state for k, v in above.items()}, lambda v: f"{v:.2f}")
                    if m != "none" and state
                    else "",
                    fmt_ratio(_ratios(ss_above, above))
                    if m not in ("none", "ss-async") and all(v > 0 for v in above.values())
                    else "",
                    _cell(helper, fmt_size),
                ]
            )
            + " |"
        )
    return out


def table_d(rows: Sequence[Row], methods: Sequence[str]) -> list[str]:
    marks = [n for n in SERIES_MARKS if any(len(r.extra.get("calls", [])) >= n for r in rows)]
    head = ["method", "state", *[f"RSS after {n}" for n in marks]]
    head += ["growth 5 → last", "call s (median)", "wait s (median)"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m, mine in _by_method(rows, methods):
        for r in mine:
            if not r.ok:
                continue
            calls = r.extra["calls"]
            start = r.extra["rss_start"]
            cells = [LABELS[m], fmt_size(r.extra["state_bytes"])]
            cells += [fmt_size(calls[n - 1]["rss"] - start) for n in marks if n <= len(calls)]
            cells += ["—"] * (len(marks) - len([n for n in marks if n <= len(calls)]))
            grow = calls[-1]["rss"] - calls[4]["rss"] if len(calls) >= 5 else None
            cells += [
                "—" if grow is None else f"{grow / MIB:+.1f} MiB",
                fmt_s(_med([c["call"] for c in calls])),
                fmt_s(_med([c["wait"] for c in calls])),
            ]
            out.append("| " + " | ".join(cells) + " |")
    out += ["", "RSS after each wait, above the RSS before the first call."]
    return out


def errors(rows: Sequence[Row]) -> list[str]:
    out = []
    for r in rows:
        if not r.ok:
            err = (r.error or "no result").replace("\n", " ")
            out.append(f"- {r.state} {r.op} {LABELS[r.method]}: **FAILED** {err}")
        for w in dict.fromkeys(r.extra.get("warnings", [])):
            out.append(f"- {r.state} {r.op} {LABELS[r.method]}: warned: {w.strip()}")
        if r.extra.get("helper_stopped") is False:
            out.append(f"- {r.state} {r.op} {LABELS[r.method]}: DCP's helper did not stop")
    out = list(dict.fromkeys(out))
    return ["", "Failures, warnings:", "", *out] if out else []
