"""The operations a worker process measures (``python -m benchmarks.worker JOB.json``, see
:mod:`benchmarks.worker`): :func:`run_job` reads the job file and writes its result as JSON to
the job's ``result`` path (stdout and stderr stay free for whatever the libraries print). Ops:

``take``         generate the state, then time ``Writer.save`` (plus, in the fsync'd mode, the
                 harness's fsync of every file and directory for methods that do not fsync).
``restore``      allocate and touch the targets (for readers that load in place), then time
                 ``Reader.load``; afterwards compare the result bitwise with the generated state.
``read-object``  statesnap only: time ``Snapshot(path)`` and ``read_object`` of one tensor
                 separately, with the ``/proc/self/io`` counters around each.
``async``        generate the state, then ``calls`` times in a row: time an ``AsyncMethod``'s call
                 (the stall), flip every bit of every tensor at once (the caller changing its
                 state; timed apart), time the wait; afterwards (untimed) read back what the call
                 wrote and compare it bitwise with the state at call time, delete it, and trim
                 the heap (``common.trim_heap``). Peak and current RSS are also given above the
                 RSS before the first call, statesnap's staging pool after each call, and the
                 memory budget statesnap computed right before each call.
``train``        a small MLP trained on CPU, snapshotting every ``interval`` steps in one of the
                 ways of ``benchmarks.train_loop`` (none, take, async_take).
``async-training``
                 an MLP or a small transformer trained on CPU with AdamW, snapshotting every
                 ``interval`` steps with statesnap or one of DCP's async_save modes, or a series
                 of snapshots in a row (``benchmarks.async_training``).
``reshard-take``
                 build this rank's pieces of a ``dtensors`` state as DTensors of the job's
                 ``layout`` (``common.sharded_state``), then time a ``RESHARD_METHODS`` save.
``reshard-restore``
                 build zero-filled targets of the job's ``layout`` (DTensors on a mesh of the
                 group's ranks, or plain full tensors), then time the method's load into them;
                 afterwards check that every target was filled in place and that its local
                 tensor equals this rank's piece of the regenerated global tensor, bitwise.
``parallel-take`` / ``parallel-restore``
                 build the job's model and AdamW optimizer on its ``layout`` (FSDP2 x TP, HSDP,
                 FSDP2, plain; :mod:`benchmarks.methods.parallel`), fill them (take) or zero
                 them (restore), then time the method's save or load of their Stateful;
                 afterwards a restore checks every value's full tensor bitwise, and times
                 ``later_calls`` more restores in the same process (``later_seconds``). A take
                 with ``paired_with`` (a method) times its later calls alternating with that
                 method's, in the same processes (``paired_seconds``).

Peak RSS is measured above the RSS right before the timed region (see ``common.PeakRSS``).
When the job says ``settle_memory`` (the harness's default), the worker (rank 0 of a group)
first waits until the kernel has stopped handing freed memory back to the host
(``common.settle_memory``), and the result gives the seconds waited (``settled_seconds``).

A job with ``rank``, ``world_size`` and ``store`` is one rank of a process group (the ``dist``
and ``reshard`` cases; the harness starts ``world_size`` workers for it): the worker joins a
gloo group through the FileStore at ``store``, generates its rank's state (the spec gets
``rank``; in the reshard case the rank's pieces of the global tensors), uses the methods' group
flavors (``GROUP_WRITERS`` / ``GROUP_READERS``, or ``RESHARD_METHODS``) and times the call
between two barriers, so ``seconds`` runs until the slowest rank is done (``own_seconds`` stops
when this rank's call returns). Rank 0 measures the bytes on disk after the second barrier.

A job with ``s3`` (the ``s3`` case) uses the S3 methods (``S3_WRITERS`` / ``S3_READERS``) on the
endpoint it names, its ``path`` an ``s3://bucket/prefix`` URL; the worker reads the S3 server
process's CPU time (``s3["server_pid"]``, utime + stime from ``/proc/PID/stat``) right before
and right after the timed call and reports the difference as ``server_cpu_seconds``.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.common import (
    PeakRSS,
    StateSpec,
    build_spec,
    check_pieces,
    check_restored,
    current_rss,
    flip_bits,
    fsync_tree,
    generate_state,
    io_delta,
    local_tensor,
    make_targets,
    proc_io,
    settle_memory,
    sharded_state,
    tree_size,
    trim_heap,
)
from benchmarks.library_tree import check_tree, imported_library
from benchmarks.methods import (
    ASYNC_METHODS,
    GROUP_READERS,
    GROUP_WRITERS,
    READERS,
    RESHARD_METHODS,
    S3_READERS,
    S3_WRITERS,
    WRITERS,
    Reader,
    Writer,
    configure_s3,
    parallel,
    statesnap_path,
)
from benchmarks.methods.local import dcp_prepare, ss_prepare
from benchmarks.methods.parallel import PARALLEL_METHODS, ParallelMethod
from benchmarks.s3server import process_cpu_seconds


@dataclass(frozen=True)
class RankGroup:
    """The process group this worker is a rank of; ``world_size == 0`` for a job run alone
    (then ``barrier`` does nothing and the single-process methods are used)."""

    rank: int = 0
    world_size: int = 0
    settle: bool = False

    @classmethod
    def join(cls, job: dict[str, Any]) -> RankGroup:
        settle = bool(job.get("settle_memory"))
        if "rank" not in job:
            return cls(settle=settle)
        import torch.distributed as dist

        rank, world_size = int(job["rank"]), int(job["world_size"])
        dist.init_process_group(
            "gloo",
            store=dist.FileStore(job["store"], world_size),
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=float(job.get("group_timeout", 600))),
        )
        return cls(rank, world_size, settle)

    def leave(self) -> None:
        if self.world_size:
            import torch.distributed as dist

            dist.destroy_process_group()

    def barrier(self) -> None:
        if self.world_size:
            import torch.distributed as dist

            dist.barrier()

    def ready(self) -> dict[str, Any]:
        """Called once every rank has its state or targets and its library imported: when the
        job asks, rank 0 waits for the memory to settle (``common.settle_memory``; one machine
        for all ranks), then all meet at a barrier. The seconds waited, for the result."""
        waited = settle_memory() if self.settle and self.rank == 0 else None
        self.barrier()
        return {"settled_seconds": waited} if waited is not None else {}

    def spec(self, job: dict[str, Any]) -> StateSpec:
        """This rank's state (the spec of a grouped job depends on the rank)."""
        return build_spec({**job["state"], "rank": self.rank} if self.world_size else job["state"])

    def writer(self, name: str, s3: bool = False) -> Writer:
        if s3:
            return S3_WRITERS[name]
        return (GROUP_WRITERS if self.world_size else WRITERS)[name]

    def reader(self, name: str, s3: bool = False) -> Reader:
        if s3:
            return S3_READERS[name]
        return (GROUP_READERS if self.world_size else READERS)[name]

    def take_bytes(self, spec: StateSpec) -> int:
        """Bytes the group has to write: the replicated model once, every rank's own state."""
        if not self.world_size:
            return spec.nbytes
        return spec.group_nbytes("model") + self.world_size * (
            spec.nbytes - spec.group_nbytes("model")
        )

    def restore_bytes(self, spec: StateSpec) -> int:
        """Bytes loaded into the group's tensors: every rank's whole state."""
        return spec.nbytes * max(1, self.world_size)

    def fields(self) -> dict[str, Any]:
        return {"rank": self.rank} if self.world_size else {}


