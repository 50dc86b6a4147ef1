"""Storage plugins: bytes in, bytes out, under a root that a URL names."""

from storage_plugins.base import (
    BlobTooLargeError,
    Buffer,
    RefusedBlobError,
    StoragePlugin,
    UnsafeBlobError,
)
from storage_plugins.registry import (
    ENTRY_POINT_GROUP,
    register_storage_plugin,
    unregister_storage_plugin,
    url_to_storage_plugin,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "BlobTooLargeError",
    "Buffer",
    "RefusedBlobError",
    "StoragePlugin",
    "UnsafeBlobError",
    "register_storage_plugin",
    "unregister_storage_plugin",
    "url_to_storage_plugin",
]
