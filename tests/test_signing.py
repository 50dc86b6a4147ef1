"""Signed snapshots (snapshot.signing, docs/signing.md): sign and verify with Ed25519 and
HMAC-SHA256, each kind of tampering refused naming the file, a wrong key, an unsigned snapshot
refused by restore with its targets untouched, incremental snapshots verified through their
bases, the CLI's sign and verify --signature, and S3."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import pytest
import torch

import manifest as mf
from snapshot import CheckpointManager, CorruptSnapshotError, Options, Snapshot, StateDict
from snapshot.cli import main
from snapshot.signing import SignatureError, SigningKey, UnsignedSnapshotError, sign, verify

SECRET = b"a shared secret of enough bytes"


def _state(seed: float = 0.0) -> dict[str, StateDict]:
    return {
        "m": StateDict(
            w=torch.arange(4096.0) + seed, b=torch.ones(64, dtype=torch.bfloat16), step=7
        )
    }


@pytest.fixture
def snap(tmp_path: Path) -> str:
    path = str(tmp_path / "step_1")
    Snapshot.take(path, _state())
    return path


@pytest.fixture
def ed_keys(tmp_path: Path) -> tuple[Path, Path]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    private = Ed25519PrivateKey.generate()
    priv_file, pub_file = tmp_path / "key.pem", tmp_path / "key.pub.pem"
    priv_file.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    pub_file.write_bytes(
        private.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return priv_file, pub_file


def _blobs(path: str) -> list[str]:
    return sorted(
        str(p.relative_to(path))
        for p in Path(path).rglob("*")
        if p.is_file() and p.parent.name.isdigit()
    )


def _flip(file: Path, at: int) -> None:
    data = bytearray(file.read_bytes())
    data[at] ^= 0x01
    file.write_bytes(bytes(data))


def test_sign_and_verify_with_ed25519_pem_files(snap, ed_keys):
    private, public = ed_keys
    statement = sign(snap, private)
    assert (Path(snap) / "manifest.sig.json").is_file()
    assert statement["_type"] == "https://in-toto.io/Statement/v1"
    assert [b["name"] for b in statement["predicate"]["blobs"]] == _blobs(snap)
    assert verify(snap, public) == statement
    assert verify(snap, private) == statement  # a private key verifies too
    with pytest.raises(Exception, match="needs a private key"):
        sign(snap, public)


def test_sign_and_verify_with_hmac_and_raw_ed25519(snap):
    sign(snap, SigningKey.hmac(SECRET))
    verify(snap, SECRET)  # bytes that are no PEM: an HMAC secret
    raw = bytes(range(32))
    sign(snap, SigningKey.ed25519(raw, private=True))
    public = SigningKey.ed25519(raw, private=True).public
    verify(snap, public)


def test_a_changed_manifest_byte_is_refused_naming_the_manifest(snap):
    sign(snap, SECRET)
    manifest = Path(snap) / "manifest.yaml"
    original = manifest.read_bytes()
    # One byte flipped: the manifest's own checksum line fails, and the signature says so.
    _flip(manifest, len(original) // 2)
    with pytest.raises(SignatureError, match="manifest.yaml changed") as e:
        verify(snap, SECRET)
    assert e.value.file.endswith("manifest.yaml")
    # A change made as a forger would, with the checksum line recomputed: still refused.
    loaded = mf.loads(original, source="m", verify=True)
    loaded.metadata["note"] = "x"
    manifest.write_bytes(mf.dumps(loaded))
    with pytest.raises(SignatureError, match="manifest.yaml changed.*SHA-256") as e:
        verify(snap, SECRET)
    assert e.value.file.endswith("manifest.yaml")


def test_a_flipped_blob_byte_is_refused_naming_the_blob(snap):
    sign(snap, SECRET)
    blob = _blobs(snap)[0]
    _flip(Path(snap) / blob, 3)
    with pytest.raises(SignatureError, match=f"blob {blob} changed") as e:
        verify(snap, SECRET)
    assert e.value.file.endswith(blob)
    assert isinstance(e.value, CorruptSnapshotError)


def test_a_longer_or_missing_blob_is_refused_naming_it(snap):
    sign(snap, SECRET)
    blob = Path(snap) / _blobs(snap)[0]
    data = blob.read_bytes()
    blob.write_bytes(data + b"\0")
    with pytest.raises(
        SignatureError, match=f"holds {len(data) + 1:,} bytes, {len(data):,} were"
    ) as e:
        verify(snap, SECRET)
    assert e.value.file == str(blob)
    blob.unlink()
    with pytest.raises(SignatureError, match="cannot be read") as e:
        verify(snap, SECRET)
    assert e.value.file == str(blob)
    target = _state(seed=9.0)
    with pytest.raises(SignatureError):
        Snapshot(snap).restore(target, verify_key=SECRET)
    assert torch.equal(target["m"]["w"], torch.arange(4096.0) + 9.0)


def test_a_changed_signature_file_is_refused(snap, ed_keys):
    private, public = ed_keys
    sign(snap, private)
    sig = Path(snap) / "manifest.sig.json"
    document = json.loads(sig.read_bytes())
    payload = bytearray(document["dsseEnvelope"]["payload"].encode())
    payload[10] = ord("A") if payload[10] != ord("A") else ord("B")
    document["dsseEnvelope"]["payload"] = payload.decode()
    sig.write_text(json.dumps(document))
    with pytest.raises(SignatureError, match="does not verify|damaged") as e:
        verify(snap, public)
    assert e.value.file.endswith("manifest.sig.json")
    _flip(sig, 5)  # not JSON any more
    with pytest.raises(SignatureError, match="manifest.sig.json"):
        verify(snap, public)


def test_a_wrong_key_is_refused(snap, ed_keys):
    sign(snap, SECRET)
    with pytest.raises(SignatureError, match="wrong key"):
        verify(snap, b"another secret of enough bytes")
    with pytest.raises(SignatureError, match="wrong key"):
        verify(snap, ed_keys[1])
    # The right key id with a forged signature: refused by the signature itself.
    sign(snap, SigningKey.ed25519(bytes(32), private=True))
    sig = Path(snap) / "manifest.sig.json"
    document = json.loads(sig.read_bytes())
    other = SigningKey.ed25519(bytes(range(32)), private=True)
    document["dsseEnvelope"]["signatures"][0]["sig"] = base64.b64encode(other._sign(b"x")).decode()
    sig.write_text(json.dumps(document))
    with pytest.raises(SignatureError, match="does not verify"):
        verify(snap, SigningKey.ed25519(bytes(32), private=True))


def test_an_unsigned_snapshot_is_refused_and_restore_touches_nothing(snap):
    with pytest.raises(UnsignedSnapshotError, match="not signed"):
        verify(snap, SECRET)
    target = _state(seed=100.0)
    before = {k: v.clone() if torch.is_tensor(v) else v for k, v in target["m"].items()}
    with pytest.raises(UnsignedSnapshotError):
        Snapshot(snap).restore(target, verify_key=SECRET)
    for k, v in before.items():
        assert torch.equal(target["m"][k], v) if torch.is_tensor(v) else target["m"][k] == v
    # Signed with another key, or tampered: refused the same way.
    sign(snap, SECRET)
    with pytest.raises(SignatureError):
        Snapshot(snap).restore(target, verify_key=b"another secret of enough bytes")
    assert torch.equal(target["m"]["w"], before["w"])
    Snapshot(snap).restore(target, verify_key=SECRET)
    assert torch.equal(target["m"]["w"], torch.arange(4096.0))


def test_an_incremental_snapshot_signs_and_verifies_its_base(tmp_path):
    base, top = str(tmp_path / "step_1"), str(tmp_path / "step_2")
    Snapshot.take(base, _state(), options=Options(digests=True))
    state = _state()
    state["m"]["b"] = torch.zeros(64, dtype=torch.bfloat16)  # w reused from the base
    Snapshot.take(top, state, base=base)
    assert Snapshot(top).get_manifest() is not None
    statement = sign(top, SECRET)  # signs the unsigned base first
    assert [b["name"] for b in statement["predicate"]["bases"]] == ["step_1"]
    assert (Path(base) / "manifest.sig.json").is_file()
    verify(top, SECRET)
    target = _state(seed=5.0)
    Snapshot(top).restore(target, verify_key=SECRET)
    assert torch.equal(target["m"]["w"], torch.arange(4096.0))
    _flip(Path(base) / _blobs(base)[0], 1)
    with pytest.raises(SignatureError, match="base step_1 does not verify.*changed"):
        verify(top, SECRET)


def test_a_base_signed_again_is_refused(tmp_path):
    base, top = str(tmp_path / "step_1"), str(tmp_path / "step_2")
    Snapshot.take(base, _state(), options=Options(digests=True))
    Snapshot.take(top, _state(), base=base)
    sign(top, SECRET)
    sign(base, SECRET)  # a new signature file: the top's statement recorded the old one
    sig = Path(base) / "manifest.sig.json"
    document = json.loads(sig.read_bytes())
    sig.write_text(json.dumps(document, indent=4))  # same content, other bytes
    with pytest.raises(SignatureError, match="signed again or changed"):
        verify(top, SECRET)


def test_a_signed_step_is_part_of_the_snapshot_for_the_manager(capsys, tmp_path):
    manager = CheckpointManager(str(tmp_path))
    for step in (1, 2, 3):
        manager.save(step, _state(float(step)))
    manager.wait()
    steps = sorted(os.listdir(tmp_path))
    assert len(steps) == 3
    for step in steps:
        sign(str(tmp_path / step), SECRET)
    code = main(["steps", str(tmp_path), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert "left-alone" not in json.dumps(out), out
    code = main(["prune", str(tmp_path), "--keep-last", "1"])
    assert code == 0
    assert sorted(os.listdir(tmp_path)) == steps[-1:]


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_sign_and_verify_signature(capsys, snap, ed_keys):
    private, public = ed_keys
    code, out, err = _run(capsys, "sign", snap, "--key", str(private))
    assert code == 0 and out.startswith("sign: signed") and err == ""
    code, out, _ = _run(capsys, "verify", snap, "--signature", "--key", str(public))
    assert code == 0 and out.startswith("verify: OK: signature")
    code, out, _ = _run(capsys, "verify", snap, "--signature", "--key", str(public), "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"] and report["signed"] and report["problem"] is None
    assert report["blobs"] == len(_blobs(snap)) and report["algorithm"] == "ed25519"
    blob = _blobs(snap)[0]
    _flip(Path(snap) / blob, 0)
    code, out, _ = _run(capsys, "verify", snap, "--signature", "--key", str(public), "--json")
    report = json.loads(out)
    assert code == 1 and not report["ok"] and report["problem"]["file"].endswith(blob)
    code, out, err = _run(capsys, "verify", snap, "--signature", "--key", str(public))
    assert code == 1 and f"blob {blob} changed" in err
    code, out, _ = _run(capsys, "sign", snap, "--key", str(private), "--json")
    assert code == 0 and json.loads(out)["blobs"] == len(_blobs(snap))


def test_cli_verify_signature_of_an_unsigned_snapshot(capsys, snap, tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    code, out, _ = _run(capsys, "verify", snap, "--signature", "--key", str(secret), "--json")
    report = json.loads(out)
    assert code == 1 and not report["signed"] and "not signed" in report["problem"]["what"]
    code, _, err = _run(capsys, "verify", snap, "--signature")
    assert code == 2 and "--key" in err


def test_sign_and_verify_on_s3(s3_bucket):
    options = s3_bucket.storage_options
    url = s3_bucket.url()
    Snapshot.take(url, _state(), storage_options=options)
    sign(url, SECRET, storage_options=options, piece_bytes=1000)  # several pieces per blob
    verify(url, SECRET, storage_options=options, piece_bytes=1000)
    target = _state(seed=3.0)
    Snapshot(url, storage_options=options).restore(target, verify_key=SECRET)
    assert torch.equal(target["m"]["w"], torch.arange(4096.0))


def _restore_with_key(rank: int, world: int, path: str) -> str:
    # Rank 1 holds the wrong secret: its refusal stops rank 0 too, before any target changes.
    import torch.distributed as dist

    from snapshot import RankFailedError

    target = {"model": StateDict(w=torch.zeros(64, 64))}
    key = b"the right secret" if rank == 0 else b"a wrong secret"
    try:
        Snapshot(path, pg=dist.group.WORLD).restore(target, verify_key=key)
    except RankFailedError as e:
        assert torch.equal(target["model"]["w"], torch.zeros(64, 64))
        return str(e)
    return "restored"


def test_a_rank_that_refuses_the_signature_stops_every_rank(tmp_path):
    from tests.multirank import run_ranks

    path = str(tmp_path / "s")
    Snapshot.take(path, {"model": StateDict(w=torch.ones(64, 64))})
    sign(path, b"the right secret")
    for message in run_ranks(2, _restore_with_key, path):
        assert "restore: signature failed on rank(s) [1] of 2" in message
