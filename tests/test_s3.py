"""Snapshots on S3: a real S3 endpoint (moto's server on loopback, tests/s3server.py), reached
through s3fs as users reach AWS, with requests counted and faults injected at the server."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from snapshot import (
    IncompleteSnapshotError,
    Options,
    Snapshot,
    SnapshotError,
    SnapshotNotFoundError,
    StateDict,
    StorageError,
)
from snapshot._engine.take.commit import MANIFEST_NAME, PENDING_NAME
from storage_plugins.s3 import S3StoragePlugin
from tests.helpers import assert_same
from tests.multirank import run_ranks
from tests.s3server import S3Bucket, S3Request

MIB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent


def mixed_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": StateDict(
            weight=torch.randn(3 * MIB, generator=g),  # 12 MiB: a multipart upload with 5 MiB parts
            bias=torch.randn(16, generator=g),
            half=torch.randn(64, 32, generator=g).to(torch.bfloat16),
            steps=torch.arange(100),
        ),
        "extra": StateDict(epoch=3, name="run-7", history=[0.5, 0.25], blob=b"\x00\x01" * 700),
    }


def empty_like(state: dict) -> dict:
    return {
        k: StateDict(
            {n: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for n, v in sd.items()}
        )
        for k, sd in state.items()
    }


def same(a: dict, b: dict) -> None:
    """The two app states hold bitwise-equal values (StateDicts compared as dicts)."""
    assert_same({k: dict(v) for k, v in a.items()}, {k: dict(v) for k, v in b.items()})


def data_put(r: S3Request) -> bool:
    """A request that stores snapshot data: a PUT or a part of a multipart upload, not the
    commit marker and not the pending marker."""
    return r.method in ("PUT", "POST") and not r.key.endswith((MANIFEST_NAME, PENDING_NAME))


def test_take_and_restore_through_storage_options(s3_bucket: S3Bucket):
    state = mixed_state()
    options = {**s3_bucket.storage_options, "part_bytes": 5 * MIB}
    Snapshot.take(s3_bucket.url(), state, storage_options=options)
    restored = empty_like(state)
    Snapshot(s3_bucket.url(), storage_options=options).restore(restored)
    same(restored, state)
    # The slab of the 12 MiB tensor and the small ones went up in parts of 5 MiB: 5 + 5 + 2
    # and a few KiB.
    parts = sorted(
        r.bytes_in for r in s3_bucket.log() if r.method == "PUT" and "partNumber=" in r.query
    )
    assert len(parts) == 3 and parts[1:] == [5 * MIB, 5 * MIB], parts
    assert 2 * MIB < parts[0] < 2 * MIB + 64 * 1024, parts


def test_an_async_slab_is_checksummed_member_by_member_as_it_is_sent(s3_bucket: S3Bucket):
    """An async take packs 6 MiB tensors and small ones into one slab, sent from its staged copy
    as a multipart upload; S3 checksums each member's range as it sends it. The snapshot holds
    the call's values, and every member's CRC-32 verifies."""
    from snapshot._engine.tools.verify import verify

    g = torch.Generator().manual_seed(3)
    state = StateDict(
        {f"w{i}": torch.randn(3, 1 << 19, generator=g) for i in range(3)}  # 6 MiB each
        | {f"b{i}": torch.randn(100, generator=g) for i in range(3)}
    )
    expected = {k: v.clone() for k, v in state.items()}
    options = {**s3_bucket.storage_options, "part_bytes": 5 * MIB}
    pending = Snapshot.async_take(s3_bucket.url(), {"s": state}, storage_options=options)
    for t in state.values():
        t.fill_(-1)
    snap = pending.wait(timeout=120)
    manifest = snap.get_manifest()
    blobs = {loc.blob for k in expected for loc in manifest[f"0/s/{k}"].locations}
    assert len(blobs) == 1  # one slab
    report = verify(s3_bucket.url(), options)
    assert report.ok and report.ranges >= 6, report.problems
    for k, v in expected.items():
        assert torch.equal(snap.read_object(f"0/s/{k}"), v), k


def test_endpoint_and_credentials_from_the_environment(s3_bucket: S3Bucket, monkeypatch):
    for name, value in s3_bucket.environ().items():
        monkeypatch.setenv(name, value)
    state = mixed_state(1)
    Snapshot.take(s3_bucket.url("env"), state)  # no storage_options at all
    restored = empty_like(state)
    Snapshot(s3_bucket.url("env")).restore(restored)
    same(restored, state)
    assert any(r.key.endswith(MANIFEST_NAME) for r in s3_bucket.log())


def test_commit_marker_is_written_after_every_data_object(s3_bucket: S3Bucket):
    Snapshot.take(
        s3_bucket.url(),
        mixed_state(),
        storage_options={**s3_bucket.storage_options, "part_bytes": 5 * MIB},
    )
    log = s3_bucket.log()
    manifest_puts = [r for r in log if r.method == "PUT" and r.key.endswith(MANIFEST_NAME)]
    data = [r for r in log if data_put(r)]
    assert len(manifest_puts) == 1 and len(data) >= 4
    assert manifest_puts[0].started >= max(r.ended for r in data)


def test_concurrent_requests_are_bounded(s3_bucket: S3Bucket):
    # 16 tensors of 6 MiB: 16 blobs (slabs take only payloads up to 1 MiB here), 32 parts.
    state = {"m": StateDict({f"t{i}": torch.full((3 * MIB // 2,), float(i)) for i in range(16)})}
    server, name = s3_bucket.server, s3_bucket.name
    for limit in (8, 2):
        options = {**s3_bucket.storage_options, "part_bytes": 5 * MIB}
        options["max_concurrent_requests"] = limit
        server.max_in_flight[name] = 0
        alone = Options(slab_threshold_bytes=MIB)
        Snapshot.take(s3_bucket.url(f"limit{limit}"), state, storage_options=options, options=alone)
        took = server.max_in_flight[name]
        restored = {"m": StateDict({k: torch.zeros_like(v) for k, v in state["m"].items()})}
        Snapshot(s3_bucket.url(f"limit{limit}"), storage_options=options).restore(restored)
        same(restored, state)
        if limit == 8:  # the server does see concurrent requests when the plugin allows them
            assert took > 2
        else:
            assert took <= 2 and server.max_in_flight[name] <= 2
    assert sum(1 for r in s3_bucket.log() if "partNumber=" in r.query) == 2 * 32


def test_read_object_of_a_1_gib_snapshot_transfers_only_its_bytes(s3_bucket: S3Bucket):
    big = torch.empty(256 * MIB, dtype=torch.float32)  # 1 GiB
    big[:: 1 << 16] = torch.arange(big.numel() >> 16, dtype=torch.float32)
    bias = torch.linspace(-1, 1, 1024)  # 4 KiB, in a slab with the other small tensors
    state = {
        "model": StateDict(
            big=big, bias=bias, **{f"small{i}": torch.full((1000,), float(i)) for i in range(50)}
        )
    }
    options = s3_bucket.storage_options
    Snapshot.take(s3_bucket.url(), state, storage_options=options)
    del state, big
    assert sum(r.bytes_in for r in s3_bucket.log() if data_put(r)) >= 1 << 30

    start = len(s3_bucket.log())
    got = Snapshot(s3_bucket.url(), storage_options=options).read_object("0/model/bias")
    assert torch.equal(got, bias)
    reads = s3_bucket.log()[start:]
    manifest = [r for r in reads if r.key.endswith(MANIFEST_NAME)]
    others = [r for r in reads if not r.key.endswith(MANIFEST_NAME)]
    assert len(manifest) == 1 and manifest[0].bytes_out < MIB
    assert all(r.range is not None for r in others if r.method == "GET")
    # The object's length comes with the ranged GET's answer: no HEAD request for it.
    assert [r.method for r in others] == ["GET"]
    assert 4096 <= sum(r.bytes_out for r in others) < MIB


def test_transient_errors_are_retried(s3_bucket: S3Bucket, caplog):
    # The first two data uploads are throttled, the first ranged read fails inside the server.
    s3_bucket.fail(data_put, status=503, code="SlowDown", times=2)
    s3_bucket.fail(
        lambda r: r.method == "GET" and r.range is not None,
        status=500,
        code="InternalError",
        times=1,
    )
    state = mixed_state(2)
    options = s3_bucket.storage_options
    with caplog.at_level(logging.WARNING, logger="snapshot"):
        Snapshot.take(s3_bucket.url(), state, storage_options=options)
        restored = empty_like(state)
        Snapshot(s3_bucket.url(), storage_options=options).restore(restored)
    same(restored, state)
    statuses = [r.status for r in s3_bucket.log()]
    assert statuses.count(503) == 2 and statuses.count(500) == 1
    retries = [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]
    assert len(retries) == 3 and all(f"s3://{s3_bucket.name}/snap/" in m for m in retries)


def test_a_connection_dropped_mid_read_is_retried(s3_bucket: S3Bucket, caplog):
    state = mixed_state(3)
    options = s3_bucket.storage_options
    snap = Snapshot.take(s3_bucket.url(), state, storage_options=options)
    blob = snap.get_manifest()["0/model/weight"].locations[0].blob  # 12 MiB in a slab
    cut = s3_bucket.fail(
        lambda r: r.method == "GET" and r.range is not None and r.key.endswith(f"/{blob}"),
        status=0,
        cut_after=100_000,
    )
    restored = empty_like(state)
    with caplog.at_level(logging.WARNING, logger="snapshot"):
        Snapshot(s3_bucket.url(), storage_options=options).restore(restored)
    same(restored, state)
    assert cut.hits == 1
    assert any("retrying" in r.getMessage() for r in caplog.records)


def test_a_permanent_fault_leaves_no_committed_snapshot(s3_bucket: S3Bucket):
    fault = s3_bucket.fail(data_put, status=500, code="InternalError", times=None)
    options = s3_bucket.storage_options
    with pytest.raises(StorageError, match=rf"s3://{s3_bucket.name}/snap/\S+ \(3 attempts\)"):
        Snapshot.take(
            s3_bucket.url(), mixed_state(), storage_options=options, options=Options(io_retries=2)
        )
    assert fault.hits >= 3
    with pytest.raises((SnapshotNotFoundError, IncompleteSnapshotError)):
        Snapshot(s3_bucket.url(), storage_options=options)
    assert not any(r.key.endswith(MANIFEST_NAME) and r.method == "PUT" for r in s3_bucket.log())


def test_a_refused_request_is_not_retried(s3_bucket: S3Bucket):
    s3_bucket.fail(data_put, status=403, code="AccessDenied", times=None)
    with pytest.raises(StorageError, match="AccessDenied|Forbidden|denied"):
        Snapshot.take(s3_bucket.url(), mixed_state(), storage_options=s3_bucket.storage_options)
    refused = [r.key for r in s3_bucket.log() if r.status == 403]
    assert refused and len(refused) == len(set(refused))  # no blob was asked twice


def test_a_stalled_upload_fails_the_take_within_the_timeout(s3_bucket: S3Bucket):
    stall = 40.0  # far longer than the timeout: the take must not wait for it
    s3_bucket.fail(data_put, status=0, delay=stall, times=1)
    t0 = time.monotonic()
    with pytest.raises(StorageError, match=r"STATESNAP_IO_TIMEOUT_SECS") as caught:
        Snapshot.take(
            s3_bucket.url(),
            mixed_state(),
            storage_options=s3_bucket.storage_options,
            options=Options(io_timeout_secs=2),
        )
    assert time.monotonic() - t0 < stall / 2
    assert f"s3://{s3_bucket.name}/snap/" in str(caught.value)
    with pytest.raises(SnapshotError):
        Snapshot(s3_bucket.url(), storage_options=s3_bucket.storage_options)


def _two_ranks(rank: int, world: int, url: str, options: dict) -> list[str]:
    model = torch.nn.Linear(64, 32)
    with torch.no_grad():  # the same on every rank: stored once
        model.weight.copy_(torch.linspace(-1, 1, 64 * 32).view(32, 64))
        model.bias.fill_(0.25)
    own = StateDict(rank=rank, data=torch.full((1000,), float(rank)))
    Snapshot.take(
        url, {"model": model, "own": own}, replicated=["model/**"], storage_options=options
    )
    fresh, mine = torch.nn.Linear(64, 32), StateDict(rank=-1, data=torch.zeros(1000))
    snap = Snapshot(url, storage_options=options)
    snap.restore({"model": fresh, "own": mine})
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
    assert mine["rank"] == rank and torch.equal(mine["data"], own["data"])
    return sorted(snap.get_manifest())


def test_two_ranks_take_and_restore(s3_bucket: S3Bucket):
    manifests = run_ranks(2, _two_ranks, s3_bucket.url(), s3_bucket.storage_options)
    assert manifests[0] == manifests[1]
    snap = Snapshot(s3_bucket.url(), storage_options=s3_bucket.storage_options)
    manifest = snap.get_manifest()
    # Written once and listed once, under rank 0; rank 1's path reads the same entry.
    assert manifest["0/model/weight"].replicated and "1/model/weight" not in manifest
    assert torch.equal(snap.read_object("1/model/weight"), snap.read_object("0/model/weight"))
    assert torch.equal(snap.read_object("1/own/data"), torch.full((1000,), 1.0))


def _unclosed_session_reports(bucket: S3Bucket, close: bool) -> list[str]:
    """What aiohttp reports about unclosed sessions once a plugin that wrote one blob is gone,
    on a loop of its own, after ``close()`` or without it."""

    async def use() -> None:
        plugin = S3StoragePlugin(bucket.url("closing"), bucket.storage_options)
        await plugin.write("blob", [b"bytes"])
        if close:
            await plugin.close()

    reports: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop = asyncio.new_event_loop()
        loop.set_exception_handler(lambda _, context: reports.append(context["message"]))
        loop.run_until_complete(use())
        loop.close()
        gc.collect()
    return reports + [str(w.message) for w in caught if "nclosed" in str(w.message)]


def test_close_closes_the_plugins_http_session(s3_bucket: S3Bucket):
    assert _unclosed_session_reports(s3_bucket, close=True) == []
    # The check can fail: without close(), aiohttp reports the session left open.
    assert any("Unclosed client session" in m for m in _unclosed_session_reports(s3_bucket, False))


def test_tensors_go_to_s3_in_objects_of_at_most_32_mib(s3_bucket: S3Bucket):
    from storage_plugins.registry import chunk_bytes_hint

    assert chunk_bytes_hint("s3://b/p") == 32 * MIB and chunk_bytes_hint("/tmp/x") is None
    big = torch.arange(10 * MIB, dtype=torch.float32)  # 40 MiB
    options = s3_bucket.storage_options
    Snapshot.take(s3_bucket.url("a"), {"m": StateDict(big=big)}, storage_options=options)
    chunks = Snapshot(s3_bucket.url("a"), storage_options=options).get_manifest()["0/m/big"].chunks
    assert [c.nbytes for c in chunks] == [32 * MIB, 8 * MIB]
    assert not any("uploadId" in r.query for r in s3_bucket.log())  # one PutObject each
    big_chunks = Options(chunk_bytes=64 * MIB)  # an explicit setting wins
    Snapshot.take(
        s3_bucket.url("b"), {"m": StateDict(big=big)}, storage_options=options, options=big_chunks
    )
    chunks = Snapshot(s3_bucket.url("b"), storage_options=options).get_manifest()["0/m/big"].chunks
    assert [c.nbytes for c in chunks] == [40 * MIB]


def test_request_bodies_are_streamed_from_the_callers_buffers():
    """A body reads the caller's buffers in place: its length, reads that span buffers, seeks
    from each end, and the pieces aiohttp streams are the bytes in order."""
    from storage_plugins.s3 import _PIECE_BYTES
    from storage_plugins.s3 import Body as _Body

    big = bytes(range(256)) * ((_PIECE_BYTES + 1000) // 256)
    views = [memoryview(b"head"), memoryview(b""), memoryview(big), memoryview(b"tail")]
    whole = b"head" + big + b"tail"
    body = _Body(views)
    assert len(body) == len(whole) and body.tell() == 0
    assert body.read(6) == whole[:6]  # across the first two buffers
    assert body.seek(-6, 2) == len(whole) - 6 and body.read() == whole[-6:]
    assert body.read(10) == b""
    body.seek(3)
    body.seek(2, 1)
    assert body.tell() == 5 and body.read(4) == whole[5:9]
    with pytest.raises(ValueError):
        body.seek(-1)

    async def stream() -> list[bytes]:
        body.seek(0)
        return [piece async for piece in body]

    pieces = asyncio.run(stream())
    assert b"".join(pieces) == whole
    assert max(len(p) for p in pieces) == _PIECE_BYTES and len(pieces) == 2


def test_request_body_reads_and_seeks_in_any_order():
    """Reads resume where the last one ended (without rescanning the buffers before it), and a
    seek anywhere, back or forward or past the end, is honoured."""
    import random

    from storage_plugins.s3 import Body as _Body

    rng = random.Random(1)
    for _ in range(300):
        views = [
            memoryview(bytes(rng.randrange(256) for _ in range(rng.randrange(0, 40))))
            for _ in range(rng.randrange(1, 8))
        ]
        whole = b"".join(views)
        body, pos = _Body(views), 0
        for _ in range(20):
            if rng.random() < 0.3:
                pos = rng.randrange(0, len(whole) + 3)
                body.seek(pos)
            n = rng.choice([-1, 0, 1, 3, 7, 50])
            expected = whole[pos:] if n < 0 else whole[pos : pos + n]
            assert body.read(n) == expected
            pos += len(expected)
            assert body.tell() == pos


@pytest.mark.parametrize(
    "config",
    [
        {"s3": {"payload_signing_enabled": True}},
        {
            "request_checksum_calculation": "when_supported",
            "response_checksum_validation": "when_supported",
        },
    ],
    ids=["payload-signing", "sdk-checksums"],
)
def test_bodies_serve_botocore_when_it_hashes_them(s3_bucket: S3Bucket, config: dict):
    """With payload signing or the SDK's own checksums on (botocore's defaults the plugin
    turns off), botocore reads each body to hash it before it is sent: what lands is still
    the state, single PUTs and multipart parts alike."""
    state = mixed_state(4)
    options = {**s3_bucket.storage_options, "part_bytes": 5 * MIB, "config_kwargs": config}
    Snapshot.take(s3_bucket.url(), state, storage_options=options)
    restored = empty_like(state)
    Snapshot(s3_bucket.url(), storage_options=s3_bucket.storage_options).restore(restored)
    same(restored, state)


@pytest.fixture
def s3_plugins_made(monkeypatch) -> list[S3StoragePlugin]:
    """Every S3 plugin made while the test runs, in order."""
    made: list[S3StoragePlugin] = []
    init = S3StoragePlugin.__init__

    def counting_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(S3StoragePlugin, "__init__", counting_init)
    return made


def _session_open(plugin: S3StoragePlugin) -> bool:
    return getattr(plugin.fs, "_s3", None) is not None


def test_reads_of_one_snapshot_share_one_s3_client(s3_bucket: S3Bucket, s3_plugins_made):
    """Snapshot(path), its restore and read_object calls after it reuse one plugin (its client
    and connections), kept open between them; with ``keep_open_secs=0`` each makes its own and
    closes it."""
    state = mixed_state(5)
    url, options = s3_bucket.url(), s3_bucket.storage_options
    Snapshot.take(url, state, storage_options=options)
    del s3_plugins_made[:]
    snap = Snapshot(url, storage_options=options)
    snap.restore(empty_like(state))
    assert torch.equal(snap.read_object("0/model/bias"), state["model"]["bias"])
    assert torch.equal(snap.read_object("0/model/steps"), state["model"]["steps"])
    assert len(s3_plugins_made) == 1 and _session_open(s3_plugins_made[0])
    # Other options are another key: not shared.
    Snapshot(url, storage_options={**options, "max_concurrent_requests": 4})
    assert len(s3_plugins_made) == 2

    closing = Options(keep_open_secs=0)
    del s3_plugins_made[:]
    # Takes the kept one, then closes it.
    snap = Snapshot(url, storage_options=options, options=closing)
    snap.read_object("0/model/bias", options=closing)
    snap.read_object("0/model/bias", options=closing)
    assert len(s3_plugins_made) == 2
    assert not any(_session_open(p) for p in s3_plugins_made)


def test_a_kept_s3_plugin_is_closed_after_its_time(s3_bucket: S3Bucket, s3_plugins_made):
    state = mixed_state(6)
    url, options = s3_bucket.url(), s3_bucket.storage_options
    Snapshot.take(url, state, storage_options=options)
    briefly = Options(keep_open_secs=1)
    del s3_plugins_made[:]
    Snapshot(url, storage_options=options, options=briefly).restore(
        empty_like(state), options=briefly
    )
    (plugin,) = s3_plugins_made
    assert _session_open(plugin)
    deadline = time.monotonic() + 10
    while _session_open(plugin) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _session_open(plugin)
    Snapshot(url, storage_options=options, options=briefly)  # so a new one is made
    assert len(s3_plugins_made) == 2


def test_a_reused_s3_plugin_forgets_the_object_sizes_it_saw(s3_bucket: S3Bucket, s3_plugins_made):
    state = mixed_state(7)
    url, options = s3_bucket.url(), s3_bucket.storage_options
    Snapshot.take(url, state, storage_options=options)
    del s3_plugins_made[:]
    Snapshot(url, storage_options=options).restore(empty_like(state))
    (plugin,) = s3_plugins_made
    assert plugin._sizes  # learned from the ranged reads' answers
    Snapshot(url, storage_options=options)  # the same plugin, for a new operation
    assert len(s3_plugins_made) == 1 and not plugin._sizes


def test_a_failed_operation_does_not_keep_its_s3_plugin(s3_bucket: S3Bucket, s3_plugins_made):
    with pytest.raises(SnapshotNotFoundError):
        Snapshot(s3_bucket.url("nothing"), storage_options=s3_bucket.storage_options)
    (plugin,) = s3_plugins_made
    assert not _session_open(plugin)


def test_kept_s3_plugins_are_closed_at_exit(s3_bucket: S3Bucket):
    """A process that exits with a plugin kept open closes it (its HTTP session) on the way
    out. The script's own exit hook, registered before the library's, runs after it."""
    url, options = s3_bucket.url(), s3_bucket.storage_options
    Snapshot.take(url, mixed_state(8), storage_options=options)
    script = """
