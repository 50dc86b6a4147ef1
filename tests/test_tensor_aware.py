"""BasicTensorAwareStateDict: pop, insert, init, CPU staging and their errors, all on CPU."""

from __future__ import annotations

from collections import OrderedDict, namedtuple
from typing import Any

import pytest
import torch

from snapshot.errors import (
    HollowStateError,
    ShapeMismatchError,
    SnapshotError,
    StateMismatchError,
    UnsupportedValueError,
)
from snapshot.strategies.tensor_aware import (
    BasicTensorAwareStateDict,
    TensorAwareStateDict,
    TensorPlaceholder,
)

Pair = namedtuple("Pair", "first second")

META = torch.device("meta")
CPU = torch.device("cpu")


class Opaque:
    """A plain value that happens to hold a tensor: not descended into."""

    def __init__(self) -> None:
        self.hidden = torch.ones(2)


def nested() -> dict[str, Any]:
    return {
        "model": OrderedDict(w=torch.randn(3, 4), b=torch.zeros(4, dtype=torch.bfloat16)),
        "optim": {
            "state": {0: {"step": torch.tensor(7), "exp_avg": torch.randn(3, 4)}},
            "param_groups": [{"lr": 0.1, "params": [0]}],
        },
        "buffers": [torch.ones(2, dtype=torch.bool), [torch.arange(5)]],
        "pair": (torch.ones(1), "label"),
        "named": Pair(first=torch.full((2,), 3.0), second=5),
        "size": torch.Size([2, 3]),
        "epoch": 3,
        "name": "run",
        "none": None,
        "opaque": Opaque(),
    }


def tensor_paths(sd: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """The same state's tensors read directly, in the documented traversal order."""
    return [
        ("model/w", sd["model"]["w"]),
        ("model/b", sd["model"]["b"]),
        ("optim/state/0/step", sd["optim"]["state"][0]["step"]),
        ("optim/state/0/exp_avg", sd["optim"]["state"][0]["exp_avg"]),
        ("buffers/0", sd["buffers"][0]),
        ("buffers/1/0", sd["buffers"][1][0]),
        ("pair/0", sd["pair"][0]),
        ("named/0", sd["named"].first),
    ]


def test_is_an_abstract_interface():
    with pytest.raises(TypeError):
        TensorAwareStateDict()  # type: ignore[abstract]
    assert isinstance(BasicTensorAwareStateDict({}), TensorAwareStateDict)


@pytest.mark.parametrize("value", [[torch.ones(1)], torch.ones(1), None])
def test_rejects_a_non_dict(value):
    with pytest.raises(TypeError, match="wraps a dict"):
        BasicTensorAwareStateDict(value)


def test_pop_order_is_depth_first_in_insertion_order():
    sd = nested()
    expected = [t for _, t in tensor_paths(sd)]
    popped = BasicTensorAwareStateDict(sd).pop_tensors()
    assert len(popped) == len(expected)
    assert all(p is e for p, e in zip(popped, expected, strict=True))


def test_round_trip_puts_the_same_objects_back_in_the_same_places():
    sd = nested()
    before = tensor_paths(sd)
    containers = [sd["model"], sd["optim"], sd["optim"]["state"][0], sd["buffers"]]
    wrapped = BasicTensorAwareStateDict(sd)
    wrapped.insert_tensors(wrapped.pop_tensors())
    assert not wrapped.is_hollow
    assert wrapped.state_dict is sd
    after = tensor_paths(sd)
    assert [p for p, _ in after] == [p for p, _ in before]
    assert all(a is b for (_, a), (_, b) in zip(after, before, strict=True))
    # dicts and lists are updated in place; tuples are rebuilt with their type
    assert all(
        c is d
        for c, d in zip(
            containers,
            [sd["model"], sd["optim"], sd["optim"]["state"][0], sd["buffers"]],
            strict=True,
        )
    )
    assert type(sd["model"]) is OrderedDict
    assert type(sd["pair"]) is tuple and sd["pair"][1] == "label"
    assert type(sd["named"]) is Pair and sd["named"].second == 5


def test_non_tensor_values_are_untouched():
    sd = nested()
    plain = {k: sd[k] for k in ("size", "epoch", "name", "none", "opaque")}
    hidden = sd["opaque"].hidden
    groups = sd["optim"]["param_groups"]
    wrapped = BasicTensorAwareStateDict(sd)
    assert len(wrapped.pop_tensors()) == 8  # the tensor inside Opaque is not found
    for key, value in plain.items():
        assert sd[key] is value
    assert sd["opaque"].hidden is hidden
    assert sd["optim"]["param_groups"] is groups
    assert groups == [{"lr": 0.1, "params": [0]}]
    assert sd["pair"][1] == "label" and sd["named"].second == 5


def test_hollow_state_holds_placeholders():
    sd = nested()
    wrapped = BasicTensorAwareStateDict(sd)
    originals = tensor_paths(sd)
    wrapped.pop_tensors()
    assert wrapped.is_hollow
    for (path, tensor), (_, placeholder) in zip(originals, tensor_paths(sd), strict=True):
        assert placeholder == TensorPlaceholder(
            shape=tensor.shape, dtype=tensor.dtype, device=tensor.device
        ), path


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16, torch.bool, torch.int64, torch.uint8]
)
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 0, 4), (2, 3)])
@pytest.mark.parametrize("device", [CPU, META])
def test_placeholders_keep_shape_dtype_device(dtype, shape, device):
    tensor = torch.ones(shape, dtype=dtype, device=device)
    wrapped = BasicTensorAwareStateDict({"t": tensor})
    assert wrapped.pop_tensors()[0] is tensor
    placeholder = wrapped.state_dict["t"]
    assert isinstance(placeholder, TensorPlaceholder)
    assert (placeholder.shape, placeholder.dtype, placeholder.device) == (
        torch.Size(shape),
        dtype,
        device,
    )
    wrapped.init_tensors()
    fresh = wrapped.state_dict["t"]
    assert fresh is not tensor
    assert (fresh.shape, fresh.dtype, fresh.device) == (tensor.shape, dtype, device)


