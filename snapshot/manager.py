"""``CheckpointManager``: the loop every training script writes around snapshots.

A folder per step under one root, resume from the newest committed step, keep the last few
and some milestones, never delete the one being written, delete in the background::

    manager = CheckpointManager("ckpt", keep_last=3, keep_every_steps=1000)
    start = manager.restore(app_state)  # the step restored, or None: start fresh
    for step in range(0 if start is None else start + 1, steps):
        train_one_step()
        if step % 100 == 0:
            manager.save(step, app_state, metrics={"loss": loss})
    manager.close()

One job owns a root: the manager assumes no other process takes or deletes step folders there
(a second job at the same root would see the first one's saves under way as incomplete
folders, and clean them).

What the manager deletes (docs/reliability.md, "Checkpoint manager and deletions"): committed
steps its policy lets go, and folders holding a take's pending marker and nothing but what a
take writes; each only after checking the whole folder (no link, nothing a take does not
write). It never deletes a committed step it cannot read, a folder without the marker (another
library's snapshot, a user's files), nor anything through a link.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from snapshot._engine import arguments
from snapshot._engine.dist.dist import RankZero
from snapshot._engine.manager import preemption
from snapshot._engine.manager.preemption import PreemptionHandler
from snapshot._engine.manager.retention import Cleaner, Policy
from snapshot._engine.manager.steps import COMMITTED, NOT_FOLDERS, UNREADABLE, Steps, step_name
from snapshot.errors import InvalidArgumentError, SnapshotError, SnapshotExistsError
from snapshot.options import Options, resolve
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
            ``"max"``: higher); steps saved without that metric are not ranked.
            With none of the three, every step is kept. Together, a step is kept when any of
            them keeps it. The newest committed step, any save under way, and the bases of a
            kept incremental snapshot are never deleted.
        storage_options: for the storage plugin, as :meth:`Snapshot.take` takes them.
        pg: the process group (None: the default one when ``torch.distributed`` is
            initialized, else this process alone). Every rank calls ``save``, ``restore``,
            ``steps``, ``latest_step``, ``wait`` and ``close`` in the same order; rank 0 lists
            the steps, decides, deletes, and tells the others.
        async_: ``save`` returns once the state is captured (``Snapshot.async_take``); False:
            once it is committed (``Snapshot.take``).
        max_in_flight: how many saves may be writing at once; a save waits for the oldest
            beyond it to commit first.
        incremental: each save is an incremental take on the newest committed step
            (``Snapshot.take(..., base=...)``): tensors that did not change are not written
            again. Implies waiting for the previous save to commit before the next one.
        options: the :class:`~snapshot.Options` of every take and restore.
        raise_on_next_save: raise the error of a save that failed in the background from the
            next ``save`` too (the default leaves training running: see below).

    A save that fails in the background does not interrupt training: it is logged (ERROR,
    naming the step and the root), what it wrote is deleted, the newest committed step stays
    the one to restore, and its error is raised by the next ``wait`` or ``close`` (with
    ``raise_on_next_save=True``, by the next ``save`` already). Deletions run on a thread of
    their own and never delay a save; one that fails is logged and tried again after the next
    commit. The manager's thread ends with ``close``, or once the manager is garbage
    collected, or at interpreter exit.

    Saving a step whose folder is there already (a committed step after the one restored)
    raises ``SnapshotExistsError`` before anything is written: the manager never replaces nor
    deletes a committed step it was not asked to; save under another root, or after the
    newest step, or move the later steps away first.
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
        max_in_flight: int = 1,
        incremental: bool = False,
        options: Options | None = None,
        raise_on_next_save: bool = False,
    ) -> None:
        self.root = arguments.snapshot_path(root, "CheckpointManager", "root")
        self.policy = Policy(keep_last, keep_every_steps, keep_best, metric, mode)
        if type(max_in_flight) is not int or max_in_flight < 1:
            raise InvalidArgumentError(f"max_in_flight must be an int >= 1, got {max_in_flight!r}")
        self.storage_options = arguments.options(storage_options, "CheckpointManager", self.root)
        self.pg = pg
        self.async_ = bool(async_)
        self.max_in_flight = max_in_flight
        self.incremental = bool(incremental)
        self.raise_on_next_save = bool(raise_on_next_save)
        self.options = resolve(options)
        self._steps = Steps(self.root, self.storage_options, self.options)
        # Rank 0 lists, decides and deletes; every rank gets its answers.
        self._ranks = RankZero(pg, self.options, self.root)
        self._rank, self._world = self._ranks.rank, self._ranks.world
        # Saves not yet committed, oldest first: (step, pending snapshot or None for a
        # synchronous one still running).
        self._in_flight: list[tuple[int, PendingSnapshot | None]] = []
        # Retention and deletions (rank 0's), and which steps the saves hold.
        self._cleaner = Cleaner(self._steps, self.policy, self.root)
        self._last_saved: int | None = None
        self._errors: list[BaseException] = []
        self._lock = threading.Lock()  # guards _in_flight and _errors
        # As rank 0 last listed them (every rank: ``steps``): the folder of each step, and the
        # steps a save must not write to (a folder there that is not a take's debris).
        self._folders: dict[int, str] = {}
        self._occupied: dict[int, str] = {}
        self._cleaned = False  # incomplete folders left by an earlier run were cleaned
        self._closed = False
        self._handler: PreemptionHandler | None = None
        # Set by the handler handle_preemption installs when its signal arrives.
        self.preempted = False
        self._ending = False  # the final save after a preemption signal is under way

    # -- saving ---------------------------------------------------------------------------------

    def save(
        self, step: int, app_state: dict[str, Any], metrics: Mapping[str, float] | None = None
    ) -> None:
        """Snapshots ``app_state`` as step ``step`` (an int greater than every step saved
        before), with ``metrics`` (name -> finite number) recorded in it for ``keep_best``
        and ``statesnap steps``. Returns once the state is captured (``async_``) or committed.
        """
        self._check_open("save")
        if type(step) is not int or step < 0:
            raise InvalidArgumentError(f"step must be an int >= 0, got {step!r}")
        recorded = arguments.metrics(metrics)
        if self.raise_on_next_save:
            self._raise_background_error()
        # Across ranks, steps are agreed on by their order: each rank checks its own calls.
        latest = self._latest_known()
        if latest is not None and step <= latest:
            raise InvalidArgumentError(
                f"step {step} is not after the newest step under {self.root} ({latest}): steps "
                "must increase (restore() first to resume, or use another root)"
            )
        self._refuse_occupied(step)
        self._make_room()
        if self.raise_on_next_save:  # of a save that ended while this one waited for room
            self._raise_background_error()
        base = None
        if self.incremental:
            self._drain()  # the base must be committed
            newest = self.latest_step()
            base = self._steps.path(self._folders[newest]) if newest is not None else None
        self._clean_once()
        # The folder found for this step (debris a take may replace), else the canonical name.
        path = self._steps.path(self._folders.get(step, step_name(step)))
        user = {"step": step, "metrics": recorded}
        options = self.options.replace(digests=True) if self.incremental else self.options
        t = time.perf_counter()
        self._cleaner.begin(step)  # waits while debris at this step is being deleted
        try:
            # A PendingSnapshot when async, else the committed Snapshot.
            pending = (Snapshot.async_take if self.async_ else Snapshot.take)(
                path,
                app_state,
                pg=self.pg,
                storage_options=self.storage_options,
                options=options,
                base=base,
                user_metadata=user,
            )
        except BaseException:
            # The take removed what it wrote; a folder it could not remove is debris that the
            # next listing may clean.
            self._cleaner.end(step, failed=True)
            raise
        self._last_saved = step
        if self.async_:
            logger.info(
                "save of step %d under %s captured in %.3f s",
                step,
                self.root,
                time.perf_counter() - t,
            )
            with self._lock:
                self._in_flight.append((step, pending))
            # Its own thread waits for the commit: the worker may be busy deleting, which must
            # not hold a save back.
            threading.Thread(
                target=self._committed,
                args=(step, pending, t),
                name=f"statesnap-commit-{step}",
                daemon=True,
            ).start()
        else:
            logger.info(
                "save of step %d under %s committed in %.3f s",
                step,
                self.root,
                time.perf_counter() - t,
            )
            self._cleaner.end(step)
            if self._rank == 0:
                self._cleaner.run_round()
        self._after_save(step)  # under handle_preemption(app_state, step_fn): maybe the last

    def _committed(self, step: int, pending: PendingSnapshot, t0: float) -> None:
        """On a thread of its own: waits for an async save, records its end, then hands
        retention to the worker (rank 0)."""
        try:
            pending.wait()
            logger.info(
                "save of step %d under %s committed %.3f s after it began",
                step,
                self.root,
                time.perf_counter() - t0,
            )
        except BaseException as e:
            with self._lock:
                self._errors.append(e)
            self._cleaner.failed(step)  # its folder is debris now, the worker's to delete
            logger.error(
                "save of step %d under %s failed (training goes on; the newest committed step "
                "stays; the error is raised by %s): %s",
                step,
                self.root,
                "the next save" if self.raise_on_next_save else "wait() or close()",
                e,
            )
        finally:
            # The cleaner's mark goes before the entry of ``_in_flight``: once ``_drain``
            # returns, no save that ended is still held in flight for retention.
            self._cleaner.end(step)
            with self._lock:
                self._in_flight = [(s, p) for s, p in self._in_flight if p is not pending]
        if self._rank == 0 and not self._closed:
            self._cleaner.run_round()

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

    def _make_room(self) -> None:
        """Waits until fewer than ``max_in_flight`` saves are writing."""
        while True:
            with self._lock:
                if len(self._in_flight) < self.max_in_flight:
                    return
                _, oldest = self._in_flight[0]
            _wait_quietly(oldest)
            self._await_commit_record(oldest)

    def _await_commit_record(self, pending: PendingSnapshot | None) -> None:
        """Waits until the worker has recorded ``pending``'s end (it drops it from
        ``_in_flight`` right after its wait returns)."""
        while True:
            with self._lock:
                if all(p is not pending for _, p in self._in_flight):
                    return
            time.sleep(0.001)

    def _drain(self) -> None:
        """Waits for every save under way to commit (or fail)."""
        while True:
            with self._lock:
                if not self._in_flight:
                    return
                _, oldest = self._in_flight[0]
            _wait_quietly(oldest)
            self._await_commit_record(oldest)

    def _clean_once(self) -> None:
        """Before the first save: incomplete folders an earlier run left (a crash mid-take or
        mid-delete) are deleted on rank 0, in the background."""
        if self._cleaned:
            return
        self._cleaned = True
        if self._rank == 0:
            self._cleaner.run_round()

    def wait(self) -> None:
        """Waits for every save under way to commit and for the deletions queued so far;
        raises the error of a save that failed in the background (the first, once)."""
        self._drain()
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

    # -- what is committed ----------------------------------------------------------------------

    def steps(self) -> list[int]:
        """The committed steps under the root, ascending (as rank 0 finds them); a step whose
        manifest cannot be read is not one of them (it is kept, and a warning says why).

        Raises:
            StorageError: the root could not be listed.
            InvalidArgumentError: two folders hold one step (``step_5`` and
                ``step_0000000005``).
        """

        def listing() -> tuple[list[tuple[int, str]], list[tuple[int, str, str]]]:
            found = self._steps.scan()
            self._cleaner.note(found)
            good = [(s.step, s.name) for s in found if s.committed]
            # (step, folder or "" for a link or a file, what blocks a save there or "")
            others = [
                (
                    s.step,
                    "" if s.reason in NOT_FOLDERS else s.name,
                    "" if s.debris else s.state if s.state == UNREADABLE else s.reason,
                )
                for s in found
                if not s.committed
            ]
            return good, others

        good, others = self._ranks.agreed(listing)
        # A step has one folder at most (``Steps.scan``), beside which links may be named
        # like it: the folder is the one used.
        self._folders = {step: name for step, name in good}
        self._folders.update((step, name) for step, name, _ in others if name)
        self._occupied = {step: what for step, _, what in others if what}
        self._occupied.update((step, COMMITTED) for step, _ in good)
        return [step for step, _ in good]

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    def _latest_known(self) -> int | None:
        """The newest step saved by this manager, or else committed under the root."""
        if self._last_saved is not None:
            return self._last_saved
        return self.latest_step()

    def restore(self, app_state: dict[str, Any], step: int | None = None) -> int | None:
        """Restores ``app_state`` from step ``step`` (the newest committed one by default), on
        every rank the same step. Returns the step restored, or None when no step is committed
        (start fresh). Waits for the saves under way first.

        Raises:
            InvalidArgumentError: ``step`` is given but not committed under the root.
        """
        self._check_open("restore")
        self._drain()
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
        logger.info("restored step %d from %s in %.3f s", step, path, time.perf_counter() - t)
        if self._last_saved is None or step > self._last_saved:
            self._last_saved = step
        return step

    # -- preemption -----------------------------------------------------------------------------

    def handle_preemption(
        self,
        app_state: dict[str, Any] | None = None,
        step_fn: Callable[[], int] | None = None,
        *,
        signals: Iterable[int] = (signal.SIGTERM,),
    ) -> None:
        """Watches for the signals a scheduler sends before it stops a job (SIGTERM from SLURM
        and Kubernetes). The handler only records the signal (``manager.preempted = True``)
        and logs it: it never saves, since it runs on the main thread wherever that is, in the
        middle of a step (between two parameters' updates) as likely as between two steps.

        The final save happens at a step boundary the training loop marks: call
        :meth:`checkpoint_if_preempted` after each step. Or check ``manager.preempted`` and
        save, close and exit at a point of the loop's choosing.

        ``app_state`` and ``step_fn`` (deprecated; ``step_fn`` is no longer called): with them,
        the next :meth:`save` after the signal is the final one (it runs synchronously, then
        the process ends as :meth:`checkpoint_if_preempted` ends it), and
        ``checkpoint_if_preempted`` may be called without ``app_state``. A loop that saves
        rarely then runs on until its next save: call ``checkpoint_if_preempted`` each step.
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
        if self._handler is not None:
            self._handler.uninstall()
        self._handler = PreemptionHandler(self, app_state, tuple(signals))

    def checkpoint_if_preempted(self, step: int, app_state: dict[str, Any] | None = None) -> None:
        """Marks a step boundary: call it after each step, when ``app_state`` holds the state
        after step ``step``, whole. Returns at once unless a signal that
        :meth:`handle_preemption` watches has arrived (on any rank: with a process group the
        ranks agree on it here, one small collective per call). Then: waits for the saves under
        way, saves ``app_state`` as step ``step`` synchronously unless that step is saved
        already, waits for the deletions, closes the manager, restores the signal handlers it
        replaced and sends the signal again, so the process ends as the signal would have
        ended it (for SIGTERM with no earlier handler: killed by it, exit status 143 in a
        shell). If the process survives that (an earlier Python handler that returns, or an
        ignored signal), raises ``SystemExit(128 + signum)``.

        ``app_state`` defaults to the one given to ``handle_preemption``. An error of the final
        save, or of a save that failed in the background, is raised (the handlers restored).
        """
        self._check_open("checkpoint_if_preempted")
        if not self._preemption_agreed():
            return
        if app_state is None:
            app_state = self._handler.app_state if self._handler is not None else None
            if app_state is None:
                raise InvalidArgumentError(
                    "checkpoint_if_preempted needs app_state (none was given to handle_preemption)"
                )
        self._final_save(step, app_state)

    def _preemption_agreed(self) -> bool:
        """Whether a preemption signal arrived on any rank (this rank alone without a group)."""
        return preemption.agreed(self, self._world, self.pg, self.options)

    def _after_save(self, step: int) -> None:
        """End of :meth:`save` under ``handle_preemption(app_state, step_fn)``: after a
        signal, that save is the final one."""
        handler = self._handler
        if handler is None or handler.app_state is None or self._ending:
            return
        if self._preemption_agreed():
            self._final_save(step, handler.app_state)

    def _final_save(self, step: int, app_state: dict[str, Any]) -> None:
        """At a step boundary after a preemption signal: saves ``step`` once, waits for every
        save and deletion, closes, then ends the process by the signal."""
        self._ending = True
        handler = self._handler
        signum = handler.signum if handler is not None and handler.signum else signal.SIGTERM
        try:
            self._drain()
            preemption.save_last(self, step, app_state, self._last_saved)  # and closes
        finally:
            if self._handler is not None:  # the save or the close failed: the error goes on
                self._handler.uninstall()
                self._handler = None
        preemption.end_by_signal(self.root, signum)

    # -- closing --------------------------------------------------------------------------------

    def close(self) -> None:
        """Waits for the saves and deletions under way, then stops the manager's thread and its
        preemption handler. Raises a background save's error, if any."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            if self._handler is not None:
                self._handler.uninstall()
                self._handler = None
            self._cleaner.stop()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        else:  # the block's error goes on; a background one is logged, not raised over it
            try:
                self.close()
            except Exception as e:
                logger.error("closing the checkpoint manager of %s: %s", self.root, e)

    def _check_open(self, call: str) -> None:
        if self._closed:
            raise SnapshotError(f"CheckpointManager.{call}: the manager of {self.root} is closed")


def _wait_quietly(pending: PendingSnapshot | None) -> None:
    """Waits for a pending snapshot to end; its error is the worker's to record."""
    if pending is None:
        return
    try:
        pending.wait()
    except BaseException:
        pass


__all__ = ["CheckpointManager"]
