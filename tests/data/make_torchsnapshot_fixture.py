"""Writes the torchsnapshot 0.1.0 snapshots under ``tests/data/torchsnapshot-0.1.0/`` that
``tests/test_torchsnapshot_format.py`` reads, with the values they hold beside them.

It needs torchsnapshot itself, which statesnap does not depend on, so it runs in a venv of its
own (torch exactly 2.13.0, CPU; torchsnapshot 0.1.0 imports numpy without declaring it)::

    python3 -m venv /tmp/tsvenv
    /tmp/tsvenv/bin/pip install torch==2.13.0 torchsnapshot==0.1.0 importlib-metadata \
        nest-asyncio numpy
    /tmp/tsvenv/bin/python tests/data/make_torchsnapshot_fixture.py [OUT_DIR]

``OUT_DIR`` defaults to ``tests/data/torchsnapshot-0.1.0`` beside this script; it must not exist
yet (torchsnapshot would write into it). What it holds:

- ``single/``: one process. A small ``nn.Sequential``, an Adam optimizer after one step (tensor
  state, tuples, None and bools in its param groups), and a ``StateDict`` with every primitive
  torchsnapshot stores inline (int, float including nan / -0.0 / inf, str, bool, bytes), None and
  a set and a tuple (pickled objects), a list, a dict with int keys, one with a ``/`` in a key,
  an OrderedDict, a float32 tensor large enough to be chunked, small tensors batched into shared
  files, a bfloat16 tensor, a 0-d tensor and complex64 tensors (stored with torch.save by
  torchsnapshot: one whole, one chunked).
- ``two_ranks/``: two processes on gloo. ``model`` is the same on both ranks and marked
  replicated (stored once, under rank 0's entries); ``local`` differs per rank; ``sharded`` is a
  ``ShardedTensor`` split by rows between the ranks.
- ``rng/``: one process, torchsnapshot's ``RNGState`` alone (its state dict is
  ``{"rng_state": <torch's CPU generator state>}``).
- ``expected.pt``: ``{"single": {key: state_dict}, "two_ranks": {rank: {key: state_dict}},
  "rng": <the generator state taken>}``,
  the sharded tensor as its whole global value; it loads with ``torch.load(...,
  weights_only=True)``.

Chunks are 4 KiB (``TORCHSNAPSHOT_MAX_CHUNK_SIZE_BYTES_OVERRIDE``) and tensors under 4 KiB are
batched (``TORCHSNAPSHOT_SLAB_SIZE_THRESHOLD_BYTES_OVERRIDE``), so the whole fixture stays small.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
from collections import OrderedDict
from datetime import timedelta
from typing import Any

# torchsnapshot reads these whenever it plans a take; set on import, so that the ranks'
# processes (spawned: they import this module) have them too.
os.environ["TORCHSNAPSHOT_MAX_CHUNK_SIZE_BYTES_OVERRIDE"] = "4096"
os.environ["TORCHSNAPSHOT_SLAB_SIZE_THRESHOLD_BYTES_OVERRIDE"] = "4096"

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torchsnapshot

HERE = os.path.dirname(os.path.abspath(__file__))


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


def _single_state() -> dict[str, Any]:
    model = _model(0)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(5, 4)).square().sum().backward()  # every parameter gets a gradient
    optim.step()
    g = torch.Generator().manual_seed(1)
    extra = {
        "step": 7,
        "big_int": -(2**62),
        "ratio": 0.1,
        "nan": math.nan,
        "neg_zero": -0.0,
        "inf": math.inf,
        "name": "run/1",
        "flag": True,
        "blob": b"\x00\xffbytes",
        "nothing": None,
        "tags": {3, 1, 2},
        "pair": (1, "two", torch.tensor([3.0, 4.0])),
        "names": ["a", 2, 3.5],
        "by_id": {1: "one", 2: torch.arange(3)},
        "a/b": 5,
        "ordered": OrderedDict([("z", 1), ("y", 2)]),
        "embedding": torch.randn(64, 48, generator=g),  # 12 KiB: three chunks of 4 KiB
        "small": torch.arange(6, dtype=torch.int16).reshape(2, 3),
        "mask": torch.tensor([True, False, True]),
        # torchsnapshot 0.1.0 views bfloat16 bytes as float32 elements (on torch 2.13 a size
        # that is not a multiple of 4 bytes loses its tail): 8 elements, 16 bytes.
        "half": torch.randn(2, 4, generator=g).to(torch.bfloat16),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "z": torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64),
        "z_big": torch.randn(640, generator=g, dtype=torch.complex64),  # 5 KiB: 2 chunks
    }
    return {
        "model": model,
        "optim": optim,
        "extra": torchsnapshot.StateDict(**extra),
    }


def _rank_state(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(world_size)])
    sharded = sharded_tensor.empty(spec, 6, 5)
    for shard in sharded.local_shards():
        rows = shard.metadata.shard_offsets[0]
        n = shard.metadata.shard_sizes[0]
        shard.tensor.copy_(torch.arange(rows * 5, (rows + n) * 5, dtype=torch.float32).view(n, 5))
    local = {
        "rank": rank,
        "values": torch.full((3,), float(rank + 1)),
        "note": f"rank {rank}",
    }
    return {
        "model": _model(1),  # the same on every rank
        "local": torchsnapshot.StateDict(**local),
        "sharded": torchsnapshot.StateDict(weight=sharded),
    }


def _plain(state: dict[str, Any]) -> dict[str, Any]:
    """Each value's state dict, as plain containers (a StateDict is a UserDict)."""
    out = {}
    for key, value in state.items():
        sd = value.state_dict()
        out[key] = dict(sd) if isinstance(value, torchsnapshot.StateDict) else sd
    return out


def _take_rank(rank: int, world_size: int, path: str, store: str, results: str) -> None:
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store, world_size),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=120),
    )
    try:
        state = _rank_state(rank, world_size)
        torchsnapshot.Snapshot.take(path, state, replicated=["model/**"])
        plain = _plain(state)
        sharded = plain["sharded"]["weight"]
        whole = torch.empty(sharded.size()) if rank == 0 else None
        sharded.gather(dst=0, out=whole)
        plain["sharded"] = {"weight": whole}
        torch.save(plain, os.path.join(results, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def take_rng(out: str) -> torch.Tensor:
    """Takes ``rng/``; returns the generator state it holds."""
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    torchsnapshot.Snapshot.take(os.path.join(out, "rng"), {"rng": torchsnapshot.RNGState()})
    return state


def main(out: str) -> None:
    if os.path.exists(out):
        sys.exit(f"{out} exists: remove it first (torchsnapshot would write into it)")
    os.makedirs(out)
    state = _single_state()
    torchsnapshot.Snapshot.take(os.path.join(out, "single"), state)
    expected: dict[str, Any] = {"single": _plain(state), "rng": take_rng(out)}

    world_size = 2
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(
            _take_rank,
            args=(world_size, os.path.join(out, "two_ranks"), os.path.join(tmp, "store"), tmp),
            nprocs=world_size,
        )
        ranks = {
            r: torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False)
            for r in range(world_size)
        }
    # Rank 0 gathered the sharded tensor whole: every rank expects that global value.
    for r in range(1, world_size):
        ranks[r]["sharded"] = ranks[0]["sharded"]
    expected["two_ranks"] = ranks
    path = os.path.join(out, "expected.pt")
    torch.save(expected, path)
    torch.load(path, weights_only=True)  # what the test does: every value must allow it


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "torchsnapshot-0.1.0"))
