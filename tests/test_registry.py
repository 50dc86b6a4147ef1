"""The plugin registry: URL prefixes, third-party entry points, storage_options."""

from __future__ import annotations

import textwrap
import uuid

import pytest
import torch

from snapshot import Snapshot, StateDict, StorageError
from snapshot._engine.runtime import run
from storage_plugins import register_storage_plugin, unregister_storage_plugin
from storage_plugins.fs import FSStoragePlugin
from storage_plugins.fsspec_plugin import FSSpecStoragePlugin
from storage_plugins.memory import MemoryStoragePlugin
from storage_plugins.registry import resolve_factory, split_url, url_to_storage_plugin
from storage_plugins.s3 import S3StoragePlugin


def build(url: str, options=None):
    async def make():
        plugin = url_to_storage_plugin(url, options)
        await plugin.close()
        return plugin

    return run(make())


def test_split_url():
    assert split_url("/a/b") == ("fs", "/a/b")
    assert split_url("rel/path") == ("fs", "rel/path")
    assert split_url("s3://bucket/p") == ("s3", "bucket/p")
    assert split_url("memory://x") == ("memory", "x")
    with pytest.raises(ValueError, match="malformed"):
        split_url("s3://")


def test_builtin_plugins_by_prefix(tmp_path):
    assert isinstance(build(str(tmp_path)), FSStoragePlugin)
    assert build(f"file://{tmp_path}").root == str(tmp_path)
    assert isinstance(build("memory://abc"), MemoryStoragePlugin)
    assert resolve_factory("s3")[0] is S3StoragePlugin
    assert resolve_factory("s3a")[0] is S3StoragePlugin
    # Any protocol fsspec knows works through the generic plugin.
    assert resolve_factory("ftp") == (FSSpecStoragePlugin, "built-in")


def test_unknown_protocol_and_missing_package_are_clear(tmp_path):
    with pytest.raises(StorageError, match="no storage plugin for nosuch://.*memory.*entry-point"):
        Snapshot.take("nosuch://x", {"s": StateDict()})
    # gcs is known to fsspec, but its package is not installed here.
    with pytest.raises(StorageError, match="gcs.*gcsfs"):
        Snapshot.take("gcs://bucket/x", {"s": StateDict()})


def test_storage_options_reach_the_plugin(tmp_path):
    seen = {}

    class Capturing(MemoryStoragePlugin):
        def __init__(self, url, storage_options=None):
            seen[url] = storage_options
            super().__init__(url.replace("capture://", "memory://"))

    register_storage_plugin("capture", Capturing)
    try:
        url = f"capture://{uuid.uuid4().hex}"
        Snapshot.take(url, {"s": StateDict(x=torch.ones(2))}, storage_options={"token": "abc"})
        Snapshot(url, storage_options={"token": "def"}).read_object("0/s/x")
    finally:
        unregister_storage_plugin("capture")
    assert seen[url] == {"token": "def"}
    plugin = build(str(tmp_path), {"fsync": False, "io_threads": 2})
    assert plugin._fsync is False and plugin._executor._max_workers == 2


def test_registered_plugin_takes_precedence(tmp_path):
    class Loud(MemoryStoragePlugin):
        pass

    register_storage_plugin("memory", Loud)
    try:
        assert isinstance(build("memory://x"), Loud)
    finally:
        unregister_storage_plugin("memory")
    assert type(build("memory://x")) is MemoryStoragePlugin


def _install(tmp_path, monkeypatch, module: str, entry_points: str) -> None:
    """Makes ``module`` (already written under ``tmp_path``) an installed distribution with
    these lines in the ``statesnap.storage_plugins`` entry-point group."""
    dist = tmp_path / f"{module}-1.0.dist-info"
    dist.mkdir()
    name = module.replace("_", "-")
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[statesnap.storage_plugins]\n{entry_points}\n")
    monkeypatch.syspath_prepend(str(tmp_path))


def test_third_party_plugin_through_entry_point(tmp_path, monkeypatch):
    (tmp_path / "thirdparty_store.py").write_text(
        textwrap.dedent(
            """
            from storage_plugins.memory import MemoryStoragePlugin

            class ThirdParty(MemoryStoragePlugin):
                def __init__(self, url, storage_options=None):
                    super().__init__(url.replace("thirdparty://", "memory://tp-"))
            """
        )
    )
    _install(tmp_path, monkeypatch, "thirdparty_store", "thirdparty = thirdparty_store:ThirdParty")
    factory, source = resolve_factory("thirdparty")
    assert source == "entry point" and factory.__name__ == "ThirdParty"
    Snapshot.take("thirdparty://snap", {"s": StateDict(v=3)})
    assert Snapshot("thirdparty://snap").read_object("0/s/v") == 3
    assert Snapshot("memory://tp-snap").read_object("0/s/v") == 3


def test_entry_point_cannot_take_over_a_builtin_protocol(tmp_path, monkeypatch):
    (tmp_path / "hijack_store.py").write_text("def Hijack(url, storage_options=None):\n    1 / 0\n")
    _install(
        tmp_path,
        monkeypatch,
        "hijack_store",
        "fs = hijack_store:Hijack\nmemory = hijack_store:Hijack",
    )
    assert resolve_factory("fs") == (FSStoragePlugin, "built-in")
    assert resolve_factory("memory")[1] == "built-in"
    Snapshot.take(str(tmp_path / "snap"), {"s": StateDict(v=4)})
    assert Snapshot(str(tmp_path / "snap")).read_object("0/s/v") == 4
