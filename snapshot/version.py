"""The library's version: the one place it is written. The wheel's metadata is read from here at
build time (pyproject.toml), and every manifest a take commits records it."""

__version__ = "0.1.0"
