"""The checkpoint manager's memory tier in one process: where it keeps steps, what it restores
from, retention and budget, stale tiers, and the pairing of replicas (across ranks:
tests/test_tier_ranks.py)."""

from __future__ import annotations

import json
import logging
import os
import signal

import pytest
import torch

from snapshot import CheckpointManager, InvalidArgumentError, MemoryTier, StateDict
from snapshot._engine.manager.tier import job_id, pack, peers_of, unpack
from snapshot.errors import SnapshotError
from storage_plugins.fs import FSStoragePlugin


def _state(value: float) -> dict:
    return {"model": StateDict(w=torch.full((64,), value)), "progress": StateDict(step=0)}


def _job(shm, root) -> str:
    return os.path.join(shm, job_id(str(root)))


def test_pairing_puts_replicas_on_other_hosts():
    assert peers_of(["a", "a", "b", "b"], 1) == [[2], [3], [0], [1]]
    assert peers_of(["a", "b", "c"], 2) == [[1, 2], [2, 0], [0, 1]]
    assert peers_of(["a", "a"], 1) == [[], []]  # one host: no replica elsewhere
    assert peers_of(["b", "a", "a"], 1) == [[1], [0], [0]]
    assert peers_of(["a", "b"], 0) == [[], []]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"durable_every": 0},
        {"replicas": -1},
        {"keep": 0},
        {"budget_bytes": 0},
        {"dir": ""},
        {"host": ""},
        {"keep": 1.5},
    ],
)
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(InvalidArgumentError, match="MemoryTier"):
        MemoryTier(**kwargs)
    with pytest.raises(InvalidArgumentError, match="memory_tier"):
        CheckpointManager("x", memory_tier={"dir": "/dev/shm"})  # type: ignore[arg-type]


def test_saves_go_to_memory_and_every_nth_to_the_root(tmp_path, caplog):
    root, shm = tmp_path / "root", tmp_path / "shm"
    tier = MemoryTier(dir=str(shm), durable_every=3, keep=2)
    state = _state(0.0)
    with CheckpointManager(str(root), memory_tier=tier) as manager:
        for step in range(1, 8):
            state["model"]["w"].fill_(step)
            state["progress"]["step"] = step
            manager.save(step, state)
        manager.wait()
        assert manager.steps() == [3, 6]  # the durable root: every third save
    job = _job(shm, root)
    # The newest two steps in memory, each rank's part a snapshot of its own.
    assert sorted(n for n in os.listdir(job) if n.startswith("step_")) == [
        "step_0000000006",
        "step_0000000007",
    ]
    assert os.path.isfile(os.path.join(job, "step_0000000007", "0", "manifest.yaml"))
    with open(os.path.join(job, "job.json")) as f:
        assert json.load(f) == {"root": str(root), "world_size": 1}
    # A restart restores step 7 from memory, newer than the root's newest.
    target = _state(-1.0)
    caplog.set_level(logging.INFO, logger="snapshot")
    with CheckpointManager(str(root), memory_tier=tier) as manager:
        assert manager.restore(target) == 7
    assert torch.equal(target["model"]["w"], torch.full((64,), 7.0))
    assert "rank 0: step 7 restored from its node's memory" in caplog.messages


def _damage_step_1(shm, root) -> None:
    """Flips a byte of rank 0's part of step 1 in the node's tier."""
    part = os.path.join(_job(shm, root), "step_0000000001", "0", "0")
    (blob,) = os.listdir(part)
    with open(os.path.join(part, blob), "r+b") as f:
        f.seek(8)
        f.write(b"\xff")


def test_damaged_memory_falls_back_to_the_root(tmp_path, caplog):
    root, shm = tmp_path / "root", tmp_path / "shm"
    tier = MemoryTier(dir=str(shm), durable_every=1)
    with CheckpointManager(str(root), memory_tier=tier) as manager:
        manager.save(1, _state(1.0))
    _damage_step_1(shm, root)
    caplog.set_level(logging.INFO, logger="snapshot")
    target = _state(-1.0)
    with CheckpointManager(str(root), memory_tier=tier) as manager:
        assert manager.restore(target) == 1
    assert torch.equal(target["model"]["w"], torch.full((64,), 1.0))
    text = "\n".join(caplog.messages)
    assert "from its node's memory failed its check" in text and "checksum mismatch" in text
    assert "restoring it from durable storage" in text


