"""The library's structure, read from its source with ``ast`` (nothing is imported): no import
cycles among its modules, ``manifest`` and ``storage_plugins`` below ``snapshot`` (neither
imports ``snapshot`` nor ``torch.distributed``), and no module longer than a reader can hold.

The import graph counts what runs: imports at module level and inside functions alike, but not
those under ``if TYPE_CHECKING:`` (annotations only). ``from pkg import name`` is an import of
the submodule ``pkg.name`` when there is one, else of ``pkg``. An import of ``a.b.c`` is an edge
to that module only, not to the packages above it: their ``__init__`` runs first, but counting
that would tie every module to its package's ``__init__``, which imports the public API; the
graph follows what each module names.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("snapshot", "manifest", "storage_plugins")
# The layers below ``snapshot``: plain data and bytes, usable without the engine or a process
# group.
LOWER = ("manifest", "storage_plugins")
FORBIDDEN_BELOW = ("snapshot", "torch.distributed")
MAX_LINES = 600


# ---------------------------------------------------------------------------------------------
# Reading the source.


def find_modules(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Dotted module name -> its file, for every ``.py`` file of ``packages`` under ``root``
    (a package under its own name, from its ``__init__.py``)."""
    found: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    """``TYPE_CHECKING`` or ``<module>.TYPE_CHECKING`` (``typing.TYPE_CHECKING``)."""
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _runtime_imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement that runs, at any depth, leaving out the bodies of
    ``if TYPE_CHECKING:`` (their ``else`` runs, and is kept)."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The module a ``from`` import names, relative imports resolved against ``module``."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def import_statements(path: Path, module: str) -> list[tuple[str, list[str]]]:
    """What ``module`` (at ``path``) imports at run time, one ``(base, names)`` per statement:
    ``import a.b`` is ``("a.b", [])``, ``from a import b, c`` is ``("a", ["b", "c"])``, with
    relative imports made absolute."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    found: list[tuple[str, list[str]]] = []
    for node in _runtime_imports(tree):
        if isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
        else:
            found.append((_absolute(node, module, is_package), [a.name for a in node.names]))
    return found


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The library module ``name`` is, or is in (``pkg.mod.Class`` -> ``pkg.mod``); None
    outside the library."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(
    modules: dict[str, Path],
) -> tuple[dict[str, set[str]], dict[str, list[tuple[str, list[str]]]]]:
    """(module -> the library modules it imports at run time, module -> its import
    statements as ``import_statements`` gives them)."""
    graph: dict[str, set[str]] = {}
    statements: dict[str, list[tuple[str, list[str]]]] = {}
    for module, path in modules.items():
        found = statements[module] = import_statements(path, module)
        targets: set[str | None] = set()
        for base, names in found:
            if not names:
                targets.add(_owner(base, modules))
            for name in names:
                # ``from pkg import name``: the submodule ``pkg.name`` when there is one.
                full = f"{base}.{name}"
                targets.add(full if full in modules else _owner(base, modules))
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph, statements


# ---------------------------------------------------------------------------------------------
# The checks.


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected component of ``graph`` that has
    one, found without recursion (Tarjan's algorithm, iterative), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[set[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = []
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        work.append((start, iter(sorted(graph.get(start, ())))))
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph.get(node, ()):
                    components.append(component)
    return sorted(_cycle_in(graph, c) for c in components)


def _cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module, within the component."""
    first = min(component)
    paths = {first: [first]}
    queue = [first]
    for node in queue:
        for child in sorted(graph.get(node, ())):
            if child == first:
                return [*paths[node], first]
            if child in component and child not in paths:
                paths[child] = [*paths[node], child]
                queue.append(child)
    raise AssertionError(f"no cycle through {first}")  # pragma: no cover


def layering_violations(
    statements: dict[str, list[tuple[str, list[str]]]],
    lower: Iterable[str],
    forbidden: Iterable[str],
) -> list[str]:
    """``"module imports name"`` for each import, by a module of a ``lower`` package, of a
    ``forbidden`` module or anything below one (``from torch import distributed`` included)."""
    lower, forbidden = tuple(lower), tuple(forbidden)

    def banned(name: str) -> bool:
        return any(name == f or name.startswith(f + ".") for f in forbidden)

    found = []
    for module, found_statements in sorted(statements.items()):
        if not any(module == p or module.startswith(p + ".") for p in lower):
            continue
        for base, names in found_statements:
            if banned(base):
                found.append(f"{module} imports {base}")
            else:
                found.extend(f"{module} imports {base}.{n}" for n in names if banned(f"{base}.{n}"))
    return sorted(found)


def oversized(modules: dict[str, Path], limit: int) -> list[str]:
    """``"path: N lines"`` for each module longer than ``limit`` lines."""
    found = []
    for path in sorted(modules.values()):
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > limit:
            found.append(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}: {n}")
    return found