def test_init_tensors_makes_fresh_plain_tensors():
    sd = nested()
    sd["model"]["p"] = torch.nn.Parameter(torch.randn(2))
    wrapped = BasicTensorAwareStateDict(sd)
    popped = wrapped.pop_tensors()
    wrapped.init_tensors()
    assert not wrapped.is_hollow
    fresh = wrapped.tensors
    assert len(fresh) == len(popped)
    for new, old in zip(fresh, popped, strict=True):
        assert new is not old
        assert (new.shape, new.dtype, new.device) == (old.shape, old.dtype, old.device)
        assert type(new) is torch.Tensor and not new.requires_grad
    pointers = [t.data_ptr() for t in fresh if t.numel()]
    assert len(set(pointers)) == len(pointers)  # no two share memory
    assert type(sd["named"]) is Pair and type(sd["model"]) is OrderedDict


def test_tensors_lists_without_popping():
    sd = nested()
    wrapped = BasicTensorAwareStateDict(sd)
    listed = wrapped.tensors
    assert all(a is b for a, (_, b) in zip(listed, tensor_paths(sd), strict=True))
    assert not wrapped.is_hollow
    assert all(a is b for a, b in zip(wrapped.pop_tensors(), listed, strict=True))


def test_state_without_tensors():
    sd = {"epoch": 1, "names": ["a", ("b",)]}
    wrapped = BasicTensorAwareStateDict(sd)
    assert wrapped.tensors == []
    assert wrapped.pop_tensors() == []
    assert wrapped.is_hollow
    wrapped.insert_tensors([])
    assert sd == {"epoch": 1, "names": ["a", ("b",)]}


def test_tied_and_shared():
    tied = torch.randn(3)
    shared_list = [torch.ones(1)]
    sd = {"embed": tied, "head": tied, "x": shared_list, "y": shared_list}
    wrapped = BasicTensorAwareStateDict(sd)
    popped = wrapped.pop_tensors()
    # the tensor held twice is listed twice; the shared list is walked once
    assert len(popped) == 3 and popped[0] is popped[1] is tied
    assert sd["y"] is shared_list and isinstance(shared_list[0], TensorPlaceholder)
    wrapped.insert_tensors(popped)
    wrapped.copy_tensors_to_cpu()
    assert sd["embed"] is sd["head"] and sd["embed"] is not tied  # staged once, still tied


def test_a_cycle_through_a_list_ends():
    loop: list[Any] = [torch.ones(1)]
    loop.append(loop)
    wrapped = BasicTensorAwareStateDict({"loop": loop})
    assert len(wrapped.pop_tensors()) == 1
    wrapped.init_tensors()
    assert loop[1] is loop and isinstance(loop[0], torch.Tensor)


