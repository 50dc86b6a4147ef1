"""Pipeline stages: each stage's ranks hold disjoint keys, and a restore at another world size
takes a key its rank's own saved state lacks from the one saved rank that holds it.

A tiny 4-layer MLP split into 2 stages as torchtitan splits a model: each stage builds the whole
model and deletes the other stage's layers, so parameter names stay the full model's. Each rank
takes its stage's model and AdamW state through ``get_state_dict`` (the optimizer's state keyed
by parameter name, flattened as torchtitan does). Real processes joined by gloo on the CPU
(tests/multirank.py); the one-rank sides run in the test's own process.
"""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
)

from snapshot import Snapshot, StateMismatchError
from tests.helpers import ModelAndOptimizer, assert_same
from tests.multirank import run_ranks

LAYERS, WIDTH, TAKEN_AT, MORE = 4, 8, 2, 3


class MLP(torch.nn.Module):
    def __init__(self, layers: int = LAYERS) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleDict(
            {str(i): torch.nn.Linear(WIDTH, WIDTH) for i in range(layers)}
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = torch.tanh(layer(x))
        return x


def _model(stage: int | None, seed: int, layers: int = LAYERS) -> MLP:
    """The whole model (``stage`` None) or one of 2 stages, its other layers deleted."""
    torch.manual_seed(seed)
    model = MLP(layers)
    if stage is not None:
        for i in range(layers):
            if i // (layers // 2) != stage:
                del model.layers[str(i)]
    return model


def _batch(step: int) -> torch.Tensor:
    return torch.linspace(-1, 1, 4 * WIDTH).view(4, WIDTH) * (1 + step / 4)


class Train(ModelAndOptimizer):
    """A stage's (or the whole) model and its AdamW as one Stateful; ``flat``: the optimizer's
    state flattened to keys such as ``state.layers.0.weight.exp_avg`` (torchtitan's), else
    nested by parameter name; ``strict``: torch's check of the model's keys on load."""

    def __init__(self, model: MLP, flat: bool = True, strict: bool = True) -> None:
        options = StateDictOptions(flatten_optimizer_state_dict=flat, strict=strict)
        super().__init__(model, torch.optim.AdamW(model.parameters(), lr=0.01), options)

    def copy(self) -> dict[str, Any]:
        return copy.deepcopy(self.state_dict())


def _step_whole(train: Train, step: int) -> float:
    train.optim.zero_grad()
    loss = train.model(_batch(step)).square().mean()
    loss.backward()
    train.optim.step()
    return loss.item()


def _step_stages(train: Train, stage: int, step: int) -> float | None:
    """One step of a 2-stage pipeline over gloo: stage 0 sends its activations to stage 1,
    which sends back their gradient. Stage 1's loss, None on stage 0."""
    train.optim.zero_grad()
    if stage == 0:
        out = train.model(_batch(step))
        dist.send(out.detach(), 1)
        grad = torch.empty_like(out)
        dist.recv(grad, 1)
        out.backward(grad)
        loss = None
    else:
        x = torch.empty(4, WIDTH)
        dist.recv(x, 0)
        x.requires_grad_()
        out = train.model(x).square().mean()
        out.backward()
        assert x.grad is not None
        dist.send(x.grad, 0)
        loss = out.item()
    train.optim.step()
    return loss


def _pack(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _unpack(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _sorted(state: dict[str, Any]) -> dict[str, Any]:
    """A state with each part's keys sorted (the stages' union lists them in another order)."""
    return {part: dict(sorted(value.items())) for part, value in state.items()}


def _union(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    return _sorted({part: {**a[part], **b[part]} for part in a})


def _uninterrupted() -> list[float]:
    """The losses of one process training the whole model from the start."""
    train = Train(_model(None, 0))
    return [_step_whole(train, step) for step in range(TAKEN_AT + MORE)]


# -- 2 stages -> 1 rank ------------------------------------------------------------------------


def _take_stages(rank: int, world: int, flat_path: str, nested_path: str, plain: str) -> bytes:
    train = Train(_model(rank, 0))
    nested = Train(train.model, flat=False)
    nested.optim = train.optim
    for step in range(TAKEN_AT):
        _step_stages(train, rank, step)
    Snapshot.take(flat_path, {"train": train})
    Snapshot.take(nested_path, {"train": nested})
    Snapshot.take(plain, {"model": train.model})
    taken = train.copy()
    losses = [_step_stages(train, rank, TAKEN_AT + i) for i in range(MORE)]
    return _pack((taken, losses))


@pytest.mark.slow
def test_two_stages_restore_on_one_rank_and_a_key_no_rank_holds_fails_first(tmp_path):
    flat, nested, plain = (str(tmp_path / name) for name in ("flat", "nested", "plain"))
    taken = run_ranks(2, _take_stages, flat, nested, plain)
    (stage0, _), (stage1, piped) = map(_unpack, taken)
    expected = _uninterrupted()
    assert piped == expected[TAKEN_AT:]  # the pipeline trains as one process does
    assert not set(stage0["model"]) & set(stage1["model"])  # disjoint keys

    # The whole model on one rank: rank 1's keys come from rank 1's saved state.
    train = Train(_model(None, 7))
    Snapshot(flat).restore({"train": train})
    assert_same(_sorted(train.copy()), _union(stage0, stage1))  # bitwise
    assert [_step_whole(train, TAKEN_AT + i) for i in range(MORE)] == expected[TAKEN_AT:]

    # A key no saved rank holds: an error naming it, before any target is modified.
    bigger = Train(_model(None, 7, layers=LAYERS + 2))
    _step_whole(bigger, 0)  # optimizer state to compare too
    before = bigger.copy()
    with pytest.raises(StateMismatchError) as info:
        Snapshot(flat).restore({"train": bigger})
    message = str(info.value)
    assert "taken on 2 ranks and restored on 1, rank 0" in message, message
    assert "'train/model/layers.4.weight'" in message, message
    assert "no saved rank holds these keys of the state_dict(): app_state['train']: 64" in message
    assert "'train/optim/state.layers.4.weight.exp_avg'" in message, message
    assert "(searched the saved states of ranks 0-1;" in message, message
    assert "nothing was modified" in message and "strict=False" in message
    assert info.value.modified == {} and info.value.untouched == ("train",)
    assert_same(bigger.copy(), before)

    # strict=False: those keys are left as they are, the others restored (a module's own
    # load is told strict=False too).
    module = bigger.model
    Snapshot(plain).restore({"model": module}, strict=False)
    now = module.state_dict()
    for name, value in _union(stage0, stage1)["model"].items():
        assert_same(now[name], value)
    assert_same(now["layers.5.bias"], before["model"]["layers.5.bias"])

    # Optimizer state nested by parameter name keeps its param_groups in a list, which is
    # never merged across ranks: the keys of rank 1's parameters there are named.
    with pytest.raises(StateMismatchError, match=r"'train/optim/param_groups/0/params/4'"):
        Snapshot(nested).restore({"train": Train(_model(None, 7), flat=False)})


# -- 1 rank -> 2 stages ------------------------------------------------------------------------


def _restore_stages(rank: int, world: int, path: str, taken: bytes) -> bytes:
    # Each stage finds its keys in rank 0's saved state, which holds the whole model: the
    # other stage's keys come too, and torch's load leaves them aside (strict=False, as
    # torchtitan's model wrapper loads).
    train = Train(_model(rank, 7), strict=False)
    Snapshot(path).restore({"train": train})
    restored = train.copy()
    whole = _unpack(taken)
    for part, value in restored.items():
        assert_same(value, type(value)((k, whole[part][k]) for k in value), part)  # bitwise
    losses = [_step_stages(train, rank, TAKEN_AT + i) for i in range(MORE)]
    return _pack(losses)


@pytest.mark.slow
def test_one_rank_restores_on_two_stages(tmp_path):
    path = str(tmp_path / "snap")
    train = Train(_model(None, 0))
    for step in range(TAKEN_AT):
        _step_whole(train, step)
    Snapshot.take(path, {"train": train})
    taken = _pack(train.copy())
    _, losses = map(_unpack, run_ranks(2, _restore_stages, path, taken))
    assert losses == _uninterrupted()[TAKEN_AT:]


# -- the rule, on manifests of primitives (no blobs: nothing to read), in one process ---------


def _restore_on(manifest: Any, app_state: dict, path: str, rank: int = 0, world: int = 1, **kw):
    from snapshot._engine.dist.dist import Coordinator
    from snapshot._engine.restore import restore
    from snapshot.options import Options

    class At(Coordinator):
        pass

    At.rank, At.world_size = rank, world
    restore.restore(
        manifest,
        app_state,
        path=path,
        coordinator=At(),
        storage_options=None,
        options=Options.from_env(),
        **kw,
    )


def _saved(world: int, ranks: dict[int, dict[str, Any]], replicated: dict[str, Any]) -> Any:
    """A manifest of ``world`` ranks, each rank's ``s`` a dict of primitives (lists of them),
    and ``replicated`` ones listed once, under rank 0."""
    import manifest as mf

    entries: dict[str, mf.Entry] = {}
    for rank, values in ranks.items():
        entries[f"{rank}/s"] = mf.DictEntry(keys=(*values, *replicated))
        for k, v in values.items():
            if isinstance(v, list):
                entries[f"{rank}/s/{k}"] = mf.ListEntry(length=len(v))
                for i, item in enumerate(v):
                    entries[f"{rank}/s/{k}/{i}"] = mf.PrimitiveEntry(value=item)
            else:
                entries[f"{rank}/s/{k}"] = mf.PrimitiveEntry(value=v)
    for k, v in replicated.items():
        entries[f"0/s/{k}"] = mf.PrimitiveEntry(value=v, replicated=True)
    return mf.Manifest(format_version=3, world_size=world, entries=entries)


def test_a_key_comes_from_the_one_saved_rank_holding_it_or_fails_naming_it(tmp_path, caplog):
    from snapshot import StateDict

    path = str(tmp_path)
    two = _saved(2, {0: {"a": 1}, 1: {"b": 2}}, {"r": 5})
    state = StateDict(a=0, b=0, r=0)
    _restore_on(two, {"s": state}, path)
    assert dict(state) == {"a": 1, "r": 5, "b": 2}

    # Held by no saved rank: named, nothing changed; strict=False leaves it as it is.
    state = StateDict(a=0, b=0, c=0)
    with pytest.raises(StateMismatchError, match=r"no saved rank holds .*'s/c'") as info:
        _restore_on(two, {"s": state}, path)
    assert "'s/b'" not in str(info.value)
    assert dict(state) == {"a": 0, "b": 0, "c": 0}
    with caplog.at_level("WARNING", logger="snapshot"):
        _restore_on(two, {"s": state}, path, strict=False)
    assert dict(state) == {"a": 1, "b": 2, "c": 0, "r": 5}
    assert any(
        "'s/c'" in r.getMessage() and "left as they are" in r.getMessage() for r in caplog.records
    )

    # Held by two saved ranks with different values: none is chosen.
    three = _saved(3, {0: {"a": 1}, 1: {"b": 2}, 2: {"b": 3}}, {})
    state = StateDict(a=0, b=0)
    with pytest.raises(StateMismatchError, match=r"several saved ranks hold different .*'s/b'"):
        _restore_on(three, {"s": state}, path)
    assert dict(state) == {"a": 0, "b": 0}

    # A list is never merged across ranks: rank 0's is the list.
    lists = _saved(2, {0: {"l": [1]}, 1: {"l": [1, 2]}}, {})
    with pytest.raises(StateMismatchError, match=r"'s/l/1'.*a list or tuple is never merged"):
        _restore_on(lists, {"s": StateDict(l=[0, 0])}, path)

    # A rank the snapshot did not have takes a leaf that rank 0 alone held.
    one = _saved(1, {0: {"a": 1}}, {})
    state = StateDict(a=0)
    _restore_on(one, {"s": state}, path, rank=2, world=3)
    assert dict(state) == {"a": 1}
