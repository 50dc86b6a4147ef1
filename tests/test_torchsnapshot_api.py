"""torchsnapshot's documented API, as this library provides it: ``restore(strict=)``,
``get_state_dict_for_key``, ``Snapshot.metadata`` as an object, torchsnapshot's module paths
(``stateful.AppState``, ``state_dict``, ``rng_state``, ``tricks.ddp``, the ``knobs``
overrides), and ``NotStatefulError`` as a ``TypeError``."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import threading
import time

import pytest
import torch
import torch.distributed as dist

import snapshot
from manifest import Manifest
from snapshot import (
    EntryNotFoundError,
    NotStatefulError,
    Options,
    Snapshot,
    SnapshotError,
    StateDict,
    StatefulError,
    StateMismatchError,
    knobs,
)
from snapshot._engine.format.manifest_io import load_manifest
from snapshot._engine.tools.inspection import list_entries
from snapshot.metadata import SnapshotMetadata
from snapshot.tricks.ddp import DDP_STATE_DICT_PREFIX, DistributedDataParallelAdapter
from snapshot.version import __version__
from tests.multirank import run_ranks


def net(seed: int, scale: bool = False) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    if scale:
        m.register_buffer("scale", torch.full((2,), 7.0))
    return m


def same_params(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


class PlainStateful:
    """A Stateful whose load_state_dict takes the state alone (no ``strict``)."""

    def __init__(self, x: int) -> None:
        self.x = x

    def state_dict(self) -> dict[str, int]:
        return {"x": self.x}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.x = state_dict["x"]


# -- restore(strict=) ------------------------------------------------------------------------


def test_restore_not_strict_leaves_app_state_keys_the_snapshot_lacks(tmp_path, caplog):
    path = str(tmp_path / "snap")
    saved = net(0)
    Snapshot.take(path, {"model": saved, "p": PlainStateful(5)})
    snap = Snapshot(path)
    extra = StateDict(step=3, t=torch.ones(2))
    with pytest.raises(
        StateMismatchError, match=rf"{re.escape(path)} has no app_state key\(s\) \['extra'\]"
    ):
        snap.restore({"model": net(1), "extra": extra})

    target, plain = net(1), PlainStateful(0)
    with caplog.at_level(logging.WARNING, logger="snapshot"):
        snap.restore({"model": target, "extra": extra, "p": plain}, strict=False)
    assert same_params(target, saved)
    assert plain.x == 5  # a Stateful without ``strict`` in its signature is called as before
    assert extra["step"] == 3 and torch.equal(extra["t"], torch.ones(2))  # left as it was
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(path in m and "'extra'" in m and "strict=False" in m for m in warned), warned

    # Nothing at all in the snapshot: nothing is read, nothing changes.
    alone = StateDict(a=1)
    snap.restore({"other": alone}, strict=False)
    assert dict(alone) == {"a": 1}


def test_restore_not_strict_passes_strict_to_modules(tmp_path):
    # torchsnapshot forwards ``strict`` to ``nn.Module.load_state_dict``: parameters and buffers
    # missing on either side pass with strict=False.
    path = str(tmp_path / "snap")
    saved = net(0)
    Snapshot.take(path, {"model": saved})
    snap = Snapshot(path)
    with pytest.raises(
        StatefulError, match=r"load_state_dict\(\) raised RuntimeError.*\s*Missing key.*scale"
    ):
        snap.restore({"model": net(1, scale=True)})
    bigger = net(1, scale=True)
    snap.restore({"model": bigger}, strict=False)
    assert torch.equal(bigger[0].weight, saved[0].weight)
    assert torch.equal(bigger[2].bias, saved[2].bias)
    assert torch.equal(bigger.scale, torch.full((2,), 7.0))  # not in the snapshot: kept

    # The other way round: the snapshot has an entry the module lacks.
    path2 = str(tmp_path / "snap2")
    with_scale = net(2, scale=True)
    Snapshot.take(path2, {"model": with_scale})
    smaller = net(3)
    with pytest.raises(StatefulError, match=r"Unexpected key.*scale"):
        Snapshot(path2).restore({"model": smaller})
    Snapshot(path2).restore({"model": smaller}, strict=False)
    assert torch.equal(smaller[0].weight, with_scale[0].weight)


# -- get_state_dict_for_key ------------------------------------------------------------------


def test_get_state_dict_for_key_reads_without_a_target(tmp_path):
    path = str(tmp_path / "snap")
    model = net(0)
    optim = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    model(torch.randn(8, 4)).sum().backward()
    optim.step()
    Snapshot.take(path, {"model": model, "optim": optim, "a/b": StateDict(n=7)})
    snap = Snapshot(path)

    sd = snap.get_state_dict_for_key("model")
    assert list(sd) == list(model.state_dict())
    assert all(torch.equal(sd[k], v) for k, v in model.state_dict().items())
    assert all(sd[k].data_ptr() != v.data_ptr() for k, v in model.state_dict().items())
    osd = snap.get_state_dict_for_key("optim")
    assert osd["param_groups"][0]["lr"] == 0.5
    assert torch.equal(
        osd["state"][0]["momentum_buffer"], optim.state_dict()["state"][0]["momentum_buffer"]
    )
    assert snap.get_state_dict_for_key("a/b") == {"n": 7}  # escaped in the manifest, found

    with pytest.raises(
        EntryNotFoundError, match=rf"{re.escape(path)} has no app_state key 'mdoel'.*'model'"
    ):
        snap.get_state_dict_for_key("mdoel")


def _state_dict_for_key(rank: int, world: int, root: str) -> tuple[int, int, int]:
    per_rank = f"{root}/per_rank"
    Snapshot.take(per_rank, {"s": StateDict(rank=rank, t=torch.full((3,), float(rank)))})
    snap = Snapshot(per_rank)
    mine = snap.get_state_dict_for_key("s")
    assert torch.equal(mine["t"], torch.full((3,), float(rank)))
    first = snap.get_state_dict_for_key("s", replicate_from_rank0=True)
    # A snapshot of rank 0 alone: rank 1 was not in it, and reads rank 0's state.
    solo = dist.new_group([0])
    if rank == 0:
        Snapshot.take(f"{root}/solo", {"s": StateDict(rank=0)}, pg=solo)
    dist.barrier()
    other = Snapshot(f"{root}/solo").get_state_dict_for_key("s")
    return mine["rank"], first["rank"], other["rank"]


@pytest.mark.slow
def test_get_state_dict_for_key_reads_each_ranks_own_state(tmp_path):
    results = run_ranks(2, _state_dict_for_key, str(tmp_path))
    assert results == [(0, 0, 0), (1, 0, 0)]
    # Outside a process group, this process is rank 0.
    assert Snapshot(str(tmp_path / "per_rank")).get_state_dict_for_key("s")["rank"] == 0


# -- Snapshot.metadata ---------------------------------------------------------------------


def test_metadata_is_a_frozen_object(tmp_path):
    path = str(tmp_path / "snap")
    t0 = time.time()
    taken = Snapshot.take(path, {"model": net(0), "s": StateDict(step=1)})
    t1 = time.time()
    md = Snapshot(path).metadata
    assert isinstance(md, SnapshotMetadata)
    assert md.version == __version__
    assert md.world_size == 1
    assert md.manifest == Snapshot(path).get_manifest() and "0/model/0.weight" in md.manifest
    assert md.torch_version == torch.__version__
    assert md.created_unix is not None and t0 - 1 <= md.created_unix <= t1 + 1
    assert md.format_version == 1
    assert md.info["library"] == f"statesnap {__version__}"
    assert md.info["strategies"] == {"sharded": ["statesnap", 1], "common": ["statesnap", 1]}
    assert taken.metadata == md  # from the bytes the take wrote, and from storage, alike
    assert "manifest=" not in repr(md)  # a repr stays short for large snapshots
    with pytest.raises(dataclasses.FrozenInstanceError):
        md.version = "9"  # type: ignore[misc]
    md.manifest.clear()  # a copy: the snapshot's own manifest is untouched
    assert "0/model/0.weight" in Snapshot(path).get_manifest()
    # The command line's listing names the same bases.
    assert list_entries(load_manifest(path, None)).bases == Snapshot(path).metadata.bases
    # A manifest that records nothing about its writer.
    bare = SnapshotMetadata.from_manifest(Manifest(world_size=3, entries={}, metadata={}))
    assert (bare.version, bare.world_size, bare.torch_version, bare.created_unix) == (
        None,
        3,
        None,
        None,
    )


# -- torchsnapshot's module paths ------------------------------------------------------------


def test_torchsnapshot_module_paths_are_aliases():
    from snapshot.rng_state import RNGState
    from snapshot.state_dict import StateDict as AliasedStateDict
    from snapshot.stateful import AppState, Stateful

    assert AliasedStateDict is snapshot.StateDict and RNGState is snapshot.RNGState
    assert Stateful is snapshot.Stateful
    assert AppState[torch.nn.Module] == dict[str, torch.nn.Module]
    assert DDP_STATE_DICT_PREFIX == "module."
    assert isinstance(DistributedDataParallelAdapter(net(0)), snapshot.Stateful)


def _ddp_adapter(rank: int, world: int, root: str) -> list[str]:
    DDP = torch.nn.parallel.DistributedDataParallel
    ddp = DDP(net(seed=rank))  # DDP starts every rank from rank 0's parameters
    assert same_params(ddp.module, net(seed=0))

    # Taken from DDP through the adapter: restores into a plain module, no adapter.
    Snapshot.take(
        f"{root}/from_ddp", {"model": DistributedDataParallelAdapter(ddp)}, replicated=["model/**"]
    )
    plain = net(seed=10)
    Snapshot(f"{root}/from_ddp").restore({"model": plain})
    assert same_params(plain, ddp.module)

    # Taken from a plain module: restores into DDP through the adapter.
    source = net(seed=20)
    Snapshot.take(f"{root}/plain", {"model": source}, replicated=["model/**"])
    target = DDP(net(seed=30))
    Snapshot(f"{root}/plain").restore({"model": DistributedDataParallelAdapter(target)})
    assert same_params(target.module, source)

    # Taken of the DDP module itself (keys "module.*"): restores into a plain module through
    # the adapter (torchsnapshot's use of it).
    Snapshot.take(f"{root}/ddp", {"model": ddp})
    plain2 = net(seed=40)
    Snapshot(f"{root}/ddp").restore({"model": DistributedDataParallelAdapter(plain2)})
    assert same_params(plain2, ddp.module)
    return sorted(p for p in Snapshot(f"{root}/from_ddp").get_manifest() if p.startswith("0/"))


class Outer(torch.nn.Module):
    """A plain module whose one child is named ``module``: every key starts with "module."."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.module = torch.nn.Linear(2, 2)


