"""Counters the gateway keeps, served in the Prometheus text format at ``GET /metrics``."""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["GatewayMetrics"]


def _capture_rows(calls: int, capture: Any) -> tuple[tuple[str, str, str, int], ...]:
    return (
        (
            "agl_gateway_captured_calls_total",
            "counter",
            "Calls that named no rollout and joined the rollout of their session (production capture).",
            calls,
        ),
        (
            "agl_gateway_captured_sessions_registered_total",
            "counter",
            "Sessions registered as rollouts in the store (or found registered).",
            int(capture.registered),
        ),
        (
            "agl_gateway_captured_sessions_pending",
            "gauge",
            "Sessions waiting to be registered (the store slow or down).",
            len(capture.pending()),
        ),
        (
            "agl_gateway_captured_sessions_dropped_total",
            "counter",
            "Sessions dropped unregistered because too many waited while the store was down.",
            int(capture.dropped),
        ),
    )


@dataclasses.dataclass
class GatewayMetrics:
    """Plain counters, updated from the event loop only (no locking needed)."""

    requests: collections.Counter[tuple[str, int]] = dataclasses.field(default_factory=collections.Counter)
    #: Calls whose prompt ids the gateway compared with its own rendering of the chat template.
    prompt_checks: int = 0
    #: Of those, calls where the backend's prompt ids differed from the gateway's rendering.
    prompt_drift: int = 0
    client_disconnects: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    inflight: int = 0
    #: Production capture: calls that named no rollout and joined their session's.
    captured_calls: int = 0
    #: Policy versions published to this gateway (``POST /agl/v1/policy``): loaded, refused, and when the
    #: last one was loaded (Unix seconds; 0: none since the gateway started).
    policy_changes: int = 0
    policy_refused: int = 0
    policy_loaded_at: float = 0.0

    def request_done(self, endpoint: str, status: int) -> None:
        self.requests[(endpoint, status)] += 1

    def render(self, capture: Any = None, backend: Any = None, *sources: Any) -> str:
        """The counters in the Prometheus text format; with ``capture`` (production capture), its
        sessions registered as rollouts, waiting to be and dropped as well; with a ``backend`` that has
        ``metric_rows()`` (the transformers backend: its prefix cache, prefill and decoding), those rows
        ``(name, kind, help, value)`` too, and those of every other source (the span spool)."""
        lines = [
            "# HELP agl_gateway_requests_total Requests answered, by endpoint and HTTP status.",
            "# TYPE agl_gateway_requests_total counter",
        ]
        for (endpoint, status), count in sorted(self.requests.items()):
            lines.append(f'agl_gateway_requests_total{{endpoint="{endpoint}",code="{status}"}} {count}')
        for name, kind, help_text, value in (
            (
                "agl_gateway_prompt_checks_total",
                "counter",
                "Calls whose prompt token ids were checked against the gateway's own chat-template "
                "rendering.",
                self.prompt_checks,
            ),
            (
                "agl_gateway_prompt_drift_total",
                "counter",
                "Checked calls where the backend's prompt token ids differed from the gateway's rendering.",
                self.prompt_drift,
            ),
            (
                "agl_gateway_client_disconnects_total",
                "counter",
                "Calls whose client went away before the answer ended (streamed or not); their generation"
                " is stopped.",
                self.client_disconnects,
            ),
            (
                "agl_gateway_prompt_tokens_total",
                "counter",
                "Prompt tokens of answered calls.",
                self.prompt_tokens,
            ),
            (
                "agl_gateway_completion_tokens_total",
                "counter",
                "Generated tokens of answered calls.",
                self.completion_tokens,
            ),
            ("agl_gateway_inflight_requests", "gauge", "Requests being served now.", self.inflight),
            *_policy_rows(self, backend),
            *(() if capture is None else _capture_rows(self.captured_calls, capture)),
            *_backend_rows(backend),
            *(row for source in sources for row in _backend_rows(source)),
        ):
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"]
        return "\n".join(lines) + "\n"


def _policy_rows(metrics: GatewayMetrics, backend: Any) -> list[tuple[str, str, str, float]]:
    """The served policy version (a backend that has one) and the publishes this gateway took."""
    version = getattr(backend, "policy_version", None)
    rows: list[tuple[str, str, str, float]] = []
    if isinstance(version, int) and not isinstance(version, bool):
        rows.append(("agl_gateway_policy_version", "gauge", "The policy version served now.", version))
    return rows + [
        (
            "agl_gateway_policy_changes_total",
            "counter",
            "Policy versions published to this gateway and loaded.",
            metrics.policy_changes,
        ),
        (
            "agl_gateway_policy_refused_total",
            "counter",
            "Policy versions published to this gateway that it could not load.",
            metrics.policy_refused,
        ),
        (
            "agl_gateway_policy_loaded_timestamp_seconds",
            "gauge",
            "When the last policy version was loaded (Unix seconds; 0: none since the gateway started).",
            metrics.policy_loaded_at,
        ),
    ]


def _backend_rows(backend: Any) -> list[tuple[str, str, str, float]]:
    rows = getattr(backend, "metric_rows", None)
    if rows is None:
        return []
    try:
        return list(rows())
    except Exception:  # a backend's figures never cost the gateway its metrics
        logger.exception("agl: the backend's metrics could not be read")
        return []
