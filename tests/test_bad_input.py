"""Bad arguments, values the engine cannot store as they are, restore targets that cannot
receive a value, and takes that stop half-way: each refused with a precise SnapshotError before
anything is written (or read), or handled, and nothing left running."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from snapshot import (
    EntryNotFoundError,
    InvalidArgumentError,
    NotStatefulError,
    PathMismatchWarning,
    ShapeMismatchError,
    Snapshot,
    SnapshotError,
    SnapshotNotFoundError,
    StateDict,
    StateMismatchError,
    UnsupportedValueError,
)
from snapshot.knobs import override_max_chunk_size_bytes
from snapshot.strategies.default import (
    SnapshotLoadStrategy,
    SnapshotSaveCommonStrategy,
    SnapshotSaveStrategy,
)
from tests.multirank import run_ranks

REPO = Path(__file__).resolve().parent.parent


def files_under(path: Path | str) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs
    )


def small_state() -> dict[str, StateDict]:
    return {"a": StateDict(x=torch.arange(4.0))}


# ---------------------------------------------------------------------------------------------
# Arguments.

BLANK_PATHS = ["", "   ", "\t\n", "memory://", "memory://  "]


@pytest.mark.parametrize("path", BLANK_PATHS, ids=repr)
def test_a_path_naming_no_location_is_refused_before_anything_is_written(
    tmp_path, monkeypatch, path
):
    # Relative to the local plugin, an empty path is the working directory: the take used to
    # write manifest.yaml and 0/ there.
    monkeypatch.chdir(tmp_path)
    calls = [
        lambda: Snapshot.take(path, small_state()),
        lambda: Snapshot.async_take(path, small_state()),
        lambda: Snapshot(path),
    ]
    for call in calls:
        with pytest.raises(InvalidArgumentError, match="names no location") as info:
            call()
        assert isinstance(info.value, ValueError) and isinstance(info.value, SnapshotError)
        assert repr(path) in str(info.value)
    assert os.listdir(tmp_path) == []


class BytesPath:
    def __fspath__(self) -> bytes:
        return b"/tmp/x"


@pytest.mark.parametrize(
    "path", [None, 3, b"snap", ["snap"], BytesPath()], ids=["None", "int", "bytes", "list", "fs-b"]
)
def test_a_path_that_is_not_a_str_or_pathlike_is_refused(tmp_path, monkeypatch, path):
    monkeypatch.chdir(tmp_path)
    for call in (Snapshot.take, Snapshot.async_take):
        with pytest.raises(InvalidArgumentError, match=r"path must be a str or os\.PathLike"):
            call(path, small_state())
    with pytest.raises(InvalidArgumentError, match=type(path).__name__):
        Snapshot(path)
    assert os.listdir(tmp_path) == []  # str(None) would have been a directory named "None"


def test_a_path_with_a_nul_character_is_refused(tmp_path):
    with pytest.raises(InvalidArgumentError, match="NUL"):
        Snapshot.take(str(tmp_path / "a\0b"), small_state())
    with pytest.raises(InvalidArgumentError, match="NUL"):
        Snapshot(str(tmp_path / "a\0b"))
    assert os.listdir(tmp_path) == []


def test_a_pathlike_path_is_a_path(tmp_path):
    snap = Snapshot.take(tmp_path / "s", small_state())
    assert snap.path == str(tmp_path / "s")
    pending = Snapshot.async_take(tmp_path / "t", small_state())
    assert pending.path == str(tmp_path / "t")
    pending.wait(timeout=60)
    opened = Snapshot(tmp_path / "s")
    assert opened.path == str(tmp_path / "s")
    assert torch.equal(opened.read_object("0/a/x"), torch.arange(4.0))


def test_app_state_that_is_not_a_dict_is_still_not_stateful(tmp_path):
    for app_state in ([StateDict()], None, "state"):
        for call in (Snapshot.take, Snapshot.async_take):
            with pytest.raises(NotStatefulError, match="dict of name -> Stateful") as info:
                call(str(tmp_path / "s"), app_state)
            assert isinstance(info.value, TypeError)  # as torchsnapshot raised
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "replicated",
    ["**", b"**", 3, [1], ["a/**", None]],
    ids=["str", "bytes", "int", "list-of-int", "list-with-None"],
)
def test_replicated_must_be_a_list_of_glob_strings(tmp_path, replicated):
    for call in (Snapshot.take, Snapshot.async_take):
        with pytest.raises(InvalidArgumentError, match="replicated must be a list of glob") as e:
            call(str(tmp_path / "s"), small_state(), replicated=replicated)
        assert str(tmp_path / "s") in str(e.value)
    assert os.listdir(tmp_path) == []


def test_replicated_may_be_any_collection_of_strings(tmp_path):
    for i, replicated in enumerate([None, (), ("a/**",), {"a/*"}, iter(["a/x"])]):
        snap = Snapshot.take(str(tmp_path / f"s{i}"), small_state(), replicated=replicated)
        assert torch.equal(snap.read_object("0/a/x"), torch.arange(4.0))


@pytest.mark.parametrize(
    ("argument", "value", "message"),
    [
        ("storage_options", "fsync=False", "storage_options must be a dict"),
        ("storage_options", [("fsync", False)], "storage_options must be a dict"),
        ("pg", "world", "pg must be a torch.distributed.ProcessGroup"),
        ("pg", 0, "pg must be a torch.distributed.ProcessGroup"),
        ("_custom_tensor_prepare_func", "bf16", "_custom_tensor_prepare_func must be callable"),
    ],
)
def test_other_take_arguments_of_the_wrong_kind(tmp_path, argument, value, message):
    for call in (Snapshot.take, Snapshot.async_take):
        with pytest.raises(InvalidArgumentError, match=message) as info:
            call(str(tmp_path / "s"), small_state(), **{argument: value})
        assert str(tmp_path / "s") in str(info.value)
    assert os.listdir(tmp_path) == []
    if argument != "_custom_tensor_prepare_func":
        with pytest.raises(InvalidArgumentError, match=message):
            Snapshot(str(tmp_path / "s"), **{argument: value})


def test_restore_arguments_of_the_wrong_kind(tmp_path):
    snap = Snapshot.take(str(tmp_path / "s"), small_state())
    target = torch.zeros(4)
    with pytest.raises(NotStatefulError, match="dict of name -> Stateful"):
        snap.restore([StateDict(x=target)])
    with pytest.raises(NotStatefulError, match="dict of name -> Stateful"):
        snap.restore(None)
    with pytest.raises(InvalidArgumentError, match="strict must be a bool, got str 'no'"):
        snap.restore({"a": StateDict(x=target)}, strict="no")
    assert torch.equal(target, torch.zeros(4))  # nothing restored


def test_read_object_arguments_of_the_wrong_kind(tmp_path):
    snap = Snapshot.take(str(tmp_path / "s"), small_state())
    for path in (3, None, b"0/a/x", ["0/a/x"]):
        with pytest.raises(InvalidArgumentError, match="path must be a str") as info:
            snap.read_object(path)
        assert str(tmp_path / "s") in str(info.value)
    for budget in ("big", 0, -1, 1.5, True):
        with pytest.raises(InvalidArgumentError, match="memory_budget_bytes must be a positive"):
            snap.read_object("0/a/x", memory_budget_bytes=budget)
    assert torch.equal(snap.read_object("0/a/x", memory_budget_bytes=4), torch.arange(4.0))


def test_get_state_dict_for_key_arguments_of_the_wrong_kind(tmp_path):
    snap = Snapshot.take(str(tmp_path / "s"), small_state())
    with pytest.raises(InvalidArgumentError, match="key must be a str, got int 3"):
        snap.get_state_dict_for_key(3)
    with pytest.raises(InvalidArgumentError, match="replicate_from_rank0 must be a bool"):
        snap.get_state_dict_for_key("a", replicate_from_rank0="yes")
    with pytest.raises(EntryNotFoundError, match="no app_state key 'b'"):
        snap.get_state_dict_for_key("b")
    assert torch.equal(snap.get_state_dict_for_key("a")["x"], torch.arange(4.0))


def test_pending_wait_refuses_a_timeout_that_is_not_seconds(tmp_path):
    pending = Snapshot.async_take(str(tmp_path / "s"), small_state())
    for timeout in ("10", -1, float("nan"), True):
        with pytest.raises(InvalidArgumentError, match="timeout must be None or a number"):
            pending.wait(timeout)
    assert pending.wait(timeout=60).path == str(tmp_path / "s")


def test_knob_settings_of_the_wrong_kind_are_invalid_arguments(tmp_path, monkeypatch):
    # Through the environment: what is checked is how a bad variable is refused.
    monkeypatch.setenv("STATESNAP_CHUNK_BYTES", "lots")
    with pytest.raises(InvalidArgumentError, match="STATESNAP_CHUNK_BYTES must be an integer"):
        Snapshot.take(str(tmp_path / "s"), small_state())
    monkeypatch.setenv("STATESNAP_CHUNK_BYTES", "0")
    with pytest.raises(InvalidArgumentError, match="STATESNAP_CHUNK_BYTES must be >= 1, got 0"):
        Snapshot.take(str(tmp_path / "s"), small_state())
    assert os.listdir(tmp_path) == []
    with pytest.raises(InvalidArgumentError, match="max_chunk_size_bytes must be an int >= 1"):
        override_max_chunk_size_bytes(1.5)


def test_the_strategy_api_refuses_a_bad_directory_or_state(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    save, common, load = (
        SnapshotSaveStrategy(),
        SnapshotSaveCommonStrategy(),
        SnapshotLoadStrategy(),
    )
    state = {"t": torch.ones(3)}
    for where in ("", None, 3):
        # "" was the working directory (and its common part "/common", at the root); None a
        # directory named "None".
        with pytest.raises(InvalidArgumentError, match="checkpoint_dir"):
            save.save(state, where)
        with pytest.raises(InvalidArgumentError, match="checkpoint_dir"):
            common.save_common(state, where)
        with pytest.raises(InvalidArgumentError, match="checkpoint_dir"):
            load.load(state, where)
        with pytest.raises(InvalidArgumentError, match="checkpoint_dir"):
            load.load_common(where)
        with pytest.raises(InvalidArgumentError, match="checkpoint_dir"):
            load.load_tensors_metadata(where)
    for given in ([("t", torch.ones(3))], None, torch.ones(3)):
        with pytest.raises(InvalidArgumentError, match="sharded_state_dict must be a dict"):
            save.save(given, str(tmp_path / "c"))
    assert os.listdir(tmp_path) == []
    assert not os.path.exists("/common")
    save.save(state, tmp_path / "c")
    target = {"t": torch.zeros(3)}
    with pytest.raises(InvalidArgumentError, match="sharded_state_dict must be a dict"):
        load.load([target["t"]], tmp_path / "c")
    assert torch.equal(load.load(target, tmp_path / "c")["t"], torch.ones(3))


# ---------------------------------------------------------------------------------------------
# Values the engine cannot store as raw bytes.


def take_one(tmp_path: Path, value: object, name: str = "s") -> tuple[Snapshot, object]:
    snap = Snapshot.take(str(tmp_path / name), {"a": StateDict(v=value)})
    return snap, snap.read_object("0/a/v")


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["strided", "jagged"])
def test_nested_tensors_round_trip(tmp_path, layout):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: nested tensors are a prototype
        value = torch.nested.nested_tensor(
            [torch.arange(2.0), torch.arange(3.0) * -1.5], layout=layout
        )
        # The strided layout used to reach torch's "NestedTensorImpl doesn't support sizes".
        snap, back = take_one(tmp_path, value)
        assert snap.get_manifest()["0/a/v"].serializer == "torch_save"
        assert back.is_nested and back.layout == value.layout
        for got, want in zip(back.unbind(), value.unbind(), strict=True):
            assert torch.equal(got, want)


@pytest.mark.filterwarnings("ignore::UserWarning")  # sparse and quantized: beta, deprecated
def test_sparse_and_quantized_tensors_round_trip_exactly(tmp_path):
    uncoalesced = torch.sparse_coo_tensor(
        torch.tensor([[0, 0, 1], [1, 1, 0]]), torch.tensor([1.0, 2.0, -3.0]), (2, 2)
    )
    values = {
        "coo": torch.eye(3).to_sparse(),
        "uncoalesced": uncoalesced,
        "csr": torch.eye(3).to_sparse_csr(),
        "csc": torch.eye(3).to_sparse_csc(),
        "bsr": torch.eye(4).to_sparse_bsr((2, 2)),
        "q": torch.quantize_per_tensor(torch.arange(4.0), 0.5, 1, torch.quint8),
        "qc": torch.quantize_per_channel(
            torch.arange(4.0).reshape(2, 2),
            torch.tensor([0.5, 1.0], dtype=torch.float64),
            torch.tensor([0, 1]),
            0,
            torch.qint8,
        ),
    }
    snap = Snapshot.take(str(tmp_path / "s"), {"a": StateDict(values)})
    for name, want in values.items():
        got = snap.read_object(f"0/a/{name}")
        assert got.layout == want.layout and got.dtype == want.dtype, name
        if want.is_quantized:
            assert torch.equal(got.int_repr(), want.int_repr())
            assert got.qscheme() == want.qscheme()
            if want.qscheme() == torch.per_tensor_affine:
                assert (got.q_scale(), got.q_zero_point()) == (0.5, 1)
            else:
                assert torch.equal(got.q_per_channel_scales(), want.q_per_channel_scales())
        elif want.layout == torch.sparse_coo:
            assert got.is_coalesced() == want.is_coalesced()
            assert torch.equal(got._indices(), want._indices())
            assert torch.equal(got._values(), want._values())
        else:
            assert torch.equal(got.to_dense(), want.to_dense())
            assert torch.equal(got.values(), want.values())


def raw_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.resolve_conj().resolve_neg().contiguous().view(torch.uint8).reshape(-1))


def test_conjugate_negative_and_complex_views_are_stored_resolved(tmp_path):
    z = torch.tensor([1 + 2j, -3.5 - 4j, 0 - 0j], dtype=torch.complex64)
    values = {
        "conj": z.conj(),  # the conjugate bit
        "neg": z.conj().imag,  # the negative bit
        "conj_t": torch.tensor([[1 + 1j, 2 - 2j], [3j, -4 + 0j]]).t().conj(),
        "c128": z.to(torch.complex128),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: ComplexHalf is experimental
        values["c32"] = z.to(torch.complex32)
        snap = Snapshot.take(str(tmp_path / "s"), {"a": StateDict(values)})
        for name, want in values.items():
            got = snap.read_object(f"0/a/{name}")
            assert type(snap.get_manifest()[f"0/a/{name}"]).__name__ == "TensorEntry"
            assert not got.is_conj() and not got.is_neg()
            assert got.dtype == want.dtype and got.shape == want.shape
            assert raw_bytes(got) == raw_bytes(want), name


def test_empty_tensors_round_trip(tmp_path):
    values = {"rows": torch.empty(0, 3), "none": torch.empty(0), "scalar": torch.tensor(2.5)}
    snap = Snapshot.take(str(tmp_path / "s"), {"a": StateDict(values)})
    for name, want in values.items():
        got = snap.read_object(f"0/a/{name}")
        assert got.shape == want.shape and torch.equal(got, want)


class Tagged(torch.Tensor):
    pass


def test_a_tensor_subclass_is_refused_naming_the_key(tmp_path):
    value = torch.arange(3.0).as_subclass(Tagged)
    with pytest.raises(UnsupportedValueError, match=r"0/a/v.*Tagged.*as_subclass"):
        Snapshot.take(str(tmp_path / "s"), {"a": StateDict(v=value)})
    with pytest.raises(SnapshotNotFoundError):
        Snapshot(str(tmp_path / "s"))
    assert files_under(tmp_path) == []


def freed(t: torch.Tensor) -> torch.Tensor:
    t.untyped_storage().resize_(0)  # what FSDP does to a parameter's unsharded storage
    return t


def freed_view() -> torch.Tensor:
    base = torch.ones(2, 3)
    view = base.t()
    freed(base)  # their one storage
    return view


def shrunk(t: torch.Tensor) -> torch.Tensor:
    t.untyped_storage().resize_(8)
    return t


@pytest.mark.parametrize(
    "make",
    [
        lambda: freed(torch.ones(2, 3)),
        lambda: freed_view(),  # through the non-contiguous path
        lambda: torch.nn.Parameter(freed(torch.ones(6))),
        lambda: shrunk(torch.ones(100_000)),
    ],
    ids=["freed", "freed-transposed", "freed-parameter", "shrunk"],
)
def test_a_tensor_whose_storage_lacks_its_bytes_is_refused_before_anything_is_written(
    tmp_path, make
):
    # Its bytes used to be read out of bounds: a take committed a snapshot of garbage, or one
    # whose blob was shorter than its manifest said.
    with pytest.raises(UnsupportedValueError, match=r"0/a/v: the float32\[.*storage that holds"):
        Snapshot.take(str(tmp_path / "s"), {"a": StateDict(ok=torch.ones(3), v=make())})
    with pytest.raises(SnapshotNotFoundError):
        Snapshot(str(tmp_path / "s"))
    assert files_under(tmp_path) == []


# ---------------------------------------------------------------------------------------------
# Targets that cannot receive a value.


def overlapping() -> torch.Tensor:
    return torch.zeros(8).as_strided((2, 2), (1, 1))  # elements (0, 1) and (1, 0) coincide


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: torch.zeros(1).expand(2, 2), StateMismatchError, "share memory"),
        (lambda: torch.zeros(2, 1).expand(2, 2).double(), None, None),  # a copy: receives
        (overlapping, StateMismatchError, "share memory"),
        (lambda: freed(torch.zeros(2, 2)), StateMismatchError, "storage that holds 0"),
        (lambda: torch.zeros(2, 3), ShapeMismatchError, "has shape"),
        (lambda: torch.zeros(4), ShapeMismatchError, "has shape"),
        (lambda: [[0.0, 0.0], [0.0, 0.0]], StateMismatchError, "a list, cannot receive"),
        (lambda: np.zeros((2, 2)), StateMismatchError, "a ndarray, cannot receive"),
        (lambda: torch.zeros(2, 2).to_sparse(), StateMismatchError, "sparse_coo"),
        (
            lambda: torch.quantize_per_tensor(torch.zeros(2, 2), 0.5, 0, torch.quint8),
            StateMismatchError,
            "quantized",
        ),
        (lambda: torch.zeros(2, 2, dtype=torch.bits8), StateMismatchError, "cannot copy"),
    ],
    ids=[
        "expanded",
        "expanded-copy",
        "overlapping",
        "freed",
        "shape",
        "flat",
        "list",
        "ndarray",
        "sparse",
        "quantized",
        "bits8",
    ],
)
@pytest.mark.filterwarnings("ignore::UserWarning")  # quantized tensors are deprecated
def test_read_object_refuses_a_target_that_cannot_receive_the_value_before_reading(
    recorded, make, error, message
):
    url, log = recorded
    want = torch.tensor([[1.0, -2.0], [3.5, 4.0]])
    snap = Snapshot.take(url, {"a": StateDict(v=want)})
    snap = Snapshot(url)
    log.clear()
    target = make()
    if error is None:
        assert torch.equal(snap.read_object("0/a/v", obj_out=target), want.double())
        return
    with pytest.raises(error, match=message) as info:
        snap.read_object("0/a/v", obj_out=target)
    assert type(info.value) is error
    assert url in str(info.value) or url.removeprefix("recording://") in str(info.value)
    assert "0/a/v" in str(info.value)
    assert log.reads == []  # refused before any byte was read


def test_read_object_fills_targets_of_another_layout_or_dtype(tmp_path):
    z = torch.tensor([[1 + 2j, -3 - 4j], [5j, 6.0 + 0j]])
    want = torch.tensor([[1.0, -2.0], [3.5, 4.0]])
    snap = Snapshot.take(str(tmp_path / "s"), {"a": StateDict(v=want, z=z)})
    for target in (
        torch.zeros(4, 4, dtype=torch.float64)[::2, ::2],  # not contiguous, another dtype
        torch.zeros(2, 2).t(),
        torch.nn.Parameter(torch.zeros(2, 2)),  # a leaf that requires grad
    ):
        got = snap.read_object("0/a/v", obj_out=target)
        assert got is target and torch.equal(got.detach(), want.to(target.dtype))
    conj_target = torch.zeros(2, 2, dtype=torch.complex64).conj()
    got = snap.read_object("0/a/z", obj_out=conj_target)
    assert got is conj_target and torch.equal(got.resolve_conj(), z)


def test_read_object_ignores_obj_out_for_values_not_loaded_in_place(tmp_path):
    snap = Snapshot.take(str(tmp_path / "s"), {"a": StateDict(o={1, 2}, n=7, d={"k": "v"})})
    target = torch.zeros(2)
    assert snap.read_object("0/a/o", obj_out=target) == {1, 2}
    assert snap.read_object("0/a/n", obj_out=target) == 7
    assert snap.read_object("0/a", obj_out=target)["d"] == {"k": "v"}
    assert torch.equal(target, torch.zeros(2))


def test_restore_into_an_expanded_parameter_is_refused_before_reading(recorded):
    url, log = recorded
    taken = torch.nn.Linear(4, 1, bias=False)
    other = StateDict(x=torch.arange(3.0))
    Snapshot.take(url, {"m": taken, "o": other})
    snap = Snapshot(url)
    module = torch.nn.Linear(4, 1, bias=False)
    module.weight = torch.nn.Parameter(torch.zeros(1, 1).expand(1, 4))  # one element, 4 views
    fresh = StateDict(x=torch.zeros(3))
    log.clear()
    with pytest.raises(StateMismatchError, match=r"0/m/weight: .*share memory") as info:
        snap.restore({"o": fresh, "m": module})
    assert type(info.value) is StateMismatchError
    assert log.reads == []
    assert torch.equal(fresh["x"], torch.zeros(3))  # no key restored


# ---------------------------------------------------------------------------------------------
# Stopping cleanly.


class Interrupt:
    """A value whose pickling is interrupted (Ctrl-C while a take captures the state)."""

    def __reduce__(self):
        raise KeyboardInterrupt


@pytest.mark.parametrize("use_async", [False, True], ids=["take", "async_take"])
def test_a_take_interrupted_while_capturing_removes_what_it_wrote(tmp_path, use_async):
    # The tensors before the interrupted value are placed, and their writes under way.
    state = {"a": StateDict(**{f"t{i}": torch.randn(50_000) for i in range(8)}, z=Interrupt())}
    call = Snapshot.async_take if use_async else Snapshot.take
    with pytest.raises(KeyboardInterrupt):
        call(str(tmp_path / "s"), state)
    assert files_under(tmp_path) == []  # blobs and pending marker removed
    del state["a"]["z"]
    snap = call(str(tmp_path / "s"), state)
    if use_async:
        snap = snap.wait(timeout=60)
    assert torch.equal(snap.read_object("0/a/t7"), state["a"]["t7"])


SHUTDOWN_SCENARIOS = """
import errno, gc, sys, tempfile
import torch
from snapshot import Snapshot, StateDict
from snapshot.strategies.default import SnapshotSaveStrategy
from storage_plugins import register_storage_plugin
from tests.plugins import FaultyPlugin, fail_writes