@pytest.mark.slow
def test_ddp_adapter_moves_state_between_ddp_and_plain_modules(tmp_path):
    paths = run_ranks(2, _ddp_adapter, str(tmp_path))
    assert paths[0] == paths[1]
    assert "0/model/0.weight" in paths[0]
    assert not any(DDP_STATE_DICT_PREFIX in p for p in paths[0])
    # Replicated on request: written once, listed once (under rank 0) for both ranks.
    manifest = Snapshot(str(tmp_path / "from_ddp")).get_manifest()
    assert manifest["0/model/0.weight"].replicated and "1/model/0.weight" not in manifest

    # A plain module's own "module." keys are not taken for DDP's prefix.
    path = str(tmp_path / "outer")
    Snapshot.take(path, {"m": DistributedDataParallelAdapter(Outer(0))})
    back = Outer(1)
    Snapshot(path).restore({"m": DistributedDataParallelAdapter(back)})
    assert same_params(back, Outer(0))


# -- knobs overrides -------------------------------------------------------------------------


def blobs_of(snap: Snapshot, path: str) -> list[str]:
    return [c.blob for c in snap.get_manifest()[path].chunks]


def now() -> Options:
    """The tunables a call starting now would run with (the environment and any override
    block open now)."""
    return Options.from_env()