# ---------------------------------------------------------------------------------------------
# The library.


def _library() -> tuple[
    dict[str, Path], dict[str, set[str]], dict[str, list[tuple[str, list[str]]]]
]:
    modules = find_modules(ROOT, PACKAGES)
    graph, statements = import_graph(modules)
    return modules, graph, statements


def test_no_import_cycles():
    _, graph, _ = _library()
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_manifest_and_storage_plugins_import_neither_snapshot_nor_torch_distributed():
    _, _, statements = _library()
    found = layering_violations(statements, LOWER, FORBIDDEN_BELOW)
    assert not found, "\n".join(found)


def test_no_module_is_longer_than_the_limit():
    modules, _, _ = _library()
    found = oversized(modules, MAX_LINES)
    assert not found, f"modules over {MAX_LINES} lines:\n" + "\n".join(found)


# Interpreter and torch internals the library must not reach for: the C API through ctypes,
# ctypes' private function addresses, torch's dispatch keys, threading's private exit hooks.
INTERNALS = frozenset(
    {"pythonapi", "_memmove_addr", "_memset_addr", "_dispatch_keys", "_register_atexit"}
)


def internals_used(modules: dict[str, Path]) -> list[str]:
    """``module:line name`` for each attribute or imported name in ``INTERNALS``."""
    found = []
    for name, path in sorted(modules.items()):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in INTERNALS:
                found.append(f"{name}:{node.lineno} {node.attr}")
            elif isinstance(node, ast.ImportFrom):
                found += [
                    f"{name}:{node.lineno} {a.name}" for a in node.names if a.name in INTERNALS
                ]
    return found


def test_no_interpreter_internals():
    modules, _, _ = _library()
    found = internals_used(modules)
    assert not found, "interpreter or torch internals used:\n" + "\n".join(found)


def test_the_internals_check_finds_each_form(tmp_path):
    (tmp_path / "m.py").write_text(
        "import ctypes\nfrom threading import _register_atexit\n"
        "api = ctypes.pythonapi\nkeys = torch._C._dispatch_keys(t)\n"
    )
    found = internals_used({"m": tmp_path / "m.py"})
    assert found == ["m:2 _register_atexit", "m:3 pythonapi", "m:4 _dispatch_keys"]


def test_the_library_is_found():
    modules, graph, _ = _library()
    assert {"snapshot", "snapshot.snapshot", "manifest.codec", "storage_plugins.fs"} <= set(modules)
    assert "manifest.entries" in graph["manifest.codec"]


# ---------------------------------------------------------------------------------------------
# The checks themselves, on a package made for them.


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_graph_follows_runtime_imports_only(tmp_path):
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.a import A\n",
            "pkg/a.py": "import pkg.b\nA = 1\n",
            # A function-level import runs too: a cycle a -> b -> a.
            "pkg/b.py": "def f():\n    from pkg import a\n    return a\n",
            # Annotations only: no edge to d, and so no cycle c -> d -> c.
            "pkg/c.py": (
                "import typing\nfrom typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from pkg.d import D\n"
                "if typing.TYPE_CHECKING:\n    import pkg.d\nelse:\n    import pkg.e\n"
            ),
            "pkg/d.py": "from pkg.c import *\nclass D: ...\n",
            # Relative imports; a name that is not a module is an edge to its module.
            "pkg/e.py": "from . import sub\nfrom .sub.g import G\nfrom .a import A\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/g.py": "from ..d import D\nG = 2\n",
        },
    )
    modules = find_modules(tmp_path, ["pkg"])
    assert set(modules) == {
        "pkg",
        "pkg.a",
        "pkg.b",
        "pkg.c",
        "pkg.d",
        "pkg.e",
        "pkg.sub",
        "pkg.sub.g",
    }
    graph, _ = import_graph(modules)
    assert graph["pkg"] == {"pkg.a"}
    assert graph["pkg.a"] == {"pkg.b"}
    assert graph["pkg.b"] == {"pkg.a"}
    assert graph["pkg.c"] == {"pkg.e"}
    assert graph["pkg.d"] == {"pkg.c"}
    assert graph["pkg.e"] == {"pkg.sub", "pkg.sub.g", "pkg.a"}
    assert graph["pkg.sub.g"] == {"pkg.d"}
    assert cycles(graph) == [
        ["pkg.a", "pkg.b", "pkg.a"],
        ["pkg.c", "pkg.e", "pkg.sub.g", "pkg.d", "pkg.c"],
    ]


def test_a_cycle_is_named_and_an_acyclic_graph_passes():
    assert cycles({"x": {"y"}, "y": {"z"}, "z": set()}) == []
    assert cycles({"x": {"y"}, "y": {"z"}, "z": {"x"}, "w": {"x"}}) == [["x", "y", "z", "x"]]
    assert cycles({"x": {"x"}}) == [["x", "x"]]


