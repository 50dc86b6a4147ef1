"""RNGState: random numbers after restore equal those after take, for every generator."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch

from snapshot import RNGState, Snapshot, StateDict


def draw() -> tuple:
    return (
        torch.rand(3).tolist(),
        random.random(),
        random.gauss(0, 1),
        np.random.rand(2).tolist(),
        np.random.randn(),
    )


def test_random_numbers_after_restore_equal_those_after_take(snapshot_url):
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    random.gauss(0, 1)  # leaves a cached gaussian in Python's generator state
    np.random.randn()
    Snapshot.take(snapshot_url, {"rng": RNGState()})
    after_take = draw()
    draw()  # move every generator on
    Snapshot(snapshot_url).restore({"rng": RNGState()})
    assert draw() == after_take


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def test_taking_a_snapshot_advances_no_generator(snapshot_url):
    app_state = {"model": torch.nn.Linear(4, 4), "rng": RNGState(), "s": StateDict(x={1, 2})}
    seed_all(5)
    expected = draw()
    seed_all(5)
    Snapshot.take(snapshot_url, app_state)
    assert draw() == expected


class ConsumesRandomness:
    """A Stateful whose load_state_dict draws random numbers, as re-initialisation code may."""

    def state_dict(self):
        return {"v": 1}

    def load_state_dict(self, sd):
        torch.rand(10)
        random.random()


def test_rng_state_is_restored_after_every_other_key(snapshot_url):
    torch.manual_seed(0)
    # RNGState comes first in app_state, yet is captured and restored last.
    app_state = {"rng": RNGState(), "other": ConsumesRandomness()}
    Snapshot.take(snapshot_url, app_state)
    after_take = draw()
    Snapshot(snapshot_url).restore(app_state)
    assert draw() == after_take


def test_rng_state_is_stored_compactly(snapshot_url):
    snap = Snapshot.take(snapshot_url, {"rng": RNGState()})
    manifest = snap.get_manifest()
    assert manifest["0/rng/python/state"].shape == (625,)
    assert manifest["0/rng/numpy/keys"].shape == (624,)
    assert len(manifest) < 20


class _FakeCuda:
    """Stands in for the few ``torch.cuda`` calls RNGState makes: ``visible`` devices, each
    generator state a tensor recorded per device index."""

    def __init__(self, visible: int) -> None:
        self.visible = visible
        self.states = {i: torch.full((16,), i, dtype=torch.uint8) for i in range(visible)}

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.visible)
        monkeypatch.setattr(
            torch.cuda, "get_rng_state_all", lambda: [self.states[i] for i in range(self.visible)]
        )

        def set_rng_state(state, device="cuda"):
            assert isinstance(device, int) and 0 <= device < self.visible, device
            self.states[device] = state.clone()

        monkeypatch.setattr(torch.cuda, "set_rng_state", set_rng_state)


@pytest.mark.parametrize("taken, visible", [(2, 2), (4, 2), (2, 4)])
def test_cuda_generators_restore_across_gpu_counts(monkeypatch, caplog, taken, visible):
    saved = [torch.full((16,), 100 + i, dtype=torch.uint8) for i in range(taken)]
    fake = _FakeCuda(visible)
    fake.install(monkeypatch)
    state = RNGState().state_dict()
    assert len(state["cuda"]) == visible
    state["cuda"] = saved
    with caplog.at_level(logging.WARNING, logger="snapshot.stateful"):
        RNGState().load_state_dict(state)
    common = min(taken, visible)
    for i in range(common):
        assert torch.equal(fake.states[i], saved[i])
    for i in range(common, visible):  # devices the snapshot has no state for keep theirs
        assert torch.equal(fake.states[i], torch.full((16,), i, dtype=torch.uint8))
    warned = [r.getMessage() for r in caplog.records]
    if taken == visible:
        assert not warned
    else:
        assert len(warned) == 1 and f"{taken} CUDA device(s) and {visible} are visible" in warned[0]


def test_cuda_generators_without_cuda_are_logged_not_raised(monkeypatch, caplog):
    state = RNGState().state_dict()
    state["cuda"] = [torch.zeros(16, dtype=torch.uint8)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="snapshot.stateful"):
        RNGState().load_state_dict(state)
    assert "CUDA is not available" in caplog.text
