"""Importing an example's modules in tests: each example folder has its own ``agent`` (and often other
modules of names that another example uses too), so a test imports them afresh from their folder and
drops them from ``sys.modules`` afterwards; the module objects it got keep working."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType


def import_fresh(folder: Path, name: str, modules: Sequence[str]) -> ModuleType:
    """Module ``name`` imported from ``folder``, with ``modules`` (the folder's modules it may import)
    dropped from ``sys.modules`` before and after."""
    sys.path.insert(0, str(folder))
    try:
        for module in modules:
            sys.modules.pop(module, None)
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(folder))
        for module in modules:
            sys.modules.pop(module, None)
