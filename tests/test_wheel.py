"""The package a user installs: a wheel built from the tracked files (as a fresh clone has them),
installed into an environment of its own outside the source tree, imports every module and
takes, restores and lists a snapshot from there.

The rest of the suite runs against an editable install, which reads modules straight from the
source tree: a module left out of the wheel would pass there and fail for every user.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("snapshot", "storage_plugins", "manifest")


def _tracked_files() -> list[str]:
    """The files a fresh clone of the working tree would hold (tracked, or new and not
    ignored)."""
    if not (ROOT / ".git").exists():
        pytest.skip("needs the source tree's git metadata to know which files a clone holds")
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout
    return [p for p in out.decode().split("\0") if p and (ROOT / p).is_file()]


def _source_modules(files: list[str]) -> set[str]:
    """Dotted names of every library module in the tree (``snapshot.sharding.mapping``) but
    ``__main__`` ones, which run a program when imported (the CLI test runs them)."""
    names = set()
    for f in files:
        parts = Path(f).parts
        if parts[0] in PACKAGES and f.endswith(".py") and parts[-1] != "__main__.py":
            mod = ".".join(parts)[: -len(".py")]
            names.add(mod.removesuffix(".__init__"))
    return names


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, set[str]]:
    """(python of an environment holding only the built wheel and the dependencies, the
    modules the source tree has)."""
    tmp = tmp_path_factory.mktemp("wheel")
    files = _tracked_files()
    clone = tmp / "clone"
    for f in files:
        (clone / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, clone / f)
    dist = tmp / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(clone)],
        check=True,
        capture_output=True,
    )
    wheels = list(dist.glob("statesnap-*.whl"))
    assert len(wheels) == 1, wheels
    wheel_names = set(zipfile.ZipFile(wheels[0]).namelist())
    missing = sorted(
        f
        for f in files
        if f.endswith(".py") and Path(f).parts[0] in PACKAGES and f not in wheel_names
    )
    assert not missing, f"modules missing from the wheel: {missing}"

    # A fresh environment without pip; the dependencies (torch...) are reached through a .pth
    # line naming this environment's site-packages, whose own .pth files (the editable install's
    # finder among them) are not processed from there: only the wheel provides our packages.
    env = tmp / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    python = env / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(site, "statesnap_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "-q",
            str(wheels[0]),
        ],
        check=True,
        capture_output=True,
    )
    return python, _source_modules(files)


def _run(python: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    return subprocess.run(
        [str(python), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_every_module_imports_from_the_installed_wheel(installed, tmp_path):
    python, modules = installed
    script = (
        "import importlib, sys\n"
        f"for name in {sorted(modules)!r}:\n"
        "    importlib.import_module(name)\n"
        "import snapshot\n"
        "print(snapshot.__file__)\n"
        "print(snapshot.__version__)\n"
    )
    r = _run(python, tmp_path, "-c", script)
    assert r.returncode == 0, r.stderr
    where, version = r.stdout.split()
    # From the environment the wheel went into, not from the source tree.
    assert Path(where).is_relative_to(python.parent.parent), where
    assert not Path(where).is_relative_to(ROOT)
    meta = _run(
        python, tmp_path, "-c", "import importlib.metadata as m; print(m.version('statesnap'))"
    )
    assert meta.stdout.strip() == version


def test_take_restore_and_cli_from_the_installed_wheel(installed, tmp_path):
    python, _ = installed
    snap = tmp_path / "snap"
    script = (
        "import sys, torch\n"
        "from snapshot import Snapshot, StateDict\n"
        "m = torch.nn.Linear(4, 3)\n"
        "state = {'model': m, 'progress': StateDict(step=7)}\n"
        "Snapshot.take(sys.argv[1], state)\n"
        "fresh, progress = torch.nn.Linear(4, 3), StateDict(step=0)\n"
        "Snapshot(sys.argv[1]).restore({'model': fresh, 'progress': progress})\n"
        "assert torch.equal(fresh.weight, m.weight) and progress['step'] == 7\n"
        "print('restored')\n"
    )
    r = _run(python, tmp_path, "-c", script, str(snap))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "restored"
    # The console script the wheel installs.
    cli = python.parent / "statesnap"
    ls = subprocess.run([str(cli), "ls", str(snap)], capture_output=True, text=True, timeout=120)
    assert ls.returncode == 0, ls.stderr
    assert "0/model/weight" in ls.stdout and "0/progress/step" in ls.stdout
    verify = subprocess.run(
        [str(cli), "verify", str(snap)], capture_output=True, text=True, timeout=120
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    # ``python -m snapshot`` (the package's __main__) is the same command line.
    version = _run(python, tmp_path, "-m", "snapshot", "--version")
    assert version.returncode == 0, version.stderr
    assert version.stdout.startswith("statesnap ")