def no_knob_env(monkeypatch) -> None:
    for name in ("CHUNK_BYTES", "SLAB_THRESHOLD_BYTES", "SLAB_BYTES", "MAX_CONCURRENT_IO"):
        monkeypatch.delenv(f"STATESNAP_{name}", raising=False)


def test_knob_overrides_change_what_a_take_writes(tmp_path, monkeypatch):
    no_knob_env(monkeypatch)
    # Through the environment: the overrides are checked against the value it sets.
    monkeypatch.setenv("STATESNAP_CHUNK_BYTES", "8000")
    big = torch.arange(4000, dtype=torch.float32)  # 16,000 bytes
    small = {f"s{i}": torch.full((16,), float(i)) for i in range(4)}

    def take(name: str) -> Snapshot:
        return Snapshot.take(str(tmp_path / name), {"s": StateDict(big=big, **small)})

    assert len(blobs_of(take("env"), "0/s/big")) == 2  # the environment's 8,000 bytes
    with knobs.override_max_chunk_size_bytes(4000):
        assert now().chunk_bytes == 4000
        snap = take("chunk")
    assert len(blobs_of(snap, "0/s/big")) == 4
    with knobs.override_max_shard_size_bytes(2000):  # the same knob here: see its docstring
        assert len(blobs_of(take("shard"), "0/s/big")) == 8
    assert now().chunk_bytes == 8000  # the environment's again

    default = take("slabs")
    assert len({blobs_of(default, f"0/s/s{i}")[0] for i in range(4)}) == 1  # one slab
    with knobs.override_slab_size_threshold_bytes(0):
        assert (now().slab_threshold_bytes, now().slab_bytes) == (0, 1)
        unslabbed = take("no_slabs")
    assert len({blobs_of(unslabbed, f"0/s/s{i}")[0] for i in range(4)}) == 4  # a blob each
    with knobs.override_slab_size_threshold_bytes(130):  # 2 members of 64 bytes per slab
        assert (now().slab_threshold_bytes, now().slab_bytes) == (130, 130)
        two_per_slab = take("small_slabs")
    assert len({blobs_of(two_per_slab, f"0/s/s{i}")[0] for i in range(4)}) == 2

    with knobs.override_max_per_rank_io_concurrency(3):
        seen: list[int] = []
        reader = threading.Thread(target=lambda: seen.append(now().max_concurrent_io))
        reader.start()
        reader.join()
        assert now().max_concurrent_io == 3 and seen == [3]  # process-wide, like the env
        out = StateDict(big=torch.zeros(4000), **{k: torch.zeros(16) for k in small})
        Snapshot(str(tmp_path / "chunk")).restore({"s": out})
        assert torch.equal(out["big"], big)
    assert now().max_concurrent_io == 16


