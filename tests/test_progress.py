"""``progress=`` of take, async_take and restore: records of the bytes each rank completes, a
bar on a terminal (nothing drawn elsewhere), a callable that raises logged and ignored; and the
one INFO line per operation, with or without progress."""

from __future__ import annotations

import itertools
import logging
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from snapshot import InvalidArgumentError, Options, Snapshot, StateDict
from snapshot.options import Progress
from tests.helpers import on_terminal
from tests.multirank import run_ranks

ROOT = Path(__file__).resolve().parents[1]
# Small payloads are written alone, one blob each: a take of a few tensors has a few items.
APART = Options(slab_threshold_bytes=0)


def _state(scale: int = 1) -> dict:
    return {
        "model": torch.nn.Linear(40 * scale, 30),
        "extra": StateDict(big=torch.arange(5000.0 * scale), step=3, name="run"),
    }


def _blob_bytes(path: str | Path, under: str = "") -> tuple[int, int]:
    """(bytes, files) of the snapshot's blobs (all but the manifest), under ``under``."""
    sizes = [
        os.path.getsize(os.path.join(d, f))
        for d, _, files in os.walk(os.path.join(path, under))
        for f in files
        if f != "manifest.yaml"
    ]
    return sum(sizes), len(sizes)


class Recorder:
    """A progress callable keeping each record and the name of the thread that gave it."""

    def __init__(self) -> None:
        self.records: list[Progress] = []
        self.threads: list[str] = []

    def __call__(self, record: Progress) -> None:
        self.records.append(record)
        self.threads.append(threading.current_thread().name)


def _check_records(records: list[Progress], operation: str, path: str) -> Progress:
    """Records of one operation: from nothing done, growing, to the totals; the last one."""
    assert records, "no progress was reported"
    first, last = records[0], records[-1]
    assert (first.done_bytes, first.done_items) == (0, 0)
    for before, after in itertools.pairwise(records):
        assert after.done_bytes >= before.done_bytes and after.done_items == before.done_items + 1
    assert {(r.operation, r.path, r.rank) for r in records} == {(operation, path, 0)}
    assert {(r.total_bytes, r.total_items) for r in records} == {
        (last.total_bytes, last.total_items)
    }
    assert (last.done_bytes, last.done_items) == (last.total_bytes, last.total_items)
    assert len(records) == last.total_items + 1
    return last


def test_take_and_restore_report_their_bytes_up_to_the_snapshots(tmp_path):
    path = str(tmp_path / "snap")
    state, took = _state(), Recorder()
    Snapshot.take(path, state, options=APART, progress=took)
    last = _check_records(took.records, "take", path)
    assert (last.total_bytes, last.total_items) == _blob_bytes(path)
    assert last.total_items >= 3
    # The first once planned, on the caller's thread; each blob's on the I/O thread.
    assert took.threads[0] == threading.current_thread().name
    assert set(took.threads[1:]) == {"statesnap-io"}

    restored, read = _state(), Recorder()
    Snapshot(path).restore(restored, progress=read)
    last = _check_records(read.records, "restore", path)
    assert last.total_bytes == _blob_bytes(path)[0]  # every blob read, once
    assert set(read.threads[1:]) == {"statesnap-io"}
    assert torch.equal(restored["model"].weight, state["model"].weight)
    assert torch.equal(restored["extra"]["big"], state["extra"]["big"])


def test_async_take_reports_after_the_call_returns_until_wait(tmp_path):
    path = str(tmp_path / "snap")
    returned = threading.Event()
    seen: list[tuple[Progress, bool]] = []

    def report(record: Progress) -> None:
        if record.done_items:  # a blob written: on the I/O thread, held until the call returned
            returned.wait(60)
        seen.append((record, returned.is_set()))

    pending = Snapshot.async_take(path, _state(), options=APART, progress=report)
    returned.set()
    # Before the call returned: the first record only (nothing written yet).
    assert [r.done_items for r, after in seen if not after] == [0]
    snap = pending.wait(timeout=120)
    records = [r for r, _ in seen]
    last = _check_records(records, "take", path)
    assert all(after for r, after in seen if r.done_items)
    assert (last.total_bytes, last.total_items) == _blob_bytes(snap.path)


@pytest.mark.parametrize("progress", [False, True, "callable"])
def test_each_operation_logs_one_info_line_with_path_bytes_and_seconds(tmp_path, caplog, progress):
    wanted = Recorder() if progress == "callable" else progress
    caplog.set_level(logging.INFO, logger="snapshot")
    took, pended = str(tmp_path / "took"), str(tmp_path / "pended")
    state = _state()
    Snapshot.take(took, state, progress=wanted)
    Snapshot(took).restore(_state(), progress=wanted)
    Snapshot.async_take(pended, state, progress=wanted).wait(timeout=120)

    def lines(pattern: str) -> list[str]:
        found = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
        return [m for m in found if re.search(pattern, m)]

    mb_in_s = r"[\d.]+ MB in [\d.]+ s"
    assert len(lines(rf"^took snapshot {re.escape(took)} .*{mb_in_s}")) == 1
    assert len(lines(rf"^restored .* from {re.escape(took)}: {mb_in_s}")) == 1
    assert len(lines(rf"^took snapshot {re.escape(pended)} .*{mb_in_s}")) == 1
    # progress=True without a terminal logs a line each tenth instead of drawing a bar.
    tenths = lines(rf"^take {re.escape(took)}: \d+%")
    if progress is True:
        assert tenths[0].startswith(f"take {took}: 0% (0.0 of ") and ": 100% (" in tenths[-1]
    else:
        assert tenths == []