class Interrupt:
    def __reduce__(self):
        raise KeyboardInterrupt

def state(extra=None):
    values = {f"t{i}": torch.randn(100_000) for i in range(12)}
    if extra is not None:
        values["z"] = extra
    return {"m": StateDict(values)}

def scenario(name):
    gc.collect()  # what the previous one dropped is collected (and reported) before this line
    print(f"--- {name}", file=sys.stderr, flush=True)

base = tempfile.mkdtemp()
register_storage_plugin("faulty", FaultyPlugin)

scenario("async_take interrupted while capturing")
try:
    Snapshot.async_take(f"{base}/a", state(Interrupt()))
except KeyboardInterrupt:
    pass

scenario("take interrupted while capturing")
try:
    Snapshot.take(f"{base}/b", state(Interrupt()))
except KeyboardInterrupt:
    pass

scenario("async_take whose background write fails")
fail_writes(f"{base}/c", errno.EIO, "I/O error", lambda p: p.startswith("0/"))
try:
    Snapshot.async_take(f"faulty://{base}/c", state()).wait(timeout=60)
except Exception as e:
    print("wait raised", type(e).__name__, file=sys.stderr)

scenario("an async save's request dropped unrun")
request = SnapshotSaveStrategy().async_save({"t": torch.randn(100_000)}, f"{base}/d")
del request

