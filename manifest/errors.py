"""The errors of reading a manifest: every one a ``ManifestDecodeError`` (a ``ValueError``)."""


class ManifestDecodeError(ValueError):
    """The bytes are not a manifest this version of the library can read."""


class UnsupportedFormatError(ManifestDecodeError):
    """The manifest was written in a newer format version."""


class ManifestChecksumError(ManifestDecodeError):
    """The manifest's bytes do not have the CRC-32 its last line records, or it has no such
    line (it was cut short)."""


class UnsafeManifestError(ManifestDecodeError):
    """The manifest uses what this library never writes, and will not expand or follow: YAML
    anchors and aliases, tags, merge keys, collections as mapping keys, plain scalars of types
    JSON has no form for (timestamps), or nesting deeper than ``MAX_DEPTH``."""
