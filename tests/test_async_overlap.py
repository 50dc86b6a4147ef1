"""async_take(stage_in_background=True): the call returns before the tensors are copied; hooks
hold each optimizer's step and each forward of a module with buffers until they are, and
``wait_staged`` is the guard for the rest. The snapshot still holds the state of the call."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from snapshot import Snapshot, SnapshotError, StateDict
from snapshot._engine import runtime
from snapshot._engine.io.staging import process_pool
from snapshot.options import Options
from tests.cuda_double import CudaDouble
from tests.multirank import run_ranks

OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5),
    "lbfgs": lambda p: torch.optim.LBFGS(p, lr=0.5, history_size=3, max_iter=2),
    "adadelta": lambda p: torch.optim.Adadelta(p, lr=0.5),
    "adamax": lambda p: torch.optim.Adamax(p, lr=0.01),
    "nadam": lambda p: torch.optim.NAdam(p, lr=0.01),
    "radam": lambda p: torch.optim.RAdam(p, lr=0.01),
    "asgd": lambda p: torch.optim.ASGD(p, lr=0.01, t0=0),
    "rprop": lambda p: torch.optim.Rprop(p, lr=0.01),
    "adafactor": lambda p: torch.optim.Adafactor(p, lr=0.01),
    "muon": lambda p: torch.optim.Muon([q for q in p if q.dim() == 2], lr=0.01),  # 2-D only
}
# Every optimizer of torch.optim whose state a dense step makes (SparseAdam takes sparse
# gradients only): step counts as tensors, moment buffers, LBFGS's lists, ASGD's eta/mu/ax,
# Rprop's per-element step sizes, Adafactor's factored row and column variances, Muon's
# momentum of matrices.


class Gate:
    """A ``_custom_tensor_prepare_func`` that returns the tensor as it is, but whose calls
    while writing (``tracing=False``, on the staging thread) wait until ``opened``."""

    def __init__(self, fail: bool = False) -> None:
        self.opened = threading.Event()
        self.fail = fail
        self.staging_calls = 0

    def __call__(self, path: str, t: torch.Tensor, tracing: bool) -> torch.Tensor:
        if not tracing:
            self.staging_calls += 1
            assert self.opened.wait(60)
            if self.fail:
                raise ValueError(f"cannot stage {path}")
        return t

    def open_later(self, seconds: float) -> None:
        threading.Timer(seconds, self.opened.set).start()


class Holder:
    """A user object with a tensor: Stateful, its optimizer an attribute (as a wrapper's)."""

    def __init__(self) -> None:
        self.t = torch.arange(6.0)
        self.net = torch.nn.Linear(3, 2)
        self.opt = torch.optim.Adam(self.net.parameters(), lr=0.01)

    def state_dict(self):
        return {"t": self.t, "opt": self.opt.state_dict(), "net": self.net.state_dict()}

    def load_state_dict(self, state):
        self.t.copy_(state["t"])


def _train(models, optimizers, x):
    """One step of every optimizer (LBFGS through its closure)."""
    for name, opt in optimizers.items():
        model = models[name]

        def closure(model=model, opt=opt):
            opt.zero_grad()
            loss = model(x).square().sum()
            loss.backward()
            return loss

        opt.step(closure)


def _state():
    torch.manual_seed(0)
    models = {n: torch.nn.Linear(4, 3) for n in OPTIMIZERS}
    optimizers = {n: make(models[n].parameters()) for n, make in OPTIMIZERS.items()}
    bn = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).train()
    extra = StateDict(t=torch.randn(5), n=3)
    holder = Holder()
    x = torch.randn(8, 4)
    _train(models, optimizers, x)  # every optimizer has state
    bn(x)
    holder.net(torch.randn(2, 3)).sum().backward()
    holder.opt.step()
    app_state = {f"opt_{n}": o for n, o in optimizers.items()}
    app_state |= {f"model_{n}": m for n, m in models.items()}
    app_state |= {"bn": bn, "extra": extra, "holder": holder}
    return app_state, models, optimizers, x


def _copy(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copy(v) for v in value)
    return value