def test_a_damaged_step_only_in_memory_gives_the_roots_newest(tmp_path):
    root, shm = tmp_path / "root", tmp_path / "shm"
    tier = MemoryTier(dir=str(shm), durable_every=2, keep=1)
    with CheckpointManager(str(root), memory_tier=tier) as manager:
        for step in (1, 2, 3):
            manager.save(step, _state(float(step)))
    part = os.path.join(_job(shm, root), "step_0000000003", "0")
    os.remove(os.path.join(part, "manifest.yaml"))  # step 3 incomplete in memory
    target = _state(-1.0)
    with CheckpointManager(str(root), memory_tier=tier) as manager:
        assert manager.restore(target) == 2
        # Memory steps after the one restored belong to the run abandoned: gone.
        assert not os.path.exists(os.path.dirname(part))
        manager.save(3, _state(3.0))  # the run goes on from step 2
    assert torch.equal(target["model"]["w"], torch.full((64,), 2.0))


def test_another_jobs_or_another_world_sizes_tier_is_not_read(tmp_path):
    shm = tmp_path / "shm"
    tier = MemoryTier(dir=str(shm))
    with CheckpointManager(str(tmp_path / "one"), memory_tier=tier) as manager:
        manager.save(5, _state(5.0))
    # Another root: another folder of the tier, never read.
    with CheckpointManager(str(tmp_path / "two"), memory_tier=tier) as manager:
        assert manager.restore(_state(0.0)) is None
    # The same root's tier written at another world size: deleted, not read.
    job = _job(shm, tmp_path / "one")
    with open(os.path.join(job, "job.json"), "w") as f:
        json.dump({"root": str(tmp_path / "one"), "world_size": 4}, f)
    import shutil

    shutil.rmtree(tmp_path / "one")  # and the root's own copy gone
    with CheckpointManager(str(tmp_path / "one"), memory_tier=tier) as manager:
        assert manager.restore(_state(0.0)) is None
    assert not any(n.startswith("step_") for n in os.listdir(job))


def test_budget_drops_the_oldest_never_the_newest_complete(tmp_path, caplog):
    root, shm = tmp_path / "root", tmp_path / "shm"
    tier = MemoryTier(dir=str(shm), durable_every=100, keep=3, budget_bytes=1)
    caplog.set_level(logging.WARNING, logger="snapshot")
    with CheckpointManager(str(root), memory_tier=tier) as manager:
        for step in (1, 2, 3):
            manager.save(step, _state(float(step)))
    job = _job(shm, root)
    assert sorted(n for n in os.listdir(job) if n.startswith("step_")) == ["step_0000000003"]
    assert any("over its budget" in m and "dropped" in m for m in caplog.messages)
    assert any("as the only one the tier can restore" in m for m in caplog.messages)
    target = _state(-1.0)
    with CheckpointManager(str(root), memory_tier=tier) as manager:
        assert manager.restore(target) == 3


def test_a_part_sent_by_a_peer_stays_in_its_folder(tmp_path):
    part = tmp_path / "part"
    (part / "0").mkdir(parents=True)
    (part / "0" / "blob").write_bytes(b"x" * 10)
    (part / "manifest.yaml").write_text("m")
    data = pack(str(part))
    unpack(data, str(tmp_path / "copy"))
    assert (tmp_path / "copy" / "0" / "blob").read_bytes() == b"x" * 10
    assert (tmp_path / "copy" / "manifest.yaml").read_text() == "m"
    evil = data.replace(b'"0/blob"', b'"../abc"')  # the same length
    with pytest.raises(SnapshotError, match="outside its folder"):
        unpack(evil, str(tmp_path / "copy"))


def test_a_damaged_part_with_no_durable_step_is_an_error(tmp_path):
    root, shm = tmp_path / "root", tmp_path / "shm"
    tier = MemoryTier(dir=str(shm), durable_every=100)
    with CheckpointManager(str(root), memory_tier=tier) as manager:
        manager.save(1, _state(1.0))
    _damage_step_1(shm, root)
    with (
        CheckpointManager(str(root), memory_tier=tier) as manager,
        pytest.raises(SnapshotError, match="cannot be restored.*no step to fall back on"),
    ):
        manager.restore(_state(-1.0))