@pytest.mark.parametrize("non_blocking", [False, True])
def test_copy_to_cpu_leaves_originals_untouched(non_blocking):
    sd = nested()
    originals = [t for _, t in tensor_paths(sd)]
    values = [t.clone() for t in originals]
    wrapped = BasicTensorAwareStateDict(sd)
    wrapped.copy_tensors_to_cpu(non_blocking=non_blocking)
    copies = wrapped.tensors
    assert len(copies) == len(originals)
    for copy, original, value in zip(copies, originals, values, strict=True):
        assert copy is not original
        assert copy.device == CPU
        assert (copy.shape, copy.dtype) == (original.shape, original.dtype)
        assert torch.equal(copy, original)
        if copy.numel():
            assert copy.data_ptr() != original.data_ptr()
            # writing the copy leaves the original as it was
            if copy.dtype == torch.bool:
                copy.logical_not_()
            else:
                copy.add_(1)
            assert torch.equal(original, value)
            assert not torch.equal(copy, original)
    assert sd["epoch"] == 3 and sd["name"] == "run"


def test_copy_to_cpu_of_a_non_contiguous_tensor_and_one_requiring_grad():
    strided = torch.arange(12.0).reshape(3, 4).t()
    param = torch.nn.Parameter(torch.randn(2))
    wrapped = BasicTensorAwareStateDict({"strided": strided, "param": param})
    wrapped.copy_tensors_to_cpu()
    copy, param_copy = wrapped.tensors
    assert torch.equal(copy, strided)
    assert torch.equal(param_copy, param.detach())
    assert not param_copy.requires_grad and param_copy.grad_fn is None


def test_copy_to_cpu_twice_makes_new_copies():
    t = torch.randn(4)
    wrapped = BasicTensorAwareStateDict({"t": t})
    wrapped.copy_tensors_to_cpu()
    first = wrapped.state_dict["t"]
    wrapped.copy_tensors_to_cpu()
    second = wrapped.state_dict["t"]
    assert second is not first and second is not t and torch.equal(second, t)


@pytest.mark.parametrize("non_blocking", [False, True])
def test_restore_after_cpu_staging_on_cpu_keeps_the_copies(non_blocking):
    sd = nested()
    originals = [t for _, t in tensor_paths(sd)]
    wrapped = BasicTensorAwareStateDict(sd)
    wrapped.copy_tensors_to_cpu()
    copies = wrapped.tensors
    wrapped.restore_tensor_device(non_blocking=non_blocking)
    # every tensor already lives on CPU, its home: no move is required
    assert all(a is b for a, b in zip(wrapped.tensors, copies, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(wrapped.tensors, originals, strict=True))


def test_restore_without_staging_changes_nothing():
    sd = nested()
    before = [t for _, t in tensor_paths(sd)]
    wrapped = BasicTensorAwareStateDict(sd)
    wrapped.restore_tensor_device()
    assert all(a is b for a, b in zip(wrapped.tensors, before, strict=True))


@pytest.mark.parametrize("non_blocking", [False, True])
def test_restore_moves_tensors_inserted_from_another_device(non_blocking):
    # The meta device stands in for a GPU: placeholders say "meta", the tensors read are on CPU.
    wrapped = BasicTensorAwareStateDict(
        {"a": torch.empty(2, 3, device=META), "b": [torch.empty(4, dtype=torch.int64, device=META)]}
    )
    wrapped.pop_tensors()
    read = [torch.ones(2, 3), torch.arange(4)]
    wrapped.insert_tensors(read)
    assert all(a is b for a, b in zip(wrapped.tensors, read, strict=True))
    wrapped.restore_tensor_device(non_blocking=non_blocking)
    moved = wrapped.tensors
    assert [t.device for t in moved] == [META, META]
    assert [(t.shape, t.dtype) for t in moved] == [(r.shape, r.dtype) for r in read]
    wrapped.restore_tensor_device()  # nothing left to move
    assert all(a is b for a, b in zip(wrapped.tensors, moved, strict=True))


def test_placeholders_remember_the_home_device_of_staged_tensors():
    wrapped = BasicTensorAwareStateDict({"a": torch.empty(2, device=META)})
    wrapped.pop_tensors()
    wrapped.insert_tensors([torch.ones(2)])  # belongs on meta, held on CPU
    wrapped.copy_tensors_to_cpu()
    wrapped.pop_tensors()
    assert wrapped.state_dict["a"].device == META
    wrapped.init_tensors()
    assert wrapped.state_dict["a"].device == META


def test_copy_to_cpu_of_a_tensor_without_data_names_its_path_and_changes_nothing():
    ok, meta = torch.ones(2), torch.empty(2, device=META)
    wrapped = BasicTensorAwareStateDict({"ok": ok, "layer": {"w": meta}})
    with pytest.raises(UnsupportedValueError, match=r"^layer/w: cannot copy .* meta"):
        wrapped.copy_tensors_to_cpu()
    assert wrapped.state_dict["ok"] is ok and wrapped.state_dict["layer"]["w"] is meta


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda w: w.pop_tensors(), id="pop_tensors"),
        pytest.param(lambda w: w.tensors, id="tensors"),
        pytest.param(lambda w: w.copy_tensors_to_cpu(), id="copy_tensors_to_cpu"),
        pytest.param(lambda w: w.restore_tensor_device(), id="restore_tensor_device"),
    ],
)
def test_needing_tensors_while_hollow_is_refused(call, request):
    wrapped = BasicTensorAwareStateDict(nested())
    popped = wrapped.pop_tensors()
    name = request.node.callspec.id
    with pytest.raises(HollowStateError, match=rf"^{name}: the state is .*hollow.*insert_tensors"):
        call(wrapped)
    assert wrapped.is_hollow
    wrapped.insert_tensors(popped)  # still usable afterwards
    assert not wrapped.is_hollow


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda w: w.insert_tensors(w.tensors), id="insert_tensors"),
        pytest.param(lambda w: w.init_tensors(), id="init_tensors"),
    ],
)
def test_needing_placeholders_while_full_is_refused(call, request):
    sd = nested()
    before = [t for _, t in tensor_paths(sd)]
    wrapped = BasicTensorAwareStateDict(sd)
    name = request.node.callspec.id
    with pytest.raises(HollowStateError, match=rf"^{name}: the state is not hollow.*pop_tensors"):
        call(wrapped)
    assert issubclass(HollowStateError, SnapshotError)
    assert all(a is b for a, b in zip(wrapped.tensors, before, strict=True))