scenario("async_take pending at exit, its handle dropped")
pending = Snapshot.async_take(f"{base}/e", state())
del pending

scenario("an async save's request unrun at exit")
kept = SnapshotSaveStrategy().async_save({"t": torch.randn(100_000)}, f"{base}/f")

scenario("exit")
"""


@pytest.mark.slow
def test_stopped_takes_leave_no_task_pending_at_exit(tmp_path):
    # Each used to leave the write pipeline's workers waiting on their queue: at exit (or when
    # collected) asyncio reported each as "Task was destroyed but it is pending!".
    script = tmp_path / "scenarios.py"
    script.write_text(textwrap.dedent(SHUTDOWN_SCENARIOS))
    # The default concurrency whatever the caller's environment holds, through the environment:
    # the script's strategy saves take no options.
    env = {**os.environ, "PYTHONPATH": str(REPO), "STATESNAP_MAX_CONCURRENT_IO": "16"}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    assert "--- exit" in done.stderr and "wait raised StorageError" in done.stderr
    for line in done.stderr.splitlines():
        assert "Task was destroyed" not in line, done.stderr
        assert "was never awaited" not in line, done.stderr


# ---------------------------------------------------------------------------------------------
# Ranks that disagree on the path.


def _take_at_own_path(rank: int, world: int, base: str, use_async: bool) -> tuple[str, list[str]]:
    own = os.path.join(base, f"snap-of-rank-{rank}")
    state = {"s": StateDict(r=torch.full((3,), float(rank)))}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if use_async:
            pending = Snapshot.async_take(own, state)
            used = pending.path
            assert pending.wait(timeout=120).path == used
        else:
            used = Snapshot.take(own, state).path
        # Same location, spelt differently: no warning.
        Snapshot.take(os.path.join(base, "same") + ("/" if rank else ""), state)
    mismatches = [w for w in caught if issubclass(w.category, PathMismatchWarning)]
    # Each points at the caller's line, the take's.
    assert all(os.path.basename(w.filename) == "test_bad_input.py" for w in mismatches)
    return used, [str(w.message) for w in mismatches]


@pytest.mark.slow
@pytest.mark.parametrize("use_async", [False, True], ids=["take", "async_take"])
def test_ranks_that_pass_different_paths_are_told_which_one_was_used(tmp_path, use_async):
    results = run_ranks(2, _take_at_own_path, str(tmp_path), use_async)
    rank0 = str(tmp_path / "snap-of-rank-0")
    assert [used for used, _ in results] == [rank0, rank0]
    assert results[0][1] == []  # rank 0's path is the one used
    (message,) = results[1][1]
    assert repr(str(tmp_path / "snap-of-rank-1")) in message and repr(rank0) in message
    assert sorted(os.listdir(tmp_path)) == ["same", "snap-of-rank-0"]
    assert torch.equal(Snapshot(rank0).read_object("1/s/r"), torch.full((3,), 1.0))
