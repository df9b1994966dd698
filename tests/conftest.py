from __future__ import annotations

import itertools
import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agl_core.records import Span
from agl_core.store import SqliteStore, StoreClient
from agl_core.testing import Collector

#: The test kit's fixtures (``agl_stack``, ``agl_collector``, ``agl_memory``, ``agl_script``).
pytest_plugins = ["agl_core.testing.pytest_plugin"]


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread() -> None:
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)


#: PostgreSQL on this machine (trust auth); override with AGL_TEST_POSTGRES.
POSTGRES_DSN = os.environ.get("AGL_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")


@pytest.fixture
def sqlite_store(tmp_path) -> Iterator[SqliteStore]:
    s = SqliteStore(tmp_path / "store.sqlite")
    yield s
    s.close()


@pytest.fixture
def postgres_store() -> Iterator[Any]:
    """A PostgresStore in a schema of its own, dropped afterwards."""
    import psycopg

    from agl_core.store.postgres import PostgresStore

    schema = f"agl_test_{uuid.uuid4().hex[:12]}"
    s = PostgresStore(POSTGRES_DSN, schema=schema)
    yield s
    s.close()
    with psycopg.connect(POSTGRES_DSN, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA "{schema}" CASCADE')


@pytest.fixture(params=["sqlite", "postgres"])
def store(request) -> Any:
    """Every test using ``store`` (or the server and client on top of it) runs on both backends."""
    return request.getfixturevalue(f"{request.param}_store")


@pytest.fixture
def store_server(store) -> Iterator[Collector]:
    """The store's HTTP server (OTLP/HTTP ingest and the API) on a free port; ``.url`` is its address."""
    with Collector(store) as server:
        yield server


@pytest.fixture
def client(store_server) -> Iterator[StoreClient]:
    with StoreClient(store_server.url) as c:
        yield c


_ids = itertools.count(1)


def make_span(
    name: str,
    attributes: dict[str, Any] | None = None,
    *,
    parent: Span | None = None,
    trace_id: str | None = None,
    start: int | None = None,
    status: str = "UNSET",
) -> Span:
    """A hand-built span with deterministic ids and increasing times."""
    n = next(_ids)
    start_ns = start if start is not None else n * 1000
    return Span(
        trace_id=trace_id or (parent.trace_id if parent else f"{n:032x}"),
        span_id=f"{n:016x}",
        parent_span_id=parent.span_id if parent else None,
        name=name,
        start_ns=start_ns,
        end_ns=start_ns + 500,
        attributes=attributes or {},
        status_code=status,
    )


@pytest.fixture(scope="session")
def tiny_policy() -> tuple[Any, Any]:
    """The tiny random Llama model with SmolLM2's tokenizer (session-wide; tests must not train it)."""
    from agl_trainer.model import load_policy

    return load_policy("tiny", seed=0)


_EXAMPLES = str(Path(__file__).resolve().parent.parent / "examples")


def _forget_example_modules() -> None:
    for name, module in list(sys.modules.items()):
        if (getattr(module, "__file__", None) or "").startswith(_EXAMPLES):
            del sys.modules[name]


@pytest.fixture(autouse=True, scope="module")
def _examples_do_not_leak_between_files() -> Iterator[None]:
    """Each example imports its own flat modules (``agent``, ``reward``...); forget them between test files
    so one example's ``agent`` is never another's, whatever order the files run in."""
    _forget_example_modules()
    yield
    _forget_example_modules()
