"""Typed Python clients of the collector-store's HTTP API, sync (:class:`StoreClient`) and async
(:class:`AsyncStoreClient`). Both implement the same methods as the ``Store`` protocol's coordination
part, so code written against it runs against a remote store unchanged."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, Generic, TypeVar, cast

import httpx

from .. import settings
from ..pipeline.rewards import EPISODE, Reward, StoredReward, make_reward
from ..records import Attempt, Resource, Rollout, RolloutStatus, Span
from .base import NotFoundError, RolloutFilter, RolloutPage, RolloutRequest, StoreError, StoreUnavailableError
from .formats import wire

__all__ = ["AsyncStoreClient", "StoreClient"]

_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True)
class _Call(Generic[_T]):
    """One API request and how to read its answer (shared by the sync and async clients).

    ``parse`` receives the decoded JSON body (``None`` for HTTP 204) and returns the typed result."""

    method: str
    path: str
    body: Any
    parse: Callable[[Any], _T]


def _rollouts(data: Any) -> list[Rollout]:
    return [wire.rollout_from_json(r) for r in data["rollouts"]]


def _marked(data: Any) -> int:
    # The decoded JSON body is Any; the server answers {"marked": <count>}.
    return cast(int, data["marked"])


def _stats(data: Any) -> dict[str, int]:
    # The decoded JSON body is Any; the server answers {<counter name>: <count>}.
    return cast(dict[str, int], data)


def _span_query(
    rollout_ids: Sequence[str] | None,
    attempt_id: str | None,
    trace_id: str | None,
    start_after_ns: int | None,
    start_before_ns: int | None,
    after_seq: int,
    limit: int,
) -> _Call[tuple[list[Span], bool]]:
    body: dict[str, Any] = {"after_seq": after_seq, "limit": limit}
    for key, value in (
        ("rollout_ids", None if rollout_ids is None else list(rollout_ids)),
        ("attempt_id", attempt_id),
        ("trace_id", trace_id),
        ("start_after_ns", start_after_ns),
        ("start_before_ns", start_before_ns),
    ):
        if value is not None:
            body[key] = value
    return _Call(
        "POST",
        "/api/spans/query",
        body,
        lambda d: ([wire.span_from_json(s) for s in d["spans"]], bool(d.get("more"))),
    )


def _enqueue(requests: Iterable[RolloutRequest]) -> _Call[list[Rollout]]:
    return _Call("POST", "/api/rollouts", {"rollouts": [dict(r) for r in requests]}, _rollouts)


def _observed(requests: Iterable[RolloutRequest]) -> _Call[list[Rollout]]:
    return _Call("POST", "/api/rollouts/observed", {"rollouts": [dict(r) for r in requests]}, _rollouts)


def _merge(moves: dict[str, str]) -> _Call[int]:
    return _Call("POST", "/api/rollouts/merge", {"moves": moves}, lambda d: int(d["moved"]))


def _merge_pages(moves: Mapping[str, str]) -> list[dict[str, str]]:
    """``moves`` in pages the store accepts (none when there is nothing to move)."""
    items = list(moves.items())
    return [dict(items[i : i + _PAGE]) for i in range(0, len(items), _PAGE)]


def _dequeue(worker_id: str, lease_s: float) -> _Call[tuple[Rollout, Attempt] | None]:
    return _Call(
        "POST",
        "/api/rollouts/dequeue",
        {"worker_id": worker_id, "lease_s": lease_s},
        lambda d: (
            None
            if d is None
            else (wire.rollout_from_json(d["rollout"]), wire.attempt_from_json(d["attempt"]))
        ),
    )


def _heartbeat(attempt_id: str, lease_s: float) -> _Call[Attempt]:
    return _Call(
        "POST",
        f"/api/attempts/{attempt_id}/heartbeat",
        {"lease_s": lease_s},
        lambda d: wire.attempt_from_json(d["attempt"]),
    )


def _complete(
    attempt_id: str, status: RolloutStatus, reward: float | None, error: str | None
) -> _Call[Rollout]:
    body = {"status": RolloutStatus(status).value, "reward": reward, "error": error}
    return _Call(
        "POST", f"/api/attempts/{attempt_id}/complete", body, lambda d: wire.rollout_from_json(d["rollout"])
    )


_CANCEL, _CONSUMED, _QUERY = "/api/rollouts/cancel", "/api/rollouts/consumed", "/api/rollouts/query"
#: Most ids (or rollouts) the store takes in one call (its ``MAX_IDS_PER_CALL``); longer lists are paged.
_PAGE = 10_000


def _chunks(items: Sequence[_T]) -> list[Sequence[_T]]:
    """``items`` in pages the store accepts; one empty page for an empty list (the call still happens)."""
    return [items[i : i + _PAGE] for i in range(0, len(items), _PAGE)] or [items]


def _ids_call(path: str, rollout_ids: Sequence[str], parse: Callable[[Any], _T]) -> _Call[_T]:
    return _Call("POST", path, {"rollout_ids": list(rollout_ids)}, parse)


def _put_resource(name: str, value: Any, keep: int | None) -> _Call[Resource]:
    body = {"value": value} if keep is None else {"value": value, "keep": keep}
    return _Call("PUT", f"/api/resources/{name}", body, lambda d: wire.resource_from_json(d["resource"]))


def _get_resource(name: str) -> _Call[Resource]:
    return _Call("GET", f"/api/resources/{name}", None, lambda d: wire.resource_from_json(d["resource"]))


def _rewards(rewards: Sequence[Reward]) -> _Call[list[StoredReward]]:
    return _Call(
        "POST",
        "/api/rewards",
        {"rewards": [r.to_json() for r in rewards]},
        lambda d: [StoredReward.from_json(r) for r in d["rewards"]],
    )


def _answer(call: _Call[_T], response: httpx.Response) -> _T:
    if response.status_code == 204:
        return call.parse(None)
    if response.status_code >= 400:
        try:
            message = response.json()["error"]["message"]
        except Exception:
            message = response.text[:500]
        error: type[StoreError] = StoreError
        if response.status_code == 404:
            error = NotFoundError
        elif response.status_code >= 500:
            error = StoreUnavailableError
        raise error(f"{call.method} {call.path} -> HTTP {response.status_code}: {message}")
    return call.parse(response.json())


def _headers(token: str | None) -> dict[str, str]:
    token = settings.store_token(token)
    return {"authorization": f"Bearer {token}"} if token else {}


class StoreClient:
    """Blocking client of ``agl store serve`` (or an embedded store server)."""

    def __init__(self, url: str | None = None, *, token: str | None = None, timeout_s: float = 30.0) -> None:
        self.url = settings.store_url(url)
        self._http = httpx.Client(base_url=self.url, headers=_headers(token), timeout=timeout_s)

    def _run(self, call: _Call[_T]) -> _T:
        try:
            response = self._http.request(call.method, call.path, json=call.body)
        except httpx.HTTPError as exc:
            raise StoreUnavailableError(f"cannot reach the store at {self.url}: {exc}") from None
        return _answer(call, response)

    def query_spans(
        self,
        *,
        rollout_ids: Sequence[str] | None = None,
        attempt_id: str | None = None,
        trace_id: str | None = None,
        start_after_ns: int | None = None,
        start_before_ns: int | None = None,
        after_seq: int = 0,
        limit: int = 10_000,
    ) -> list[Span]:
        """Up to ``limit`` spans after ``after_seq``; where the store cut a page by bytes
        (``QUERY_PAGE_BYTES``), the next pages are fetched until ``limit`` is reached."""
        out: list[Span] = []
        while True:
            spans, more = self._run(
                _span_query(
                    rollout_ids,
                    attempt_id,
                    trace_id,
                    start_after_ns,
                    start_before_ns,
                    after_seq,
                    limit - len(out),
                )
            )
            out.extend(spans)
            if not more or not spans or len(out) >= limit:
                return out
            after_seq = spans[-1].seq or after_seq

    def all_spans(self, rollout_ids: Sequence[str], *, page: int = 10_000) -> list[Span]:
        """Every span of the given rollouts, paging through the store (and through the ids, at most
        ``MAX_IDS_PER_CALL`` per request)."""
        out: list[Span] = []
        for ids in _chunks(rollout_ids):
            after = 0
            while True:
                chunk = self.query_spans(rollout_ids=ids, after_seq=after, limit=page)
                out.extend(chunk)
                if len(chunk) < page:
                    break
                after = chunk[-1].seq or after
        return out

    def enqueue_rollouts(self, requests: Iterable[RolloutRequest]) -> list[Rollout]:
        return [r for part in _chunks(list(requests)) for r in self._run(_enqueue(part))]

    def add_observed_rollouts(self, requests: Iterable[RolloutRequest]) -> list[Rollout]:
        """Record finished rollouts that ran outside the queue (see ``Store.add_observed_rollouts``);
        none given, nothing is sent."""
        items = list(requests)
        return [r for part in _chunks(items) for r in self._run(_observed(part))] if items else []

    def dequeue_rollout(self, worker_id: str, *, lease_s: float = 60.0) -> tuple[Rollout, Attempt] | None:
        return self._run(_dequeue(worker_id, lease_s))

    def heartbeat(self, attempt_id: str, *, lease_s: float = 60.0) -> Attempt:
        return self._run(_heartbeat(attempt_id, lease_s))

    def complete_attempt(
        self, attempt_id: str, status: RolloutStatus, *, reward: float | None = None, error: str | None = None
    ) -> Rollout:
        return self._run(_complete(attempt_id, status, reward, error))

    def cancel_rollouts(self, rollout_ids: Sequence[str]) -> list[Rollout]:
        return [r for ids in _chunks(rollout_ids) for r in self._run(_ids_call(_CANCEL, ids, _rollouts))]

    def mark_consumed(self, rollout_ids: Sequence[str]) -> int:
        return sum(self._run(_ids_call(_CONSUMED, ids, _marked)) for ids in _chunks(rollout_ids))

    def merge_rollouts(self, moves: Mapping[str, str]) -> int:
        """See ``Store.merge_rollouts``; more than ``MAX_IDS_PER_CALL`` pairs go in several requests, each
        all or none."""
        return sum(self._run(_merge(page)) for page in _merge_pages(moves))

    def get_rollouts(self, rollout_ids: Sequence[str]) -> list[Rollout]:
        return [r for ids in _chunks(rollout_ids) for r in self._run(_ids_call(_QUERY, ids, _rollouts))]

    def list_rollouts(
        self, where: RolloutFilter | None = None, *, before: int | None = None, limit: int = 50
    ) -> RolloutPage:
        body: dict[str, Any] = {**wire.filter_to_json(where or RolloutFilter()), "limit": limit}
        if before is not None:
            body["before"] = before
        return self._run(_Call("POST", "/api/rollouts/list", body, wire.page_from_json))

    def wait_for_rollouts(
        self, rollout_ids: Sequence[str], *, timeout_s: float, poll_s: float = 0.2
    ) -> list[Rollout]:
        """Poll until every rollout has finished or ``timeout_s`` passed; returns their latest state."""
        deadline = time.monotonic() + timeout_s
        while True:
            rollouts = self.get_rollouts(rollout_ids)
            if all(r.status.finished for r in rollouts) or time.monotonic() >= deadline:
                return rollouts
            time.sleep(poll_s)

    def put_resource(self, name: str, value: Any, *, keep: int | None = None) -> Resource:
        return self._run(_put_resource(name, value, keep))

    def get_resource(self, name: str) -> Resource | None:
        try:
            return self._run(_get_resource(name))
        except NotFoundError:
            return None

    def add_rewards(self, rewards: Sequence[Reward]) -> list[StoredReward]:
        """Attach rewards after the fact (``POST /api/rewards``; see ``Store.add_rewards``). Longer lists
        are sent in pages, each stored whole or not at all."""
        return [r for part in _chunks(list(rewards)) for r in self._run(_rewards(part))]

    def add_reward(
        self,
        value: float,
        *,
        rollout_id: str | None = None,
        trace_id: str | None = None,
        span_id: str | None = None,
        name: str = EPISODE,
        source: str | None = None,
        reward_id: str | None = None,
        time: datetime | float | None = None,
    ) -> StoredReward:
        """Attach one reward to a rollout, trace or span (:func:`agl_core.pipeline.rewards.make_reward`). Pass
        a ``reward_id`` to make retrying safe: the same reward under the same id is stored once."""
        reward = make_reward(
            value,
            rollout_id=rollout_id,
            trace_id=trace_id,
            span_id=span_id,
            name=name,
            source=source,
            reward_id=reward_id,
            time=time,
        )
        return self.add_rewards([reward])[0]

    def stats(self) -> dict[str, int]:
        return self._run(_Call("GET", "/api/stats", None, _stats))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncStoreClient:
    """The asyncio twin of :class:`StoreClient` (same methods, awaited)."""

    def __init__(self, url: str | None = None, *, token: str | None = None, timeout_s: float = 30.0) -> None:
        self.url = settings.store_url(url)
        self._http = httpx.AsyncClient(base_url=self.url, headers=_headers(token), timeout=timeout_s)

    async def _run(self, call: _Call[_T]) -> _T:
        try:
            response = await self._http.request(call.method, call.path, json=call.body)
        except httpx.HTTPError as exc:
            raise StoreUnavailableError(f"cannot reach the store at {self.url}: {exc}") from None
        return _answer(call, response)

    async def query_spans(
        self,
        *,
        rollout_ids: Sequence[str] | None = None,
        attempt_id: str | None = None,
        trace_id: str | None = None,
        start_after_ns: int | None = None,
        start_before_ns: int | None = None,
        after_seq: int = 0,
        limit: int = 10_000,
    ) -> list[Span]:
        out: list[Span] = []
        while True:
            spans, more = await self._run(
                _span_query(
                    rollout_ids,
                    attempt_id,
                    trace_id,
                    start_after_ns,
                    start_before_ns,
                    after_seq,
                    limit - len(out),
                )
            )
            out.extend(spans)
            if not more or not spans or len(out) >= limit:
                return out
            after_seq = spans[-1].seq or after_seq

    async def enqueue_rollouts(self, requests: Iterable[RolloutRequest]) -> list[Rollout]:
        return [r for part in _chunks(list(requests)) for r in await self._run(_enqueue(part))]

    async def add_observed_rollouts(self, requests: Iterable[RolloutRequest]) -> list[Rollout]:
        items = list(requests)
        return [r for part in _chunks(items) for r in await self._run(_observed(part))] if items else []

    async def dequeue_rollout(
        self, worker_id: str, *, lease_s: float = 60.0
    ) -> tuple[Rollout, Attempt] | None:
        return await self._run(_dequeue(worker_id, lease_s))

    async def heartbeat(self, attempt_id: str, *, lease_s: float = 60.0) -> Attempt:
        return await self._run(_heartbeat(attempt_id, lease_s))

    async def complete_attempt(
        self, attempt_id: str, status: RolloutStatus, *, reward: float | None = None, error: str | None = None
    ) -> Rollout:
        return await self._run(_complete(attempt_id, status, reward, error))

    async def cancel_rollouts(self, rollout_ids: Sequence[str]) -> list[Rollout]:
        return [
            r for ids in _chunks(rollout_ids) for r in await self._run(_ids_call(_CANCEL, ids, _rollouts))
        ]

    async def mark_consumed(self, rollout_ids: Sequence[str]) -> int:
        return sum([await self._run(_ids_call(_CONSUMED, ids, _marked)) for ids in _chunks(rollout_ids)])

    async def merge_rollouts(self, moves: Mapping[str, str]) -> int:
        return sum([await self._run(_merge(page)) for page in _merge_pages(moves)])

    async def get_rollouts(self, rollout_ids: Sequence[str]) -> list[Rollout]:
        return [r for ids in _chunks(rollout_ids) for r in await self._run(_ids_call(_QUERY, ids, _rollouts))]

    async def wait_for_rollouts(
        self, rollout_ids: Sequence[str], *, timeout_s: float, poll_s: float = 0.2
    ) -> list[Rollout]:
        deadline = time.monotonic() + timeout_s
        while True:
            rollouts = await self.get_rollouts(rollout_ids)
            if all(r.status.finished for r in rollouts) or time.monotonic() >= deadline:
                return rollouts
            await asyncio.sleep(poll_s)

    async def put_resource(self, name: str, value: Any, *, keep: int | None = None) -> Resource:
        return await self._run(_put_resource(name, value, keep))

    async def get_resource(self, name: str) -> Resource | None:
        try:
            return await self._run(_get_resource(name))
        except NotFoundError:
            return None

    async def add_rewards(self, rewards: Sequence[Reward]) -> list[StoredReward]:
        return [r for part in _chunks(list(rewards)) for r in await self._run(_rewards(part))]

    async def add_reward(
        self,
        value: float,
        *,
        rollout_id: str | None = None,
        trace_id: str | None = None,
        span_id: str | None = None,
        name: str = EPISODE,
        source: str | None = None,
        reward_id: str | None = None,
        time: datetime | float | None = None,
    ) -> StoredReward:
        reward = make_reward(
            value,
            rollout_id=rollout_id,
            trace_id=trace_id,
            span_id=span_id,
            name=name,
            source=source,
            reward_id=reward_id,
            time=time,
        )
        return (await self.add_rewards([reward]))[0]

    async def stats(self) -> dict[str, int]:
        return await self._run(_Call("GET", "/api/stats", None, _stats))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncStoreClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
