"""Typed Python client of the collector-store's HTTP API."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

import httpx

from .. import settings
from ..records import Attempt, Resource, Rollout, RolloutStatus, Span
from . import _wire
from .base import NotFoundError, RolloutRequest, StoreError

__all__ = ["StoreClient"]


class StoreClient:
    """Talks to ``agl store serve`` (or an embedded store server) over HTTP.

    Implements the same methods as :class:`~agl_core.store.base.Store`, so code written against the
    protocol runs against a remote store unchanged.
    """

    def __init__(self, url: str | None = None, *, token: str | None = None, timeout_s: float = 30.0) -> None:
        self.url = settings.store_url(url)
        token = settings.store_token(token)
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        try:
            response = self._http.request(method, path, json=body)
        except httpx.HTTPError as exc:
            raise StoreError(f"cannot reach the store at {self.url}: {exc}") from None
        if response.status_code == 204:
            return None
        if response.status_code >= 400:
            try:
                message = response.json()["error"]["message"]
            except Exception:
                message = response.text[:500]
            error = NotFoundError if response.status_code == 404 else StoreError
            raise error(f"{method} {path} -> HTTP {response.status_code}: {message}")
        return response.json()

    # --- spans ---------------------------------------------------------------------------------------
    def query_spans(
        self,
        *,
        rollout_ids: Sequence[str] | None = None,
        trace_id: str | None = None,
        after_seq: int = 0,
        limit: int = 10_000,
    ) -> list[Span]:
        body: dict[str, Any] = {"after_seq": after_seq, "limit": limit}
        if rollout_ids is not None:
            body["rollout_ids"] = list(rollout_ids)
        if trace_id is not None:
            body["trace_id"] = trace_id
        return [_wire.span_from_json(s) for s in self._call("POST", "/api/spans/query", body)["spans"]]

    def all_spans(self, rollout_ids: Sequence[str], *, page: int = 10_000) -> list[Span]:
        """Every span of the given rollouts, paging through the store."""
        out: list[Span] = []
        after = 0
        while True:
            chunk = self.query_spans(rollout_ids=rollout_ids, after_seq=after, limit=page)
            out.extend(chunk)
            if len(chunk) < page:
                return out
            after = chunk[-1].seq or after

    # --- rollouts ------------------------------------------------------------------------------------
    def enqueue_rollouts(self, requests: Iterable[RolloutRequest]) -> list[Rollout]:
        body = {"rollouts": [dict(r) for r in requests]}
        return [_wire.rollout_from_json(r) for r in self._call("POST", "/api/rollouts", body)["rollouts"]]

    def dequeue_rollout(self, worker_id: str) -> tuple[Rollout, Attempt] | None:
        data = self._call("POST", "/api/rollouts/dequeue", {"worker_id": worker_id})
        if data is None:
            return None
        return _wire.rollout_from_json(data["rollout"]), _wire.attempt_from_json(data["attempt"])

    def complete_attempt(
        self,
        attempt_id: str,
        status: RolloutStatus,
        *,
        reward: float | None = None,
        error: str | None = None,
    ) -> Rollout:
        body = {"status": RolloutStatus(status).value, "reward": reward, "error": error}
        data = self._call("POST", f"/api/attempts/{attempt_id}/complete", body)
        return _wire.rollout_from_json(data["rollout"])

    def get_rollouts(self, rollout_ids: Sequence[str]) -> list[Rollout]:
        data = self._call("POST", "/api/rollouts/query", {"rollout_ids": list(rollout_ids)})
        return [_wire.rollout_from_json(r) for r in data["rollouts"]]

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

    # --- resources -----------------------------------------------------------------------------------
    def put_resource(self, name: str, value: Any) -> Resource:
        return _wire.resource_from_json(self._call("PUT", f"/api/resources/{name}", {"value": value})["resource"])

    def get_resource(self, name: str) -> Resource | None:
        try:
            return _wire.resource_from_json(self._call("GET", f"/api/resources/{name}")["resource"])
        except NotFoundError:
            return None

    def stats(self) -> dict[str, int]:
        return self._call("GET", "/api/stats")

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
