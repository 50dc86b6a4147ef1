"""Incremental takes (``Snapshot.take(..., base=...)``): unchanged tensors point at the base's
bytes, changed ones are written, and every reader follows the references, checked."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import uuid

import pytest
import torch

import manifest as mf
from snapshot import (
    CorruptSnapshotError,
    InvalidArgumentError,
    MissingBaseError,
    Options,
    Snapshot,
    StateDict,
)
from snapshot._engine.take.commit import MANIFEST_NAME
from snapshot.errors import SnapshotError
from tests.helpers import open_decoded
from tests.multirank import run_ranks
from tests.s3server import S3Bucket

DIGESTS = Options(digests=True)


def frozen_state(seed: int = 0) -> dict:
    """A model whose first layers stay frozen while the head trains, plus an optimizer-like
    StateDict of small tensors, a Python value and an RNG-free step counter."""
    g = torch.Generator().manual_seed(seed)
    backbone = {f"layer{i}": torch.randn(256, 256, generator=g) for i in range(4)}
    head = {"w": torch.randn(64, 256, generator=g), "b": torch.zeros(64)}
    return {
        "backbone": StateDict(**backbone),
        "head": StateDict(**head),
        "extra": StateDict(
            step=0, small=torch.arange(7), half=torch.ones(33, dtype=torch.bfloat16)
        ),
    }


def train(state: dict, step: int) -> None:
    """Changes the head and the step, leaves the backbone's bytes as they are."""
    state["head"]["w"].add_(0.5)
    state["head"]["b"][step % 64] += 1
    state["extra"]["step"] = step


def empty_like(state: dict) -> dict:
    return {
        k: StateDict(
            **{
                n: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None
                for n, v in sd.items()
            }
        )
        for k, sd in state.items()
    }


def assert_same(a: dict, b: dict) -> None:
    for key in a:
        assert a[key].keys() == b[key].keys(), key
        for name, v in a[key].items():
            w = b[key][name]
            if isinstance(v, torch.Tensor):
                assert v.dtype == w.dtype and v.shape == w.shape, (key, name)
                assert torch.equal(v.view(torch.uint8), w.view(torch.uint8)), (key, name)
            else:
                assert v == w, (key, name)


def own_bytes(path: str) -> int:
    """Bytes of the blobs a local snapshot holds itself (its manifest aside)."""
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files if f != MANIFEST_NAME)
    return total


def clone(state: dict) -> dict:
    return {
        k: StateDict(**{n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in sd.items()})
        for k, sd in state.items()
    }


def restored(path: str, like: dict, **kw) -> dict:
    out = empty_like(like)
    Snapshot(path, **kw).restore(out)
    return out


# -- the basics ---------------------------------------------------------------------------------


def test_unchanged_tensors_are_not_written_again(tmp_path):
    state = frozen_state()
    first = Snapshot.take(str(tmp_path / "s1"), state, options=DIGESTS)
    assert first.metadata.bases == ()
    full = own_bytes(str(tmp_path / "s1"))
    train(state, 1)
    want = clone(state)
    second = Snapshot.take(str(tmp_path / "s2"), state, base=first)
    assert second.metadata.bases == ("s1",)
    assert second.metadata.format_version == mf.INCREMENTAL_VERSION
    # What changed is the head (64 x 256 + 64 floats): the backbone's 1 MiB is not rewritten.
    head_bytes = (64 * 256 + 64) * 4
    assert own_bytes(str(tmp_path / "s2")) <= head_bytes + 4096
    assert full > 10 * head_bytes
    entries = second.get_manifest()
    assert entries["0/backbone/layer0"].chunks[0].blob.startswith("../s1/")
    assert not entries["0/head/w"].chunks[0].blob.startswith("../")
    assert_same(restored(str(tmp_path / "s2"), state), want)


def test_a_take_without_base_or_digests_stays_at_its_old_format(tmp_path):
    snap = Snapshot.take(str(tmp_path / "s"), frozen_state())
    assert snap.metadata.format_version < mf.INCREMENTAL_VERSION
    assert all(
        e.digest is None for e in snap.get_manifest().values() if isinstance(e, mf.TensorEntry)
    )


