"""``CheckpointManager``: step folders under one root, resume, retention, preemption::

    manager = CheckpointManager("ckpt", keep_last=3, keep_every_steps=1000)
    start = manager.restore(app_state)  # the step restored, or None: start fresh
    for step in range(0 if start is None else start + 1, steps):
        train_one_step()
        if step % 100 == 0:
            manager.save(step, app_state, metrics={"loss": loss})
    manager.close()

One job owns a root. The manager deletes committed steps its policy lets go and folders
holding a take's pending marker and nothing but what a take writes, each after checking the
whole folder; never a committed step it cannot read, a folder without the marker, nor anything
through a link (docs/reliability.md, "Checkpoint manager and deletions").
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

from snapshot._engine import state_dicts
from snapshot._engine.dist.dist import RankZero
from snapshot._engine.dist.dist import resolve as resolve_group
from snapshot._engine.manager import tier_durable
from snapshot._engine.manager.retention import Cleaner, Policy
from snapshot._engine.manager.steps import COMMITTED, LEFT, NOT_FOLDERS, StepInfo, Steps, step_name
from snapshot._engine.manager.tier import Tier
from snapshot.errors import InvalidArgumentError, SnapshotError, SnapshotExistsError
from snapshot.options import MemoryTier, Options, resolve
from snapshot.pending import PendingSnapshot
from snapshot.snapshot import Snapshot

logger = logging.getLogger("snapshot")


class CheckpointManager:
    """Snapshots of one training job under ``root``, one folder per step
    (``root/step_0000000100``), with retention.

    Args:
        root: the folder (or ``s3://bucket/prefix``, ``memory://name``...) holding the steps.
        keep_last: keep the newest N committed steps.
        keep_every_steps: keep every step that is a multiple of N (milestones).
        keep_best: keep the N best steps by ``metric`` (``mode="min"``: lower is better,
            ``"max"``: higher). With none of the three, every step is kept; together, a step
            is kept when any keeps it. The newest committed step, saves under way and the
            bases of kept incremental snapshots are never deleted.
        storage_options: for the storage plugin, as :meth:`Snapshot.take` takes them.
        pg: the process group. Every rank makes the manager's calls in the same order; rank 0
            lists the steps, decides, deletes, and tells the others.
        async_: ``save`` returns once the state is captured (``Snapshot.async_take``); False:
            once it is committed.
        stage_in_background: with ``async_``, ``save`` returns before the tensors are
            copied, which happens while training goes on; the optimizers' steps and the
            forwards of modules with buffers wait for the copies (see
            ``Snapshot.async_take``), and :meth:`wait_staged` waits for them where state is
            changed otherwise.
        max_in_flight: how many saves may be writing at once.
        incremental: each save is an incremental take on the newest committed step (waiting
            for the previous save to commit first).
        options: the :class:`~snapshot.Options` of every take and restore.
        raise_on_next_save: raise a background save's error from the next ``save`` too.
        memory_tier: a :class:`~snapshot.MemoryTier`: every save goes to a folder on each node
            (copied to peers on other hosts), every ``durable_every``-th one also to ``root``;
            ``restore`` takes each rank's part from the fastest tier that has it valid
            (docs/tiers.md). Every rank makes the manager (the tier's groups are made then).

    A save that fails in the background does not interrupt training: it is logged, what it
    wrote is deleted, and its error is raised by the next ``wait`` or ``close`` (or ``save``,
    with ``raise_on_next_save``). Deletions run on a thread of their own; a failed one is
    retried after the next commit. Saving a step whose folder is there already raises
    ``SnapshotExistsError`` before anything is written: a committed step is never replaced.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep_last: int | None = None,
        keep_every_steps: int | None = None,
        keep_best: int | None = None,
        metric: str | None = None,
        mode: str = "min",
        storage_options: dict[str, Any] | None = None,
        pg: Any | None = None,
        async_: bool = True,
        stage_in_background: bool = False,
        max_in_flight: int = 1,
        incremental: bool = False,
        options: Options | None = None,
        raise_on_next_save: bool = False,
        memory_tier: MemoryTier | None = None,
    ) -> None:
        self.root = state_dicts.snapshot_path(root, "CheckpointManager", "root")
        self.policy = Policy(keep_last, keep_every_steps, keep_best, metric, mode)
        if type(max_in_flight) is not int or max_in_flight < 1:
            raise InvalidArgumentError(f"max_in_flight must be an int >= 1, got {max_in_flight!r}")
        self.storage_options = state_dicts.options(storage_options, "CheckpointManager", self.root)
        self.pg = pg
        self.async_ = bool(async_)
        if type(stage_in_background) is not bool or (stage_in_background and not self.async_):
            raise InvalidArgumentError(
                "stage_in_background must be a bool, and True only with async_=True, got "
                f"{stage_in_background!r} with async_={async_!r}"
            )
        self.stage_in_background = stage_in_background
        self._staging: PendingSnapshot | None = None  # the newest save, while it may stage
        self.max_in_flight = max_in_flight
        self.incremental = bool(incremental)
        self.raise_on_next_save = bool(raise_on_next_save)
        self.options = resolve(options)
        self._steps = Steps(self.root, self.storage_options, self.options)
        if not isinstance(memory_tier, MemoryTier | None):
            raise InvalidArgumentError(
                f"memory_tier must be a snapshot.MemoryTier, got {type(memory_tier).__name__}"
            )
        tier_args = (self.root, pg, self.options, self.storage_options)
        self._tier = None if memory_tier is None else Tier(memory_tier, *tier_args)
        # Rank 0 lists, decides and deletes; every rank gets its answers.
        self._ranks = RankZero(pg, self.options, self.root)
        # The commit threads of the async saves under way, oldest first.
        self._in_flight: list[threading.Thread] = []
        # Retention and deletions (rank 0's), and which steps the saves hold.
        self._cleaner = Cleaner(self._steps, self.policy)
        self._last_saved: int | None = None
        self._durable_saved: int | None = None  # the newest step saved to the root
        self._final = False  # the final save of a preempted job: to the root too
        self._errors: list[BaseException] = []
        self._lock = threading.Lock()  # guards _in_flight and _errors
        # As rank 0 last listed them (every rank: ``steps``): the folder of each step, and the
        # steps a save must not write to (a folder there that is not a take's debris).
        self._folders: dict[int, str] = {}
        self._occupied: dict[int, str] = {}
        self._cleaned = False  # incomplete folders left by an earlier run were cleaned
        self._closed = False
        # The signal handlers handle_preemption replaced (empty: none installed), the
        # app_state it was given, the first signal received.
        self._previous: dict[int, Any] = {}
        self._preempt_state: dict[str, Any] | None = None
        self._signum: int | None = None
        # Set by the handler handle_preemption installs when its signal arrives.
        self.preempted = False

    def save(
        self, step: int, app_state: dict[str, Any], metrics: Mapping[str, float] | None = None
    ) -> None:
        """Snapshots ``app_state`` as step ``step`` (greater than every step saved before),
        recording ``metrics`` (name -> finite number) for ``keep_best``."""
        self._check_open("save")
        if type(step) is not int or step < 0:
            raise InvalidArgumentError(f"step must be an int >= 0, got {step!r}")
        recorded = state_dicts.metrics(metrics)
        # Across ranks, steps are agreed on by their order: each rank checks its own calls.
        latest = self._last_saved if self._last_saved is not None else self.latest_step()
        if latest is not None and step <= latest:
            raise InvalidArgumentError(
                f"step {step} is not after the newest step under {self.root} ({latest}): steps "
                "must increase (restore() first to resume, or use another root)"
            )
        tier_error = None
        if self._tier is not None:
            try:
                self._tier.save(step, app_state, self._take_part)
            except Exception as e:  # a durable save due still runs: every rank takes part
                tier_error = e
            if not self._tier.durable() and not self._final:
                self._last_saved = step
                if tier_error is not None:
                    raise tier_error
                logger.info("save of step %d to the memory tier of %s", step, self.root)
                if self.raise_on_next_save:
                    self._raise_background_error()
                if self._preempt_state is not None:
                    self.checkpoint_if_preempted(step)
                return
        self._save_durable(step, app_state, recorded, tier_error is None)
        if tier_error is not None:
            raise tier_error
        if self._preempt_state is not None:
            # Under handle_preemption(app_state, step_fn): after a signal, the final save.
            self.checkpoint_if_preempted(step)

    def _save_durable(
        self, step: int, app_state: dict[str, Any], recorded: dict[str, float], part: bool = True
    ) -> None:
        """``save`` to the durable root, once the step is known to be new there. With the
        memory tier, from its copies when every rank has its part of ``step`` (``part``: this
        rank's take of it succeeded), its sharded values rebuilt; else from ``app_state``."""
        from_memory = False
        if self._tier is not None:
            has, sharded = self._tier.has_part(step)
            flags = resolve_group(self.pg, self.options).all_gather(part and has and not sharded)
            from_memory = all(flags)
        self._refuse_occupied(step)
        # An incremental save's base must be committed.
        self._wait_for_saves(0 if self.incremental else self.max_in_flight - 1)
        if self.raise_on_next_save:
            self._raise_background_error()
        base = None
        if self.incremental:
            newest = self.latest_step()
            base = self._steps.path(self._folders[newest]) if newest is not None else None
        if not self._cleaned and self._ranks.rank == 0:
            # Before the first save: incomplete folders an earlier run left (a crash mid-take
            # or mid-delete) are deleted, in the background.
            self._cleaner.run_round()
        self._cleaned = True
        # The folder found for this step (debris a take may replace), else the canonical name.
        path = self._steps.path(self._folders.get(step, step_name(step)))
        user = {"step": step, "metrics": recorded}
        options = self.options.replace(digests=True) if self.incremental else self.options
        t = time.perf_counter()
        self._cleaner.begin(step)  # waits while debris at this step is being deleted
        try:
            common: dict[str, Any] = dict(
                pg=self.pg,
                storage_options=self.storage_options,
                options=options,
                base=base,
                user_metadata=user,
            )
            if from_memory:
                assert self._tier is not None
                write = tier_durable.writer(Snapshot, path, app_state, self.options, common)
                taken: Any = self._tier.write_durable(step, write)
                if not self.async_:
                    taken = taken.result()  # committed, or raised
            elif self.async_:
                taken = Snapshot.async_take(
                    path, app_state, stage_in_background=self.stage_in_background, **common
                )
            else:
                taken = Snapshot.take(path, app_state, **common)
        except BaseException:
            # The take removed what it wrote; what it could not is debris for the cleaner.
            self._cleaner.end(step, failed=True)
            raise
        self._last_saved = step
        done = "captured" if self.async_ else "committed"
        logger.info("save of step %d under %s %s in %.3f s", step, self.root, done, _since(t))
        if isinstance(taken, PendingSnapshot | Future):
            self._staging = taken if isinstance(taken, PendingSnapshot) else None
            wait = taken.wait if isinstance(taken, PendingSnapshot) else taken.result
            # Its own thread waits for the commit: the cleaner's thread must not hold it back.
            thread = threading.Thread(
                target=self._committed,
                args=(step, wait, t),
                name=f"statesnap-commit-{step}",
                daemon=True,
            )
            with self._lock:
                self._in_flight.append(thread)
            thread.start()
        else:
            self._cleaner.end(step)
            if self._ranks.rank == 0:
                self._cleaner.run_round()
        self._durable_saved = step

    def _committed(self, step: int, wait: Callable[[], Any], t0: float) -> None:
        """On a thread of its own: waits for an async save (``wait``), records its end, then
        hands retention to the worker (rank 0)."""
        error = None
        try:
            wait()
            logger.info(
                "save of step %d under %s committed %.3f s after it began",
                step,
                self.root,
                _since(t0),
            )
        except BaseException as e:
            error = e
            logger.error(
                "save of step %d under %s failed (training goes on; the newest committed step "
                "stays; the error is raised by %s): %s",
                step,
                self.root,
                "the next save" if self.raise_on_next_save else "wait() or close()",
                e,
            )
        # The cleaner's mark goes first (a failed save's folder is debris now, the worker's to
        # delete): once ``_wait_for_saves`` returns, no save that ended is held in flight.
        self._cleaner.end(step, failed=error is not None)
        with self._lock:
            if error is not None:
                self._errors.append(error)
            self._in_flight.remove(threading.current_thread())
        if self._ranks.rank == 0 and not self._closed:
            self._cleaner.run_round()

    def _take_part(self, path: str, app_state: dict[str, Any], pg: Any) -> None:
        """The memory tier's take of this rank's part (``pg``: this rank alone), uncompressed:
        the tier writes at memory speed, and ``zstd_level`` applies to durable steps."""
        Snapshot.take(path, app_state, pg=pg, options=replace(self.options, zstd_level=0))

    def _refuse_occupied(self, step: int) -> None:
        """Raises ``SnapshotExistsError`` when the last listing found a folder at ``step`` that
        is not a take's debris (a committed step after the one restored, a folder the manager
        leaves alone), before anything is written."""
        what = self._occupied.get(step)
        if what is None:
            return
        path = self._steps.path(self._folders.get(step, step_name(step)))
        later = sorted(s for s in self._occupied if s > step)
        after = f" (and {', '.join(map(str, later[:10]))} after it)" if later else ""
        if what == COMMITTED:
            head = f"step {step} is already committed under {self.root}{after}: {path}"
        else:
            head = f"step {step} cannot be saved under {self.root}: {path} is there ({what})"
        raise SnapshotExistsError(
            f"{head}. A save never replaces a folder, and the manager deletes no committed step "
            "but those its policy lets go: to train on from an earlier step, save under another "
            f"root, or save steps after {max(self._occupied)}, or move the later steps away "
            "first"
        )

    def _wait_for_saves(self, most: int) -> None:
        """Waits until at most ``most`` saves are writing, oldest first, each until its
        commit thread has recorded its end (its error is that thread's to record)."""
        while True:
            with self._lock:
                if len(self._in_flight) <= most:
                    return
                oldest = self._in_flight[0]
            oldest.join()

    def wait_staged(self, timeout: float | None = None) -> None:
        """With ``stage_in_background``: returns once the newest save has copied the state it
        was given, so that state no hook guards may change (``PendingSnapshot.wait_staged``,
        which takes ``timeout`` in seconds the same way); at once otherwise."""
        self._check_open("wait_staged")
        if self._staging is not None:
            try:
                self._staging.wait_staged(timeout)
            except SnapshotError:
                pass  # a failed save: its commit thread records it, for wait() or close()

    def wait(self) -> None:
        """Waits for the saves under way and the deletions queued; raises the first error of
        a save that failed in the background."""
        self._wait_for_saves(0)
        if self._tier is not None:
            self._tier.wait()
        self._cleaner.join()
        self._ranks.barrier()
        self._raise_background_error()

    def _raise_background_error(self) -> None:
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            first = errors[0]
            if len(errors) > 1:
                logger.error("%d more background saves failed under %s", len(errors) - 1, self.root)
            raise first

    def steps(self) -> list[int]:
        """The committed steps under the root, ascending (as rank 0 finds them); one whose
        manifest cannot be read is not among them (it is kept, with a warning).

        Raises:
            StorageError: the root could not be listed.
            InvalidArgumentError: two folders hold one step (``step_5`` and
                ``step_0000000005``).
        """
        found: list[StepInfo] = self._ranks.agreed(self._cleaner.scan)
        # A step has one folder at most (``Steps.scan``), beside which links may be named
        # like it: the folder is the one used.
        self._folders = {s.step: s.name for s in found if s.reason not in NOT_FOLDERS}
        # What blocks a save at a step: anything but a take's debris.
        self._occupied = {
            s.step: s.reason if s.state == LEFT else s.state for s in found if not s.debris
        }
        self._occupied.update((s.step, COMMITTED) for s in found if s.committed)
        return [s.step for s in found if s.committed]

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    def restore(self, app_state: dict[str, Any], step: int | None = None) -> int | None:
        """Restores ``app_state`` from step ``step`` (default: the newest committed), after the
        saves under way; returns the step, or None when none is committed (start fresh).

        Raises:
            InvalidArgumentError: ``step`` is given but not committed under the root.
        """
        self._check_open("restore")
        self._wait_for_saves(0)
        if self._tier is not None and step is None:
            return self._restore_tiered(app_state)
        return self._restore_durable(app_state, step)

    def _restore_durable(self, app_state: dict[str, Any], step: int | None) -> int | None:
        """``restore`` from the durable root."""
        committed = self.steps()
        if step is None:
            if not committed:
                logger.info("no committed step under %s: nothing restored", self.root)
                return None
            step = committed[-1]
        elif step not in committed:
            shown = ", ".join(map(str, committed[-10:])) or "none"
            raise InvalidArgumentError(
                f"step {step} is not committed under {self.root} (committed: {shown})"
            )
        t = time.perf_counter()
        path = self._steps.path(self._folders[step])
        Snapshot(
            path, pg=self.pg, storage_options=self.storage_options, options=self.options
        ).restore(app_state, options=self.options)
        logger.info("restored step %d from %s in %.3f s", step, path, _since(t))
        self._last_saved = max(step, self._last_saved or 0)
        self._durable_saved = step
        return step

    def _restore_tiered(self, app_state: dict[str, Any]) -> int | None:
        """``restore`` with the memory tier: the newest step complete in any tier; the tier
        restores each rank's part it has valid, durable storage the step when a part is
        missing or bad everywhere in memory."""
        assert self._tier is not None
        self._tier.wait()
        # The durable steps by their manifests' presence (none is read here).
        durable = set(self._ranks.agreed(self._steps.committed_steps))
        t = time.perf_counter()
        path = self._steps.path  # a step's folder as the manager names it
        step, failed = self._tier.restore(app_state, durable, lambda s: path(step_name(s)))
        if step is not None and not failed:
            logger.info("restored step %d from the memory tier in %.3f s", step, _since(t))
            self._tier.forget_after(step)
            self._last_saved = max(step, self._last_saved or 0)
            if step in durable:
                self._durable_saved = step
            return step
        step = self._tier.fallback(step, failed, durable)
        restored = self._restore_durable(app_state, step)
        self._tier.forget_after(restored)
        return restored

    def handle_preemption(
        self,
        app_state: dict[str, Any] | None = None,
        step_fn: Callable[[], int] | None = None,
        *,
        signals: Iterable[int] = (signal.SIGTERM,),
    ) -> None:
        """Watches for the signals a scheduler sends before it stops a job (SIGTERM). The
        handler only records the signal (``manager.preempted = True``): it may run in the
        middle of a step, so it never saves. The final save happens at a step boundary:
        call :meth:`checkpoint_if_preempted` after each step.

        ``app_state`` and ``step_fn`` (deprecated; ``step_fn`` is not called): with them, the
        next :meth:`save` after the signal is the final one, and ``checkpoint_if_preempted``
        may be called without ``app_state``.
        """
        if (app_state is None) != (step_fn is None):
            raise InvalidArgumentError("handle_preemption takes app_state and step_fn together")
        if step_fn is not None:
            warnings.warn(
                "handle_preemption(app_state, step_fn) no longer saves from the signal handler "
                "(that could save a state in the middle of a step): the final save happens at "
                "the next save(); call manager.checkpoint_if_preempted(step, app_state) after "
                "each step instead",
                DeprecationWarning,
                stacklevel=2,
            )
        self._drop_handler()
        self._preempt_state, self._signum = app_state, None
        self._previous = {s: signal.signal(s, self._on_signal) for s in signals}

    def _on_signal(self, signum: int, frame: Any) -> None:
        """The handler ``handle_preemption`` installs: it only records and logs the signal,
        so a save it interrupts completes."""
        self._signum = self._signum or signum
        self.preempted = True
        logger.warning(
            "signal %d received by the checkpoint manager of %s: manager.preempted is set, the "
            "final save happens at the next step boundary",
            signum,
            self.root,
        )

    def checkpoint_if_preempted(self, step: int, app_state: dict[str, Any] | None = None) -> None:
        """Marks a step boundary (``app_state`` holds the state after step ``step``). Returns
        at once unless a watched signal arrived on any rank (the ranks agree here, one small
        collective). Then waits for the saves under way, saves ``step`` synchronously unless
        it is saved already, closes the manager, restores the replaced signal handlers and
        sends the signal again, so the process ends as the signal would have ended it; if it
        survives that, raises ``SystemExit(128 + signum)``. Errors of the final or of a
        background save are raised. ``app_state`` defaults to ``handle_preemption``'s.
        """
        self._check_open("checkpoint_if_preempted")
        if any(resolve_group(self.pg, self.options).all_gather(self.preempted)):
            if not self.preempted:
                logger.warning("preempted: another rank received the signal")
            self.preempted = True
        if not self.preempted:
            return
        app_state = self._preempt_state if app_state is None else app_state
        if app_state is None:
            raise InvalidArgumentError(
                "checkpoint_if_preempted needs app_state (none was given to handle_preemption)"
            )
        self._preempt_state = None  # the save below is the final one, not a trigger
        signum = self._signum or signal.SIGTERM
        try:
            self._wait_for_saves(0)
            last = self._last_saved
            if last is not None and step <= last and self._durable_saved != last and self._tier:
                # The newest save is in memory only: the root gets it before the exit.
                logger.warning("preempted: saving step %d under %s before exiting", last, self.root)
                self.async_, async_ = False, self.async_
                try:
                    self._save_durable(last, app_state, {})
                finally:
                    self.async_ = async_
            elif last is not None and step <= last:
                logger.warning(
                    "preempted: step %d is saved already under %s (the newest saved is %d)",
                    step,
                    self.root,
                    last,
                )
            else:
                logger.warning("preempted: saving step %d under %s before exiting", step, self.root)
                self.async_, async_ = False, self.async_
                self._final = True  # to the root too, with a memory tier
                try:
                    self.save(step, app_state)
                finally:
                    self.async_ = async_
            self.close()
        finally:
            self._drop_handler()  # where the save or the close failed: the error goes on
        logger.warning(
            "preempted: the saves under %s are committed; ending by signal %d", self.root, signum
        )
        for stream in (sys.stdout, sys.stderr):  # a signal's default action flushes nothing
            with contextlib.suppress(OSError, ValueError):
                if stream is not None:
                    stream.flush()
        signal.raise_signal(signum)
        raise SystemExit(128 + signum)

    def _drop_handler(self) -> None:
        """Puts back the signal handlers ``handle_preemption`` replaced (the default one where
        an earlier handler was installed from outside Python)."""
        for s, handler in self._previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        self._previous, self._preempt_state = {}, None

    def close(self) -> None:
        """Waits for the saves and deletions under way, then stops the cleaner's thread and the
        preemption handler. Raises a background save's error, if any."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._drop_handler()
            self._cleaner.stop()
            if self._tier is not None:
                self._tier.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.close()
        except Exception as e:
            if exc[0] is None:
                raise
            # The block's error goes on; a background one is logged, not raised over it.
            logger.error("closing the checkpoint manager of %s: %s", self.root, e)

    def _check_open(self, call: str) -> None:
        if self._closed:
            raise SnapshotError(f"CheckpointManager.{call}: the manager of {self.root} is closed")


def _since(t: float) -> float:
    return time.perf_counter() - t


__all__ = ["CheckpointManager"]
