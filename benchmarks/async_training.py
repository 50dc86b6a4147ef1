"""Snapshots during a CPU training loop, statesnap beside DCP's async_save modes (the
``async-training`` case; the worker's ``async-training`` op runs one loop, or one series, in a
fresh process).

Models (``build``): an MLP (``Linear`` + ``GELU``) or a small transformer (a stack of
``nn.TransformerEncoderLayer``, pre-norm, on random token embeddings), both trained with AdamW
on a fixed pool of random batches. Methods (``METHODS``), all with their libraries' defaults
(statesnap fsyncs every file; DCP's ``FileSystemWriter`` has ``sync_files=True``):

``none``          no snapshots: the reference.
``ss-async``      ``Snapshot.async_take(path, app_state)``; ``pending.wait()`` before the next.
``ss-overlap``    ``Snapshot.async_take(path, app_state, stage_in_background=True)``: the call
                  returns before staging; the loop waits for ``pending.wait_staged()`` right
                  before the next ``optimizer.step()`` (where the library's step hook would hold
                  it), timed as the stager's wait is.
``ss-overlap-budget`` the same with ``Options(memory_budget_bytes=)`` a quarter of the state:
                  staging waits for writes to free buffers, so the loop waits longer before the
                  step, and the host holds a quarter of the state's copy instead of all of it.
``ss-take``       ``Snapshot.take(path, app_state)``: the loop stops for the whole take.
``dcp-thread``    ``dcp.async_save(state_dict, checkpoint_id=path)`` (``AsyncCheckpointerType``
                  ``THREAD``, its default; the stager it makes copies the state in the call).
``dcp-process``   the same with ``async_checkpointer_type=AsyncCheckpointerType.PROCESS``: the
                  first call spawns DCP's helper process (which joins a group of its own), every
                  call pipes the staged state to it. Stopped at the end of the job.
``dcp-stager``    the same as ``dcp-thread`` with ``async_stager=DefaultStager(StagingOptions(
                  use_pinned_memory=True, use_shared_memory=True, use_async_staging=True,
                  use_non_blocking_copy=False))``, one stager for the whole loop (it keeps its
                  staging storages between calls) closed at the end. Without CUDA the stager
                  ignores ``use_pinned_memory`` (it warns; the result keeps the warning) and
                  ``use_non_blocking_copy=True`` raises, so both stay plain copies on the CPU.
                  Staging runs in the stager's thread: the loop waits for
                  ``staging_completion`` right before the next ``optimizer.step()`` (the first
                  moment the state changes), so staging overlaps forward and backward.

Every DCP method runs in a single-rank gloo group (a FileStore under the job's path); statesnap
runs without one. A snapshot is started before every ``interval``-th timed step; the previous
one is waited for first (at most one in flight, as a user must); the last one is waited for
after the last step, inside the timed region. What each snapshot blocked the loop for: the call,
plus the wait for the previous one, plus (``dcp-stager``) the wait for staging.

``plain copy``: before the loop, ``dst.copy_(src)`` of every tensor of the model's and the
optimizer's state into tensors allocated and touched before (median of 3; the destinations are
freed before the loop). Peak RSS: the kernel's high-water mark, reset after the warm-up steps,
above the RSS then (model, AdamW state and data resident); DCP's helper process's own peak is
given apart. CPU: the process's CPU seconds during the loop minus the loop thread's own (what
background threads burned), plus the helper's. ``paired``: a snapshot starts in every other
window of ``interval`` steps, and the windows with one and without one are summed apart; with
each window the loop thread's scheduler statistics (Linux) split its time into time on a CPU,
time runnable but waiting for a core, and time asleep (the interpreter lock, the waits, I/O).

The ``series`` op: ``series`` snapshots in a row of a small MLP (no training between them),
each waited for, RSS after each wait.
"""

from __future__ import annotations

import contextlib
import cProfile
import gc
import io
import itertools
import os
import pstats
import shutil
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from benchmarks.common.system import (
    current_rss,
    peak_rss,
    reset_peak_rss,
    thread_schedstat,
    trim_heap,
)

