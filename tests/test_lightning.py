"""The Lightning ``CheckpointIO`` plugins (``snapshot.integrations.lightning``): a real Trainer
fits, checkpoints through the plugin and resumes bitwise; a save that fails or never commits
leaves the checkpoint it would replace loadable; ``map_location``; removal; S3; two ranks."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def _lightning() -> Any:
    for name in ("lightning.pytorch", "pytorch_lightning"):
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError:
            continue
    pytest.skip(
        "Lightning cannot be imported (neither lightning.pytorch nor pytorch_lightning): "
        "pip install 'statesnap[lightning]'",
        allow_module_level=True,
    )


pl = _lightning()

from snapshot import Snapshot, StateDict  # noqa: E402
from snapshot._engine.io.storage_calls import open_storage  # noqa: E402
from snapshot._engine.runtime import run  # noqa: E402
from snapshot.errors import InvalidArgumentError, SnapshotError  # noqa: E402
from snapshot.integrations import lightning as integration  # noqa: E402
from snapshot.integrations.lightning import (  # noqa: E402
    AsyncStatesnapCheckpointIO,
    StatesnapCheckpointIO,
)
from snapshot.options import resolve  # noqa: E402
from storage_plugins import Buffer, register_storage_plugin, unregister_storage_plugin  # noqa: E402
from storage_plugins.fs import FSStoragePlugin  # noqa: E402
from tests.helpers import assert_same  # noqa: E402
from tests.multirank import run_ranks  # noqa: E402
from tests.plugins import GATE, gated_storage  # noqa: E402
from tests.s3server import S3Bucket  # noqa: E402

PLUGINS = [StatesnapCheckpointIO, AsyncStatesnapCheckpointIO]


def versions(root: str, storage_options: dict[str, Any] | None = None) -> list[Any]:
    return integration.list_versions(root, storage_options, resolve(None))


def checkpoint(seed: int) -> dict[str, Any]:
    """A dict shaped like Lightning's: a module's state, an optimizer's, plain values."""
    g = torch.Generator().manual_seed(seed)
    return {
        "epoch": seed,
        "global_step": 10 * seed,
        "pytorch-lightning_version": "2.4.0",
        "state_dict": {
            "net.weight": torch.randn(4, 3, generator=g),
            "net.bias": torch.randn(4, generator=g),
        },
        "optimizer_states": [
            {"state": {0: {"step": torch.tensor(float(seed))}}, "param_groups": [{"lr": 0.1}]}
        ],
        "hyper_parameters": {"width": 4, "name": "run"},
    }


def save(io: StatesnapCheckpointIO, ckpt: dict[str, Any], path: str, **kw: Any) -> None:
    """A save, committed before returning (the async plugin waits for it)."""
    io.save_checkpoint(ckpt, path, **kw)
    if isinstance(io, AsyncStatesnapCheckpointIO):
        io.wait()


# ---------------------------------------------------------------------------------------------
# A real Trainer: fit with checkpoints, resume, losses bitwise equal to an uninterrupted run.