def test_a_callable_that_raises_is_logged_once_and_the_operation_goes_on(tmp_path, caplog):
    path = str(tmp_path / "snap")
    calls: list[Progress] = []

    def broken(record: Progress) -> None:
        calls.append(record)
        raise RuntimeError("the bar fell over")

    state = _state()
    with caplog.at_level(logging.WARNING, logger="snapshot"):
        Snapshot.take(path, state, options=APART, progress=broken)
        restored = _state()
        Snapshot(path).restore(restored, progress=broken)
    assert [r.operation for r in calls] == ["take", "restore"]  # not called again after raising
    warnings = [r for r in caplog.records if "progress callable raised" in r.getMessage()]
    assert len(warnings) == 2 and all(r.exc_info is not None for r in warnings)
    assert "the bar fell over" in caplog.text
    assert torch.equal(restored["extra"]["big"], state["extra"]["big"])  # committed, restored


def test_progress_must_be_a_bool_or_a_callable(tmp_path):
    path = str(tmp_path / "snap")
    for call in (Snapshot.take, Snapshot.async_take):
        with pytest.raises(InvalidArgumentError, match="progress must be True, False or a call"):
            call(path, _state(), progress="yes")
    assert not os.path.exists(path)
    Snapshot.take(path, _state())
    with pytest.raises(InvalidArgumentError, match="progress must be"):
        Snapshot(path).restore(_state(), progress=None)


# ---------------------------------------------------------------------------------------------
# progress=True as a user meets it: a bar on a terminal, nothing drawn elsewhere.

CHILD = """
import logging, sys
if sys.argv[2] == "no-tqdm":
    sys.modules["tqdm"] = None  # as if it were not installed: importing it fails
    logging.basicConfig(level=logging.INFO, format="%(message)s")
import torch
from snapshot import Snapshot, StateDict
state = {"extra": StateDict(big=torch.arange(50000.0))}
Snapshot.take(sys.argv[1] + "-plain", state)
Snapshot(sys.argv[1] + "-plain").restore(state)
# Without progress, the progress module is not imported (tqdm may be: torch imports it).
print("snapshot._engine.progress" in sys.modules, flush=True)
Snapshot.take(sys.argv[1], state, progress=True)
Snapshot(sys.argv[1]).restore(state, progress=True)
print("done", flush=True)
"""


def _run_child(path: Path, mode: str, tty: bool) -> tuple[str, str]:
    """(stdout, stderr) of a take and a restore with progress=True in a new interpreter, its
    stderr a pseudo-terminal (80 columns) or a pipe."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-c", CHILD, str(path), mode]
    if not tty:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stdout, done.stderr
    code, out, drawn = on_terminal(command, env, 80).finish(timeout=300)
    assert code == 0, drawn
    return out, drawn


@pytest.mark.slow  # three new interpreters, each importing torch
def test_progress_true_draws_a_bar_on_a_terminal_only(tmp_path):
    out, drawn = _run_child(tmp_path / "tty", "tqdm", tty=True)
    assert out.split() == ["False", "done"]
    # Named by the path's last part, the bar fits the terminal's 80 columns.
    assert re.search(r"\rtake tty: +100%\|█+\| 195k/195k \[", drawn), drawn
    assert re.search(r"\rrestore tty: +100%\|█+\| 195k/195k \[", drawn), drawn
    assert max(len(line) for line in re.split(r"[\r\n]", drawn)) <= 80

    out, drawn = _run_child(tmp_path / "pipe", "tqdm", tty=False)
    assert out.split() == ["False", "done"] and drawn == ""  # no terminal: nothing drawn

    # tqdm missing: lines are logged instead of a bar, on a terminal too.
    out, drawn = _run_child(tmp_path / "plain", "no-tqdm", tty=True)
    plain = re.escape(str(tmp_path / "plain"))
    assert re.search(rf"take {plain}: 100% \(0.2 of 0.2 MB, 1 of 1 items\)", drawn), drawn
    assert re.search(rf"restore {plain}: 100%", drawn) and "%|" not in drawn, drawn


# ---------------------------------------------------------------------------------------------
# Across ranks: each rank reports its own bytes.


def _two_ranks(rank: int, world_size: int, path: str) -> tuple[list[Progress], list[Progress]]:
    state = {"s": StateDict(t=torch.full((1000 * (rank + 1),), float(rank)))}
    took, read = Recorder(), Recorder()
    Snapshot.take(path, state, progress=took)
    Snapshot(path).restore(state, progress=read)
    return took.records, read.records


@pytest.mark.slow
def test_each_rank_reports_its_own_bytes(tmp_path):
    path = str(tmp_path / "snap")
    results = run_ranks(2, _two_ranks, path)
    for rank, (took, read) in enumerate(results):
        assert {r.rank for r in took + read} == {rank}
        for records in (took, read):
            last = records[-1]
            assert (records[0].done_bytes, last.done_bytes) == (0, last.total_bytes)
        # Rank r's tensor is (r + 1) * 4000 bytes, in blobs of its own.
        assert took[-1].total_bytes == _blob_bytes(path, str(rank))[0] >= 4000 * (rank + 1)
        assert read[-1].total_bytes == took[-1].total_bytes
