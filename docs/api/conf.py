"""Sphinx settings of agl's API reference, generated from the docstrings of the public modules.

Build: ``sphinx-build -W -b html docs/api site/api`` (``-W``: any warning fails the build;
``tests/test_api_reference.py`` runs it)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "trainer")]

project = "agl"
extensions = ["sphinx.ext.autodoc"]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_title = "agl API reference"
