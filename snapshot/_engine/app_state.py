"""The ``app_state`` argument of a take or a restore: a mapping of str -> Stateful, checked,
ordered (RNG states last), and each value's ``state_dict()`` called with its errors named."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from snapshot.errors import NotStatefulError, StatefulError
from snapshot.stateful import RNGState, Stateful


def ordered_keys(app_state: Mapping[str, Any]) -> list[str]:
    """app_state keys with RNGState values last, so capturing or restoring the other objects
    cannot move the generators after their state is taken or set."""
    keys = list(app_state)
    return [k for k in keys if not isinstance(app_state[k], RNGState)] + [
        k for k in keys if isinstance(app_state[k], RNGState)
    ]


def check_app_state(app_state: Any, path: str) -> None:
    """Refuses an app_state that is not a mapping of str -> Stateful; ``path`` is the snapshot's."""
    if not isinstance(app_state, Mapping):
        raise NotStatefulError(
            f"snapshot {path}: app_state must be a dict of name -> Stateful, "
            f"got {type(app_state).__name__}"
        )
    for key, value in app_state.items():
        if type(key) is not str:
            raise NotStatefulError(f"snapshot {path}: app_state key {key!r} is not a str")
        if not isinstance(value, Stateful):
            raise NotStatefulError(
                f"snapshot {path}: app_state[{key!r}] is a {type(value).__name__}, which has no "
                "state_dict() and load_state_dict(); wrap plain values in snapshot.StateDict"
            )


def state_dict_of(key: str, value: Stateful, path: str) -> Any:
    """``value.state_dict()`` of ``app_state[key]``; what it raises becomes a
    ``StatefulError`` that names the key."""
    try:
        return value.state_dict()
    except Exception as e:
        raise StatefulError(
            f"snapshot {path}: app_state[{key!r}].state_dict() raised {type(e).__name__}: {e}"
        ) from e
