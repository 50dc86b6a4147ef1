"""Which source tree of the library a worker measures (see :mod:`benchmarks.worker`).

Nothing here imports the library: the worker calls :func:`use_tree` before anything does.
"""

from __future__ import annotations

import os
import sys

#: Environment variable naming another source tree of the library for this worker.
LIBRARY_ENV = "BENCHMARKS_LIBRARY_TREE"
#: The library's top-level packages: each must come from the tree measured.
LIBRARY_PACKAGES = ("snapshot", "storage_plugins", "manifest")


def use_tree() -> tuple[str, bool]:
    """The tree this worker measures, and whether it is another one than the working tree.
    Another tree goes first on ``sys.path``; call this before anything imports the library."""
    other = os.environ.get(LIBRARY_ENV)
    if other:
        tree = os.path.realpath(other)
        sys.path.insert(0, tree)
        return tree, True
    return os.path.realpath(os.getcwd()), False


def imported_library() -> dict[str, str]:
    """Package -> the file it was imported from, for each of the library's packages imported."""
    return {
        name: os.path.realpath(getattr(sys.modules[name], "__file__", None) or "?")
        for name in LIBRARY_PACKAGES
        if name in sys.modules
    }


def check_tree(tree: str) -> None:
    """Raises unless every package of the library imported so far comes from ``tree``."""
    wrong = {
        name: path
        for name, path in imported_library().items()
        if not path.startswith(tree.rstrip(os.sep) + os.sep)
    }
    if wrong:
        raise RuntimeError(f"the library was to be imported from {tree}, but came from {wrong}")