class Regressor(pl.LightningModule):
    """A small MLP with Adam and a per-step LR schedule: resuming right needs the weights, the
    optimizer's moments and the scheduler's position."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.losses: dict[int, torch.Tensor] = {}

    def training_step(self, batch: Sequence[torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses[self.global_step] = loss.detach().clone()
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=0.05)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


STEPS_PER_EPOCH = 4


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=32 // STEPS_PER_EPOCH, shuffle=False)


def fit(
    root: str,
    epochs: int,
    *,
    seed: int = 0,
    plugins: list[Any] | None = None,
    callbacks: list[Any] | None = None,
    ckpt_path: str | None = None,
) -> dict[int, torch.Tensor]:
    """Fits a fresh Regressor for ``epochs`` epochs (resuming from ``ckpt_path``); the loss of
    each step it ran, by global step."""
    model = Regressor(seed)
    trainer = pl.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=bool(callbacks),
        callbacks=callbacks,
        plugins=plugins,
        default_root_dir=root,
    )
    trainer.fit(model, loader(), ckpt_path=ckpt_path)
    return model.losses


def assert_bitwise(got: dict[int, torch.Tensor], want: dict[int, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for step in want:
        assert got[step].view(torch.int32).item() == want[step].view(torch.int32).item(), step


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[int, torch.Tensor]:
    """Four epochs without a checkpoint: the losses a resumed run must reproduce."""
    losses = fit(str(tmp_path_factory.mktemp("straight")), 4)
    assert len(losses) == 4 * STEPS_PER_EPOCH
    return losses


def test_trainer_resumes_bitwise(tmp_path, uninterrupted):
    ckdir = tmp_path / "checkpoints"
    # save_top_k=1 without a monitor keeps the newest epoch's file: each epoch removes the
    # previous one through the plugin; last.ckpt is replaced at the same path every epoch.
    callback = pl.callbacks.ModelCheckpoint(dirpath=ckdir, save_last=True)
    first = fit(str(tmp_path), 2, plugins=[StatesnapCheckpointIO()], callbacks=[callback])
    assert_bitwise(first, {s: uninterrupted[s] for s in range(2 * STEPS_PER_EPOCH)})
    assert sorted(os.listdir(ckdir)) == ["epoch=1-step=8.ckpt", "last.ckpt"]
    for name in os.listdir(ckdir):
        found = versions(str(ckdir / name))
        assert len(found) == 1 and found[0].committed, found
    assert [v.counter for v in versions(str(ckdir / "last.ckpt"))] == [2]  # replaced once

    # A different seed: only the checkpoint can make the resumed run match.
    resumed = fit(
        str(tmp_path),
        4,
        seed=1,
        plugins=[StatesnapCheckpointIO()],
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "again")],
        ckpt_path=str(ckdir / "last.ckpt"),
    )
    assert_bitwise(resumed, {s: uninterrupted[s] for s in range(8, 16)})


class HeldSaves(AsyncStatesnapCheckpointIO):
    """The async plugin with each save's blob writes held (``gated://``, tests/plugins.py) until
    the next training step has run, or until something must wait for the save."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options=None) -> None:
        GATE.set()
        AsyncStatesnapCheckpointIO.wait(self)
        GATE.clear()
        super().save_checkpoint(checkpoint, f"gated://{path}", storage_options)

    def remove_checkpoint(self, path: Any) -> None:
        GATE.set()
        super().remove_checkpoint(path)

    def teardown(self) -> None:
        GATE.set()
        super().teardown()


class StepWhileHeld(pl.Callback):
    """Counts the optimizer steps that ran while a save's writes were held, then lets them go."""

    def __init__(self) -> None:
        self.steps_while_held = 0

    def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        if not GATE.is_set():
            self.steps_while_held += 1
            GATE.set()


def test_async_trainer_resumes_bitwise_with_steps_during_writes(tmp_path, uninterrupted):
    ckdir = tmp_path / "checkpoints"
    held = StepWhileHeld()
    with gated_storage():
        GATE.set()  # closed by each save
        fit(
            str(tmp_path),
            3,
            plugins=[HeldSaves()],
            callbacks=[
                # One save per epoch (a second one would let the first go before the next
                # step): each is held while the next step runs.
                pl.callbacks.ModelCheckpoint(dirpath=ckdir, save_top_k=-1),
                held,
            ],
        )
    # The saves at the end of epochs 0 and 1 were written while the next step changed the
    # weights in place (the one of epoch 2 was let go by teardown).
    assert held.steps_while_held == 2
    names = ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt"]
    assert sorted(os.listdir(ckdir)) == names
    for name in names:
        assert [v.committed for v in versions(str(ckdir / name))] == [True]
    resumed = fit(
        str(tmp_path),
        4,
        seed=1,
        plugins=[AsyncStatesnapCheckpointIO()],
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "again")],
        ckpt_path=str(ckdir / "epoch=1-step=8.ckpt"),
    )
    assert_bitwise(resumed, {s: uninterrupted[s] for s in range(8, 16)})


class Width(pl.LightningModule):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.fc = nn.Linear(width, 1)


def test_load_from_checkpoint_fails_and_the_documented_way_works(tmp_path):
    """README, Lightning, limits: ``load_from_checkpoint`` calls torch.load on the folder;
    loading through the plugin and ``load_state_dict`` gives the model back."""
    path = str(tmp_path / "last.ckpt")
    trainer = pl.Trainer(logger=False, enable_progress_bar=False, plugins=[StatesnapCheckpointIO()])
    model = Width(3)
    trainer.strategy.connect(model)
    trainer.save_checkpoint(path)
    with pytest.raises(IsADirectoryError, match="Is a directory"):
        Width.load_from_checkpoint(path)
    ckpt = StatesnapCheckpointIO().load_checkpoint(path, map_location="cpu")
    again = Width(**ckpt["hyper_parameters"])
    again.load_state_dict(ckpt["state_dict"])
    assert again.fc.weight.shape == (1, 3)
    assert torch.equal(again.fc.weight, model.fc.weight)


