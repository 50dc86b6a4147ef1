"""Shared fixtures: storage locations for every plugin, and the recording wrapper."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from storage_plugins import memory, register_storage_plugin, unregister_storage_plugin
from tests.plugins import FAULTS, LOGS, FaultyPlugin, IOLog, RecordingPlugin
from tests.s3server import S3Bucket, S3Server


@pytest.fixture(autouse=True)
def _fresh_memory_store() -> Iterator[None]:
    yield
    memory.clear()


@pytest.fixture(params=["fs", "memory"])
def snapshot_url(request: pytest.FixtureRequest, tmp_path) -> str:
    """A fresh location for one snapshot, on local disk and in memory."""
    if request.param == "fs":
        return str(tmp_path / "snap")
    return f"memory://{uuid.uuid4().hex}/snap"


@pytest.fixture
def recorded(tmp_path) -> Iterator[tuple[str, IOLog]]:
    """A local snapshot location whose reads and writes are logged."""
    register_storage_plugin("recording", RecordingPlugin)
    inner = str(tmp_path / "snap")
    log = LOGS.setdefault(inner, IOLog())
    try:
        yield f"recording://{inner}", log
    finally:
        LOGS.pop(inner, None)
        unregister_storage_plugin("recording")


@pytest.fixture
def faulty(tmp_path) -> Iterator[tuple[str, str]]:
    """(url, inner path) of a local location whose plugin raises what ``FAULTS[inner]`` says."""
    register_storage_plugin("faulty", FaultyPlugin)
    inner = str(tmp_path / "snap")
    try:
        yield f"faulty://{inner}", inner
    finally:
        FAULTS.pop(inner, None)
        LOGS.pop(inner, None)
        unregister_storage_plugin("faulty")


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """moto's S3 server on 127.0.0.1 at a free port, for the whole session (tests/s3server.py)."""
    server = S3Server()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> Iterator[S3Bucket]:
    """A fresh bucket on the session's S3 server; faults injected by the test end with it."""
    try:
        yield S3Bucket(s3_server, s3_server.new_bucket())
    finally:
        s3_server.clear_faults()
