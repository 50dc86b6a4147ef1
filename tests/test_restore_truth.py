"""A failed restore tells the truth: its error names every app_state key whose live state it
wrote before the failure ("partially", or "fully" when its load_state_dict returned), and every
other key was left bit for bit as it was. ``verify_first=True`` checks the snapshot's bytes
before writing anything, so that damage leaves every key untouched.

The reads run one at a time (``max_concurrent_io=1``, ``OPTS``) with every tensor in a blob of
its own (no slabs), in the order of the app_state keys, so that which keys a failure reached
is known exactly; each test compares the live state with what it was before the restore and
with what the snapshot holds."""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch

from manifest import Location
from snapshot import (
    ChecksumError,
    CorruptSnapshotError,
    InvalidArgumentError,
    Options,
    RankFailedError,
    Snapshot,
    SnapshotError,
    StateDict,
    StatefulError,
)
from snapshot.sharding import ShardedTensor
from snapshot.strategies.default import SnapshotLoadStrategy, SnapshotSaveStrategy
from tests.helpers import assert_same
from tests.multirank import run_ranks

KEYS = ("model", "optim", "extra")
# A tensor of each key, the one damaged when that key's bytes are.
DAMAGED = {"model": "0/model/weight", "optim": "0/optim/state/0/exp_avg", "extra": "0/extra/w"}


# One read at a time, every tensor in a blob of its own: the options of every take and restore.
OPTS = Options(slab_threshold_bytes=0, max_concurrent_io=1)


def _app(seed: int) -> dict[str, Any]:
    """A model, its optimizer after one step, and a state of a tensor, an int and a long text
    (stored as an object): every value differs from one seed to another."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(32, 32)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 32)).sum().backward()
    optim.step()
    extra = StateDict(w=torch.randn(1000), step=seed, note=f"run {seed} " * 400)
    return {"model": model, "optim": optim, "extra": extra}


def _live(app: dict[str, Any]) -> dict[str, Any]:
    """A copy of each value's state as it is now."""
    return {k: copy.deepcopy(dict(v.state_dict())) for k, v in app.items()}


def _same(a: Any, b: Any) -> bool:
    try:
        assert_same(a, b)
    except AssertionError:
        return False
    return True


def _flip(path: str, logical: str) -> None:
    _flip_at(path, Snapshot(path).get_manifest()[logical].locations[0])


