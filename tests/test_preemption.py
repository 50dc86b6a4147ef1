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


# -- SIGTERM at random moments: the resumed run goes on as an uninterrupted one ---------------

# One interpreter imports torch once, then forks a process per run (41 interpreter starts
# would take minutes on a busy machine): "run MODE ROOT LOG" forks one and answers its pid,
# "wait PID" answers its exit status (-signum when a signal ended it). A run trains a tiny MLP
# with Adam on batches drawn from a generator seeded by the step, saves every SAVE_EVERY steps
# (async) and marks each step boundary; it logs each step's loss (float.hex, exact) to a
# line-buffered file, so a line is there once its step ended, and its stderr to LOG.err.
LAUNCHER = textwrap.dedent(
    """
    import os, sys, time, traceback, torch
    from snapshot import CheckpointManager
    STEPS, SAVE_EVERY = 300, 20
    # An optimizer's first construction imports torch._dynamo (seconds): once, here.
    torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])
    import threading
    assert threading.active_count() == 1  # forking copies no thread's half-done work

    def train(mode, root, log_path):
        torch.set_num_threads(1)
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
        )
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        app_state = {"model": model, "optimizer": optimizer}
        manager = CheckpointManager(root, keep_last=2)
        start = 0
        if mode == "resume":
            restored = manager.restore(app_state)
            start = 0 if restored is None else restored + 1
            with open(log_path + ".restored", "w") as f:
                f.write(str(restored))
        manager.handle_preemption()
        t = time.perf_counter()
        with open(log_path, "w", buffering=1) as log:  # its creation: training begins
            for step in range(start, STEPS):
                g = torch.Generator().manual_seed(step)
                x = torch.randn(32, 8, generator=g)
                y = torch.sin(x.sum(dim=1, keepdim=True))
                loss = torch.nn.functional.mse_loss(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                log.write(f"{step} {loss.item().hex()}\\n")
                if step % SAVE_EVERY == 0:
                    manager.save(step, app_state)
                manager.checkpoint_if_preempted(step, app_state)
        manager.close()
        with open(log_path + ".seconds", "w") as f:
            f.write(str(time.perf_counter() - t))

    for line in sys.stdin:
        command, *args = line.split()
        if command == "run":
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    err = os.open(args[2] + ".err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                    os.dup2(err, 2)
                    train(*args)
                    code = 0
                except SystemExit as e:
                    code = e.code
                except BaseException:
                    traceback.print_exc()
                finally:
                    sys.stderr.flush()
                    os._exit(code)
            print("pid", pid, flush=True)
        elif command == "wait":
            _, status = os.waitpid(int(args[0]), 0)
            print("status", os.waitstatus_to_exitcode(status), flush=True)
    """
)


