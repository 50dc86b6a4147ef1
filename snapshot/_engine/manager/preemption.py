"""The checkpoint manager's preemption: the signal handler that records a scheduler's signal,
and the end of the process by that signal after the final save
(``CheckpointManager.handle_preemption`` and ``checkpoint_if_preempted``)."""

from __future__ import annotations

import logging
import signal
import sys
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from snapshot.manager import CheckpointManager as Manager

logger = logging.getLogger("snapshot")


class PreemptionHandler:
    """The signal handlers ``handle_preemption`` installs, and the ones they replaced. A handler
    only records and logs the signal, so a save it interrupts completes."""

    def __init__(
        self,
        manager: Manager,
        app_state: dict[str, Any] | None,
        signals: tuple[int, ...],
    ) -> None:
        self.manager = manager
        self.app_state = app_state
        self.signum: int | None = None  # the first signal received
        self.previous = {s: signal.signal(s, self._on_signal) for s in signals}

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            logger.warning(
                "signal %d received again by the checkpoint manager of %s: the final save "
                "happens at the next step boundary",
                signum,
                self.manager.root,
            )
            return
        self.signum = signum
        self.manager.preempted = True
        logger.warning(
            "signal %d received by the checkpoint manager of %s: manager.preempted is set, "
            "the final save happens at the next step boundary",
            signum,
            self.manager.root,
        )

    def uninstall(self) -> None:
        """Puts back the handlers this one replaced (the default one where an earlier handler
        was installed from outside Python)."""
        for s, handler in self.previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        self.previous = {}


def end_by_signal(root: str, signum: int) -> NoReturn:
    """Ends the process by ``signum`` as the signal would have, the output flushed first;
    ``SystemExit(128 + signum)`` if the process survives it."""
    logger.warning("preempted: the saves under %s are committed; ending by signal %d", root, signum)
    for stream in (sys.stdout, sys.stderr):  # a signal's default action flushes nothing
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    signal.raise_signal(signum)
    raise SystemExit(128 + signum)
