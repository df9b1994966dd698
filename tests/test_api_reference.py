"""The API reference (docs/api, Sphinx autodoc) builds from the docstrings with no warning, and documents
every name the public packages export."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _build(source: Path, out: Path) -> subprocess.CompletedProcess[str]:
    """The build docs/development.md gives, warnings as errors."""
    return subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "-E", "-q", "-b", "html", str(source), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("api")
    done = _build(ROOT / "docs" / "api", out)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "WARNING" not in done.stderr, done.stderr[-3000:]
    return out


def _anchors(site: Path) -> set[str]:
    ids = re.compile(r'id="([A-Za-z_][\w.]*)"')
    return {a for page in site.glob("*.html") for a in ids.findall(page.read_text())}


def test_every_exported_name_of_the_public_packages_is_documented(site):
    import agl_core
    import agl_core.store
    import agl_trainer

    anchors = _anchors(site)
    names = {
        "agl_core": agl_core.__all__,
        "agl_core.store": agl_core.store.__all__,
        "agl_trainer": agl_trainer.__all__,
    }
    missing = {
        package: [n for n in exported if not any(a == n or a.endswith(f".{n}") for a in anchors)]
        for package, exported in names.items()
    }
    assert {p: m for p, m in missing.items() if m} == {}
    for needed in (
        "agl_trainer.api.Trainer.fit",
        "agl_core.runner.Runner",
        "agl_core.runner.LLM",
        "agl_core.records.Rollout",
        "agl_langchain.instrument",
        "agl_openai_agents.instrument",
        "agl_autogen.instrument",
        "agl_core.gateway.backend.Backend",
        "agl_core.pipeline.transitions.spans_to_transitions",
        "agl_trainer.config.TrainerConfig",
    ):
        assert needed in anchors, needed


def test_a_docstring_sphinx_cannot_read_fails_the_build(tmp_path):
    """The build's -W is what keeps the reference clean: one malformed docstring fails it."""
    (tmp_path / "broken_mod.py").write_text('def f():\n    """Text\n\n    ``unclosed literal\n    """\n')
    (tmp_path / "conf.py").write_text(
        f"import sys\nsys.path.insert(0, {str(tmp_path)!r})\nextensions = ['sphinx.ext.autodoc']\n"
    )
    (tmp_path / "index.rst").write_text("T\n=\n\n.. automodule:: broken_mod\n   :members:\n")
    done = _build(tmp_path, tmp_path / "out")
    assert done.returncode != 0
    assert "WARNING" in done.stderr or "ERROR" in done.stderr