METHODS = (
    "none",
    "ss-async",
    "ss-overlap",
    "ss-overlap-budget",
    "ss-take",
    "dcp-thread",
    "dcp-process",
    "dcp-stager",
)
DCP_METHODS = ("dcp-thread", "dcp-process", "dcp-stager")


@dataclass(frozen=True)
class TrainConfig:
    """What the loop trains and how often it snapshots (JSON-able: the harness passes it as a
    dict). ``model`` is ``mlp`` (``dims``: layer widths) or ``transformer`` (``d_model``,
    ``layers``, ``ff``, ``heads``, ``seq``); ``threads``: torch's intra-op threads."""

    model: str = "mlp"
    steps: int = 60
    interval: int = 10
    warmup: int = 3
    batch: int = 16
    dims: tuple[int, ...] = (2048, 2560, 2560, 2048)
    d_model: int = 640
    layers: int = 4
    ff: int = 2560
    heads: int = 10
    seq: int = 32
    seed: int = 0
    data_batches: int = 4
    threads: int = 1
    # A snapshot only in every other window of ``interval`` steps (from the first step on),
    # waited for at the window's end: windows with and without one alternate, so that the
    # machine's own drift falls on both alike (``paired`` in the result).
    paired: bool = False


def build(cfg: TrainConfig) -> tuple[nn.Module, torch.optim.Optimizer, list[torch.Tensor]]:
    """The model, its AdamW optimizer and the pool of (input, target) batches, all seeded."""
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    model: nn.Module
    if cfg.model == "mlp":
        dims = list(cfg.dims)
        layers: list[nn.Module] = []
        for i in range(len(dims) - 1):
            layers.append(nn.Linear(dims[i], dims[i + 1]))
            if i < len(dims) - 2:
                layers.append(nn.GELU())
        model = nn.Sequential(*layers)
        shape_in: tuple[int, ...] = (cfg.batch, dims[0])
        shape_out: tuple[int, ...] = (cfg.batch, dims[-1])
    elif cfg.model == "transformer":
        layer = nn.TransformerEncoderLayer(
            cfg.d_model, cfg.heads, cfg.ff, dropout=0.0, batch_first=True, norm_first=True
        )
        model = nn.TransformerEncoder(layer, cfg.layers, enable_nested_tensor=False)
        shape_in = shape_out = (cfg.batch, cfg.seq, cfg.d_model)
    else:
        raise ValueError(f"unknown model {cfg.model!r}: mlp or transformer")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = [
        torch.randn(cfg.data_batches, *shape_in, generator=gen),
        torch.randn(cfg.data_batches, *shape_out, generator=gen),
    ]
    return model, optimizer, data


def state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor of the model's and the optimizer's state dicts."""
    out = list(model.state_dict().values())
    for per_param in optimizer.state_dict()["state"].values():
        out += [v for v in per_param.values() if isinstance(v, torch.Tensor)]
    return out


def plain_copy_seconds(tensors: list[torch.Tensor], repeats: int = 3) -> float:
    """Median time of ``dst.copy_(src)`` over every tensor, into destinations allocated and
    touched before; the destinations are freed (and the heap trimmed) afterwards."""
    dst = [torch.zeros_like(t) for t in tensors]
    times = []
    with torch.no_grad():
        for _ in range(repeats):
            t0 = time.perf_counter()
            for d, s in zip(dst, tensors, strict=True):
                d.copy_(s)
            times.append(time.perf_counter() - t0)
    del dst
    trim_heap()
    return statistics.median(times)


def _step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: list[torch.Tensor],
    i: int,
    before_update: Callable[[], None] | None = None,
) -> None:
    x, y = data[0][i % len(data[0])], data[1][i % len(data[1])]
    optimizer.zero_grad(set_to_none=True)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    if before_update is not None:
        before_update()
    optimizer.step()


def _init_group(path: str) -> None:
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # DCP's helper process's own store
    store = os.path.join(path, "group-store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)


def _import_library(method: str) -> None:
    """Imports the method's library before anything is timed, as a program does at its start."""
    if method.startswith("ss-"):
        import storage_plugins.fs  # noqa: F401
        from snapshot import Snapshot  # noqa: F401  (loads the engine, not only the package)
    elif method in DCP_METHODS:
        import torch.distributed.checkpoint
        import torch.distributed.checkpoint.staging  # noqa: F401