def test_a_single_changed_bit_is_seen(tmp_path):
    state = frozen_state()
    first = Snapshot.take(str(tmp_path / "s1"), state, options=DIGESTS)
    gen = torch.Generator().manual_seed(1)
    for trial in range(20):
        t = state["backbone"][f"layer{trial % 4}"]
        raw = t.view(torch.uint8).view(-1)
        at = int(torch.randint(raw.numel(), (1,), generator=gen))
        bit = 1 << int(torch.randint(8, (1,), generator=gen))
        raw[at] ^= bit
        path = str(tmp_path / f"t{trial}")
        Snapshot.take(path, state, base=first)
        back = restored(path, state)
        assert torch.equal(
            back["backbone"][f"layer{trial % 4}"].view(torch.uint8), t.view(torch.uint8)
        )
        raw[at] ^= bit  # back as in the base
        entry = Snapshot(path).get_manifest()[f"0/backbone/layer{trial % 4}"]
        assert not entry.chunks[0].blob.startswith("../")


def test_same_bytes_in_another_shape_or_dtype_are_written(tmp_path):
    t = torch.arange(64, dtype=torch.float32)
    Snapshot.take(str(tmp_path / "s1"), {"s": StateDict(t=t)}, options=DIGESTS)
    for other in (t.view(8, 8), t.view(torch.int32)):
        path = str(tmp_path / f"s_{other.dtype}_{other.dim()}")
        Snapshot.take(path, {"s": StateDict(t=other)}, base=str(tmp_path / "s1"))
        entry = Snapshot(path).get_manifest()["0/s/t"]
        assert not entry.chunks[0].blob.startswith("../")
        back = Snapshot(path).read_object("0/s/t")
        assert back.dtype == other.dtype and back.shape == other.shape
        assert torch.equal(back, other)


def test_a_base_without_digests_reuses_nothing_but_starts_the_chain(tmp_path):
    state = frozen_state()
    Snapshot.take(str(tmp_path / "s1"), state)
    second = Snapshot.take(str(tmp_path / "s2"), state, base=str(tmp_path / "s1"))
    assert second.metadata.bases == ()
    third = Snapshot.take(str(tmp_path / "s3"), state, base=second)
    assert third.metadata.bases == ("s2",)
    assert own_bytes(str(tmp_path / "s3")) < 4096


def test_parameters_keep_their_kind_and_grad_flag(tmp_path):
    weight = torch.nn.Parameter(torch.randn(16, 32))
    state = {"s": StateDict(weight=weight)}
    Snapshot.take(str(tmp_path / "s1"), state, options=DIGESTS)
    Snapshot.take(str(tmp_path / "s2"), state, base=str(tmp_path / "s1"))
    entry = Snapshot(str(tmp_path / "s2")).get_manifest()["0/s/weight"]
    assert entry.chunks[0].blob.startswith("../s1/")
    assert entry.parameter and entry.requires_grad
    back = Snapshot(str(tmp_path / "s2")).read_object("0/s/weight")
    assert isinstance(back, torch.nn.Parameter) and torch.equal(back, weight)


def test_tied_weights_stay_tied(tmp_path):
    shared = torch.randn(100)
    state = {"s": StateDict(a=shared, b=shared, c=torch.ones(3))}
    Snapshot.take(str(tmp_path / "s1"), state, options=DIGESTS)
    state["s"]["c"] = torch.zeros(3)
    Snapshot.take(str(tmp_path / "s2"), state, base=str(tmp_path / "s1"))
    back = Snapshot(str(tmp_path / "s2")).read_object("0/s")
    assert torch.equal(back["a"], shared) and back["a"].data_ptr() == back["b"].data_ptr()
    assert torch.equal(back["c"], torch.zeros(3))


def test_user_metadata_is_kept_and_checked(tmp_path):
    meta = {"step": 7, "metrics": {"loss": 0.25, "acc": 1}, "tags": ["a", None, True]}
    snap = Snapshot.take(str(tmp_path / "s"), frozen_state(), user_metadata=meta)
    assert snap.metadata.user == meta
    assert Snapshot(str(tmp_path / "s")).metadata.user == meta
    assert Snapshot.take(str(tmp_path / "n"), frozen_state()).metadata.user is None
    for bad in ({"x": float("nan")}, {1: 2}, {"x": object()}, [1]):
        with pytest.raises(InvalidArgumentError, match="user_metadata"):
            Snapshot.take(str(tmp_path / "bad"), frozen_state(), user_metadata=bad)
    assert not (tmp_path / "bad").exists()


# -- chains and missing bases ------------------------------------------------------------------


