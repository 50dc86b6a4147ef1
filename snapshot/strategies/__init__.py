"""The strategy layer: how each kind of state is saved and loaded, a compatibility layer on top of
the library (``base``: actions, strategy classes and the default-strategy registry; ``default``:
the library's own strategies, registered when this package is imported; ``tensor_aware``: state
dicts that lend out their tensors)."""

from snapshot.strategies import default  # noqa: F401  (registers the library's strategies)
