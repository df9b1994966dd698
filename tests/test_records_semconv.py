import dataclasses
import re

import pytest

from agl_core import semconv
from agl_core.records import RolloutStatus, Span, Transition


def test_semconv_keys_are_unique_and_well_formed():
    keys = {k: v for k, v in vars(semconv).items() if k.isupper() and isinstance(v, str)}
    attribute_keys = [v for k, v in keys.items() if "." in v and not k.startswith(("SPAN_", "OP_"))]
    assert len(attribute_keys) == len(set(attribute_keys))
    for value in attribute_keys:
        assert re.fullmatch(r"[a-z_]+(\.[a-z_]+)+", value), value
    assert semconv.ROLLOUT_ID.startswith("agl.")
    assert semconv.GEN_AI_AGENT_NAME.startswith("gen_ai.")


def test_span_is_frozen_and_exposes_rollout_identity():
    span = Span("a" * 32, "b" * 16, None, "x", 1, 2, {semconv.ROLLOUT_ID: "ro-1", semconv.ATTEMPT_ID: "at-1"})
    assert span.rollout_id == "ro-1" and span.attempt_id == "at-1"
    with pytest.raises(dataclasses.FrozenInstanceError):
        span.name = "y"  # type: ignore[misc]
    assert Span("a" * 32, "b" * 16, None, "x", 1, 2).rollout_id is None


def test_transition_rejects_logprobs_of_the_wrong_length():
    Transition("ro", None, None, 0, (1, 2), (3, 4), (-0.1, -0.2), 1.0)
    with pytest.raises(ValueError, match="2 logprobs for 3 response tokens"):
        Transition("ro", None, None, 0, (1, 2), (3, 4, 5), (-0.1, -0.2), 1.0)


def test_rollout_status_finished():
    assert not RolloutStatus.QUEUED.finished and not RolloutStatus.RUNNING.finished
    assert all(
        s.finished
        for s in (
            RolloutStatus.SUCCEEDED,
            RolloutStatus.FAILED,
            RolloutStatus.TIMED_OUT,
            RolloutStatus.CANCELLED,
        )
    )
