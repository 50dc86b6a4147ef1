"""Transient storage errors are retried with backoff; permanent ones fail at once."""

from __future__ import annotations

import errno
import logging
import uuid
import zlib
from collections import Counter

import pytest
import torch

from snapshot import Options, Snapshot, SnapshotNotFoundError, StateDict, StorageError
from storage_plugins import register_storage_plugin, unregister_storage_plugin
from storage_plugins.memory import MemoryStoragePlugin
from tests.helpers import raw_bytes
from tests.plugins import FAULTS, plain_blob


def _failing(first: int, error: Exception, verb: str, path: str, counts: Counter):
    """A fault that raises ``error`` on the first ``first`` calls ``verb`` of ``path``."""

    def fault(v: str, p: str) -> Exception | None:
        if v == verb and p == path:
            counts[(v, p)] += 1
            if counts[(v, p)] <= first:
                return error
        return None

    return fault


def _state() -> dict[str, StateDict]:
    return {"s": StateDict(a=torch.arange(6.0), b=torch.ones(3, dtype=torch.int64))}


def test_transient_write_errors_are_retried(faulty, caplog):
    url, inner = faulty
    counts: Counter = Counter()
    FAULTS[inner] = _failing(
        2, ConnectionResetError("connection reset by peer"), "write", "0/s0", counts
    )
    with caplog.at_level(logging.WARNING, logger="snapshot"):
        snap = Snapshot.take(url, _state())
    assert counts[("write", "0/s0")] == 3  # two failures, then the write that went through
    retries = [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]
    assert len(retries) == 2 and "0/s/a and 1 more" in retries[0] and "retry 1 of 4" in retries[0]
    assert torch.equal(snap.read_object("0/s/a"), torch.arange(6.0))


class CutOff(MemoryStoragePlugin):
    """``cutoff://name``: the first observed write and read of each blob shows part of its
    bytes to the observer, then fails as a dropped connection does."""

    seen: set[tuple[str, str]] = set()

    def _first(self, verb: str, path: str) -> bool:
        key = (verb, plain_blob(path))
        first = key not in CutOff.seen
        CutOff.seen.add(key)
        return first

    async def write_observed(self, path, buffers, observe):
        if self._first("write", path):
            head = memoryview(buffers[0]).cast("B")
            observe(head[: len(head) // 2])
            raise ConnectionResetError("connection reset by peer")
        await super().write_observed(path, buffers, observe)

    async def readv_observed(self, path, offset, outs, observe):
        if self._first("read", path):
            await self.readv(path, offset, outs)
            observe(outs[0][: len(outs[0]) // 2])
            raise ConnectionResetError("connection reset by peer")
        await super().readv_observed(path, offset, outs, observe)


@pytest.mark.parametrize("slabs", [True, False])
def test_a_retry_after_bytes_were_observed_checksums_them_once(slabs):
    """Each attempt gets a new digest: the bytes a failed attempt showed are not counted twice
    (they would make every checksum wrong, at take or at restore). A slab's members are
    checksummed when it is staged, so its write is not observed; a tensor in a blob of its own
    is checksummed as it is written."""
    options = Options() if slabs else Options(slab_threshold_bytes=0)
    blob = "0/s0" if slabs else "0/0"
    CutOff.seen = set()
    register_storage_plugin("cutoff", CutOff)
    try:
        url = f"cutoff://{uuid.uuid4().hex}"
        state = _state()
        manifest = Snapshot.take(url, state, options=options).get_manifest()
        for key in ("a", "b"):  # what the write recorded: the CRC of the tensor's bytes
            assert manifest[f"0/s/{key}"].chunks[0].crc32 == zlib.crc32(raw_bytes(state["s"][key]))
        out = {"s": StateDict(a=torch.zeros(6), b=torch.zeros(3, dtype=torch.int64))}
        Snapshot(url).restore(out)  # verifies every checksum
        assert torch.equal(out["s"]["a"], torch.arange(6.0))
        assert ("read", blob) in CutOff.seen
        assert (("write", blob) in CutOff.seen) is not slabs
    finally:
        unregister_storage_plugin("cutoff")


def test_transient_read_errors_are_retried(faulty):
    url, inner = faulty
    Snapshot.take(url, _state())
    counts: Counter = Counter()
    FAULTS[inner] = _failing(1, TimeoutError("read timed out"), "read", "0/s0", counts)
    out = StateDict(a=torch.zeros(6), b=torch.zeros(3, dtype=torch.int64))
    Snapshot(url).restore({"s": out})
    assert counts[("read", "0/s0")] == 2
    assert torch.equal(out["a"], torch.arange(6.0)) and torch.equal(out["b"], torch.ones(3).long())


def test_reading_the_manifest_is_retried(faulty):
    url, inner = faulty
    Snapshot.take(url, _state())
    counts: Counter = Counter()
    FAULTS[inner] = _failing(
        2, OSError(errno.EAGAIN, "resource busy"), "read", "manifest.yaml", counts
    )
    assert Snapshot(url).read_object("0/s/b").tolist() == [1, 1, 1]
    assert counts[("read", "manifest.yaml")] == 3


def test_a_transient_error_that_persists_fails_the_take(faulty):
    url, inner = faulty
    counts: Counter = Counter()
    FAULTS[inner] = _failing(99, ConnectionResetError("reset"), "write", "0/s0", counts)
    with pytest.raises(
        StorageError, match=r"failed to write blob .*0/(?:[0-9a-f]{8}-)?s0 \(3 attempts\).*reset"
    ):
        Snapshot.take(url, _state(), options=Options(io_retries=2))
    assert counts[("write", "0/s0")] == 3
    with pytest.raises(SnapshotNotFoundError):
        Snapshot(inner)  # nothing committed


@pytest.mark.parametrize("retries", [None, 0])
def test_permanent_errors_and_disabled_retries_fail_at_once(faulty, retries):
    url, inner = faulty
    counts: Counter = Counter()
    if retries is None:  # an I/O error of the device is not retried
        error: Exception = OSError(errno.EIO, "I/O error")
    else:  # io_retries=0: not even a transient one
        error = ConnectionResetError("reset")
    FAULTS[inner] = _failing(1, error, "write", "0/s0", counts)
    with pytest.raises(
        StorageError, match=r"failed to write blob .*0/(?:[0-9a-f]{8}-)?s0: "
    ) as info:
        Snapshot.take(url, _state(), options=Options(io_retries=retries))
    assert info.value.__cause__ is error
    assert counts[("write", "0/s0")] == 1


@pytest.mark.parametrize(
    ("error", "transient"),
    [
        (ConnectionResetError("reset"), True),
        (ConnectionRefusedError("refused"), True),
        (TimeoutError("timed out"), True),
        (OSError(errno.EAGAIN, "try again"), True),
        (OSError(errno.EBUSY, "busy"), True),
        (OSError(errno.EIO, "I/O error"), False),
        (OSError(errno.ENOSPC, "no space"), False),
        (FileNotFoundError("gone"), False),
        (PermissionError("denied"), False),
        (EOFError("short"), False),
        (ValueError("bug"), False),
    ],
)
def test_what_counts_as_transient(error, transient):
    assert MemoryStoragePlugin("memory://x").is_transient(error) is transient
