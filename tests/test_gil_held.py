"""The steps a take or a restore repeats per tensor keep the GIL: CRCs of small buffers while
another thread keeps the GIL busy (``checksum.crc32_held``, ``crc32_each``), the copies of small payloads into staging buffers
(``stage._memmove``) and the negation and conjugation bits (``tensor_memory.negated``,
``conjugated``). Each gives the same answer as the call it replaces; how much faster they are
beside a busy thread is measured by ``benchmarks/busy_thread.py``."""

from __future__ import annotations

import ctypes
import math
import random
import sys
import threading
import time
import zlib

import pytest
import torch

from snapshot._engine.format import checksum
from snapshot._engine.format.checksum import HELD_BYTES, HOLD_MAX_BYTES, crc32_each, crc32_held
from snapshot._engine.io import stage
from snapshot._engine.io.tensor_memory import beside_others, conjugated, negated

SIZES = [
    0,
    1,
    HELD_BYTES - 1,
    HELD_BYTES,
    HELD_BYTES + 1,
    10 << 10,
    10_440,
    4 * HELD_BYTES,
    4 * HELD_BYTES + 1,
    HOLD_MAX_BYTES,
    HOLD_MAX_BYTES + 1,
    1 << 20,
]


@pytest.fixture(params=["plain", "held"])
def mode(request, monkeypatch):
    """The CRCs as taken with the GIL idle, and as taken once a wait for it was seen."""
    monkeypatch.setattr(checksum, "_held_until", math.inf if request.param == "held" else 0.0)
    monkeypatch.setattr(checksum, "_WAITED", math.inf if request.param == "plain" else 0.8)
    return request.param


def _views(sizes: list[int], seed: int = 0) -> list[memoryview]:
    rng = random.Random(seed)
    return [memoryview(bytearray(rng.randbytes(n))) for n in sizes]


@pytest.mark.parametrize("n", SIZES)
def test_crc32_held_equals_zlib(n, mode):
    (view,) = _views([n], seed=n)
    assert crc32_held(view) == zlib.crc32(view)
    assert crc32_held(view, 0x1234_5678) == zlib.crc32(view, 0x1234_5678)
    # Data that is not a byte view goes to the CRC as it is.
    assert crc32_held(bytes(view)) == zlib.crc32(view)
    if n % 4 == 0:
        words = view.cast("I")
        assert crc32_held(words) == zlib.crc32(view)


@pytest.mark.parametrize(
    "sizes",
    [
        [],
        [100, 0, 4096],
        [10_440] * 50,  # a slab's members: the C-level passes, in runs
        [0, 10_440, 7, HELD_BYTES + 1, 4 * HELD_BYTES],
        [3, 4 * HELD_BYTES + 1, 10_440],  # one too long for the passes: view by view
        [HOLD_MAX_BYTES + 1, 10],
    ],
)
def test_crc32_each_equals_zlib(sizes, mode):
    views = _views(sizes, seed=len(sizes))
    assert crc32_each(views) == [zlib.crc32(v) for v in views]


def test_no_crc_call_over_the_held_size_for_buffers_that_keep_the_gil(monkeypatch):
    """isal keeps the GIL for at most ``HELD_BYTES`` bytes: once a wait was seen, every call
    the two functions make for buffers of at most ``HOLD_MAX_BYTES`` stays within that; a
    longer buffer is one call."""
    monkeypatch.setattr(checksum, "_held_until", math.inf)
    lengths: list[int] = []
    raw = checksum.crc32

    def recording(data, value=0):
        lengths.append(len(data) * getattr(data, "itemsize", 1))
        return raw(data, value)

    monkeypatch.setattr(checksum, "crc32", recording)
    small = _views([HELD_BYTES + 1, 10_440, 4 * HELD_BYTES, HOLD_MAX_BYTES, 17], seed=3)
    for view in small:
        assert crc32_held(view) == zlib.crc32(view)
    assert crc32_each(small) == [zlib.crc32(v) for v in small]
    assert crc32_each(small[1:3] * 20) == [zlib.crc32(v) for v in small[1:3] * 20]
    assert lengths and max(lengths) <= HELD_BYTES
    lengths.clear()
    (large,) = _views([HOLD_MAX_BYTES + 1])
    assert crc32_held(large) == zlib.crc32(large)
    assert lengths == [HOLD_MAX_BYTES + 1]


