"""Sharded state: descriptions of the part of a global tensor or object each rank holds.

What a state dict holds (:mod:`snapshot.sharding.mapping`): :class:`ShardedTensor` (a piece of a
global tensor), :class:`ShardedObject` (one of several objects making a global one),
:class:`ShardedTensorFactory` (a tensor stored as other sharded tensors and merged back on
restore) and :class:`LocalNonpersistentObject` (a value kept on its rank, never stored); a
piece's copies are told apart by their replica id (:data:`ReplicaId`, :func:`is_main_replica`).

The helpers for sharded state dicts (splitting them by kind of leaf, renaming shard keys, shard
ids) are in :mod:`snapshot.sharding.utils`; saving our sharded tensors with
``torch.distributed.checkpoint`` is :mod:`snapshot.sharding.checkpointable`.
"""

from snapshot.sharding.mapping import (
    LocalNonpersistentObject,
    ReplicaId,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    is_main_replica,
)

__all__ = [
    "LocalNonpersistentObject",
    "ReplicaId",
    "ShardedObject",
    "ShardedTensor",
    "ShardedTensorFactory",
    "is_main_replica",
]
