"""The checkpoint manager's memory tier: each rank's part of a step kept as a snapshot of its
own in a folder on its node, copied to peer ranks on other hosts, checked and repaired at
restore (docs/tiers.md).

On a node, the tier is ``<dir>/statesnap-tier-<job>/`` (``job``: a digest of the durable root,
so another job's tier is never read), holding ``job.json`` (the root and the world size) and
``step_<step>/<rank>/``, each a committed single-process snapshot of one rank's state: the
node's own ranks' parts and the replicas its ranks keep for peers. A part is complete once its
manifest is there (written last by a replica's copy; by the take, only its layouts follow). A
part holds sharded values as this rank's local pieces, their layouts beside it in
``tier_layout.json`` (``tier_parts``), and restores only into targets of the same layout (one
without the file: only state with nothing sharded). The takes are the facade's, handed in
(``take``, and ``write`` for a durable step from the parts, ``tier_durable``); the restores
are the engine's, as rank 0 alone or as one rank of a durable step (``tier_durable``). This
module decides where, and moves the bytes between ranks, on a gloo group of its own that only
its worker thread (saves) or the caller's thread (restore) uses, each collective under the
peers' heartbeat watch (``liveness.Watch``).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import os
import shutil
import socket
import struct
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from snapshot._engine import runtime
from snapshot._engine.dist import liveness
from snapshot._engine.dist.dist import resolve as coordinator_for
from snapshot._engine.manager import tier_durable, tier_parts
from snapshot._engine.manager.steps import step_name, step_of
from snapshot._engine.take.commit import MANIFEST_NAME
from snapshot.errors import RankFailedError, SnapshotError
from snapshot.options import MemoryTier, Options
from storage_plugins.base import DaemonThreadPool

logger = logging.getLogger("snapshot")

# ``take(path, app_state, pg)``: the facade's, with the manager's options; ``pg`` is this rank
# alone (or None without a process group). ``write(part, pg, sharded)``: the durable step's
# group take on ``pg`` of the part at ``part`` read back, its sharded values rebuilt by
# ``sharded`` (``tier_durable``).
Take = Callable[[str, dict[str, Any], Any], None]
Write = Callable[[str, Any, Any], None]


OTHER = "another layout: "  # a restore status: the target's sharding differs from the part's


def job_id(root: str) -> str:
    """The name of a durable root's tier folder: ``statesnap-tier-<16 hex digits>``."""
    return "statesnap-tier-" + hashlib.sha256(root.encode()).hexdigest()[:16]


def peers_of(hosts: list[str], replicas: int) -> list[list[int]]:
    """For each rank (``hosts[rank]`` its host), the ranks that keep its replicas: on each of
    the next ``replicas`` hosts in name order (cyclically), the rank with the same place
    among its host's ranks (modulo their number). One host alone: none."""
    order = sorted(set(hosts))
    by_host = {h: [r for r, x in enumerate(hosts) if x == h] for h in order}
    out: list[list[int]] = []
    for rank, host in enumerate(hosts):
        i, place = order.index(host), by_host[host].index(rank)
        peers = []
        for k in range(1, min(replicas, len(order) - 1) + 1):
            other = by_host[order[(i + k) % len(order)]]
            peers.append(other[place % len(other)])
        out.append(peers)
    return out


def pack(folder: str) -> bytearray:
    """A part's files as one message: a length-prefixed JSON list of ``[name, size]``, the
    manifest last, then their bytes in that order (writable: sent as a tensor's memory)."""
    names = sorted(
        os.path.relpath(os.path.join(d, f), folder)
        for d, _, files in os.walk(folder)
        for f in files
        if not f.endswith(".tmp")
    )
    names.sort(key=lambda n: n == MANIFEST_NAME)  # the manifest last: it commits the copy
    chunks = []
    for name in names:
        with open(os.path.join(folder, name), "rb") as f:
            chunks.append(f.read())
    header = json.dumps([[n, len(c)] for n, c in zip(names, chunks, strict=True)]).encode()
    return bytearray().join([struct.pack("<Q", len(header)), header, *chunks])


