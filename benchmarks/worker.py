"""One measured operation in a fresh process: ``python -m benchmarks.worker JOB.json``.

The operations themselves are in :mod:`benchmarks.jobs`. This module first decides which tree
of the library the process measures, before anything imports it. The harness starts every
worker with the repository root as its working directory, so ``import snapshot`` finds the
working tree's ``snapshot/`` (``python -m`` puts the working directory first on ``sys.path``).
A worker of a ``--library NAME=PATH`` variant gets ``PATH`` in the environment variable
``BENCHMARKS_LIBRARY_TREE`` (:mod:`benchmarks.library_tree`); it puts ``PATH`` before everything
else on ``sys.path`` (so ``snapshot``, ``storage_plugins`` and ``manifest`` all come from there;
``benchmarks`` is already imported from the working tree), imports ``snapshot`` at once and
fails the job unless it came from ``PATH``.
Every worker reports the files it imported the library from (``library`` in its result, and a
line on its stdout), and fails its job when they are not in the tree it was meant to measure.
"""

from __future__ import annotations

import sys

from benchmarks.library_tree import use_tree


def main() -> None:
    tree, variant = use_tree()
    from benchmarks.jobs import run_job  # after the tree is on sys.path

    run_job(sys.argv[1], tree, variant)


if __name__ == "__main__":
    main()
