"""Export of a snapshot's tensors to safetensors / torch files: every dtype, names, splitting
with a Hugging Face index, consolidation of sharded tensors, checksums, files whole or absent,
a real transformers model loaded back from the export, a 2-rank FSDP2 snapshot."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import snapshot.export as engine
from snapshot import ChecksumError, InvalidArgumentError, Options, Snapshot, StateDict
from snapshot.export import export
from snapshot.sharding import ShardedTensor
from tests.multirank import run_ranks

SAFETENSORS_DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.complex64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
]


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (int(torch.tensor(shape).prod()) * dtype.itemsize,), generator=g)
    t = raw.to(torch.uint8).view(dtype).reshape(shape)
    return (t != 0) if dtype is torch.bool else t


def bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype is torch.bool:
        return torch.equal(a, b)
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


def files_in(folder) -> list[str]:
    return sorted(os.listdir(folder))


def test_every_safetensors_dtype_round_trips_bitwise(tmp_path):
    tensors = {
        f"t{i}": random_tensor((3, 5), dtype, i) for i, dtype in enumerate(SAFETENSORS_DTYPES)
    }
    tensors["scalar"] = torch.tensor(2.5)
    tensors["empty"] = torch.zeros(0, 4)
    Snapshot.take(str(tmp_path / "s"), {"model": StateDict(**tensors, note="skipped")})
    files = export(str(tmp_path / "s"), tmp_path / "out", key="model")
    assert [os.path.basename(f) for f in files] == ["model.safetensors"]
    got = load_file(files[0])
    assert got.keys() == tensors.keys()
    for name, t in tensors.items():
        assert bitwise(got[name], t), name


def test_names_split_files_and_the_index(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    ddp_like = StateDict(**{f"module.{k}": v for k, v in model.state_dict().items()})
    Snapshot.take(str(tmp_path / "s"), {"model": ddp_like, "optim": StateDict(step=1)})
    out = tmp_path / "out"
    files = export(
        str(tmp_path / "s"), out, key="model", strip_prefix="module.", max_shard_size=10_000
    )
    names = files_in(out)
    assert names == [
        ".statesnap-export.json",  # the record of what the export wrote
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(model.state_dict())
    loaded: dict[str, torch.Tensor] = {}
    for f in files[:-1]:
        part = load_file(f)
        assert all(index["weight_map"][k] == os.path.basename(f) for k in part)
        loaded.update(part)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in loaded.values())
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
    # Without a key, every key's tensors, named with it.
    everything = load_file(export(str(tmp_path / "s"), tmp_path / "all")[0])
    assert set(everything) == {f"model.module.{k}" for k in model.state_dict()}


def test_dtype_casts_floating_tensors_only(tmp_path):
    state = StateDict(
        w=torch.randn(10, 10), ids=torch.arange(10), flag=torch.ones(2, dtype=torch.bool)
    )
    Snapshot.take(str(tmp_path / "s"), {"m": state})
    got = load_file(export(str(tmp_path / "s"), tmp_path / "out", key="m", dtype="bf16")[0])
    assert got["w"].dtype == torch.bfloat16 and torch.equal(got["w"], state["w"].to(torch.bfloat16))
    assert got["ids"].dtype == torch.int64 and got["flag"].dtype == torch.bool


def test_sharded_boxes_are_consolidated_with_a_small_budget(tmp_path):
    """Boxes along the second axis (each row of the output gathers pieces of two boxes) and a
    leading-axis split, through tiles much smaller than the tensor."""
    full = torch.randn(64, 48)
    cols = [
        ShardedTensor.from_rank_offsets("w", full[:, :24].clone(), (1, 0, 2)),
        ShardedTensor.from_rank_offsets("w", full[:, 24:].clone(), (1, 1, 2)),
    ]
    rows = [
        ShardedTensor.from_rank_offsets("v", full[:32].clone(), (0, 0, 2)),
        ShardedTensor.from_rank_offsets("v", full[32:].clone(), (0, 1, 2)),
    ]
    Snapshot.take(str(tmp_path / "s"), {"m": StateDict(a=cols[0], b=cols[1], c=rows[0], d=rows[1])})
    opts = Options(memory_budget_bytes=4096)  # tiles of 2 KiB: a few rows each
    got = load_file(export(str(tmp_path / "s"), tmp_path / "out", key="m", options=opts)[0])
    for name in "abcd":
        assert torch.equal(got[name], full), name


def test_tiles_stay_within_the_budget():
    source = engine.Source("w", "0/w", torch.float32, (1000, 256), [], torch.float32)
    spans = list(engine.tiles(source, 64 * 1024))
    assert spans[0] == (0, 64) and spans[-1][1] == 1000
    assert all((b - a) * 256 * 4 <= 64 * 1024 for a, b in spans)


def test_a_damaged_byte_fails_and_leaves_no_file(tmp_path):
    Snapshot.take(str(tmp_path / "s"), {"m": StateDict(w=torch.randn(100, 100))})
    blob = next(p for p in (tmp_path / "s" / "0").iterdir())
    data = bytearray(blob.read_bytes())
    data[100] ^= 1
    blob.write_bytes(bytes(data))
    with pytest.raises(ChecksumError):
        export(str(tmp_path / "s"), tmp_path / "out", key="m")
    assert not (tmp_path / "out").exists()  # not even a temporary file, nor the folder made


def test_an_interrupted_export_leaves_no_file_that_looks_done(tmp_path, monkeypatch):
    Snapshot.take(str(tmp_path / "s"), {"m": StateDict(a=torch.randn(50), b=torch.randn(50))})
    calls = []
    real = engine.stream_tensor

    def stream(plugin, source, *args):
        calls.append(source.name)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the user's Ctrl-C halfway through the file
        real(plugin, source, *args)

    monkeypatch.setattr(engine, "stream_tensor", stream)
    (tmp_path / "out").mkdir()
    with pytest.raises(KeyboardInterrupt):
        export(str(tmp_path / "s"), tmp_path / "out", key="m")
    assert files_in(tmp_path / "out") == []


def test_torch_format(tmp_path):
    model = torch.nn.Linear(32, 16)
    Snapshot.take(str(tmp_path / "s"), {"model": model})
    files = export(str(tmp_path / "s"), tmp_path / "out", key="model", format="torch")
    got = torch.load(files[0], weights_only=True)
    assert all(torch.equal(got[k], v) for k, v in model.state_dict().items())
    split = export(
        str(tmp_path / "s"), tmp_path / "out2", key="model", format="torch", max_shard_size=1000
    )
    assert os.path.basename(split[-1]) == "pytorch_model.bin.index.json"


def test_bad_arguments(tmp_path):
    Snapshot.take(str(tmp_path / "s"), {"m": StateDict(w=torch.ones(2))})
    for kwargs, match in (
        ({"format": "onnx"}, "format"),
        ({"dtype": "int3"}, "dtype"),
        ({"max_shard_size": "lots"}, "max_shard_size"),
        ({"key": "nope"}, "no key 'nope'"),
    ):
        with pytest.raises(InvalidArgumentError, match=match):
            export(str(tmp_path / "s"), tmp_path / "out", **kwargs)
    assert engine.parse_size("5GB") == 5 * 10**9 and engine.parse_size("2MiB") == 2 << 20


def test_an_incremental_snapshot_exports_its_bases_bytes(tmp_path):
    state = {"m": StateDict(frozen=torch.randn(100, 10), head=torch.zeros(4))}
    Snapshot.take(str(tmp_path / "s1"), state, options=Options(digests=True))
    state["m"]["head"] += 1
    Snapshot.take(str(tmp_path / "s2"), state, base=str(tmp_path / "s1"))
    got = load_file(export(str(tmp_path / "s2"), tmp_path / "out", key="m")[0])
    assert torch.equal(got["frozen"], state["m"]["frozen"]) and torch.equal(
        got["head"], torch.ones(4)
    )


@pytest.mark.slow  # a subprocess
def test_the_command(tmp_path):
    model = torch.nn.Linear(8, 4)
    Snapshot.take(str(tmp_path / "s"), {"model": model})
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "snapshot",
            "export",
            str(tmp_path / "s"),
            str(tmp_path / "out"),
            "--key",
            "model",
            "--dtype",
            "fp16",
        ],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    assert "model.safetensors" in run.stdout
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert got["weight"].dtype == torch.float16


# -- real models -----------------------------------------------------------------------------------


def test_a_transformers_model_loads_from_the_export_with_identical_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    Snapshot.take(str(tmp_path / "s"), {"model": model})
    out = tmp_path / "hf"
    export(str(tmp_path / "s"), out, key="model", max_shard_size="40KB")
    config.save_pretrained(out)
    assert (out / "model.safetensors.index.json").exists()  # split, as Hugging Face splits
    loaded = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


def _fsdp2_take(rank: int, world_size: int, path: str) -> None:
    import warnings

    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.ReLU(), torch.nn.Linear(40, 6))
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

    class Model:
        def state_dict(self):
            return get_model_state_dict(model)

        def load_state_dict(self, state):
            raise AssertionError("not restored here")

    Snapshot.take(path, {"model": Model()})
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank == 0:  # the full weights, for the test to compare with (tensors cannot be returned)
        torch.save({k: v.clone() for k, v in full.items()}, path + ".full.pt")


@pytest.mark.slow  # real processes
def test_a_two_rank_fsdp2_snapshot_exported_on_one_process(tmp_path):
    path = str(tmp_path / "fsdp2")
    run_ranks(2, _fsdp2_take, path)
    full = torch.load(path + ".full.pt", weights_only=True)
    manifest = Snapshot(path).get_manifest()
    assert manifest["0/model/0.weight"].type == "sharded_tensor"
    got = load_file(export(path, tmp_path / "out", key="model")[0])
    assert got.keys() == full.keys()
    for name, t in full.items():
        assert torch.equal(got[name], t), name