class ServerClock:
    """CPU seconds the S3 server process spent between ``start()`` and ``stop()`` (nothing
    when the job has no S3 server)."""

    def __init__(self, job: dict[str, Any]) -> None:
        self.pid = (job.get("s3") or {}).get("server_pid")
        self.cpu0 = 0.0

    def start(self) -> None:
        if self.pid:
            self.cpu0 = process_cpu_seconds(self.pid)

    def stop(self) -> dict[str, Any]:
        if not self.pid:
            return {}
        return {"server_cpu_seconds": process_cpu_seconds(self.pid) - self.cpu0}


def _take(job: dict[str, Any], ranks: RankGroup) -> dict[str, Any]:
    s3 = "s3" in job
    writer = ranks.writer(job["method"], s3)
    writer.prepare()
    spec = ranks.spec(job)
    fsync = job["mode"] == "fsync"
    path = job["path"]
    if not s3:
        os.makedirs(path, exist_ok=True)
    state = generate_state(spec, with_objects=writer.objects)
    server = ServerClock(job)
    settled = ranks.ready()
    io0 = proc_io()
    with PeakRSS() as mem:
        ranks.barrier()
        server.start()
        t0 = time.perf_counter()
        writer.save(spec, state, path, fsync)
        if fsync and not writer.self_fsync:
            fsync_tree(path)
        own_seconds = time.perf_counter() - t0
        ranks.barrier()
        seconds = time.perf_counter() - t0
        server_cpu = server.stop()
    io = io_delta(io0, proc_io())
    return {
        "ok": True,
        "seconds": seconds,
        "own_seconds": own_seconds,
        "payload_bytes": ranks.take_bytes(spec),
        "peak_rss_above_baseline": mem.above_baseline,
        "baseline_rss": mem.baseline,
        "rss_method": mem.method,
        "disk": tree_size(path) if ranks.rank == 0 and not s3 else None,
        "io": io,
        "check": {"ok": True, "detail": "n/a (take)"},
        **server_cpu,
        **settled,
        **ranks.fields(),
    }


