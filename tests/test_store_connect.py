"""agl_core.store.connect (one way to open a store from what names it) and SpanReader (one incremental
reader of a store's spans, the stored-traces job's and agl improve's watcher's), on real SQLite,
PostgreSQL and a running store."""

from __future__ import annotations

import pytest

from agl_core import semconv
from agl_core.records import Span
from agl_core.store import SpanReader, SqliteStore, StoreClient, StoreError, connect
from agl_core.store.postgres import PostgresStore

from .conftest import POSTGRES_DSN, make_span


def _spans(rollout: str, n: int) -> list[Span]:
    return [make_span(f"step-{i}", {semconv.ROLLOUT_ID: rollout}) for i in range(n)]


def test_connect_opens_what_the_target_names(tmp_path, store_server):
    db = tmp_path / "store.sqlite"
    for target in (str(db), f"sqlite:///{db}"):
        opened = connect(target)
        assert isinstance(opened, SqliteStore)
        opened.close()
    client = connect(store_server.url, None)
    assert isinstance(client, StoreClient) and client.url == store_server.url
    client.close()
    pg = connect(POSTGRES_DSN)
    assert isinstance(pg, PostgresStore)
    pg.close()


def test_connect_refuses_a_missing_file_when_reading_and_an_empty_name(tmp_path):
    missing = tmp_path / "nope.sqlite"
    with pytest.raises(StoreError, match="neither a store URL .*, a PostgreSQL DSN .* nor an existing"):
        connect(str(missing), must_exist=True)
    assert not missing.exists()  # nothing created
    with pytest.raises(StoreError, match="no store named"):
        connect("  ")


def test_the_reader_reads_only_what_is_new_and_the_records_of_the_rollouts(sqlite_store):
    sqlite_store.add_spans(_spans("ro-1", 5))
    reader = SpanReader(page=2)  # pages of 2: three queries for 5 spans
    assert reader.read(sqlite_store) == 5
    sqlite_store.add_spans(_spans("ro-2", 3))
    assert reader.read(sqlite_store) == 3
    assert reader.read(sqlite_store) == 0
    assert [s.name for s in reader.spans] == [f"step-{i}" for i in range(5)] + [f"step-{i}" for i in range(3)]
    assert len({s.seq for s in reader.spans}) == 8 and reader.cursor == max(s.seq or 0 for s in reader.spans)
    assert reader.records == {}  # spans name rollouts the store holds no record of: looked up, none


class _FailsOnSecondPage:
    """A backend that serves one page, then goes away (a store restarting mid-read)."""

    def __init__(self, store: SqliteStore) -> None:
        self.store, self.calls = store, 0

    def query_spans(self, *, after_seq: int, limit: int) -> list[Span]:
        self.calls += 1
        if self.calls == 2:
            raise StoreError("the store went away")
        return self.store.query_spans(after_seq=after_seq, limit=limit)

    def get_rollouts(self, ids):  # type: ignore[no-untyped-def]
        return self.store.get_rollouts(ids)


def test_a_read_that_fails_midway_keeps_the_pages_it_read_and_goes_on_from_there(sqlite_store):
    sqlite_store.add_spans(_spans("ro-1", 5))
    reader = SpanReader(page=2)
    flaky = _FailsOnSecondPage(sqlite_store)
    with pytest.raises(StoreError):
        reader.read(flaky)
    assert len(reader.spans) == 2  # the first page, and the cursor after it
    assert reader.read(flaky) == 3  # the next read goes on from there: no span lost, none twice
    assert len({(s.trace_id, s.span_id) for s in reader.spans}) == 5
