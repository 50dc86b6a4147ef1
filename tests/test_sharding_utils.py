"""Sharded-state helpers: splitting a nested state by kind of leaf (both halves keep the
nesting), renaming shard keys, zip_strict, fp8 upcasting, scoped logging/timing and shard ids."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from snapshot.sharding import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    utils,
)
from snapshot.sharding.utils import (
    add_prefix_for_sharding,
    apply_prefix_mapping,
    debug_msg,
    debug_time,
    extract_matching,
    extract_nonpersistent,
    extract_sharded_base,
    extract_sharded_tensors,
    extract_sharded_tensors_and_factories,
    extract_sharded_tensors_or_nonpersistent,
    fallback_logger,
    force_all_tensors_to_non_fp8,
    logger_stack,
    replace_prefix_for_sharding,
    sharded_object_id,
    sharded_tensor_shard_id,
    zip_strict,
)


def st(key: str, offset: int = 0, replica_id=0, data=None) -> ShardedTensor:
    data = torch.full((2,), float(offset)) if data is None else data
    return ShardedTensor.from_rank_offsets(key, data, (0, offset, 4), replica_id=replica_id)


def fac(key: str) -> ShardedTensorFactory:
    return ShardedTensorFactory(key, torch.zeros(2), lambda *a: None, lambda x: x)


class State:
    """One of each kind of leaf, in dicts, lists, nested lists and empty containers."""

    def __init__(self) -> None:
        self.t1, self.t2, self.t3 = st("t1"), st("t2"), st("t3")
        self.o1 = ShardedObject("o1", "payload", (2,), (1,))
        self.f1 = fac("f1")
        self.n1, self.n2 = LocalNonpersistentObject(1), LocalNonpersistentObject(2)
        self.plain = torch.ones(3)
        self.sd = {
            "model": {"w": self.t1, "obj": self.o1, "step": 7},
            "opt": [self.t2, self.f1, "lr", [self.t3, self.n1]],
            "local": {"rng": self.n2},
            "tensor": self.plain,
            "empty_dict": {},
            "empty_list": [],
            "tuple": (self.t1, 1),
        }


def test_extract_sharded_tensors_keeps_structure_and_input():
    s = State()
    before = repr(s.sd)
    matching, rest = extract_sharded_tensors(s.sd)
    assert matching == {"model": {"w": s.t1}, "opt": [s.t2, [s.t3]]}
    assert matching["model"]["w"] is s.t1
    assert rest == {
        "model": {"obj": s.o1, "step": 7},
        "opt": [s.f1, "lr", [s.n1]],
        "local": {"rng": s.n2},
        "tensor": s.plain,
        "empty_dict": {},
        "empty_list": [],
        "tuple": (s.t1, 1),  # tuples are leaves: not searched
    }
    assert repr(s.sd) == before  # input untouched
    assert rest["empty_dict"] is not s.sd["empty_dict"]  # containers are new


def test_extract_sharded_tensors_and_factories():
    s = State()
    matching, rest = extract_sharded_tensors_and_factories(s.sd)
    assert matching == {"model": {"w": s.t1}, "opt": [s.t2, s.f1, [s.t3]]}
    assert rest["model"] == {"obj": s.o1, "step": 7}
    assert rest["opt"] == ["lr", [s.n1]]
    assert rest["local"] == {"rng": s.n2}


def test_extract_sharded_tensors_or_nonpersistent():
    s = State()
    matching, rest = extract_sharded_tensors_or_nonpersistent(s.sd)
    assert matching == {
        "model": {"w": s.t1},
        "opt": [s.t2, s.f1, [s.t3, s.n1]],
        "local": {"rng": s.n2},
    }
    # Containers left empty by the extraction are absent from rest ("local", opt's inner list).
    assert rest == {
        "model": {"obj": s.o1, "step": 7},
        "opt": ["lr"],
        "tensor": s.plain,
        "empty_dict": {},
        "empty_list": [],
        "tuple": (s.t1, 1),
    }


def test_extract_sharded_base():
    s = State()
    matching, rest = extract_sharded_base(s.sd)
    assert matching == {"model": {"w": s.t1, "obj": s.o1}, "opt": [s.t2, s.f1, [s.t3]]}
    assert rest["model"] == {"step": 7}
    assert rest["opt"] == ["lr", [s.n1]]


def test_extract_nonpersistent():
    s = State()
    matching, rest = extract_nonpersistent(s.sd)
    assert matching == {"opt": [[s.n1]], "local": {"rng": s.n2}}
    assert "local" not in rest
    assert rest["model"] == {"w": s.t1, "obj": s.o1, "step": 7}
    assert rest["opt"] == [s.t2, s.f1, "lr", [s.t3]]


def test_extract_nothing_matching_and_everything_matching():
    matching, rest = extract_nonpersistent({"a": {"b": 1}, "c": [2]})
    assert matching == {} and rest == {"a": {"b": 1}, "c": [2]}
    t = st("x")
    matching, rest = extract_sharded_tensors({"a": {"b": t}, "c": [t]})
    assert matching == {"a": {"b": t}, "c": [t]} and rest == {}


def test_extract_matching_list_root_and_predicate():
    matching, rest = extract_matching([1, "a", [2, "b"], {}], lambda v: isinstance(v, int))
    assert matching == [1, [2]]
    assert rest == ["a", ["b"], {}]


def test_extract_matching_rejects_non_container():
    with pytest.raises(TypeError, match="dict or a list, got int"):
        extract_matching(5, bool)  # type: ignore[arg-type]


# Prefixes


def test_add_prefix_for_sharding_renames_every_sharded_base():
    s = State()
    add_prefix_for_sharding(s.sd, "enc.")
    assert [x.key for x in (s.t1, s.t2, s.t3, s.o1, s.f1)] == [
        "enc.t1",
        "enc.t2",
        "enc.t3",
        "enc.o1",
        "enc.f1",
    ]
    assert s.sd["model"]["w"] is s.t1 and s.sd["model"]["step"] == 7
    assert s.o1.unique_key == "enc.o1/shard_1_2"


def test_replace_prefix_for_sharding():
    sd = {"a": st("dec.layer.w"), "b": [ShardedObject("dec.rng", None, (1,), (0,))], "c": "dec."}
    replace_prefix_for_sharding(sd, "dec.", "decoder.")
    assert sd["a"].key == "decoder.layer.w"
    assert sd["b"][0].key == "decoder.rng"
    assert sd["c"] == "dec."  # plain values are not keys


def test_replace_prefix_for_sharding_error_names_key():
    sd = {"a": st("dec.w"), "b": st("enc.w")}
    with pytest.raises(ValueError, match="'enc.w' does not start with prefix 'dec.'"):
        replace_prefix_for_sharding(sd, "dec.", "x.")


def test_apply_prefix_mapping_first_match_wins():
    sd = {
        "a": st("layers.0.w"),
        "b": st("layers.1.w"),
        "c": fac("layers.0.f"),
        "d": st("head.w"),
        "e": [ShardedObject("layers.2.o", None, (1,), (0,))],
    }
    # "layers." matches every layers key, but "layers.0." comes first for layer 0.
    apply_prefix_mapping(sd, {"layers.0.": "first.", "layers.": "block.", "lay": "never."})
    assert sd["a"].key == "first.w"
    assert sd["b"].key == "block.1.w"
    assert sd["c"].key == "first.f"
    assert sd["d"].key == "head.w"  # no match: unchanged
    assert sd["e"][0].key == "block.2.o"

    # The map's order decides, not the prefix length.
    sd2 = {"a": st("layers.0.w")}
    apply_prefix_mapping(sd2, {"layers.": "block.", "layers.0.": "first."})
    assert sd2["a"].key == "block.0.w"


# zip_strict


def test_zip_strict_equal_lengths():
    assert list(zip_strict([1, 2], "ab", (3, 4))) == [(1, "a", 3), (2, "b", 4)]
    assert list(zip_strict()) == []
    assert list(zip_strict(iter([1, 2]), [3, 4])) == [(1, 3), (2, 4)]


def test_zip_strict_error_names_every_length():
    with pytest.raises(ValueError, match=r"lengths \[3, 2, 3\]"):
        zip_strict([1, 2, 3], [1, 2], "abc")


def test_zip_strict_error_on_iterators():
    gen = zip_strict(iter([1, 2, 3]), [1, 2], (x for x in range(4)))
    with pytest.raises(ValueError, match=r"lengths \[3, 2, 4\]"):
        list(gen)


# fp8


FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2] + [
    getattr(torch, n) for n in ("float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, n)
]


class QuantizedWrapper:
    """Stands for a quantized tensor class that brings its own dequantize()."""

    def __init__(self, values: torch.Tensor, scale: float) -> None:
        self.raw = values.to(torch.float8_e4m3fn)
        self.scale = scale
        self.dtype = self.raw.dtype
        self.shape = self.raw.shape

    def dequantize(self) -> torch.Tensor:
        return self.raw.to(torch.bfloat16) * self.scale


@pytest.mark.parametrize("dtype", FP8_DTYPES, ids=str)
def test_force_all_tensors_to_non_fp8(dtype):
    values = torch.tensor([0.5, 1.0, -2.0, 4.0])
    fp8 = values.to(dtype)
    sh = ShardedTensor.from_rank_offsets("w", fp8, (0, 1, 2))
    keep = st("keep")
    sd = {"sharded": sh, "nested": [{"plain": fp8.clone()}], "keep": keep, "other": torch.ones(1)}
    force_all_tensors_to_non_fp8(sd)
    assert sd["sharded"] is sh
    assert sh.dtype == torch.float32 and sh.data.dtype == torch.float32
    assert torch.equal(sh.data, values)  # these values are exact in every fp8 format
    sh.validate_metadata_integrity()  # data and dtype agree
    plain = sd["nested"][0]["plain"]
    assert plain.dtype == torch.float32 and torch.equal(plain, values)
    assert sd["keep"] is keep and keep.dtype == torch.float32
    assert sd["other"].dtype == torch.float32


def test_force_non_fp8_uses_the_wrappers_dequantize():
    wrapper = QuantizedWrapper(torch.tensor([1.0, 2.0]), scale=3.0)
    sh = ShardedTensor("w", wrapper, torch.float8_e4m3fn, (2,), (2,), (0,), None)  # type: ignore[arg-type]
    factory = ShardedTensorFactory("f", torch.tensor([2.0]).to(torch.float8_e5m2), None, None)  # type: ignore[arg-type]
    force_all_tensors_to_non_fp8({"a": sh, "f": factory})
    assert sh.dtype == torch.bfloat16
    assert torch.equal(sh.data, torch.tensor([3.0, 6.0], dtype=torch.bfloat16))
    assert factory.data.dtype == torch.float32 and factory.data.item() == 2.0


# Logging scopes


def test_logger_stack_nesting():
    outer_logger = logging.getLogger("test.sharding.outer")
    inner_logger = logging.getLogger("test.sharding.inner")
    with logger_stack() as (names, logger):
        assert names == "" and logger is fallback_logger
    with logger_stack("take", outer_logger) as (names, logger):
        assert (names, logger) == ("take", outer_logger)
        with logger_stack("write") as (names, logger):
            assert (names, logger) == ("take.write", outer_logger)
            with logger_stack(None, inner_logger) as (names, logger):
                assert (names, logger) == ("take.write", inner_logger)
            with logger_stack("blob") as (names, logger):
                assert (names, logger) == ("take.write.blob", outer_logger)
        with logger_stack() as (names, logger):
            assert (names, logger) == ("take", outer_logger)
    with logger_stack() as (names, logger):
        assert (names, logger) == ("", fallback_logger)


def test_logger_stack_restored_after_exception():
    with pytest.raises(RuntimeError), logger_stack("boom", logging.getLogger("x")):
        raise RuntimeError
    with logger_stack() as (names, logger):
        assert (names, logger) == ("", fallback_logger)


def test_logger_stack_is_per_thread():
    seen = []

    def other_thread():
        with logger_stack() as scope:
            seen.append(scope)

    with logger_stack("main"):
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
    assert seen == [("", fallback_logger)]


LOGGER = "test.sharding.timing"


def timing_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER]


def test_debug_time_without_threshold_logs_at_debug(caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    with debug_time("load", logging.getLogger(LOGGER)):
        pass
    [record] = timing_records(caplog)
    assert record.levelno == logging.DEBUG
    assert record.getMessage().startswith("load took ")
    assert record.getMessage().endswith("s")
    seconds = record.getMessage().removeprefix("load took ").removesuffix("s")
    assert len(seconds.split(".")[1]) == 3 and float(seconds) >= 0


def test_debug_time_over_threshold_warns(caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    with debug_time("slow", logging.getLogger(LOGGER), threshold=0.0):
        pass
    [record] = timing_records(caplog)
    assert record.levelno == logging.WARNING and "slow took" in record.getMessage()


def test_debug_time_under_threshold_logs_nothing(caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    with debug_time("fast", logging.getLogger(LOGGER), threshold=3600.0):
        pass
    assert timing_records(caplog) == []


def test_debug_time_explicit_level_and_nested_names(caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    with logger_stack("take", logging.getLogger(LOGGER)), debug_time("write", level=logging.INFO):
        pass
    [record] = timing_records(caplog)
    assert record.levelno == logging.INFO
    assert record.getMessage().startswith("take.write took ")


def test_debug_time_logs_and_propagates_on_error(caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    with pytest.raises(KeyError), debug_time("fails", logging.getLogger(LOGGER)):
        raise KeyError("x")
    [record] = timing_records(caplog)
    assert "fails took" in record.getMessage()
    with logger_stack() as scope:
        assert scope == ("", fallback_logger)


def test_debug_msg_prefixes_the_scope(caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    with logger_stack("restore", logging.getLogger(LOGGER)), logger_stack("read"):
        debug_msg("checkpoint opened")
    [record] = timing_records(caplog)
    assert record.levelno == logging.DEBUG
    assert record.getMessage() == "restore.read checkpoint opened"


def test_debug_msg_outside_scopes_goes_to_the_fallback_logger(caplog):
    caplog.set_level(logging.DEBUG, logger=fallback_logger.name)
    debug_msg("hello")
    [record] = [r for r in caplog.records if r.name == fallback_logger.name]
    assert record.getMessage() == "hello" and record.levelno == logging.DEBUG


# Shard ids


def test_sharded_tensor_shard_id_ignores_replica_and_data():
    a = st("w", offset=1, replica_id=0, data=torch.zeros(2))
    b = st("w", offset=1, replica_id=(1, 2), data=torch.ones(2))
    assert sharded_tensor_shard_id(a) == sharded_tensor_shard_id(b) == ("w", (2,))
    assert sharded_tensor_shard_id(a) != sharded_tensor_shard_id(st("w", offset=2))
    assert sharded_tensor_shard_id(a) != sharded_tensor_shard_id(st("v", offset=1))
    hash(sharded_tensor_shard_id(a))  # usable as a dict key / set member
    assert utils._sharded_tensor_shard_id is sharded_tensor_shard_id


def test_sharded_object_id_ignores_replica_and_data():
    a = ShardedObject("o", "x", (4,), (1,), replica_id=0)
    b = ShardedObject("o", "y", (4,), (1,), replica_id=3)
    assert sharded_object_id(a) == sharded_object_id(b) == ("o", (1,))
    assert sharded_object_id(a) != sharded_object_id(ShardedObject("o", "x", (4,), (2,)))
    assert sharded_object_id(a) != sharded_object_id(ShardedObject("p", "x", (4,), (1,)))
    assert utils._sharded_object_id is sharded_object_id
