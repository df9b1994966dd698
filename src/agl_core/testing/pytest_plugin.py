"""pytest fixtures of the agl test kit. Opt in from a ``conftest.py``::

    pytest_plugins = ["agl_core.testing.pytest_plugin"]

==================  ====================================================================================
``agl_collector``   a started :class:`~agl_core.testing.Collector` (SQLite in the test's ``tmp_path``)
``agl_script``      the :data:`~agl_core.testing.Script` of ``agl_stack``'s backend (default:
                    :func:`~agl_core.testing.echo`); override it to script the replies
``agl_stack``       a started :class:`~agl_core.testing.AglTestStack` serving ``agl_script``
``agl_memory``      an :class:`~agl_core.testing.InMemoryTracing` (with the rollout span processor)
==================  ====================================================================================

All are function-scoped and stopped after the test.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from ._collector import Collector
from ._scripted import Script, echo
from ._stack import AglTestStack
from ._tracing import InMemoryTracing

__all__ = ["agl_collector", "agl_memory", "agl_script", "agl_stack"]


@pytest.fixture
def agl_collector(tmp_path: Path) -> Iterator[Collector]:
    with Collector(path=tmp_path / "agl-store.sqlite") as collector:
        yield collector


@pytest.fixture
def agl_script() -> Script | Sequence[str]:
    return echo


@pytest.fixture
def agl_stack(tmp_path: Path, agl_script: Script | Sequence[str]) -> Iterator[AglTestStack]:
    with AglTestStack(script=agl_script, path=tmp_path / "agl-stack.sqlite") as stack:
        yield stack


@pytest.fixture
def agl_memory() -> Iterator[InMemoryTracing]:
    with InMemoryTracing(rollout_spans=True) as tracing:
        yield tracing
