"""Exporting a snapshot's tensors to files other tools load: safetensors (with a Hugging Face
index when split) or ``torch.save``. ``statesnap export`` is the same from the command line.

    from snapshot.export import export
    export("ckpt/step_1000", "hf_model", key="model", dtype="bf16", max_shard_size="5GB")

Streamed: memory stays within the memory budget (``Options.memory_budget_bytes``) whatever
the state's size, and sharded tensors (``ShardedTensor``, DTensor, torch's ``ShardedTensor``)
are consolidated into full ones. The export appears whole or not at all, never mixed with an
earlier one in the folder, and a forged manifest is refused before anything is allocated or
written (``snapshot._engine.tools.export``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from snapshot._engine.format.manifest_io import load_manifest
from snapshot._engine.format.manifest_io import open_linked
from snapshot._engine.tools import export as engine
from snapshot._engine.tools import export_folder
from snapshot.errors import CorruptSnapshotError, IncompatibleSnapshotError, InvalidArgumentError
from snapshot.options import Options, resolve
from snapshot.snapshot import Snapshot

# The names ``dtype`` accepts.
DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "f16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "f32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp64": torch.float64,
    "float64": torch.float64,
    "fp8": torch.float8_e4m3fn,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
FORMATS = ("safetensors", "torch")


def export(
    snapshot: Snapshot | str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    format: str = "safetensors",
    key: str | None = None,
    strip_prefix: str | None = None,
    dtype: str | torch.dtype | None = None,
    max_shard_size: str | int = "5GB",
    storage_options: dict[str, Any] | None = None,
    options: Options | None = None,
    overwrite: bool = False,
) -> list[str]:
    """Writes the tensors of ``snapshot`` (rank 0's view) into ``out_dir`` (a local folder,
    made if missing); returns the paths of the files written.

    Args:
        format: ``"safetensors"`` (``model.safetensors``, or ``model-0000i-of-0000N``
            files and ``model.safetensors.index.json``) or ``"torch"`` (``pytorch_model.bin``
            likewise; a torch file is built in memory, one file's tensors at a time).
        key: only this app_state key's tensors, named as its module names them
            (``0/model/layer.weight`` -> ``layer.weight``); without it, every key's, named
            ``model.layer.weight``.
        strip_prefix: removed from the start of every name that has it (``module.`` of a
            DDP-wrapped model, ``_orig_mod.`` of a compiled one).
        dtype: cast floating point tensors to this dtype (``"bf16"``, ``"fp16"``,
            ``torch.bfloat16``...); others keep theirs. Without it, every dtype is kept.
        max_shard_size: the largest file (``"5GB"``, ``"500MiB"``, or bytes); a tensor
            larger than that gets a file of its own.
        options: the memory budget (``memory_budget_bytes``) and checksums of the reads.
        overwrite: replace an earlier export in ``out_dir`` (only the files an export recorded
            writing there, once the new export is complete). Without it, a folder holding an
            export is refused.

    The files are written into a staging folder inside ``out_dir`` and put in place only when
    all of them are complete; on any failure ``out_dir`` is left as it was (an earlier export
    in it intact). Other files in ``out_dir`` (``config.json``...) are never touched.

    Values that are not tensors (step counters, optimizer hyperparameters) are skipped, and
    logged. Raises ``InvalidArgumentError`` for a bad argument, a ``key`` the snapshot lacks or
    a folder holding an export; ``UnsupportedValueError`` for a name or dtype safetensors
    cannot hold; ``CorruptSnapshotError`` (``ChecksumError`` for damaged bytes) or
    ``IncompatibleSnapshotError`` for a manifest restore would refuse, before anything is read.
    """
    if format not in FORMATS:
        raise InvalidArgumentError(f"export: format must be one of {FORMATS}, got {format!r}")
    out_dtype = _dtype(dtype)
    max_bytes = engine.parse_size(max_shard_size)
    resolved = resolve(options)
    if isinstance(snapshot, Snapshot):
        path = snapshot.path
        storage_options = (
            storage_options if storage_options is not None else snapshot.storage_options
        )
        manifest = snapshot._manifest
    else:
        path = os.fspath(snapshot)
        manifest = load_manifest(path, storage_options, resolved)
    out = os.fspath(out_dir)
    if "://" in out:
        raise InvalidArgumentError(f"export: out_dir must be a local folder, got {out!r}")
    t = engine.now()
    with _naming(path):
        sources, skipped = engine.collect(
            manifest, key=key, strip_prefix=strip_prefix, dtype=out_dtype, where=path
        )
    if not sources:
        raise InvalidArgumentError(
            f"export: snapshot {path} has no tensors under {key or 'any key'}"
        )
    files = engine.plan_files(sources, max_bytes)
    if format == "safetensors":
        engine.check_safetensors(files)
    export_folder.earlier_export(out, overwrite)  # refused now, before an hour of writing
    # A tile, a box's piece of it (for a box narrower than the tensor), the cast copy, and
    # the storage plugin's own buffer for a read (a bounce buffer for direct I/O): a quarter
    # of the budget each at most.
    tile = max(1 << 20, resolved.budget() // 4)
    write = engine.write_safetensors if format == "safetensors" else engine.write_torch
    verify = bool(resolved.checksums)
    with open_linked(path, manifest, storage_options, resolved) as plugin:
        with _naming(path):
            engine.check_claims(plugin, manifest, sources, resolved)
        written = export_folder.stage(
            out,
            overwrite,
            lambda folder: write(plugin, files, folder, tile, verify, resolved),
        )
    result = engine.Written(
        written, len(sources), sum(s.out_bytes for s in sources), skipped, engine.now() - t
    )
    engine.log_done(path, out, result)
    return written


@contextmanager
def _naming(path: str) -> Iterator[None]:
    """A refusal of the snapshot's manifest, named with the snapshot (the checks name the
    entry)."""
    try:
        yield
    except (CorruptSnapshotError, IncompatibleSnapshotError) as e:
        if path in str(e):
            raise
        raise type(e)(f"export: snapshot {path}: {e}") from e


def _dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    try:
        return DTYPES[str(value).lower()]
    except KeyError:
        raise InvalidArgumentError(
            f"export: dtype {value!r} is not one of {', '.join(sorted(DTYPES))}"
        ) from None


__all__ = ["export"]
