"""The command line as a user runs it: ``python -m snapshot`` (and the ``statesnap`` script) in
a process of its own, its stderr a pipe or a pseudo-terminal. ``--help`` and ``--version``
import no torch; every command on a good snapshot writes nothing to stderr but what it means
to (no NumPy warning); ``--json`` is one document; a bar shows on a terminal only; a manager's
root and a Lightning checkpoint path open their latest committed snapshot.

Each process imports torch (seconds on a busy machine): the tests start their processes
together and are marked slow, but for the one that imports no torch. The same behaviours are
checked in process, quickly, in test_cli_output.py and test_cli.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

from snapshot import CheckpointManager, Snapshot, StateDict
from snapshot._engine.format.manifest_io import load_manifest
from tests.helpers import OnTerminal, on_terminal

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAVY = ("torch", "numpy", "tqdm", "yaml", "fsspec")


def _env(**extra: str) -> dict[str, str]:
    """The environment of a command: this tree's library first, no COLUMNS unless given."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    env["PYTHONPATH"] = os.pathsep.join([REPO, *filter(None, [env.get("PYTHONPATH")])])
    return {**env, **extra}


def start(*argv: str, tty: bool = False, env: dict[str, str] | None = None) -> Any:
    """``python -m snapshot argv...``, stdout a pipe, stderr a pipe or (``tty``) a terminal of
    100 columns."""
    command = [sys.executable, "-m", "snapshot", *argv]
    if tty:
        return on_terminal(command, env or _env(), 100, cwd=REPO)
    return subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env or _env(),
    )


def finish(run: Any) -> tuple[int, str, str]:
    """(exit code, stdout, stderr: what the pipe or the terminal got)."""
    if isinstance(run, OnTerminal):
        return run.finish()
    out, err = run.communicate(timeout=240)
    return run.returncode, out, err


def _imported(stderr: str) -> set[str]:
    """The modules ``-X importtime`` reports."""
    return {
        line.rsplit("|", 1)[1].strip()
        for line in stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }


def test_help_and_version_import_no_torch():
    runs = [
        subprocess.Popen(
            [sys.executable, "-X", "importtime", "-m", "snapshot", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=_env(),
        )
        for argv in (["--version"], ["--help"], ["verify", "--help"])
    ]
    script = os.path.join(os.path.dirname(sys.executable), "statesnap")
    if os.path.exists(script):  # the console script, as installed
        runs += [
            subprocess.Popen(
                [script, flag],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=_env(PYTHONPROFILEIMPORTTIME="1"),
            )
            for flag in ("--version", "--help")
        ]
    from snapshot.version import __version__

    for child in runs:
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, (child.args, err[-2000:])
        imported = _imported(err)
        assert "snapshot.cli" in imported, child.args
        heavy = sorted(m for m in imported if m.split(".")[0] in HEAVY)
        assert not heavy, (child.args, heavy)
        assert out == f"statesnap {__version__}\n" if "--version" in child.args else "usage:" in out


# ---------------------------------------------------------------------------------------------
# Every command, as a user runs it


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": StateDict(w=torch.randn(64, 32, generator=g), b=torch.zeros(32)),
        "extra": StateDict(step=seed, names=list(range(100)), note="n" * 500),
    }


def _manager_root(path: str, steps: int = 3) -> str:
    with CheckpointManager(path) as manager:
        for step in range(1, steps + 1):
            manager.save(step, _state(step), metrics={"loss": 1 / step})
    return path


