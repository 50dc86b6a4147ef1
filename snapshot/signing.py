"""Signed snapshots: a detached signature over a snapshot's manifest and every blob it names.

A snapshot's manifest records a CRC-32 of every stored byte range, which finds damage but not a
deliberate change (a CRC-32 is forged in microseconds). :func:`sign` writes ``manifest.sig.json``
beside the manifest: an in-toto statement (subject: the manifest and its SHA-256; predicate: the
SHA-256 and size of every blob of the snapshot, and the SHA-256 of each base's manifest and
signature file for an incremental snapshot) in a DSSE envelope signed with Ed25519 (the optional
``cryptography`` package, the ``signing`` extra) or HMAC-SHA256 (a shared secret),
in the spirit of the OpenSSF model-signing format. :func:`verify` checks the signature, the
manifest's digest, every blob's digest (read in pieces through the storage plugin, so any store
works in bounded memory) and, transitively, every base's signature. docs/signing.md says what it
protects against and what not.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import os
from dataclasses import dataclass
from typing import Any

from manifest import reference_of
from snapshot._engine.format.manifest_io import checked_sibling, decode_manifest
from snapshot._engine.io.storage_calls import open_storage
from snapshot._engine.runtime import run
from snapshot._engine.take.commit import MANIFEST_NAME, SIGNATURE_NAME
from snapshot.errors import CorruptSnapshotError, InvalidArgumentError
from snapshot.options import Options, resolve

__all__ = [
    "SIGNATURE_NAME",
    "SignatureError",
    "SigningKey",
    "UnsignedSnapshotError",
    "sign",
    "verify",
]

PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://statesnap.dev/signature/v1"
MEDIA_TYPE = "application/vnd.statesnap.signature+json;version=1"
PIECE_BYTES = 8 << 20  # bytes of a blob read (and held) at once, per blob being hashed
JOBS = 4  # blobs hashed at once
_SIGNATURE_LIMIT = 256 << 20  # the most bytes of a signature file read


class SignatureError(CorruptSnapshotError):
    """A signed snapshot does not verify: ``file`` names what failed (the manifest, a blob, the
    signature file, or a base's), and the message says how."""

    def __init__(self, message: str, file: str = "") -> None:
        super().__init__(message)
        self.file = file


class UnsignedSnapshotError(SignatureError):
    """The snapshot (or one of its bases) has no signature file."""


@dataclass(frozen=True)
class SigningKey:
    """A key for :func:`sign` and :func:`verify`: ``algorithm`` is ``"ed25519"`` or
    ``"hmac-sha256"``; ``key_id`` is recorded in the signature and compared before checking it.

    Build one with :meth:`load` (PEM file or bytes: Ed25519; anything else: an HMAC secret),
    :meth:`hmac` or :meth:`ed25519` (raw 32-byte keys)."""

    algorithm: str
    key_id: str
    #: The key that signs: cryptography's Ed25519PrivateKey, or the HMAC secret (None: a
    #: public key, which only verifies).
    private: Any = None
    #: The key that verifies: cryptography's Ed25519PublicKey, or the HMAC secret.
    public: Any = None

    @classmethod
    def hmac(cls, secret: bytes) -> SigningKey:
        """A shared secret for HMAC-SHA256 (at least 16 bytes); its key id is a SHA-256 of it."""
        if not isinstance(secret, (bytes, bytearray)) or len(secret) < 16:
            raise InvalidArgumentError("an HMAC secret must be bytes, at least 16 of them")
        secret = bytes(secret)
        key_id = hashlib.sha256(b"statesnap hmac key id\0" + secret).hexdigest()[:16]
        return cls("hmac-sha256", key_id, secret, secret)

    @classmethod
    def ed25519(cls, raw: bytes, *, private: bool) -> SigningKey:
        """An Ed25519 key from its 32 raw bytes (``private``: a private key, which also
        verifies; else a public key, which only verifies)."""
        ed = _ed25519()
        if private:
            return cls._from_object(ed.Ed25519PrivateKey.from_private_bytes(raw))
        return cls._from_object(ed.Ed25519PublicKey.from_public_bytes(raw))

    @classmethod
    def load(cls, key: Any) -> SigningKey:
        """A key from ``key``: a :class:`SigningKey`; a cryptography Ed25519 key object; a path
        (``str`` or path-like) to a file, read as its bytes; bytes holding a PEM Ed25519 key
        (private or public); any other bytes as an HMAC secret."""
        if isinstance(key, SigningKey):
            return key
        if isinstance(key, (str, os.PathLike)):
            with open(key, "rb") as f:
                key = f.read()
        if isinstance(key, (bytes, bytearray)):
            data = bytes(key)
            if data.lstrip().startswith(b"-----BEGIN"):
                from cryptography.hazmat.primitives import serialization

                try:
                    if b"PRIVATE KEY" in data:
                        return cls._from_object(serialization.load_pem_private_key(data, None))
                    return cls._from_object(serialization.load_pem_public_key(data))
                except ValueError as e:
                    raise InvalidArgumentError(f"cannot read the PEM key: {e}") from None
            return cls.hmac(data)
        return cls._from_object(key)

    @classmethod
    def _from_object(cls, obj: Any) -> SigningKey:
        ed = _ed25519()
        if isinstance(obj, ed.Ed25519PrivateKey):
            return cls("ed25519", _ed_key_id(obj.public_key()), obj, obj.public_key())
        if isinstance(obj, ed.Ed25519PublicKey):
            return cls("ed25519", _ed_key_id(obj), None, obj)
        raise InvalidArgumentError(
            f"expected an Ed25519 key, a PEM file or bytes, or an HMAC secret, got {type(obj)}"
        )

    def _sign(self, data: bytes) -> bytes:
        if self.private is None:
            raise InvalidArgumentError(f"key {self.key_id} is a public key: it cannot sign")
        if self.algorithm == "hmac-sha256":
            return hmac.new(self.private, data, hashlib.sha256).digest()
        return bytes(self.private.sign(data))

    def _verifies(self, data: bytes, signature: bytes) -> bool:
        if self.algorithm == "hmac-sha256":
            return hmac.compare_digest(
                hmac.new(self.public, data, hashlib.sha256).digest(), signature
            )
        from cryptography.exceptions import InvalidSignature

        try:
            self.public.verify(signature, data)
        except InvalidSignature:
            return False
        return True


def _ed25519() -> Any:
    try:
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:  # pragma: no cover - the extra is not installed
        raise InvalidArgumentError(
            "Ed25519 keys need the cryptography package (the signing extra of statesnap)"
        ) from None
    return ed25519


def _ed_key_id(public: Any) -> str:
    from cryptography.hazmat.primitives import serialization

    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def _pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE's pre-authentication encoding: what the signature covers."""
    kind = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(kind), kind, len(payload), payload)


