"""CheckpointManager: step folders, resume, retention, background deletion, incremental saves,
on local disk, memory:// and S3; preemption; the ``statesnap steps`` / ``prune`` commands.
Across ranks: test_manager_dist.py."""

from __future__ import annotations

import asyncio
import errno
import os
import subprocess
import sys
import textwrap
import threading
import uuid

import pytest
import torch

from snapshot import CheckpointManager, InvalidArgumentError, Snapshot, SnapshotError, StateDict
from snapshot._engine.take.commit import MANIFEST_NAME, PENDING_NAME
from storage_plugins import register_storage_plugin, unregister_storage_plugin
from storage_plugins.fs import FSStoragePlugin
from tests.s3server import S3Bucket


def make_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": StateDict(
            w=torch.randn(64, 64, generator=g), frozen=torch.randn(256, 256, generator=g)
        ),
        "progress": StateDict(step=0),
    }


def train(state: dict, step: int) -> None:
    state["model"]["w"].add_(1)
    state["progress"]["step"] = step


def blank(state: dict) -> dict:
    return {
        "model": StateDict(**{k: torch.zeros_like(v) for k, v in state["model"].items()}),
        "progress": StateDict(step=-1),
    }


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]) and (
        a["progress"]["step"] == b["progress"]["step"]
    )


@pytest.fixture(params=["fs", "memory"])
def root(request, tmp_path) -> str:
    if request.param == "fs":
        return str(tmp_path / "ckpt")
    return f"memory://{uuid.uuid4().hex}/ckpt"


def folders(root: str) -> list[str]:
    if root.startswith("memory://"):
        from storage_plugins.memory import _STORE

        prefix = root.removeprefix("memory://") + "/"
        return sorted({k[len(prefix) :].split("/")[0] for k in _STORE if k.startswith(prefix)})
    return sorted(os.listdir(root)) if os.path.isdir(root) else []


# -- resume and the basics ----------------------------------------------------------------------


@pytest.mark.parametrize("async_", [True, False])
def test_resume_or_start_fresh(root, async_):
    state = make_state()
    with CheckpointManager(root, async_=async_) as manager:
        assert manager.restore(blank(state)) is None  # nothing yet: start fresh
        assert manager.latest_step() is None and manager.steps() == []
        for step in (10, 20, 30):
            train(state, step)
            manager.save(step, state, metrics={"loss": 1 / step})
        manager.wait()
        assert manager.steps() == [10, 20, 30]
    # A new process would do this: the latest committed step, bitwise.
    with CheckpointManager(root) as again:
        target = blank(state)
        assert again.restore(target) == 30
        assert same(target, state)
        older = blank(state)
        assert again.restore(older, step=20) == 20 and older["progress"]["step"] == 20
        with pytest.raises(InvalidArgumentError, match="not committed"):
            again.restore(blank(state), step=25)
        # Steps go on from the latest one: an earlier step is refused.
        with pytest.raises(InvalidArgumentError, match="not after"):
            again.save(30, state)
    assert Snapshot(f"{root}/step_0000000030").metadata.user == {
        "step": 30,
        "metrics": {"loss": 1 / 30},
    }


def test_saves_staged_in_the_background_hold_the_state_of_the_call(tmp_path):
    # The optimizer's step right after save waits for the copy (the take's hook); a tensor no
    # hook guards changes after wait_staged. Each step holds the state it was saved with.
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    extra = StateDict(t=torch.zeros(1000))
    state = {"model": model, "optim": optim, "extra": extra}
    saved = {}
    with CheckpointManager(str(tmp_path), stage_in_background=True) as manager:
        for step in (1, 2, 3):
            model(torch.randn(8, 256)).square().sum().backward()
            optim.step()
            saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
            manager.save(step, state)
            optim.step()  # at once: held until the save's copies are made
            manager.wait_staged(timeout=60)
            extra["t"].add_(1.0)
        manager.wait()
    for step, want in saved.items():
        target = torch.nn.Linear(256, 256)
        Snapshot(str(tmp_path / f"step_{step:010d}")).restore({"model": target})
        for k, v in want.items():
            assert torch.equal(target.state_dict()[k], v), (step, k)
        got = StateDict(t=torch.empty(1000))
        Snapshot(str(tmp_path / f"step_{step:010d}")).restore({"extra": got})
        assert torch.equal(got["t"], torch.full((1000,), step - 1.0))
    with pytest.raises(InvalidArgumentError, match="only with async_=True"):
        CheckpointManager(str(tmp_path), async_=False, stage_in_background=True)


def test_bad_arguments(tmp_path):
    for kwargs in ({"keep_best": 2}, {"mode": "lowest"}, {"keep_last": 0}, {"max_in_flight": 0}):
        with pytest.raises(InvalidArgumentError):
            CheckpointManager(str(tmp_path), **kwargs)
    with CheckpointManager(str(tmp_path)) as manager:
        for metrics in ({"loss": float("nan")}, {"loss": "low"}, {1: 2.0}):
            with pytest.raises(InvalidArgumentError, match="metrics"):
                manager.save(1, make_state(), metrics=metrics)
        with pytest.raises(InvalidArgumentError, match="step"):
            manager.save(-1, make_state())
    with pytest.raises(SnapshotError, match="closed"):
        manager.save(2, make_state())


