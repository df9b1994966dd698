"""JSON form of the store's records, shared by the HTTP server and its client."""

from __future__ import annotations

import dataclasses
from typing import Any

from ...records import Attempt, Resource, Rollout, RolloutStatus, Span
from ..base import RolloutFilter, RolloutPage


def span_to_json(span: Span) -> dict[str, Any]:
    out = dataclasses.asdict(span)
    out["events"] = list(span.events)
    return out


def span_from_json(data: dict[str, Any]) -> Span:
    return Span(**{**data, "events": tuple(data.get("events") or ())})


def attempt_to_json(attempt: Attempt) -> dict[str, Any]:
    return {**dataclasses.asdict(attempt), "status": attempt.status.value}


def attempt_from_json(data: dict[str, Any]) -> Attempt:
    return Attempt(**{**data, "status": RolloutStatus(data["status"])})


def rollout_to_json(rollout: Rollout) -> dict[str, Any]:
    out = dataclasses.asdict(rollout)
    out["status"] = rollout.status.value
    out["attempts"] = [attempt_to_json(a) for a in rollout.attempts]
    return out


def rollout_from_json(data: dict[str, Any]) -> Rollout:
    return Rollout(
        **{
            **data,
            "status": RolloutStatus(data["status"]),
            "attempts": tuple(attempt_from_json(a) for a in data.get("attempts") or ()),
        }
    )


def resource_to_json(resource: Resource) -> dict[str, Any]:
    return dataclasses.asdict(resource)


def resource_from_json(data: dict[str, Any]) -> Resource:
    return Resource(**data)


def filter_to_json(where: RolloutFilter) -> dict[str, Any]:
    out = {k: v for k, v in dataclasses.asdict(where).items() if v is not None and v != ()}
    if "statuses" in out:
        out["statuses"] = list(out["statuses"])
    return out


def page_to_json(page: RolloutPage) -> dict[str, Any]:
    return {
        "rollouts": [rollout_to_json(r) for r in page.rollouts],
        "seqs": page.seqs,
        "span_counts": page.span_counts,
        "before": page.before,
        "total": page.total,
        "total_capped": page.total_capped,
    }


def page_from_json(data: dict[str, Any]) -> RolloutPage:
    return RolloutPage(
        rollouts=[rollout_from_json(r) for r in data["rollouts"]],
        seqs=list(data["seqs"]),
        span_counts=dict(data["span_counts"]),
        before=data["before"],
        total=data["total"],
        total_capped=data["total_capped"],
    )