# ---------------------------------------------------------------------------------------------
# Reading what is signed.


async def _hash_blob(plugin: Any, blob: str, size: int, piece: int, whole: bool) -> tuple[str, int]:
    """SHA-256 of blob ``blob``'s bytes [0, size) read in pieces of ``piece`` (``whole``: of
    every byte the store holds, when it can tell how many), and the size the store reports
    (``size`` when it cannot tell)."""
    stored = await plugin.size(blob)
    if whole and stored is not None:
        size = int(stored)
    h = hashlib.sha256()
    buf = bytearray(min(piece, max(size, 1)))
    offset = 0
    while offset < size:
        n = min(len(buf), size - offset)
        view = memoryview(buf)[:n]
        await plugin.read_into(blob, offset, view)
        await asyncio.to_thread(h.update, view)
        offset += n
    return h.hexdigest(), size if stored is None else int(stored)


def _hash_blobs(
    path: str,
    sizes: dict[str, int],
    storage_options: dict[str, Any] | None,
    options: Options,
    piece: int,
    whole: bool = False,
) -> dict[str, tuple[str, int]]:
    """blob -> (SHA-256, stored size) for ``sizes`` (blob -> bytes to hash; ``whole``: every
    byte stored), ``JOBS`` at once. A blob that cannot be read raises ``SignatureError``."""
    with open_storage(path, storage_options, options) as plugin:

        async def one(sem: asyncio.Semaphore, blob: str, size: int) -> tuple[str, tuple[str, int]]:
            async with sem:
                try:
                    return blob, await _hash_blob(plugin, blob, size, piece, whole)
                except (OSError, EOFError, ValueError) as e:
                    raise SignatureError(
                        f"snapshot {path}: blob {blob} cannot be read whole ({size:,} bytes "
                        f"signed): {e}",
                        f"{path.rstrip('/')}/{blob}",
                    ) from None

        async def every() -> list[tuple[str, tuple[str, int]]]:
            sem = asyncio.Semaphore(JOBS)  # made on the I/O loop
            return await asyncio.gather(*(one(sem, b, s) for b, s in sorted(sizes.items())))

        return dict(run(every()))


