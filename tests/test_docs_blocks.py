"""Every ```python block of README.md and docs/*.md runs as written, the way a reader runs it:
in a child process, in a fresh working directory, the blocks of one file in order in one
namespace (what an earlier block imported or defined is there for the next), after a prelude
that defines exactly the names the file says the reader's script already has, and nothing else.

A file states those names in a sentence ("The examples assume that your script already has
`model` ...") followed by ``<!-- run: user=model,optimizer,train_one_step -->``; the test checks
that each name is in that sentence. A block that needs another setting says so on the line
right above it:

- ``<!-- run: ranks=2 -->``: run on 2 ranks (gloo, CPU) with torch.distributed set up; a marker
  that names a test file (``ranks=2 (tests/test_readme_parallel.py runs this block)``) leaves
  it to that test.
- ``<!-- run: s3 -->``: run against the local S3 endpoint that docs/storage.md documents
  (its command run here, on a free port: the blocks' ``http://127.0.0.1:9000`` is replaced by
  that port's URL); ``bucket=NAME`` makes that bucket first (the reader's own).
- ``<!-- run: skip reason=... -->``: not run, for the reason given (rare).

Blocks are grouped: one child process for the plain blocks of every file, one for the S3
blocks, one for Lightning's, one launch of ranks.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*run:\s*(.*?)\s*-->\s*$")
LOCAL_S3 = "http://127.0.0.1:9000"


@dataclass
class Block:
    file: str  # relative to the repository
    line: int  # of the block's first line of code (1-based)
    code: str
    run: str = ""  # the marker right above it ("" for none)

    @property
    def setting(self) -> str:
        return self.run.split()[0].split("=")[0] if self.run else "plain"


@dataclass
class Doc:
    file: str
    user: list[str] = field(default_factory=list)  # the names the reader's script has
    blocks: list[Block] = field(default_factory=list)


def parse(path: Path) -> Doc:
    doc = Doc(str(path.relative_to(ROOT)))
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = _MARKER.match(lines[i])
        if m and m.group(1).startswith("user="):
            doc.user = m.group(1).removeprefix("user=").split(",")
            paragraph = " ".join(_paragraph_before(lines, i))
            for name in doc.user:
                assert re.search(rf"`{name}(\(\))?`", paragraph), (
                    f"{doc.file}:{i + 1}: the sentence before the marker does not name `{name}`"
                )
        fence = _FENCE.match(lines[i])
        if fence and fence.group(2):
            indent, lang = fence.group(1), fence.group(2)
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            if lang == "python":
                marker = _MARKER.match(lines[i - 1]) if i else None
                code = "\n".join(ln.removeprefix(indent) for ln in lines[i + 1 : end])
                doc.blocks.append(Block(doc.file, i + 2, code, marker.group(1) if marker else ""))
            i = end
        i += 1
    return doc


def _paragraph_before(lines: list[str], i: int) -> list[str]:
    j = i
    while j > 0 and lines[j - 1].strip():
        j -= 1
    return lines[j:i]


DOCS = [parse(p) for p in FILES]

# What the reader's script has, by the set of names a file declares: each prelude defines
# those names in a function of its own, so that nothing else (not even `torch`) is left.
PRELUDES = {
    ("model", "optimizer", "train_one_step"): """
def _user():
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(x)

    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def train_one_step():
        loss = model(torch.randn(8, 4)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.item()

    return {"model": model, "optimizer": optimizer, "train_one_step": train_one_step}
""",
    ("app_state",): """
def _user():
    import torch

    model = torch.nn.Sequential()
    model.add_module("fc", torch.nn.Linear(4, 2))
    return {"app_state": {"model": model, "optim": torch.optim.Adam(model.parameters())}}
""",
    ("MyModule", "model", "data"): """
def _user():
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from lightning.pytorch import LightningModule

    class MyModule(LightningModule):
        def __init__(self, width=4):
            super().__init__()
            self.save_hyperparameters()
            self.fc = torch.nn.Linear(width, 1)

        def training_step(self, batch, index):
            return torch.nn.functional.mse_loss(self.fc(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)),
                      batch_size=4)
    return {"MyModule": MyModule, "model": MyModule(), "data": data}