# -- retention ------------------------------------------------------------------------------------


def test_retention_policies_and_their_union(root):
    state = make_state()
    losses = {1: 0.05, 2: 0.9, 3: 0.8, 4: 0.7, 5: 0.6, 6: 0.95, 7: 0.99}
    with CheckpointManager(
        root, keep_last=2, keep_every_steps=3, keep_best=1, metric="loss"
    ) as manager:
        for step in range(1, 8):
            train(state, step)
            manager.save(step, state, metrics={"loss": losses[step]})
        manager.wait()
        # last two (6, 7), multiples of 3 (3, 6), best loss (1)
        assert manager.steps() == [1, 3, 6, 7]
    assert folders(root) == [f"step_{n:010d}" for n in (1, 3, 6, 7)]


def test_incomplete_folders_are_cleaned_and_damaged_ones_kept(tmp_path, caplog):
    root = str(tmp_path / "ckpt")
    state = make_state()
    with CheckpointManager(root, async_=False) as manager:
        manager.save(1, state)
        manager.save(2, state)
    # A crash mid-take (the pending marker and blobs, no manifest), and a manifest cut short.
    os.makedirs(f"{root}/step_0000000003/0")
    for name in ("0/0", PENDING_NAME):
        with open(f"{root}/step_0000000003/{name}", "wb") as f:
            f.write(b"partial")
    with open(f"{root}/step_0000000002/{MANIFEST_NAME}", "r+b") as f:
        f.truncate(20)
    with CheckpointManager(root) as manager:
        assert manager.steps() == [1]  # 2 is damaged, 3 incomplete: neither is "latest"
        target = blank(state)
        assert manager.restore(target) == 1
        with caplog.at_level("WARNING", logger="snapshot"):
            manager.save(4, state)
            manager.wait()
        assert manager.steps() == [1, 4]
    # The damaged step is kept (it may be repaired, or read by a tool that can), with a warning.
    assert folders(root) == ["step_0000000001", "step_0000000002", "step_0000000004"]
    assert "never finished" in caplog.text and "step_0000000002" in caplog.text


class Local(FSStoragePlugin):
    """The local plugin under a URL scheme of a test's own (``scheme:///abs/path``)."""

    def __init__(self, root: str, storage_options=None) -> None:
        super().__init__(root.split("://", 1)[1], storage_options)


class SlowDeletes(Local):
    """Local storage whose whole-folder deletes wait until the test lets them go (an object
    store's slow deletes of many keys)."""

    started = threading.Event()
    release = threading.Event()

    async def delete_all(self) -> None:
        SlowDeletes.started.set()
        await asyncio.to_thread(SlowDeletes.release.wait, 60)
        await super().delete_all()


def test_slow_deletes_never_delay_a_save(tmp_path):
    register_storage_plugin("slowdel", SlowDeletes)
    SlowDeletes.started.clear()
    SlowDeletes.release.clear()
    try:
        root = f"slowdel://{tmp_path}/ckpt"
        state = make_state()
        with CheckpointManager(root, keep_last=1, async_=False) as manager:
            manager.save(1, state)
            manager.save(2, state)  # step 1 starts being deleted in the background
            assert SlowDeletes.started.wait(30)
            manager.save(3, state)  # while that delete is held: the save does not wait
            manager.save(4, state, metrics={"loss": 1.0})
            assert not SlowDeletes.release.is_set()
            assert folders(f"{tmp_path}/ckpt")[-2:] == ["step_0000000003", "step_0000000004"]
            SlowDeletes.release.set()
        assert folders(f"{tmp_path}/ckpt") == ["step_0000000004"]
    finally:
        SlowDeletes.release.set()
        unregister_storage_plugin("slowdel")


class FullDisk(Local):
    """Local storage that runs out of space for blobs under step 2."""

    async def write(self, path, buffers):
        if "step_0000000002" in self.root and path != ".statesnap-pending":
            raise OSError(errno.ENOSPC, "No space left on device")
        await super().write(path, buffers)


def test_a_background_failure_is_raised_by_the_next_call_when_asked(tmp_path):
    register_storage_plugin("fulldisk", FullDisk)
    try:
        root = f"fulldisk://{tmp_path}/ckpt"
        state = make_state()
        manager = CheckpointManager(root, raise_on_next_save=True)
        manager.save(1, state)
        manager.save(2, state)  # fails while writing, after save returned
        with pytest.raises(SnapshotError, match="No space left"):
            manager.save(3, state)
        manager.save(3, state)  # the error was raised once; the manager goes on
        manager.close()
        assert CheckpointManager(root).steps() == [1, 3]
    finally:
        unregister_storage_plugin("fulldisk")


def test_saves_in_flight_are_never_deleted(tmp_path):
    root = str(tmp_path / "ckpt")
    state = make_state()
    with CheckpointManager(root, keep_last=1, max_in_flight=3) as manager:
        for step in range(1, 7):
            train(state, step)
            manager.save(step, state)
        manager.wait()
        assert manager.steps() == [6]
        target = blank(state)
        assert manager.restore(target) == 6 and same(target, state)