def _helper_process() -> Any:
    """DCP's helper process of ``AsyncCheckpointerType.PROCESS`` (None until its first call)."""
    from torch.distributed.checkpoint import _async_process_executor as ape

    return ape._CHECKPOINT_PROCESS


def _proc_figures(pid: int) -> dict[str, float]:
    """Peak RSS (bytes) and CPU seconds (user + system) of another process, from /proc."""
    out: dict[str, float] = {}
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    out["peak_rss"] = int(line.split()[1]) * 1024
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        out["cpu_s"] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


@dataclass
class _Staged:
    """A background-staged statesnap snapshot's staging, waited for as DCP's future is."""

    pending: Any

    def result(self) -> None:
        self.pending.wait_staged()


@dataclass
class _Snapper:
    """Starts, and waits for, the snapshots of one method."""

    method: str
    app_state: dict[str, Any]
    stager: Any = None
    pending: Any = None
    staging: Any = None
    budget_bytes: int | None = None  # ``ss-overlap-budget``'s staging budget
    warnings_seen: list[str] = field(default_factory=list)

    def start(self, where: str) -> None:
        if self.method == "ss-async":
            from snapshot import Snapshot

            self.pending = Snapshot.async_take(where, self.app_state)
        elif self.method in ("ss-overlap", "ss-overlap-budget"):
            from snapshot import Options, Snapshot

            options = Options(memory_budget_bytes=self.budget_bytes)
            self.pending = Snapshot.async_take(
                where, self.app_state, options=options, stage_in_background=True
            )
            self.staging = _Staged(self.pending)
        elif self.method == "ss-take":
            from snapshot import Snapshot

            Snapshot.take(where, self.app_state)
        else:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict_saver import (
                AsyncCheckpointerType,
                AsyncSaveResponse,
            )

            state = {k: v.state_dict() for k, v in self.app_state.items()}
            kind = AsyncCheckpointerType.THREAD
            if self.method == "dcp-process":
                kind = AsyncCheckpointerType.PROCESS
            if self.method == "dcp-stager" and self.stager is None:
                from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

                with warnings.catch_warnings(record=True) as seen:
                    warnings.simplefilter("always")
                    self.stager = DefaultStager(StagingOptions(True, True, True, False))
                self.warnings_seen += [str(w.message) for w in seen]
            result = dcp.async_save(
                state, checkpoint_id=where, async_checkpointer_type=kind, async_stager=self.stager
            )
            if isinstance(result, AsyncSaveResponse):
                self.staging, self.pending = result.staging_completion, result.upload_completion
            else:
                self.pending = result

    def wait_staging(self) -> float:
        """Blocks until the stager's copy is done (``dcp-stager``); seconds blocked."""
        if self.staging is None:
            return 0.0
        t0 = time.perf_counter()
        self.staging.result()
        self.staging = None
        return time.perf_counter() - t0

    def done(self) -> bool:
        return self.pending is None or self.pending.done()

    def wait(self) -> float:
        """Blocks until the pending snapshot is written; seconds blocked."""
        if self.pending is None:
            return 0.0
        t0 = time.perf_counter()
        if hasattr(self.pending, "wait"):
            self.pending.wait()
        else:
            self.pending.result()
        self.pending = None
        return time.perf_counter() - t0

    def close(self) -> dict[str, Any]:
        """Closes the stager, stops DCP's helper process; what the helper used."""
        out: dict[str, Any] = {}
        if self.stager is not None:
            self.stager.close()
        if self.method == "dcp-process":
            helper = _helper_process()
            if helper is not None:
                proc = helper._save_process
                out["helper"] = _proc_figures(proc.pid)
                helper.__del__()  # sends TERMINATE, joins, terminates if still alive
                proc.join(timeout=10)
                out["helper_stopped"] = not proc.is_alive()
        return out


