"""One measured operation in a fresh process: ``python -m benchmarks.worker JOB.json``.

The job file says what to do; the worker writes its result as JSON to the job's ``result``
path (stdout and stderr stay free for whatever the libraries print). Ops:

``take``         generate the state, then time ``Writer.save`` (plus, in the fsync'd mode, the
                 harness's fsync of every file and directory for methods that do not fsync).
``restore``      allocate and touch the targets (for readers that load in place), then time
                 ``Reader.load``; afterwards compare the result bitwise with the generated state.
``read-object``  statesnap only: time ``Snapshot(path)`` and ``read_object`` of one tensor
                 separately, with the ``/proc/self/io`` counters around each.

Peak RSS is measured above the RSS right before the timed region (see ``common.PeakRSS``).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

import torch

from benchmarks.common import (
    PeakRSS,
    build_spec,
    check_restored,
    fsync_tree,
    generate_state,
    io_delta,
    make_targets,
    proc_io,
    tree_size,
)
from benchmarks.methods import READERS, WRITERS, statesnap_path


def _take(job: dict[str, Any]) -> dict[str, Any]:
    writer = WRITERS[job["method"]]
    writer.prepare()
    spec = build_spec(job["state"])
    fsync = job["mode"] == "fsync"
    path = job["path"]
    os.makedirs(path, exist_ok=True)
    state = generate_state(spec, with_objects=writer.objects)
    io0 = proc_io()
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        writer.save(spec, state, path, fsync)
        if fsync and not writer.self_fsync:
            fsync_tree(path)
        seconds = time.perf_counter() - t0
    io = io_delta(io0, proc_io())
    return {
        "ok": True,
        "seconds": seconds,
        "payload_bytes": spec.nbytes,
        "peak_rss_above_baseline": mem.above_baseline,
        "baseline_rss": mem.baseline,
        "rss_method": mem.method,
        "disk": tree_size(path),
        "io": io,
        "check": {"ok": True, "detail": "n/a (take)"},
    }


def _restore(job: dict[str, Any]) -> dict[str, Any]:
    reader = READERS[job["method"]]
    reader.prepare()
    spec = build_spec(job["state"])
    targets = make_targets(spec, with_objects=reader.objects) if reader.into_targets else None
    pointers = (
        {(t.group, t.name): targets[t.group][t.name].data_ptr() for t in spec.tensors}
        if targets is not None
        else {}
    )
    io0 = proc_io()
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        restored = reader.load(spec, job["path"], targets)
        seconds = time.perf_counter() - t0
    io = io_delta(io0, proc_io())
    check = reader.verify(spec, restored, reader.objects)
    in_place = None
    if pointers and isinstance(restored, dict):
        in_place = all(
            isinstance(restored.get(g, {}).get(n), torch.Tensor)
            and restored[g][n].data_ptr() == ptr
            for (g, n), ptr in pointers.items()
        )
    return {
        "ok": True,
        "seconds": seconds,
        "payload_bytes": spec.nbytes,
        "peak_rss_above_baseline": mem.above_baseline,
        "baseline_rss": mem.baseline,
        "rss_method": mem.method,
        "io": io,
        "check": check.as_dict(),
        "in_place": in_place,
    }


def _read_object(job: dict[str, Any]) -> dict[str, Any]:
    from snapshot import Snapshot

    spec = build_spec(job["state"])
    group, name = job["object"]
    tensor_spec = spec.find(group, name)
    key = f"0/{group}/{name}"
    path = statesnap_path(job["path"])
    out = torch.zeros(tensor_spec.shape, dtype=tensor_spec.dtype)
    phases: dict[str, Any] = {}

    def measure(label: str, fn: Any) -> Any:
        io0 = proc_io()
        t0 = time.perf_counter()
        value = fn()
        phases[label] = {"seconds": time.perf_counter() - t0, **io_delta(io0, proc_io())}
        return value

    measure("(nothing: the cost of reading the counters)", lambda: None)
    snap = measure("Snapshot(path)", lambda: Snapshot(path))
    value = measure(f"read_object({key!r})", lambda: snap.read_object(key))
    measure(f"read_object({key!r}, obj_out=...)", lambda: snap.read_object(key, obj_out=out))
    checks = [
        check_restored(spec, {group: {name: v}}, False, iter([tensor_spec])) for v in (value, out)
    ]
    bad = [c.detail for c in checks if not c.ok]
    return {
        "ok": True,
        "seconds": sum(p["seconds"] for k, p in phases.items() if not k.startswith("(")),
        "payload_bytes": tensor_spec.nbytes,
        "phases": phases,
        "manifest_bytes": os.path.getsize(os.path.join(path, "manifest.yaml"))
        if os.path.exists(os.path.join(path, "manifest.yaml"))
        else None,
        "snapshot_bytes": tree_size(path)["apparent"],
        "check": {"ok": not bad, "detail": bad[0] if bad else "ok (both reads bitwise equal)"},
    }


OPS = {"take": _take, "restore": _restore, "read-object": _read_object}


def main() -> None:
    with open(sys.argv[1]) as f:
        job = json.load(f)
    try:
        result = OPS[job["op"]](job)
    except BaseException as e:  # reported to the harness, which shows it in the table
        result = {
            "ok": False,
            "error": f"{type(e).__name__}: {e}".strip()[:500],
            "traceback": traceback.format_exc()[-4000:],
        }
    with open(job["result"], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
