"""A take never commits what a default restore refuses: values whose manifest encoding another
process could not read are either stored in a form it reads, or refused before anything is
written, naming the key (``manifest.MAX_NESTING``, ``manifest.MAX_INT_DIGITS``)."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch

import manifest as mf
from snapshot import Snapshot, StateDict
from snapshot.errors import SnapshotError, UnsupportedValueError


def nested(levels: int, leaf: Any = 1) -> dict[str, Any]:
    """A dict ``levels`` deep (the outermost counting as one) with ``leaf`` at the bottom."""
    root: dict[str, Any] = {}
    node = root
    for _ in range(levels - 1):
        node["k"] = {}
        node = node["k"]
    node["v"] = leaf
    return root


def files_under(path: str) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]


def restored(path: str, key: str = "s") -> Any:
    target = StateDict()
    Snapshot(path).restore({key: target})
    return dict(target)


def test_containers_nested_deeper_than_a_restore_rebuilds_are_refused_up_front(tmp_path):
    path = str(tmp_path / "s")
    # A tensor big enough for blobs of its own sits before the deep value: nothing is written.
    state = {"a": torch.ones(1 << 16), "deep": nested(mf.MAX_NESTING + 50)}
    with pytest.raises(UnsupportedValueError) as info:
        Snapshot.take(path, {"s": StateDict(state)})
    message = str(info.value)
    assert "0/s/deep/k" in message and str(mf.MAX_NESTING) in message
    assert message.startswith(f"snapshot {path}: ")
    assert files_under(path) == []


@pytest.mark.parametrize("container", [list, tuple])
def test_deep_lists_and_tuples_are_refused_too(tmp_path, container):
    value: Any = 1
    for _ in range(mf.MAX_NESTING + 1):
        value = container([value])
    with pytest.raises(UnsupportedValueError, match=str(mf.MAX_NESTING)):
        Snapshot.take(str(tmp_path / "s"), {"s": StateDict(v=value)})


def test_nesting_at_the_limit_is_taken_and_restored(tmp_path):
    # The state dict is level 1: its value nests MAX_NESTING - 1 levels more.
    value = nested(mf.MAX_NESTING - 1, leaf=torch.arange(3))
    path = str(tmp_path / "s")
    Snapshot.take(path, {"s": StateDict(v=value)})
    back = restored(path)["v"]
    for _ in range(mf.MAX_NESTING - 2):
        back = back["k"]
    assert torch.equal(back["v"], torch.arange(3))


def test_deep_values_inside_a_dict_stored_whole_are_not_refused(tmp_path):
    # A dict with a float key is pickled whole, not split into entries: its depth is pickle's.
    value = {1.5: nested(mf.MAX_NESTING + 10)}
    path = str(tmp_path / "s")
    Snapshot.take(path, {"s": StateDict(v=value)})
    assert restored(path)["v"] == value


def test_a_structure_that_contains_itself_is_refused_before_any_write(tmp_path):
    loop: dict[str, Any] = {"x": 1}
    loop["self"] = loop
    path = str(tmp_path / "s")
    with pytest.raises(UnsupportedValueError, match="contains itself"):
        Snapshot.take(path, {"s": StateDict(a=torch.ones(1 << 16), loop=loop)})
    assert files_under(path) == []


BIG = 7 ** 6000  # 5,071 decimal digits: over the default limit of 4,300
EDGE = 10**mf.MAX_INT_DIGITS - 1  # 4,300 nines: the largest int the manifest holds


@pytest.mark.parametrize("value", [EDGE, -EDGE], ids=["edge", "-edge"])
def test_ints_up_to_the_limit_round_trip(tmp_path, value):
    path = str(tmp_path / "s")
    Snapshot.take(path, {"s": StateDict(v=value, t=torch.ones(1 << 16))})
    assert restored(path)["v"] == value
    assert Snapshot(path).read_object("0/s/v") == value


@pytest.mark.parametrize(
    "state, where",
    [
        ({"t": torch.ones(1 << 16), "opt": {"step": BIG}}, "0/s/opt/step"),
        ({"t": torch.ones(1 << 16), "v": [1, 2, -BIG]}, "0/s/v/2"),
        ({"t": torch.ones(1 << 16), "v": {BIG: "big", 1: "one"}}, "0/s/v: a dict key"),
    ],
    ids=["value", "in-a-list", "dict-key"],
)
def test_ints_over_the_limit_are_refused_before_any_write(tmp_path, state, where):
    path = str(tmp_path / "s")
    with pytest.raises(UnsupportedValueError) as info:
        Snapshot.take(path, {"s": StateDict(state)})
    assert where in str(info.value) and str(mf.MAX_INT_DIGITS) in str(info.value)
    assert files_under(path) == []


def test_a_take_with_the_digit_limit_lifted_still_refuses_what_others_cannot_read(tmp_path):
    # With the limit lifted the manifest could be written, and another process, with the
    # default limit, would call the snapshot corrupt.
    path = str(tmp_path / "s")
    old = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        with pytest.raises(UnsupportedValueError, match="0/s/v"):
            Snapshot.take(path, {"s": StateDict(v=BIG, t=torch.ones(1 << 16))})
    finally:
        sys.set_int_max_str_digits(old)
    assert files_under(path) == []


def test_user_metadata_with_a_huge_int_is_refused(tmp_path):
    path = str(tmp_path / "s")
    with pytest.raises(SnapshotError, match="user_metadata"):
        Snapshot.take(path, {"s": StateDict(a=1)}, user_metadata={"n": BIG})
    assert files_under(path) == []


def test_what_the_decoder_does_not_bound_round_trips(tmp_path):
    # The rest of the family: no limit on a key's or string's length, floats written as their
    # repr (non-finite ones included), characters YAML cannot hold raw escaped.
    path = str(tmp_path / "s")
    value = {
        "k" * 100_000: 1,
        "\u2028\x85\x7f/%": "\ufeff",
        "floats": [float("nan"), float("inf"), float("-inf"), -0.0, 5e-324],
        "long": "x" * 1_000_000,
        "big": -(10**mf.MAX_INT_DIGITS - 1),
    }
    Snapshot.take(path, {"s": StateDict(v=value)})
    back = restored(path)["v"]
    assert back.keys() == value.keys()
    floats = back["floats"]
    assert floats[0] != floats[0] and floats[1:] == value["floats"][1:]
    assert str(floats[3]) == "-0.0"
    assert all(back[k] == value[k] for k in value if k != "floats")
