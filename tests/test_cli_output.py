"""What the commands write, in process: ``--json`` for ls, show, du, diff, steps and verify
(checked against the snapshot), ``ls`` lines cut to the terminal, ``show`` summaries of long
values, and a checkpoint manager's root given where a snapshot is expected. The same commands
run as programs in test_cli_program.py."""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from snapshot import CheckpointManager, RNGState, Snapshot, StateDict
from snapshot._engine.format.manifest_io import load_manifest
from snapshot._engine.take.commit import PENDING_NAME
from snapshot._engine.tools.inspection import brief
from tests.test_cli import _flip, _location, _take, run


@pytest.fixture
def snap(tmp_path) -> str:
    return _take(str(tmp_path / "snap"))


DOCS = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
_FREE_KEYS = {"rank_bytes", "metrics"}  # objects whose keys are the snapshot's, not the schema's


def _undocumented(value: Any, section: str) -> list[str]:
    """The keys of a JSON document that its section of docs/cli.md does not name."""
    found = []
    if isinstance(value, dict):
        for key, inner in value.items():
            if not re.search(rf"\b{re.escape(key)}\b", section):
                found.append(key)
            if key not in _FREE_KEYS:
                found += _undocumented(inner, section)
    elif isinstance(value, list):
        for inner in value:
            found += _undocumented(inner, section)
    return found


def _json(capsys, *argv: str, code: int = 0) -> Any:
    """The JSON document of ``statesnap argv... --json``, its keys checked against the docs."""
    got, out, err = run(capsys, *argv, "--json")
    assert (got, err) == (code, "")
    doc = json.loads(out)
    text = DOCS.read_text()
    start = text.index(f"**`{argv[0]} --json`**")
    section = text[start : text.find("**`", start + 5)]
    assert not _undocumented(doc, section), argv
    return doc


# ---------------------------------------------------------------------------------------------
# --json


def test_ls_json(capsys, snap):
    doc = _json(capsys, "ls", snap)
    entries = load_manifest(snap, None).entries
    assert doc["path"] == snap
    assert [e["path"] for e in doc["entries"]] == list(entries)
    rows = {e["path"]: e for e in doc["entries"]}
    assert rows["0/s/w"] == {
        "path": "0/s/w",
        "kind": "tensor",
        "dtype": "float32",
        "shape": [3, 4],
        "nbytes": 48,
        "replicated": False,
        "base": None,
    }
    assert rows["0/extra/step"]["dtype"] == "int" and rows["0/extra/step"]["shape"] is None
    assert rows["0/extra/nested"]["dtype"] is None
    total = doc["total"]
    assert total["entries"] == len(entries)
    assert total["nbytes"] == sum(e.nbytes for e in entries.values())
    assert total["tensors"] == sum(r["shape"] is not None for r in doc["entries"])
    assert total["stored_bytes"] == total["nbytes"] and total["base_bytes"] == 0
    assert total["bases"] == []
    # --prefix applies as it does to the table.
    doc = _json(capsys, "ls", snap, "--prefix", "0/s")
    assert doc["total"]["entries"] == 7


def test_show_json(capsys, snap):
    doc = _json(capsys, "show", snap, "0/s/odd")
    assert (doc["path"], doc["key"], doc["kind"]) == (snap, "0/s/odd", "tensor")
    t = doc["tensor"]
    assert (t["dtype"], t["shape"], t["numel"], t["nbytes"]) == ("float32", [4], 4, 16)
    assert (t["min"], t["max"], t["mean"], t["nonfinite"]) == (-2.0, 1.0, -0.5, 2)
    assert t["values"] == [1.0, "nan", -2.0, "inf"]  # what JSON has no number for, as text
    doc = _json(capsys, "show", snap, "0/s/z")
    assert doc["tensor"]["mean"] == "(2-1j)" and doc["tensor"]["min"] is None
    doc = _json(capsys, "show", snap, "0/extra/tags")
    assert doc["kind"] == "object" and doc["type"] == "set" and doc["length"] == 2
    assert doc["repr"] == "{3, 4}" and doc["nbytes"] > 0
    doc = _json(capsys, "show", snap, "0/extra/text", "--max-chars", "10")
    assert doc["length"] == 5000 and doc["repr"] == "'ttttttttt... (4,992 more characters)"
    doc = _json(capsys, "show", snap, "0/extra/text", "--full")
    assert doc["repr"] == repr("t" * 5000)


