"""Text from a snapshot made safe to show: keys, blob names and values are untrusted, and a
terminal obeys the control characters in what it prints.

:func:`printable` shows every character ``str.isprintable`` refuses (controls, format and bidi
characters, separators, surrogates, private-use and unassigned code points) as an escape in
Python's notation (``\\x1b``, ``\\u202e``), and doubles a backslash only where it would start
such an escape, so each shown text reads back to exactly one text (:func:`unescape`) and names
such as ``C:\\data`` are shown unchanged. :func:`printable_message` escapes the same characters in
a message already made of shown names, leaving backslashes and line breaks alone (idempotent).
"""

from __future__ import annotations

import re

# A backslash that would read as the start of an escape if it were shown as it is.
_AMBIGUOUS_BACKSLASH = re.compile(r"\\(?=[\\xuU])")
# An escape as :func:`printable` writes it; any other backslash stands for itself.
_ESCAPE = re.compile(r"\\(?:\\|x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8})")


def _escape(ch: str) -> str:
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def printable(text: str) -> str:
    """``text`` with every character a terminal would not show as a glyph escaped (``\\x1b``),
    and a backslash doubled where it would otherwise read as an escape; reversed by
    :func:`unescape`."""
    if text.isprintable():  # the common case: at most some backslashes to double
        return _AMBIGUOUS_BACKSLASH.sub(r"\\\\", text) if "\\" in text else text
    out = []
    last = len(text) - 1
    for i, ch in enumerate(text):
        if not ch.isprintable():
            out.append(_escape(ch))
        # A backslash before a character that would make the pair read as an escape.
        elif ch == "\\" and i < last and (text[i + 1] in "\\xuU" or not text[i + 1].isprintable()):
            out.append("\\\\")
        else:
            out.append(ch)
    return "".join(out)


def printable_message(text: str) -> str:
    """``text`` with the characters :func:`printable` escapes escaped, except line breaks
    (``\n``), and backslashes left as they are: for a message that quotes names already shown
    with :func:`printable` (or ``repr``), made safe for a terminal whatever else it holds.
    Idempotent."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() or ch == "\n" else _escape(ch) for ch in text)


def unescape(shown: str) -> str:
    """The text that :func:`printable` showed as ``shown``: ``\\\\`` is a backslash, ``\\xHH``,
    ``\\uHHHH`` and ``\\UHHHHHHHH`` are the characters they name, and any other backslash stands
    for itself (so text typed by hand, ``C:\\data``, reads as it looks)."""
    if "\\" not in shown:
        return shown
    return _ESCAPE.sub(_unescape_one, shown)


def _unescape_one(match: re.Match[str]) -> str:
    escape = match.group()
    if escape == "\\\\":
        return "\\"
    code = int(escape[2:], 16)
    # Past the last code point: not an escape printable() writes, so it stands for itself.
    return chr(code) if code <= 0x10FFFF else escape