def test_a_preempted_job_saves_its_newest_memory_step_to_the_root(tmp_path):
    """The newest save went to memory only: the final save puts it in the root."""
    root, shm = tmp_path / "root", tmp_path / "shm"

    class Ended(Exception):
        pass

    def ending(signum, frame):  # the handler the manager's replaces, called again at the end
        raise Ended

    previous = signal.signal(signal.SIGUSR1, ending)
    try:
        manager = CheckpointManager(
            str(root), memory_tier=MemoryTier(dir=str(shm), durable_every=10)
        )
        manager.handle_preemption(signals=(signal.SIGUSR1,))
        state = _state(0.0)
        for step in (1, 2, 3):
            state["model"]["w"].fill_(step)
            manager.save(step, state)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert manager.preempted
        with pytest.raises(Ended):
            manager.checkpoint_if_preempted(3, state)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    with CheckpointManager(str(root)) as again:
        assert again.steps() == [3]
        target = _state(-1.0)
        assert again.restore(target) == 3
    assert torch.equal(target["model"]["w"], torch.full((64,), 3.0))


class _Sharded:
    """A Stateful holding rank 1's half (rows 4-7) of a global 8x4 tensor as our ShardedTensor,
    or another half (``offset``); records what its load_state_dict was given."""

    def __init__(self, value: float, offset: int = 1) -> None:
        from snapshot.sharding import ShardedTensor

        self.data = torch.full((4, 4), value)
        self.piece = ShardedTensor.from_rank_offsets("w", self.data, (0, offset, 2))
        self.loaded: dict | None = None

    def state_dict(self) -> dict:
        return {"w": self.piece, "n": 3}

    def load_state_dict(self, state: dict) -> None:
        self.loaded = state


def test_a_sharded_value_is_kept_as_its_local_piece(tmp_path, caplog):
    """A part taken alone holds the local piece of our ShardedTensor (which a plain take alone
    refuses: it does not cover the global tensor) and restores it in place into a target of
    the same layout; a target holding another block is not restored from memory."""
    root, shm = str(tmp_path / "root"), str(tmp_path / "shm")
    tier = MemoryTier(dir=shm, durable_every=2)
    with CheckpointManager(root, memory_tier=tier) as manager:
        manager.save(1, {"s": _Sharded(2.0)})
    target = _Sharded(0.0)
    with CheckpointManager(root, memory_tier=tier) as manager:
        assert manager.restore({"s": target}) == 1
    assert torch.equal(target.data, torch.full((4, 4), 2.0))  # in place, into the piece's data
    assert target.loaded is not None and target.loaded["n"] == 3
    assert target.loaded["w"] is target.data  # ours gives back its data, as a plain restore
    other = _Sharded(0.0, offset=0)
    with (
        CheckpointManager(root, memory_tier=tier) as manager,
        caplog.at_level(logging.WARNING),
        pytest.raises(SnapshotError, match="holds no step to fall back on"),
    ):
        manager.restore({"s": other})
    assert "taken with another layout" in caplog.text and "'offset': [4, 0]" in caplog.text
    assert torch.equal(other.data, torch.zeros(4, 4)) and other.loaded is None


class _Factory:
    """A Stateful whose 4x4 tensor is saved through a ShardedTensorFactory as two blocks of
    rank 1's half of global 8x4 tensors; records what its load_state_dict was given."""

    def __init__(self, value: float) -> None:
        self.data = torch.full((4, 4), value)
        self.loaded: dict | None = None

    def state_dict(self) -> dict:
        from snapshot.sharding import ShardedTensor, ShardedTensorFactory

        def build(key, data, replica_id, flattened_range):
            return {
                "top": ShardedTensor.from_rank_offsets(f"{key}.top", data[:2], (0, 1, 2)),
                "bottom": ShardedTensor.from_rank_offsets(f"{key}.bottom", data[2:], (0, 1, 2)),
            }

        def merge(loaded):
            return torch.cat([loaded["top"], loaded["bottom"]])

        return {"f": ShardedTensorFactory("f", self.data, build, merge)}

    def load_state_dict(self, state: dict) -> None:
        self.loaded = state


