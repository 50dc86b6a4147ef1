"""The command line facing hostile snapshots: what it prints, and the codes it exits with.

A snapshot's keys, type names and values are untrusted: keys holding terminal escapes (OSC
that sets the window title, CSI that clears the screen, BEL, CR, a bidi override) must reach
the terminal as visible escapes (``snapshot/text.py``) from every command, error messages and
tracebacks included. Every way a command can end maps to the exit code ``statesnap --help``
and docs/cli.md state.
"""

from __future__ import annotations

import logging
import os
import random
import re
import subprocess
import sys
import unicodedata
from pathlib import Path
from typing import Any

import pytest
import torch

import snapshot.cli as cli
from manifest import Location
from snapshot import Snapshot, StateDict
from snapshot._engine.format.manifest_io import load_manifest
from snapshot._engine.format.text import printable, printable_message, unescape
from snapshot._engine.tools import cli_commands
from snapshot._engine.tools.inspection import read_entry
from snapshot.errors import (
    CorruptSnapshotError,
    EntryNotFoundError,
    SnapshotError,
    StateMismatchError,
    UnsafeSnapshotError,
)
from tests import hostile
from tests.helpers import seal_manifest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MANIFEST = "manifest.yaml"

# OSC (set the window title) ended by BEL, CSI (clear the screen), CR, and a right-to-left
# override that would show the rest reversed.
BAD = "\x1b]0;PWNED\x07\x1b[2J\r\u202eevil"
SHOWN = printable(BAD)  # what a terminal must show instead
KEY = "m" + BAD  # an app_state key
LEAF = "w" + BAD  # a key of the state dict
ROOT = f"0/{KEY}"
TENSOR = f"{ROOT}/{LEAF}"
NESTED = f"{ROOT}/n/k{BAD}"  # a key of a nested dict: a primitive
VALUE = f"{ROOT}/s"  # a str primitive whose value holds BAD
OBJECT = f"{ROOT}/o"  # a set holding BAD: an object in a blob

_BIDI = {0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)}


def raw_controls(text: str) -> list[str]:
    """The characters of ``text`` a terminal would obey rather than show: C0 controls other
    than newline and tab, DEL, C1 controls, bidi controls and other format characters."""
    return [
        f"U+{ord(c):04X}"
        for c in text
        if (ord(c) < 0x20 and c not in "\n\t")
        or 0x7F <= ord(c) <= 0x9F
        or ord(c) in _BIDI
        or unicodedata.category(c) == "Cf"
    ]


def _state(tensor: torch.Tensor, value: str, extra: dict[str, Any] | None = None) -> dict:
    return {
        KEY: StateDict(
            **{LEAF: tensor, "n": {"k" + BAD: 1}, "s": value, "o": {BAD}, **(extra or {})}
        ),
    }


@pytest.fixture
def snap(tmp_path) -> str:
    path = str(tmp_path / "a")
    Snapshot.take(path, _state(torch.arange(6.0), "v" + BAD))
    return path


@pytest.fixture
def other(tmp_path) -> str:
    """``snap`` with the tensor's dtype and the str's value changed and a key added."""
    path = str(tmp_path / "b")
    Snapshot.take(path, _state(torch.arange(6), "u" + BAD, {"x" + BAD: 2}))
    return path


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _location(path: str, logical: str) -> Location:
    return load_manifest(path, None).entries[logical].locations[0]


