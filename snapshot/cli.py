"""Command line: ``python -m snapshot demo`` (and the ``statesnap`` console script)."""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from collections.abc import Sequence


def _demo(args: argparse.Namespace) -> int:
    from snapshot.demo import run_demo

    if args.path:
        return run_demo(args.path, steps=args.steps)
    with tempfile.TemporaryDirectory(prefix="statesnap-demo-") as tmp:
        return run_demo(f"{tmp}/snapshot", steps=args.steps)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="statesnap", description=__doc__)
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", help="train a small model, snapshot it, restore it, check training continues"
    )
    demo.add_argument("--path", help="where to take the snapshot (default: a temporary directory)")
    demo.add_argument("--steps", type=int, default=5, help="training steps before and after")
    demo.set_defaults(func=_demo)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING - 10 * min(args.verbose, 2),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
