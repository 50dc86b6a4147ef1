"""Restore targets the reads cannot simply land in: tensors that share memory (a flat buffer
and views of it, as FSDP1's flat_param or apex's flat buffers make; weights tied in the model
but not in the snapshot) and tensors of another layout (sparse). An intact snapshot is never
reported damaged: values land as ``load_state_dict`` would put them, or a ``SnapshotError``
names the targets."""

from __future__ import annotations

import pytest
import torch

from snapshot import Options, Snapshot, StateDict
from snapshot.errors import ChecksumError, StateMismatchError


class Plain(torch.nn.Module):
    """Two linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(64, 32)
        self.b = torch.nn.Linear(32, 16)


class Flat(Plain):
    """``Plain`` whose parameters are disjoint views of one flat tensor (not in its state
    dict, as with apex's flat buffers)."""

    def __init__(self) -> None:
        super().__init__()
        params = [(m, n) for m in (self.a, self.b) for n in ("weight", "bias")]
        self.flat = torch.zeros(sum(getattr(m, n).numel() for m, n in params))
        at = 0
        for m, n in params:
            p = getattr(m, n)
            view = self.flat[at : at + p.numel()].view_as(p)
            at += p.numel()
            m._parameters[n] = torch.nn.Parameter(view)


@pytest.mark.parametrize("verify_first", [False, True])
def test_parameters_that_are_disjoint_views_of_one_buffer_restore(tmp_path, verify_first):
    torch.manual_seed(0)
    source = Plain()
    path = str(tmp_path / "s")
    Snapshot.take(path, {"m": source})
    target = Flat()
    flat = target.flat
    Snapshot(path).restore({"m": target}, verify_first=verify_first)
    got, want = target.state_dict(), source.state_dict()
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert target.a.weight.data_ptr() == flat.data_ptr()  # still views of the buffer


N = 1000


def stored(order: list[str]) -> dict[str, torch.Tensor]:
    """Separate tensors, as a snapshot of a model without a flat buffer holds them."""
    values = {
        "flat": torch.arange(4.0 * N),
        "w1": torch.full((N,), 1.0),
        "w2": torch.full((2 * N,), 2.0),
        "w3": torch.full((N,), 3.0),
    }
    return {k: values[k] for k in order}


def views_of(buffer: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"flat": buffer, "w1": buffer[:N], "w2": buffer[N : 3 * N], "w3": buffer[3 * N :]}


@pytest.mark.parametrize("verify_first", [False, True])
@pytest.mark.parametrize(
    "order", [["flat", "w1", "w2", "w3"], ["w1", "w2", "w3", "flat"]], ids=["flat-first", "flat-last"]
)
def test_a_flat_buffer_and_its_views_get_what_load_state_dict_gives(tmp_path, order, verify_first):
    path = str(tmp_path / "s")
    values = stored(order)
    Snapshot.take(path, {"m": StateDict(values)})
    buffer = torch.zeros(4 * N)
    targets = views_of(buffer)
    state = StateDict({k: targets[k] for k in order})
    want = torch.zeros(4 * N)
    for k in order:  # load_state_dict: each key copied in turn, the later ones win
        views_of(want)[k].copy_(values[k])
    Snapshot(path).restore({"m": state}, verify_first=verify_first)
    assert torch.equal(buffer, want)
    assert all(state[k].data_ptr() == targets[k].data_ptr() for k in order)


def test_weights_tied_in_the_model_but_not_in_the_snapshot(tmp_path):
    path = str(tmp_path / "s")
    Snapshot.take(path, {"m": StateDict(emb=torch.full((300,), 1.0), head=torch.full((300,), 2.0))})
    shared = torch.zeros(300)
    state = StateDict(emb=shared, head=shared)
    Snapshot(path).restore({"m": state})
    assert torch.equal(shared, torch.full((300,), 2.0))  # the later key's value
    assert state["emb"] is shared or state["emb"].data_ptr() == shared.data_ptr()


def test_overlapping_targets_filled_through_a_cast_are_refused_by_name(tmp_path):
    path = str(tmp_path / "s")
    Snapshot.take(path, {"m": StateDict(stored(["flat", "w1", "w2", "w3"]))})
    buffer = torch.zeros(4 * N, dtype=torch.float64)  # float32 stored: read through a cast
    state = StateDict(views_of(buffer))
    with pytest.raises(StateMismatchError) as info:
        Snapshot(path).restore({"m": state})
    assert not isinstance(info.value, ChecksumError)
    assert "'0/m/flat'" in str(info.value) and "'0/m/w1'" in str(info.value)
    assert "share memory" in str(info.value)


def test_tied_weights_from_a_tied_snapshot_still_read_in_place(tmp_path):
    shared = torch.arange(300.0)
    path = str(tmp_path / "s")
    Snapshot.take(path, {"m": StateDict(emb=shared, head=shared)})
    target = torch.zeros(300)
    state = StateDict(emb=target, head=target)
    Snapshot(path, options=Options(checksums=True)).restore({"m": state}, verify_first=True)
    assert torch.equal(target, shared) and state["emb"] is target and state["head"] is target


@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr"])
def test_a_sparse_target_gets_the_stored_values(tmp_path, layout):
    path = str(tmp_path / "s")
    stored_value = torch.arange(6.0).reshape(2, 3)
    Snapshot.take(path, {"m": StateDict(t=stored_value, u=torch.ones(4))})
    zeros = torch.zeros(2, 3)
    target = zeros.to_sparse() if layout == "sparse_coo" else zeros.to_sparse_csr()
    state = StateDict(t=target, u=torch.zeros(4))
    Snapshot(path).restore({"m": state})
    got = state["t"]
    assert torch.equal(got.to_dense() if got.layout != torch.strided else got, stored_value)
    assert torch.equal(state["u"], torch.ones(4))