# ---------------------------------------------------------------------------------------------
# The plugins without a Trainer.


@pytest.fixture(params=["fs", "memory"])
def root(request: pytest.FixtureRequest, tmp_path) -> str:
    if request.param == "fs":
        return str(tmp_path / "last.ckpt")
    return f"memory://{tmp_path.name}/last.ckpt"


@pytest.mark.parametrize("plugin", PLUGINS)
def test_round_trip_and_replace(plugin, root):
    io = plugin()
    save(io, checkpoint(1), root)
    save(io, checkpoint(2), root)
    assert [(v.counter, v.committed) for v in versions(root)] == [(2, True)]
    assert_same(io.load_checkpoint(root), checkpoint(2))
    io.teardown()


@pytest.mark.parametrize("plugin", PLUGINS)
def test_save_of_a_value_that_cannot_be_stored_leaves_the_old_one(plugin, root):
    io = plugin()
    save(io, checkpoint(1), root)
    bad = {**checkpoint(2), "callbacks": {"hook": lambda: None}}
    with pytest.raises(SnapshotError, match="cannot serialize a function"):
        save(io, bad, root)
    assert [(v.counter, v.committed) for v in versions(root)] == [(1, True)]
    assert_same(io.load_checkpoint(root), checkpoint(1))
    save(io, checkpoint(3), root)  # the path is still usable
    assert_same(io.load_checkpoint(root), checkpoint(3))


# Blob writes fail while FAIL is set (the pending marker's write passes): a store that breaks
# in the middle of a save. Registered under ``failing://`` by the fixture.
FAIL: list[bool] = []


class FailingPlugin(FSStoragePlugin):
    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        super().__init__(url.removeprefix("failing://"), storage_options)

    async def write(self, path: str, buffers: Sequence[Buffer]) -> None:
        if FAIL and path != ".statesnap-pending":
            raise OSError(28, "No space left on device")
        await super().write(path, buffers)


@pytest.fixture
def failing(tmp_path):
    register_storage_plugin("failing", FailingPlugin)
    try:
        yield f"failing://{tmp_path / 'last.ckpt'}", str(tmp_path / "last.ckpt")
    finally:
        FAIL.clear()
        unregister_storage_plugin("failing")


@pytest.mark.parametrize("plugin", PLUGINS)
def test_save_that_fails_in_storage_leaves_the_old_one(plugin, failing):
    url, local = failing
    io = plugin(options=resolve(None).replace(io_retries=0))
    save(io, checkpoint(1), url)
    FAIL.append(True)
    with pytest.raises(SnapshotError, match="No space left"):
        save(io, checkpoint(2), url)  # the async plugin's error, from its wait()
    FAIL.clear()
    # Only the old version is left (the failed one's folder is deleted), and it loads.
    assert [(v.counter, v.committed) for v in versions(local)] == [(1, True)]
    assert os.listdir(local) == [versions(local)[0].name]
    assert_same(io.load_checkpoint(local), checkpoint(1))


def test_async_error_is_raised_by_the_next_save(failing):
    url, local = failing
    io = AsyncStatesnapCheckpointIO(options=resolve(None).replace(io_retries=0))
    FAIL.append(True)
    io.save_checkpoint(checkpoint(1), url)
    with pytest.raises(SnapshotError, match="No space left"):
        io.save_checkpoint(checkpoint(2), url)  # not begun: the earlier failure comes first
    FAIL.clear()
    assert versions(local) == []
    save(io, checkpoint(3), url)
    assert_same(io.load_checkpoint(local), checkpoint(3))