def _own_blobs(manifest_bytes: bytes, where: str) -> tuple[dict[str, int], tuple[str, ...]]:
    """The blobs the manifest records in this snapshot (blob -> recorded length) and the names
    of its bases."""
    manifest = decode_manifest(manifest_bytes, where, verify=False)
    own = {b: n for b, n in manifest.blob_sizes.items() if reference_of(b) is None}
    return own, manifest.bases


# ---------------------------------------------------------------------------------------------
# Signing and verifying.


def sign(
    path: str,
    key: Any,
    *,
    storage_options: dict[str, Any] | None = None,
    options: Options | None = None,
    piece_bytes: int = PIECE_BYTES,
) -> dict[str, Any]:
    """Signs the committed snapshot at ``path`` with ``key`` (see :meth:`SigningKey.load`; a
    private key): hashes the manifest and every blob of the snapshot (each read once, in pieces
    of ``piece_bytes``) and writes ``manifest.sig.json`` beside the manifest, replacing one
    there. An incremental snapshot's bases are signed first when unsigned, and verified with
    ``key`` when signed; the statement binds their manifests' and signatures' digests.

    ``storage_options`` go to the storage plugin, as for ``Snapshot``; ``options``: the
    tunables (:class:`~snapshot.Options`) of the reads and the write.

    Returns the statement signed (a dict).

    Raises:
        SnapshotNotFoundError: no committed snapshot at ``path``.
        SignatureError: a base's signature does not verify with ``key``, or a blob cannot be
            read whole.
        InvalidArgumentError: ``key`` is not a usable private key.
    """
    signing_key = SigningKey.load(key)
    if signing_key.private is None:
        raise InvalidArgumentError(
            f"signing needs a private key; key {signing_key.key_id} is public"
        )
    resolved = resolve(options)
    return _sign(path, signing_key, storage_options, resolved, piece_bytes, set())


def _manifest_bytes(path: str, storage_options: dict[str, Any] | None, options: Options) -> bytes:
    from snapshot._engine.format.manifest_io import read_manifest

    found, where = read_manifest(path, storage_options, options)
    if not isinstance(found, bytes):
        raise InvalidArgumentError(
            f"{where} is another library's checkpoint; only a statesnap snapshot is signed"
        )
    return found