class Launcher:
    """The forking interpreter above."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", LAUNCHER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=child_env(),
        )

    def ask(self, line: str) -> int:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline().split()
        assert len(answer) == 2, f"the launcher ended: {self.process.wait()}"
        return int(answer[1])

    def start(self, mode: str, root: str, log: Path) -> int:
        return self.ask(f"run {mode} {root} {log}")

    def wait(self, pid: int) -> int:
        return self.ask(f"wait {pid}")

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=60)


def losses(path: Path) -> dict[int, str]:
    out = {}
    for line in path.read_text().splitlines():
        step, loss = line.split()
        out[int(step)] = loss
    return out


@pytest.mark.slow  # 42 processes
def test_sigterm_at_random_moments_resumes_as_an_uninterrupted_run(tmp_path):
    launcher = Launcher()
    try:
        # Twice: the first run's caches are cold, its duration longer than the trials'.
        durations = []
        for run in range(2):
            baseline_log = tmp_path / f"baseline{run}.log"
            pid = launcher.start("fresh", str(tmp_path / f"baseline{run}"), baseline_log)
            assert launcher.wait(pid) == 0, Path(f"{baseline_log}.err").read_text()
            durations.append(float(Path(f"{baseline_log}.seconds").read_text()))
        baseline = losses(baseline_log)
        assert sorted(baseline) == list(range(300))
        assert losses(tmp_path / "baseline0.log") == baseline
        duration = min(durations)

        rng = random.Random(20260101)
        preempted = 0
        for trial in range(20):
            root = str(tmp_path / f"trial{trial}")
            first_log = tmp_path / f"trial{trial}-first.log"
            pid = launcher.start("fresh", root, first_log)
            while not first_log.exists():
                time.sleep(0.001)
            # Anywhere in the run, spread over the trials.
            time.sleep(duration * (trial + rng.random()) / 20)
            os.kill(pid, signal.SIGTERM)
            status = launcher.wait(pid)
            err = Path(f"{first_log}.err").read_text()
            assert status in (0, -signal.SIGTERM), err
            first = losses(first_log)

            resume_log = tmp_path / f"trial{trial}-resume.log"
            pid = launcher.start("resume", root, resume_log)
            assert launcher.wait(pid) == 0, Path(f"{resume_log}.err").read_text()
            text = Path(f"{resume_log}.restored").read_text()
            restored = -1 if text == "None" else int(text)
            second = losses(resume_log)

            # Every step up to the one restored ran in the first run; the rest in the second.
            assert [s for s in sorted(first) if s <= restored] == list(range(restored + 1))
            assert sorted(second) == list(range(restored + 1, 300))
            combined = {s: first[s] for s in range(restored + 1)} | second
            differ = [s for s in range(300) if combined[s] != baseline[s]]
            assert not differ, (
                f"trial {trial}: first run ended at step {max(first)}, restored {restored}; "
                f"losses differ from step {differ[0]}"
            )
            if "preempted:" in err:  # the handler saw the signal (not one after close())
                preempted += 1
                assert status == -signal.SIGTERM, err
                # The final save is the step the first run ended on: nothing lost or redone.
                assert restored == max(first), err
        assert preempted >= 12, preempted  # most signals landed in training, not after it
    finally:
        launcher.close()


# -- across ranks -----------------------------------------------------------------------------


def _signal_on_rank_one(rank: int, world_size: int, root: str) -> dict:
    received: list[int] = []
    # An earlier handler that returns: the final save ends in SystemExit, which this body sees.
    signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    state = {"w": StateDict(w=torch.zeros(10)), "progress": StateDict(step=0)}
    manager = CheckpointManager(root)
    manager.handle_preemption()
    step = 0
    try:
        for step in range(1, 10):
            state["w"]["w"].add_(1)
            state["progress"]["step"] = step
            if step % 2 == 0:
                manager.save(step, state)
            if step == 3 and rank == 1:
                os.kill(os.getpid(), signal.SIGTERM)  # the notice reaches one rank only
            manager.checkpoint_if_preempted(step, state)
    except SystemExit as e:
        return {"code": e.code, "step": step, "earlier handler": received}
    return {"finished": step}


@pytest.mark.slow  # two real ranks
def test_a_signal_on_one_rank_makes_every_rank_save_the_same_boundary(tmp_path):
    from tests.multirank import run_ranks

    root = str(tmp_path / "ckpt")
    results = run_ranks(2, _signal_on_rank_one, root)
    expected = {"code": 128 + signal.SIGTERM, "step": 3, "earlier handler": [signal.SIGTERM]}
    assert results == [expected, expected]
    with CheckpointManager(root) as manager:
        assert manager.steps() == [2, 3]
        target = {"w": StateDict(w=torch.zeros(10)), "progress": StateDict(step=-1)}
        assert manager.restore(target) == 3
    assert target["progress"]["step"] == 3 and torch.equal(target["w"]["w"], torch.full((10,), 3.0))


# -- the README's loop, as written ------------------------------------------------------------

README_PRELUDE = textwrap.dedent(
    """
    import os, signal, torch
    from snapshot import StateDict
    app_state = {"model": StateDict(a=torch.zeros(3), b=torch.zeros(3))}
    calls = 0

    def train_one_step():
        global calls
        app_state["model"]["a"].add_(1)
        if calls == 700:
            os.kill(os.getpid(), signal.SIGTERM)  # between two updates of step 700
        app_state["model"]["b"].add_(1)
        calls += 1
        return 1.0  # the loss
    """
)


def readme_manager_code() -> str:
    text = (Path(REPO) / "README.md").read_text()
    section = text[text.index("## Checkpoint manager") :]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.slow  # a child process
def test_the_readme_loop_saves_the_step_boundary_and_ends_by_the_signal(tmp_path):
    run = subprocess.run(
        [sys.executable, "-c", README_PRELUDE + readme_manager_code()],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(),
        cwd=tmp_path,
    )
    assert run.returncode == -signal.SIGTERM, run.stderr
    with CheckpointManager(str(tmp_path / "ckpt")) as manager:
        assert manager.steps() == [0, 500, 700]
        target = {"model": StateDict(a=torch.zeros(3), b=torch.zeros(3))}
        assert manager.restore(target) == 700
    assert torch.equal(target["model"]["a"], torch.full((3,), 701.0))  # steps 0..700, whole
    assert torch.equal(target["model"]["b"], torch.full((3,), 701.0))
