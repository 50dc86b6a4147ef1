"""The retention policy of the checkpoint manager, as a pure function (no storage)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from snapshot import InvalidArgumentError
from snapshot._engine.manager.retention import Policy, Step, to_delete, to_keep


def steps(*numbers: int, losses: dict[int, float] | None = None, bases=None) -> list[Step]:
    losses = losses or {}
    bases = bases or {}
    return [
        Step(n, f"step_{n}", {"loss": losses[n]} if n in losses else {}, tuple(bases.get(n, ())))
        for n in numbers
    ]


def kept(policy: Policy, found: list[Step], in_flight=frozenset()) -> list[int]:
    gone = {s.step for s in to_delete(policy, found, in_flight)}
    return sorted(s.step for s in found if s.step not in gone)


def test_keep_last():
    assert kept(Policy(keep_last=2), steps(1, 2, 3, 4)) == [3, 4]


def test_keep_every_steps_keeps_milestones_and_the_latest():
    assert kept(Policy(keep_every_steps=10), steps(5, 10, 15, 20, 25)) == [10, 20, 25]


def test_keep_best_min_and_max():
    losses = {1: 0.5, 2: 0.1, 3: 0.9, 4: 0.3}
    assert kept(Policy(keep_best=2, metric="loss"), steps(1, 2, 3, 4, losses=losses)) == [2, 4]
    # max: the highest two, and the latest (4) always
    assert kept(
        Policy(keep_best=1, metric="loss", mode="max"), steps(1, 2, 3, 4, losses=losses)
    ) == [3, 4]


def test_best_n_never_deletes_the_newest():
    """The bug peers' users report: keeping "best N" deleted the newest checkpoints."""
    losses = {1: 0.1, 2: 0.2, 3: 0.3, 4: 0.4}
    assert 4 in kept(Policy(keep_best=1, metric="loss"), steps(1, 2, 3, 4, losses=losses))


def test_steps_without_the_metric_are_not_ranked():
    found = steps(1, 2, 3, losses={1: 0.5})
    assert kept(Policy(keep_best=2, metric="loss"), found) == [1, 3]


def test_the_union_of_policies():
    losses = {1: 0.01, 2: 0.9, 3: 0.9, 4: 0.9, 5: 0.9, 6: 0.9}
    policy = Policy(keep_last=1, keep_every_steps=3, keep_best=1, metric="loss")
    assert kept(policy, steps(1, 2, 3, 4, 5, 6, losses=losses)) == [1, 3, 6]


def test_in_flight_steps_are_never_deleted():
    assert kept(Policy(keep_last=1), steps(1, 2, 3), in_flight={2}) == [2, 3]


def test_bases_of_kept_steps_stay_transitively():
    # 4 needs 3; 3 needs 1 (kept only because 3 is kept, itself only a base): 2 goes.
    found = steps(1, 2, 3, 4, bases={4: ["step_3"], 3: ["step_1"]})
    assert kept(Policy(keep_last=1), found) == [1, 3, 4]


def test_no_policy_keeps_everything():
    assert kept(Policy(), steps(1, 2, 3)) == [1, 2, 3]
    assert to_keep(Policy(keep_last=3), []) == set()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"keep_last": 0},
        {"keep_every_steps": -1},
        {"keep_best": 2},
        {"keep_best": 1, "metric": "loss", "mode": "lowest"},
        {"keep_last": 1.5},
        {"keep_last": True},
    ],
)
def test_bad_policies_are_refused(kwargs):
    with pytest.raises(InvalidArgumentError):
        Policy(**kwargs)


@settings(max_examples=300, deadline=None)
@given(
    numbers=st.lists(st.integers(0, 200), min_size=1, max_size=30, unique=True),
    keep_last=st.none() | st.integers(1, 5),
    every=st.none() | st.integers(1, 20),
    best=st.none() | st.integers(1, 4),
    losses=st.lists(st.floats(-10, 10), min_size=30, max_size=30),
    flight=st.lists(st.integers(0, 200), max_size=3),
    chain=st.booleans(),
)
def test_properties(numbers, keep_last, every, best, losses, flight, chain):
    ordered = sorted(numbers)
    loss = {n: losses[i] for i, n in enumerate(ordered) if i % 3}
    bases = {n: [f"step_{ordered[i - 1]}"] for i, n in enumerate(ordered) if chain and i}
    found = steps(*numbers, losses=loss, bases=bases)
    policy = Policy(keep_last, every, best, "loss" if best else None)
    in_flight = set(flight)
    left = set(kept(policy, found, in_flight))
    # The newest committed step and everything in flight stay.
    assert ordered[-1] in left
    assert {s.step for s in found if s.step in in_flight} <= left
    # Each policy's own choice stays (the union).
    if keep_last:
        assert set(ordered[-keep_last:]) <= left
    if every:
        assert {n for n in ordered if n % every == 0} <= left
    if best:
        ranked = sorted((v, -n) for n, v in loss.items())
        assert {-n for _, n in ranked[:best]} <= left
    # Every base of a step left is left too.
    by_name = {s.name: s.step for s in found}
    for s in found:
        if s.step in left:
            assert {by_name[b] for b in s.bases} <= left
    # Nothing is kept that no rule asks for.
    if not policy.keeps_everything and not chain:
        wanted = to_keep(policy, found) | in_flight
        assert left <= wanted