import atexit, json, sys
made = []
is_open = lambda: [getattr(p.fs, "_s3", None) is not None for p in made]
atexit.register(lambda: print("at exit", is_open()))
from snapshot import Snapshot
from storage_plugins.s3 import S3StoragePlugin
init = S3StoragePlugin.__init__
def counting_init(self, *args, **kwargs):
    init(self, *args, **kwargs)
    made.append(self)
S3StoragePlugin.__init__ = counting_init
url, options = json.loads(sys.argv[1])
Snapshot(url, storage_options=options).read_object("0/model/bias")
print("after the read", is_open())
"""
    done = subprocess.run(
        [sys.executable, "-c", script, json.dumps([url, options])],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(ROOT),
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["after the read [True]", "at exit [False]"]


def test_listing_pages_past_a_thousand_names(s3_bucket: S3Bucket):
    """A checkpoint manager's root may hold more step folders than one ListObjectsV2 page."""

    async def fill_and_list() -> list[str] | None:
        plugin = S3StoragePlugin(s3_bucket.url("root"), s3_bucket.storage_options)
        try:
            await asyncio.gather(
                *(plugin.write(f"step_{i:010d}/m", [b"x"]) for i in range(1003)),
                *(plugin.write(f"blob{i}", [b"y"]) for i in range(2)),
            )
            return await plugin.list_names(1_000_000)
        finally:
            await plugin.close()

    names = asyncio.run(fill_and_list())
    assert names is not None and len(names) == 1005
    assert {f"step_{i:010d}" for i in range(1003)} | {"blob0", "blob1"} == set(names)