def _flip(path: str, logical: str) -> None:
    loc = _location(path, logical)
    with open(os.path.join(path, loc.blob), "r+b") as f:
        f.seek(loc.offset)
        byte = f.read(1)
        f.seek(loc.offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def _forge(path: str, old: str, new: str) -> None:
    """Replaces ``old`` with ``new`` in the manifest, its checksum line recomputed."""
    file = os.path.join(path, MANIFEST)
    body = Path(file).read_bytes()
    text = body[: body.rindex(b"# crc32")].decode()
    assert old in text
    Path(file).write_bytes(seal_manifest(text.replace(old, new).encode()))


# ---------------------------------------------------------------------------------------------
# snapshot._engine.format.text


def test_printable_escapes_what_a_terminal_obeys_and_keeps_the_rest():
    assert printable(BAD) == "\\x1b]0;PWNED\\x07\\x1b[2J\\x0d\\u202eevil"
    cases = {
        "\x00\x1f\x7f": "\\x00\\x1f\\x7f",  # C0, DEL
        "\x85\x9b": "\\x85\\x9b",  # C1: NEL, CSI
        "a\nb\tc": "a\\x0ab\\x09c",  # a newline would forge a line of output
        "\u2066x\u2069\u200b\u2028": "\\u2066x\\u2069\\u200b\\u2028",  # isolate, zero width, LS
        "\ud800": "\\ud800",  # a lone surrogate (JSON allows it) cannot even be encoded
        "\U000e0041": "\\U000e0041",  # a tag character
        "\u00a0": "\\xa0",  # a space that looks like U+0020
    }
    for text, shown in cases.items():
        assert printable(text) == shown
    for kept in ("layer.0.weight", "poids_é", "重み", "🙂", "a b", "C:\\data\\w"):
        assert printable(kept) == kept


def test_a_backslash_is_doubled_only_where_it_would_read_as_an_escape():
    assert printable("\\x1b") == "\\\\x1b"  # four characters, not ESC
    assert printable("\\u202e") == "\\\\u202e"
    assert printable("a\\\\") == "a\\\\\\"  # the first of two: the next would read as one
    assert printable("\\\x1b") == "\\\\\\x1b"  # backslash then ESC
    assert printable("x\\") == "x\\" and printable("\\d") == "\\d"
    assert printable("\\x1b") != printable("\x1b")


def test_what_printable_shows_reads_back_exactly():
    alphabet = ["\\", "x", "u", "U", "0", "1", "b", "e", "\x1b", "\n", "\u202e", "\ud800", "é"]
    rng = random.Random(0)
    for _ in range(20_000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 10)))
        shown = printable(text)
        assert shown.isprintable() and not raw_controls(shown)
        assert unescape(shown) == text
        message = printable_message(text)
        assert printable_message(message) == message and not raw_controls(message)
    assert unescape("C:\\data\\w") == "C:\\data\\w"  # typed by hand: reads as it looks
    assert unescape("\\UFFFFFFFF") == "\\UFFFFFFFF"  # past the last code point: itself


def test_printable_message_leaves_backslashes_so_escaped_names_are_not_escaped_twice():
    named = f"no entry {printable(BAD)!s}"
    assert printable_message(named) == named
    assert printable_message("a\x1bb\\x1b") == "a\\x1bb\\x1b"
    # A message's own lines stay lines (a parser's error quoting where it failed).
    assert printable_message("bad YAML\n  in line 3\r") == "bad YAML\n  in line 3\\x0d"


# ---------------------------------------------------------------------------------------------
# What the commands print


def _commands(snap: str, other: str) -> list[list[str]]:
    return [
        ["ls", snap],
        ["ls", snap, "--prefix", ROOT],
        ["du", snap],
        ["verify", snap],
        ["diff", snap, other],
        ["show", snap, ROOT],  # the dict, rebuilt whole: its repr
        ["show", snap, TENSOR],
        ["show", snap, NESTED],
        ["show", snap, VALUE],
        ["show", snap, OBJECT],
        ["show", snap, ROOT + "/w"],  # a near miss: did you mean
        ["ls", snap, "--prefix", ROOT + "/w"],  # the same, for ls
        ["-v", "show", snap, ROOT + "/w"],  # and its traceback
    ]


def test_no_command_prints_a_raw_control_character(capsys, snap, other):
    for argv in _commands(snap, other):
        code, out, err = run(capsys, *argv)
        assert not raw_controls(out + err), (argv, out, err)
        if argv[0] != "verify":  # an intact snapshot's verify names no entry
            assert SHOWN in out + err, (argv, out, err)
        near_miss = argv[-1].endswith("/w")
        assert code == (2 if near_miss else 1 if argv[0] == "diff" else 0), (argv, err)


def test_each_command_shows_the_escaped_paths(capsys, snap, other):
    code, out, _ = run(capsys, "ls", snap)
    assert code == 0
    listed = {line.split()[0] for line in out.splitlines()[1:-1]}
    assert {printable(p) for p in (ROOT, TENSOR, NESTED, VALUE, OBJECT)} <= listed
    code, out, _ = run(capsys, "du", snap)
    assert code == 0 and f"0     {printable(KEY)}" in out
    code, out, _ = run(capsys, "diff", snap, other)
    assert code == 1
    assert re.search(rf"dtype\s+{re.escape(printable(TENSOR))}: float32 -> int64", out)
    assert f"only in B  {printable(ROOT + '/x' + BAD)}" in out
    # A primitive's value is shown as its repr, whose escapes are not escaped again.
    assert f"{printable(VALUE)}: {'v' + BAD!r} -> {'u' + BAD!r}" in out
    code, out, err = run(capsys, "show", snap, ROOT + "/w")
    assert code == 2 and out == ""
    assert printable(TENSOR) in err.split("; close matches: ")[1]


