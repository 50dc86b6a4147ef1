"""What only a GPU can prove about async take's staging and restores into device tensors.

Run on a machine with one CUDA GPU, from the repository root::

    python -m benchmarks.gpu_check            # every check: 28-36 s on one H100
    python -m benchmarks.gpu_check --quick    # smaller sizes: about 10 s

It needs the library's dependencies (isal among them) and, for its Lightning check, Lightning
(skipped, and said so, without it). Prints the card's name, one line per check and a summary;
exits 1 if any check found a mismatch (bytes, checksums, host memory above its bound, an
exception), 2 when no GPU is present. The speed ratios are printed, not judged.

The checks:

- dtypes: every dtype torch can make on the GPU, contiguous and transposed, small (slab
  members) and large (blobs of their own). The kernel producing each tensor's values is queued
  behind ``torch.cuda._sleep`` when ``async_take`` is called (the staging copies must wait for
  it: ``Lease.stream``), and in-place kernels changing every tensor are queued the moment the
  call returns (they must not reach the snapshot). ``verify`` then checks every stored CRC
  (computed after the copies landed: ``Placer._pooled``), and a restore into CUDA targets,
  inside a user stream whose pending kernels still write those targets, must give the
  produced bytes back bitwise.
- budget: a tiny staging budget (``STATESNAP_MEMORY_BUDGET_BYTES``) over several rounds, two
  snapshots pending at once each round (they share the budget: ``StagingPool.share``);
  the pool's pinned blocks are power-of-two sized and given back.
- dtensor: a DTensor (Shard(0)) and a replicated one on a one-GPU mesh, taken within a small
  budget; host memory's peak during the take stays within a bound of the budget, not the
  tensor's size; restored bitwise into new DTensors.
- landing: restores into CUDA targets through scratch tiles under a 1 MiB read budget: a
  target of another dtype than stored, a transposed one, one of many tiles; ``read_object``
  into a CUDA ``obj_out``; the targets' producing kernels still queued on a user stream.
- rng: ``RNGState`` restores the GPU's generator (numbers drawn after restore = after take).
- tensor_aware: ``copy_tensors_to_cpu(non_blocking=True)`` stages into pinned memory, and
  ``restore_tensor_device`` puts the tensors back bitwise.
- lightning: Lightning's Trainer on the GPU with ``AsyncStatesnapCheckpointIO``: the last
  checkpoint, loaded onto the GPU, equals the model and optimizer bitwise; a resumed run gives
  the losses of one never stopped.
- speed: device-to-host (async_take's call) and host-to-device (restore from memory://)
  against torch's own pinned copies (``tensor.to("cpu", non_blocking=True)`` into pinned
  memory, and back), as ratios.

``--cpu-dry-run`` runs the same steps with CPU tensors (no streams, no sleeps, no pinning): it
checks the script's own logic on a machine without a GPU, nothing about CUDA.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch

from snapshot import Options, Snapshot, StateDict
from snapshot._engine.format.serialization import DTYPES
from snapshot._engine.io import staging
from snapshot._engine.tools.verify import verify

FAILURES: list[str] = []
MIB = 1 << 20


class Env:
    """Where the checks run: the GPU, or the CPU for a dry run of the script's logic."""

    def __init__(self, cpu_dry_run: bool, quick: bool, root: str) -> None:
        self.cpu = cpu_dry_run
        self.quick = quick
        self.root = root
        self.device = torch.device("cpu") if cpu_dry_run else torch.device("cuda", 0)

    def sleep(self, ms: float) -> None:
        """Queues a kernel that spins for about ``ms`` on the current stream."""
        if not self.cpu:
            # About 1.4 GHz of cycles per second on current data-center cards; the exact
            # length does not matter, only that the work behind it is still queued.
            torch.cuda._sleep(int(ms * 1.4e6))

    def stream(self) -> Any:
        return None if self.cpu else torch.cuda.Stream()

    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)

    def sync(self) -> None:
        if not self.cpu:
            torch.cuda.synchronize()

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)


