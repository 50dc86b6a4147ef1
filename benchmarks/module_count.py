"""How many of the library's modules a plain take and a plain restore run code in.

The state is a small model, its Adam optimizer and a ``StateDict`` of primitives. A profile
hook on every thread records the file of each Python function the library calls during one
``Snapshot.take`` and one ``Snapshot.restore`` (after a warm-up pair, so lazy imports are
done). Usage: ``python -m benchmarks.module_count [--list]``.
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


def modules_entered(call: Callable[[], object]) -> list[str]:
    """The library files whose functions run during ``call()``, on any thread."""
    import snapshot

    root = os.path.dirname(os.path.dirname(os.path.realpath(snapshot.__file__)))
    prefixes = tuple(os.path.join(root, p) + os.sep for p in PACKAGES)
    seen: set[str] = set()

    def hook(frame: FrameType, event: str, arg: object) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(prefixes):
            seen.add(os.path.relpath(frame.f_code.co_filename, root))

    threading.setprofile(hook)
    sys.setprofile(hook)
    try:
        call()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    return sorted(seen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print the modules, not only counts")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        app_state = _state()
        Snapshot.take(os.path.join(root, "warm"), app_state)
        Snapshot(os.path.join(root, "warm")).restore(_state())
        path = os.path.join(root, "snap")
        take = modules_entered(lambda: Snapshot.take(path, app_state))
        restore = modules_entered(lambda: Snapshot(path).restore(_state()))
    for name, found in (("take", take), ("restore", restore)):
        print(f"{name}: {len(found)} modules")
        if args.list:
            print("".join(f"    {m}\n" for m in found), end="")


if __name__ == "__main__":
    main()
