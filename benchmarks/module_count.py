"""How many of the library's modules a plain take and a plain restore run code in.

The state is a small model, its Adam optimizer and a ``StateDict`` of primitives. A profile
hook on every thread records the file of each Python function the library calls during one
``Snapshot.take`` and one ``Snapshot.restore`` (after a warm-up pair, so lazy imports are
done). The hook is installed before the warm-up: the threads the library starts then and keeps
(its I/O loop, where rank 0 opens storage, checks the path and commits) carry it too. Usage:
``python -m benchmarks.module_count [--list]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch

from snapshot import Snapshot, StateDict

PACKAGES = ("snapshot", "storage_plugins", "manifest")


def _state() -> dict[str, Any]:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    return {"model": model, "optim": optimizer, "extra": StateDict(step=3, name="run")}


class Recorder:
    """A profile hook for every thread started while it is installed (and the calling one),
    which records the library files whose functions run during ``entered(call)``."""

    def __init__(self) -> None:
        import snapshot

        root = os.path.dirname(os.path.dirname(os.path.realpath(snapshot.__file__)))
        self.root = root
        self.prefixes = tuple(os.path.join(root, p) + os.sep for p in PACKAGES)
        self.seen: set[str] | None = None  # recording only inside ``entered``

    def hook(self, frame: FrameType, event: str, arg: object) -> None:
        seen = self.seen
        if (
            seen is not None
            and event == "call"
            and frame.f_code.co_filename.startswith(self.prefixes)
        ):
            seen.add(os.path.relpath(frame.f_code.co_filename, self.root))

    def __enter__(self) -> Recorder:
        threading.setprofile(self.hook)
        sys.setprofile(self.hook)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]

    def entered(self, call: Callable[[], object]) -> list[str]:
        """The library files whose functions run during ``call()``, on any thread that
        carries the hook."""
        self.seen = set()
        try:
            call()
        finally:
            found, self.seen = self.seen, None
        return sorted(found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print the modules, not only counts")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root, Recorder() as recorder:
        app_state = _state()
        Snapshot.take(os.path.join(root, "warm"), app_state)
        Snapshot(os.path.join(root, "warm")).restore(_state())
        path = os.path.join(root, "snap")
        take = recorder.entered(lambda: Snapshot.take(path, app_state))
        restore = recorder.entered(lambda: Snapshot(path).restore(_state()))
    for name, found in (("take", take), ("restore", restore)):
        print(f"{name}: {len(found)} modules")
        if args.list:
            print("".join(f"    {m}\n" for m in found), end="")


if __name__ == "__main__":
    main()