def test_a_factory_is_built_and_merged_back_in_a_part(tmp_path):
    root, shm = str(tmp_path / "root"), str(tmp_path / "shm")
    tier = MemoryTier(dir=shm, durable_every=2)
    with CheckpointManager(root, memory_tier=tier) as manager:
        manager.save(1, {"s": _Factory(5.0)})
    target = _Factory(0.0)
    with CheckpointManager(root, memory_tier=tier) as manager:
        assert manager.restore({"s": target}) == 1
    assert target.loaded is not None
    assert torch.equal(target.loaded["f"], torch.full((4, 4), 5.0))  # merge_fn's result


def test_a_value_that_is_not_stateful_is_refused_as_by_a_take(tmp_path):
    from snapshot import NotStatefulError

    tier = MemoryTier(dir=str(tmp_path / "shm"), durable_every=2)
    with (
        CheckpointManager(str(tmp_path / "root"), memory_tier=tier) as manager,
        pytest.raises(NotStatefulError, match=r"app_state\['x'\] is an int"),
    ):
        manager.save(1, {"x": 3})


class _Counted(StateDict):
    """A StateDict counting the calls of its ``state_dict()``: the captures of the live state."""

    calls = 0

    def state_dict(self) -> dict:
        self.calls += 1
        return super().state_dict()


def test_a_durable_step_is_written_from_the_memory_copy(tmp_path):
    """A durable save captures the live state once (the memory take); the root's step is
    written from the tier's copy in the background, a snapshot like a take of the state."""
    from snapshot import RNGState, Snapshot

    root, shm = tmp_path / "root", tmp_path / "shm"
    tier = MemoryTier(dir=str(shm), durable_every=2)
    model = torch.nn.Linear(3, 2)
    state = {"model": model, "extra": _Counted(w=torch.full((64,), 2.0), n=3), "rng": RNGState()}
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with CheckpointManager(str(root), memory_tier=tier) as manager:
        manager.save(1, state)
        manager.save(2, state)  # also durable
        with torch.no_grad():
            model.weight.fill_(-1.0)  # the step's copy is in memory: this is not written
        state["extra"]["w"].fill_(-1.0)
        manager.wait()
        assert manager.steps() == [2]
    assert state["extra"].calls == 2  # one capture per save: nothing taken twice
    step = Snapshot(str(root / "step_0000000002"))
    target = {"model": torch.nn.Linear(3, 2), "extra": StateDict(w=torch.zeros(64), n=0)}
    step.restore(target)  # a plain restore
    for k, v in saved.items():
        assert torch.equal(target["model"].state_dict()[k], v), k
    assert torch.equal(target["extra"]["w"], torch.full((64,), 2.0)) and target["extra"]["n"] == 3
    # The same entries, kinds and shapes as a take of the live state writes.
    Snapshot.take(str(tmp_path / "plain"), state)
    plain = Snapshot(str(tmp_path / "plain")).get_manifest()
    written = step.get_manifest()
    assert written.keys() == plain.keys()
    for path, entry in plain.items():
        assert written[path].tag == entry.tag, path
        assert getattr(written[path], "shape", None) == getattr(entry, "shape", None), path


class _Halves:
    """Both halves (rows 0-3, 4-7) of a global 8x4 tensor as two of our ShardedTensors;
    counts the calls of its ``state_dict()``."""

    def __init__(self, value: float) -> None:
        self.data = torch.arange(32.0).reshape(8, 4) + value
        self.calls = 0

    def state_dict(self) -> dict:
        from snapshot.sharding import ShardedTensor

        self.calls += 1
        top, bottom = self.data[:4], self.data[4:]
        return {
            "top": ShardedTensor.from_rank_offsets("w", top, (0, 0, 2)),
            "bottom": ShardedTensor.from_rank_offsets("w", bottom, (0, 1, 2), replica_id=0),
            "n": 3,
        }

    def load_state_dict(self, state: dict) -> None:
        self.data = torch.cat([state["top"], state["bottom"]])


