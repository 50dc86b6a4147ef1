"""The checkpoint manager's preemption: the signal handler that records a scheduler's signal,
the ranks' agreement on it, and the final save at a step boundary that ends the process by
that signal (``CheckpointManager.handle_preemption`` and ``checkpoint_if_preempted``)."""

from __future__ import annotations

import logging
import signal
import sys
from typing import TYPE_CHECKING, Any, NoReturn

from snapshot.options import Options

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


def agreed(manager: Manager, world: int, pg: Any | None, options: Options) -> bool:
    """Whether a preemption signal arrived on any rank of ``pg`` (this rank alone when
    ``world`` is 1); sets ``manager.preempted`` where another rank received it."""
    if world == 1:
        return manager.preempted
    from snapshot._engine.dist import dist as coordination

    flags = coordination.resolve(pg, options).all_gather(manager.preempted)
    if any(flags) and not manager.preempted:
        logger.warning("preempted: another rank received the signal")
        manager.preempted = True
    return bool(any(flags))


def save_last(
    manager: Manager, step: int, app_state: dict[str, Any], last_saved: int | None
) -> None:
    """The final save after a signal: saves ``step`` synchronously unless it is saved already
    (``last_saved``), then closes the manager (which restores the earlier handlers)."""
    if last_saved is not None and step <= last_saved:
        logger.warning(
            "preempted: step %d is saved already under %s (the newest saved is %d)",
            step,
            manager.root,
            last_saved,
        )
    else:
        logger.warning("preempted: saving step %d under %s before exiting", step, manager.root)
        async_, manager.async_ = manager.async_, False
        try:
            manager.save(step, app_state)
        finally:
            manager.async_ = async_
    manager.close()


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
