"""Spans sent without a rollout (an agent run outside agl's runner) become rollouts once their trace is
quiet, grouped as import and capture group them: rollout id, then session, then trace."""

from __future__ import annotations

from typing import Any

import pytest

from agl_core import semconv
from agl_core.importer import session_rollout_id, trace_rollout_id
from agl_core.store import NotFoundError
from agl_core.store._loose import LooseSpans
from agl_core.store.service import StoreService
from tests.conftest import make_span


def _rollouts_of(store: Any, trace_id: str) -> set[str | None]:
    return {s.rollout_id for s in store.query_spans(trace_id=trace_id)}


def test_loose_spans_are_grouped_once_their_trace_is_quiet(store):
    root = make_span("agent", {semconv.SESSION_ID: "s-1"})
    child = make_span("llm", parent=root)
    second_turn = make_span("agent", {semconv.SESSION_ID: "s-1"})
    plain = make_span("chain")
    own = make_span("step", {semconv.ROLLOUT_ID: "mine-1"})
    store.add_spans([child])  # children end, and arrive, before their parent
    loose = LooseSpans(quiet_s=10)
    assert store.group_loose_spans(loose, now=0) == (0, 0)
    store.add_spans([root, second_turn, plain, own])
    assert store.group_loose_spans(loose, now=5) == (0, 0)  # root's trace had a span at 5: not quiet
    assert store.stats()["rollouts"] == 0

    assert store.group_loose_spans(loose, now=16) == (4, 2)

    session = session_rollout_id("s-1")
    assert _rollouts_of(store, root.trace_id) == _rollouts_of(store, second_turn.trace_id) == {session}
    assert {s.attributes[semconv.ROLLOUT_ID] for s in store.query_spans(rollout_ids=[session])} == {session}
    assert _rollouts_of(store, plain.trace_id) == {trace_rollout_id(bytes.fromhex(plain.trace_id))}
    records = {r.rollout_id: r for r in store.list_rollouts(limit=50).rollouts}
    assert set(records) == {session, trace_rollout_id(bytes.fromhex(plain.trace_id)), "mine-1"}
    assert records[session].metadata == {"source": "live", semconv.SESSION_ID: "s-1"}
    assert records["mine-1"].metadata == {"source": "live"}
    assert store.stats()["rollouts"] == 3

    # a late span of a grouped trace joins its rollout; a loose span beside a named rollout joins that
    late = make_span("tool", parent=root)
    named = make_span("step", {semconv.ROLLOUT_ID: "mine-2"})
    beside = make_span("llm", parent=named)
    store.add_spans([late, named, beside])
    assert store.group_loose_spans(loose, now=20) == (0, 0)
    assert store.group_loose_spans(loose, now=31) == (2, 2)
    assert _rollouts_of(store, root.trace_id) == {session}
    assert _rollouts_of(store, named.trace_id) == {"mine-2"}
    assert store.get_rollouts(["mine-2"])[0].metadata == {"source": "live"}


def test_grouping_starts_at_the_oldest_loose_span_and_leaves_queued_rollouts_alone(store):
    """A store restarted (a new pass state) still groups what was loose; a rollout that ran under the
    queue keeps its record as it is."""
    (queued,) = store.enqueue_rollouts([{"task_id": "t", "rollout_id": "ro-q"}])
    old = make_span("agent")
    store.add_spans([old, make_span("step", {semconv.ROLLOUT_ID: "ro-q"})])
    loose = LooseSpans(quiet_s=1)
    store.group_loose_spans(loose, now=0)
    assert store.group_loose_spans(loose, now=2) == (1, 1)
    assert store.get_rollouts(["ro-q"])[0].status == queued.status  # still queued, metadata untouched
    assert store.get_rollouts(["ro-q"])[0].metadata == queued.metadata


def test_waiting_traces_are_bounded(sqlite_store):
    loose = LooseSpans(quiet_s=3600, max_traces=3)
    spans = [make_span(f"t{i}") for i in range(5)]
    sqlite_store.add_spans(spans)
    grouped, _ = sqlite_store.group_loose_spans(loose, now=0)
    assert grouped == 2 and len(loose.traces) == 3  # the two oldest grouped at once, three wait
    with pytest.raises(NotFoundError):
        sqlite_store.get_rollouts([trace_rollout_id(bytes.fromhex(spans[-1].trace_id))])


def test_the_store_service_groups_in_its_maintenance(sqlite_store):
    service = StoreService(sqlite_store, group_wait_s=0.01)
    span = make_span("agent", {semconv.GEN_AI_CONVERSATION_ID: "c-7"})
    sqlite_store.add_spans([span])
    service.maintain_once()  # notes the span
    import time

    time.sleep(0.05)
    service.maintain_once()  # groups it
    assert _rollouts_of(sqlite_store, span.trace_id) == {session_rollout_id("c-7")}
    assert StoreService(sqlite_store).loose is None  # off unless asked
    service.close()
