"""URI prefix -> storage plugin, with lazy imports and an entry-point group for third parties."""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from storage_plugins.base import StoragePlugin, UnsafeBlobError

# A factory takes (url, storage_options) and returns a plugin; a plugin class is one. The url is
# the snapshot's path as the user wrote it, prefix included (none for a plain local path).
PluginFactory = Callable[[str, "dict[str, Any] | None"], StoragePlugin]

ENTRY_POINT_GROUP = "statesnap.storage_plugins"

# protocol -> ("module:attribute", what to install when the import fails)
_BUILTIN: dict[str, tuple[str, str | None]] = {
    "fs": ("storage_plugins.fs:FSStoragePlugin", None),
    "file": ("storage_plugins.fs:FSStoragePlugin", None),
    "memory": ("storage_plugins.memory:MemoryStoragePlugin", None),
    "s3": ("storage_plugins.s3:S3StoragePlugin", "pip install 'statesnap[s3]'"),
    "s3a": ("storage_plugins.s3:S3StoragePlugin", "pip install 'statesnap[s3]'"),
}

_registered: dict[str, PluginFactory] = {}


def register_storage_plugin(protocol: str, factory: PluginFactory) -> None:
    """Makes ``protocol://...`` paths use ``factory``; takes precedence over every other source."""
    _registered[protocol] = factory


def unregister_storage_plugin(protocol: str) -> None:
    """Undoes ``register_storage_plugin(protocol, ...)`` (nothing when none is registered)."""
    _registered.pop(protocol, None)


def split_url(url: str) -> tuple[str, str]:
    """``"s3://b/p"`` -> ``("s3", "b/p")``; a path without a prefix is ``("fs", path)``."""
    protocol, sep, rest = url.partition("://")
    if not sep:
        return "fs", url
    if not protocol or not rest:
        raise ValueError(f"malformed storage path {url!r}: expected protocol://location")
    return protocol, rest


def check_below_root(path: str, where: str) -> str:
    """``path``, a blob path relative to a plugin's root, once it is known to have no ``.`` or
    ``..`` part (which some object stores, and fsspec, would normalize out of the root).

    Raises:
        UnsafeBlobError: ``path`` has a ``.`` or ``..`` part (``where`` names it).
    """
    if any(part in (".", "..") for part in path.split("/")):
        raise UnsafeBlobError(f"{where}: not a path below the root")
    return path


@functools.lru_cache(maxsize=1)
def _entry_points(path: tuple[str, ...]) -> dict[str, Any]:
    """The group's entry points by name, for ``sys.path`` as ``path``: scanning them reads
    every installed distribution's metadata, once per process and again when sys.path changes."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def resolve_factory(protocol: str) -> tuple[PluginFactory, str]:
    """Finds the factory for ``protocol`` and says where it came from.

    Order: plugins registered in this process, then the built-in ones, then installed entry
    points (group ``statesnap.storage_plugins``), then any protocol fsspec knows. Built-ins come
    before entry points, so an installed package cannot take over local paths unasked (and a
    local path never pays for the entry-point scan); ``register_storage_plugin`` still can.
    """
    if protocol in _registered:
        return _registered[protocol], "registered"
    target, hint = _BUILTIN.get(protocol, (None, None))
    if target is None:
        ep = _entry_points(tuple(sys.path)).get(protocol)
        if ep is not None:
            return ep.load(), "entry point"
        from fsspec.registry import known_implementations, registry  # type: ignore[import-untyped]

        if protocol not in registry and protocol not in known_implementations:
            known = sorted({*_BUILTIN, *_registered})
            raise ValueError(
                f"no storage plugin for {protocol}://; built-in and registered: "
                f"{', '.join(known)}. Third-party plugins register under the entry-point group "
                f"{ENTRY_POINT_GROUP!r}."
            )
        target = "storage_plugins.fsspec_plugin:FSSpecStoragePlugin"
    module, _, attr = target.partition(":")
    try:
        return getattr(importlib.import_module(module), attr), "built-in"
    except ImportError as e:
        fix = f" ({hint})" if hint else ""
        raise ImportError(f"the storage plugin for {protocol}:// needs {e.name}{fix}") from e


def url_to_storage_plugin(url: str, storage_options: dict[str, Any] | None = None) -> StoragePlugin:
    """Builds the plugin for ``url``, passing it ``storage_options`` (for S3, say: credentials,
    endpoint); call it on the event loop that will use the plugin.

    Raises:
        ValueError: ``url`` names no protocol that a plugin is registered or installed for.
        ImportError: the plugin needs a package that is not installed (named, with its extra).
    """
    protocol, _ = split_url(url)
    factory, _ = resolve_factory(protocol)
    return factory(url, storage_options)


def chunk_bytes_hint(url: str) -> int | None:
    """The ``chunk_bytes_hint`` of the plugin class that would serve ``url`` (None for a
    factory that is not a plugin class, or a protocol nothing serves)."""
    try:
        factory, _ = resolve_factory(split_url(url)[0])
    except (ValueError, ImportError):
        return None  # opening the storage will say why
    hint = getattr(factory, "chunk_bytes_hint", None)
    return hint if isinstance(hint, int) and hint > 0 else None