def test_show_takes_a_path_as_ls_prints_it(capsys, snap):
    code, out, _ = run(capsys, "show", snap, printable(TENSOR))
    assert code == 0 and out.startswith(f"{printable(TENSOR)}: tensor\n")
    assert "values  [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]" in out
    # The path as it is (what a script passes) works too.
    assert run(capsys, "show", snap, TENSOR)[:2] == (0, out)


def test_verify_names_a_damaged_entry_escaped(capsys, snap):
    _flip(snap, TENSOR)
    code, out, err = run(capsys, "verify", snap)
    assert code == 1 and err == "" and not raw_controls(out)
    assert out.startswith(f"{printable(TENSOR)}: blob ") and "checksum mismatch" in out
    code, out, err = run(capsys, "show", snap, TENSOR)
    assert (code, out) == (1, "") and not raw_controls(err)
    assert err.count("\n") == 1 and printable(TENSOR) in err and "checksum" in err


def test_a_type_name_forged_into_the_manifest_is_shown_escaped(capsys, snap, other):
    _forge(snap, '"obj_type": "set"', '"obj_type": "set\\u001b[2J\\u202e"')
    code, out, _ = run(capsys, "ls", snap)
    assert code == 0 and not raw_controls(out) and "set\\x1b[2J\\u202e" in out
    code, out, _ = run(capsys, "diff", snap, other)
    assert code == 1 and not raw_controls(out)
    assert re.search(r"type\s+.*: set\\x1b\[2J\\u202e -> set", out)


# ---------------------------------------------------------------------------------------------
# The library's messages


def test_the_librarys_errors_quote_snapshot_names_escaped(snap):
    with pytest.raises(EntryNotFoundError) as e:
        Snapshot(snap).read_object(ROOT + "/w")
    suggested = str(e.value).split("did you mean")[1]  # a list's repr: its paths escaped
    assert not raw_controls(str(e.value)) and repr(ROOT)[:-1] + "/" in suggested
    with pytest.raises(EntryNotFoundError) as e:
        read_entry(snap, ROOT + "/w", None)
    assert not raw_controls(str(e.value))
    assert printable(TENSOR) in str(e.value).split("; close matches: ")[1]
    with pytest.raises(StateMismatchError) as e:
        Snapshot(snap).restore({KEY + "!": StateDict()})
    assert not raw_controls(str(e.value)) and f"it holds [{KEY!r}]" in str(e.value)
    _flip(snap, TENSOR)
    with pytest.raises(CorruptSnapshotError) as e:  # raised where the read met the damage
        Snapshot(snap).read_object(TENSOR)
    message = str(e.value)
    assert not raw_controls(message) and printable_message(TENSOR) in message
    assert message.startswith(f"snapshot {snap}: ")


def test_the_log_formatter_escapes_what_it_logs():
    formatter = cli._PrintableFormatter("%(levelname)s %(message)s")
    record = logging.LogRecord("snapshot", logging.INFO, __file__, 1, "read %s", (TENSOR,), None)
    assert formatter.format(record) == f"INFO read {printable_message(TENSOR)}"


# ---------------------------------------------------------------------------------------------
# Exit codes


def test_not_found_and_usage_errors_are_exit_2(capsys, tmp_path, snap):
    code, out, err = run(capsys, "ls", str(tmp_path / "nothing"))
    assert (code, out) == (2, "") and err.startswith("statesnap: error: no snapshot at ")
    code, _, err = run(capsys, "show", snap, "0/absent")
    assert code == 2 and "has no entry '0/absent'" in err
    for argv in (["ls"], ["frobnicate", snap], ["show", snap, "x", "--values", "0"], []):
        code, out, err = run(capsys, *argv)
        assert (code, out) == (2, "") and "usage: statesnap" in err, argv


def _workspace(tmp_path: Path, name: str) -> hostile.Workspace:
    case = next(c for c in hostile.CASES if c.name == name)
    base = tmp_path / "base"
    if not base.exists():
        hostile.take_base(base)
    return hostile.build(case, base, tmp_path / name)


@pytest.mark.parametrize("case", ["python-tag", "yaml-aliases", "json-nested-100k"])
def test_a_manifest_the_library_never_writes_is_exit_1(capsys, tmp_path, case):
    """A YAML tag, anchors and aliases, arrays nested 100,000 deep: refused when the manifest
    is read, by every command, on one line and without a traceback."""
    root = str(_workspace(tmp_path, case).root)
    with pytest.raises(UnsafeSnapshotError):
        load_manifest(root, None)
    for argv in (["ls", root], ["du", root], ["verify", root], ["show", root, hostile.TENSOR_KEY]):
        code, out, err = run(capsys, *argv)
        assert (code, out) == (1, ""), (argv, err)
        assert err.startswith("statesnap: error: ") and err.count("\n") == 1
        assert len(err) < 4200 and not raw_controls(err) and "Traceback" not in err


