"""Print the import graph of agl's packages, and any import cycles in it.

    python scripts/import_graph.py                 # agl_core's modules, one line each: module -> imports
    python scripts/import_graph.py --all           # every agl package (adapters and trainer too)
    python scripts/import_graph.py --cycles        # only the cycles (exit 1 when there is one)

The graph is read from the source with ``ast``, not by importing anything. Every import statement counts,
at module level or inside a function (a function-level import still makes a cycle at run time), except
those under ``if TYPE_CHECKING:``, which never run. ``from pkg import name`` is an edge to the module
``pkg.name`` when that is a module, else to ``pkg``. A cycle is a strongly connected component of more than
one module.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE_ROOTS = (ROOT / "src", ROOT / "trainer")
PACKAGES = ("agl_core", "agl_langchain", "agl_openai_agents", "agl_autogen", "agl_trainer")


def module_files(packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Every module of ``packages`` by dotted name (a package is its ``__init__``)."""
    found: dict[str, Path] = {}
    for root in SOURCE_ROOTS:
        for package in packages:
            base = root / package
            if not base.is_dir():
                continue
            for path in sorted(base.rglob("*.py")):
                parts = list(path.relative_to(root).with_suffix("").parts)
                if parts[-1] == "__init__":
                    parts.pop()
                found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Import statements that can run: all of them but those under ``if TYPE_CHECKING:``."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules that module ``name`` (at ``path``) imports, by dotted name, whether known or not."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
            continue
        if node.level:
            base_parts = name.split(".")
            drop = node.level - 1 if is_package else node.level
            base_parts = base_parts[: len(base_parts) - drop] if drop else base_parts
            base = ".".join(base_parts + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        for alias in node.names:
            child = f"{base}.{alias.name}"
            out.add(child if child in known else base)
    return out


def graph(packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """Module -> the modules of ``packages`` it imports (itself excluded)."""
    files = module_files(packages)
    known = set(files)
    return {
        name: {m for m in imported_modules(name, path, known) if m in known and m != name}
        for name, path in files.items()
    }


def folder_of(module: str) -> str:
    """The part of its package a module belongs to: ``agl_core.store`` for ``agl_core.store.sqlite``,
    ``agl_core.tracing`` for the top-level module ``agl_core.tracing``, the package itself for its
    ``__init__``."""
    return ".".join(module.split(".")[:2])


def folder_graph(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph folded to folders (:func:`folder_of`): folder -> the other folders of the same
    package its modules import. An edge from a package's ``__init__`` (which re-exports its public names)
    is left out: it points down to every folder by design."""
    folded: dict[str, set[str]] = {}
    for src, targets in edges.items():
        if "." not in src:
            continue  # a package's __init__
        a = folder_of(src)
        folded.setdefault(a, set()).update(
            folder_of(t)
            for t in targets
            if "." in t and t.split(".")[0] == src.split(".")[0] and folder_of(t) != a
        )
    return folded


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(found)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="every agl package, not only agl_core")
    parser.add_argument("--cycles", action="store_true", help="print only the cycles")
    parser.add_argument("--folders", action="store_true", help="one node per folder (or top-level module)")
    args = parser.parse_args(argv)
    edges = graph(PACKAGES if args.all else ("agl_core",))
    if args.folders:
        edges = folder_graph(edges)
    found = cycles(edges)
    if not args.cycles:
        for name in sorted(edges):
            print(f"{name} -> {', '.join(sorted(edges[name])) or '-'}")
        print()
    kind = "folders" if args.folders else "modules"
    imports = sum(len(v) for v in edges.values())
    print(f"{len(edges)} {kind}, {imports} imports, {len(found)} cycle(s)")
    for component in found:
        print("cycle: " + " <-> ".join(component))
    return 1 if args.cycles and found else 0


if __name__ == "__main__":
    raise SystemExit(main())
