"""The public surface: what ``snapshot`` and ``snapshot.sharding`` export is exactly what the
README documents, every exported name resolves, and no public ``__all__`` hands out a piece of
the private engine (``snapshot._engine``)."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

import snapshot
import snapshot.errors
import snapshot.sharding

ROOT = Path(__file__).resolve().parents[1]

# README.md: "Public API" and "Tuning" (Options), the errors a user catches, the version.
SNAPSHOT_ALL = {
    "Snapshot",
    "PendingSnapshot",
    "StateDict",
    "RNGState",
    "Stateful",
    "Options",
    "CheckpointManager",
    "MemoryTier",
    "MemoryTierStore",
    "__version__",
    # New kinds of values (the package docstring)
    "Kind",
    "TensorLayout",
    "register_kind",
    # snapshot.errors, every class (test_every_error_is_exported keeps the two in step)
    "SnapshotError",
    "SnapshotNotFoundError",
    "IncompleteSnapshotError",
    "SnapshotExistsError",
    "PathNotEmptyError",
    "CorruptSnapshotError",
    "ChecksumError",
    "UnsafeSnapshotError",
    "IncompatibleSnapshotError",
    "UnsafeObjectError",
    "StateMismatchError",
    "ShapeMismatchError",
    "EntryNotFoundError",
    "InvalidArgumentError",
    "MissingBaseError",
    "NotStatefulError",
    "StatefulError",
    "UnsupportedValueError",
    "HollowStateError",
    "StorageError",
    "RankFailedError",
    "PathMismatchWarning",
}

# README.md, "Sharded tensors": the kinds of sharded state and the replica-id helpers a user
# calls. The helpers for sharded state dicts are documented in snapshot.sharding.utils.
SHARDING_ALL = {
    "ShardedTensor",
    "ShardedObject",
    "ShardedTensorFactory",
    "LocalNonpersistentObject",
    "ReplicaId",
    "is_main_replica",
}

# Names of a public __all__ deliberately defined in the engine (``name -> why``).
FROM_ENGINE_ON_PURPOSE: dict[str, str] = {
    "Kind": "the contract of a kind of value is the engine's own table's",
    "TensorLayout": "what a kind gives export, read by the engine",
    "register_kind": "adds to the engine's table of kinds",
}


def test_snapshot_exports_exactly_the_documented_names():
    assert set(snapshot.__all__) == SNAPSHOT_ALL
    assert len(snapshot.__all__) == len(SNAPSHOT_ALL)  # no name twice


def test_sharding_exports_exactly_the_documented_names():
    assert set(snapshot.sharding.__all__) == SHARDING_ALL
    assert len(snapshot.sharding.__all__) == len(SHARDING_ALL)


@pytest.mark.parametrize("module", [snapshot, snapshot.sharding])
def test_every_exported_name_resolves(module):
    for name in module.__all__:
        assert getattr(module, name, None) is not None, f"{module.__name__}.{name}"
    namespace: dict[str, object] = {}
    exec(f"from {module.__name__} import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(module.__all__)


def test_every_error_is_exported():
    """Each exception and warning class of ``snapshot.errors`` is exported as the same object
    (a user catches them from ``snapshot``)."""
    classes = {
        name
        for name, value in vars(snapshot.errors).items()
        if inspect.isclass(value)
        and issubclass(value, (Exception, Warning))
        and value.__module__ == "snapshot.errors"
    }
    assert classes <= set(snapshot.__all__)
    for name in classes:
        assert getattr(snapshot, name) is getattr(snapshot.errors, name)
    assert snapshot.Options is importlib.import_module("snapshot.options").Options


def _public_modules_with_all() -> list[str]:
    """Every module of the library outside ``snapshot._engine`` (and not private itself) whose
    source assigns ``__all__``."""
    found = []
    for package in ("snapshot", "manifest", "storage_plugins"):
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if any(p.startswith("_") for p in parts):
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"))
            if any(
                isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
                for node in tree.body
            ):
                found.append(".".join(parts))
    return found


def test_the_public_modules_are_found():
    modules = _public_modules_with_all()
    assert {"snapshot", "snapshot.sharding", "manifest", "storage_plugins"} <= set(modules)


@pytest.mark.parametrize("name", _public_modules_with_all())
def test_no_public_name_comes_from_the_engine(name):
    module = importlib.import_module(name)
    leaked = []
    for exported in module.__all__:
        value = getattr(module, exported)
        # Classes and functions say where they were defined; constants and aliases do not.
        home = getattr(value, "__module__", None) if callable(value) else None
        on_purpose = exported in FROM_ENGINE_ON_PURPOSE
        if home is not None and home.startswith("snapshot._engine") and not on_purpose:
            leaked.append(f"{name}.{exported} is {home}.{exported}")
    assert not leaked, "\n".join(leaked)