def test_knob_overrides_nest_and_undo_only_their_own(monkeypatch):
    no_knob_env(monkeypatch)
    # Through the environment: leaving the blocks must give back the value it sets.
    monkeypatch.setenv("STATESNAP_MAX_CONCURRENT_IO", "9")
    with knobs.override_max_per_rank_io_concurrency(5):
        with knobs.override_max_per_rank_io_concurrency(2):
            assert now().max_concurrent_io == 2
        assert now().max_concurrent_io == 5
        with pytest.raises(RuntimeError), knobs.override_max_per_rank_io_concurrency(4):
            raise RuntimeError("left by an exception")
        assert now().max_concurrent_io == 5
    assert now().max_concurrent_io == 9 and os.environ["STATESNAP_MAX_CONCURRENT_IO"] == "9"

    # Blocks left out of order (two threads' blocks overlapping): each removes its own value.
    first = knobs.override_max_chunk_size_bytes(111)
    second = knobs.override_max_chunk_size_bytes(222)
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert now().chunk_bytes == 222
    second.__exit__(None, None, None)
    assert now().chunk() == 128 << 20  # the default

    with pytest.raises(ValueError, match="max_chunk_size_bytes must be an int >= 1, got 0"):
        knobs.override_max_chunk_size_bytes(0)


# -- NotStatefulError ----------------------------------------------------------------------


def test_not_stateful_error_is_a_type_error(tmp_path):
    path = str(tmp_path / "snap")
    with pytest.raises(
        TypeError, match=rf"snapshot {re.escape(path)}: app_state\['w'\] is a Tensor"
    ) as e:
        Snapshot.take(path, {"w": torch.ones(2)})
    assert isinstance(e.value, NotStatefulError) and isinstance(e.value, SnapshotError)
    Snapshot.take(path, {"s": StateDict(a=1)})
    with pytest.raises(TypeError, match=rf"snapshot {re.escape(path)}: app_state\['s'\] is a dict"):
        Snapshot(path).restore({"s": {"a": 2}})


# -- a _custom_tensor_prepare_func that quantizes ------------------------------------------


def per_tensor(path: str, t: torch.Tensor, tracing: bool) -> torch.Tensor:
    return torch.quantize_per_tensor(t.detach(), 0.02, 3, torch.qint8)