@pytest.mark.slow  # fourteen processes, each importing torch
def test_every_command_writes_only_what_it_means_and_json_parses(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    Snapshot.take(a, _state(0))
    Snapshot.take(b, _state(1))
    root = _manager_root(str(tmp_path / "root"))
    commands = {
        "ls": ["ls", a],
        "show": ["show", a, "0/model/w"],
        "verify": ["verify", a],
        "du": ["du", a],
        "diff": ["diff", a, b],
        "steps": ["steps", root],
        "export": ["export", a, str(tmp_path / "out")],
        "prune": ["prune", root, "--keep-last", "1", "--dry-run"],
    }
    for name in ("ls", "show", "verify", "du", "diff", "steps"):
        commands[f"{name} --json"] = [*commands[name], "--json"]
    commands["ls COLUMNS=40"] = ["ls", a]
    commands["ls --wide COLUMNS=40"] = ["ls", a, "--wide"]
    runs = {
        name: start(*argv, env=_env(COLUMNS="40") if "COLUMNS" in name else None)
        for name, argv in commands.items()
    }
    done = {name: finish(run) for name, run in runs.items()}
    for name, (code, out, err) in done.items():
        # Torch, NumPy or anything else: no warning, no progress (stderr is no terminal).
        assert err == "", (name, err)
        assert code == (1 if name.startswith("diff") else 0), (name, out)
        assert out.endswith("\n") and out.strip(), name
    manifest = load_manifest(a, None)
    docs = {
        name.split()[0]: json.loads(out) for name, (_, out, _) in done.items() if "json" in name
    }
    assert [e["path"] for e in docs["ls"]["entries"]] == list(manifest.entries)
    assert docs["show"]["tensor"]["shape"] == [64, 32]
    assert docs["verify"]["ok"] is True
    assert docs["verify"]["bytes_read"] == sum(manifest.blob_sizes.values())
    assert docs["du"]["total"]["nbytes"] == sum(e.nbytes for e in manifest.entries.values())
    assert {d["path"] for d in docs["diff"]["differences"]} >= {"0/model/w", "0/extra/step"}
    assert [s["step"] for s in docs["steps"]["steps"]] == [1, 2, 3]
    assert docs["steps"]["latest"] == 3
    # ls: whole lines on a pipe, even where COLUMNS is set (test runners set it); the cut on
    # a terminal is tests/test_cli_output.py's.
    whole = done["ls"][1].splitlines()
    assert max(map(len, whole)) > 40
    assert done["ls COLUMNS=40"][1].splitlines() == whole
    assert done["ls --wide COLUMNS=40"][1].splitlines() == whole


@pytest.mark.slow  # eight processes, each importing torch
def test_progress_bars_show_on_a_terminal_only(tmp_path):
    a = str(tmp_path / "a")
    Snapshot.take(a, _state(0))
    roots = [_manager_root(str(tmp_path / f"root{i}")) for i in (0, 1)]
    commands = {
        "verify": ["verify", a],
        "du": ["du", a],
        "export": ["export", a, str(tmp_path / "out0")],
        "prune": ["prune", roots[0], "--keep-last", "1"],
    }
    on_terminal = {name: start(*argv, tty=True) for name, argv in commands.items()}
    commands["export"][-1] = str(tmp_path / "out1")
    commands["prune"][1] = roots[1]
    on_pipe = {name: start(*argv) for name, argv in commands.items()}
    bars = {"verify": " blobs]", "du": " entries", "export": " files]", "prune": " steps"}
    for name, run in on_terminal.items():
        code, out, shown = finish(run)
        assert code == 0, (name, shown)
        assert f"\r{name}: " in shown and "%|" in shown and bars[name] in shown, (name, shown)
        assert "\r" not in out and out.strip()  # the report itself is on stdout, unchanged
    for name, run in on_pipe.items():
        code, out, err = finish(run)
        assert (code, err) == (0, ""), name
        assert "\r" not in out and out.strip()
    for root in roots:
        assert sorted(os.listdir(root)) == ["step_0000000003"]


@pytest.mark.slow  # Lightning's import, and a process per command
def test_a_manager_root_and_a_lightning_checkpoint_open_their_latest(tmp_path):
    lightning = pytest.importorskip("snapshot.integrations.lightning", exc_type=ImportError)
    root = _manager_root(str(tmp_path / "root"), steps=2)
    ckpt = str(tmp_path / "lightning" / "last.ckpt")
    io = lightning.StatesnapCheckpointIO()
    for epoch in (1, 2):
        io.save_checkpoint(
            {"epoch": epoch, "state_dict": {"w": torch.full((3,), 1.0 * epoch)}}, ckpt
        )
    [version] = os.listdir(ckpt)
    empty = str(tmp_path / "empty")
    os.makedirs(os.path.join(empty, "step_0000000001"))
    runs = {
        "ls root": start("ls", root),
        "verify root": start("verify", root, "--json"),
        "show ckpt": start("show", ckpt, "0/checkpoint/epoch"),
        "du ckpt": start("du", ckpt, "--json"),
        "ls empty": start("ls", empty),
    }
    done = {name: finish(run) for name, run in runs.items()}
    step = os.path.join(root, "step_0000000002")
    opened_step = f"statesnap: opening the latest committed step, {step}\n"
    opened_version = (
        f"statesnap: opening the latest committed version, {os.path.join(ckpt, version)}\n"
    )
    assert done["ls root"][0::2] == (0, opened_step) and "0/model/w" in done["ls root"][1]
    assert done["verify root"][0::2] == (0, opened_step)
    assert json.loads(done["verify root"][1])["path"] == step
    assert done["show ckpt"] == (0, "0/checkpoint/epoch: primitive (int)\n2\n", opened_version)
    assert done["du ckpt"][0::2] == (0, opened_version)
    assert json.loads(done["du ckpt"][1])["path"] == os.path.join(ckpt, version)
    code, out, err = done["ls empty"]
    assert (code, out) == (2, "")
    assert err.startswith("statesnap: error: no committed step under the checkpoint manager's")
