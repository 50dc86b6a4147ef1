"""The snapshot manifest: pure data (entries) and its YAML codec (with its checksum); no I/O,
no torch."""

from manifest.codec import (
    ManifestChecksumError,
    ManifestDecodeError,
    UnsupportedFormatError,
    check_blob_path,
    dumps,
    entry_to_dict,
    loads,
)
from manifest.entries import (
    FORMAT_VERSION,
    DictEntry,
    Entry,
    ListEntry,
    Location,
    Manifest,
    ObjectEntry,
    PrimitiveEntry,
    TensorEntry,
    TupleEntry,
    is_container,
)

__all__ = [
    "FORMAT_VERSION",
    "DictEntry",
    "Entry",
    "ListEntry",
    "Location",
    "Manifest",
    "ManifestChecksumError",
    "ManifestDecodeError",
    "ObjectEntry",
    "PrimitiveEntry",
    "TensorEntry",
    "TupleEntry",
    "UnsupportedFormatError",
    "check_blob_path",
    "dumps",
    "entry_to_dict",
    "is_container",
    "loads",
]