def _sign(
    path: str,
    key: SigningKey,
    storage_options: dict[str, Any] | None,
    options: Options,
    piece: int,
    seen: set[str],
) -> dict[str, Any]:
    data = _manifest_bytes(path, storage_options, options)
    own, bases = _own_blobs(data, path)
    based = []
    for name in bases:
        where = checked_sibling(path, name)
        if where not in seen:
            seen.add(where)
            try:
                _verify(where, key, storage_options, options, piece, set())
            except UnsignedSnapshotError:
                _sign(where, key, storage_options, options, piece, seen)
        base_manifest = _manifest_bytes(where, storage_options, options)
        base_sig = _read(where, SIGNATURE_NAME, storage_options, options)
        assert base_sig is not None
        based.append(
            {
                "name": name,
                "digest": {"sha256": hashlib.sha256(base_manifest).hexdigest()},
                "signature": {"sha256": hashlib.sha256(base_sig).hexdigest()},
            }
        )
    hashed = _hash_blobs(path, own, storage_options, options, piece, whole=True)
    statement = {
        "_type": STATEMENT_TYPE,
        "subject": [
            {"name": MANIFEST_NAME, "digest": {"sha256": hashlib.sha256(data).hexdigest()}}
        ],
        "predicateType": PREDICATE_TYPE,
        "predicate": {
            "blobs": [
                {"name": b, "size": size, "digest": {"sha256": digest}}
                for b, (digest, size) in sorted(hashed.items())
            ],
            "bases": based,
        },
    }
    payload = json.dumps(statement, sort_keys=True, separators=(",", ":")).encode()
    signature = key._sign(_pae(PAYLOAD_TYPE, payload))
    document = {
        "mediaType": MEDIA_TYPE,
        "verificationMaterial": {"algorithm": key.algorithm, "keyid": key.key_id},
        "dsseEnvelope": {
            "payloadType": PAYLOAD_TYPE,
            "payload": base64.b64encode(payload).decode(),
            "signatures": [{"keyid": key.key_id, "sig": base64.b64encode(signature).decode()}],
        },
    }
    text = (json.dumps(document, indent=2) + "\n").encode()
    with open_storage(path, storage_options, options) as plugin:
        run(plugin.write(SIGNATURE_NAME, [text]))
    return statement


def _read(
    path: str, name: str, storage_options: dict[str, Any] | None, options: Options
) -> bytes | None:
    with open_storage(path, storage_options, options) as plugin:
        try:
            return bytes(run(plugin.read_limited(name, _SIGNATURE_LIMIT)))
        except (FileNotFoundError, NotADirectoryError):
            return None


def verify(
    path: str,
    key: Any,
    *,
    storage_options: dict[str, Any] | None = None,
    options: Options | None = None,
    piece_bytes: int = PIECE_BYTES,
) -> dict[str, Any]:
    """Checks the signature of the snapshot at ``path`` with ``key`` (see
    :meth:`SigningKey.load`; a public key suffices for Ed25519), then the SHA-256 of its manifest
    and of every blob (each read once, in pieces of ``piece_bytes``), and every base's signature
    and manifest digest, transitively. ``storage_options`` and ``options`` as for :func:`sign`.
    Returns the statement verified (a dict).

    Raises:
        UnsignedSnapshotError: no signature file (on the snapshot or a base).
        SignatureError: the signature file is changed or damaged, made with another key, or the
            manifest, a blob or a base differs from what was signed (``file`` names it).
        SnapshotNotFoundError: no committed snapshot at ``path``.
    """
    return _verify(
        path, SigningKey.load(key), storage_options, resolve(options), piece_bytes, set()
    )