def test_a_durable_step_of_sharded_state_is_written_from_the_memory_copy(tmp_path):
    """Our ShardedTensor's pieces are put back as ShardedTensors around the part's local
    pieces: one capture per save, and the step is the snapshot a take of the state commits."""
    from snapshot import Snapshot

    root = tmp_path / "root"
    tier = MemoryTier(dir=str(tmp_path / "shm"), durable_every=1)
    state = {"s": _Halves(1.0)}
    saved = state["s"].data.clone()
    with CheckpointManager(str(root), memory_tier=tier) as manager:
        manager.save(1, state)
        state["s"].data.fill_(-1.0)  # the step's copy is in memory: this is not written
        manager.wait()
    assert state["s"].calls == 1  # one capture: nothing taken twice
    step = Snapshot(str(root / "step_0000000001"))
    target = {"s": _Halves(0.0)}
    step.restore(target)  # a plain restore
    assert torch.equal(target["s"].data, saved)
    state["s"].data.copy_(saved)
    Snapshot.take(str(tmp_path / "plain"), state)
    plain = Snapshot(str(tmp_path / "plain")).get_manifest()
    assert shards(step.get_manifest()) == shards(plain)


def shards(manifest: dict) -> dict:
    """Each entry's kind and shape, and a sharded one's key, dtype and shards: each box and
    where its bytes lie (the writing rank, offset, length and CRC; blob names are random)."""
    out = {}
    for path, entry in manifest.items():
        out[path] = (entry.tag, getattr(entry, "shape", None))
        if entry.tag == "sharded_tensor":
            boxes = [
                (s.offsets, s.sizes, [(c.blob.split("/")[0], c.offset, c.nbytes, c.crc32)
                                      for c in s.chunks])
                for s in entry.shards
            ]  # fmt: skip
            out[path] += (entry.key, entry.dtype, boxes)
    return out


def test_compression_applies_to_durable_steps_not_memory_parts(tmp_path):
    pytest.importorskip("zstandard")
    from snapshot import Options, Snapshot

    root, shm = tmp_path / "root", tmp_path / "shm"
    tier = MemoryTier(dir=str(shm), durable_every=1)
    with CheckpointManager(str(root), memory_tier=tier, options=Options(zstd_level=3)) as manager:
        manager.save(1, _state(1.0))
    stored = {
        name: {loc.stored is not None for e in Snapshot(str(path)).get_manifest().values()
               for loc in getattr(e, "chunks", ())}
        for name, path in [("part", next(shm.rglob("manifest.yaml")).parent),
                           ("durable", root / "step_0000000001")]
    }  # fmt: skip
    assert stored == {"part": {False}, "durable": {True}}


class _FailingFS(FSStoragePlugin):
    """``failing://<folder>``: the local plugin, whose writes to step 4 fail."""

    def __init__(self, url: str, storage_options: dict | None = None) -> None:
        super().__init__(url.removeprefix("failing://"), storage_options)
        self.failing = url.rstrip("/").endswith("step_0000000004")

    def _check(self, path: str) -> None:
        if self.failing and "pending" not in path:
            raise OSError("disk failed")

    async def write(self, path, buffers) -> None:
        self._check(path)
        await super().write(path, buffers)

    async def write_observed(self, path, buffers, observe) -> None:
        self._check(path)
        await super().write_observed(path, buffers, observe)


def test_a_failed_durable_write_keeps_the_last_good_step(tmp_path):
    """A durable write that fails in the background raises from wait(), leaves the previous
    durable step restorable, and the next durable save writes again."""
    from storage_plugins import register_storage_plugin

    register_storage_plugin("failing", _FailingFS)
    root, shm = f"failing://{tmp_path / 'root'}", tmp_path / "shm"
    tier = MemoryTier(dir=str(shm), durable_every=2)
    with CheckpointManager(root, memory_tier=tier) as manager:
        for step in (1, 2, 3, 4):
            manager.save(step, _state(float(step)))
        with pytest.raises(SnapshotError, match="disk failed"):
            manager.wait()
        assert manager.steps() == [2]
        manager.save(5, _state(5.0))
        manager.save(6, _state(6.0))
        manager.wait()
        assert manager.steps() == [2, 6]
    import shutil

    shutil.rmtree(shm)
    target = _state(-1.0)
    with CheckpointManager(root) as manager:
        assert manager.restore(target) == 6
    assert torch.equal(target["model"]["w"], torch.full((64,), 6.0))


