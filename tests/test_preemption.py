"""Preemption: a SIGTERM (the scheduler's notice) never makes the manager save a state that is
not a step boundary. The signal handler only records the signal; the final save happens at a
step boundary the training loop marks (``checkpoint_if_preempted``, or the next ``save`` with
the older ``handle_preemption(app_state, step_fn)``), and the process then ends by the signal.

Each case runs a real child process: the final save ends the process it runs in."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from snapshot import CheckpointManager, StateDict

REPO = str(Path(__file__).resolve().parents[1])


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    return env


def run_child(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(),
    )


# -- where the final save lands ---------------------------------------------------------------

# Two tensors updated one after the other each step: at the boundary after step s both hold s.
# At step 7 the notice arrives between the two updates (the handler runs on the main thread
# there, between two bytecodes). Saves every 5 steps.
BETWEEN_UPDATES = textwrap.dedent(
    """
    import os, signal, sys, torch
    from snapshot import CheckpointManager, StateDict
    root, mode = sys.argv[1], sys.argv[2]
    state = {"model": StateDict(a=torch.zeros(4), b=torch.zeros(4)), "progress": StateDict(step=0)}
    if mode == "python-handler":
        # An earlier handler that returns: the process must still end after the final save.
        signal.signal(signal.SIGTERM, lambda signum, frame: print("earlier handler", flush=True))
    manager = CheckpointManager(root)
    step = 0
    if mode == "legacy":
        manager.handle_preemption(state, lambda: step)
    else:
        manager.handle_preemption()
    for step in range(1, 30):
        for name in ("a", "b"):
            state["model"][name].add_(1)
            if step == 7 and name == "a":
                os.kill(os.getpid(), signal.SIGTERM)
        state["progress"]["step"] = step
        if step % 5 == 0:
            manager.save(step, state)
        if mode != "legacy":
            manager.checkpoint_if_preempted(step, state)
    manager.close()
    print("finished", flush=True)
    """
)


def restored(root: str) -> tuple[int | None, dict]:
    target = {
        "model": StateDict(a=torch.full((4,), -1.0), b=torch.full((4,), -1.0)),
        "progress": StateDict(step=-1),
    }
    with CheckpointManager(root) as manager:
        return manager.restore(target), target


@pytest.mark.slow  # a child process
@pytest.mark.parametrize(
    "mode, steps, returncode",
    [
        # The loop marks each boundary: the final save is step 7, whole.
        ("boundary", [5, 7], -signal.SIGTERM),
        # An earlier Python handler that returns is called, then the process exits 128+15.
        ("python-handler", [5, 7], 128 + signal.SIGTERM),
        # handle_preemption(app_state, step_fn) and no boundary call: the next save (step 10)
        # is the final one; before, the handler saved step 7 with b not yet updated.
        ("legacy", [5, 10], -signal.SIGTERM),
    ],
)
def test_a_signal_between_two_parameter_updates_saves_a_step_boundary(
    tmp_path, mode, steps, returncode
):
    root = str(tmp_path / "ckpt")
    run = run_child(BETWEEN_UPDATES, root, mode)
    assert run.returncode == returncode, run.stdout + run.stderr
    assert "finished" not in run.stdout
    assert ("earlier handler" in run.stdout) == (mode == "python-handler"), run.stdout
    step, target = restored(root)
    # The step restored holds both updates of that step, and nothing of the next.
    assert target["progress"]["step"] == step
    assert torch.equal(target["model"]["a"], torch.full((4,), float(step)))
    assert torch.equal(target["model"]["b"], torch.full((4,), float(step))), target["model"]
    with CheckpointManager(root) as manager:
        assert manager.steps() == steps


# The notice arrives while ``save`` captures the state (from a state_dict() it calls), and a
# second one right after: the save completes, step 10 is not saved twice, the process ends.
DURING_SAVE = textwrap.dedent(
    """
    import os, signal, sys, torch
    from snapshot import CheckpointManager, StateDict
    root = sys.argv[1]

    class Notifying(StateDict):
        def state_dict(self):
            if self["step"] == 10:
                os.kill(os.getpid(), signal.SIGTERM)
            return super().state_dict()

    state = {"model": StateDict(w=torch.zeros(1000)), "progress": Notifying(step=0)}
    manager = CheckpointManager(root, max_in_flight=2)
    manager.handle_preemption()
    for step in range(1, 30):
        state["model"]["w"].add_(1)
        state["progress"]["step"] = step
        if step % 5 == 0:
            manager.save(step, state)
        if step == 10:
            print("preempted after the save:", manager.preempted, flush=True)
            os.kill(os.getpid(), signal.SIGTERM)  # a second notice
        manager.checkpoint_if_preempted(step, state)
    print("finished", flush=True)
    """
)


@pytest.mark.slow  # a child process
def test_a_signal_during_a_save_lets_it_complete_and_saves_once(tmp_path):
    root = str(tmp_path / "ckpt")
    run = run_child(DURING_SAVE, root)
    assert run.returncode == -signal.SIGTERM, run.stdout + run.stderr
    assert "preempted after the save: True" in run.stdout
    assert "finished" not in run.stdout
    assert "step 10 is saved already" in run.stderr, run.stderr
    assert run.stderr.count("saving step") == 0, run.stderr
    with CheckpointManager(root) as manager:
        assert manager.steps() == [5, 10]
        target = {"model": StateDict(w=torch.zeros(1000)), "progress": StateDict(step=-1)}
        assert manager.restore(target) == 10
    assert target["progress"]["step"] == 10
    assert torch.equal(target["model"]["w"], torch.full((1000,), 10.0))


def test_no_signal_no_save(tmp_path):
    """Without a signal the boundary call returns at once and saves nothing."""
    state = {"model": StateDict(w=torch.zeros(4))}
    with CheckpointManager(str(tmp_path / "ckpt")) as manager:
        manager.handle_preemption()
        for step in range(3):
            manager.checkpoint_if_preempted(step, state)
        assert not manager.preempted
        assert manager.steps() == []
