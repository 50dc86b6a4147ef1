"""``statesnap export``: a snapshot's tensors as safetensors (or torch) files
(``snapshot.export``)."""

from __future__ import annotations

import argparse

from snapshot._engine.format.text import printable
from snapshot._engine.tools.cli_commands import _write_lines


def run_export(args: argparse.Namespace) -> int:
    from snapshot.export import export

    files = export(
        args.snapshot,
        args.out,
        format=args.format,
        key=args.key,
        strip_prefix=args.strip_prefix,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        storage_options=args.storage_options,
        overwrite=args.overwrite,
    )
    _write_lines([f"wrote {printable(f)}" for f in files])
    return 0


def add_parser(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "export",
        parents=[common],
        help="write a snapshot's tensors as safetensors (or torch) files",
        description="Writes the tensors of SNAPSHOT (rank 0's; sharded ones consolidated) into "
        "the local folder OUT, streamed within the memory budget "
        "(STATESNAP_MEMORY_BUDGET_BYTES): model.safetensors, or model-0000i-of-0000N."
        "safetensors files with model.safetensors.index.json when larger than "
        "--max-shard-size. The export is put in place only once every file is whole; a "
        "folder holding an earlier export is refused unless --overwrite. Values that are not "
        "tensors are skipped.",
    )
    p.add_argument("snapshot", metavar="SNAPSHOT", help="the snapshot (local path or URL)")
    p.add_argument("out", metavar="OUT", help="the folder to write into (made if missing)")
    p.add_argument("--format", choices=("safetensors", "torch"), default="safetensors")
    p.add_argument("--key", help="only this app_state key, named as its module names them (model)")
    p.add_argument("--strip-prefix", help="removed from the start of names (module.)")
    p.add_argument("--dtype", help="cast floating point tensors (bf16, fp16, fp32, fp8)")
    p.add_argument(
        "--max-shard-size", default="5GB", help="the largest file (default 5GB; 500MiB...)"
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier export in OUT (only the files an export recorded writing, "
        "once the new one is complete)",
    )
    p.set_defaults(func=run_export)