class _DyingFS(FSStoragePlugin):
    """``dying://<folder>``: the local plugin; the process ends as step 4's manifest is
    written, every blob of it written before."""

    def __init__(self, url: str, storage_options: dict | None = None) -> None:
        super().__init__(url.removeprefix("dying://"), storage_options)
        self.dying = url.rstrip("/").endswith("step_0000000004")

    async def write_if_absent(self, path, buffers) -> None:
        if self.dying and path == "manifest.yaml":
            os._exit(9)
        await super().write_if_absent(path, buffers)


def _killed_mid_write(root: str, shm: str) -> None:
    from storage_plugins import register_storage_plugin

    register_storage_plugin("dying", _DyingFS)
    with CheckpointManager(root, memory_tier=MemoryTier(dir=shm, durable_every=2)) as manager:
        for step in (1, 2, 3, 4):
            manager.save(step, _state(float(step)))
    raise AssertionError("the durable write of step 4 did not end the process")


@pytest.mark.slow  # a process of its own, killed
def test_a_crash_mid_durable_write_leaves_the_previous_step(tmp_path):
    from tests.multirank import PROCESS_CONTEXT

    folder, shm = tmp_path / "root", str(tmp_path / "shm")
    process = PROCESS_CONTEXT.Process(target=_killed_mid_write, args=(f"dying://{folder}", shm))
    process.start()
    process.join(120)
    assert process.exitcode == 9
    assert (folder / "step_0000000004").is_dir()  # the write's debris, no manifest
    assert not (folder / "step_0000000004" / "manifest.yaml").exists()
    target = _state(-1.0)
    with CheckpointManager(str(folder)) as manager:
        assert manager.steps() == [2]
        assert manager.restore(target) == 2
        manager.save(4, _state(4.0))  # over the debris
        manager.wait()
        assert manager.steps() == [2, 4]
    assert torch.equal(target["model"]["w"], torch.full((64,), 2.0))


def test_the_memory_tier_alone(tmp_path, caplog):
    """``MemoryTierStore``: saves to the node's folder, restores the newest complete step (each
    range checked), None when it holds none; a step whose part is valid nowhere is passed over
    for an older one, and an error when no step is valid."""
    from snapshot import MemoryTierStore

    tier = MemoryTier(dir=str(tmp_path / "shm"), keep=2)
    state = _state(0.0)
    with MemoryTierStore("job", tier) as store:
        assert store.restore(_state(-1.0)) is None
        for step in (1, 2, 3):
            state["model"]["w"].fill_(step)
            state["progress"]["step"] = step
            store.save(step, state)
    job = os.path.join(tmp_path / "shm", job_id("memory-tier-store://job"))
    assert sorted(n for n in os.listdir(job) if n.startswith("step_")) == [
        "step_0000000002",
        "step_0000000003",
    ]
    target = _state(-1.0)
    with MemoryTierStore("job", tier) as store:
        assert store.restore(target) == 3
    assert torch.equal(target["model"]["w"], torch.full((64,), 3.0))
    assert target["progress"]["step"] == 3
    with MemoryTierStore("another job", tier) as store:
        assert store.restore(_state(-1.0)) is None

    def damage(step: int) -> None:
        part = os.path.join(job, f"step_{step:010d}", "0", "0")
        (blob,) = os.listdir(part)
        with open(os.path.join(part, blob), "r+b") as f:
            f.write(b"\xff")

    # Step 3 valid nowhere: passed over, with a warning, for step 2.
    damage(3)
    target = _state(-1.0)
    with caplog.at_level(logging.WARNING, logger="snapshot"), MemoryTierStore("job", tier) as store:
        assert store.restore(target) == 2
        assert torch.equal(target["model"]["w"], torch.full((64,), 2.0))
        assert target["progress"]["step"] == 2
        assert "step 3 has no valid copy of the part of rank(s) [0]" in caplog.text
        store.save(3, state)  # the job goes on: step 2, restored, stays as one of `keep`
    # Every step held is damaged: an error, not a fresh start.
    damage(2)
    damage(3)
    with (
        MemoryTierStore("job", tier) as store,
        pytest.raises(SnapshotError, match=r"no step can be restored.*step 3.*step 2"),
    ):
        store.restore(_state(-1.0))
