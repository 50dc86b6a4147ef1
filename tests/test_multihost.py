"""A host cut off mid-take, on a test network of namespaces (tests/netns.py).

Two "hosts", a and b, with half the ranks each, joined by gloo over TCP across a bridge; the
rendezvous store on rank 0's host (a), as torchrun puts it; storage on a directory both hosts
share and on moto's S3 server in a namespace of its own. Host b's link goes down while its
ranks are inside a take (their ``state_dict``): its packets vanish, no connection is reset.
The ranks of host a raise RankFailedError naming every rank of b within the bound
(``rank_timeout_secs``, set low here), nothing is committed, and a job restarted on the ranks
that remain (host a's) restores the previous snapshot bitwise.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from snapshot import Options, RankFailedError, Snapshot, SnapshotNotFoundError, StateDict
from tests import netns
from tests.multirank import run_ranks
from tests.s3server import S3Server

pytestmark = pytest.mark.slow  # real processes on a namespace network

RANK_TIMEOUT = 4.0
OPTIONS = Options(rank_timeout_secs=RANK_TIMEOUT)


@pytest.fixture(scope="module")
def can_make_namespaces() -> None:
    why = netns.unavailable()
    if why is not None:
        pytest.skip(f"no namespace network here: {why}")


def _model() -> StateDict:
    """The same values on every rank (replicated: stored once, restorable on fewer ranks)."""
    gen = torch.Generator().manual_seed(7)
    return StateDict(**{f"w{i}": torch.randn(256, 256, generator=gen) for i in range(4)})


class Gate:
    """On host b's ranks, ``state_dict`` says so (a file) and waits until the test has cut
    the host off: the cut lands inside the take."""

    def __init__(self, root: str, on_b: bool) -> None:
        self.root, self.on_b = root, on_b

    def state_dict(self):
        if self.on_b:
            open(os.path.join(self.root, f"gate-{dist.get_rank()}"), "w").close()
            deadline = time.monotonic() + 60
            while not os.path.exists(os.path.join(self.root, "cut-at")):
                assert time.monotonic() < deadline, "the host was never cut"
                time.sleep(0.02)
        return {"rank": dist.get_rank()}

    def load_state_dict(self, sd):
        pass


def _job(rank: int, world: int, base: str, storage: dict | None, root: str, per_host: int):
    """Takes step 1, then step 2 during which host b is cut. Host a's ranks return what they
    raised and how long after the cut; b's return what they raised (they lose the store)."""
    on_b = rank >= per_host
    Snapshot.take(f"{base}/step-1", {"model": _model()}, storage_options=storage, options=OPTIONS)
    state = {"model": _model(), "gate": Gate(root, on_b)}
    try:
        Snapshot.take(f"{base}/step-2", state, storage_options=storage, options=OPTIONS)
    except RankFailedError as e:
        with open(os.path.join(root, "cut-at")) as f:
            return str(e), e.failures, time.time() - float(f.read())
    raise AssertionError("the take did not fail")


def _resume(rank: int, world: int, base: str, storage: dict | None):
    """On the ranks that remain: step 2 is not there; step 1 restores bitwise."""
    with pytest.raises(SnapshotNotFoundError):
        Snapshot(f"{base}/step-2", storage_options=storage)
    model = StateDict(**{f"w{i}": torch.zeros(256, 256) for i in range(4)})
    Snapshot(f"{base}/step-1", storage_options=storage).restore({"model": model})
    for key, value in _model().items():
        assert torch.equal(model[key], value), key
    return sorted(model)


def _cut_when_gated(net: netns.TestNetwork, root: str, b_ranks: list[int]) -> None:
    deadline = time.monotonic() + 90
    while not all(os.path.exists(os.path.join(root, f"gate-{r}")) for r in b_ranks):
        if time.monotonic() > deadline:
            return
        time.sleep(0.02)
    net.cut("b")
    with open(os.path.join(root, "cut-at.tmp"), "w") as f:
        f.write(repr(time.time()))
    os.replace(os.path.join(root, "cut-at.tmp"), os.path.join(root, "cut-at"))


# Two ranks on a shared directory, four (two per host) on S3: each world size and each store
# once. The watch that names the silent ranks is the same code on both stores.
@pytest.mark.parametrize(("world", "storage"), [(2, "fs"), (4, "s3")])
def test_a_host_cut_off_mid_take(can_make_namespaces, tmp_path, world, storage):
    per_host = world // 2
    a_ranks, b_ranks = list(range(per_host)), list(range(per_host, world))
    root = str(tmp_path)
    with netns.TestNetwork(["a", "b", "s3"]) as net:
        server = None
        if storage == "s3":
            server = S3Server()
            server.start(net.address("s3"), netns=net.ns("s3"))
            base, options = f"s3://{server.new_bucket()}", server.storage_options()
        else:
            base, options = str(tmp_path / "shared"), None
        try:
            cutter = threading.Thread(target=_cut_when_gated, args=(net, root, b_ranks))
            cutter.start()
            results = run_ranks(
                world,
                _job,
                base,
                options,
                root,
                per_host,
                hosts=[net.ns("a")] * per_host + [net.ns("b")] * per_host,
                init_method=f"tcp://{net.address('a')}:29500",
                timeout=120,
                expect_dead=frozenset(b_ranks),  # cut off: they may not get to report
            )
            cutter.join()
            for rank in a_ranks:
                message, failures, seconds = results[rank]
                assert f"rank(s) {b_ranks} fell silent" in message, message
                assert sorted(failures) == b_ranks, failures
                # Within the bound: the silent ranks' heartbeats stopped at the cut.
                assert RANK_TIMEOUT - 0.5 < seconds < RANK_TIMEOUT + 10, seconds
                print(f"{world} ranks, {storage}: rank {rank} raised {seconds:.2f} s after the cut")
            # The job restarted on the ranks that remain (host a's; a fresh rendezvous).
            restored = run_ranks(
                per_host,
                _resume,
                base,
                options,
                hosts=[net.ns("a")] * per_host,
                init_method=f"tcp://{net.address('a')}:29501",
                timeout=120,
            )
            assert restored == [[f"w{i}" for i in range(4)]] * per_host
        finally:
            if server is not None:
                server.stop()
    if storage == "fs":  # what step 2 left holds no manifest: it is no snapshot
        assert (tmp_path / "shared" / "step-1" / "manifest.yaml").exists()
        assert not (tmp_path / "shared" / "step-2" / "manifest.yaml").exists()