@dataclass
class _Snap:
    call: float
    started: float
    staging_wait: float = 0.0
    blocked_in_wait: float = 0.0
    seen_done: float | None = None
    profiled: bool = False


def _profile_text(prof: cProfile.Profile, top: int = 30) -> str:
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def _prepared(
    cfg: TrainConfig, method: str, path: str
) -> tuple[nn.Module, torch.optim.Optimizer, list[torch.Tensor]]:
    """The model, optimizer and data of ``cfg`` after its warm-up steps, with ``method``'s
    library imported (and, for DCP, its one-rank group made) before anything is timed."""
    if method in DCP_METHODS:
        _init_group(path)
    _import_library(method)
    model, optimizer, data = build(cfg)
    for i in range(cfg.warmup):
        _step(model, optimizer, data, i)
    return model, optimizer, data


def run_training(cfg: TrainConfig, method: str, path: str, profile: bool) -> dict[str, Any]:
    """One loop with ``method``'s snapshots; timings as a JSON-able dict. ``profile``: cProfile
    the loop thread's snapshot calls and waits (the profile is the result's ``profile``)."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; known: {', '.join(METHODS)}")
    model, optimizer, data = _prepared(cfg, method, path)
    tensors = state_tensors(model, optimizer)
    state_bytes = sum(t.nbytes for t in tensors)
    copy_s = plain_copy_seconds(tensors)
    del tensors
    snapper = _Snapper(method, {"model": model, "optim": optimizer})
    if method == "ss-overlap-budget":
        snapper.budget_bytes = state_bytes // 4
    prof = cProfile.Profile() if profile else None
    snaps: list[_Snap] = []
    step_times: list[float] = []

    def before_update() -> None:
        if snapper.staging is not None:
            if prof is not None:
                prof.enable()
            snaps[-1].staging_wait += snapper.wait_staging()
            if prof is not None:
                prof.disable()

    gc.collect()
    trim_heap()
    reset_peak_rss()
    rss_start = current_rss()
    cpu0, thread0 = time.process_time(), time.thread_time()
    t_start = time.perf_counter()
    marks: list[float] = []  # ``paired``: where each window starts (a wait ends the one before)
    scheds: list[tuple[float, float] | None] = []  # the loop thread's schedstat at each mark
    for i in range(cfg.steps):
        boundary = i % cfg.interval == 0 and (i > 0 or cfg.paired)
        if boundary and cfg.paired and method == "none":
            marks.append(time.perf_counter())
            scheds.append(thread_schedstat())
        elif boundary and method != "none":
            if prof is not None:
                prof.enable()
            waited = snapper.wait()
            if snaps:
                snaps[-1].blocked_in_wait = waited
            t0 = time.perf_counter()
            if cfg.paired:
                marks.append(t0)
                scheds.append(thread_schedstat())
            if not cfg.paired or (i // cfg.interval) % 2 == 0:
                snapper.start(os.path.join(path, f"snap{len(snaps)}"))
                snaps.append(_Snap(time.perf_counter() - t0, t0))
            if prof is not None:
                prof.disable()
        t0 = time.perf_counter()
        _step(model, optimizer, data, cfg.warmup + i, before_update)
        step_times.append(time.perf_counter() - t0)
        if snaps and snaps[-1].seen_done is None and snapper.done():
            snaps[-1].seen_done = time.perf_counter() - snaps[-1].started
    if snaps:
        before_update()
        if prof is not None:
            prof.enable()
        snaps[-1].blocked_in_wait = snapper.wait()
        if prof is not None:
            prof.disable()
        if snaps[-1].seen_done is None:
            snaps[-1].seen_done = time.perf_counter() - snaps[-1].started
    seconds = time.perf_counter() - t_start
    marks.append(t_start + seconds)
    scheds.append(thread_schedstat())
    windows = [b - a for a, b in itertools.pairwise(marks)]
    paired: dict[str, Any] = {
        "with": sum(windows[0::2]),
        "without": sum(windows[1::2]),
        "windows": windows,
    }
    stats = [x for x in scheds if x is not None]
    if cfg.paired and len(stats) == len(marks):
        # Where the loop thread's time went in each kind of window: on a CPU, runnable but
        # waiting for one (other threads and processes held the cores), and the rest asleep
        # (waiting for the interpreter lock, a snapshot's wait, I/O).
        spans = [
            (w, b[0] - a[0], b[1] - a[1])
            for w, (a, b) in zip(windows, itertools.pairwise(stats), strict=True)
        ]
        for kind, part in (("with", spans[0::2]), ("without", spans[1::2])):
            on_cpu = sum(x[1] for x in part)
            waiting = sum(x[2] for x in part)
            paired[f"{kind}_split"] = {
                "windows": len(part),
                "on_cpu": on_cpu,
                "runqueue": waiting,
                "asleep": sum(x[0] for x in part) - on_cpu - waiting,
            }
    cpu_other = (time.process_time() - cpu0) - (time.thread_time() - thread0)
    peak_above = peak_rss() - rss_start
    closed = snapper.close()
    written = sum(1 for n in range(len(snaps)) if os.path.isdir(os.path.join(path, f"snap{n}")))
    if method in DCP_METHODS:
        import torch.distributed as dist

        dist.destroy_process_group()
    return {
        "ok": written == len(snaps),
        **({} if written == len(snaps) else {"error": f"{written}/{len(snaps)} written"}),
        "seconds": seconds,
        "steps": cfg.steps,
        "step_median": statistics.median(step_times),
        "step_mean": seconds / cfg.steps,
        "state_bytes": state_bytes,
        "copy_seconds": copy_s,
        "rss_start": rss_start,
        "peak_rss_above_start": peak_above,
        "cpu_other_threads": cpu_other,
        "snapshots": [s.__dict__ for s in snaps],
        **({"paired": paired} if cfg.paired else {}),
        "warnings": snapper.warnings_seen,
        **closed,
        **({"profile": _profile_text(prof)} if prof is not None else {}),
    }


def run_series(cfg: TrainConfig, method: str, path: str, count: int) -> dict[str, Any]:
    """``count`` snapshots in a row of ``cfg``'s model (after its warm-up steps), each waited
    for and then deleted (untimed); RSS after each wait, and each one's call and wait."""
    if method not in METHODS or method == "none":
        raise ValueError(f"unknown series method {method!r}")
    model, optimizer, _ = _prepared(cfg, method, path)
    state_bytes = sum(t.nbytes for t in state_tensors(model, optimizer))
    snapper = _Snapper(method, {"model": model, "optim": optimizer})
    if method == "ss-overlap-budget":
        snapper.budget_bytes = state_bytes // 4
    gc.collect()
    trim_heap()
    rss_start = current_rss()
    calls = []
    for n in range(count):
        where = os.path.join(path, f"snap{n}")
        t0 = time.perf_counter()
        snapper.start(where)
        call = time.perf_counter() - t0
        wait = snapper.wait_staging() + snapper.wait()
        calls.append({"call": call, "wait": wait, "rss": current_rss()})
        shutil.rmtree(where, ignore_errors=True)
    closed = snapper.close()
    if method in DCP_METHODS:
        import torch.distributed as dist

        dist.destroy_process_group()
    return {
        "ok": True,
        "rss_start": rss_start,
        "state_bytes": state_bytes,
        "calls": calls,
        "warnings": snapper.warnings_seen,
        **closed,
    }


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """The worker's ``async-training`` op: ``kind`` ``loop`` or ``series``."""
    cfg = TrainConfig(**{**job["config"], "dims": tuple(job["config"]["dims"])})
    if job["kind"] == "series":
        return run_series(cfg, job["method"], job["path"], int(job["count"]))
    return run_training(cfg, job["method"], job["path"], bool(job.get("profile")))