def fail(what: str) -> None:
    FAILURES.append(what)
    print(f"  MISMATCH: {what}", flush=True)


def check(ok: bool, what: str) -> None:
    if not ok:
        fail(what)


@contextlib.contextmanager
def env_var(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The uint8 view of a contiguous tensor's memory (any dtype)."""
    return t.view(torch.uint8)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads and the sign of zero included), on the same device."""
    return a.shape == b.shape and torch.equal(as_bytes(a.contiguous()), as_bytes(b.contiguous()))


def random_like_bytes(shape: tuple[int, ...], dtype: torch.dtype, seed: int, dev: Any) -> Any:
    """A contiguous tensor of ``dtype`` whose bytes are random (NaNs included), on ``dev``."""
    t = torch.empty(shape, dtype=dtype, device=dev)
    b = as_bytes(t)
    g = torch.Generator(device=dev).manual_seed(seed)
    b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, device=dev, generator=g))
    if dtype == torch.bool:
        b.bitwise_and_(1)
    return t


def verified(path: str, label: str) -> None:
    report = verify(path, None)
    check(report.ok, f"{label}: verify found {report.problems[:3]}")
    check(report.checksums_checked > 0, f"{label}: verify checked no checksum")


# -------------------------------------------------------------------------------------------------


def check_dtypes(env: Env) -> None:
    dev = env.device
    small, large = (16, 24), ((256, 1100) if env.quick else (1024, 1100))
    bases: dict[str, torch.Tensor] = {}  # contiguous memory of each tensor, on the device
    finals: dict[str, torch.Tensor] = {}  # the bytes the producing kernel writes
    state = StateDict()
    skipped = []
    for i, (name, dtype) in enumerate(sorted(DTYPES.items())):
        if name.startswith(("q", "bits", "float4")):  # quantized, or no element type
            skipped.append(name)
            continue
        try:
            for kind, shape in (("s", small), ("l", large)):
                for layout in ("c", "t"):
                    key = f"{name}_{kind}{layout}"
                    final = random_like_bytes(shape, dtype, seed=i * 4 + len(bases), dev=dev)
                    base = torch.empty_like(final)
                    as_bytes(base).zero_()
                    bases[key], finals[key] = base, final
                    state[key] = base if layout == "c" else base.t()
        except (RuntimeError, TypeError, NotImplementedError) as e:
            skipped.append(f"{name} ({type(e).__name__})")
            for key in [k for k in bases if k.startswith(name + "_")]:
                del bases[key], finals[key], state[key]
    env.sync()
    # The producing kernels, queued behind a sleep: still pending when async_take starts.
    env.sleep(200)
    for key, base in bases.items():
        as_bytes(base).copy_(as_bytes(finals[key]))
    path = env.path("dtypes")
    t0 = time.perf_counter()
    pending = Snapshot.async_take(path, {"s": state})
    call = time.perf_counter() - t0
    # Training goes on at once: every tensor changes in place.
    env.sleep(20)
    for base in bases.values():
        as_bytes(base).bitwise_not_()
    pending.wait(timeout=300)
    verified(path, "dtypes")
    # Restore into CUDA targets inside a user stream whose queued kernels still write them.
    user = env.stream()
    targets = {k: torch.empty_like(b) for k, b in bases.items()}
    restored = StateDict({k: (t if k.endswith("c") else t.t()) for k, t in targets.items()})
    with env.use(user):
        env.sleep(100)
        for t in targets.values():
            as_bytes(t).fill_(0x5A)
        try:
            Snapshot(path).restore({"s": restored})
        except Exception as e:
            fail(f"dtypes: restore raised {type(e).__name__}: {str(e).splitlines()[0]}")
            # Which keys fail: each read on its own, so one run names them all.
            raised = []
            for k, t in restored.items():
                try:
                    Snapshot(path).read_object(f"0/s/{k}", obj_out=t)
                except Exception as e:
                    raised.append(f"{k} ({type(e).__name__})")
            check(not raised, f"dtypes: read_object into CUDA raised for {raised}")
    if user is not None:
        user.synchronize()
    env.sync()
    bad = [k for k, t in targets.items() if not same(t, finals[k])]
    check(not bad, f"dtypes: restored bytes differ for {bad[:8]}{'...' if len(bad) > 8 else ''}")
    print(
        f"  {len(bases)} tensors of {len(bases) // 4} dtypes, call {call:.3f} s; "
        f"skipped {', '.join(skipped)}"
    )


def _budget_state(env: Env, seed: int) -> tuple[StateDict, dict[str, torch.Tensor]]:
    dev = env.device
    n_small = 200 if env.quick else 1000
    values: dict[str, torch.Tensor] = {}
    for i in range(n_small):
        values[f"s{i}"] = random_like_bytes((1024,), torch.float32, seed * 10_000 + i, dev)
    for i in range(8):
        values[f"l{i}"] = random_like_bytes(
            (768, 1024), torch.bfloat16, seed * 10_000 + 5000 + i, dev
        )
    values["huge"] = random_like_bytes((4 * MIB,), torch.float32, seed * 10_000 + 9000, dev)
    return StateDict({k: torch.zeros_like(v) for k, v in values.items()}), values


def check_budget(env: Env) -> None:
    budget = 4 * MIB
    rounds = 2 if env.quick else 6
    pool = staging.process_pool(Options.from_env())
    held = [0]  # the most bytes of the shared staging budget held at once, sampled
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            held[0] = max(held[0], pool.budget.used)
            time.sleep(0.0005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    with env_var("STATESNAP_MEMORY_BUDGET_BYTES", str(budget)):
        for r in range(rounds):
            pendings = []
            for j in range(2):  # the second is taken while the first is pending
                state, values = _budget_state(env, seed=r * 2 + j)
                env.sync()
                env.sleep(50)
                for k, v in values.items():
                    state[k].copy_(v)
                path = env.path(f"budget{r}_{j}")
                pendings.append((Snapshot.async_take(path, {"s": state}), path, values))
                for t in state.values():
                    as_bytes(t).bitwise_not_()
            for pending, path, values in pendings:
                pending.wait(timeout=300)
                verified(path, f"budget round {r}")
                snap = Snapshot(path)
                for k in ("s0", "l3", "huge"):
                    got = snap.read_object(f"0/s/{k}")
                    check(same(got, values[k].cpu()), f"budget round {r}: {path} {k} differs")
            check(pool.leased_bytes == 0, f"budget round {r}: {pool.leased_bytes} B still lent")
            check(pool.free_bytes <= budget, f"budget: the pool keeps {pool.free_bytes} B")
    stop.set()
    sampler.join()
    # A write larger than the budget (``huge``: 16 MiB) is staged alone; no two budgets.
    check(held[0] <= 16 * MIB, f"budget: {held[0]} B of staging held at once")
    if not env.cpu:
        pinned_classes = all(size & (size - 1) == 0 for (pinned, size) in pool._free if pinned)
        check(pool.pinned_bytes > 0, "budget: nothing was pinned")
        check(pinned_classes, "budget: a pinned block is not a power of two")
    print(
        f"  {rounds} rounds x 2 pending, budget {budget // MIB} MiB: pool allocated "
        f"{pool.allocated_bytes / MIB:.0f} MiB ({pool.pinned_bytes / MIB:.0f} pinned), "
        f"at most {held[0] / MIB:.1f} MiB staged at once (sampled)"
    )


def check_dtensor(env: Env) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from benchmarks.common import PeakRSS

    started = not dist.is_initialized()  # this check's own group, ended when it passes
    if started:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29_500 + os.getpid() % 1000))
        backend = "gloo" if env.cpu else "cpu:gloo,cuda:nccl"
        dist.init_process_group(backend, rank=0, world_size=1)
    mesh = init_device_mesh(env.device.type, (1,))
    numel = (64 if env.quick else 512) * MIB // 4
    big = random_like_bytes((numel // 1024, 1024), torch.float32, 77, env.device)
    small = random_like_bytes((1000,), torch.float32, 78, env.device)
    state = StateDict(
        w=distribute_tensor(big.clone(), mesh, [Shard(0)]),
        b=distribute_tensor(small.clone(), mesh, [Replicate()]),
    )
    budget = 64 * MIB
    path = env.path("dtensor")
    env.sync()
    # What this take stages is counted, not earlier checks' blocks.
    pool = staging.process_pool(Options.from_env())
    keep, pool.keep_bytes = pool.keep_bytes, 0
    pool.trim()  # gives every free block back
    pool.keep_bytes = keep
    with env_var("STATESNAP_MEMORY_BUDGET_BYTES", str(budget)), PeakRSS() as peak:
        Snapshot.async_take(path, {"m": state}).wait(timeout=300)
    verified(path, "dtensor")
    bound = 3 * budget + 128 * MIB
    check(
        peak.above_baseline <= bound,
        f"dtensor: host memory peaked {peak.above_baseline / MIB:.0f} MiB above the start, "
        f"more than {bound / MIB:.0f} MiB for a {big.nbytes / MIB:.0f} MiB tensor",
    )
    target = StateDict(
        w=distribute_tensor(torch.zeros_like(big), mesh, [Shard(0)]),
        b=distribute_tensor(torch.zeros_like(small), mesh, [Replicate()]),
    )
    Snapshot(path).restore({"m": target})
    env.sync()
    check(same(target["w"].to_local(), big), "dtensor: w restored differs")
    check(same(target["b"].to_local(), small), "dtensor: b restored differs")
    print(
        f"  {big.nbytes / MIB:.0f} MiB DTensor, budget {budget // MIB} MiB: host peak "
        f"{peak.above_baseline / MIB:.0f} MiB above the start ({peak.method})"
    )
    if started:
        dist.destroy_process_group()


def check_landing(env: Env) -> None:
    """Restores and reads whose bytes land through scratch tiles: CUDA targets of another
    dtype than stored (cast on the host into a second pinned tile), not contiguous, larger
    than a tiny read budget (tiles drained and reused while copies are in flight), and
    ``read_object`` into a CUDA ``obj_out``."""
    dev = env.device
    g = torch.Generator().manual_seed(5)
    values = {
        "big": torch.randn(4 * MIB, generator=g),  # 16 MiB: many tiles under a 1 MiB budget
        "wide": torch.randn(700, 900, generator=g),
        "cast": torch.randn(3000, 333, generator=g),
        "small": torch.randn(5000, generator=g),
    }
    path = env.path("landing")
    Snapshot.take(path, {"s": StateDict(values)})
    wanted = {
        "big": values["big"].to(dev),
        "wide": values["wide"].to(dev),
        "cast": values["cast"].to(torch.bfloat16).to(dev),  # the same rounding as on the host
        "small": values["small"].to(dev),
    }
    bases = {
        "big": torch.empty(4 * MIB, device=dev),
        "wide": torch.empty(900, 700, device=dev),  # restored through its transpose
        "cast": torch.empty(3000, 333, dtype=torch.bfloat16, device=dev),
        "small": torch.empty(5000, device=dev),
    }
    targets = StateDict({k: (b.t() if k == "wide" else b) for k, b in bases.items()})
    user = env.stream()
    with env.use(user):
        env.sleep(100)  # the kernels below still write the targets when the restore starts
        for b in bases.values():
            as_bytes(b).fill_(0xA5)
        Snapshot(path).restore({"s": targets}, options=Options(memory_budget_bytes=MIB))
    env.sync()
    bad = [k for k in wanted if not same(targets[k], wanted[k])]
    check(not bad, f"landing: restored bytes differ for {bad}")
    out = torch.empty(3000, 333, dtype=torch.bfloat16, device=dev)
    with env.use(user):
        env.sleep(50)
        as_bytes(out).fill_(0x11)
        got = Snapshot(path).read_object("0/s/cast", obj_out=out, memory_budget_bytes=MIB)
    env.sync()
    check(got is out, "landing: read_object did not return obj_out")
    check(same(out, wanted["cast"]), "landing: read_object into a CUDA bf16 tensor differs")
    print(f"  {len(bases)} CUDA targets (cast, transposed, 16 MiB) under a 1 MiB read budget")


def check_rng(env: Env) -> None:
    """``RNGState`` takes every GPU's generator and restores it: the numbers drawn on the GPU
    after a restore are those drawn after the take."""
    from snapshot import RNGState

    path = env.path("rng")
    torch.manual_seed(1234)
    torch.randn(10, device=env.device)  # move the generators off their seeds
    Snapshot.take(path, {"rng": RNGState()})
    after_take = torch.randn(1000, device=env.device)
    torch.randn(77, device=env.device)
    Snapshot(path).restore({"rng": RNGState()})
    after_restore = torch.randn(1000, device=env.device)
    check(same(after_take, after_restore), "rng: GPU numbers after restore differ from take's")
    held = Snapshot(path).read_object("0/rng")
    has_cuda = "cuda" in held
    check(has_cuda == (not env.cpu), f"rng: the snapshot holds CUDA states: {has_cuda}")
    print(f"  generators restored; CUDA states held: {has_cuda}")


def check_tensor_aware(env: Env) -> None:
    """The tensor-aware state dict stages CUDA tensors into pinned memory non-blocking and
    puts restored host tensors back on their devices."""
    from snapshot.strategies.tensor_aware import BasicTensorAwareStateDict

    on_dev = random_like_bytes((512, 512), torch.float32, 7, env.device)
    wrapped = BasicTensorAwareStateDict({"w": on_dev})
    wrapped.copy_tensors_to_cpu(non_blocking=True)
    env.sync()
    staged = wrapped.state_dict["w"]
    check(staged.device.type == "cpu", "tensor_aware: staged tensor is not on the host")
    check(env.cpu or staged.is_pinned(), "tensor_aware: staged tensor is not pinned")
    check(same(staged, on_dev.cpu()), "tensor_aware: staged bytes differ")
    wrapped.pop_tensors()
    wrapped.insert_tensors([staged])
    wrapped.restore_tensor_device(non_blocking=True)
    env.sync()
    back = wrapped.state_dict["w"]
    check(back.device == on_dev.device, f"tensor_aware: put back on {back.device}")
    check(same(back, on_dev), "tensor_aware: bytes put back differ")
    print("  staged pinned and put back bitwise")


def check_lightning(env: Env) -> None:
    """Lightning's Trainer on the GPU with ``AsyncStatesnapCheckpointIO``: the checkpoint of
    the last step, loaded onto the GPU, equals the model's and optimizer's state bitwise, and a
    run resumed from it gives the losses of a run never stopped."""
    import importlib

    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    pl = None
    for name in ("lightning.pytorch", "pytorch_lightning"):
        with contextlib.suppress(ModuleNotFoundError):
            pl = importlib.import_module(name)
            break
    if pl is None:
        print("  skipped: Lightning is not installed (pip install 'statesnap[lightning]')")
        return
    from snapshot.integrations.lightning import AsyncStatesnapCheckpointIO

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(3)
            self.net = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 1))
            self.losses: dict[int, float] = {}

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.losses[self.global_step] = loss.item()
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=0.01)

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(256, 64, generator=g), torch.randn(256, 1, generator=g))

    def fit(epochs: int, ckpt: str | None = None, save: bool = False) -> tuple[Any, Any]:
        model = Net()
        trainer = pl.Trainer(
            max_epochs=epochs,
            accelerator="cpu" if env.cpu else "gpu",
            devices=1,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=save,
            callbacks=[pl.callbacks.ModelCheckpoint(dirpath=env.path("pl"), save_last=True)]
            if save
            else None,
            plugins=[AsyncStatesnapCheckpointIO()],
            default_root_dir=env.path("pl-root"),
        )
        trainer.fit(model, DataLoader(data, batch_size=32), ckpt_path=ckpt)
        return model, trainer

    straight, _ = fit(3)
    first, trainer = fit(2, save=True)
    last = os.path.join(env.path("pl"), "last.ckpt")
    loaded = AsyncStatesnapCheckpointIO().load_checkpoint(last, map_location=env.device)
    weights = loaded["state_dict"]
    # Lightning moves the model and optimizer back to the host when fit ends.
    bad = [k for k, v in first.state_dict().items() if not same(weights[k], v.to(env.device))]
    check(not bad, f"lightning: checkpointed weights differ: {bad}")
    check(
        all(v.device == env.device for v in weights.values()),
        "lightning: weights not loaded onto the GPU",
    )
    moments = loaded["optimizer_states"][0]["state"]
    live = trainer.optimizers[0].state_dict()["state"]
    bad = [
        (i, k)
        for i in live
        for k in ("exp_avg", "exp_avg_sq")
        if not same(moments[i][k], live[i][k].to(env.device))
    ]
    check(not bad, f"lightning: optimizer moments differ: {bad}")
    resumed, _ = fit(3, ckpt=last)
    later = {s: v for s, v in straight.losses.items() if s >= min(resumed.losses)}
    check(resumed.losses == later, "lightning: resumed losses differ from the straight run's")
    print(
        f"  {len(weights)} tensors checkpointed on {env.device}, resumed at step "
        f"{min(resumed.losses)}: {len(resumed.losses)} losses equal the straight run's"
    )


def _best(fn: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def check_speed(env: Env) -> None:
    from storage_plugins import memory

    dev = env.device
    count, numel = (4, 16 * MIB // 4) if env.quick else (8, 128 * MIB // 4)
    tensors = [random_like_bytes((numel,), torch.float32, 90 + i, dev) for i in range(count)]
    total = count * numel * 4
    state = StateDict({f"t{i}": t for i, t in enumerate(tensors)})
    pinned = [torch.empty(numel, dtype=torch.float32, pin_memory=not env.cpu) for _ in tensors]
    repeats = 2 if env.quick else 3

    def torch_d2h() -> None:
        for dst, src in zip(pinned, tensors, strict=True):
            dst.copy_(src, non_blocking=True)  # what tensor.to("cpu", non_blocking=True) does
        env.sync()

    source = "memory://gpu-check-speed"
    lib_time = math.inf
    with env_var("STATESNAP_MEMORY_BUDGET_BYTES", str(2 * total)):
        env.sync()
        torch_time = _best(torch_d2h, repeats)
        memory.clear(source)
        t0 = time.perf_counter()
        Snapshot.take(source, {"s": state})  # a synchronous take of the same state, first
        take_time = time.perf_counter() - t0
        for i in range(repeats + 1):  # the first call fills the pool: reported apart
            memory.clear(source)
            t0 = time.perf_counter()
            pending = Snapshot.async_take(source, {"s": state})  # staged when it returns
            if i:
                lib_time = min(lib_time, time.perf_counter() - t0)
            else:
                first_time = time.perf_counter() - t0
            pending.wait(timeout=300)
    restored = StateDict({k: torch.empty_like(t) for k, t in state.items()})

    def torch_h2d() -> None:
        for dst, src in zip(restored.values(), pinned, strict=True):
            dst.copy_(src, non_blocking=True)
        env.sync()

    h2d_torch = _best(torch_h2d, repeats)

    def library_h2d() -> None:
        Snapshot(source).restore({"s": restored})
        env.sync()

    h2d_lib = _best(library_h2d, repeats)
    check(all(same(restored[k], t) for k, t in state.items()), "speed: restored differs")
    # Where a restore's time goes: the same restore without CRC checks, and one into host
    # tensors (the storage's reads and checks alone, no device copy).
    unchecked = Options(checksums=False)

    def library_h2d_unchecked() -> None:
        Snapshot(source).restore({"s": restored}, options=unchecked)
        env.sync()

    h2d_unchecked = _best(library_h2d_unchecked, repeats)
    on_host = StateDict({k: torch.empty(t.shape, dtype=t.dtype) for k, t in state.items()})
    host_lib = _best(lambda: Snapshot(source).restore({"s": on_host}), repeats)
    check(all(same(on_host[k], t.cpu()) for k, t in state.items()), "speed: host restore differs")
    memory.clear()
    gb = total / 1e9
    print(
        f"  {count} x {numel * 4 // MIB} MiB fp32; device->host: async_take's call "
        f"{gb / lib_time:.1f} GB/s, torch pinned copies {gb / torch_time:.1f} GB/s, ratio "
        f"{torch_time / lib_time:.2f}; host->device: restore from memory:// {gb / h2d_lib:.1f} "
        f"GB/s, torch pinned copies {gb / h2d_torch:.1f} GB/s, ratio {h2d_torch / h2d_lib:.2f}"
    )
    print(
        f"  restore from memory:// without CRC checks {gb / h2d_unchecked:.1f} GB/s; into host "
        f"tensors (no device copy) {gb / host_lib:.1f} GB/s"
    )
    print(
        f"  first async_take's call {first_time:.3f} s against a take to memory:// "
        f"{take_time:.3f} s (ratio {first_time / take_time:.2f}); later calls {lib_time:.3f} s"
    )


CHECKS: dict[str, Callable[[Env], None]] = {
    "dtypes": check_dtypes,
    "budget": check_budget,
    "dtensor": check_dtensor,
    "landing": check_landing,
    "rng": check_rng,
    "tensor_aware": check_tensor_aware,
    "lightning": check_lightning,
    "speed": check_speed,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer rounds")
    parser.add_argument("--only", nargs="*", choices=sorted(CHECKS), help="run these checks")
    parser.add_argument("--out", help="where to write snapshots (default: a temp directory)")
    parser.add_argument(
        "--cpu-dry-run", action="store_true", help="run the steps on CPU (the script's logic)"
    )
    args = parser.parse_args(argv)
    if not args.cpu_dry_run and not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA GPU is available (torch.cuda.is_available() is False, torch "
            f"{torch.__version__}); run it on a machine with one",
            file=sys.stderr,
        )
        return 2
    root = tempfile.mkdtemp(prefix="gpu-check-", dir=args.out)
    env = Env(args.cpu_dry_run, args.quick, root)
    name = "CPU dry run" if env.cpu else torch.cuda.get_device_name(0)
    print(f"gpu_check on {name}, torch {torch.__version__}", flush=True)
    start = time.perf_counter()
    try:
        for check_name in args.only or list(CHECKS):
            t0 = time.perf_counter()
            print(f"[{check_name}]", flush=True)
            before = len(FAILURES)
            try:
                CHECKS[check_name](env)
            except Exception:
                traceback.print_exc()
                fail(f"{check_name}: raised (traceback above)")
            status = "ok" if len(FAILURES) == before else "FAILED"
            print(f"  {status} in {time.perf_counter() - t0:.1f} s", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"summary on {name}: {len(FAILURES)} mismatch(es) in {time.perf_counter() - start:.0f} s")
    for f in FAILURES:
        print(f"  - {f}")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