Pointers = dict[tuple[str, str], int]


def _target_pointers(spec: StateSpec, targets: dict[str, dict[str, Any]] | None) -> Pointers:
    """(group, name) -> data_ptr of each preallocated target tensor."""
    if targets is None:
        return {}
    return {(t.group, t.name): targets[t.group][t.name].data_ptr() for t in spec.tensors}


def _kept_targets(restored: Any, pointers: Pointers) -> bool | None:
    """Whether every restored tensor is still the preallocated target (None: no targets)."""
    if not pointers or not isinstance(restored, dict):
        return None
    return all(
        isinstance(restored.get(g, {}).get(n), torch.Tensor) and restored[g][n].data_ptr() == ptr
        for (g, n), ptr in pointers.items()
    )


def _restore(job: dict[str, Any], ranks: RankGroup) -> dict[str, Any]:
    reader = ranks.reader(job["method"], "s3" in job)
    reader.prepare()
    spec = ranks.spec(job)
    targets = make_targets(spec, with_objects=reader.objects) if reader.into_targets else None
    pointers = _target_pointers(spec, targets)
    server = ServerClock(job)
    settled = ranks.ready()
    io0 = proc_io()
    with PeakRSS() as mem:
        ranks.barrier()
        server.start()
        t0 = time.perf_counter()
        restored = reader.load(spec, job["path"], targets)
        own_seconds = time.perf_counter() - t0
        ranks.barrier()
        seconds = time.perf_counter() - t0
        server_cpu = server.stop()
    io = io_delta(io0, proc_io())
    check = reader.verify(spec, restored, reader.objects)
    return {
        "ok": True,
        "seconds": seconds,
        "own_seconds": own_seconds,
        "payload_bytes": ranks.restore_bytes(spec),
        "peak_rss_above_baseline": mem.above_baseline,
        "baseline_rss": mem.baseline,
        "rss_method": mem.method,
        "io": io,
        "check": check.as_dict(),
        "in_place": _kept_targets(restored, pointers),
        **server_cpu,
        **settled,
        **ranks.fields(),
    }