def test_a_symlinked_blob_is_exit_1(capsys, tmp_path):
    ws = _workspace(tmp_path, "blob-symlink")
    root = str(ws.root)
    code, out, err = run(capsys, "verify", root)
    assert (code, err) == (1, "") and out.startswith(f"{hostile.TENSOR_KEY}: blob ")
    code, out, err = run(capsys, "show", root, hostile.TENSOR_KEY)
    assert (code, out) == (1, "") and "symbolic link" in err and err.count("\n") == 1
    assert hostile.SECRET.decode() not in out + err


def _raising(monkeypatch, error: BaseException) -> None:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise error

    monkeypatch.setattr(cli_commands, "load_manifest", fail)


@pytest.mark.parametrize(
    ("error", "code", "start"),
    [
        (UnsafeSnapshotError("snapshot s: blob 0/0 is a symlink"), 1, "statesnap: error: "),
        (SnapshotError("snapshot s: something"), 2, "statesnap: error: "),
        (PermissionError(13, "Permission denied"), 2, "statesnap: error: PermissionError: "),
        # A pipe to the store breaking is a failure, not a reader of stdout going away.
        (BrokenPipeError(32, "Broken pipe"), 2, "statesnap: error: BrokenPipeError: "),
        (RecursionError("maximum recursion depth exceeded"), 3, "statesnap: internal error: "),
        (KeyError("entries"), 3, "statesnap: internal error: KeyError: 'entries'"),
    ],
)
def test_every_kind_of_failure_has_its_code(capsys, monkeypatch, snap, error, code, start):
    _raising(monkeypatch, error)
    got, out, err = run(capsys, "ls", snap)
    assert (got, out) == (code, "")
    assert err.startswith(start) and err.count("\n") == 1 and "Traceback" not in err
    got, _, err = run(capsys, "-v", "du", snap)
    assert got == code and "Traceback (most recent call last)" in err
    assert err.splitlines()[-1].startswith(start)


def test_an_internal_error_says_it_is_one(capsys, monkeypatch, snap):
    _raising(monkeypatch, ValueError("unexpected\x1b[2J\nsecond line"))
    code, _, err = run(capsys, "ls", snap)
    assert code == 3 and not raw_controls(err) and err.count("\n") == 1
    assert err == (
        "statesnap: internal error: ValueError: unexpected\\x1b[2J second line "
        "(a bug in statesnap; -v shows the traceback)\n"
    )


def test_a_long_message_is_cut_on_the_error_line(capsys, monkeypatch, snap):
    _raising(monkeypatch, CorruptSnapshotError("bad " + "x" * 100_000))
    code, _, err = run(capsys, "ls", snap)
    assert code == 1 and len(err) < 4200
    assert err.rstrip().endswith("... (96,004 more characters; -v shows them)")


def test_an_interrupt_is_exit_130(capsys, monkeypatch, snap):
    _raising(monkeypatch, KeyboardInterrupt())
    assert run(capsys, "ls", snap) == (130, "", "statesnap: interrupted\n")


def _statesnap(*argv: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "snapshot", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )


def test_a_reader_that_goes_away_keeps_the_commands_code(snap, other):
    # The read end is closed before the command writes: its write fails with EPIPE.
    for argv, code in ((["ls", snap], 0), (["diff", snap, other], 1)):
        child = _statesnap(*argv)
        assert child.stdout is not None
        child.stdout.close()
        _, err = child.communicate(timeout=120)
        assert (child.returncode, err) == (code, b""), argv


def test_output_in_an_encoding_without_the_characters_is_escaped(tmp_path):
    path = str(tmp_path / "s")
    Snapshot.take(path, {"modèle": StateDict(w=torch.ones(2))})
    child = _statesnap("ls", path, env={"PYTHONIOENCODING": "ascii"})
    out, err = child.communicate(timeout=120)
    assert (child.returncode, err) == (0, b"")
    assert b"0/mod\\xe8le/w" in out


def test_the_help_states_the_exit_codes(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0
    table = out[out.index("exit codes:") :]
    for line in ("0    success", "1    verify found", "2    usage error", "3    internal error"):
        assert line in table
    assert "130  interrupted" in table
    readme = Path(REPO, "docs", "cli.md").read_text()
    for code in ("| 0 |", "| 1 |", "| 2 |", "| 3 |", "| 130 |"):
        assert code in readme