def test_du_json(capsys, snap):
    doc = _json(capsys, "du", snap)
    entries = load_manifest(snap, None).entries
    keys = {r["key"]: r for r in doc["rows"]}
    assert set(keys) == {"model", "s", "extra"} and {r["rank"] for r in doc["rows"]} == {"0"}
    for key, row in keys.items():
        mine = [e for p, e in entries.items() if p == f"0/{key}" or p.startswith(f"0/{key}/")]
        assert (row["entries"], row["nbytes"]) == (len(mine), sum(e.nbytes for e in mine))
        assert row["replicated_bytes"] == 0
    sizes = [r["nbytes"] for r in doc["rows"]]
    assert sizes == sorted(sizes, reverse=True)
    assert doc["rank_bytes"] == {"0": sum(sizes)}
    total = doc["total"]
    assert total["entries"] == len(entries) and total["nbytes"] == sum(sizes)
    assert set(total) == {
        "entries",
        "nbytes",
        "replicated_bytes",
        "stored_bytes",
        "base_bytes",
        "bases",
    }


def test_verify_json(capsys, snap):
    doc = _json(capsys, "verify", snap)
    manifest = load_manifest(snap, None)
    assert doc["ok"] is True and doc["problems"] == []
    assert doc["entries"] == len(manifest.entries) and doc["blobs"] == len(manifest.blob_sizes)
    assert doc["bytes_read"] == sum(manifest.blob_sizes.values())
    assert doc["checksums_checked"] == doc["ranges"] and doc["checksums_missing"] == 0
    assert (doc["foreign"], doc["sizes_unknown"], doc["not_decoded"]) == (None, [], [])
    loc = _location(snap, "0/s/half")
    _flip(snap, loc)
    doc = _json(capsys, "verify", snap, code=1)
    assert doc["ok"] is False
    [problem] = doc["problems"]
    assert problem["paths"] == ["0/s/half"] and problem["blob"] == loc.blob
    assert problem["start"] <= loc.offset < problem["end"]
    assert problem["what"].startswith("checksum mismatch")


def test_diff_json(capsys, tmp_path):
    a = _take(str(tmp_path / "a"))
    b = _take(str(tmp_path / "b"), w=torch.zeros(3, 4), added=1)
    doc = _json(capsys, "diff", a, a)
    assert doc["identical"] is True and doc["differences"] == []
    doc = _json(capsys, "diff", a, b, code=1)
    assert (doc["a"], doc["b"], doc["identical"]) == (a, b, False)
    assert doc["entries_b"] == doc["entries_a"] + 1 and doc["compared_by_reading"] == 0
    found = {d["path"]: d for d in doc["differences"]}
    assert found["0/s/w"]["what"] == "bytes" and found["0/extra/added"]["what"] == "only in B"
    assert found["0/extra"]["what"] == "keys"


def _manager_root(tmp_path) -> str:
    root = str(tmp_path / "ckpt")
    with CheckpointManager(root) as manager:
        for step in (1, 2):
            manager.save(
                step, {"m": StateDict(w=torch.full((4,), float(step)))}, metrics={"l": step}
            )
    return root


def test_steps_json(capsys, tmp_path):
    root = _manager_root(tmp_path)
    os.makedirs(f"{root}/step_0000000009")
    with open(f"{root}/step_0000000009/{PENDING_NAME}", "w") as f:
        f.write("a take that never finished")
    doc = _json(capsys, "steps", root)
    assert (doc["root"], doc["committed"], doc["latest"]) == (root, 2, 2)
    one, two, nine = doc["steps"]
    assert (two["step"], two["metrics"], two["nbytes"] > 0) == (2, {"l": 2}, True)
    assert (one["step"], one["state"], one["folder"]) == (1, "committed", "step_0000000001")
    assert one["path"] == os.path.join(root, "step_0000000001")
    assert one["metrics"] == {"l": 1} and one["bases"] == [] and one["reason"] is None
    assert one["nbytes"] == sum(load_manifest(one["path"], None).blob_sizes.values())
    assert (nine["step"], nine["state"], nine["nbytes"]) == (9, "incomplete", None)
    assert nine["reason"] == "a take that never finished"


