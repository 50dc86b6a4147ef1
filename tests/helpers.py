"""Helpers shared by tests: exact equality of restored values, bit for bit; manifests edited by
hand."""

from __future__ import annotations

import fcntl
import math
import os
import pty
import struct
import subprocess
import termios
import threading
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch

from snapshot import Snapshot
from snapshot._engine.format.serialization import as_copyable, tensor_memoryview


def seal_manifest(body: bytes) -> bytes:
    """Manifest bytes ending with the checksum line of ``body`` (what a manifest edited by hand,
    or forged, would carry to pass the checksum), so that the decoder's own checks are what a
    test exercises. The line starts a line of its own."""
    if body and not body.endswith(b"\n"):
        body += b"\n"
    return body + b"# crc32 %08x\n" % zlib.crc32(body)


def open_decoded(path: str, **kwargs: Any) -> Snapshot:
    """``Snapshot(path, **kwargs)`` with its manifest decoded: opening checks the manifest's
    checksum line and header; its entries are decoded on first use."""
    snap = Snapshot(path, **kwargs)
    snap.get_manifest()
    return snap


def raw_bytes(t: torch.Tensor) -> bytes:
    """A tensor's bytes in row-major order (dtypes without copy kernels, the sub-byte ints,
    through their uint8 view)."""
    t = as_copyable(t.detach().resolve_conj().resolve_neg())
    if not t.is_contiguous():
        t = t.contiguous()
    return bytes(tensor_memoryview(t))


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A tensor of ``dtype`` whose bytes are random (so NaNs and odd bit patterns occur)."""
    t = torch.empty(shape, dtype=dtype)
    view = tensor_memoryview(t)
    g = torch.Generator().manual_seed(seed)
    view[:] = bytes(torch.randint(0, 256, (len(view),), dtype=torch.uint8, generator=g).tolist())
    if dtype == torch.bool:
        t.view(torch.uint8).bitwise_and_(1)
    return t


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Same types, same structure and key order, tensors bitwise equal, floats equal incl. NaN
    and the sign of zero."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype, f"{path}: {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: {a.shape} != {b.shape}"
        assert raw_bytes(a) == raw_bytes(b), f"{path}: tensor bytes differ"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}/{i}")
    elif isinstance(a, float):
        assert (math.isnan(a) and math.isnan(b)) or (
            a == b and math.copysign(1, a) == math.copysign(1, b)
        ), f"{path}: {a!r} != {b!r}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


class ModelAndOptimizer:
    """A model and its optimizer as one Stateful, through torch's ``get_state_dict`` /
    ``set_state_dict``, as a parallel job writes it (the defaults keep each value a DTensor:
    each rank's own pieces); ``options``: torch's ``StateDictOptions`` for both calls."""

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer, options: Any = None):
        self.model, self.optim, self.options = model, optim, options

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.model, self.optim, options=self.options)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self.model,
            self.optim,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=self.options,
        )


def full_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """The whole model and optimizer state of a parallel job (torch's ``full_state_dict``),
    gathered on every rank: path -> value (tensors cloned)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True)
    model_sd, optim_sd = get_state_dict(model, optim, options=options)
    out: dict[str, Any] = {f"model/{k}": v.detach().clone() for k, v in model_sd.items()}
    for fqn, state in optim_sd["state"].items():
        for name, value in state.items():
            out[f"optim/{fqn}/{name}"] = value.detach().clone()
    for i, group in enumerate(optim_sd["param_groups"]):
        for name, value in group.items():
            out[f"optim/param_groups/{i}/{name}"] = value
    return out


def train_step(
    model: torch.nn.Module, optim: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor]
) -> float:
    """One optimizer step on the mean squared error of ``model(x)`` against ``y``; its loss."""
    x, y = batch
    optim.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optim.step()
    return loss.item()


@dataclass
class OnTerminal:
    """A command started with its stderr on a pseudo-terminal (``on_terminal``): ``shown``
    collects what the terminal received, read by ``reader`` until the command closes it."""

    process: subprocess.Popen[str]
    reader: threading.Thread
    shown: list[bytes] = field(default_factory=list)

    def finish(self, timeout: float = 240) -> tuple[int, str, str]:
        """(exit code, stdout, what the terminal showed)."""
        out, _ = self.process.communicate(timeout=timeout)
        self.reader.join(timeout=60)
        return self.process.returncode, out, b"".join(self.shown).decode(errors="replace")


def on_terminal(command: list[str], env: dict[str, str], columns: int, **popen: Any) -> OnTerminal:
    """Starts ``command`` with stdout a pipe and stderr a terminal ``columns`` wide (so that a
    progress bar draws as it would for a user)."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=follower, text=True, env=env, **popen
    )
    os.close(follower)
    shown: list[bytes] = []

    def read() -> None:
        while True:
            try:
                data = os.read(leader, 4096)
            except OSError:  # EIO: the command closed its end
                break
            if not data:
                break
            shown.append(data)
        os.close(leader)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return OnTerminal(process, reader, shown)