# -- incremental ----------------------------------------------------------------------------------


def test_incremental_chain_with_retention(root):
    state = make_state()
    wants = {}
    with CheckpointManager(root, keep_last=2, incremental=True) as manager:
        for step in range(1, 7):
            train(state, step)  # "w" changes, "frozen" never does
            manager.save(step, state)
            wants[step] = {k: v.clone() for k, v in state["model"].items()}
        manager.wait()
        # Step 1 holds the frozen tensor every later step points at: it stays.
        assert manager.steps() == [1, 5, 6]
        assert Snapshot(f"{root}/step_0000000006").metadata.bases == ("step_0000000001",)
        for step in (5, 6):
            target = blank(state)
            assert manager.restore(target, step=step) == step
            assert all(torch.equal(target["model"][k], wants[step][k]) for k in wants[step])


@pytest.mark.slow
def test_s3(s3_bucket: S3Bucket):
    opts = s3_bucket.storage_options
    root = s3_bucket.url("run")
    state = make_state()
    with CheckpointManager(root, keep_last=2, storage_options=opts, incremental=True) as manager:
        assert manager.restore(blank(state)) is None
        for step in range(1, 5):
            train(state, step)
            manager.save(step, state, metrics={"loss": float(step)})
        manager.wait()
        assert manager.steps() == [1, 3, 4]  # 1 is the base of the frozen tensor
    with CheckpointManager(root, storage_options=opts) as again:
        target = blank(state)
        assert again.restore(target) == 4 and same(target, state)


# -- preemption -----------------------------------------------------------------------------------

PREEMPTED = textwrap.dedent(
    """
    import os, signal, sys, torch
    from snapshot import CheckpointManager, StateDict
    root, mode = sys.argv[1], sys.argv[2]
    state = {"model": StateDict(w=torch.zeros(10)), "progress": StateDict(step=0)}
    manager = CheckpointManager(root)
    step = 0
    if mode == "handler":
        manager.handle_preemption(state, lambda: step)
    else:
        manager.handle_preemption()
    for step in range(1, 1000):
        state["model"]["w"].add_(1)
        state["progress"]["step"] = step
        if step % 10 == 0:
            manager.save(step, state)
        if step == 25:
            os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's notice
        if manager.preempted:
            manager.save(step, state)
            manager.close()
            sys.exit(3)
    """
)


@pytest.mark.slow  # real processes
@pytest.mark.parametrize("mode", ["handler", "cooperative"])
def test_preemption_saves_a_final_step(tmp_path, mode):
    root = str(tmp_path / "ckpt")
    run = subprocess.run(
        [sys.executable, "-c", PREEMPTED, root, mode], capture_output=True, text=True, timeout=120
    )
    if mode == "handler":
        # The handler saved step 25, then the signal ended the process as it would have.
        assert run.returncode == -15, run.stderr
    else:
        assert run.returncode == 3, run.stderr
    with CheckpointManager(root) as manager:
        assert manager.steps() == [10, 20, 25]
        target = {"model": StateDict(w=torch.zeros(10)), "progress": StateDict(step=-1)}
        assert manager.restore(target) == 25
        assert target["progress"]["step"] == 25 and torch.equal(
            target["model"]["w"], torch.full((10,), 25.0)
        )


# -- the command line -----------------------------------------------------------------------------


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "snapshot", *args], capture_output=True, text=True)


@pytest.mark.slow  # real processes
def test_steps_and_prune_commands(tmp_path):
    root = str(tmp_path / "ckpt")
    state = make_state()
    with CheckpointManager(root, incremental=True) as manager:
        for step in range(1, 6):
            train(state, step)
            manager.save(step, state, metrics={"loss": 1.0 / step})
    os.makedirs(f"{root}/step_0000000009")
    with open(f"{root}/step_0000000009/{PENDING_NAME}", "w") as f:
        f.write("a take that never finished")
    out = cli("steps", root)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:5] == ["STEP", "STATE", "SIZE", "METRICS", "BASES"]
    assert any(ln.split()[:2] == ["9", "incomplete"] for ln in lines)
    row5 = next(ln for ln in lines if ln.split()[:2] == ["5", "committed"])
    assert '"loss": 0.2' in row5 and "step_0000000001" in row5
    assert "5 committed, 1 incomplete, unreadable or left alone; latest: 5" in lines[-1]

    dry = cli("prune", root, "--keep-last", "1", "--dry-run")
    assert dry.returncode == 0 and "would delete" in dry.stdout
    assert len(folders(root)) == 6
    done = cli("prune", root, "--keep-last", "1", "--incomplete")
    assert done.returncode == 0, done.stderr
    # 5 is kept, and 1 with it: 5 needs its frozen tensor.
    assert folders(root) == ["step_0000000001", "step_0000000005"]
    refused = cli("prune", root)  # no policy given: an error, nothing deleted
    assert refused.returncode == 2 and "give at least one" in refused.stderr
    assert folders(root) == ["step_0000000001", "step_0000000005"]
