"""``statesnap steps`` and ``statesnap prune``: the step folders a checkpoint manager keeps
under a root, and retention applied from the command line (``snapshot.manager``)."""

from __future__ import annotations

import argparse
import json

from snapshot._engine.format.text import printable
from snapshot._engine.manager.retention import Policy, Step, to_delete
from snapshot._engine.manager.steps import INCOMPLETE, LEFT, UNREADABLE, Steps
from snapshot._engine.tools.cli_commands import _size, _table, _write_lines
from snapshot.errors import InvalidArgumentError, SnapshotError
from snapshot.options import Options


def _steps(args: argparse.Namespace) -> Steps:
    return Steps(args.root, args.storage_options, Options.from_env())


def run_steps(args: argparse.Namespace) -> int:
    found = _steps(args).scan()
    exact = args.bytes
    rows = []
    for s in found:
        metrics = json.dumps(s.metrics, sort_keys=True) if s.metrics else "-"
        rows.append(
            [
                str(s.step),
                s.state.replace(" ", "-"),
                _size(s.nbytes, exact) if s.committed else "-",
                printable(metrics),
                printable(",".join(s.bases)) or "-",
                printable(s.name),
            ]
        )
    lines = _table(["STEP", "STATE", "SIZE", "METRICS", "BASES", "FOLDER"], rows, right={0, 2})
    committed = [s for s in found if s.committed]
    latest = committed[-1].step if committed else None
    lines.append(
        f"{len(committed)} committed, {len(found) - len(committed)} incomplete, unreadable "
        f"or left alone; latest: {latest if latest is not None else 'none'}"
    )
    for s in found:
        if s.state in (UNREADABLE, LEFT):
            lines.append(f"{printable(s.name)}: {s.state}: {printable(s.reason)}")
    _write_lines(lines)
    return 0


def run_prune(args: argparse.Namespace) -> int:
    policy = Policy(args.keep_last, args.keep_every, args.keep_best, args.metric, args.mode)
    if policy.keeps_everything:
        raise InvalidArgumentError(
            "prune: give at least one of --keep-last, --keep-every, --keep-best"
        )
    steps = _steps(args)
    found = steps.scan()
    committed = [Step(s.step, s.name, s.metrics, s.bases) for s in found if s.committed]
    unreadable = [s.name for s in found if s.state == UNREADABLE]
    doomed = to_delete(policy, committed, unreadable=unreadable)
    # Debris of takes (the pending marker and nothing else a take does not write) is deleted
    # too when asked (a take of a running job may be under way in one); nothing else is.
    debris = [s for s in found if s.state == INCOMPLETE] if args.incomplete else []
    lines = []
    verb = "would delete" if args.dry_run else "deleted"
    gone = set()
    for name in [s.name for s in doomed] + [s.name for s in debris]:
        path = printable(steps.path(name))
        if not args.dry_run:
            try:
                steps.delete(name)
            except SnapshotError as e:
                lines.append(f"kept {path}: {printable(str(e))}")
                continue
        gone.add(name)
        lines.append(f"{verb} {path}")
    for s in found:
        if s.state in (UNREADABLE, LEFT):
            lines.append(f"left alone {printable(steps.path(s.name))}: {printable(s.reason)}")
    if unreadable and to_delete(policy, committed):
        lines.append(
            "no committed step deleted: a step that cannot be read may need any other as its base"
        )
    kept = sorted(s.step for s in committed if s.name not in gone)
    lines.append(f"kept {len(kept)} committed step(s): {', '.join(map(str, kept)) or 'none'}")
    _write_lines(lines)
    return 0


def add_parsers(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Registers ``steps`` and ``prune`` on the command line's sub-parsers."""
    p_steps = sub.add_parser(
        "steps",
        parents=[common],
        help="list the step folders under a checkpoint manager's root",
        description="One row per step folder (step_<N>) under ROOT: committed, incomplete (a "
        "take that never finished: its pending marker and blobs), unreadable (a manifest that "
        "cannot be read: damaged, or of a newer statesnap) or left-alone (a link, another "
        "library's or a user's folder), its size, the metrics it was saved with, and the bases "
        "it needs (incremental snapshots).",
    )
    p_steps.add_argument("root", metavar="ROOT", help="the manager's root (local path or URL)")
    p_steps.add_argument("--bytes", action="store_true", help="sizes as exact byte counts")
    p_steps.set_defaults(func=run_steps)

    p_prune = sub.add_parser(
        "prune",
        parents=[common],
        help="delete the steps a retention policy lets go",
        description="Keeps the union of what each policy keeps (and always the newest "
        "committed step, and every base a kept step needs); deletes the other committed steps. "
        "Never deletes a step it cannot read (and, while there is one, no step), a link, or a "
        "folder holding files no take writes. Run it only while no job is saving under ROOT.",
    )
    p_prune.add_argument("root", metavar="ROOT", help="the manager's root (local path or URL)")
    p_prune.add_argument("--keep-last", type=int, metavar="N", help="keep the newest N steps")
    p_prune.add_argument("--keep-every", type=int, metavar="N", help="keep multiples of N")
    p_prune.add_argument("--keep-best", type=int, metavar="N", help="keep the N best by --metric")
    p_prune.add_argument("--metric", help="the metric --keep-best ranks by")
    p_prune.add_argument(
        "--mode", choices=("min", "max"), default="min", help="min: lower is better"
    )
    p_prune.add_argument(
        "--incomplete",
        action="store_true",
        help="also delete the debris of takes that never finished (pending marker and blobs)",
    )
    p_prune.add_argument("--dry-run", action="store_true", help="say what would be deleted")
    p_prune.set_defaults(func=run_prune)
