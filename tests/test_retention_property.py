"""Retention through the CheckpointManager over random roots: committed steps, steps it cannot
read (a damaged byte, a newer format), other libraries' and users' folders, links named like
steps, takes and deletions cut short, under random policies. A manager saving one new step
deletes nothing but the debris of takes and the committed steps its policy drops, and the new
step restores (docs/reliability.md, "Checkpoint manager and deletions")."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from snapshot import CheckpointManager, Snapshot, StateDict
from snapshot._engine.manager.retention import Policy, Step, to_keep
from snapshot._engine.take.commit import MANIFEST_NAME, PENDING_NAME
from tests.test_manager_safety import TORCHSNAPSHOT, damage, newer_format, tree

LOSSES = (0.4, 0.1, 0.3, 0.2)
KINDS = (
    "committed",
    "committed",
    "committed",
    "committed_marked",  # a deletion cut short after its marker was written
    "damaged",
    "newer",
    "torchsnapshot",
    "user",
    "link",
    "incomplete",  # a take cut short: marker and blobs
    "deletion_cut",  # a deletion cut short: marker and some blobs, no manifest
    "marker_and_user_file",
    "unmarked_blobs",
    "empty",
)
DEBRIS = ("incomplete", "deletion_cut")


def state(value: float) -> dict:
    return {"model": StateDict(w=torch.full((4,), value), b=torch.arange(300.0) * value)}


@pytest.fixture(scope="module")
def templates():
    """Committed snapshots, one per loss, and one outside any root for links to point at."""
    where = tempfile.mkdtemp(prefix="statesnap-retention-")
    made = []
    for i, loss in enumerate(LOSSES):
        path = os.path.join(where, f"t{i}")
        Snapshot.take(path, state(float(i)), user_metadata={"step": i, "metrics": {"loss": loss}})
        made.append(path)
    outside = os.path.join(where, "outside")
    Snapshot.take(outside, state(9.0))
    yield made, outside
    shutil.rmtree(where)


def build(root: str, step: int, kind: str, template: str, outside: str, canonical: bool) -> None:
    name = f"step_{step:010d}" if canonical else f"step_{step}"
    path = os.path.join(root, name)
    if kind == "link":
        os.symlink(outside, path)
        return
    if kind in ("committed", "committed_marked", "damaged", "newer", "deletion_cut"):
        shutil.copytree(template, path)
        if kind == "damaged":
            damage(path)
        elif kind == "newer":
            newer_format(path)
        elif kind in ("committed_marked", "deletion_cut"):
            with open(os.path.join(path, PENDING_NAME), "w") as f:
                f.write("deleting\n")
            if kind == "deletion_cut":
                os.remove(os.path.join(path, MANIFEST_NAME))
                blobs = sorted(os.listdir(os.path.join(path, "0")))
                os.remove(os.path.join(path, "0", blobs[0]))
        return
    if kind == "torchsnapshot":
        shutil.copytree(TORCHSNAPSHOT, path)
        return
    os.makedirs(path)
    files = {
        "user": ["notes.txt"],
        "incomplete": [PENDING_NAME, "0/1a2b3c4d-s0", "0/1a2b3c4d-3", "..statesnap-pending.tmp"],
        "marker_and_user_file": [PENDING_NAME, "0/1a2b3c4d-s0", "0/notes.txt"],
        "unmarked_blobs": ["0/1a2b3c4d-s0"],
        "empty": [],
    }[kind]
    if kind == "incomplete":
        files[-1] = f"..statesnap-pending.{'a' * 12}.tmp"
    for rel in files:
        os.makedirs(os.path.dirname(os.path.join(path, rel)), exist_ok=True)
        with open(os.path.join(path, rel), "w") as f:
            f.write("x")


roots = st.dictionaries(
    st.integers(1, 20),
    st.tuples(st.sampled_from(KINDS), st.integers(0, len(LOSSES) - 1), st.booleans()),
    max_size=8,
)
policies = st.tuples(
    st.sampled_from([None, 1, 2, 3]), st.sampled_from([None, 2, 5]), st.sampled_from([None, 1, 2])
)


@pytest.mark.slow  # a manager's save per example, some 40 examples
@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(contents=roots, policy=policies)
def test_retention_deletes_only_debris_and_what_the_policy_drops(templates, contents, policy):
    made, outside = templates
    keep_last, keep_every, keep_best = policy
    with tempfile.TemporaryDirectory(prefix="statesnap-root-") as where:
        root = os.path.join(where, "ckpt")
        os.makedirs(root)
        names = {}
        for step, (kind, t, canonical) in contents.items():
            # Non-canonical names only for plain committed steps (one name per step).
            canonical = canonical or kind != "committed"
            build(root, step, kind, made[t], outside, canonical)
            names[step] = f"step_{step:010d}" if canonical else f"step_{step}"
        before = tree(root)
        beyond = tree(os.path.dirname(outside))
        new = max(contents, default=0) + 1
        with CheckpointManager(
            root,
            keep_last=keep_last,
            keep_every_steps=keep_every,
            keep_best=keep_best,
            metric="loss",
            async_=False,
        ) as manager:
            manager.restore(state(0.0))
            manager.save(new, state(float(new)), metrics={"loss": 0.25})
            manager.wait()
        after = tree(root)
        assert tree(os.path.dirname(outside)) == beyond  # nothing through a link

        def gone(step: int) -> bool:
            return not any(p.split(os.sep)[0] == names[step] for p in after)

        readable = {s for s, (k, _, _) in contents.items() if k.startswith("committed")}
        unreadable = any(k in ("damaged", "newer") for k, _, _ in contents.values())
        steps = [Step(s, names[s], {"loss": LOSSES[contents[s][1]]}) for s in readable]
        steps.append(Step(new, f"step_{new:010d}", {"loss": 0.25}))
        kept = to_keep(Policy(keep_last, keep_every, keep_best, "loss"), steps)
        for step, (kind, _, _) in contents.items():
            mine = {p: v for p, v in before.items() if p.split(os.sep)[0] == names[step]}
            if kind in DEBRIS:
                assert gone(step), (kind, step)
            elif kind in ("committed", "committed_marked"):
                if unreadable or step in kept:
                    assert {p: after.get(p) for p in mine} == mine, (kind, step)
                else:
                    assert gone(step), (kind, step)
            else:  # never the manager's to delete
                assert {p: after.get(p) for p in mine} == mine, (kind, step)
        with CheckpointManager(root) as manager:
            target = state(-1.0)
            assert manager.restore(target) == new
            assert torch.equal(target["model"]["w"], state(float(new))["model"]["w"])
