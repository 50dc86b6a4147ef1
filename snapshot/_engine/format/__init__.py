"""Bytes and files of a snapshot: serialization, checksums, manifest I/O, foreign formats."""