def _same(got, want, where=""):
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert got.dtype == want.dtype and got.shape == want.shape, where
        bits = lambda t: t.detach().flatten().view(torch.uint8)  # noqa: E731
        assert torch.equal(bits(got), bits(want)), where  # bitwise: NaNs and -0.0 too
    elif isinstance(want, dict):
        assert set(got) == set(want), where
        for k in want:
            _same(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _same(g, w, f"{where}/{i}")
    else:
        assert got == want, where


def _mutate(app_state, models, optimizers, x, pending):
    """Changes every kind of state at once: the hooked steps and forward first, then the rest
    after ``wait_staged``."""
    _train(models, optimizers, x)
    app_state["bn"](x)
    holder = app_state["holder"]
    holder.net(torch.randn(2, 3)).sum().backward()
    holder.opt.step()
    pending.wait_staged(timeout=60)
    app_state["extra"]["t"].add_(1.0)
    holder.t.mul_(3.0)


def _hooks(app_state) -> int:
    opts = [v for v in app_state.values() if isinstance(v, torch.optim.Optimizer)]
    opts.append(app_state["holder"].opt)
    return sum(
        len(o._optimizer_step_pre_hooks) + len(o._optimizer_step_post_hooks) for o in opts
    ) + sum(len(m._forward_pre_hooks) for m in app_state["bn"].modules())


@pytest.mark.parametrize("gated", [True, False], ids=["held", "free"])
def test_state_changed_at_once_after_the_call_is_snapshotted_as_it_was(tmp_path, gated):
    app_state, models, optimizers, x = _state()
    expected = {k: _copy(v.state_dict()) for k, v in app_state.items()}
    gate = Gate() if gated else None
    if gate is None:
        pending = Snapshot.async_take(str(tmp_path / "s"), app_state, stage_in_background=True)
    else:
        pending = Snapshot.async_take(
            str(tmp_path / "s"), app_state, _custom_tensor_prepare_func=gate,
            stage_in_background=True,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while gate.staging_calls == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gate.staging_calls == 1  # the call returned before staging was done
        # the holder's Adam; the Sequential holding BatchNorm, and BatchNorm
        assert _hooks(app_state) == len(OPTIMIZERS) + 1 + 2
        gate.open_later(0.3)
        t0 = time.perf_counter()
    _mutate(app_state, models, optimizers, x, pending)
    if gate is not None:
        assert time.perf_counter() - t0 > 0.2  # the first step waited for staging
    snap = pending.wait(timeout=60)
    assert _hooks(app_state) == 0
    for key, want in expected.items():
        _same(snap.get_state_dict_for_key(key), want, key)
    # The state did change after the call.
    assert not torch.equal(app_state["extra"]["t"], expected["extra"]["t"])
    assert not torch.equal(app_state["bn"][1].running_mean, expected["bn"]["1.running_mean"])


def test_without_the_option_wait_staged_returns_at_once(tmp_path):
    state = StateDict(t=torch.ones(3))
    pending = Snapshot.async_take(str(tmp_path / "s"), {"s": state})
    pending.wait_staged(timeout=0)
    pending.wait(timeout=60)


def test_wait_staged_times_out_while_staging_goes_on(tmp_path):
    gate = Gate()
    state = StateDict(t=torch.ones(3))
    pending = Snapshot.async_take(
        str(tmp_path / "s"), {"s": state}, _custom_tensor_prepare_func=gate,
        stage_in_background=True,
    )  # fmt: skip
    with pytest.raises(TimeoutError):
        pending.wait_staged(timeout=0.05)
    gate.opened.set()
    pending.wait_staged(timeout=60)
    assert torch.equal(pending.wait(timeout=60).read_object("0/s/t"), torch.ones(3))


def test_a_failed_staging_releases_the_hooks_and_raises_at_wait(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    gate = Gate(fail=True)
    pending = Snapshot.async_take(
        str(tmp_path / "s"), {"model": model, "opt": opt}, _custom_tensor_prepare_func=gate,
        stage_in_background=True,
    )  # fmt: skip
    gate.open_later(0.2)
    before = model[0].weight.detach().clone()
    opt.step()  # held until staging fails, then it runs
    assert not torch.equal(model[0].weight, before)
    model(torch.randn(8, 4))
    with pytest.raises(SnapshotError, match="cannot stage"):
        pending.wait_staged(timeout=60)
    with pytest.raises(SnapshotError, match="cannot stage"):
        pending.wait(timeout=60)
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    assert not any(m._forward_pre_hooks for m in model.modules())
    assert not (tmp_path / "s" / "manifest.yaml").exists()


def test_a_later_pre_hook_survives_the_guard_removing_its_own(tmp_path):
    """The guard's hook is removed while the step waits in it; a hook registered after it
    still runs, and torch's iteration over the hooks is not disturbed."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones(3)
    opt.step()
    gate = Gate()
    pending = Snapshot.async_take(
        str(tmp_path / "s"), {"opt": opt}, _custom_tensor_prepare_func=gate,
        stage_in_background=True,
    )  # fmt: skip
    ran = []
    opt.register_step_pre_hook(lambda *_: ran.append(gate.opened.is_set()))
    gate.open_later(0.2)
    opt.step()
    assert ran == [True]
    pending.wait(timeout=60)
    assert len(opt._optimizer_step_pre_hooks) == 1 and not opt._optimizer_step_post_hooks


def test_two_pending_snapshots_hold_one_step_and_both_keep_their_state(tmp_path):
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones(3)
    opt.step()
    first = opt.state_dict()["state"][0]["momentum_buffer"].clone()
    gates = [Gate(), Gate()]
    pending = [
        Snapshot.async_take(
            str(tmp_path / f"s{i}"),
            {"opt": opt},
            _custom_tensor_prepare_func=gate,
            stage_in_background=True,
        )
        for i, gate in enumerate(gates)
    ]
    gates[0].open_later(0.1)
    gates[1].open_later(0.3)
    opt.step()  # waits for both: the first's hook is removed while the second's still holds
    assert gates[1].opened.is_set()
    for i in range(2):
        got = pending[i].wait(timeout=60).read_object("0/opt/state/0/momentum_buffer")
        assert torch.equal(got, first)
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks


def test_stage_in_background_must_be_a_bool(tmp_path):
    with pytest.raises(Exception, match="stage_in_background must be a bool"):
        Snapshot.async_take(str(tmp_path / "s"), {"s": StateDict()}, stage_in_background="yes")


def test_device_copies_wait_for_the_kernels_queued_at_the_call_only(tmp_path, monkeypatch):
    """The staging thread's copies come after the kernels queued on the caller's current
    stream before the call, and not after those queued after it (the forward and backward
    that overlap with staging): a stream made at the call waits for the caller's, and the
    staging stream waits for that one."""
    cuda = CudaDouble(monkeypatch, devices=2)
    final = {f"t{i}": torch.randn(64) for i in range(6)} | {"big": torch.randn(300_000)}
    state = StateDict()
    for i, (k, v) in enumerate(final.items()):
        t = cuda.tensor(torch.zeros_like(v), device=i % 2)
        cuda.launch(lambda t=t, v=v: t.copy_(v), device=i % 2)  # the kernel computing it
        state[k] = t
    with runtime.use():
        process_pool(Options().resolved())
        pending = Snapshot.async_take(str(tmp_path / "s"), {"s": state}, stage_in_background=True)
        for i, t in enumerate(state.values()):  # queued at once: not in the snapshot
            cuda.launch(lambda t=t: t.add_(100.0), device=i % 2)
        snap = pending.wait(timeout=60)
        for k, v in final.items():
            assert torch.equal(snap.read_object(f"0/s/{k}"), v), k
    waits = set(cuda.calls("wait"))
    for d in (0, 1):  # s0: made at the call; s1: the pool's staging stream
        assert ("wait", f"cuda:{d}/s0", f"cuda:{d}/default") in waits
        assert ("wait", f"cuda:{d}/s1", f"cuda:{d}/s0") in waits
        assert ("wait", f"cuda:{d}/s1", f"cuda:{d}/default") not in waits
    cuda.synchronize()
    assert torch.equal(cuda.values(state["big"]), final["big"] + 100.0)


def _fail_on_rank_1(path: str, t: torch.Tensor, tracing: bool) -> torch.Tensor:
    if not tracing and torch.distributed.get_rank() == 1:
        raise ValueError("rank 1 cannot stage")
    return t


def _in_a_group(rank: int, world: int, base: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    own = StateDict(t=torch.full((100,), float(rank)))
    app_state = {"model": model, "opt": opt, "own": own}
    expected = {k: _copy(v.state_dict()) for k, v in app_state.items()}
    pending = Snapshot.async_take(
        f"{base}/a", app_state, replicated=["model/**", "opt/**"], stage_in_background=True
    )
    model(torch.randn(8, 4)).sum().backward()  # held until staged
    opt.step()
    x = torch.ones(2)
    torch.distributed.all_reduce(x)  # the caller's group is free while staging goes on
    pending.wait_staged(timeout=120)
    own["t"].add_(1.0)
    snap = pending.wait(timeout=120)
    for key, want in expected.items():
        _same(snap.get_state_dict_for_key(key), want, key)
    # A staging error on one rank: every rank raises at wait, and its step ran.
    failing = Snapshot.async_take(
        f"{base}/b", app_state, _custom_tensor_prepare_func=_fail_on_rank_1,
        stage_in_background=True,
    )  # fmt: skip
    opt.step()
    with pytest.raises(SnapshotError, match="rank 1 cannot stage"):
        failing.wait(timeout=120)
    assert not any(m._forward_pre_hooks for m in model.modules())


@pytest.mark.slow
def test_background_staging_in_a_group(tmp_path):
    run_ranks(2, _in_a_group, str(tmp_path))
    assert (tmp_path / "a" / "manifest.yaml").exists()
    assert not (tmp_path / "b" / "manifest.yaml").exists()


def test_a_forward_run_while_staging_is_not_held_by_its_own_hook(tmp_path):
    """A prepare function that runs a held module's forward runs on the staging thread, which
    the hooks never hold (it would wait for itself); the caller's forward is held."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    x = torch.randn(8, 4)
    ran_on: list[str] = []

    def prepare(path: str, t: torch.Tensor, tracing: bool) -> torch.Tensor:
        if not tracing and path.endswith("running_mean"):
            with torch.no_grad():
                model.eval()(x)  # would wait for staging to end, were the hook to hold it
            ran_on.append(threading.current_thread().name)
        return t

    for i in range(2):  # a second take stages on the same thread
        pending = Snapshot.async_take(
            str(tmp_path / f"s{i}"), {"m": model}, _custom_tensor_prepare_func=prepare,
            stage_in_background=True,
        )  # fmt: skip
        pending.wait_staged(timeout=60)
        pending.wait(timeout=60)
    assert len(ran_on) == 2 and threading.current_thread().name not in ran_on
