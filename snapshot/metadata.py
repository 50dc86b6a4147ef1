"""``Snapshot.metadata``: what a snapshot's manifest says about it, as one frozen object."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from manifest import Entry, Manifest

# How a take records the writer in the manifest's metadata: "statesnap 0.1.0".
_LIBRARY_PREFIX = "statesnap "


@dataclass(frozen=True)
class SnapshotMetadata:
    """Facts about a committed snapshot, read from its manifest (torchsnapshot's
    ``version``, ``world_size`` and ``manifest``, and this library's own).

    Attributes:
        version: the library version that took it (None when not recorded).
        world_size: how many processes took it.
        manifest: logical path -> entry, every rank's (a copy, not shown by ``repr``).
        format_version: the manifest format it needs (2 with sharded entries, else 1).
        torch_version: ``torch.__version__`` of the taker, when recorded.
        created_unix: its commit time in seconds since the epoch, when recorded.
        info: the manifest's metadata (a copy): ``library``, ``torch``, ``strategies``...
        user: the take's ``user_metadata`` (a copy), or None.
        bases: the sibling snapshots whose bytes its entries point at (an incremental take's
            base, and that base's own); empty when it holds all its bytes.
    """

    version: str | None
    world_size: int
    manifest: dict[str, Entry] = field(repr=False)
    format_version: int = 1
    torch_version: str | None = None
    created_unix: float | None = None
    info: dict[str, Any] = field(default_factory=dict)
    user: dict[str, Any] | None = None
    bases: tuple[str, ...] = ()

    @classmethod
    def from_manifest(cls, manifest: Manifest) -> SnapshotMetadata:
        """The metadata of a decoded manifest (its entries and metadata copied)."""
        info = copy.deepcopy(manifest.metadata)
        library, torch_version = info.get("library"), info.get("torch")
        created = info.get("created_unix")
        return cls(
            version=library.removeprefix(_LIBRARY_PREFIX) if isinstance(library, str) else None,
            world_size=manifest.world_size,
            manifest=dict(manifest.entries),
            format_version=manifest.format_version,
            torch_version=torch_version if isinstance(torch_version, str) else None,
            created_unix=(
                float(created)
                if isinstance(created, (int, float)) and not isinstance(created, bool)
                else None
            ),
            info=info,
            user=copy.deepcopy(user) if isinstance(user := info.get("user"), dict) else None,
            bases=manifest.bases,
        )


__all__ = ["SnapshotMetadata"]