def _read_object(job: dict[str, Any], ranks: RankGroup) -> dict[str, Any]:
    from snapshot import Snapshot

    spec = build_spec(job["state"])
    group, name = job["object"]
    tensor_spec = spec.find(group, name)
    key = f"0/{group}/{name}"
    path = statesnap_path(job["path"])
    out = torch.zeros(tensor_spec.shape, dtype=tensor_spec.dtype)
    phases: dict[str, Any] = {}

    def measure(label: str, fn: Any) -> Any:
        io0 = proc_io()
        t0 = time.perf_counter()
        value = fn()
        phases[label] = {"seconds": time.perf_counter() - t0, **io_delta(io0, proc_io())}
        return value

    measure("(nothing: the cost of reading the counters)", lambda: None)
    snap = measure("Snapshot(path)", lambda: Snapshot(path))
    value = measure(f"read_object({key!r})", lambda: snap.read_object(key))
    measure(f"read_object({key!r}, obj_out=...)", lambda: snap.read_object(key, obj_out=out))
    checks = [
        check_restored(spec, {group: {name: v}}, False, iter([tensor_spec])) for v in (value, out)
    ]
    bad = [c.detail for c in checks if not c.ok]
    return {
        "ok": True,
        "seconds": sum(p["seconds"] for k, p in phases.items() if not k.startswith("(")),
        "payload_bytes": tensor_spec.nbytes,
        "phases": phases,
        "manifest_bytes": os.path.getsize(os.path.join(path, "manifest.yaml"))
        if os.path.exists(os.path.join(path, "manifest.yaml"))
        else None,
        "snapshot_bytes": tree_size(path)["apparent"],
        "check": {"ok": not bad, "detail": bad[0] if bad else "ok (both reads bitwise equal)"},
    }


def _async(job: dict[str, Any], ranks: RankGroup) -> dict[str, Any]:
    """``calls`` async calls in a row, each waited for and checked; see the module docstring.

    A call that raises ends the job: the calls before it are kept in the result, with the
    error and its traceback."""
    method = ASYNC_METHODS[job["method"]]
    method.prepare()
    reader = READERS[method.reader] if method.reader is not None else None
    if reader is not None:
        reader.prepare()
    spec = build_spec(job["state"])
    fsync = job["mode"] == "fsync"
    state = generate_state(spec, with_objects=method.objects)
    ctx = method.setup(spec, state)
    # Where the check reads each call's files back to (allocated once, before the baseline).
    targets = (
        make_targets(spec, with_objects=reader.objects)
        if reader is not None and reader.into_targets
        else None
    )
    trim_heap()
    baseline = current_rss()
    calls: list[dict[str, Any]] = []
    result: dict[str, Any] = {
        "ok": True,
        "payload_bytes": spec.nbytes,
        "baseline_rss": baseline,
        "calls": calls,
    }
    for k in range(int(job["calls"])):
        path = os.path.join(job["path"], f"call{k}")
        os.makedirs(path, exist_ok=True)
        try:
            # The staging budget statesnap derives from the available memory (outside the timing).
            budget_before = method.budget() if method.budget is not None else None
            with PeakRSS() as mem:
                t0 = time.perf_counter()
                handle = method.start(spec, state, path, fsync, ctx)
                t1 = time.perf_counter()
                flip_bits(state)  # the caller changes every tensor as soon as the call returns
                t2 = time.perf_counter()
                method.wait(handle)
                if fsync and method.files and not method.self_fsync:
                    fsync_tree(path)
                t3 = time.perf_counter()
            record: dict[str, Any] = {
                "call": k,
                "stall": t1 - t0,
                "mutate": t2 - t1,
                "wait": t3 - t2,
                "total": (t1 - t0) + (t3 - t2),
                "peak_rss_above_start": max(0, mem.peak - baseline),
                "peak_rss_above_call": mem.above_baseline,
                "rss_after_above_start": current_rss() - baseline,
            }
            if method.pool_stats is not None:
                record["pool_allocated"], record["pool_free"] = method.pool_stats()
            if budget_before is not None:
                record["budget_before"] = budget_before
            # Untimed: what the call wrote must be the state as it was when the call was made,
            # i.e. the generated state flipped k times (flipping twice is the identity).
            written = reader.load(spec, path, targets) if reader is not None else handle
            if k % 2:
                flip_bits(written)
            check = check_restored(spec, written, method.objects, count_all=True)
            record["check"] = check.as_dict()
            del handle, written
            trim_heap()  # what the check allocated must not count in the next call's RSS
        except BaseException as e:
            result.update(
                ok=False,
                error=f"call {k + 1}: {type(e).__name__}: {e}".strip()[:500],
                traceback=traceback.format_exc()[-4000:],
            )
            break
        finally:
            shutil.rmtree(path, ignore_errors=True)
        calls.append(record)
    return result


