"""The strategy layer: how each kind of state is saved and loaded (``base``: actions, strategy
classes and the default-strategy registry; ``sharded``: pieces of global tensors)."""