def test_the_layering_check_catches_an_import_from_above(tmp_path):
    _write(
        tmp_path,
        {
            "low/__init__.py": "",
            "low/ok.py": "import torch\nfrom torch import nn\nimport snapshotting\n",
            "low/bad.py": "def f():\n    import torch.distributed as dist\n    return dist\n",
            "low/worse.py": "from top.engine import thing\n",
            "low/grey.py": "from torch import distributed, nn\n",
            "top/__init__.py": "",
            "top/engine.py": "import low.ok\nimport torch.distributed\n",
        },
    )
    modules = find_modules(tmp_path, ["low", "top"])
    _, statements = import_graph(modules)
    assert layering_violations(statements, ["low"], ["top", "torch.distributed"]) == [
        "low.bad imports torch.distributed",
        "low.grey imports torch.distributed",
        "low.worse imports top.engine",
    ]


def test_the_length_check_names_the_file_and_its_length(tmp_path):
    _write(
        tmp_path,
        {"pkg/__init__.py": "", "pkg/short.py": "x = 1\n" * 600, "pkg/long.py": "x = 1\n" * 601},
    )
    found = oversized(find_modules(tmp_path, ["pkg"]), 600)
    assert found == [f"{tmp_path / 'pkg' / 'long.py'}: 601"]


# ---------------------------------------------------------------------------------------------
# The engine's concern folders (docs/architecture.md, "Rules between layers").

ENGINE = "snapshot._engine"


def _in(module: str, *folders: str) -> bool:
    """Whether ``module`` is in one of the engine's ``folders`` (in the engine at all: none)."""
    if not folders:
        return module == ENGINE or module.startswith(f"{ENGINE}.")
    return any(module == f"{ENGINE}.{f}" or module.startswith(f"{ENGINE}.{f}.") for f in folders)


def folder_violations(graph: dict[str, set[str]]) -> list[str]:
    """``"a imports b"`` for each import that crosses the engine's folders against the rules:
    only the public face and tools/ drive tools/; manager/ is driven by the public face and
    tools/; a take and a restore do not reach into each other; the kinds of values are handed
    the planner and the loader, never import them; the bytes below (format/, io/) know nothing
    of restores, process groups, tools or the manager; and only tools/ uses the public facade."""
    rules: list[tuple[Callable[[str], bool], Callable[[str], bool]]] = [
        (lambda a: _in(a) and not _in(a, "tools"), lambda b: _in(b, "tools")),
        (lambda a: _in(a) and not _in(a, "tools", "manager"), lambda b: _in(b, "manager")),
        (lambda a: _in(a, "take"), lambda b: _in(b, "restore")),
        (lambda a: _in(a, "restore"), lambda b: _in(b, "take")),
        (
            lambda a: _in(a, "handlers"),
            lambda b: (
                b in {f"{ENGINE}.take.plan", f"{ENGINE}.take.take"}
                or b in {f"{ENGINE}.restore.loader", f"{ENGINE}.restore.restore"}
            ),
        ),
        (
            lambda a: _in(a, "format", "io"),
            lambda b: _in(b, "restore", "dist", "tools", "manager"),
        ),
        (
            lambda a: _in(a) and not _in(a, "tools"),
            lambda b: b in {"snapshot.snapshot", "snapshot.manager", "snapshot.export"},
        ),
    ]
    return sorted(
        f"{a} imports {b}"
        for a, targets in graph.items()
        for b in targets
        for source, target in rules
        if source(a) and target(b)
    )


def test_the_engine_folders_import_by_the_rules():
    _, graph, _ = _library()
    found = folder_violations(graph)
    assert not found, "\n".join(found)


def test_the_folder_rules_catch_a_crossing():
    graph = {
        f"{ENGINE}.io.stage": {f"{ENGINE}.restore.loader"},
        f"{ENGINE}.runtime": {f"{ENGINE}.tools.verify", "snapshot.errors"},
        f"{ENGINE}.tools.verify": {f"{ENGINE}.restore.loader", "snapshot.snapshot"},
    }
    assert folder_violations(graph) == [
        f"{ENGINE}.io.stage imports {ENGINE}.restore.loader",
        f"{ENGINE}.runtime imports {ENGINE}.tools.verify",
    ]


def test_every_folder_of_the_library_is_a_package():
    # A folder without __init__.py imports as a namespace package from a checkout but is left
    # out of a wheel built by package discovery.
    missing = [
        str(d.relative_to(ROOT))
        for package in PACKAGES
        for d in [ROOT / package, *(ROOT / package).rglob("*")]
        if d.is_dir() and d.name != "__pycache__" and not (d / "__init__.py").exists()
    ]
    assert not missing, missing
