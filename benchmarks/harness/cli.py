"""Argument types shared by the command line and the cases' own options."""

from __future__ import annotations


def csv_list(text: str) -> list[str]:
    """``a,b,c`` -> ``["a", "b", "c"]`` (blanks dropped)."""
    return [x.strip() for x in text.split(",") if x.strip()]


def int_list(text: str) -> list[int]:
    """``1,2,4`` -> ``[1, 2, 4]``."""
    return [int(x) for x in csv_list(text)]