def test_an_interrupted_save_is_ignored_then_cleaned(tmp_path):
    """A process killed mid-save leaves a version without a manifest: loads skip it, and the
    next save's commit deletes it."""
    root = str(tmp_path / "last.ckpt")
    io = StatesnapCheckpointIO()
    save(io, checkpoint(1), root)
    debris = tmp_path / "last.ckpt" / "v0000000007_0123456789ab"
    (debris / "0").mkdir(parents=True)
    (debris / ".statesnap-pending").write_bytes(b"")
    (debris / "0" / "0").write_bytes(b"\0" * 100)
    assert [(v.counter, v.committed) for v in versions(root)] == [(1, True), (7, False)]
    assert_same(io.load_checkpoint(root), checkpoint(1))
    save(io, checkpoint(2), root)
    assert [(v.counter, v.committed) for v in versions(root)] == [(8, True)]
    assert_same(io.load_checkpoint(root), checkpoint(2))


def test_async_save_captures_before_returning(tmp_path):
    """The weights are overwritten right after the save returns, while its writes are held:
    the checkpoint holds them as they were."""
    ckpt = checkpoint(1)
    want = checkpoint(1)
    io = AsyncStatesnapCheckpointIO()
    root = tmp_path / "last.ckpt"
    with gated_storage():
        io.save_checkpoint(ckpt, f"gated://{root}")
        for t in ckpt["state_dict"].values():
            t.fill_(float("nan"))
        ckpt["optimizer_states"][0]["state"][0]["step"].add_(100)
        assert [v.committed for v in versions(str(root))] == [False]  # still held
        GATE.set()
        io.teardown()
    assert_same(io.load_checkpoint(str(root)), want)


def test_map_location():
    io = StatesnapCheckpointIO()
    root = "memory://maps/last.ckpt"
    w = nn.Parameter(torch.randn(3, 2))
    ckpt = {"state_dict": {"w": w, "tied": w}, "opt": [torch.zeros(2)], "n": 3}
    save(io, ckpt, root)

    def devices(c: dict[str, Any]) -> list[str]:
        return [c["state_dict"]["w"].device.type, c["opt"][0].device.type]

    # Tensors come back on the CPU; "meta" stands in for another device here.
    assert devices(io.load_checkpoint(root)) == ["cpu", "cpu"]
    assert devices(io.load_checkpoint(root, map_location="cpu")) == ["cpu", "cpu"]
    for where in ("meta", torch.device("meta"), {"cpu": "meta"}):
        moved = io.load_checkpoint(root, map_location=where)
        assert devices(moved) == ["meta", "meta"], where
        assert moved["state_dict"]["w"] is moved["state_dict"]["tied"]
        assert type(moved["state_dict"]["w"]) is nn.Parameter
        assert moved["n"] == 3
    assert devices(io.load_checkpoint(root, map_location={"cuda:0": "meta"})) == ["cpu", "cpu"]
    seen = []

    def to_meta(storage: Any, location: str) -> Any:
        seen.append(location)
        return torch.UntypedStorage(storage.nbytes(), device="meta")

    assert devices(io.load_checkpoint(root, map_location=to_meta)) == ["meta", "meta"]
    assert seen == ["cpu", "cpu"]  # the tied tensor is moved once
    kept = io.load_checkpoint(root, map_location=lambda storage, location: storage)
    assert devices(kept) == ["cpu", "cpu"]
    assert torch.equal(kept["state_dict"]["w"], w)
    with pytest.raises(InvalidArgumentError, match="map_location"):
        io.load_checkpoint(root, map_location=3)


@pytest.mark.parametrize("plugin", PLUGINS)
def test_remove(plugin, root):
    io = plugin()
    save(io, checkpoint(1), root)
    save(io, checkpoint(2), root)
    other = root.replace("last.ckpt", "other.ckpt")
    save(io, checkpoint(3), other)
    io.remove_checkpoint(root)
    assert versions(root) == []
    if "://" not in root:
        assert not os.path.exists(root)
    with pytest.raises(FileNotFoundError, match="no committed statesnap checkpoint"):
        io.load_checkpoint(root)
    io.remove_checkpoint(root)  # nothing there: nothing to do
    assert_same(io.load_checkpoint(other), checkpoint(3))


def test_a_file_at_the_path_is_refused(tmp_path):
    path = tmp_path / "old.ckpt"
    torch.save(checkpoint(1), path)
    io = StatesnapCheckpointIO()
    for call in (lambda: io.save_checkpoint(checkpoint(2), path), lambda: io.load_checkpoint(path)):
        with pytest.raises(SnapshotError, match="is a file, not a statesnap checkpoint"):
            call()
    assert torch.load(path)["epoch"] == 1


