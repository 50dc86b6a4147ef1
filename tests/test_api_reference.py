"""The API reference (``mkdocs.yml``, ``docs/api/``): every public name it documents has a
docstring that says what it does and names its parameters, its pages link only to pages that
exist, and the strict build passes (``python -m mkdocs build --strict``, with the ``docs`` extra
installed)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import textwrap
from typing import Any

import pytest

import snapshot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
API = os.path.join(ROOT, "docs", "api")
# ``::: dotted.name`` lines: what mkdocstrings renders on a reference page.
DIRECTIVE = re.compile(r"^::: ([\w.]+)\s*$", re.M)
# What the build needs beyond the library (the ``docs`` extra, by import name).
BUILD_MODULES = ("mkdocs", "mkdocstrings", "mkdocstrings_handlers.python")


def _pages() -> dict[str, str]:
    pages = {}
    for name in sorted(os.listdir(API)):
        if name.endswith(".md"):
            with open(os.path.join(API, name), encoding="utf-8") as f:
                pages[name] = f.read()
    return pages


def _resolve(dotted: str) -> Any:
    """The object ``dotted`` names: a module, or a name within one."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise LookupError(dotted)


def _documented() -> dict[str, Any]:
    """Every public name: ``snapshot.__all__`` and each name a reference page renders."""
    names = {f"snapshot.{n}": getattr(snapshot, n) for n in snapshot.__all__ if n != "__version__"}
    for text in _pages().values():
        for dotted in DIRECTIVE.findall(text):
            names[dotted] = _resolve(dotted)
    return names


def _members(cls: type) -> dict[str, Any]:
    """The public methods and properties a class defines itself (inherited ones are documented
    where they are defined; a dataclass's generated methods are not the class's own words)."""
    out = {}
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if inspect.isfunction(value) or isinstance(value, property):
            out[name] = value  # (a property's docstring is inherited by an override)
    return out


def _parameters(fn: Any) -> list[str]:
    """The parameters a caller passes (not ``self``/``cls``, ``*args``/``**kwargs``)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    return [
        p.name
        for p in signature.parameters.values()
        if p.name not in ("self", "cls") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]


def _words(text: str | None) -> set[str]:
    return set(re.findall(r"\w+", text or ""))


def _field_docs(cls: type) -> set[str]:
    """The names of the class-body fields that carry words of their own: an attribute
    docstring (a string right below it, which the reference renders) or a ``#:`` comment."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return set()
    lines = textwrap.dedent(source).splitlines()
    body = ast.parse("\n".join(lines)).body[0]
    assert isinstance(body, ast.ClassDef)
    found = set()
    for i, node in enumerate(body.body):
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        after = body.body[i + 1] if i + 1 < len(body.body) else None
        if (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)) or lines[
            node.lineno - 2
        ].strip().startswith("#:"):
            found.add(node.target.id)
    return found


# "Like :meth:`take`, but ...": the parameters are the named sibling's, documented there.
_LIKE = re.compile(r"^Like (?::meth:)?`+(\w+)`+")


def _problems(label: str, obj: Any, owner: type | None = None) -> list[str]:
    """What the docstring of ``obj`` lacks: any words at all; for a function, a mention of
    each parameter (for a class, of each constructor parameter that is no documented field)."""
    doc = inspect.getdoc(obj)
    if not doc or not doc.strip():
        return [f"{label}: no docstring"]
    if inspect.isfunction(obj):
        words = _words(doc)
        like = _LIKE.match(doc)
        if like and owner is not None and hasattr(owner, like.group(1)):
            words |= _words(inspect.getdoc(getattr(owner, like.group(1))))
        missing = [p for p in _parameters(obj) if p not in words]
        if missing:
            return [f"{label}: docstring does not mention parameter(s) {', '.join(missing)}"]
    if inspect.isclass(obj):
        init = obj.__init__
        if not inspect.isfunction(init) or init is object.__init__:
            return []
        # A constructor's words: the class's docstring and its bases', __init__'s, and the
        # fields' own; a private parameter (``_manifest``) is none of the caller's business.
        words = _words(init.__doc__)
        for base in obj.__mro__:
            if base is not object and base.__module__ != "builtins":
                words |= _words(base.__doc__) | _field_docs(base)
        missing = [p for p in _parameters(init) if not p.startswith("_") and p not in words]
        if missing:
            return [
                f"{label}: docstring does not mention constructor parameter(s) {', '.join(missing)}"
            ]
    return []


def test_every_public_name_has_a_docstring():
    problems = []
    for label, obj in _documented().items():
        if not (inspect.isclass(obj) or inspect.isfunction(obj) or inspect.ismodule(obj)):
            continue  # a constant or an alias: the page's own words describe it
        problems += _problems(label, obj)
        if inspect.isclass(obj):
            for name, member in _members(obj).items():
                problems += _problems(f"{label}.{name}", member, obj)
    assert not problems, "public names whose docstrings lack words:\n" + "\n".join(problems)


def test_reference_pages_link_only_to_pages_that_exist():
    broken = []
    for name, text in _pages().items():
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if "://" in target:
                continue
            if not os.path.exists(os.path.normpath(os.path.join(API, target))):
                broken.append(f"{name}: {target}")
    assert not broken, f"links to files that do not exist: {broken}"


def test_every_reference_page_is_in_the_nav():
    with open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8") as f:
        config = f.read()
    missing = [n for n in _pages() if f"api/{n}" not in config]
    assert not missing, f"pages under docs/api missing from mkdocs.yml's nav: {missing}"


@pytest.mark.slow
def test_strict_build_passes(tmp_path):
    for module in BUILD_MODULES:
        if importlib.util.find_spec(module.split(".")[0]) is None or (
            "." in module and importlib.util.find_spec(module) is None
        ):
            pytest.skip(f"{module} is not installed (pip install -e '.[docs]')")
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (site / "api" / "snapshot" / "index.html").exists()
    page = (site / "api" / "snapshot" / "index.html").read_text(encoding="utf-8")
    assert "read_object" in page and "async_take" in page