def test_a_crc_that_waited_turns_the_pieces_on(monkeypatch):
    """Two runs of CRCs in a row that each took longer than a wait for the GIL make the next
    ones keep it (in pieces of at most ``HELD_BYTES``) for a while; one such run alone (the
    library's own threads can make it) or none leaves them whole calls. A single CRC that
    waited is enough."""
    monkeypatch.setattr(checksum, "_held_until", 0.0)
    lengths: list[int] = []
    raw = checksum.crc32
    waits: set[int] = set()  # the calls, counted from 0, that wait
    run_wait = 1.5 * checksum._RUN_WAITED * sys.getswitchinterval()  # as waits for the GIL

    def recording(data, value=0):
        if len(lengths) in waits:
            time.sleep(run_wait)
        lengths.append(len(data))
        return raw(data, value)

    monkeypatch.setattr(checksum, "crc32", recording)
    run = checksum._RUN
    views = _views([10_440] * (3 * run), seed=5)
    assert crc32_each(views) == [zlib.crc32(v) for v in views]
    assert max(lengths) == 10_440 and checksum._held_until == 0.0  # no wait: whole calls
    lengths.clear()
    waits.update({0, 2 * run})  # the first and third runs wait, not two in a row
    assert crc32_each(views) == [zlib.crc32(v) for v in views]
    assert lengths == [10_440] * (3 * run) and checksum._held_until == 0.0
    lengths.clear()
    waits.clear()
    waits.update({0, run})  # the first two runs wait
    assert crc32_each(views) == [zlib.crc32(v) for v in views]
    # The first two runs waited, as whole calls; the third kept the GIL, in pieces.
    assert lengths[: 2 * run] == [10_440] * (2 * run)
    assert max(lengths[2 * run :]) <= HELD_BYTES
    assert checksum._held_until > time.perf_counter()
    monkeypatch.setattr(checksum, "_held_until", 0.0)
    lengths.clear()
    waits.clear()
    waits.add(0)
    (one,) = _views([10_440])
    assert crc32_held(one) == zlib.crc32(one)  # it waited, as one call
    assert lengths == [10_440] and checksum._held_until > time.perf_counter()
    lengths.clear()
    assert crc32_held(one) == zlib.crc32(one)
    assert len(lengths) == 3 and max(lengths) <= HELD_BYTES


def test_range_digest_of_slab_members_matches_zlib(mode):
    """A read's digest of a slab's members, with padding between them, through the held CRCs
    (``many`` in calls of a few members, and piece by piece)."""
    members = _views([10_440] * 30 + [HELD_BYTES * 5], seed=7)
    pad = memoryview(bytes(8))
    pieces: list[memoryview] = []
    ranges: list[tuple[int, int]] = []
    pos = 0
    for m in members:
        ranges.append((pos, len(m)))
        pieces += [m, pad]
        pos += len(m) + len(pad)
    want = [zlib.crc32(m) for m in members]
    segments = ([len(p) for p in pieces], [i % 2 == 0 for i in range(len(pieces))])
    told = checksum.RangeDigest(ranges, segments)
    for at in range(0, len(pieces), 7):
        told.many(pieces[at : at + 7])
    assert told.values == want
    searched = checksum.RangeDigest(ranges)
    searched.many(pieces[:10])
    for piece in pieces[10:]:
        searched(piece)
    assert searched.values == want


def _tensors() -> list[torch.Tensor]:
    real = torch.arange(6.0)
    cplx = torch.randn(4, dtype=torch.complex64)
    neg = torch._neg_view(real)
    return [
        real,
        real.detach(),
        torch.nn.Parameter(real.clone()),
        neg,
        neg.detach(),
        neg.resolve_neg(),
        neg.clone(),
        cplx,
        cplx.conj(),
        cplx.conj().detach(),
        cplx.conj().resolve_conj(),
        cplx.conj().imag,  # a negated view of a conjugate's imaginary parts
        cplx.conj()[1:],
        torch.empty(0),
    ]


def test_negated_and_conjugated_agree_with_torch():
    tensors = _tensors()
    assert [negated(t) for t in tensors] == [t.is_neg() for t in tensors]
    assert [conjugated(t) for t in tensors] == [t.is_conj() for t in tensors]
    # Both answers occur, so the comparison above tells them apart.
    assert {negated(t) for t in tensors} == {True, False}
    assert {conjugated(t) for t in tensors} == {True, False}


def test_small_copies_keep_the_gil_and_copy_exactly():
    """``_memmove_held`` is typed to keep the GIL (ctypes' flag for it), and ``_memmove``
    copies small and large payloads alike."""
    assert stage._memmove_held._flags_ & ctypes._FUNCFLAG_PYTHONAPI  # type: ignore[attr-defined]
    for n in (1, 10_440, HOLD_MAX_BYTES, HOLD_MAX_BYTES + 1):
        src = torch.randint(0, 256, (n,), dtype=torch.uint8)
        dst = torch.zeros(n + 16, dtype=torch.uint8)
        stage._memmove(dst.data_ptr() + 8, src.data_ptr(), n)
        assert torch.equal(dst[8 : 8 + n], src)
        assert not dst[:8].any() and not dst[8 + n :].any()
        data = bytes(src.tolist())
        stage._memmove(dst.data_ptr(), data, n)
        assert bytes(dst[:n].tolist()) == data


def test_the_busy_thread_benchmark_runs(capsys, tmp_path):
    """``benchmarks/busy_thread.py`` at a small size: every call and step is timed both ways
    (the restore is checked bitwise by the script) and printed."""
    from benchmarks import busy_thread

    busy_thread.main(["--count", "200", "--reps", "1", "--dir", str(tmp_path)])
    out = capsys.readouterr().out
    for name in ("statesnap take", "torch.save", "statesnap restore", "torch.load"):
        assert f"| {name} |" in out
    for name in ("crc32 (isal)", "crc32_each", "Tensor.is_neg()", "negated"):
        assert f"| {name} |" in out
    assert list(tmp_path.iterdir()) == []  # the scratch directory is removed


def test_a_thread_of_the_application_is_one_beside_the_library(monkeypatch):
    """``beside_others``: any live thread but the caller's and those named ``statesnap-*``."""
    me = threading.current_thread()
    ours = threading.Thread(name="statesnap-io")
    theirs = threading.Thread(name="pin_memory")
    monkeypatch.setattr(threading, "enumerate", lambda: [me, ours])
    assert not beside_others()
    monkeypatch.setattr(threading, "enumerate", lambda: [me, ours, theirs])
    assert beside_others()
