"""``statesnap steps`` and ``statesnap prune``: the step folders a checkpoint manager keeps
under a root, and retention applied from the command line (``snapshot.manager``)."""

from __future__ import annotations

import argparse
import json

from snapshot._engine.cli_commands import _size, _table, _write_lines
from snapshot._engine.retention import Policy, Step, to_delete
from snapshot._engine.steps import Steps
from snapshot._engine.text import printable
from snapshot.errors import InvalidArgumentError
from snapshot.options import Options


def _steps(args: argparse.Namespace) -> Steps:
    return Steps(args.root, args.storage_options, Options.from_env())


def run_steps(args: argparse.Namespace) -> int:
    found = _steps(args).scan()
    exact = args.bytes
    rows = []
    for s in found:
        if not s.committed:
            state = "incomplete"
        elif s.damaged:
            state = "damaged"
        else:
            state = "committed"
        metrics = json.dumps(s.metrics, sort_keys=True) if s.metrics else "-"
        rows.append(
            [
                str(s.step),
                state,
                _size(s.nbytes, exact) if s.committed and not s.damaged else "-",
                printable(metrics),
                printable(",".join(s.bases)) or "-",
                printable(s.name),
            ]
        )
    lines = _table(["STEP", "STATE", "SIZE", "METRICS", "BASES", "FOLDER"], rows, right={0, 2})
    committed = [s for s in found if s.committed and not s.damaged]
    latest = committed[-1].step if committed else None
    lines.append(
        f"{len(committed)} committed, {len(found) - len(committed)} incomplete or damaged; "
        f"latest: {latest if latest is not None else 'none'}"
    )
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
    committed = [
        Step(s.step, s.name, s.metrics, s.bases) for s in found if s.committed and not s.damaged
    ]
    doomed = to_delete(policy, committed)
    # Incomplete or damaged folders are deleted too, unless asked to keep them (a take of a
    # running job may be under way in one).
    debris = [s for s in found if not s.committed or s.damaged] if args.incomplete else []
    lines = []
    verb = "would delete" if args.dry_run else "deleted"
    for s in [*doomed, *debris]:
        if not args.dry_run:
            steps.delete(s.name)
        lines.append(f"{verb} {printable(steps.path(s.name))}")
    kept = sorted({s.step for s in committed} - {s.step for s in doomed})
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
        "take that never finished) or damaged (a manifest that cannot be read), its size, the "
        "metrics it was saved with, and the bases it needs (incremental snapshots).",
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
        "Run it only while no job is saving under ROOT.",
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
        "--incomplete", action="store_true", help="also delete incomplete and damaged folders"
    )
    p_prune.add_argument("--dry-run", action="store_true", help="say what would be deleted")
    p_prune.set_defaults(func=run_prune)
