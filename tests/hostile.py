"""A corpus of hostile snapshots, built by code (docs/reliability.md, "Threat model").

Each :class:`Case` starts from a real snapshot taken by the library and changes it the way an
attacker (a tarball, an upload, a forged manifest) or an unlucky store could: a blob or folder
that is a symlink out of the root, a manifest that is a device or a FIFO, a manifest whose YAML
expands, a length claimed over a short blob, nesting past any limit, a pickle that runs code.
Forged manifests get their checksum line recomputed (``seal_manifest``), so that what is tested
is the decoder, not the CRC trailer (which detects damage, not forgery).

Every outside file holds :data:`SECRET`: a probe (``tests/hostile_probe.py``) checks that those
bytes never come back in any value it reads.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from snapshot import Options, Snapshot, StateDict
from snapshot.sharding import ShardedTensor
from tests.helpers import seal_manifest

MANIFEST = "manifest.yaml"
# Distinctive bytes that fill every file outside a snapshot's root.
SECRET = b"OUTSIDE-THE-ROOT-SECRET:"

# The keys every probe reads; the hostile change targets one of them.
TENSOR_KEY = "0/model/w"
OBJECT_KEY = "0/extra/obj"
SHARDED_KEY = "0/sharded/w"


def base_state() -> dict[str, StateDict]:
    """A small state with a tensor and an object that each live in a blob of their own (the
    slab threshold is lowered when it is taken), plus values kept in the manifest."""
    return {
        "model": StateDict(w=torch.arange(4096, dtype=torch.float32), b=torch.ones(3)),
        "extra": StateDict(step=7, name="run", obj={1, 2, 3}),
        "sharded": StateDict(
            w=ShardedTensor.from_rank_offsets("w", torch.arange(16.0).reshape(4, 4))
        ),
    }


def take_base(root: Path) -> None:
    Snapshot.take(str(root), base_state(), options=Options(slab_threshold_bytes=16))


@dataclass
class Workspace:
    """A fresh copy of the base snapshot at ``root``, and a folder outside it."""

    root: Path
    outside: Path

    def manifest_text(self) -> str:
        body = (self.root / MANIFEST).read_bytes()
        return body[: body.rindex(b"# crc32")].decode()

    def write_manifest(self, text: str) -> None:
        """Replaces the manifest with ``text``, its checksum line recomputed (a forgery)."""
        (self.root / MANIFEST).write_bytes(seal_manifest(text.encode()))

    def entry_line(self, key: str) -> str:
        for line in self.manifest_text().splitlines():
            if line.strip().startswith(f'"{key}":'):
                return line
        raise KeyError(key)

    def replace_entry(self, key: str, new_line: str) -> None:
        text = self.manifest_text()
        self.write_manifest(text.replace(self.entry_line(key), new_line))

    def blob_of(self, key: str) -> str:
        """The blob holding ``key``'s bytes (its first location)."""
        found = re.search(r'\["([^"]+)", \d+', self.entry_line(key))
        assert found is not None, key
        return found.group(1)

    def drop_checksums(self, key: str) -> None:
        """Removes the CRC-32s of ``key``'s locations: an entry may omit them, so a forger
        needs nothing but a file of the right length."""
        line = self.entry_line(key)
        self.replace_entry(key, re.sub(r'(\["[^"]+", \d+, \d+), \d+\]', r"\1]", line))

    def secret_file(self, name: str, size: int) -> Path:
        """A file outside the root, ``size`` bytes of :data:`SECRET` repeated."""
        path = self.outside / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes((SECRET * (size // len(SECRET) + 1))[:size])
        return path

    def link_blob_out(self, key: str) -> None:
        """``key``'s blob becomes a symlink to an outside file of the same length."""
        blob = self.root / self.blob_of(key)
        target = self.secret_file("secret-" + blob.name, blob.stat().st_size)
        blob.unlink()
        blob.symlink_to(target)


@dataclass(frozen=True)
class Case:
    """One hostile snapshot: how it is made from the base, where it applies, and what each
    operation of the probe must raise (an exception class name; "ok" for success).

    ``expect`` maps probe operations (``open``, ``read``, ``restore``, ``verify``) to outcomes;
    ``read`` reads ``key``.
    """

    name: str
    family: str
    build: Callable[[Workspace], None]
    expect: dict[str, str]
    key: str = TENSOR_KEY
    stores: tuple[str, ...] = ("fs", "s3")
    #: Fields of the :class:`~snapshot.Options` every operation of the probe runs with.
    options: dict[str, int] = field(default_factory=dict)


def _fifo(ws: Workspace, rel: str) -> None:
    target = ws.root / rel
    target.unlink()
    os.mkfifo(target)


def _blob_symlink(ws: Workspace) -> None:
    ws.drop_checksums(TENSOR_KEY)
    ws.link_blob_out(TENSOR_KEY)


def _object_blob_symlink(ws: Workspace) -> None:
    ws.drop_checksums(OBJECT_KEY)
    ws.link_blob_out(OBJECT_KEY)


def _folder_symlink(ws: Workspace) -> None:
    """``0/`` is a link to an outside folder holding files of the same names and lengths."""
    for key in (TENSOR_KEY, OBJECT_KEY, "0/model/b"):
        ws.drop_checksums(key)
    folder = ws.root / "0"
    for blob in folder.iterdir():
        ws.secret_file(f"zero/{blob.name}", blob.stat().st_size)
    shutil.rmtree(folder)
    folder.symlink_to(ws.outside / "zero", target_is_directory=True)


def _manifest_symlink(ws: Workspace) -> None:
    """The manifest is a link to a copy outside the root (a valid manifest: only the link is
    wrong)."""
    outside = ws.outside / "manifest.yaml"
    shutil.copy(ws.root / MANIFEST, outside)
    (ws.root / MANIFEST).unlink()
    (ws.root / MANIFEST).symlink_to(outside)


def _manifest_dev_zero(ws: Workspace) -> None:
    (ws.root / MANIFEST).unlink()
    (ws.root / MANIFEST).symlink_to("/dev/zero")


def _manifest_fifo(ws: Workspace) -> None:
    _fifo(ws, MANIFEST)


def _blob_fifo(ws: Workspace) -> None:
    _fifo(ws, ws.blob_of(TENSOR_KEY))


def _huge_object_claim(ws: Workspace) -> None:
    """The object's location claims 2 GiB over its short blob."""
    line = ws.entry_line(OBJECT_KEY)
    ws.replace_entry(OBJECT_KEY, re.sub(r'(\["[^"]+", \d+), \d+, \d+\]', r"\1, 2147483648]", line))


def _huge_tensor_claim(ws: Workspace) -> None:
    """The tensor claims 2**29 float32 elements (2 GiB) in one chunk of its 16 KiB blob."""
    blob = ws.blob_of(TENSOR_KEY)
    ws.replace_entry(
        TENSOR_KEY,
        f'  "{TENSOR_KEY}": {{"type": "tensor", "dtype": "float32", "shape": [536870912], '
        f'"chunks": [["{blob}", 0, 2147483648]]}}',
    )


def _yaml_aliases(ws: Workspace) -> None:
    """A YAML manifest whose anchors and aliases would expand to 10**6 chunk locations from a
    few hundred bytes (each level repeats the one below ten times)."""
    blob = ws.blob_of(TENSOR_KEY)
    levels = [f'l0: &l0 ["{blob}", 0, 4]']
    for i in range(1, 7):
        levels.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]")
    text = ws.manifest_text()
    head, _, _ = text.partition("entries:")
    body = head + "\n".join(levels) + "\nentries:\n"
    body += f'  "{TENSOR_KEY}": {{type: tensor, dtype: float32, shape: [1000000], chunks: *l6}}\n'
    ws.write_manifest(body)


def _deep_json(ws: Workspace) -> None:
    """An entry whose value nests JSON arrays 100,000 deep."""
    depth = 100_000
    ws.replace_entry(
        "0/extra/step",
        '  "0/extra/step": {"type": "primitive", "value_type": "int", "value": '
        + "[" * depth
        + "]" * depth
        + "}",
    )


def _deep_yaml(ws: Workspace) -> None:
    """Nesting in YAML's block style, which the JSON fast path does not take (each level indents
    further, so the file grows with the square of the depth: 2,000 levels are 4 MB)."""
    depth = 2_000
    text = ws.manifest_text().replace(ws.entry_line("0/extra/step"), "")
    text += '  "0/extra/step":\n'
    text += "".join("  " * (i + 2) + "- \n" for i in range(depth))
    ws.write_manifest(text)


def _empty_shards(ws: Workspace) -> None:
    """The sharded tensor's entry gains 25,000 empty shards (each pair once compared: hours)."""
    empty = "".join(
        f', {{"offsets": [{i % 4}, 0], "sizes": [0, 4], "chunks": []}}' for i in range(25_000)
    )
    line = ws.entry_line(SHARDED_KEY)
    new, count = re.subn(
        r'("chunks": \[\[[^\]]*\]\]\})\]', lambda m: m.group(1) + empty + "]", line
    )
    assert count == 1, line
    ws.replace_entry(SHARDED_KEY, new)


def _python_tag(ws: Workspace) -> None:
    ws.replace_entry(
        "0/extra/step",
        '  "0/extra/step": !!python/object/apply:os.system ["echo pwned"]',
    )


def _blob_path_escapes(ws: Workspace) -> None:
    secret = ws.secret_file("escape.bin", 16384)
    rel = os.path.relpath(secret, ws.root)
    ws.drop_checksums(TENSOR_KEY)
    line = ws.entry_line(TENSOR_KEY)
    ws.replace_entry(TENSOR_KEY, re.sub(r'\["[^"]+",', f'["{rel}",', line))


def _pickle_runs_code(ws: Workspace) -> None:
    """The object's blob becomes a ``torch.save`` archive whose pickle calls ``os.system`` (its
    CRC recomputed), as a tool without the take-time check could write."""
    import io
    import zlib

    class Boom:
        def __reduce__(self):
            return (os.system, ("echo pwned > /dev/null",))

    buffer = io.BytesIO()
    torch.save(Boom(), buffer)
    payload = buffer.getvalue()
    blob = ws.root / ws.blob_of(OBJECT_KEY)
    blob.write_bytes(payload)
    line = ws.entry_line(OBJECT_KEY)
    ws.replace_entry(
        OBJECT_KEY,
        re.sub(
            r'\["([^"]+)", \d+, \d+, \d+\]',
            lambda m: f'["{m.group(1)}", 0, {len(payload)}, {zlib.crc32(payload)}]',
            line,
        ),
    )


UNSAFE = "UnsafeSnapshotError"
CORRUPT = "CorruptSnapshotError"
OPENS = {"open": "ok"}

CASES: tuple[Case, ...] = (
    # Reads outside the root (symlinks exist only on file systems).
    Case(
        "blob-symlink",
        "outside",
        _blob_symlink,
        {**OPENS, "read": UNSAFE, "restore": UNSAFE, "verify": "problems"},
        stores=("fs",),
    ),
    Case(
        "object-blob-symlink",
        "outside",
        _object_blob_symlink,
        {**OPENS, "read": UNSAFE, "restore": UNSAFE, "verify": "problems"},
        key=OBJECT_KEY,
        stores=("fs",),
    ),
    Case(
        "folder-symlink",
        "outside",
        _folder_symlink,
        {**OPENS, "read": UNSAFE, "restore": UNSAFE, "verify": "problems"},
        stores=("fs",),
    ),
    Case("manifest-symlink", "outside", _manifest_symlink, {"open": UNSAFE}, stores=("fs",)),
    Case(
        "blob-path-escapes",
        "outside",
        _blob_path_escapes,
        {"open": UNSAFE},
    ),
    # Inputs that would cost more than their bytes.
    Case("manifest-dev-zero", "cost", _manifest_dev_zero, {"open": UNSAFE}, stores=("fs",)),
    Case("manifest-fifo", "cost", _manifest_fifo, {"open": UNSAFE}, stores=("fs",)),
    Case(
        "blob-fifo",
        "cost",
        _blob_fifo,
        {**OPENS, "read": UNSAFE, "restore": UNSAFE, "verify": "problems"},
        stores=("fs",),
    ),
    Case(
        "manifest-over-limit",
        "cost",
        lambda ws: None,
        {"open": UNSAFE},
        options={"max_manifest_bytes": 256},
    ),
    Case(
        "object-claims-2gib",
        "cost",
        _huge_object_claim,
        {**OPENS, "read": CORRUPT, "restore": CORRUPT, "verify": "problems"},
        key=OBJECT_KEY,
    ),
    Case(
        "tensor-claims-2gib",
        "cost",
        _huge_tensor_claim,
        {**OPENS, "read": CORRUPT, "restore": CORRUPT, "verify": "problems"},
    ),
    Case("yaml-aliases", "cost", _yaml_aliases, {"open": UNSAFE}),
    Case(
        "25k-empty-shards",
        "cost",
        _empty_shards,
        {**OPENS, "read": "ok", "restore": "ok", "verify": "ok"},
        key=SHARDED_KEY,
    ),
    # Inputs that once raised errors other than SnapshotError.
    Case("json-nested-100k", "errors", _deep_json, {"open": UNSAFE}),
    Case("yaml-nested-2k", "errors", _deep_yaml, {"open": UNSAFE}),
    Case("python-tag", "errors", _python_tag, {"open": UNSAFE}),
    Case(
        "pickle-runs-code",
        "errors",
        _pickle_runs_code,
        {**OPENS, "read": "UnsafeObjectError", "restore": "UnsafeObjectError", "verify": "ok"},
        key=OBJECT_KEY,
    ),
)


def build(case: Case, base: Path, where: Path) -> Workspace:
    """A copy of the snapshot at ``base`` under ``where``, changed as ``case`` says."""
    ws = Workspace(root=where / "snap", outside=where / "outside")
    shutil.copytree(base, ws.root, symlinks=True)
    ws.outside.mkdir(parents=True, exist_ok=True)
    case.build(ws)
    return ws