def test_plain_snapshot_tools_read_a_version(tmp_path):
    """Each version is an ordinary snapshot: ``Snapshot`` reads it, the checkpoint under
    ``0/checkpoint``."""
    root = str(tmp_path / "last.ckpt")
    StatesnapCheckpointIO().save_checkpoint(checkpoint(1), root)
    (only,) = versions(root)
    snap = Snapshot(os.path.join(root, only.name))
    assert snap.read_object("0/checkpoint/epoch") == 1
    target = {"checkpoint": StateDict(checkpoint(0))}
    snap.restore(target)
    assert_same(dict(target["checkpoint"]), checkpoint(1))


def test_missing_lightning_is_a_clear_import_error(monkeypatch):
    for name in list(sys.modules):
        if name.split(".")[0] in ("lightning", "pytorch_lightning"):
            monkeypatch.setitem(sys.modules, name, None)
    for name in ("lightning", "pytorch_lightning"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match=r"pip install 'statesnap\[lightning\]'"):
        integration._checkpoint_io_base()


def test_s3(s3_bucket: S3Bucket):
    opts = s3_bucket.storage_options
    run_url = s3_bucket.url("run")
    root = f"{run_url}/last.ckpt"
    for plugin in PLUGINS:
        io = plugin(opts)
        save(io, checkpoint(1), root)
        save(io, checkpoint(2), root)
        assert [(v.counter, v.committed) for v in versions(root, opts)] == [(2, True)]
        assert_same(io.load_checkpoint(root), checkpoint(2))
        io.remove_checkpoint(root)
        assert versions(root, opts) == []
        with open_storage(run_url, opts, resolve(None)) as store:
            assert run(store.list_names(100)) == []  # nothing left under the prefix
    assert any(r.method == "GET" and "list-type" in r.query for r in s3_bucket.log())


# ---------------------------------------------------------------------------------------------
# Across ranks: Lightning saves on rank 0 alone and loads on every rank.


def _rank0_saves(rank: int, world_size: int, root: str) -> list[int]:
    import torch.distributed as dist

    if rank == 0:
        for plugin in PLUGINS:
            io = plugin()
            for seed in (1, 2):
                save(io, checkpoint(seed), root)
    dist.barrier()
    loaded = StatesnapCheckpointIO().load_checkpoint(root)
    assert_same(loaded, checkpoint(2))
    return [v.counter for v in versions(root)]


@pytest.mark.slow
def test_two_ranks_rank0_saves_alone(tmp_path):
    root = str(tmp_path / "last.ckpt")
    assert run_ranks(2, _rank0_saves, root) == [[4], [4]]


# ---------------------------------------------------------------------------------------------
# Each Lightning distribution: `lightning` (the extra's, import name lightning.pytorch) and
# `pytorch-lightning` (pytorch_lightning); with both installed, the plugins serve a Trainer of
# either, whichever was imported first.

_EITHER = """
import sys
import torch
from torch.utils.data import DataLoader, TensorDataset
from snapshot.integrations.lightning import StatesnapCheckpointIO  # before Lightning
import importlib
pl = importlib.import_module(sys.argv[1])

class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 1)
    def training_step(self, batch, index):
        return torch.nn.functional.mse_loss(self.fc(batch[0]), batch[1])
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

data = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=4)
def trainer(epochs):
    return pl.Trainer(max_epochs=epochs, plugins=[StatesnapCheckpointIO()], logger=False,
                      callbacks=[pl.callbacks.ModelCheckpoint(dirpath="ckpt", save_last=True)],
                      enable_progress_bar=False, enable_model_summary=False)
trainer(1).fit(Net(), data)
resumed = trainer(2)
resumed.fit(Net(), data, ckpt_path="ckpt/last.ckpt")
print("resumed at", resumed.global_step)
"""


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lightning.pytorch", "pytorch_lightning"])
def test_each_lightning_distribution_takes_the_plugin(name, tmp_path):
    import subprocess

    if importlib.util.find_spec(name.split(".")[0]) is None:
        pytest.skip(f"{name} is not installed")
    done = subprocess.run(
        [sys.executable, "-c", _EITHER, name],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=str(tmp_path),
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "resumed at 4", done.stdout
    assert (tmp_path / "ckpt" / "last.ckpt").is_dir()
