"""Snapshots taken by disjoint subgroups of one job at the same time: each group's ranks alone
take part, every group commits its own snapshot, and none waits for (or talks to) the other.

torch requires every rank of the default group to create each group with ``new_group`` in the
same order, unless the group is made with local synchronization; the gloo groups the library
makes for itself are made by the ranks of the caller's group only.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from snapshot import Snapshot, StateDict
from tests.multirank import run_ranks


def _subgroups(rank: int, world: int, root: str, use_async: bool) -> None:
    # Every rank makes both groups, as torch requires of the caller's own groups.
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    mine = groups[rank % 2]
    name = "even" if rank % 2 == 0 else "odd"
    path = os.path.join(root, name)
    # The two groups' states have the same layout and different values: a snapshot that mixed
    # ranks of both groups would restore the other group's values (or fail its checksums).
    value = torch.arange(4096, dtype=torch.float32) + 1000 * rank
    state = {"s": StateDict(t=value.clone(), rank=rank)}
    for round_ in range(2):  # the library's groups are made once and reused
        at = f"{path}-{round_}"
        if use_async:
            Snapshot.async_take(at, state, pg=mine).wait()
        else:
            Snapshot.take(at, state, pg=mine)
        out = StateDict(t=torch.zeros(4096), rank=-1)
        Snapshot(at, pg=mine).restore({"s": out})
        assert out["rank"] == rank
        assert torch.equal(out["t"], value)
        manifest = Snapshot(at, pg=mine).get_manifest()
        # Group ranks 0 and 1: the global ranks of this group only.
        members = [0, 2] if rank % 2 == 0 else [1, 3]
        for group_rank, global_rank in enumerate(members):
            assert manifest[f"{group_rank}/s/rank"].value == global_rank


@pytest.mark.slow
@pytest.mark.parametrize("use_async", [False, True], ids=["take", "async_take"])
def test_disjoint_subgroups_snapshot_at_once(tmp_path, use_async):
    run_ranks(4, _subgroups, str(tmp_path), use_async, timeout=120)