def test_json_is_ascii_and_exact(capsys, tmp_path):
    path = str(tmp_path / "s")
    Snapshot.take(path, {"m\x1bx": StateDict(**{"é\u202e": torch.ones(1)})})
    _, out, _ = run(capsys, "ls", path, "--json")
    assert out.isascii() and "\x1b" not in out
    assert [e["path"] for e in json.loads(out)["entries"]] == ["0/m\x1bx", "0/m\x1bx/é\u202e"]


# ---------------------------------------------------------------------------------------------
# ls: lines cut to the terminal


def test_ls_cuts_lines_to_the_terminal_width(capsys, snap, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    _, whole, _ = run(capsys, "ls", snap)  # not a terminal: whole lines
    assert max(map(len, whole.splitlines())) > 40
    monkeypatch.setenv("COLUMNS", "40")
    assert run(capsys, "ls", snap)[1] == whole  # COLUMNS alone (a test runner's): no cut
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    code, out, _ = run(capsys, "ls", snap)
    assert code == 0
    lines = out.splitlines()
    assert len(lines) == len(whole.splitlines()) and all(len(line) <= 40 for line in lines)
    for cut, line in zip(lines, whole.splitlines(), strict=True):
        if len(line) > 40:
            assert cut == line[:39] + "…"
        else:
            assert cut == line
    assert run(capsys, "ls", snap, "--wide")[1] == whole
    assert json.loads(run(capsys, "ls", snap, "--json")[1])["total"]["entries"] > 0
    # A terminal without COLUMNS: its own width.
    monkeypatch.delenv("COLUMNS")
    monkeypatch.setattr(
        "shutil.get_terminal_size", lambda fallback=(80, 24): os.terminal_size((30, 24))
    )
    assert max(map(len, run(capsys, "ls", snap)[1].splitlines())) == 30


# ---------------------------------------------------------------------------------------------
# show: long values summarized


def test_brief_cuts_long_containers_strings_and_tensors():
    assert brief({"k": (1, [2, 3])}, 8, 2000) == repr({"k": (1, [2, 3])})
    for small in ((1,), set(), frozenset({1}), [], "x", b"y", None, 1.5):
        assert brief(small, 8, 2000) == repr(small)
    assert brief(list(range(20)), 3, 2000) == "[0, 1, 2, ... (17 more)]"
    assert brief({i: str(i) for i in range(5)}, 2, 2000) == "{0: '0', 1: '1', ... (3 more)}"
    assert brief("a" * 30, 8, 10) == "'aaaaaaaaa... (22 more characters)"
    assert brief(torch.arange(10, dtype=torch.uint8), 3, 2000) == (
        "tensor(dtype=uint8, shape=[10], [0, 1, 2, ... (7 more)])"
    )
    # Inside a container, a string is cut at 100 characters.
    assert brief(["b" * 150], 8, 2000) == "['" + "b" * 99 + "... (52 more characters)]"
    deep: list[Any] = [[[[[1, 2]]]]]
    assert brief(deep, 8, 2000) == "[[[[<list of 2 items>]]]]"


def test_show_summarizes_rng_states_and_long_values(capsys, tmp_path):
    path = str(tmp_path / "s")
    random.seed(0)
    state = {
        "rng": RNGState(),
        "x": StateDict(py=random.getstate(), blob=bytes(range(256)) * 20, many=list(range(700))),
    }
    Snapshot.take(path, state)
    code, out, _ = run(capsys, "show", path, "0/rng")
    assert code == 0
    header, text = out.splitlines()
    assert header == "0/rng: dict (length 3)"
    assert "'torch': tensor(dtype=uint8, shape=[5056], [" in text and "(5,048 more)" in text
    assert "(617 more)" in text and len(text) < 1000  # Python's 625 words, cut
    code, out, _ = run(capsys, "show", path, "0/x/py")
    assert out.splitlines()[1].startswith("(3, (") and "... (617 more)), None)" in out
    code, out, _ = run(capsys, "show", path, "0/x/many", "--values", "4")
    assert out.splitlines() == ["0/x/many: list (length 700)", "[0, 1, 2, 3, ... (696 more)]"]
    code, out, _ = run(capsys, "show", path, "0/x/blob")
    header, text = out.splitlines()
    assert header.startswith("0/x/blob: object (bytes, length 5,120, ")
    assert text.startswith("b'\\x00\\x01") and text.endswith(" more characters)")
    assert len(text) < 250
    code, out, _ = run(capsys, "show", path, "0/x/many", "--full")
    assert out.splitlines()[1] == repr(list(range(700)))


# ---------------------------------------------------------------------------------------------
# A manager's root where a snapshot is expected


def test_a_manager_root_opens_its_latest_committed_step(capsys, tmp_path):
    root = _manager_root(tmp_path)
    latest = os.path.join(root, "step_0000000002")
    said = f"statesnap: opening the latest committed step, {latest}\n"
    code, out, err = run(capsys, "ls", root)
    assert (code, err) == (0, said) and "0/m/w" in out
    code, out, err = run(capsys, "show", root, "0/m/w")
    assert (code, err) == (0, said) and "  values  [2.0, 2.0, 2.0, 2.0]" in out
    for command in ("verify", "du"):
        code, out, err = run(capsys, command, root)
        assert (code, err) == (0, said), command
    code, out, err = run(capsys, "diff", root, os.path.join(root, "step_0000000001"))
    assert (code, err) == (1, said) and "0/m/w" in out
    code, out, err = run(capsys, "export", root, str(tmp_path / "out"))
    assert (code, err) == (0, said)
    doc = json.loads(run(capsys, "verify", root, "--json")[1])
    assert doc["path"] == latest and doc["ok"] is True


def test_a_root_without_a_committed_step_is_a_clear_error(capsys, tmp_path):
    root = str(tmp_path / "ckpt")
    os.makedirs(f"{root}/step_0000000003")
    with open(f"{root}/step_0000000003/{PENDING_NAME}", "w") as f:
        f.write("a take that never finished")
    code, out, err = run(capsys, "ls", root)
    assert (code, out) == (2, "")
    assert err == (
        f"statesnap: error: no committed step under the checkpoint manager's root {root}: "
        f"1 step folder(s), none committed (`statesnap steps {root}` says what each holds)\n"
    )
    # A folder of neither kind: no snapshot there, as before.
    code, _, err = run(capsys, "ls", str(tmp_path))
    assert code == 2 and err.startswith(f"statesnap: error: no snapshot at {tmp_path} ")


def test_a_damaged_latest_step_is_reported_not_passed_over(capsys, tmp_path):
    root = _manager_root(tmp_path)
    latest = os.path.join(root, "step_0000000002")
    _flip(latest, _location(latest, "0/m/w"))
    code, out, _ = run(capsys, "verify", root)
    assert code == 1 and out.startswith("0/m/w: blob ")


# ---------------------------------------------------------------------------------------------
# The docs


def test_the_docs_name_every_command_option_and_exit_code():
    from snapshot import cli

    text = DOCS.read_text()
    parser = cli._parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name, command in sub.choices.items():
        heading = f"**`{name} "
        assert heading in text, name
        usage = text[text.index(heading) : text.index("**:", text.index(heading))]
        for action in command._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help", "--storage-option"):
                    assert option in usage, (name, option)
    for option in ("--storage-option", "-v", "--version"):
        assert f"`{option}" in text
    for code in (cli.EXIT_OK, cli.EXIT_PROBLEM, cli.EXIT_ERROR, cli.EXIT_INTERNAL, 130):
        assert f"| {code} |" in text
    for command in ("ls", "show", "verify", "du", "diff", "steps"):
        assert f"**`{command} --json`**" in text