def test_a_missing_bucket_is_one_clear_error(s3_server):
    """A take into a bucket that does not exist, and ``Snapshot(path)`` of one, each raise one
    ``StorageError`` naming the bucket; nothing else reaches stderr (no retry warnings, no
    unclosed HTTP session at exit). The take's path checks are one listing, which fails: no
    request asks for a marker file (HEAD requests would be held back at the server, and
    still under way when the take fails)."""
    from tests.s3server import Fault

    missing = "no-such-bucket-here"
    fault = s3_server.add_fault(
        Fault(match=lambda r: r.bucket == missing and r.method == "HEAD", status=0, delay=0.3,
              times=None)
    )  # fmt: skip
    script = """
import json, sys, time
import torch
from snapshot import Snapshot, SnapshotError
url, options = json.loads(sys.argv[1])
for attempt in (
    lambda: Snapshot.take(url, {"m": torch.nn.Linear(2, 2)}, storage_options=options),
    lambda: Snapshot(url, storage_options=options).restore({"m": torch.nn.Linear(2, 2)}),
):
    try:
        attempt()
    except SnapshotError as e:
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
time.sleep(1)  # the held-back checks end meanwhile
"""
    url = f"s3://{missing}/run/step-1"
    try:
        done = subprocess.run(
            [sys.executable, "-c", script, json.dumps([url, s3_server.storage_options()])],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=str(ROOT),
        )
    finally:
        s3_server.clear_faults()
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 2, done.stderr
    for line in lines:
        assert line.startswith("StorageError: "), done.stderr
        assert f"S3 bucket {missing!r} does not exist" in line, line
    assert fault.hits == 0  # the listing answered for the marker files
