"""The layering the code is read by: agl_core at the bottom, the adapters and the trainer above it, one
direction only, no cycles, and a light ``import agl_core``. Read from the source with ``ast``
(``scripts/import_graph.py`` prints the same graph)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def _load_graph_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("agl_import_graph", ROOT / "scripts" / "import_graph.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


graph_tool = _load_graph_tool()
ADAPTERS = ("agl_langchain", "agl_openai_agents", "agl_autogen")


def _all_imports(packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Module -> every module name it imports (agl's or not)."""
    files = graph_tool.module_files(packages)
    return {name: graph_tool.imported_modules(name, path, set(files)) for name, path in files.items()}


def _roots(names: set[str]) -> set[str]:
    return {n.split(".")[0] for n in names}


def test_nothing_under_src_imports_the_trainer():
    offenders = {
        name: sorted(m for m in imported if m.split(".")[0] == "agl_trainer")
        for name, imported in _all_imports(("agl_core", *ADAPTERS)).items()
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_agl_core_imports_no_adapter():
    offenders = {
        name: sorted(_roots(imported) & set(ADAPTERS))
        for name, imported in _all_imports(("agl_core",)).items()
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_adapters_and_trainer_use_only_public_agl_core_modules():
    def private(module: str) -> bool:
        return module.split(".")[0] == "agl_core" and any(p.startswith("_") for p in module.split(".")[1:])

    offenders = {
        name: sorted(m for m in imported if private(m))
        for name, imported in _all_imports((*ADAPTERS, "agl_trainer")).items()
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def _private_owner(module: str) -> str | None:
    """The package a private module belongs to (``agl_core.store`` for ``agl_core.store._sql``), or
    ``None`` for a public module."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:i])
    return None


def private_imports_across_packages(packages: tuple[str, ...]) -> dict[str, list[str]]:
    """agl module -> the private agl modules of other packages it imports. A module whose name (or one of
    whose packages' names) starts with ``_`` is private to the package that holds it, that package's
    subpackages included (docs/development.md)."""
    files = graph_tool.module_files(packages)
    found: dict[str, list[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for module in sorted(graph_tool.imported_modules(name, path, set(files))):
            owner = _private_owner(module)
            if module.split(".")[0] not in packages or owner is None:
                continue  # another project's module, or a public one
            if package != owner and not package.startswith(owner + "."):
                found.setdefault(name, []).append(module)
    return found


AGL_PACKAGES = ("agl_core", *ADAPTERS, "agl_trainer")


def test_no_agl_package_imports_another_packages_private_module():
    assert private_imports_across_packages(AGL_PACKAGES) == {}


def test_the_private_import_check_finds_one(tmp_path, monkeypatch):
    """The check above is not vacuous: a module of one package importing another's private module, as the
    importer once did the store's, is found."""
    root = tmp_path / "agl_fake"
    for folder in ("store", "importer"):
        (root / folder).mkdir(parents=True)
        (root / folder / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "store" / "_sql.py").write_text("X = 1\n")
    (root / "store" / "base.py").write_text("from ._sql import X\n")  # inside its own package: fine
    (root / "importer" / "run.py").write_text("from ..store._sql import X\nfrom ..store.base import X\n")
    monkeypatch.setattr(graph_tool, "SOURCE_ROOTS", (tmp_path,))
    found = private_imports_across_packages(("agl_fake",))
    assert found == {"agl_fake.importer.run": ["agl_fake.store._sql"]}


def test_no_import_cycle_among_agl_modules():
    assert graph_tool.cycles(graph_tool.graph()) == []


def test_folders_import_in_one_direction():
    """Folded to folders (``agl_core.store``, ``agl_trainer.run``, a top-level module as its own), the
    graph has no cycle: a folder never imports one that imports it back, so each package reads as layers."""
    folded = graph_tool.folder_graph(graph_tool.graph())
    assert graph_tool.cycles(folded) == []
    # the layers the trainer is read by, bottom up, pinned by name
    trainer = graph_tool.folder_graph(graph_tool.graph(("agl_trainer",)))
    below = {
        "agl_trainer.learning": {"agl_trainer.run", "agl_trainer.reporting", "agl_trainer.evaluate"},
        "agl_trainer.reporting": {"agl_trainer.run", "agl_trainer.evaluate"},
        "agl_trainer.generation": {"agl_trainer.run", "agl_trainer.learning", "agl_trainer.reporting"},
        "agl_trainer.config": {"agl_trainer.run", "agl_trainer.learning", "agl_trainer.reporting"},
    }
    upward = {folder: sorted(trainer[folder] & above) for folder, above in below.items()}
    assert {k: v for k, v in upward.items() if v} == {}


def test_the_folder_check_finds_a_cycle(tmp_path, monkeypatch):
    """Two folders each importing the other, as ``tracing`` and ``capture`` once did, are a cycle there."""
    root = tmp_path / "agl_fake"
    for folder in ("low", "high"):
        (root / folder).mkdir(parents=True)
        (root / folder / "__init__.py").write_text("")
    (root / "__init__.py").write_text("from .high import b\n")  # an __init__ re-exporting is not an edge
    (root / "low" / "a.py").write_text("from ..high.b import Y\nX = 1\n")
    (root / "high" / "b.py").write_text("Y = 2\n")
    (root / "high" / "c.py").write_text("from ..low.a import X\n")
    monkeypatch.setattr(graph_tool, "SOURCE_ROOTS", (tmp_path,))
    folded = graph_tool.folder_graph(graph_tool.graph(("agl_fake",)))
    assert folded["agl_fake.low"] == {"agl_fake.high"}
    assert graph_tool.cycles(folded) == [["agl_fake.high", "agl_fake.low"]]


def test_the_runner_package_imports_in_one_direction():
    # types -> outcome -> state -> engines -> Runner -> Ray actors -> CLI: a module may import only from
    # layers below its own
    layers = {
        "agl_core.runner._types": 0,
        "agl_core.runner._outcome": 1,
        "agl_core.runner._state": 2,
        "agl_core.runner._engine": 3,
        "agl_core.runner._worker": 3,
        "agl_core.runner._threads": 4,
        "agl_core.runner._async": 4,
        "agl_core.runner._procs": 4,
        "agl_core.runner._runner": 5,
        "agl_core.runner._ray": 6,
        "agl_core.runner.cli": 7,
        "agl_core.runner": 8,
    }
    edges = graph_tool.graph(("agl_core",))
    runner_modules = {m for m in edges if m == "agl_core.runner" or m.startswith("agl_core.runner.")}
    assert runner_modules <= set(layers), sorted(runner_modules - set(layers))
    upward = [
        (src, dst)
        for src in sorted(runner_modules)
        for dst in sorted(edges[src] & runner_modules)
        if layers[dst] >= layers[src]
    ]
    assert upward == []
    # the runner builds rollout URLs without the gateway's web app (Starlette)
    assert not any("agl_core.gateway.app" in edges[m] for m in runner_modules)


def test_import_agl_core_pulls_in_no_framework_torch_or_web_server():
    heavy = {
        "torch",
        "transformers",
        "peft",
        "numpy",
        "starlette",
        "uvicorn",
        "grpc",
        "httpx",
        "pydantic",
        "langchain_core",
        "langgraph",
        "agents",
        "autogen_agentchat",
        "autogen_core",
        "openai",
        "agl_trainer",
        *ADAPTERS,
    }
    code = "import sys, json, agl_core; print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert sorted(set(json.loads(done.stdout)) & heavy) == []
