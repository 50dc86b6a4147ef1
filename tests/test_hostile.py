"""The hostile-snapshot corpus (tests/hostile.py) on local disk and on S3 (moto's server).

Each case is opened, read, restored and verified in a process of its own (tests/hostile_probe.py)
so that a hang is a timeout and memory is measured: every operation must end with the class the
case names, within a memory bound far below what the snapshot claims, and no byte of a file
outside the snapshot may come back in a value or a message.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import fsspec
import pytest

from snapshot._engine.tools.inspection import JOBS, PIECE_BYTES
from tests.hostile import CASES, Case, build, take_base
from tests.hostile_probe import OPERATIONS
from tests.s3server import S3Server

# One fixture builds and probes the whole corpus in subprocesses before the first case runs.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
# Peak memory an operation may add over the probe's own: the base snapshot is 16 KiB, and every
# amplifying case claims or would expand to a gigabyte or more.
MEMORY_BOUND = 96 << 20
# verify reads with buffers of its own, at most JOBS x PIECE_BYTES whatever the blobs claim (a
# claim over 16 MiB makes them full size): its bound is that much higher.
VERIFY_BOUND = MEMORY_BOUND + JOBS * PIECE_BYTES


def _upload(ws_root: Path, server: S3Server, bucket: str, prefix: str) -> str:
    """Copies the regular files of a built case to ``s3://bucket/prefix`` as they are."""
    fs = fsspec.filesystem("s3", **server.storage_options())
    for path in sorted(ws_root.rglob("*")):
        if path.is_file() and not path.is_symlink():
            fs.pipe_file(f"{bucket}/{prefix}/{path.relative_to(ws_root)}", path.read_bytes())
    return f"s3://{bucket}/{prefix}"


def _request(case: Case, url: str, options: dict | None) -> dict:
    return {
        "name": f"{case.name}@{'s3' if url.startswith('s3://') else 'fs'}",
        "url": url,
        "storage_options": options,
        "key": case.key,
        # No retries: each operation ends at its first storage error.
        "options": {"io_retries": 0, **case.options},
        "ops": [op for op in OPERATIONS if op in case.expect],
    }


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory, worker_id: str, s3_server: S3Server) -> dict:
    """Every case built on every store it applies to, probed once per run: under xdist the
    first worker to get here probes and leaves the outcomes in the run's shared temporary
    folder, under a lock the others wait on."""
    if worker_id == "master":
        return _probe_all(tmp_path_factory, s3_server)
    shared = tmp_path_factory.getbasetemp().parent  # one per run, shared by its workers
    found = shared / "hostile-outcomes.json"
    with open(shared / "hostile-outcomes.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not found.exists():
            found.write_text(json.dumps(_probe_all(tmp_path_factory, s3_server)))
    return json.loads(found.read_text())


def _probe_all(tmp_path_factory, s3_server: S3Server) -> dict:
    base = tmp_path_factory.mktemp("hostile") / "base"
    take_base(base)
    bucket = s3_server.new_bucket()
    requests = []
    for case in CASES:
        ws = build(case, base, tmp_path_factory.mktemp(case.name))
        if "fs" in case.stores:
            requests.append(_request(case, str(ws.root), None))
        if "s3" in case.stores:
            url = _upload(ws.root, s3_server, bucket, case.name)
            requests.append(_request(case, url, s3_server.storage_options()))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "tests.hostile_probe"],
        input=json.dumps(requests),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


PARAMS = [
    pytest.param(case, store, id=f"{case.name}@{store}")
    for case in CASES
    for store in ("fs", "s3")
    if store in case.stores
]


@pytest.mark.parametrize(("case", "store"), PARAMS)
def test_hostile_snapshot(outcomes: dict, case: Case, store: str) -> None:
    results = outcomes[f"{case.name}@{store}"]
    got = {op: r["outcome"] for op, r in results.items()}
    assert got == case.expect, results
    for op, r in results.items():
        assert not r["leaked"], f"{op}: bytes from outside the snapshot came back"
        bound = VERIFY_BOUND if op == "verify" else MEMORY_BOUND
        assert r["peak_bytes"] < bound, f"{op}: peak {r['peak_bytes'] >> 20} MiB"


def test_the_corpus_covers_every_family() -> None:
    assert {c.family for c in CASES} == {"outside", "cost", "errors"}
    assert len({c.name for c in CASES}) == len(CASES)