def _verify(
    path: str,
    key: SigningKey,
    storage_options: dict[str, Any] | None,
    options: Options,
    piece: int,
    seen: set[str],
) -> dict[str, Any]:
    manifest_file = f"{path.rstrip('/')}/{MANIFEST_NAME}"
    damaged: CorruptSnapshotError | None = None
    try:
        data = _manifest_bytes(path, storage_options, options)
    except CorruptSnapshotError as e:  # its checksum line fails: told once the signature holds
        damaged, data = e, b""
    raw = _read(path, SIGNATURE_NAME, storage_options, options)
    sig_file = f"{path.rstrip('/')}/{SIGNATURE_NAME}"
    if raw is None:
        raise UnsignedSnapshotError(
            f"snapshot {path} is not signed: it has no {SIGNATURE_NAME} (statesnap sign makes one)",
            sig_file,
        )

    def bad(what: str, file: str = sig_file) -> SignatureError:
        return SignatureError(f"snapshot {path}: {what}", file)

    try:
        document = json.loads(raw)
        envelope = document["dsseEnvelope"]
        payload = base64.b64decode(envelope["payload"], validate=True)
        (entry,) = envelope["signatures"]
        signature = base64.b64decode(entry["sig"], validate=True)
        key_id, algorithm = entry["keyid"], document["verificationMaterial"]["algorithm"]
        payload_type = envelope["payloadType"]
    except (ValueError, KeyError, TypeError) as e:
        raise bad(
            f"the signature file {SIGNATURE_NAME} is damaged or not one statesnap writes ({e!r})"
        ) from None
    if algorithm != key.algorithm or key_id != key.key_id:
        raise bad(
            f"signed with {algorithm} key {key_id}, but the key given is {key.algorithm} key "
            f"{key.key_id}: a wrong key, or a changed signature file"
        )
    if not key._verifies(_pae(str(payload_type), payload), signature):
        raise bad(
            f"the signature in {SIGNATURE_NAME} does not verify with key {key.key_id}: the "
            "signature file was changed, or signed with another key"
        )
    statement = json.loads(payload)  # signed: written by a holder of the key
    if statement.get("_type") != STATEMENT_TYPE or statement.get("predicateType") != PREDICATE_TYPE:
        raise bad("the signed statement is not a statesnap snapshot signature")
    (subject,) = statement["subject"]
    if damaged is not None:
        raise bad(f"{MANIFEST_NAME} changed since it was signed: {damaged}", manifest_file)
    digest = hashlib.sha256(data).hexdigest()
    if subject["name"] != MANIFEST_NAME or subject["digest"]["sha256"] != digest:
        raise bad(
            f"{MANIFEST_NAME} changed since it was signed: its SHA-256 is {digest}, the "
            f"signature records {subject['digest']['sha256']}",
            manifest_file,
        )
    own, bases = _own_blobs(data, path)
    predicate = statement["predicate"]
    signed_bases = {b["name"]: b for b in predicate["bases"]}
    if set(signed_bases) != set(bases):
        raise bad(f"the signature names bases {sorted(signed_bases)}, the manifest {list(bases)}")
    for name in bases:
        where = checked_sibling(path, name)
        if where not in seen:
            seen.add(where)
            try:
                _verify(where, key, storage_options, options, piece, seen)
            except SignatureError as e:
                raise SignatureError(
                    f"snapshot {path}: its base {name} does not verify: {e}", e.file
                ) from None
        base_manifest = _manifest_bytes(where, storage_options, options)
        base_sig = _read(where, SIGNATURE_NAME, storage_options, options) or b""
        recorded = signed_bases[name]
        if (
            recorded["digest"]["sha256"] != hashlib.sha256(base_manifest).hexdigest()
            or recorded["signature"]["sha256"] != hashlib.sha256(base_sig).hexdigest()
        ):
            raise bad(
                f"its base {name} was signed again or changed since this snapshot was signed",
                f"{where}/{MANIFEST_NAME}",
            )
    signed = {b["name"]: b for b in predicate["blobs"]}
    if set(signed) != set(own):
        missing = sorted(set(own) - set(signed))
        raise bad(f"the manifest names blobs the signature does not cover: {missing[:5]}")
    sizes = {b: int(signed[b]["size"]) for b in own}
    hashed = _hash_blobs(path, sizes, storage_options, options, piece)
    for blob in sorted(own):
        found, stored = hashed[blob]
        if stored != sizes[blob]:
            raise bad(
                f"blob {blob} holds {stored:,} bytes, {sizes[blob]:,} were signed",
                f"{path.rstrip('/')}/{blob}",
            )
        if found != signed[blob]["digest"]["sha256"]:
            raise bad(
                f"blob {blob} changed since it was signed: its SHA-256 is {found}, the "
                f"signature records {signed[blob]['digest']['sha256']}",
                f"{path.rstrip('/')}/{blob}",
            )
    return dict(statement)