def _timed(ranks: RankGroup, call: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
    """``call()`` timed as ``_take`` and ``_restore`` time theirs: barrier, barrier, start, the
    call, barrier, stop (``seconds`` runs until the slowest rank is done, ``own_seconds`` until
    this rank's call returned); peak RSS above the RSS before it, ``/proc/self/io`` around it."""
    settled = ranks.ready()
    io0 = proc_io()
    with PeakRSS() as mem:
        ranks.barrier()
        t0 = time.perf_counter()
        value = call()
        own_seconds = time.perf_counter() - t0
        ranks.barrier()
        seconds = time.perf_counter() - t0
    return value, {
        "seconds": seconds,
        "own_seconds": own_seconds,
        "peak_rss_above_baseline": mem.above_baseline,
        "baseline_rss": mem.baseline,
        "rss_method": mem.method,
        "io": io_delta(io0, proc_io()),
        **settled,
    }


def _reshard_take(job: dict[str, Any], ranks: RankGroup) -> dict[str, Any]:
    method = RESHARD_METHODS[job["method"]]
    method.prepare()
    spec = build_spec(job["state"])
    world = max(1, ranks.world_size)
    state = sharded_state(spec, job["state"]["layout"], ranks.rank, world, filled=True)
    path = job["path"]
    os.makedirs(path, exist_ok=True)
    _, figures = _timed(ranks, lambda: method.save(state, path, job["mode"] == "fsync"))
    return {
        "ok": True,
        **figures,
        "payload_bytes": spec.nbytes,
        "disk": tree_size(path) if ranks.rank == 0 else None,
        "check": {"ok": True, "detail": "n/a (take)"},
        **ranks.fields(),
    }


def _reshard_restore(job: dict[str, Any], ranks: RankGroup) -> dict[str, Any]:
    method = RESHARD_METHODS[job["method"]]
    method.prepare()
    spec = build_spec(job["state"])
    layout = job["state"]["layout"]
    world = max(1, ranks.world_size)
    targets = sharded_state(spec, layout, ranks.rank, world, filled=False)
    pointers = {name: local_tensor(v).data_ptr() for name, v in targets.items()}
    restored, figures = _timed(ranks, lambda: method.load(targets, job["path"]))
    in_place = all(
        restored.get(name) is targets[name] and local_tensor(targets[name]).data_ptr() == ptr
        for name, ptr in pointers.items()
    )
    check = check_pieces(spec, restored, layout, ranks.rank, world)
    return {
        "ok": True,
        **figures,
        "payload_bytes": spec.nbytes,
        "check": check.as_dict(),
        "in_place": in_place,
        **ranks.fields(),
    }


def _parallel_job(job: dict[str, Any]) -> tuple[ParallelMethod, Any, Any, int]:
    """The job's method (its modules imported), and its model and AdamW optimizer built on the
    job's layout (see :mod:`benchmarks.methods.parallel`)."""
    method = PARALLEL_METHODS[job["method"]]
    for name in {method.name, job.get("paired_with") or method.name}:
        (ss_prepare if name == "statesnap" else dcp_prepare)()
    import torch.distributed.checkpoint.state_dict  # noqa: F401  (both methods' Stateful)

    state = job["state"]
    model, optim = parallel.build(parallel.Layout.parse(state["layout"]), int(state["dim"]))
    return method, model, optim, int(state["seed"])


def _budget(method: ParallelMethod) -> dict[str, Any]:
    """statesnap's memory budget for a restore started now (its ``Options`` default)."""
    if method.name != "statesnap":
        return {}
    try:
        from snapshot import Options

        return {"budget_bytes": Options().budget()}
    except (ImportError, AttributeError):
        return {}


def _parallel_take(job: dict[str, Any], ranks: RankGroup) -> dict[str, Any]:
    method, model, optim, seed = _parallel_job(job)
    parallel.fill(model, optim, seed)
    path = job["path"]
    os.makedirs(path, exist_ok=True)
    budget = _budget(method)
    app = parallel.AppState(model, optim)
    _, figures = _timed(ranks, lambda: method.save(app, path))
    disk = tree_size(path) if ranks.rank == 0 else None
    # Later takes in the same process (its first-call costs paid), each into a folder of its
    # own beside the first, barrier to barrier; removed after, the first one kept to restore.
    # With ``paired_with``, that method's take follows each one (precedes every other one), so
    # that both meet the same state of the disk and of the machine.
    other = job.get("paired_with")
    series: dict[str, list[float]] = {method.name: [], **({other: []} if other else {})}
    for i in range(int(job.get("later_calls", 0))):
        order = list(series) if i % 2 == 0 else list(series)[::-1]
        for name in order:
            again = f"{path}-later-{i}-{name}"
            ranks.barrier()
            t0 = time.perf_counter()
            PARALLEL_METHODS[name].save(app, again)
            ranks.barrier()
            series[name].append(time.perf_counter() - t0)
            if ranks.rank == 0:
                shutil.rmtree(again, ignore_errors=True)
    return {
        "ok": True,
        **figures,
        **budget,
        "later_seconds": series[method.name],
        "paired_seconds": series[other] if other else [],
        "payload_bytes": parallel.model_bytes(int(job["state"]["dim"])),
        "disk": disk,
        "check": {"ok": True, "detail": "n/a (take)"},
        **ranks.fields(),
    }


def _parallel_restore(job: dict[str, Any], ranks: RankGroup) -> dict[str, Any]:
    method, model, optim, seed = _parallel_job(job)
    parallel.zero(model, optim)
    budget = _budget(method)
    app = parallel.AppState(model, optim)
    _, figures = _timed(ranks, lambda: method.load(app, job["path"]))
    result = parallel.check(model, optim, seed)
    # Later restores in the same process (its imports and first-call costs paid), each from a
    # barrier to a barrier, into zeroed values again; the last one is checked too.
    later = []
    for _ in range(int(job.get("later_calls", 0))):
        parallel.zero(model, optim)
        ranks.barrier()
        t0 = time.perf_counter()
        method.load(app, job["path"])
        ranks.barrier()
        later.append(time.perf_counter() - t0)
    if later and result["ok"]:
        result = parallel.check(model, optim, seed)
    return {
        "ok": True,
        **figures,
        **budget,
        "later_seconds": later,
        "payload_bytes": parallel.model_bytes(int(job["state"]["dim"])),
        "check": result,
        **ranks.fields(),
    }


def _train(job: dict[str, Any], ranks: RankGroup) -> dict[str, Any]:
    from benchmarks.train_loop import LoopConfig, run_loop

    return {"ok": True, **run_loop(LoopConfig(**job["loop"]), job["method"], job["path"])}


def _async_training(job: dict[str, Any], ranks: RankGroup) -> dict[str, Any]:
    from benchmarks.async_training import run_job as run_training_job

    return run_training_job(job)


OPS = {
    "take": _take,
    "restore": _restore,
    "read-object": _read_object,
    "async": _async,
    "train": _train,
    "async-training": _async_training,
    "reshard-take": _reshard_take,
    "reshard-restore": _reshard_restore,
    "parallel-take": _parallel_take,
    "parallel-restore": _parallel_restore,
}


def run_job(job_file: str, tree: str, variant: bool) -> None:
    """Runs the job of ``job_file`` and writes its result; ``tree`` is the directory the library
    must be imported from (see :mod:`benchmarks.worker`), another tree than the harness's when
    ``variant``. The result says which files of the
    library the process imported (``library``); a job whose library came from elsewhere fails
    (before its timed call when it can), so a wrong tree is never measured silently."""
    with open(job_file) as f:
        job = json.load(f)
    try:
        if variant:  # check the tree before anything is measured
            import snapshot  # noqa: F401

            check_tree(tree)
        if "s3" in job:
            configure_s3(job["s3"])
        ranks = RankGroup.join(job)
        try:
            result = OPS[job["op"]](job, ranks)
        finally:
            ranks.leave()
        check_tree(tree)
    except BaseException as e:  # reported to the harness, which shows it in the table
        result = {
            "ok": False,
            "error": f"{type(e).__name__}: {e}".strip()[:500],
            "traceback": traceback.format_exc()[-4000:],
            **({"rank": job["rank"]} if "rank" in job else {}),
        }
    library = imported_library()
    if library:
        result["library"] = library
        print(f"library imported from: {library}", flush=True)
    with open(job["result"], "w") as f:
        json.dump(result, f)
