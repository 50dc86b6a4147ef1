"""Exporting a snapshot's tensors to files other tools load: safetensors (with a Hugging Face
index when split) or ``torch.save``. ``statesnap export`` is the same from the command line.

    from snapshot.export import export
    export("ckpt/step_1000", "hf_model", key="model", dtype="bf16", max_shard_size="5GB")

Streamed within the memory budget whatever the state's size; sharded tensors are consolidated
into full ones. The export appears whole or not at all, and a forged manifest is refused before
anything is allocated or written (``snapshot._engine.tools.export``).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from snapshot._engine.format.manifest_io import load_manifest, open_linked
from snapshot._engine.restore import checks as claims
from snapshot._engine.runtime import naming_snapshot, run
from snapshot._engine.tools import export as engine
from snapshot.errors import InvalidArgumentError
from snapshot.options import Options, resolve
from snapshot.snapshot import Snapshot

logger = logging.getLogger("snapshot")

# The names ``dtype`` accepts.
DTYPES = {
    **dict.fromkeys(("bf16", "bfloat16"), torch.bfloat16),
    **dict.fromkeys(("fp16", "f16", "float16", "half"), torch.float16),
    **dict.fromkeys(("fp32", "f32", "float32", "float"), torch.float32),
    **dict.fromkeys(("fp64", "float64"), torch.float64),
    **dict.fromkeys(("fp8", "float8_e4m3fn"), torch.float8_e4m3fn),
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
    """Writes the tensors of ``snapshot`` (rank 0's view) into the local folder ``out_dir``;
    returns the paths of the files written.

    Args:
        format: ``"safetensors"`` (``model.safetensors``, or ``model-0000i-of-0000N`` files and
            an index) or ``"torch"`` (``pytorch_model.bin`` likewise).
        key: only this app_state key's tensors, named as its module names them; without it,
            every key's, named ``model.layer.weight``.
        strip_prefix: removed from every name that starts with it (``module.``, ``_orig_mod.``).
        dtype: cast floating point tensors to this dtype (``"bf16"``, ``torch.float16``...).
        max_shard_size: the largest file (``"5GB"``, ``"500MiB"``, or bytes).
        options: the memory budget and checksums of the reads.
        overwrite: replace an earlier export in ``out_dir`` (once the new one is complete);
            without it, a folder holding an export is refused.

    The files are staged inside ``out_dir`` and put in place only once all are complete; on
    failure ``out_dir`` is as it was. Other files there are never touched; values that are not
    tensors are skipped and logged. Raises ``InvalidArgumentError``,
    ``UnsupportedValueError`` (what safetensors cannot hold), ``CorruptSnapshotError`` or
    ``IncompatibleSnapshotError`` (before anything is read).
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
    t = time.perf_counter()
    with naming_snapshot(path):
        sources, skipped = engine.collect(
            manifest, key=key, strip_prefix=strip_prefix, dtype=out_dtype, where=path
        )
    if not sources:
        raise InvalidArgumentError(
            f"export: snapshot {path} has no tensors under {key or 'any key'}"
        )
    files = engine.plan_files(sources, max_bytes)
    if format == "safetensors":  # every header built now, refusing what the format cannot hold
        for group in files:
            engine.safetensors_header(group)
    engine.earlier_export(out, overwrite)  # refused now, before an hour of writing
    # A tile, a box's piece of it, the cast copy and the plugin's read buffer: a quarter of
    # the budget each at most.
    tile = max(1 << 20, resolved.budget() // 4)
    with open_linked(path, manifest, storage_options, resolved) as plugin:
        # Restore's check of the sizes the manifest claims for every blob read (no overlapping
        # ranges; each blob holds its ranges), before anything is read or allocated.
        jobs = resolved.max_concurrent_io
        assert jobs is not None
        with naming_snapshot(path):
            blobs, _ = claims.claimed_blobs(manifest.view(0), [s.path for s in sources], {})
            run(
                claims.check_blob_sizes(
                    plugin, blobs, manifest.blob_sizes, jobs, resolved, before=True
                )
            )
        written = engine.stage(
            out,
            overwrite,
            lambda folder: engine.write_files(plugin, files, folder, format, tile, resolved),
        )
    skipped_note = f"; {len(skipped)} other values skipped" if skipped else ""
    logger.info(
        "exported %d tensors (%.1f MB) of %s to %d file(s) in %s in %.3f s%s",
        len(sources),
        sum(s.out_bytes for s in sources) / 1e6,
        path,
        len(written),
        out,
        time.perf_counter() - t,
        skipped_note,
    )
    return written


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