def unpack(data: bytes | bytearray | memoryview, folder: str) -> None:
    """Writes a ``pack``ed part into ``folder`` (replacing what was there): each file under a
    temporary name renamed into place, the manifest last."""
    (n,) = struct.unpack_from("<Q", data)
    listed = json.loads(bytes(data[8 : 8 + n]))
    remove(folder)
    at = 8 + n
    for name, size in listed:
        parts = name.split("/")
        if any(p in ("", ".", "..") for p in parts) or os.path.isabs(name):
            raise SnapshotError(f"a peer sent a part naming {name!r}, outside its folder")
        path = os.path.join(folder, *parts)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "wb") as f:
            f.write(data[at : at + size])
        os.replace(path + ".tmp", path)
        at += size


def remove(folder: str) -> None:
    """Deletes a folder of the tier's, gone already or not (another rank of the node may be
    deleting it too)."""
    shutil.rmtree(folder, ignore_errors=True)


class Tier:
    """One rank's view of the memory tier of the manager of ``root`` (see the module)."""

    def __init__(
        self,
        config: MemoryTier,
        root: str,
        pg: Any | None,
        options: Options,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        import torch.distributed as dist

        self.config, self.options, self.storage_options = config, options, storage_options
        # A local root by its absolute path: "ckpt" of two jobs in two folders are two roots.
        self.root = root if "://" in root else os.path.abspath(root)
        self.folder = os.path.join(os.path.abspath(os.fspath(config.dir)), job_id(self.root))
        self.rank, self.world = 0, 1
        self.alone: Any = None  # this rank's group of one: the takes of its part
        self.group: Any = None  # the tier's gloo group: replicas and restore's agreements
        self.global_ranks = [0]
        self.watch: Any = None  # liveness.Watch of the tier's group
        self.sharded: dict[int, Any] = {}  # the newest part's tier_parts.rebuilders, by step
        host = config.host if config.host is not None else socket.gethostname()
        self.hosts = [host]
        if dist.is_available() and dist.is_initialized():
            self.rank, self.world = dist.get_rank(pg), dist.get_world_size(pg)
            ranks = dist.get_process_group_ranks(pg if pg is not None else dist.group.WORLD)
            self.global_ranks = list(ranks)
            if self.world > 1:
                seconds, rank_timeout = options.collective_timeout_secs, options.rank_timeout_secs
                assert seconds is not None and rank_timeout is not None  # resolved options
                timeout = datetime.timedelta(seconds=seconds)
                local = len(ranks) < dist.get_world_size()
                # Every collective of the tier's runs under a watch of the peers' heartbeats,
                # as a take's do: a silent peer fails it within rank_timeout_secs, one whose
                # process ended at once, each a RankFailedError naming the rank.
                runtime.get().heartbeat(dist.get_rank(), rank_timeout)
                self.watch = liveness.Watch(self.rank, ranks, rank_timeout, seconds)
                self.group = self.watch.run(
                    lambda: dist.new_group(
                        ranks=ranks,
                        backend="gloo",
                        timeout=timeout,
                        use_local_synchronization=local,
                    ),
                    self._lost,
                )
                me = dist.get_rank()
                self.alone = dist.new_group(
                    ranks=[me], backend="gloo", timeout=timeout, use_local_synchronization=True
                )
                self.hosts = self._all_gather(host)
                # The library's group for the durable takes on the worker, made here: made
                # there, it could be made in another order than the caller's groups.
                coordinator_for(self.group, options)
        self.host = host
        # A tier of another world size on this node is deleted (by the node's first rank, the
        # others waiting for it): its parts cannot be restored, nor mixed with new ones.
        if self.rank == min(r for r, h in enumerate(self.hosts) if h == host):
            if os.path.isdir(self.folder) and not self._check_job():
                self.forget_after(None)
                remove(os.path.join(self.folder, "job.json"))
            self._check_job()
        self._all_gather(None)
        self.peers = peers_of(self.hosts, config.replicas)
        self.keepers = [
            [r for r in range(self.world) if s in self.peers[r]] for s in range(self.world)
        ]
        if config.replicas and len(set(self.hosts)) < 2 and self.world > 1:
            logger.warning(
                "memory tier of %s: every rank is on host %r, so no part has a replica on "
                "another host (losing the host loses the tier; durable storage remains)",
                root,
                host,
            )
        self.saves = 0  # saves so far: every durable_every-th also goes to the durable root
        self.complete: list[int] = []  # the steps replicated on every rank, oldest first
        self._worker = DaemonThreadPool(1, "statesnap-tier")
        self._last: Future[None] | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ layout

    def part(self, step: int, rank: int) -> str:
        return os.path.join(self.folder, step_name(step), str(rank))

    def _check_job(self) -> bool:
        """Whether the node's tier folder is this job's at this world size (writing
        ``job.json`` when there is none); a mismatch is logged and the tier not read."""
        path = os.path.join(self.folder, "job.json")
        want = {"root": self.root, "world_size": self.world}
        try:
            with open(path) as f:
                found = json.load(f)
        except FileNotFoundError:
            os.makedirs(self.folder, exist_ok=True)
            with open(f"{path}.{os.getpid()}.tmp", "w") as f:
                json.dump(want, f)
            os.replace(f"{path}.{os.getpid()}.tmp", path)
            return True
        except (OSError, ValueError) as e:
            logger.warning("memory tier %s: unreadable job.json (%s): ignored", self.folder, e)
            return False
        if found != want:
            logger.warning(
                "memory tier %s was written by %s (another job, or another world size): ignored",
                self.folder,
                found,
            )
            return False
        return True

    def inventory(self) -> dict[int, list[int]]:
        """The steps in this node's tier and the ranks whose part each holds complete."""
        if not os.path.isdir(self.folder) or not self._check_job():
            return {}
        out: dict[int, list[int]] = {}
        for name in os.listdir(self.folder):
            step = step_of(name)
            if step is None:
                continue
            with contextlib.suppress(OSError):
                out[step] = sorted(
                    int(r)
                    for r in os.listdir(os.path.join(self.folder, name))
                    if r.isdigit()
                    and int(r) < self.world
                    and os.path.isfile(os.path.join(self.folder, name, r, MANIFEST_NAME))
                )
        return out

    def _node_steps(self) -> list[int]:
        with contextlib.suppress(OSError):
            return sorted(s for n in os.listdir(self.folder) if (s := step_of(n)) is not None)
        return []

    def forget_after(self, step: int | None) -> None:
        """Deletes the node's steps after ``step`` (all, for None): a restore chose an older
        step, so they belong to a run that is being abandoned."""
        for s in self._node_steps():
            if step is None or s > step:
                remove(os.path.join(self.folder, step_name(s)))

    def _used_bytes(self) -> int:
        total = 0
        for d, _, files in os.walk(self.folder):
            for f in files:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(d, f)).st_size
        return total

    def _prune(self, newest: int) -> None:
        """Keeps the newest ``keep`` complete steps up to ``newest`` (never later ones, which
        a save may be writing), then drops the oldest of those while over the budget."""
        kept = self.complete[-self.config.keep :]
        for s in self._node_steps():
            if s < newest and s not in kept:
                remove(os.path.join(self.folder, step_name(s)))
        budget = self.config.budget_bytes
        if budget is None:
            return
        while len(kept) > 1 and self._used_bytes() > budget:
            logger.warning(
                "memory tier %s over its budget of %d bytes: step %d dropped from it",
                self.folder,
                budget,
                kept[0],
            )
            dropped = kept.pop(0)
            self.complete.remove(dropped)
            remove(os.path.join(self.folder, step_name(dropped)))
        used = self._used_bytes()
        if used > budget:
            logger.warning(
                "memory tier %s holds %d bytes, over its budget of %d, with one complete step "
                "(%d): it stays, as the only one the tier can restore",
                self.folder,
                used,
                budget,
                newest,
            )

    # ------------------------------------------------------------------ saves

    def durable(self) -> bool:
        """Counts a save; whether it also goes to the durable root."""
        self.saves += 1
        return self.saves % self.config.durable_every == 0

    def save(self, step: int, app_state: dict[str, Any], take: Take) -> None:
        """Takes this rank's part of ``step`` into its node's tier, then (on the worker) copies
        it to the peers once every rank has taken its own. A take that failed is raised, and
        the others are told (the step is not replicated anywhere)."""
        path = self.part(step, self.rank)
        error: BaseException | None = None
        try:
            remove(path)
            wrapped = tier_parts.wrap(app_state, None, path)  # sharded values as their local pieces
            take(path, wrapped, self.alone)
            tier_parts.write_layouts(path, wrapped)
            self.sharded = {step: tier_parts.rebuilders(wrapped)}  # None: not rebuilt from it
        except BaseException as e:
            error = e
        with self._lock:
            self._last = self._worker.submit(self._replicate, step, error is None)
        if error is not None:
            raise error

    def has_part(self, step: int) -> tuple[bool, bool]:
        """Whether this rank's part of ``step`` is complete in its node's tier, and whether it
        holds sharded values a durable step cannot be written from (``tier_parts.rebuilders``)."""
        path = self.part(step, self.rank)
        return (
            os.path.isfile(os.path.join(path, MANIFEST_NAME)),
            self.sharded.get(step) is None,
        )

    def write_durable(self, step: int, write: Write) -> Future[None]:
        """Writes the durable step ``step`` from this rank's part of it, on the worker after
        the step's replication (``write``, a group take on the tier's group: every rank calls
        this for the same steps in the same order). Its future holds the take's outcome."""
        return self._worker.submit(self._durable, step, write, self.sharded.get(step))

    def _durable(self, step: int, write: Write, sharded: Any) -> None:
        path = self.part(step, self.rank)
        # Every rank must reach the take's agreements: one without its part says so first.
        ok = os.path.isfile(os.path.join(path, MANIFEST_NAME))
        missing = [r for r, good in enumerate(self._all_gather(ok)) if not good]
        if missing:
            raise SnapshotError(
                f"step {step} was not written to {self.root}: the memory tier has no part of "
                f"rank(s) {missing} to write it from"
            )
        write(path, self.group, sharded)

    def _replicate(self, step: int, ok: bool) -> None:
        """On the worker: once every rank has its part of ``step``, each sends its part to its
        peers and writes the parts it keeps for others; then the node's tier is pruned."""
        try:
            oks = self._all_gather(ok)
            if not all(oks):
                failed = [r for r, good in enumerate(oks) if not good]
                logger.warning(
                    "memory tier: step %d not replicated, its take failed on rank(s) %s",
                    step,
                    failed,
                )
                return
            outgoing = {p: pack(self.part(step, self.rank)) for p in self.peers[self.rank]}
            got = self._exchange(outgoing, self.keepers[self.rank])
            for src, data in got.items():
                unpack(data, self.part(step, src))
            self.complete.append(step)
            self._prune(step)
        except BaseException as e:
            logger.error("memory tier: replicating step %d failed: %s", step, e)
            raise

    def wait(self) -> None:
        """Waits for the replication of the saves so far; raises its error."""
        with self._lock:
            last = self._last
        if last is not None:
            last.result()

    def close(self) -> None:
        with contextlib.suppress(BaseException):
            self.wait()
        self._worker.shutdown(wait=False)

    # ------------------------------------------------------------------ restores

    def restore(
        self,
        app_state: dict[str, Any],
        durable: set[int],
        durable_path: Callable[[int], str] | None = None,
        below: float = float("inf"),
    ) -> tuple[int | None, list[int]]:
        """Restores the newest step complete in the tier (older than ``below``) when no durable
        step is newer: each rank's part from its node, else from a peer's replica, else (when
        the root holds the step at ``durable_path(step)``) that rank's part of the durable step,
        each checked as its bytes land (a part that fails is restored again in full from the
        next source, overwriting what it loaded; the other ranks keep theirs; one whose targets
        are laid out otherwise is tried from no other source). Returns the step (None: the tier
        has no step to restore, nothing was loaded) and the ranks whose part no source could
        give (the caller restores that step, or an older one, from durable storage)."""
        inventory = self.inventory()
        every = self._all_gather(inventory)
        holders: dict[int, dict[int, list[int]]] = {}  # step -> part -> ranks whose node has it
        for q, found in enumerate(every):
            for step, parts in found.items():
                for r in parts:
                    holders.setdefault(step, {}).setdefault(r, []).append(q)
        complete = [s for s, p in holders.items() if len(p) == self.world and s < below]
        newest = max(complete, default=None)
        newest_durable = max(durable, default=None)
        if newest is None or (newest_durable is not None and newest_durable > newest):
            logger.info(
                "memory tier %s: no complete step newer than durable storage's (%s)",
                self.folder,
                newest_durable,
            )
            return None, []
        # Steps restored or older count toward ``keep`` for the saves that follow.
        step, self.complete = newest, sorted(c for c in complete if c <= newest)
        if self.rank in inventory.get(step, []):
            status = self._try(step, app_state, "its node's memory")
        else:
            status = "not in its node's memory"
            logger.warning("rank %d: its part of step %d is %s", self.rank, step, status)
        statuses = self._all_gather(status)
        # A part whose target is laid out otherwise fits no replica either: durable storage.
        need = [r for r, s in enumerate(statuses) if s is not None and not s.startswith(OTHER)]
        if need:
            # Each part missing or bad: from a rank on another host whose node holds it.
            source = {r: self._source(r, holders[step][r]) for r in need}
            outgoing = {r: pack(self.part(step, r)) for r in need if source[r] == self.rank}
            mine = source.get(self.rank)
            got = self._exchange(outgoing, [mine] if mine is not None else [])
            if self.rank in need:
                if mine is None:
                    status = "no replica on another host"
                    logger.warning("rank %d: step %d has %s", self.rank, step, status)
                else:
                    unpack(got[mine], self.part(step, self.rank))
                    status = self._try(step, app_state, f"the replica of rank {mine}")
            statuses = self._all_gather(status)
        failed = [r for r, s in enumerate(statuses) if s is not None]
        if failed and durable_path is not None and step in durable:
            if any(statuses[r].startswith(OTHER) for r in failed):
                return step, failed  # targets laid out otherwise: the whole step, resharded
            if self.rank in failed:
                # This rank's part of the durable step alone; the others keep what they loaded.
                where, status = "durable storage", None
                logger.warning(
                    "rank %d: its part of step %d is valid in no memory: restoring it from %s",
                    self.rank,
                    step,
                    where,
                )
                try:
                    path, rank = durable_path(step), self.rank
                    tier_durable.restore_rank(
                        path, app_state, rank, self.storage_options, self.options
                    )
                    logger.info("rank %d: step %d restored from %s", self.rank, step, where)
                except Exception as e:  # every rank must reach the agreement below
                    status = f"{type(e).__name__}: {e}"
                    logger.warning("rank %d: from %s, step %d: %s", self.rank, where, step, status)
            failed = [r for r, s in enumerate(self._all_gather(status)) if s is not None]
        return step, failed

    def fallback(self, step: int | None, failed: list[int], durable: set[int]) -> int | None:
        """The durable step to restore after ``restore`` returned ``step`` and ``failed``:
        that step when the root has it, else the root's newest before it (None: the root's
        newest, the tier having had no step).

        Raises:
            SnapshotError: no step of the root to fall back on, after a part failed.
        """
        if step is None:
            return None
        if step in durable:
            logger.warning(
                "step %d: rank(s) %s have no valid part in memory: restoring it from durable "
                "storage",
                step,
                failed,
            )
            return step
        older = max((s for s in durable if s < step), default=None)
        if older is None:
            raise SnapshotError(
                f"step {step} cannot be restored: the part of rank(s) {failed} is valid in no "
                f"memory tier, and {self.root} holds no step to fall back on; app_state may "
                "hold values loaded before a check failed"
            )
        logger.warning(
            "step %d: no valid part of rank(s) %s in any memory tier and none in durable "
            "storage; restoring step %d from durable storage",
            step,
            failed,
            older,
        )
        return older

    def _source(self, part: int, holders: list[int]) -> int | None:
        """The rank that sends ``part``: one on another host whose node holds it, the part's
        own keeper first (so the senders are spread as the replicas were)."""
        away = [q for q in holders if self.hosts[q] != self.hosts[part]]
        keepers = [q for q in away if q in self.keepers[part]]
        found = keepers or away
        return found[0] if found else None

    def _try(self, step: int, app_state: dict[str, Any], source: str) -> str | None:
        """Restores this rank's part of ``step`` from its node, its sharded values as local
        pieces into targets of the part's layout; None when it did, else why not (its checks
        failed, or ``OTHER`` and how the targets are laid out otherwise: nothing was read)."""
        part = self.part(step, self.rank)
        wrapped = tier_parts.wrap(app_state, tier_parts.read_layouts(part), part)
        try:
            tier_durable.restore_rank(part, wrapped, 0, None, self.options)
        except SnapshotError as e:
            other = tier_parts.mismatch(wrapped)
            if other is not None:
                logger.warning(
                    "rank %d: the part of step %d from %s was taken with another layout of "
                    "its sharded state, so the step comes from durable storage: %s",
                    self.rank,
                    step,
                    source,
                    other,
                )
                return f"{OTHER}{other}"
            logger.warning(
                "rank %d: the part of step %d from %s failed its check: %s",
                self.rank,
                step,
                source,
                e,
            )
            return f"{type(e).__name__}: {e}"
        logger.info("rank %d: step %d restored from %s", self.rank, step, source)
        return None

    # ------------------------------------------------------------------ transfers

    def _all_gather(self, value: Any) -> list[Any]:
        if self.group is None:
            return [value]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        self.watch.run(lambda: dist.all_gather_object(out, value, group=self.group), self._lost)
        return out

    def _lost(self, why: str, failures: dict[int, str]) -> RankFailedError:
        """What a rank raises when it lost contact with its peers in a tier's collective."""
        return RankFailedError(
            f"rank {self.rank} of {self.world} lost contact with the other ranks in the memory "
            f"tier of {self.root}: {why}",
            failures,
        )

    def _exchange(
        self, outgoing: dict[int, bytearray], incoming: list[int]
    ) -> dict[int, memoryview]:
        """Sends each ``outgoing`` message to its rank and receives one from each rank of
        ``incoming`` (ranks of the manager's group), on the tier's group."""
        if self.group is None:
            return {}
        import torch
        import torch.distributed as dist

        def exchange() -> dict[int, memoryview]:
            works, held = [], []
            for dst, data in outgoing.items():
                size = torch.tensor([len(data)], dtype=torch.int64)
                body = torch.frombuffer(data, dtype=torch.uint8)
                held += [size, body]
                for t in (size, body):
                    works.append(dist.isend(t, dst=self.global_ranks[dst], group=self.group))
            got = {}
            for src in incoming:
                size = torch.empty(1, dtype=torch.int64)
                dist.recv(size, src=self.global_ranks[src], group=self.group)
                body = torch.empty(int(size[0]), dtype=torch.uint8)
                dist.recv(body, src=self.global_ranks[src], group=self.group)
                got[src] = body.numpy().data  # the tensor's memory, no copy
            for w in works:
                if w is not None:
                    w.wait()
            return got

        return self.watch.run(exchange, self._lost)
