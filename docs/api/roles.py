"""A mkdocs hook (``hooks:`` in mkdocs.yml): the docstrings cross-reference in Sphinx's roles
(``:class:`~snapshot.Options```), which mkdocstrings leaves as text before a code span; this
drops the role and a leading ``~`` with the module path it hides, leaving the name as code."""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:class|meth|func|mod|attr|data|exc|obj):<code>(~?)([^<]*)</code>")


def _name(match: re.Match[str]) -> str:
    short, name = match.group(1), match.group(2)
    return f"<code>{name.rsplit('.', 1)[-1] if short else name}</code>"


def on_page_content(html: str, **kwargs: Any) -> str:
    """The page's HTML with each role's prefix removed."""
    return _ROLE.sub(_name, html)
