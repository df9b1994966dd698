"""Stored rollouts as training data: reading a store, the ``traces.filter`` selection, and the pure
preparation of what each algorithm trains on (no torch).

A rollout is a set of spans, however it arrived (the trainer's runner, ``agl import``, a production
gateway): its time is the start of its earliest span, its reward the episode reward among its spans
(:func:`agl_core.pipeline.transitions.episode_rewards`), its source the ``source`` in its record's metadata,
its task the record's task id (else ``agl.task.id`` on its spans, else its rollout id). Rollouts of the
store's queue that did not succeed are not selected; only the spans of a retried rollout's last attempt are.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import random
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

from agl_core import semconv, settings
from agl_core.pipeline.credit import CreditResult, assign_rewards
from agl_core.pipeline.sft import SftResult, spans_to_sft_examples
from agl_core.pipeline.spantree import GATEWAY, LLM, SpanTree, kind_of
from agl_core.pipeline.transitions import (
    TransitionResult,
    episode_rewards,
    explain_untrained,
    spans_to_transitions,
)
from agl_core.records import Rollout, RolloutStatus, Span, Transition
from agl_core.store import SpanReader, connect

from ..config import TracesConfig, TrainerConfig
from ..learning.algo import Advantaged, GroupReport, compute_advantages

__all__ = [
    "NO_LOGPROBS",
    "NothingSelectedError",
    "RlData",
    "Selection",
    "StoredRollout",
    "baseline_groups",
    "minibatches",
    "prepare_rl",
    "prepare_sft",
    "read_store",
    "select",
]

#: Why a rollout is refused for off-policy RL: a call has token ids but no behaviour logprobs.
NO_LOGPROBS = "an LLM call recorded token ids but no logprobs (off-policy RL needs the behaviour logprobs)"
#: Why a rollout is refused for off-policy RL: a call was served by another model than the policy.
OTHER_MODEL = (
    "an LLM call was served by another model than this policy or its versions (off-policy RL needs the"
    " policy's own behaviour logprobs; list other names of the same weights in traces.models, or train on"
    " any model's calls with algorithm: sft)"
)


class NothingSelectedError(ValueError):
    """The ``traces`` selection holds nothing to train on; the message says what matched how many."""


@dataclasses.dataclass(frozen=True)
class StoredRollout:
    """What the filter knows of one stored rollout."""

    rollout_id: str
    task_id: str
    status: RolloutStatus
    source: str | None
    reward: float | None
    #: Start of its earliest span (Unix nanoseconds).
    start_ns: int
    agents: frozenset[str]


@dataclasses.dataclass(frozen=True)
class Selection:
    """The rollouts the filter kept, their spans, and how each condition narrowed them."""

    rollouts: tuple[StoredRollout, ...]
    spans: tuple[Span, ...]
    #: Rollouts in the store.
    total: int
    #: ``(condition, rollouts left after it)``, in the order applied.
    narrowing: tuple[tuple[str, int], ...]

    def describe(self) -> str:
        """``the filter matched 3 of 120 rollouts: source 'import' left 40, reward_min 0.8 left 3``."""
        steps = ", ".join(f"{what} left {n}" for what, n in self.narrowing)
        return f"the filter matched {len(self.rollouts)} of {self.total} rollouts" + (
            f": {steps}" if steps else ""
        )

    def only(self, rollout_ids: Iterable[str], condition: str) -> Selection:
        """The part of this selection whose rollouts are in ``rollout_ids``, the narrowing recorded as
        ``condition``."""
        wanted = set(rollout_ids)
        kept = tuple(r for r in self.rollouts if r.rollout_id in wanted)
        spans = tuple(s for s in self.spans if s.rollout_id in wanted)
        return Selection(kept, spans, self.total, (*self.narrowing, (condition, len(kept))))


def read_store(store: str) -> tuple[list[Span], dict[str, Rollout]]:
    """Every span of ``store`` (a SQLite file, ``postgresql://`` DSN or a running store's URL) and the
    records of the rollouts they belong to."""
    reader = SpanReader()
    backend = connect(store, settings.store_token())
    try:
        reader.read(backend)
    finally:
        backend.close()
    return reader.spans, reader.records


def _ns(moment: datetime) -> int:
    aware = moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)
    return int(aware.timestamp() * 1e9)


def _stored(
    rollout_id: str, spans: Sequence[Span], record: Rollout | None, reward: float | None
) -> StoredRollout:
    tree = SpanTree(spans)
    agents = {tree.agent_name(s) for s in tree.spans if kind_of(s) in (LLM, GATEWAY)}
    task = record.task_id if record is not None else None
    if task is None:
        task = next(
            (str(s.attributes[semconv.TASK_ID]) for s in spans if semconv.TASK_ID in s.attributes), None
        )
    source = record.metadata.get("source") if record is not None else None
    return StoredRollout(
        rollout_id,
        task or rollout_id,
        record.status if record is not None else RolloutStatus.SUCCEEDED,
        str(source) if source is not None else None,
        reward,
        min(s.start_ns for s in spans),
        frozenset(a for a in agents if a),
    )


def select(
    traces: TracesConfig,
    spans: Sequence[Span],
    records: Mapping[str, Rollout],
    *,
    timed_out_too: bool = False,
) -> Selection:
    """The rollouts of ``spans`` that ``traces.filter`` keeps (pure). ``timed_out_too``: rollouts that
    timed out count as finished (``algorithm.rewards.timeout_episode_reward`` rewards them)."""
    by_rollout: dict[str, list[Span]] = defaultdict(list)
    for span in spans:
        if span.rollout_id is not None:
            by_rollout[span.rollout_id].append(span)
    for rollout_id, group in by_rollout.items():
        record = records.get(rollout_id)
        if record is not None and record.attempts:
            last = record.attempts[-1].attempt_id
            by_rollout[rollout_id] = [s for s in group if s.attempt_id is None or s.attempt_id == last]
    rewards = episode_rewards(s for group in by_rollout.values() for s in group)
    # a rollout id that only reward spans name (a reward sent over OTLP for a rollout that never ran) is
    # no rollout: nothing to train on, and no session anyone served
    rollouts = [
        _stored(rid, group, records.get(rid), rewards.get(rid))
        for rid, group in by_rollout.items()
        if any(s.name != semconv.SPAN_REWARD for s in group)
    ]
    total = len(rollouts)
    f = traces.filter
    finished = {RolloutStatus.SUCCEEDED} | ({RolloutStatus.TIMED_OUT} if timed_out_too else set())
    conditions: list[tuple[str, Any]] = [("finished", lambda r: r.status in finished)]
    if f.rollout_ids:
        wanted = set(f.rollout_ids)
        conditions.append((f"rollout_ids ({len(wanted)})", lambda r: r.rollout_id in wanted))
    if f.source is not None:
        conditions.append((f"source {f.source!r}", lambda r: r.source == f.source))
    if f.since is not None:
        since = _ns(f.since)
        conditions.append((f"since {f.since.isoformat()}", lambda r: r.start_ns >= since))
    if f.until is not None:
        until = _ns(f.until)
        conditions.append((f"until {f.until.isoformat()}", lambda r: r.start_ns < until))
    if f.has_reward is not None:
        conditions.append(
            (f"has_reward {str(f.has_reward).lower()}", lambda r: (r.reward is not None) == f.has_reward)
        )
    if f.reward_min is not None:
        low = f.reward_min
        conditions.append((f"reward_min {low:g}", lambda r: r.reward is not None and r.reward >= low))
    if f.agents:
        conditions.append(
            (
                f"agents {', '.join(f.agents)}",
                lambda r: any(fnmatch.fnmatchcase(a, p) for a in r.agents for p in f.agents),
            )
        )
    narrowing = []
    for what, keep in conditions:
        rollouts = [r for r in rollouts if keep(r)]
        narrowing.append((what, len(rollouts)))
    kept = {r.rollout_id for r in rollouts}
    chosen = tuple(s for rid in kept for s in by_rollout[rid])
    return Selection(tuple(rollouts), chosen, total, tuple(narrowing))


# --- what each algorithm trains on ----------------------------------------------------------------------
def prepare_sft(config: TrainerConfig, selection: Selection) -> SftResult:
    """The selection's fine-tuning examples (:func:`agl_core.pipeline.sft.spans_to_sft_examples`)."""
    agents = (config.traces.filter.agents if config.traces else []) or config.algorithm.agents
    return spans_to_sft_examples(selection.spans, agents=agents)


@dataclasses.dataclass(frozen=True)
class RlData:
    """The selection as off-policy RL data: advantaged transitions grouped by task."""

    result: TransitionResult
    credit: CreditResult
    samples: tuple[Advantaged, ...]
    report: GroupReport
    #: Rollout id -> group (its task id).
    group_of: Mapping[str, str]
    #: Rollouts refused -> why (no token ids, no logprobs, no reward, ...).
    refused: Mapping[str, str]


def prepare_rl(config: TrainerConfig, selection: Selection) -> RlData:
    """Transitions, credit and group advantages of the selection for ``algorithm.name`` (pure).

    A rollout trains only when every call it made has the gateway's token ids *and* logprobs: one with a
    call recorded without logprobs is refused whole (:data:`NO_LOGPROBS`), so credit rules such as
    ``last`` see the same calls the agent made; rollouts without any transition are refused with the
    reason :func:`~agl_core.pipeline.transitions.explain_untrained` gives (no reward, no gateway token ids,
    ...). Calls without token ids are never re-tokenised here. Groups are the rollouts of one task id (or,
    with ``traces.baseline: agent``, of the same agents); a group of one rollout, or of tied scores,
    carries no signal and is skipped (``GroupReport``).
    """
    algorithm = config.algorithm
    agents = (config.traces.filter.agents if config.traces else []) or algorithm.agents
    full = spans_to_transitions(selection.spans, timeout_reward=algorithm.rewards.timeout_episode_reward)
    other_model = _served_by_others(config, selection.spans)
    no_logprobs = {t.rollout_id for t in full.transitions if t.response_logprobs is None} - set(other_model)
    excluded = no_logprobs | set(other_model)
    result = dataclasses.replace(
        full, transitions=tuple(t for t in full.transitions if t.rollout_id not in excluded)
    )
    credit = assign_rewards(
        result,
        selection.spans,
        strategy=algorithm.credit,
        gamma=algorithm.gamma,
        weights=algorithm.reward_weights(),
        agents=agents,
    )
    transitions: list[Transition] = [t for t in credit.transitions if t.prompt_ids and t.response_ids]
    group_of = baseline_groups(selection, config.traces.baseline if config.traces else "task")
    samples, report = compute_advantages(transitions, group_of, algorithm.name, scores=credit.scores)
    refused = {rid: NO_LOGPROBS for rid in no_logprobs}
    refused.update((rid, f"{OTHER_MODEL}: {model!r}") for rid, model in other_model.items())
    refused.update(
        (rid, why)
        for rid, why in explain_untrained(
            [r.rollout_id for r in selection.rollouts], result, transitions
        ).items()
        if rid not in excluded
    )
    return RlData(result, credit, tuple(samples), report, group_of, refused)


def baseline_groups(selection: Selection, baseline: str) -> dict[str, str]:
    """Rollout id -> the group whose mean reward is its baseline: its task id (``task``), or the agents
    that made its calls (``agent``: one group per set of agents over the whole selection)."""
    if baseline == "task":
        return {r.rollout_id: r.task_id for r in selection.rollouts}
    return {r.rollout_id: "agents:" + ",".join(sorted(r.agents)) for r in selection.rollouts}


def _served_by_others(config: TrainerConfig, spans: Sequence[Span]) -> dict[str, str]:
    """Rollout id -> the first model name among its gateway calls that is not this policy's: neither
    ``model.served_name`` (or a version of it, ``<served_name>-...``), ``model.source`` nor one of
    ``traces.models``. A call that recorded no model name is taken as the policy's."""
    own = config.model.served_name
    accepted = {own, config.model.source, *(config.traces.models if config.traces else ())}
    found: dict[str, str] = {}
    for span in spans:
        if span.rollout_id is None or span.rollout_id in found or kind_of(span) != GATEWAY:
            continue
        model = span.attributes.get(semconv.GEN_AI_RESPONSE_MODEL) or span.attributes.get(
            semconv.GEN_AI_REQUEST_MODEL
        )
        if isinstance(model, str) and model not in accepted and not model.startswith(own + "-"):
            found[span.rollout_id] = model
    return found


def minibatches(items: Sequence[Any], key: Any, batch_size: int, steps: int, seed: int) -> list[list[Any]]:
    """``steps`` batches of ``batch_size`` units (``key(item)`` names an item's unit: an example, a
    group), in shuffled order, each pass over the data reshuffled; the last batch of a pass may be
    smaller. The same arguments give the same batches (a resumed run continues them)."""
    units: dict[Any, list[Any]] = defaultdict(list)
    for item in items:
        units[key(item)].append(item)
    order = list(units)
    rng = random.Random(seed)
    batches: list[list[Any]] = []
    while len(batches) < steps and order:
        shuffled = order[:]
        rng.shuffle(shuffled)
        for i in range(0, len(shuffled), batch_size):
            batches.append([item for unit in shuffled[i : i + batch_size] for item in units[unit]])
            if len(batches) == steps:
                break
    return batches


def steps_for(config: TrainerConfig, units: int) -> int:
    """How many steps a ``traces`` run takes over ``units`` examples or groups."""
    traces = config.traces
    if traces is None or traces.epochs is None:
        return config.train.steps
    per_epoch = -(-units // traces.batch_size)
    return max(1, per_epoch * traces.epochs)


def reason_counts(problems: Sequence[Any]) -> dict[str, int]:
    return dict(Counter(p.reason for p in problems))
