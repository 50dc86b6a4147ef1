"""A take killed with SIGKILL at any moment leaves no snapshot or a complete one, never half.

Each trial runs a 100 MiB take in a child process and kills it at a random moment of the take
(the moments spread over the take's measured duration, commit included). Then: the path holds
either no committed snapshot (``Snapshot(path)`` raises ``SnapshotNotFoundError``, or its
subclass ``IncompleteSnapshotError`` when the pending marker was written) or one whose every
tensor is bitwise what the child took; a snapshot in a sibling path is untouched; and a new take
at the path works.
"""

from __future__ import annotations

import random
import time
from typing import Any

import pytest
import torch

from snapshot import (
    IncompleteSnapshotError,
    Snapshot,
    SnapshotExistsError,
    SnapshotNotFoundError,
    StateDict,
)
from tests.multirank import PROCESS_CONTEXT

pytestmark = pytest.mark.slow  # kills real processes; -m 'not slow' skips them

TRIALS = 20
TENSORS = 25
NUMEL = 1 << 20  # 25 int32 tensors of 4 MiB: 100 MiB, plus 400 small ones for slabs


def state() -> StateDict:
    """The child's state: every value derived from its name, so the parent can check it."""
    big = {f"big{i}": torch.arange(NUMEL, dtype=torch.int32) * 7 + i for i in range(TENSORS)}
    small = {f"small{i}": torch.full((100,), float(i)) for i in range(400)}
    return StateDict({**big, **small, "step": 1234})


def _child(path: str, started: Any, took: Any) -> None:
    s = state()
    started.set()
    t0 = time.perf_counter()
    Snapshot.take(path, {"s": s})
    took.put(time.perf_counter() - t0)


def _start(path: str) -> tuple[Any, Any]:
    """A child process that takes the state at ``path``, once it has started its take; and the
    queue its take's duration arrives on."""
    started, took = PROCESS_CONTEXT.Event(), PROCESS_CONTEXT.Queue()
    proc = PROCESS_CONTEXT.Process(target=_child, args=(path, started, took), daemon=True)
    proc.start()
    assert started.wait(120), "child did not start its take"
    return proc, took


def _check_complete(path: str) -> None:
    expected = state()
    out = StateDict(
        {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else v for k, v in expected.items()}
    )
    out["step"] = 0
    Snapshot(path).restore({"s": out})
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(out[key], value), key
    assert out["step"] == 1234


@pytest.mark.timeout(600)
def test_sigkill_at_any_moment_never_leaves_half_a_snapshot(tmp_path):
    sibling = str(tmp_path / "earlier")
    Snapshot.take(sibling, {"s": StateDict(t=torch.arange(1000), note="earlier")})

    # How long a whole take runs in a child, to spread the kills over it.
    proc, took = _start(str(tmp_path / "calibration"))
    duration = took.get(timeout=300)
    proc.join(60)
    assert proc.exitcode == 0, proc.exitcode
    _check_complete(str(tmp_path / "calibration"))

    rng = random.Random(20261122)
    outcomes = {"none": 0, "incomplete": 0, "complete": 0}
    for trial in range(TRIALS):
        path = str(tmp_path / f"trial{trial}")
        proc, _ = _start(path)
        time.sleep(rng.uniform(0.0, duration * 1.1))
        proc.kill()  # SIGKILL
        proc.join(60)
        try:
            Snapshot(path)
        except IncompleteSnapshotError:
            outcomes["incomplete"] += 1
        except SnapshotNotFoundError:
            outcomes["none"] += 1
        else:
            outcomes["complete"] += 1
            _check_complete(path)
            with pytest.raises(SnapshotExistsError):
                Snapshot.take(path, {"s": StateDict(x=1)})
            continue
        # Debris of a killed take: a new take at the path replaces it.
        Snapshot.take(path, {"s": StateDict(x=trial)})
        assert Snapshot(path).read_object("0/s/x") == trial
    assert sum(outcomes.values()) == TRIALS
    earlier = Snapshot(sibling)
    assert torch.equal(earlier.read_object("0/s/t"), torch.arange(1000))
    assert earlier.read_object("0/s/note") == "earlier"
    print(f"kill trials: {outcomes}, take {duration:.2f} s")