def per_channel(path: str, t: torch.Tensor, tracing: bool) -> torch.Tensor:
    t = t.detach()
    if t.dim() < 2:  # biases stay as they are
        return t
    rows = t.shape[0]
    scales = torch.linspace(0.01, 0.03, rows, dtype=torch.float64)
    return torch.quantize_per_channel(
        t, scales, torch.zeros(rows, dtype=torch.int64), 0, torch.quint8
    )


@pytest.mark.filterwarnings("ignore::UserWarning")  # quantized tensors are deprecated in torch
@pytest.mark.parametrize("prepare", [per_tensor, per_channel], ids=["per_tensor", "per_channel"])
@pytest.mark.parametrize("take", ["take", "async_take"])
def test_a_quantizing_prepare_func_stores_what_it_returns(tmp_path, prepare, take):
    model = net(0)
    path = str(tmp_path / "snap")
    if take == "take":
        snap = Snapshot.take(path, {"m": model}, _custom_tensor_prepare_func=prepare)
    else:
        snap = Snapshot.async_take(path, {"m": model}, _custom_tensor_prepare_func=prepare).wait()
    snap = Snapshot(path)
    for key, value in model.state_dict().items():
        want = prepare(key, value, False)
        got = snap.read_object(f"0/m/{key}")
        assert got.dtype == want.dtype and got.is_quantized == want.is_quantized, key
        if want.is_quantized:  # the values, scales and zero points it returned
            assert torch.equal(got.dequantize(), want.dequantize()), key
            assert torch.equal(got.int_repr(), want.int_repr()) and got.qscheme() == want.qscheme()
            entry = snap.get_manifest()[f"0/m/{key}"]
            assert (entry.type, entry.serializer, entry.obj_type) == (
                "object",
                "torch_save",
                "torch.Tensor",
            )
        else:
            assert torch.equal(got, want), key

    # Into a quantized tensor of its shape and scheme: filled in place, its scales the stored
    # ones; of another scheme: requantized to the target's (torchsnapshot's tensor_copy).
    weight = prepare("0.weight", model[0].weight, False)
    target = prepare("0.weight", torch.full((3, 4), 9.0), False)
    assert snap.read_object("0/m/0.weight", obj_out=target) is target
    assert torch.equal(target.dequantize(), weight.dequantize())
    other = per_channel if prepare is per_tensor else per_tensor
    target = other("0.weight", torch.zeros(3, 4), False)
    want = other("0.weight", weight.dequantize(), False)
    assert snap.read_object("0/m/0.weight", obj_out=target) is target
    assert (
        torch.equal(target.dequantize(), want.dequantize()) and target.qscheme() == want.qscheme()
    )

    # Into the float model it came from: refused, as torchsnapshot refuses it. The refusal
    # comes as the object is decoded (a float bias may have been read in place before it, and
    # the error says so); with verify_first, before anything is written.
    fresh = net(1)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(StateMismatchError) as info:
        snap.restore({"m": fresh}, verify_first=True)
    message = str(info.value)
    assert "0/m/0.weight" in message and "quantized" in message and "dequantize()" in message
    assert info.value.untouched == ("m",)
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())
    with pytest.raises(StateMismatchError, match=r"0/m/\d.weight: the snapshot holds a quantized"):
        snap.restore({"m": fresh})
    with pytest.raises(StateMismatchError, match="cannot receive"):
        snap.read_object("0/m/0.weight", obj_out=torch.zeros(3, 4))

    # Into a state that holds no tensors there: the quantized tensors themselves.
    state = StateDict()
    snap.restore({"m": state})
    assert torch.equal(state["0.weight"].dequantize(), weight.dequantize())


@pytest.mark.filterwarnings("ignore::UserWarning")  # quantized tensors are deprecated in torch
def test_a_prepare_func_must_quantize_alike_when_tracing_and_not(tmp_path):
    def only_when_tracing(path: str, t: torch.Tensor, tracing: bool) -> torch.Tensor:
        return per_tensor(path, t, tracing) if tracing else t.detach().half()

    with pytest.raises(
        SnapshotError,
        match=r"0/m/0.weight: .*quantized qint8\[3, 4\] tensor when "
        r"tracing but float16\[3, 4\] when preparing; both calls must agree",
    ):
        Snapshot.take(
            str(tmp_path / "s"), {"m": net(0)}, _custom_tensor_prepare_func=only_when_tracing
        )
    assert not os.path.exists(tmp_path / "s") or not os.listdir(tmp_path / "s")