def test_a_chain_points_at_the_holders_and_survives_deleting_the_rest(tmp_path):
    state = frozen_state()
    paths = [str(tmp_path / f"step_{i}") for i in range(5)]
    wants = []
    Snapshot.take(paths[0], state, options=DIGESTS)
    wants.append(clone(state))
    for i in range(1, 5):
        train(state, i)
        if i == 2:
            state["backbone"]["layer3"].mul_(2)  # a frozen layer changes once
        Snapshot.take(paths[i], state, base=paths[i - 1])
        wants.append(clone(state))
    last = Snapshot(paths[4])
    # The backbone's unchanged layers live in step_0, layer3 in step_2: never one hop more.
    assert last.metadata.bases == ("step_0", "step_2")
    for i in range(5):
        assert_same(restored(paths[i], state), wants[i])
    # step_1 and step_3 hold nothing the last one reads: deleting them changes nothing.
    import shutil

    shutil.rmtree(paths[1])
    shutil.rmtree(paths[3])
    assert_same(restored(paths[4], state), wants[4])
    shutil.rmtree(paths[2])
    with pytest.raises(MissingBaseError, match="step_2") as caught:
        restored(paths[4], state)
    assert caught.value.base.endswith("step_2")
    for call in (lambda: last.read_object("0/backbone/layer3"),):
        with pytest.raises(MissingBaseError):
            call()
    # The snapshot is incomplete without its base: no read of it starts, even of an entry
    # whose bytes it holds itself.
    with pytest.raises(MissingBaseError):
        Snapshot(paths[4]).read_object("0/head/w")


def test_a_base_that_never_committed_is_refused_at_take(tmp_path):
    with pytest.raises(MissingBaseError, match="cannot take"):
        Snapshot.take(str(tmp_path / "s2"), frozen_state(), base=str(tmp_path / "nothing"))
    assert not (tmp_path / "s2").exists() or not os.listdir(tmp_path / "s2")


def test_a_base_elsewhere_is_refused(tmp_path):
    Snapshot.take(str(tmp_path / "a" / "s1"), frozen_state(), options=DIGESTS)
    with pytest.raises(InvalidArgumentError, match="same folder"):
        Snapshot.take(str(tmp_path / "b" / "s2"), frozen_state(), base=str(tmp_path / "a" / "s1"))
    with pytest.raises(InvalidArgumentError, match="own base"):
        Snapshot.take(str(tmp_path / "a" / "s1"), frozen_state(), base=str(tmp_path / "a" / "s1"))
    assert not (tmp_path / "b" / "s2").exists()


# -- a manifest is untrusted --------------------------------------------------------------------


def rewrite(path: str, change, version: int = mf.INCREMENTAL_VERSION) -> None:
    """Rewrites a local snapshot's manifest with ``change(entry) -> entry`` applied to every
    tensor entry, saying format ``version`` (the checksum line made anew: what a crafted
    snapshot would hold)."""
    file = os.path.join(path, MANIFEST_NAME)
    with open(file, "rb") as f:
        m = mf.loads(f.read())
    entries = {p: change(e) if isinstance(e, mf.TensorEntry) else e for p, e in m.entries.items()}
    with open(file, "wb") as f:
        f.write(mf.dumps(dataclasses.replace(m, entries=entries, format_version=version)))


def point_at(blob: str):
    def change(e: mf.TensorEntry) -> mf.TensorEntry:
        chunks = tuple(dataclasses.replace(c, blob=blob) for c in e.chunks)
        return dataclasses.replace(e, chunks=chunks)

    return change


def test_a_reference_to_a_folder_that_is_no_snapshot_reads_nothing(tmp_path):
    (tmp_path / "secrets" / "0").mkdir(parents=True)
    (tmp_path / "secrets" / "0" / "0").write_bytes(b"x" * 4096)
    state = {"s": StateDict(t=torch.ones(16))}
    Snapshot.take(str(tmp_path / "s"), state)
    rewrite(str(tmp_path / "s"), point_at("../secrets/0/0"))
    with pytest.raises(MissingBaseError, match="secrets"):
        Snapshot(str(tmp_path / "s")).read_object("0/s/t")


def test_a_reference_outside_what_the_base_records_is_refused(tmp_path):
    state = {"s": StateDict(t=torch.ones(16))}
    Snapshot.take(str(tmp_path / "base"), {"s": StateDict(t=torch.ones(8))})
    # A blob the base has no entry for (a file planted in its folder), and a range past the
    # end of what its manifest records in a blob it has.
    (tmp_path / "base" / "0" / "planted").write_bytes(b"y" * 64)
    for blob in ("../base/0/planted", "../base/" + _first_blob(str(tmp_path / "base"))):
        target = str(tmp_path / f"s{len(blob)}")
        Snapshot.take(target, state)
        rewrite(target, point_at(blob))
        with pytest.raises(CorruptSnapshotError, match="base"):
            Snapshot(target).read_object("0/s/t")


