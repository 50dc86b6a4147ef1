"""Runs the operations a user runs on a snapshot, each in a process of its own, and reports what
happened: ``python -m tests.hostile_probe < cases.json > results.json``.

Input: a JSON list of ``{"name", "url", "storage_options", "key", "options"}`` (``options``:
the fields of the :class:`~snapshot.Options` every operation runs with). For each, a child
forked from this process (which imports torch and the library once, and never touches a
snapshot itself) runs ``open`` (``Snapshot(url)`` and ``get_manifest``), ``read``
(``read_object(key)``), ``restore`` (into an empty ``StateDict`` per app_state key) and
``verify`` (``snapshot._engine.tools.verify.verify``), each on its own, and reports per operation the
exception's class name or ``ok`` (``problems`` for a verify that found some), whether
:data:`tests.hostile.SECRET` appeared in any value or message, and the child's peak resident
memory above what it held when forked. A child that has not finished in ``TIMEOUT`` seconds is
killed and reported as ``hang``.
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import select
import signal
import sys
import time
from typing import Any

import torch

from snapshot import Options, Snapshot, StateDict
from snapshot._engine.tools.verify import verify
from tests.hostile import SECRET

TIMEOUT = 60.0
OPERATIONS = ("open", "read", "restore", "verify")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _leaks(value: Any) -> bool:
    """Whether SECRET's bytes are in ``value`` (tensors by their raw bytes, the rest pickled)."""
    needle = SECRET[:12]
    if isinstance(value, torch.Tensor):
        t = value.detach().contiguous().view(-1)
        return needle in t.view(torch.uint8).numpy().tobytes() if t.numel() else False
    if isinstance(value, dict):
        return any(_leaks(v) for v in value.values())
    if isinstance(value, (list, tuple, set)):
        return any(_leaks(v) for v in value)
    try:
        return needle in pickle.dumps(value)
    except Exception:
        return needle in repr(value).encode()


def _one(op: str, case: dict[str, Any]) -> tuple[str, bool]:
    url, storage, key = case["url"], case["storage_options"], case["key"]
    try:
        options = Options(**case.get("options", {}))
        if op == "open":
            snap = Snapshot(url, storage_options=storage, options=options)
            return "ok", _leaks(dict(snap.get_manifest()))
        if op == "read":
            value = Snapshot(url, storage_options=storage, options=options).read_object(
                key, options=options
            )
            return "ok", _leaks(value)
        if op == "restore":
            snap = Snapshot(url, storage_options=storage, options=options)
            roots = {k.split("/")[1] for k in snap.get_manifest() if k.count("/") >= 1}
            state = {k: StateDict() for k in roots}
            snap.restore(state, options=options)
            return "ok", _leaks(state)
        report = verify(url, storage, options=options)
        text = repr(report).encode()
        return ("problems" if report.problems else "ok"), SECRET[:12] in text
    except Exception as e:  # the probe reports every outcome; the test judges it
        return type(e).__name__, SECRET[:12] in str(e).encode()


def _run_child(op: str, case: dict[str, Any], out: int) -> None:
    start = _rss_bytes()
    outcome, leaked = _one(op, case)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    os.write(out, json.dumps([outcome, leaked, max(0, peak - start)]).encode())


def probe(case: dict[str, Any], op: str) -> dict[str, Any]:
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one operation, then gone without running the parent's atexit
        os.close(read_end)
        code = 0
        try:
            _run_child(op, case, write_end)
        except BaseException:
            code = 1
        os._exit(code)
    os.close(write_end)
    deadline = time.monotonic() + TIMEOUT
    chunks: list[bytes] = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([read_end], [], [], left)[0]:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(read_end)
            return {"outcome": "hang", "leaked": False, "peak_bytes": 0}
        chunk = os.read(read_end, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(read_end)
    _, status = os.waitpid(pid, 0)
    if not chunks:
        return {"outcome": f"died (status {status})", "leaked": False, "peak_bytes": 0}
    outcome, leaked, peak = json.loads(b"".join(chunks))
    return {"outcome": outcome, "leaked": leaked, "peak_bytes": peak}


def main() -> None:
    cases = json.load(sys.stdin)
    results = {c["name"]: {op: probe(c, op) for op in c["ops"]} for c in cases}
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