@pytest.mark.parametrize("change", [-1, +1])
def test_inserting_the_wrong_number_of_tensors_is_refused(change):
    wrapped = BasicTensorAwareStateDict(nested())
    popped = wrapped.pop_tensors()
    given = popped[:-1] if change < 0 else [*popped, torch.ones(1)]
    with pytest.raises(StateMismatchError, match=rf"got {len(given)} tensors for 8 placeholders"):
        wrapped.insert_tensors(given)
    assert wrapped.is_hollow
    wrapped.insert_tensors(iter(popped))  # any iterable will do


@pytest.mark.parametrize(
    ("index", "replacement", "error", "message"),
    [
        (
            3,
            torch.randn(4, 3),
            ShapeMismatchError,
            r"optim/state/0/exp_avg: .*shape \(4, 3\).*\(3, 4\)",
        ),
        (
            2,
            torch.tensor([7]),
            ShapeMismatchError,
            r"optim/state/0/step: .*shape \(1,\).*shape \(\)",
        ),
        (1, torch.zeros(4), StateMismatchError, r"model/b: .*torch.float32.*torch.bfloat16"),
        (7, [3.0, 3.0], StateMismatchError, r"named/0: .*got a list where a tensor was popped"),
    ],
)
def test_inserting_a_misfit_names_its_path_and_changes_nothing(index, replacement, error, message):
    sd = nested()
    wrapped = BasicTensorAwareStateDict(sd)
    popped = wrapped.pop_tensors()
    given = list(popped)
    given[index] = replacement
    with pytest.raises(error, match=message):
        wrapped.insert_tensors(given)
    assert wrapped.is_hollow
    assert all(isinstance(t, TensorPlaceholder) for _, t in tensor_paths(sd))
    wrapped.insert_tensors(popped)
    assert all(a is b for a, (_, b) in zip(popped, tensor_paths(sd), strict=True))


def test_cuda_staging_round_trip():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device: pinned, asynchronous device-to-host copies")
    on_gpu = torch.randn(64, 64, device="cuda")
    wrapped = BasicTensorAwareStateDict({"w": on_gpu})
    wrapped.copy_tensors_to_cpu(non_blocking=True)
    torch.cuda.synchronize()
    staged = wrapped.state_dict["w"]
    assert staged.device == CPU and staged.is_pinned() and torch.equal(staged, on_gpu.cpu())
    wrapped.pop_tensors()
    assert wrapped.state_dict["w"].device == on_gpu.device
    wrapped.insert_tensors([staged])
    wrapped.restore_tensor_device(non_blocking=True)
    back = wrapped.state_dict["w"]
    assert back.device == on_gpu.device and back is not on_gpu and torch.equal(back, on_gpu)