def _first_blob(path: str) -> str:
    m = Snapshot(path).get_manifest()
    return next(e.chunks[0].blob for e in m.values() if isinstance(e, mf.TensorEntry))


@pytest.mark.parametrize(
    "blob", ["../../etc/0/0", "../s1/../s2/0", "../.hidden/0/0", "..//0/0", "../s1/../../x"]
)
def test_references_that_leave_the_parent_are_refused_when_decoding(tmp_path, blob):
    Snapshot.take(str(tmp_path / "s"), {"s": StateDict(t=torch.ones(4))})
    rewrite(str(tmp_path / "s"), point_at(blob))
    with pytest.raises(SnapshotError, match="unsafe"):
        Snapshot(str(tmp_path / "s")).read_object("0/s/t")


def test_a_reference_in_a_manifest_older_than_version_5_is_unsafe(tmp_path):
    Snapshot.take(str(tmp_path / "base"), {"s": StateDict(t=torch.ones(4))}, options=DIGESTS)
    Snapshot.take(str(tmp_path / "s"), {"s": StateDict(t=torch.ones(4))})
    blob = "../base/" + _first_blob(str(tmp_path / "base"))
    rewrite(str(tmp_path / "s"), point_at(blob), version=mf.TENSOR_ATTRS_VERSION)
    with pytest.raises(SnapshotError, match="unsafe blob path"):
        open_decoded(str(tmp_path / "s"))


def test_the_local_plugin_refuses_dot_dot_itself(tmp_path):
    from snapshot._engine.runtime import run
    from storage_plugins import UnsafeBlobError
    from storage_plugins.fs import FSStoragePlugin

    (tmp_path / "outside").write_bytes(b"z")
    (tmp_path / "root").mkdir()
    plugin = FSStoragePlugin(str(tmp_path / "root"))
    with pytest.raises(UnsafeBlobError):
        run(plugin.read("../outside"))
    run(plugin.close())


def test_a_damaged_base_byte_fails_the_checksum(tmp_path):
    state = frozen_state()
    Snapshot.take(str(tmp_path / "s1"), state, options=DIGESTS)
    Snapshot.take(str(tmp_path / "s2"), state, base=str(tmp_path / "s1"))
    blob = _first_blob(str(tmp_path / "s1"))
    with open(tmp_path / "s1" / blob, "r+b") as f:
        f.seek(10)
        byte = f.read(1)
        f.seek(10)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(CorruptSnapshotError):
        restored(str(tmp_path / "s2"), state)


# -- readers: read_object, ls / du / verify, async ---------------------------------------------


@pytest.mark.slow  # real processes
def test_the_command_line_follows_references(tmp_path):
    state = frozen_state()
    Snapshot.take(str(tmp_path / "s1"), state, options=DIGESTS)
    train(state, 1)
    Snapshot.take(str(tmp_path / "s2"), state, base=str(tmp_path / "s1"))

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "snapshot", *args], capture_output=True, text=True
        )

    ls = cli("ls", str(tmp_path / "s2"))
    assert ls.returncode == 0, ls.stderr
    assert "IN BASE" in ls.stdout
    layer = next(line for line in ls.stdout.splitlines() if "backbone/layer0" in line)
    head = next(line for line in ls.stdout.splitlines() if "head/w" in line)
    assert layer.rstrip().endswith("s1") and not head.rstrip().endswith("s1")
    du = cli("du", str(tmp_path / "s2"))
    assert "in base snapshots (s1)" in du.stdout
    verify = cli("verify", str(tmp_path / "s2"))
    assert verify.returncode == 0 and "OK" in verify.stdout, verify.stdout + verify.stderr
    # A damaged byte of the base fails the verify of the snapshot that reuses it.
    blob = _first_blob(str(tmp_path / "s1"))
    with open(tmp_path / "s1" / blob, "r+b") as f:
        f.write(b"\xff\xff")
    assert cli("verify", str(tmp_path / "s2")).returncode != 0


