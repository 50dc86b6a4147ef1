"""Hugging Face safetensors folders as read-only sources.

A tiny transformers model (built from a config, nothing downloaded) is saved with
``save_pretrained`` into several shards; ``Snapshot(folder).restore({"model": model})`` loads
it into a fresh model of that config, whose logits then equal the saved model's. A single
``model.safetensors`` opens too, and ``read_object("0/model/<name>")`` reads one tensor.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch

from manifest import TensorEntry
from snapshot import Snapshot

transformers = pytest.importorskip("transformers")


def _config() -> Any:
    return transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )


def _model(seed: int) -> Any:
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(_config()).eval()


def _logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.arange(10).reshape(1, 10)).logits


def test_sharded_folder_restores_a_fresh_model(tmp_path: Any) -> None:
    saved = _model(0)
    folder = str(tmp_path / "hf")
    saved.save_pretrained(folder, max_shard_size="20KB", safe_serialization=True)
    shards = [f for f in os.listdir(folder) if f.endswith(".safetensors")]
    assert len(shards) > 2 and "model.safetensors.index.json" in os.listdir(folder)
    fresh = _model(1)
    assert not torch.equal(_logits(fresh), _logits(saved))
    snap = Snapshot(folder)
    snap.restore({"model": fresh})
    assert torch.equal(_logits(fresh), _logits(saved))
    name = "model.layers.1.mlp.down_proj.weight"
    entry = snap.get_manifest()[f"0/model/{name}"]
    assert isinstance(entry, TensorEntry) and entry.shape == (32, 48)
    assert torch.equal(snap.read_object(f"0/model/{name}"), saved.state_dict()[name])


def test_single_file_and_cli(tmp_path: Any) -> None:
    from snapshot.cli import main

    saved = _model(0)
    folder = str(tmp_path / "one")
    saved.save_pretrained(folder, safe_serialization=True)
    assert os.path.exists(os.path.join(folder, "model.safetensors"))
    fresh = _model(2)
    Snapshot(folder).restore({"model": fresh})
    assert torch.equal(_logits(fresh), _logits(saved))
    name = "model.norm.weight"
    for args in (["ls", folder], ["show", folder, f"0/model/{name}"], ["verify", folder]):
        assert main(args) == 0, args
    out = str(tmp_path / "export")
    assert main(["export", folder, out]) == 0
    from safetensors.torch import load_file

    exported = load_file(os.path.join(out, "model.safetensors"))
    assert torch.equal(exported[f"model.{name}"], saved.state_dict()[name])


def test_index_naming_a_file_outside_the_folder_is_refused(tmp_path: Any) -> None:
    from snapshot.errors import UnsafeSnapshotError

    folder = tmp_path / "hf"
    _model(0).save_pretrained(str(folder), max_shard_size="20KB", safe_serialization=True)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "../elsewhere.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(UnsafeSnapshotError, match="inside the folder"):
        Snapshot(str(folder))