""",
}

# Runs groups of blocks: {"groups": [{"label", "dir", "user", "prelude", "blocks":
# [{"file", "line", "code"}], "replace": {old: new}, "buckets": [...], "storage_options": {}}]}.
RUNNER = """
import json, os, sys
spec = json.load(open(sys.argv[1]))
for group in spec["groups"]:
    os.makedirs(group["dir"], exist_ok=True)
    os.chdir(group["dir"])
    for bucket in group.get("buckets", []):
        import s3fs
        s3fs.S3FileSystem(**group["storage_options"]).mkdir(bucket)
    ns = {"__name__": "__main__"}
    exec(compile(group["prelude"] + "\\nglobals().update(_user())\\ndel _user\\n", "prelude", "exec"), ns)
    names = sorted(k for k in ns if not k.startswith("__"))
    assert names == sorted(group["user"]), (group["label"], names)
    for block in group["blocks"]:
        code = block["code"]
        for old, new in group.get("replace", {}).items():
            code = code.replace(old, new)
        # Padded so that a traceback names the line of the markdown file.
        exec(compile("\\n" * (block["line"] - 1) + code, block["file"], "exec"), ns)
    print("ran", group["label"], len(group["blocks"]), flush=True)
"""


def group(doc: Doc, setting: str, folder: Path, **extra: Any) -> dict[str, Any] | None:
    blocks = [b for b in doc.blocks if b.setting == setting]
    if not blocks:
        return None
    prelude = PRELUDES[tuple(doc.user)] if doc.user else "def _user():\n    return {}\n"
    return {
        "label": f"{doc.file} ({setting})",
        "dir": str(folder / doc.file.replace("/", "_")),
        "user": doc.user,
        "prelude": prelude,
        "blocks": [{"file": b.file, "line": b.line, "code": b.code} for b in blocks],
        **extra,
    }


def run_groups(groups: list[dict[str, Any]], folder: Path, timeout: int = 240) -> str:
    spec = folder / "spec.json"
    spec.write_text(json.dumps({"groups": groups}))
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, str(spec)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=str(folder),
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    return done.stdout


# ---------------------------------------------------------------------------------------------


def test_every_block_has_a_setting_the_test_knows():
    seen = 0
    for doc in DOCS:
        for b in doc.blocks:
            seen += 1
            where = f"{b.file}:{b.line}"
            assert b.setting in ("plain", "ranks", "s3", "skip"), (where, b.run)
            if b.setting == "skip":
                assert re.search(r"reason=\S", b.run), f"{where}: a skip must give its reason"
            if b.setting == "plain" and doc.file != "docs/lightning.md":
                assert doc.user == [] or tuple(doc.user) in PRELUDES, where
    skips = [b for doc in DOCS for b in doc.blocks if b.setting == "skip"]
    assert len(skips) <= 1, "skips must be rare"
    assert seen >= 8  # README's and the guides' blocks were found
    # A block left to another test names it, and that test reads the same marker.
    for doc in DOCS:
        for b in doc.blocks:
            named = re.search(r"(tests/\w+\.py)", b.run)
            if named:
                assert b.run in (ROOT / named.group(1)).read_text(), (b.file, b.line)


def test_readme_says_what_the_script_has_before_its_first_block():
    readme = DOCS[0]
    assert readme.user == ["model", "optimizer", "train_one_step"]
    text = (ROOT / "README.md").read_text()
    assert text.index("<!-- run: user=") < text.index("```python")


def test_plain_blocks_run_as_written(tmp_path):
    """README's blocks in order in one namespace, and each guide's in its own: one child."""
    groups = [
        g for doc in DOCS if doc.file != "docs/lightning.md" if (g := group(doc, "plain", tmp_path))
    ]
    out = run_groups(groups, tmp_path)
    assert out.count("ran ") == len(groups) and "ran README.md (plain) 3" in out, out
    # What the README's blocks say they made is there.
    readme = tmp_path / "README.md"
    assert (readme / "snapshots" / "step-100" / "manifest.yaml").is_file()
    assert sorted(p.name for p in (readme / "ckpt").iterdir()) == [
        "step_0000000000", "step_0000000500", "step_0000001000"
    ]  # fmt: skip
    assert (readme / "runs" / "step_200" / "manifest.yaml").is_file()


@pytest.mark.slow  # imports Lightning and fits twice
def test_lightning_blocks_run_as_written(tmp_path):
    import importlib.util

    if importlib.util.find_spec("lightning") is None:
        pytest.skip("the lightning package (the lightning extra) is not installed")
    (doc,) = [d for d in DOCS if d.file == "docs/lightning.md"]
    out = run_groups([group(doc, "plain", tmp_path)], tmp_path)
    assert "ran docs/lightning.md (plain) 2" in out
    assert (tmp_path / "docs_lightning.md" / "ckpt" / "last.ckpt").is_dir()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_s3_command() -> str:
    text = (ROOT / "docs" / "storage.md").read_text()
    after = text[text.index("<!-- s3-local command -->") :]
    return after.split("```bash\n", 1)[1].split("\n```", 1)[0].strip()


def test_the_local_s3_command_installs_the_extra_that_holds_moto():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on

    command = local_s3_command()
    assert "pip install torch==2.13.0 -e '.[s3-local]'" in command
    assert command.split("&&")[-1].strip() == ".venv/bin/moto_server -p 9000"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert "statesnap[s3]" in extras["s3-local"]
    assert any(r.startswith("moto[server]") for r in extras["s3-local"])


@pytest.mark.slow  # starts moto's server in a process of its own
def test_s3_blocks_run_against_the_documented_local_endpoint(tmp_path):
    """The server the documented command starts (its last step, run from this environment's
    bin directory on a free port) serves the S3 blocks: a take and a restore."""
    server = local_s3_command().split("&&")[-1].strip()
    import importlib.util

    if importlib.util.find_spec("moto") is None:
        pytest.skip("moto's server is not installed (the s3-local extra)")
    # The script pip made, else the same entry point through this interpreter.
    binary = Path(sys.executable).parent / "moto_server"
    start = [str(binary)] if binary.exists() else [sys.executable, "-m", "moto.server"]
    port = _free_port()
    args = server.replace("9000", str(port)).split()
    assert args[0] == ".venv/bin/moto_server"
    endpoint = LOCAL_S3.replace("9000", str(port))
    proc = subprocess.Popen(
        start + args[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=str(tmp_path)
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "no server"
                time.sleep(0.2)
        groups = []
        for doc in DOCS:
            for b in doc.blocks:
                if b.setting == "s3":
                    assert LOCAL_S3 in b.code, f"{b.file}:{b.line}: S3 blocks use {LOCAL_S3}"
            buckets = [m for b in doc.blocks for m in re.findall(r"bucket=(\S+)", b.run)]
            g = group(
                doc, "s3", tmp_path, replace={LOCAL_S3: endpoint}, buckets=buckets,
                storage_options={"endpoint_url": endpoint, "key": "k", "secret": "s"},
            )  # fmt: skip
            if g is not None:
                groups.append(g)
        assert groups
        out = run_groups(groups, tmp_path)
        assert "ran docs/storage.md (s3) 2" in out, out
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _ranked(rank: int, world: int, code: str, line: int, file: str, folder: str) -> bool:
    os.chdir(folder)
    exec(compile("\n" * (line - 1) + code, file, "exec"), {"__name__": "__main__"})
    return True


@pytest.mark.slow  # real processes (gloo)
def test_multi_rank_blocks_run_on_two_ranks(tmp_path):
    from tests.multirank import run_ranks

    blocks = [
        b for doc in DOCS for b in doc.blocks if b.setting == "ranks" and "tests/" not in b.run
    ]
    assert blocks, "docs/distributed.md's block"
    for b in blocks:
        assert b.run.startswith("ranks=2"), b.run
        folder = tmp_path / f"{b.file.replace('/', '_')}_{b.line}"
        folder.mkdir()
        assert run_ranks(2, _ranked, b.code, b.line, b.file, str(folder)) == [True, True]


def test_no_install_line_names_an_index_package():
    """No package index serves statesnap: no `pip install statesnap...` anywhere."""
    for path in FILES:
        text = path.read_text()
        assert not re.search(r"pip install\s+['\"]?statesnap", text), path
