"""What the agl improve tests share: a production store of gateway sessions rated late, a service config
over it, and a state where a round promoted v1."""

from __future__ import annotations

from agl_core import semconv


def sessions(store, versions_and_rewards, *, legacy=()):
    """Gateway sessions each served by one version and rated late; ``legacy``: (version, value) ratings
    stored as an older store let them in (an OTLP reward span of any double)."""
    from agl_core.pipeline.rewards import Reward
    from agl_core.records import Span
    from agl_core.store.formats.otlp import extract_rows, records_to_request

    spans, rewards, raw = [], [], []
    everything = [(v, r, False) for v, r in versions_and_rewards] + [(v, r, True) for v, r in legacy]
    for i, (version, value, old) in enumerate(everything):
        rid = f"imp-s-{i:04d}"
        attrs = {
            semconv.SOURCE: semconv.SOURCE_GATEWAY,
            semconv.POLICY_VERSION: version,
            semconv.ROLLOUT_ID: rid,
        }
        spans.append(
            Span(f"{i + 1:032x}", f"{i + 1:016x}", None, "chat policy", 10**18 + i, 10**18 + i + 1, attrs)
        )
        if old:
            reward = {semconv.ROLLOUT_ID: rid, semconv.REWARD_VALUE: value, semconv.REWARD_NAME: "episode"}
            raw.append(
                Span(
                    f"{i + 1:032x}",
                    f"{i + 7000:016x}",
                    None,
                    semconv.SPAN_REWARD,
                    2 * 10**18,
                    2 * 10**18,
                    reward,
                )
            )
        else:
            rewards.append(Reward(f"u-{i}", value, rollout_id=rid))
    store.add_spans(spans)
    store.add_observed_rollouts(
        [{"rollout_id": s.rollout_id, "metadata": {"source": "gateway"}} for s in spans]
    )
    store.add_rewards(rewards)
    if raw:
        batch = extract_rows(records_to_request(raw), rewards=None)
        store.add_span_rows(batch.rows, batch.scopes)


def improve_config(tmp_path, store: str, **improve):
    from agl_trainer.config import config_from_dict

    return config_from_dict(
        {
            "output_dir": str(tmp_path / "service"),
            "model": {"source": "tiny", "lora": {"r": 4, "alpha": 8}},
            "traces": {"store": store, "filter": {"source": "gateway"}},
            "algorithm": {"name": "sft"},
            "improve": {
                "name": "t",
                "gate": "none",
                "min_new_rollouts": 1000,
                "rollback": {"min_sessions": 20, "k_se": 2.0},
                **improve,
            },
        },
        required=(),
    )


def promoted_v1(tmp_path):
    from agl_trainer.improve.state import STATE_FILE, GateRecord, ImproveState, Version

    out = tmp_path / "service"
    out.mkdir(exist_ok=True)
    state = ImproveState.new("t", None)
    state.versions[0].status = "retired"
    state.versions.append(Version(1, "serving", parent=0, round=1, gate=GateRecord("promoted", "ok")))
    state.serving, state.rounds = 1, 1
    state.save(out / STATE_FILE)
    return out / STATE_FILE