def _flip_at(path: str, loc: Location) -> None:
    with open(os.path.join(path, loc.blob), "r+b") as f:
        f.seek(loc.offset + loc.nbytes // 2)
        byte = f.read(1)
        f.seek(loc.offset + loc.nbytes // 2)
        f.write(bytes([byte[0] ^ 0x40]))


def _taken(tmp_path) -> tuple[str, dict[str, Any]]:
    path = str(tmp_path / "s")
    app = _app(0)
    Snapshot.take(path, app, options=OPTS)
    return path, _live(app)


def _account(modified: dict[str, str], untouched: tuple[str, ...]) -> str:
    changed = ", ".join(f"{k!r} ({how})" for k, how in modified.items()) or "none"
    left = ", ".join(map(repr, untouched)) or "none"
    return f"app_state keys modified before the failure: {changed}; untouched: {left}"


@pytest.mark.parametrize("damaged", KEYS)
def test_a_flipped_byte_names_the_keys_it_wrote(tmp_path, damaged):
    """The keys read before the damaged one, and the damaged one, were written in place (their
    tensors are the live object's own); the keys after it were never reached."""
    path, taken = _taken(tmp_path)
    _flip(path, DAMAGED[damaged])
    app = _app(1)
    before = _live(app)
    with pytest.raises(ChecksumError, match=DAMAGED[damaged]) as info:
        Snapshot(path).restore(app, options=OPTS)
    reached = KEYS[: KEYS.index(damaged) + 1]
    modified = {k: "partially" for k in reached}
    untouched = KEYS[len(reached) :]
    assert info.value.modified == modified
    assert info.value.untouched == untouched
    assert str(info.value).endswith(_account(modified, untouched))
    now = _live(app)
    for key in untouched:
        assert_same(now[key], before[key])
    for key in reached:
        assert not _same(now[key], before[key]), key
    for key in reached[:-1]:  # read whole, before the damage: the snapshot's values
        assert_same(now[key], taken[key])


@pytest.mark.parametrize("damaged", KEYS)
def test_verify_first_leaves_every_key_as_it_was(tmp_path, damaged):
    options = OPTS.replace(max_concurrent_io=4)  # any order of reads
    path, _ = _taken(tmp_path)
    _flip(path, DAMAGED[damaged])
    app = _app(1)
    before = _live(app)
    with pytest.raises(ChecksumError, match=DAMAGED[damaged]) as info:
        Snapshot(path).restore(app, verify_first=True, options=options)
    assert info.value.modified == {}
    assert info.value.untouched == KEYS
    assert str(info.value).endswith(_account({}, KEYS))
    assert_same(_live(app), before)


def test_verify_first_restores_what_a_plain_restore_does(tmp_path, recorded):
    """The same values; the tensors read in place are read twice (once to check), the object
    once."""
    url, log = recorded
    app = _app(0)
    Snapshot.take(url, app, options=OPTS)
    taken = _live(app)
    manifest = Snapshot(url).get_manifest()
    tensors = sum(e.nbytes for p, e in manifest.items() if p != "0/extra/note")
    text = manifest["0/extra/note"].nbytes
    read: dict[bool, int] = {}
    for verify_first in (False, True):
        target = _app(1)
        log.clear()
        Snapshot(url).restore(target, verify_first=verify_first, options=OPTS)
        read[verify_first] = log.bytes_read
        assert_same(_live(target), taken)
    manifest_bytes = os.path.getsize(
        os.path.join(url.removeprefix("recording://"), "manifest.yaml")
    )
    assert read[False] == manifest_bytes + tensors + text
    assert read[True] == manifest_bytes + 2 * tensors + text


def test_verify_first_checks_with_checksums_off(tmp_path):
    path, _ = _taken(tmp_path)
    _flip(path, "0/extra/w")
    off = OPTS.replace(checksums=False)
    app = _app(1)
    before = _live(app)
    with pytest.raises(ChecksumError, match="0/extra/w") as info:
        Snapshot(path).restore(app, verify_first=True, options=off)
    assert info.value.untouched == KEYS
    assert_same(_live(app), before)
    Snapshot(path).restore(app, options=off)  # unchecked: the damaged bytes are restored
    assert not _same(_live(app)["extra"], before["extra"])


def test_verify_first_through_a_cast_and_a_new_tensor(tmp_path):
    """Targets filled through scratch tiles (another dtype) and values read into new tensors
    are checked before anything is written too."""
    path, _ = _taken(tmp_path)
    _flip(path, "0/extra/w")
    app = _app(1)
    app["model"] = app["model"].double()
    app["optim"] = StateDict()  # its state comes back as new tensors
    before = _live(app)
    with pytest.raises(ChecksumError) as info:
        Snapshot(path).restore(app, verify_first=True, options=OPTS)
    assert info.value.untouched == KEYS
    assert_same(_live(app), before)


def test_reads_into_new_tensors_leave_a_key_untouched(tmp_path):
    """Bytes read into tensors the restore made itself reach the value only through its
    load_state_dict, which a failed read never calls; bytes read into the value's own tensors
    modify it."""
    path, _ = _taken(tmp_path)
    _flip(path, "0/extra/w")
    empty = StateDict()
    with pytest.raises(ChecksumError) as info:
        Snapshot(path).restore({"extra": empty}, options=OPTS)
    assert (info.value.modified, info.value.untouched) == ({}, ("extra",))
    assert dict(empty) == {}
    own = StateDict(w=torch.zeros(1000), step=-1, note="")
    with pytest.raises(ChecksumError) as info:
        Snapshot(path).restore({"extra": own}, options=OPTS)
    assert (info.value.modified, info.value.untouched) == ({"extra": "partially"}, ())
    assert not torch.equal(own["w"], torch.zeros(1000))
    assert (own["step"], own["note"]) == (-1, "")


class _Refuses(StateDict):
    """Takes no state back."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise ValueError("not now")


def test_load_state_dict_failing_names_the_keys_before_it(tmp_path):
    path = str(tmp_path / "s")
    Snapshot.take(
        path,
        {
            "a": StateDict(w=torch.ones(10)),
            "b": StateDict(n=1, text="x"),
            "c": StateDict(w=torch.ones(10)),
            "d": StateDict(n=1),
        },
        options=OPTS,
    )
    app = {
        "a": StateDict(w=torch.zeros(10)),
        "b": _Refuses(n=0, text=""),
        "c": StateDict(w=torch.zeros(10)),
        "d": StateDict(n=0),
    }
    with pytest.raises(
        StatefulError, match=r"app_state\['b'\]\.load_state_dict\(\) raised"
    ) as info:
        Snapshot(path).restore(app, options=OPTS)
    # a: restored; b: its load_state_dict ran (and raised); c: its tensor was read in place,
    # its load_state_dict never called; d: nothing of it read, nothing called.
    modified = {"a": "fully", "b": "partially", "c": "partially"}
    assert (info.value.modified, info.value.untouched) == (modified, ("d",))
    assert str(info.value).endswith(_account(modified, ("d",)))
    assert torch.equal(app["a"]["w"], torch.ones(10))
    assert torch.equal(app["c"]["w"], torch.ones(10))
    assert dict(app["d"]) == {"n": 0}


def test_a_missing_blob(tmp_path):
    """The first key's read fails at once: it is named as modified (its read had begun), the
    other keys are untouched; checked first, every key is."""
    path, _ = _taken(tmp_path)
    os.remove(os.path.join(path, Snapshot(path).get_manifest()["0/model/weight"].chunks[0].blob))
    app = _app(1)
    before = _live(app)
    with pytest.raises(CorruptSnapshotError, match="0/model/weight.* is missing") as info:
        Snapshot(path).restore(app, options=OPTS)
    assert (info.value.modified, info.value.untouched) == ({"model": "partially"}, KEYS[1:])
    now = _live(app)
    for key in KEYS[1:]:
        assert_same(now[key], before[key])
    app = _app(1)
    with pytest.raises(CorruptSnapshotError, match="0/model/weight.* is missing") as info:
        Snapshot(path).restore(app, verify_first=True, options=OPTS)
    assert (info.value.modified, info.value.untouched) == ({}, KEYS)
    assert_same(_live(app), before)


def test_a_key_left_out_by_strict_false_is_untouched(tmp_path):
    path, _ = _taken(tmp_path)
    _flip(path, "0/model/weight")
    app = {"model": torch.nn.Linear(32, 32), "sched": StateDict(lr=0.5)}
    with pytest.raises(ChecksumError) as info:
        Snapshot(path).restore(app, strict=False, options=OPTS)
    assert (info.value.modified, info.value.untouched) == ({"model": "partially"}, ("sched",))


def test_a_tensor_shared_by_two_keys_is_written_through_either(tmp_path):
    """ "ema" holds the model's weight itself, and the snapshot other values for the two: the
    two are read apart and copied into the shared memory only once every read is done
    (test_restore_targets.py), so a damaged range of either leaves that memory as it was."""
    path = str(tmp_path / "s")
    torch.manual_seed(0)
    Snapshot.take(
        path,
        {
            "ema": StateDict(w=torch.randn(32, 32)),
            "model": torch.nn.Linear(32, 32),
            "other": StateDict(w=torch.randn(10)),
        },
        options=OPTS,
    )
    _flip(path, "0/ema/w")
    model = torch.nn.Linear(32, 32)
    weight = model.weight.detach().clone()
    other = StateDict(w=torch.zeros(10))
    with pytest.raises(ChecksumError) as info:
        Snapshot(path).restore(
            {"ema": StateDict(w=model.weight), "model": model, "other": other}, options=OPTS
        )
    assert info.value.modified.get("model") == "partially"  # its bias is read in place
    assert torch.equal(model.weight, weight)


class _Stop(BaseException):
    """Not an Exception: passes through the library's handlers."""


class _Stops(StateDict):
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise _Stop


def test_an_exception_of_another_kind_carries_the_account_as_a_note(tmp_path):
    path, _ = _taken(tmp_path)
    app = _app(1)
    app["extra"] = _Stops(dict(app["extra"]))
    with pytest.raises(_Stop) as info:
        Snapshot(path).restore(app, options=OPTS)
    assert info.value.__notes__ == [
        _account({"model": "fully", "optim": "fully", "extra": "partially"}, ())
    ]


def test_verify_first_is_a_bool(tmp_path):
    path, _ = _taken(tmp_path)
    with pytest.raises(InvalidArgumentError, match="verify_first"):
        Snapshot(path).restore(_app(1), verify_first="yes", options=OPTS)  # type: ignore[arg-type]


def test_other_errors_carry_no_account():
    assert SnapshotError("x").modified is None
    assert SnapshotError("x").untouched is None
    assert str(SnapshotError("x")) == "x"


def test_the_strategy_api_checks_first_too(tmp_path, monkeypatch):
    # The strategy API takes no options: the file's options through the environment.
    monkeypatch.setenv("STATESNAP_SLAB_THRESHOLD_BYTES", "0")
    monkeypatch.setenv("STATESNAP_MAX_CONCURRENT_IO", "1")
    path = str(tmp_path / "ckpt")
    SnapshotSaveStrategy().save({"w": torch.ones(100), "n": 3}, path)
    _flip(path, "0/state/w")
    state = {"w": torch.zeros(100), "n": 0}
    with pytest.raises(ChecksumError) as info:
        SnapshotLoadStrategy().load(state, path, verify_first=True)
    assert info.value.untouched == ("state",)
    assert torch.equal(state["w"], torch.zeros(100))


def test_verify_first_checks_the_shards_a_sharded_target_reads(tmp_path):
    """Pieces of one global tensor under two keys; a target of rows 0-7 reads the first key's
    shard only, so damage in the other's is not read (and not checked); a target of a column
    block reads part of every shard, and each of them is checked whole first."""
    g = torch.arange(16 * 12, dtype=torch.float32).reshape(16, 12)
    path = str(tmp_path / "s")
    Snapshot.take(
        path,
        {
            "m": StateDict(w=ShardedTensor.from_rank_offsets("w", g[:8].clone(), (0, 0, 2))),
            "n": StateDict(w=ShardedTensor.from_rank_offsets("w", g[8:].clone(), (0, 1, 2))),
        },
        options=OPTS,
    )
    second = next(s for s in Snapshot(path).get_manifest()["0/n/w"].shards if s.offsets[0] == 8)
    _flip_at(path, second.chunks[0])
    rows = ShardedTensor.from_rank_offsets("w", torch.zeros(8, 12), (0, 0, 2))
    Snapshot(path).restore({"m": StateDict(w=rows)}, verify_first=True, options=OPTS)
    assert torch.equal(rows.data, g[:8])
    columns = torch.zeros(6, 16).t()  # not contiguous: through scratch
    cols = ShardedTensor.from_rank_offsets("w", columns, (1, 0, 2))
    with pytest.raises(ChecksumError, match="0/m/w") as info:
        Snapshot(path).restore({"m": StateDict(w=cols)}, verify_first=True, options=OPTS)
    assert info.value.untouched == ("m",)
    assert torch.equal(columns, torch.zeros(16, 6))


# ---------------------------------------------------------------------------------------------
# Two ranks.


def _rank_app(rank: int, seed: int, refuses: bool = False) -> dict[str, Any]:
    torch.manual_seed(seed * 10 + rank)  # a value of each rank's own: stored per rank
    extra = (_Refuses if refuses else StateDict)(w=torch.randn(100))
    return {"model": torch.nn.Linear(16, 16), "extra": extra}


def _outcome(app: dict[str, Any], **arguments: Any) -> dict[str, Any]:
    before = _live(app)
    try:
        Snapshot(_outcome.path).restore(app, options=OPTS, **arguments)  # type: ignore[attr-defined]
    except RankFailedError as e:
        now = _live(app)
        return {
            "modified": e.modified,
            "untouched": e.untouched,
            "message": str(e),
            "unchanged": [k for k in app if _same(now[k], before[k])],
        }
    return {"error": None}


def _two_ranks(rank: int, world_size: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist

    path = _outcome.path = os.path.join(root, "s")  # type: ignore[attr-defined]
    Snapshot.take(path, _rank_app(rank, 0), options=OPTS)
    if rank == 0:
        _flip(path, "1/model/weight")
    dist.barrier()
    out = {
        "plain": _outcome(_rank_app(rank, 1)),
        "verify_first": _outcome(_rank_app(rank, 1), verify_first=True),
        "mixed": _outcome(_rank_app(rank, 1), verify_first=rank == 0),
    }
    dist.barrier()
    if rank == 0:
        _flip(path, "1/model/weight")  # back as it was
    dist.barrier()
    out["load"] = _outcome(_rank_app(rank, 1, refuses=rank == 1))
    return out


@pytest.mark.slow
def test_two_ranks_each_name_their_own_keys(tmp_path):
    rank0, rank1 = run_ranks(2, _two_ranks, str(tmp_path))
    # Rank 1's blob is damaged: rank 0 read all of its own state in place, rank 1 reached its
    # first key only.
    assert (rank0["plain"]["modified"], rank0["plain"]["untouched"]) == (
        {"model": "partially", "extra": "partially"},
        (),
    )
    assert (rank1["plain"]["modified"], rank1["plain"]["untouched"]) == (
        {"model": "partially"},
        ("extra",),
    )
    assert rank1["plain"]["unchanged"] == ["extra"]
    assert "ChecksumError" in rank0["plain"]["message"]
    assert rank1["plain"]["message"].endswith(
        "app_state keys modified on rank 1 before the failure: 'model' (partially); "
        "untouched: 'extra'"
    )
    # Checked first: no rank wrote anything, though only rank 1's bytes were damaged.
    for rank in (rank0, rank1):
        assert (rank["verify_first"]["modified"], rank["verify_first"]["untouched"]) == (
            {},
            ("model", "extra"),
        )
        assert rank["verify_first"]["unchanged"] == ["model", "extra"]
        assert "InvalidArgumentError" in rank["mixed"]["message"]
        assert rank["mixed"]["unchanged"] == ["model", "extra"]
    # Rank 1's load_state_dict of "extra" raised: rank 0 restored everything.
    assert rank0["load"]["modified"] == {"model": "fully", "extra": "fully"}
    assert rank1["load"]["modified"] == {"model": "fully", "extra": "partially"}
    assert "StatefulError" in rank0["load"]["message"]