def test_async_take_on_a_base_captures_before_returning(tmp_path):
    state = frozen_state()
    Snapshot.take(str(tmp_path / "s1"), state, options=DIGESTS)
    train(state, 1)
    want = clone(state)
    pending = Snapshot.async_take(str(tmp_path / "s2"), state, base=str(tmp_path / "s1"))
    for sd in state.values():  # mutate at once, frozen layers too
        for v in sd.values():
            if isinstance(v, torch.Tensor):
                v.fill_(3)
    snap = pending.wait()
    assert snap.metadata.bases == ("s1",)
    assert_same(restored(str(tmp_path / "s2"), want), want)


def test_memory_store():
    parent = f"memory://{uuid.uuid4().hex}"
    state = frozen_state()
    Snapshot.take(f"{parent}/s1", state, options=DIGESTS)
    train(state, 1)
    want = clone(state)
    snap = Snapshot.take(f"{parent}/s2", state, base=f"{parent}/s1")
    assert snap.metadata.bases == ("s1",)
    assert_same(restored(f"{parent}/s2", state), want)


@pytest.mark.slow
def test_s3(s3_bucket: S3Bucket):
    opts = s3_bucket.storage_options
    state = frozen_state()
    Snapshot.take(s3_bucket.url("run/s1"), state, storage_options=opts, options=DIGESTS)
    train(state, 1)
    want = clone(state)
    before = len(s3_bucket.log())
    snap = Snapshot.take(
        s3_bucket.url("run/s2"), state, storage_options=opts, base=s3_bucket.url("run/s1")
    )
    uploaded = sum(r.bytes_in for r in s3_bucket.log()[before:] if r.method in ("PUT", "POST"))
    assert uploaded < 200_000  # the head and the manifest, not the 1 MiB backbone
    assert snap.metadata.bases == ("s1",)
    assert_same(restored(s3_bucket.url("run/s2"), state, storage_options=opts), want)


# -- across ranks --------------------------------------------------------------------------------


def _two_ranks(rank: int, world_size: int, root: str) -> list[str]:
    torch.manual_seed(0)
    model = torch.nn.Linear(128, 128)  # the same on both ranks: replicated, written once
    own = StateDict(x=torch.full((1000,), float(rank)), y=torch.full((10,), float(rank)))
    state = {"model": model, "own": own}
    Snapshot.take(f"{root}/s1", state, options=DIGESTS)
    own["y"].add_(1)
    snap = Snapshot.take(f"{root}/s2", state, base=f"{root}/s1")
    model2 = torch.nn.Linear(128, 128)
    own2 = StateDict(x=torch.zeros(1000), y=torch.zeros(10))
    Snapshot(f"{root}/s2").restore({"model": model2, "own": own2})
    assert torch.equal(model2.weight, model.weight) and torch.equal(model2.bias, model.bias)
    assert torch.equal(own2["x"], own["x"]) and torch.equal(own2["y"], own["y"])
    m = snap.get_manifest()
    return [m[f"{rank}/own/x"].chunks[0].blob, m[f"{rank}/own/y"].chunks[0].blob]


@pytest.mark.slow  # real processes
def test_two_ranks(tmp_path):
    blobs = run_ranks(2, _two_ranks, str(tmp_path))
    for x_blob, y_blob in blobs:
        assert x_blob.startswith("../s1/") and not y_blob.startswith("../")
    m = Snapshot(str(tmp_path / "s2")).get_manifest()
    assert m["0/model/weight"].chunks[0].blob.startswith("../s1/")


def test_a_base_without_digests_is_warned_of_naming_the_fix(tmp_path, caplog):
    """Digests stay off by default (they cost a take of many small tensors several times its
    time: benchmarks/results/2026-12-06-digests-default.md); an increment on a base without
    them writes everything, and says so at WARNING, with the option that fixes it."""
    state = frozen_state()
    Snapshot.take(str(tmp_path / "s1"), state)
    with caplog.at_level("WARNING", logger="snapshot"):
        Snapshot.take(str(tmp_path / "s2"), state, base=str(tmp_path / "s1"))
    warned = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]
    message = warned[0].getMessage()
    assert "s1" in message and "Options(digests=True)" in message
    assert own_bytes(str(tmp_path / "s2")) > 4 * 256 * 256 * 4  # written in full
    caplog.clear()
    Snapshot.take(str(tmp_path / "s3"), state, options=DIGESTS)
    with caplog.at_level("WARNING", logger="snapshot"):
        Snapshot.take(str(tmp_path / "s4"), state, base=str(tmp_path / "s3"))
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    assert own_bytes(str(tmp_path / "s4")) < 4096
