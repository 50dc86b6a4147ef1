"""Two takes at one path at the same moment: exactly one commits, the other fails with a clear
SnapshotExistsError, and the committed snapshot is the winner's, whole (each take writes blobs
of its own names; the manifest is created only where none exists)."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
import torch

from snapshot import Snapshot, SnapshotError, SnapshotExistsError, StateDict
from snapshot._engine.take.commit import MANIFEST_NAME
from storage_plugins import register_storage_plugin, unregister_storage_plugin
from storage_plugins.fs import FSStoragePlugin
from tests.multirank import PROCESS_CONTEXT
from tests.s3server import S3Bucket

TRIALS = 20
_CTX = PROCESS_CONTEXT  # torch already imported in the fork server


def state_of(writer: int, trial: int) -> dict[str, Any]:
    # 8 MiB each, different in every byte between the two writers and between trials.
    g = torch.Generator().manual_seed(1000 * trial + writer)
    return {
        "m": StateDict(
            big=torch.randn(1024, 1024, generator=g),
            small=torch.full((100,), float(writer)),
            writer=writer,
            trial=trial,
        )
    }


def _writer(
    writer: int, urls: list[str], storage_options: dict | None, barrier: Any, out: Any
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for trial, url in enumerate(urls):
        state = state_of(writer, trial)
        barrier.wait(60)
        try:
            Snapshot.take(url, state, storage_options=storage_options)
            out.put((trial, writer, "ok", ""))
        except SnapshotError as e:
            out.put((trial, writer, type(e).__name__, str(e)))
        except BaseException as e:  # reported to the test, not swallowed
            out.put((trial, writer, "crash", repr(e)))


def race(urls: list[str], storage_options: dict | None) -> dict[int, dict[int, tuple[str, str]]]:
    """Two processes take a snapshot at each of ``urls`` in turn, both at once."""
    barrier = _CTX.Barrier(2)
    out = _CTX.Queue()
    procs = [
        _CTX.Process(target=_writer, args=(w, urls, storage_options, barrier, out), daemon=True)
        for w in range(2)
    ]
    for p in procs:
        p.start()
    results: dict[int, dict[int, tuple[str, str]]] = {}
    for _ in range(2 * len(urls)):
        trial, writer, outcome, message = out.get(timeout=240)
        results.setdefault(trial, {})[writer] = (outcome, message)
    for p in procs:
        p.join(60)
    return results


def check(results, urls: list[str], storage_options: dict | None) -> int:
    """Checks every trial; returns how many the manifest decided (both takes wrote, the
    second manifest was refused), rather than the check at the start of the later take."""
    at_commit = 0
    for trial, url in enumerate(urls):
        outcomes = results[trial]
        won = [w for w, (o, _) in outcomes.items() if o == "ok"]
        lost = [w for w, (o, _) in outcomes.items() if o != "ok"]
        assert len(won) == 1 and len(lost) == 1, (trial, outcomes)
        outcome, message = outcomes[lost[0]]
        assert outcome == "SnapshotExistsError", (trial, outcomes)
        assert "another take" in message or "already holds a snapshot" in message, message
        at_commit += "another take" in message
        # The snapshot at the path is the winner's, every byte of it.
        want = state_of(won[0], trial)
        got = Snapshot(url, storage_options=storage_options).read_object("0/m")
        assert got["writer"] == won[0] and got["trial"] == trial
        assert torch.equal(got["big"], want["m"]["big"])
        assert torch.equal(got["small"], want["m"]["small"])
    return at_commit


@pytest.mark.slow  # two processes, 20 trials
def test_two_processes_racing_on_local_disk(tmp_path):
    urls = [str(tmp_path / f"snap{i}") for i in range(TRIALS)]
    results = race(urls, None)
    assert check(results, urls, None) >= 1  # some races were decided by the manifest
    # Nothing of a loser is left: the folder holds the manifest and the winner's blobs.
    for url in urls:
        listed = {os.path.relpath(os.path.join(r, f), url) for r, _, fs in os.walk(url) for f in fs}
        blobs = {loc.blob for e in Snapshot(url).get_manifest().values() for loc in e.locations}
        assert listed == blobs | {MANIFEST_NAME}, url


@pytest.mark.slow  # two processes, 20 trials
def test_two_processes_racing_on_s3(s3_bucket: S3Bucket):
    opts = s3_bucket.storage_options
    urls = [s3_bucket.url(f"snap{i}") for i in range(TRIALS)]
    results = race(urls, opts)
    assert check(results, urls, opts) >= 1


def test_two_async_takes_pending_at_one_path_in_one_process(tmp_path):
    url = str(tmp_path / "snap")
    outcomes: dict[int, str] = {}
    pending = {}
    for w in range(2):  # the path is checked when a take starts: the first may have committed
        try:
            pending[w] = Snapshot.async_take(url, state_of(w, 0))
        except SnapshotExistsError as e:
            assert "already holds a snapshot" in str(e), e
            outcomes[w] = "exists"
    for w, p in pending.items():  # then the first to commit wins, whichever started first
        try:
            assert p.wait().read_object("0/m/writer") == w
            outcomes[w] = "ok"
        except SnapshotExistsError as e:
            assert "another take" in str(e) or "already holds a snapshot" in str(e), e
            outcomes[w] = "exists"
    assert sorted(outcomes.values()) == ["exists", "ok"], outcomes
    winner = next(w for w, o in outcomes.items() if o == "ok")
    assert torch.equal(Snapshot(url).read_object("0/m/big"), state_of(winner, 0)["m"]["big"])


def test_threads_racing_in_one_process(tmp_path):
    url = str(tmp_path / "snap")
    outcomes: dict[int, str] = {}

    def take(w: int) -> None:
        try:
            Snapshot.take(url, state_of(w, 0))
            outcomes[w] = "ok"
        except SnapshotExistsError:
            outcomes[w] = "exists"

    threads = [threading.Thread(target=take, args=(w,)) for w in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes.values()) == ["exists", "ok"]
    winner = next(w for w, o in outcomes.items() if o == "ok")
    assert Snapshot(url).read_object("0/m/writer") == winner


class LostAnswer(FSStoragePlugin):
    """Local storage whose first exclusive write lands but raises as if the answer was lost:
    the retry then finds the manifest it wrote itself."""

    calls = 0

    def __init__(self, root: str, storage_options=None) -> None:
        super().__init__(root.split("://", 1)[1], storage_options)

    async def write_if_absent(self, path, buffers):
        LostAnswer.calls += 1
        await super().write_if_absent(path, buffers)
        if LostAnswer.calls == 1:
            raise ConnectionResetError("connection reset by peer")


def test_a_manifest_write_whose_answer_was_lost_is_not_taken_for_a_rival(tmp_path):
    register_storage_plugin("lostanswer", LostAnswer)
    try:
        url = f"lostanswer://{tmp_path}/snap"
        Snapshot.take(url, state_of(0, 0))
        assert LostAnswer.calls == 2  # the retry met the manifest: ours, so committed
        assert Snapshot(str(tmp_path / "snap")).read_object("0/m/writer") == 0
    finally:
        unregister_storage_plugin("lostanswer")


@pytest.mark.asyncio
async def test_write_if_absent_on_every_store(tmp_path, s3_bucket: S3Bucket):
    from storage_plugins.fsspec_plugin import FSSpecStoragePlugin
    from storage_plugins.memory import MemoryStoragePlugin
    from storage_plugins.s3 import S3StoragePlugin

    plugins = [
        FSStoragePlugin(str(tmp_path / "fs")),
        MemoryStoragePlugin(f"memory://{os.getpid()}-excl"),
        FSSpecStoragePlugin(f"file://{tmp_path}/fsspec"),
        S3StoragePlugin(s3_bucket.url("excl"), s3_bucket.storage_options),
    ]
    for p in plugins:
        try:
            await p.write_if_absent("m", [b"first"])
            with pytest.raises(FileExistsError):
                await p.write_if_absent("m", [b"second"])
            assert await p.read("m") == b"first", type(p).__name__
        finally:
            await p.close()
