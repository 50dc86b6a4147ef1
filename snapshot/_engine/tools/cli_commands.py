"""What the command line's commands compute and print (:mod:`snapshot.cli` parses the
arguments and calls ``run_<command>``): ``ls``, ``show``, ``verify``, ``du``, ``diff``,
``export``, ``steps`` and ``prune``, formatted as aligned tables, sizes for people and a
progress bar on a terminal (:mod:`.output`), or with ``--json`` as one JSON document (the keys
are documented in docs/cli.md: a change here is a change there). Whatever comes from a snapshot
is printed through :mod:`snapshot._engine.format.text`, so a hostile key's control characters
are shown escaped; JSON escapes every character outside ASCII itself.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from snapshot._engine.format.manifest_io import load_manifest
from snapshot._engine.format.text import printable, printable_message
from snapshot._engine.manager.retention import Policy, Step, to_delete
from snapshot._engine.manager.steps import INCOMPLETE, LEFT, UNREADABLE, Steps
from snapshot._engine.tools.inspection import (
    Listing,
    Usage,
    brief,
    disk_usage,
    format_shape,
    list_entries,
    read_entry,
    summarize_tensor,
)
from snapshot._engine.tools.locate import snapshot_at
from snapshot._engine.tools.output import (
    Progress,
    count,
    fit,
    human_bytes,
    say,
    size,
    some,
    table,
    width,
    write_json,
    write_lines,
)
from snapshot._engine.tools.verify import diff, verify
from snapshot.errors import InvalidArgumentError, SnapshotError
from snapshot.options import Options


def _open(args: argparse.Namespace, name: str = "path") -> str:
    """The snapshot a command opens for ``args.<name>``: the path itself, or the latest
    committed step or version inside a manager's root or a Lightning checkpoint, said on
    stderr (``locate.snapshot_at``)."""
    path, what = snapshot_at(getattr(args, name), args.storage_options)
    if what:
        say(f"statesnap: opening the latest committed {what}, {printable(path)}")
    return path


# ---------------------------------------------------------------------------------------------
# ls


def _totals(totals: Listing | Usage) -> dict[str, Any]:
    return {
        "nbytes": totals.nbytes,
        "stored_bytes": totals.stored_bytes,
        "base_bytes": totals.base_bytes,
        "bases": list(totals.bases),
    }


def run_ls(args: argparse.Namespace) -> int:
    path = _open(args)
    listing = list_entries(load_manifest(path, args.storage_options), prefix=args.prefix)
    if args.json:
        records = [
            {
                "path": r.path,
                "kind": r.kind,
                "dtype": r.dtype or None,
                "shape": list(r.shape) if r.shape is not None else None,
                "nbytes": r.nbytes,
                "replicated": r.replicated,
                "base": r.base or None,
            }
            for r in listing.rows
        ]
        total = {"entries": len(records), "tensors": listing.tensors, **_totals(listing)}
        write_json({"path": path, "entries": records, "total": total})
        return 0
    exact = args.bytes
    header = ["PATH", "KIND", "DTYPE", "SHAPE", "SIZE"]
    replicated = any(r.replicated for r in listing.rows)
    in_base = any(r.base for r in listing.rows)
    header += ["REPLICATED"] * replicated + ["IN BASE"] * in_base
    rows = []
    for r in listing.rows:
        row = [
            printable(r.path),
            r.kind,
            printable(r.dtype) if r.dtype else "-",
            format_shape(r.shape) if r.shape is not None else "-",
            size(r.nbytes, exact) if r.nbytes or r.kind in ("tensor", "object") else "-",
        ]
        row += ["yes" if r.replicated else ""] * replicated + [printable(r.base)] * in_base
        rows.append(row)
    lines = table(header, rows, right={4})
    counts = f"{count(len(rows), 'entry')}, {count(listing.tensors, 'tensor')}"
    lines.append(_total(counts, listing, "shared and replicated ranges counted once", exact))
    write_lines(fit(lines, None if args.wide else width()))
    return 0


def _total(counts: str, totals: Listing | Usage, once: str, exact: bool) -> str:
    """The last line of ``ls`` and ``du``: what is listed, and what the blobs hold of it."""
    nbytes, stored, in_bases = totals.nbytes, totals.stored_bytes, totals.base_bytes
    total = f"total: {counts}, {size(nbytes, exact)}" + ("" if exact else f" ({nbytes:,} bytes)")
    if stored != nbytes:
        total += f"; {size(stored, exact)} stored ({once})"
    if in_bases:
        names = ", ".join(map(printable, totals.bases))
        total += f"; {size(in_bases, exact)} of it in base snapshots ({names})"
    return total


# ---------------------------------------------------------------------------------------------
# show


def _number(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        text = f"{value:.6g}"
        # 1.0, not 1: say it is a float
        return text if any(c in text for c in ".enia") else text + ".0"
    if isinstance(value, complex):
        return f"({value.real:.6g}{value.imag:+.6g}j)"
    return str(value)


def run_show(args: argparse.Namespace) -> int:
    path = _open(args)
    key, entry, value = read_entry(path, args.key, args.storage_options)
    document: dict[str, Any] = {"path": path, "key": key, "kind": entry.tag}
    name = printable(key)
    lines = []
    if isinstance(value, torch.Tensor):
        s = summarize_tensor(value, values=args.values)
        document["tensor"] = {
            "dtype": s.dtype,
            "shape": list(s.shape),
            "numel": s.numel,
            "nbytes": s.nbytes,
            "min": s.min,
            "max": s.max,
            "mean": s.mean,
            "nonfinite": s.nonfinite,
            "values": s.values,
        }
        lines.append(f"{name}: tensor")
        lines.append(f"  dtype   {printable(s.dtype)}")
        lines.append(f"  shape   {format_shape(s.shape)}")
        lines.append(f"  numel   {s.numel:,}")
        lines.append(f"  size    {human_bytes(s.nbytes)} ({s.nbytes:,} bytes)")
        lines.append(f"  min     {_number(s.min)}")
        lines.append(f"  max     {_number(s.max)}")
        lines.append(f"  mean    {_number(s.mean)}")
        if s.nonfinite:
            lines.append(f"  nan/inf {s.nonfinite:,} (min, max and mean are of the finite values)")
        if s.values is None:
            lines.append("  values  n/a")
        else:
            shown = ", ".join(_number(v) for v in s.values)
            more = f", ... ({s.numel - len(s.values):,} more)" if s.numel > len(s.values) else ""
            lines.append(f"  values  [{shown}{more}]")
    else:
        # Its type, length (containers, str, bytes) and repr: whole with --full, else with
        # long containers, strings and bytes cut (``inspection.brief``).
        cls = type(value)
        qualified = f"{cls.__module__}.{cls.__name__}"
        type_name = cls.__qualname__ if cls.__module__ == "builtins" else qualified
        about = [printable(type_name)] if type_name != entry.tag else []
        length = len(value) if isinstance(value, (dict, list, tuple, set, str, bytes)) else None
        if length is not None:
            about.append(f"length {length:,}")
        if entry.nbytes:
            about.append(f"{human_bytes(entry.nbytes)} stored")
        text = repr(value) if args.full else brief(value, args.values, args.max_chars)
        document.update(type=type_name, length=length, nbytes=entry.nbytes, repr=text)
        lines.append(f"{name}: {printable(entry.tag)} ({', '.join(about)})")
        lines.append(printable_message(text))
    if args.json:
        write_json(document)
    else:
        write_lines(lines)
    return 0


# ---------------------------------------------------------------------------------------------
# verify


def run_sign(args: argparse.Namespace) -> int:
    from snapshot import signing

    path = _open(args)
    key = signing.SigningKey.load(args.key)
    statement = signing.sign(path, key, storage_options=args.storage_options)
    blobs, bases = statement["predicate"]["blobs"], statement["predicate"]["bases"]
    if args.json:
        write_json(
            {
                "path": path,
                "signature": signing.SIGNATURE_NAME,
                "algorithm": key.algorithm,
                "keyid": key.key_id,
                "manifest_sha256": statement["subject"][0]["digest"]["sha256"],
                "blobs": len(blobs),
                "bytes": sum(b["size"] for b in blobs),
                "bases": [b["name"] for b in bases],
            }
        )
        return 0
    write_lines(
        [
            f"sign: signed {printable(path)} with {key.algorithm} key {key.key_id}: "
            f"{count(len(blobs), 'blob')}, {human_bytes(sum(b['size'] for b in blobs))} hashed"
            + (f", {count(len(bases), 'base')}" if bases else "")
        ]
    )
    return 0


def _verify_signature(args: argparse.Namespace, path: str) -> int:
    from snapshot import signing

    if not args.key:
        raise InvalidArgumentError("verify --signature needs --key (the public key or secret)")
    key = signing.SigningKey.load(args.key)
    try:
        statement = signing.verify(path, key, storage_options=args.storage_options)
    except signing.SignatureError as e:
        if not args.json:
            raise
        problem: dict[str, Any] | None = {"file": e.file, "what": str(e)}
        unsigned = isinstance(e, signing.UnsignedSnapshotError)
        blobs: list[Any] = []
        bases: list[Any] = []
    else:
        problem, unsigned = None, False
        blobs, bases = statement["predicate"]["blobs"], statement["predicate"]["bases"]
    if args.json:
        write_json(
            {
                "path": path,
                "ok": problem is None,
                "signed": not unsigned,
                "algorithm": key.algorithm,
                "keyid": key.key_id,
                "blobs": len(blobs),
                "bytes": sum(b["size"] for b in blobs),
                "bases": [b["name"] for b in bases],
                "problem": problem,
            }
        )
        return 0 if problem is None else 1
    write_lines(
        [
            f"verify: OK: signature of {printable(path)} verified with {key.algorithm} key "
            f"{key.key_id}; {count(len(blobs), 'blob')}, "
            f"{human_bytes(sum(b['size'] for b in blobs))} hashed"
            + (f", {count(len(bases), 'base')} verified" if bases else "")
        ]
    )
    return 0


def run_verify(args: argparse.Namespace) -> int:
    path = _open(args)
    if args.signature:
        return _verify_signature(args, path)
    progress = Progress("verify", "blobs", quiet=args.json)
    try:
        report = verify(path, args.storage_options, jobs=args.jobs, progress=progress)
    finally:
        progress.close()
    if args.json:
        found = [
            {"blob": p.blob, "start": p.start, "end": p.end, "paths": list(p.paths), "what": p.what}
            for p in report.problems
        ]
        write_json(
            {
                "path": path,
                "ok": report.ok,
                "entries": report.entries,
                "blobs": report.blobs,
                "bytes_read": report.bytes_read,
                "ranges": report.ranges,
                "checksums_checked": report.checksums_checked,
                "checksums_missing": report.checksums_missing,
                "sizes_unknown": report.sizes_unknown,
                "foreign": report.foreign,
                "decoded": report.decoded,
                "not_decoded": report.not_decoded,
                "problems": found,
            }
        )
        return 0 if report.ok else 1
    lines = []
    for p in report.problems:
        who = ", ".join(map(printable, p.paths)) + ": " if p.paths else ""
        lines.append(
            f"{who}blob {printable(p.blob)}, bytes [{p.start}, {p.end}): "
            f"{printable_message(p.what)}"
        )
    unknown = report.sizes_unknown
    if unknown:
        lines.append(
            f"note: size not checked for {count(len(unknown), 'blob')} ({some(unknown)}): the "
            "store cannot tell their size, so bytes added after the take go unnoticed"
        )
    if report.checksums_missing:
        why = (
            f"{printable(report.foreign)} records none"
            if report.foreign
            else "taken with checksums off (Options(checksums=False) or STATESNAP_CHECKSUMS=0)"
        )
        decoded = (
            f" (and the {count(report.decoded, 'pickled value')} among them by decoding)"
            if report.decoded
            else ""
        )
        lines.append(
            f"note: checksums were not recorded for {report.checksums_missing:,} of "
            f"{report.ranges:,} byte ranges ({why}): those were checked for size and "
            f"readability only{decoded}"
        )
    if report.not_decoded:
        lines.append(
            f"note: not decoded, so not checked: {some(report.not_decoded)} (a type the safe "
            "loader does not allow; see `statesnap show` for the type to pass to "
            "torch.serialization.add_safe_globals)"
        )
    summary = (
        f"{count(report.entries, 'entry')}, {count(report.blobs, 'blob')}, "
        f"{human_bytes(report.bytes_read)} read, "
        f"{count(report.checksums_checked, 'checksum')} checked"
    )
    if report.ok:
        lines.append(f"verify: OK: {summary}")
    else:
        problems = count(len(report.problems), "problem")
        blobs = count(len({p.blob for p in report.problems}), "blob")
        affected = count(len({path for p in report.problems for path in p.paths}), "entry")
        lines.append(f"verify: FAILED: {problems} in {blobs}, {affected} affected; {summary}")
    write_lines(lines)
    return 0 if report.ok else 1


# ---------------------------------------------------------------------------------------------
# du


def run_du(args: argparse.Namespace) -> int:
    path = _open(args)
    progress = Progress("du", "entries", quiet=args.json)
    try:
        usage = disk_usage(load_manifest(path, args.storage_options), progress=progress)
    finally:
        progress.close()
    if args.json:
        records = [
            {
                "rank": r.rank,
                "key": r.key,
                "entries": r.entries,
                "nbytes": r.nbytes,
                "replicated_bytes": r.replicated_bytes,
            }
            for r in usage.rows
        ]
        totals = {
            "entries": usage.entries,
            "replicated_bytes": usage.replicated_bytes,
            **_totals(usage),
        }
        document = {"path": path, "rows": records, "rank_bytes": usage.rank_bytes, "total": totals}
        write_json(document)
        return 0
    exact = args.bytes
    header = ["RANK", "KEY", "ENTRIES", "SIZE", "REPLICATED", "SHARE"]
    rows = [
        [
            printable(r.rank),
            printable(r.key),
            f"{r.entries:,}",
            size(r.nbytes, exact),
            size(r.replicated_bytes, exact) if r.replicated_bytes else "-",
            f"{100 * r.nbytes / usage.nbytes:.1f}%" if usage.nbytes else "-",
        ]
        for r in usage.rows
    ]
    lines = table(header, rows, right={2, 3, 4, 5})
    if len(usage.rank_bytes) > 1:
        lines.append(
            "per rank: "
            + ", ".join(
                f"rank {printable(k)} {size(v, exact)}" for k, v in usage.rank_bytes.items()
            )
        )
    once = "replicated entries and shared tensors counted once"
    lines.append(_total(count(usage.entries, "entry"), usage, once, exact))
    write_lines(lines)
    return 0


# ---------------------------------------------------------------------------------------------
# diff


def run_diff(args: argparse.Namespace) -> int:
    path_a, path_b = _open(args, "path_a"), _open(args, "path_b")
    progress = Progress("diff", "entries", quiet=args.json)
    try:
        report = diff(path_a, path_b, args.storage_options, jobs=args.jobs, progress=progress)
    finally:
        progress.close()
    if args.json:
        differences = [
            {"path": d.path, "what": d.what, "detail": d.detail} for d in report.differences
        ]
        write_json(
            {
                "a": report.path_a,
                "b": report.path_b,
                "identical": report.identical,
                "entries_a": report.entries_a,
                "entries_b": report.entries_b,
                "compared_by_reading": report.compared_by_reading,
                "differences": differences,
            }
        )
        return 0 if report.identical else 1
    lines = [f"A: {printable(report.path_a)}", f"B: {printable(report.path_b)}"]
    width = max((len(d.what) for d in report.differences), default=0)
    for d in report.differences:
        detail = (
            f": {printable_message(d.detail)}" if d.detail and not d.what.startswith("only") else ""
        )
        lines.append(f"{d.what.ljust(width)}  {printable(d.path)}{detail}")
    read = (
        f"; {count(report.compared_by_reading, 'entry')} compared by reading their bytes "
        "(no checksums recorded)"
        if report.compared_by_reading
        else ""
    )
    if report.identical:
        lines.append(f"identical: {count(report.entries_a, 'entry')}{read}")
    else:
        a, b = count(report.entries_a, "entry"), count(report.entries_b, "entry")
        lines.append(f"{count(len(report.differences), 'difference')} (A: {a}, B: {b}){read}")
    write_lines(lines)
    return 0 if report.identical else 1


# ---------------------------------------------------------------------------------------------
# export


def run_export(args: argparse.Namespace) -> int:
    from snapshot.export import export

    names = ("format", "key", "strip_prefix", "dtype", "max_shard_size", "overwrite")
    flags = {name: getattr(args, name) for name in names}
    path = _open(args, "snapshot")
    progress = Progress("export", "files")
    try:
        files = export(
            path, args.out, storage_options=args.storage_options, progress=progress, **flags
        )
    finally:
        progress.close()
    write_lines([f"wrote {printable(f)}" for f in files])
    return 0


# ---------------------------------------------------------------------------------------------
# steps and prune: a checkpoint manager's step folders (``snapshot.manager``)


def run_steps(args: argparse.Namespace) -> int:
    steps = Steps(args.root, args.storage_options, Options.from_env())
    found = steps.scan()
    committed = [s for s in found if s.committed]
    latest = committed[-1].step if committed else None
    if args.json:
        records = [
            {
                "step": s.step,
                "state": s.state.replace(" ", "-"),
                "folder": s.name,
                "path": steps.path(s.name),
                "nbytes": s.nbytes if s.committed else None,
                "metrics": dict(s.metrics),
                "bases": list(s.bases),
                "reason": s.reason or None,
            }
            for s in found
        ]
        summary = {"committed": len(committed), "latest": latest}
        write_json({"root": args.root, "steps": records, **summary})
        return 0
    exact = args.bytes
    rows = []
    for s in found:
        metrics = json.dumps(s.metrics, sort_keys=True) if s.metrics else "-"
        rows.append(
            [
                str(s.step),
                s.state.replace(" ", "-"),
                size(s.nbytes, exact) if s.committed else "-",
                printable(metrics),
                printable(",".join(s.bases)) or "-",
                printable(s.name),
            ]
        )
    lines = table(["STEP", "STATE", "SIZE", "METRICS", "BASES", "FOLDER"], rows, right={0, 2})
    lines.append(
        f"{len(committed)} committed, {len(found) - len(committed)} incomplete, unreadable "
        f"or left alone; latest: {latest if latest is not None else 'none'}"
    )
    for s in found:
        if s.state in (UNREADABLE, LEFT):
            lines.append(f"{printable(s.name)}: {s.state}: {printable(s.reason)}")
    write_lines(lines)
    return 0


def run_prune(args: argparse.Namespace) -> int:
    policy = Policy(args.keep_last, args.keep_every, args.keep_best, args.metric, args.mode)
    if policy.keeps_everything:
        raise InvalidArgumentError(
            "prune: give at least one of --keep-last, --keep-every, --keep-best"
        )
    steps = Steps(args.root, args.storage_options, Options.from_env())
    found = steps.scan()
    committed = [Step(s.step, s.name, s.metrics, s.bases) for s in found if s.committed]
    unreadable = [s.name for s in found if s.state == UNREADABLE]
    doomed = to_delete(policy, committed, unreadable=unreadable)
    # Debris of takes only when asked (a running job's take may be under way in one).
    debris = [s for s in found if s.state == INCOMPLETE] if args.incomplete else []
    lines = []
    verb = "would delete" if args.dry_run else "deleted"
    gone = set()
    todo = [s.name for s in doomed] + [s.name for s in debris]
    progress = Progress("prune", "steps", quiet=args.dry_run or not todo)
    try:
        for done, name in enumerate(todo):
            progress(done, len(todo))
            path = printable(steps.path(name))
            if not args.dry_run:
                try:
                    steps.delete(name)
                except SnapshotError as e:
                    lines.append(f"kept {path}: {printable(str(e))}")
                    continue
            gone.add(name)
            lines.append(f"{verb} {path}")
        progress(len(todo), len(todo))
    finally:
        progress.close()
    for s in found:
        if s.state in (UNREADABLE, LEFT):
            lines.append(f"left alone {printable(steps.path(s.name))}: {printable(s.reason)}")
    if unreadable and to_delete(policy, committed):
        lines.append(
            "no committed step deleted: a step that cannot be read may need any other as its base"
        )
    kept = sorted(s.step for s in committed if s.name not in gone)
    lines.append(f"kept {len(kept)} committed step(s): {', '.join(map(str, kept)) or 'none'}")
    write_lines(lines)
    return 0
