"""Shared fixtures: storage locations for every plugin, and the recording wrapper."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from storage_plugins import memory, register_storage_plugin, unregister_storage_plugin
from tests.plugins import FAULTS, LOGS, FaultyPlugin, IOLog, RecordingPlugin


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
