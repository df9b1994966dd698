"""Credit assignment: how a rollout's rewards are shared among its LLM calls.

Pure functions over transitions and spans. Every function keeps the order of the transitions it is given.

Two layers make a call's reward:

1. A base strategy shares the episode reward among the rollout's calls (:func:`assign_credit`):
   ``episode``, ``last``, ``discounted``, or ``per_call`` (the episode reward is not shared at all).
2. Intermediate rewards are added to single calls (:func:`reward_events`, :func:`assign_rewards`):

   * ``explicit``: an ``agl.reward`` span whose name is not ``episode`` (``emit_reward(0.3, name="step")``)
     adds its value to one call;
   * ``tool_error``: a tool span with ERROR status, on the call that requested the tool;
   * ``tool_success``: a tool span that ended without error, on the call that requested the tool (a small
     positive weight rewards using a tool correctly, so that penalties on failing calls do not teach a
     policy to avoid the tool altogether);
   * ``malformed_tool_call``: a call whose gateway span says it wrote a tool call that cannot be run
     (``agl.llm.tool_call_malformed``: unparseable, unknown tool, arguments not a JSON object), once per
     malformed call;
   * ``timeout``: an ``agl.error`` span recording a timeout, on the rollout's last call.

   Each automatic kind adds ``weight * count`` (weights in :class:`RewardWeights`, 0 = off).

Which call a span is attached to (:func:`reward_events`):

* a tool span that carries ``gen_ai.tool.call.id`` goes to the call whose response holds that tool call
  id (from the output messages recorded on the gateway span or on a framework span joined to it);
* otherwise, and for explicit rewards, the call is found from where and when the span happened: a call
  the span is nested in; else, among the calls that ended before the span started, the one that ended
  last within the span's nearest enclosing step (the nearest ancestor span, such as an agent turn or a
  graph node, under which any such call ran); else the last call of the rollout that ended before it;
  else (the span came before any call ended) the rollout's first call. A reward span is placed in time no
  later than the end of its parent span: a reward attached to a span after the fact
  (:mod:`agl_core.pipeline.rewards`) counts as given when that span ended;
* a timeout goes to the last call of the attempt it was recorded in (the last call of the rollout when
  that attempt made none).

Duplicates are counted once: a tool call described by several spans (an agl adapter and an OpenInference
instrumentor, or a framework's own telemetry nested in agl's span) is one error or one success; a tool
span for a call the gateway already flagged as malformed is neither a tool error nor a success.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence

from .. import semconv
from ..records import Span, Transition
from .spantree import TOOL, SpanTree, is_timeout_error, kind_of, source_of, tool_name
from .transitions import TransitionResult

__all__ = [
    "EXPLICIT",
    "MALFORMED_TOOL_CALL",
    "REWARD_KINDS",
    "STRATEGIES",
    "TIMEOUT",
    "TOOL_ERROR",
    "TOOL_SUCCESS",
    "CreditResult",
    "RewardEvent",
    "RewardWeights",
    "assign_credit",
    "assign_rewards",
    "reward_events",
    "select_agents",
]

#: ``episode``: every call gets the episode reward (LightningRL's default).
#: ``last``: the last call of the rollout gets it, earlier calls 0.
#: ``discounted``: call t of T gets ``gamma ** (T - 1 - t) * R``.
#: ``per_call``: no call gets it; calls are rewarded only by intermediate rewards.
STRATEGIES = ("episode", "last", "discounted", "per_call")

EXPLICIT = "explicit"
TOOL_ERROR = "tool_error"
TOOL_SUCCESS = "tool_success"
MALFORMED_TOOL_CALL = "malformed_tool_call"
TIMEOUT = "timeout"
#: The kinds of intermediate reward, in report order.
REWARD_KINDS = (EXPLICIT, TOOL_ERROR, MALFORMED_TOOL_CALL, TIMEOUT, TOOL_SUCCESS)

_EPISODE = "episode"


def assign_credit(
    transitions: Sequence[Transition], strategy: str = "episode", *, gamma: float = 1.0
) -> list[Transition]:
    """Rewrite each transition's ``reward`` from its episode reward according to ``strategy``.

    Expects transitions as made by :func:`~agl_core.pipeline.transitions.spans_to_transitions` (``reward``
    holds the episode reward, ``call_index`` counts calls within the rollout). ``last`` and ``discounted``
    count from the last of the given transitions of each rollout.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown credit strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    if strategy == "episode":
        return list(transitions)
    if strategy == "per_call":
        return [dataclasses.replace(t, reward=0.0) for t in transitions]
    last_index: dict[str, int] = defaultdict(int)
    for t in transitions:
        last_index[t.rollout_id] = max(last_index[t.rollout_id], t.call_index)
    out = []
    for t in transitions:
        steps_to_end = last_index[t.rollout_id] - t.call_index
        if strategy == "last":
            reward = t.reward if steps_to_end == 0 else 0.0
        else:
            reward = t.reward * gamma**steps_to_end
        out.append(dataclasses.replace(t, reward=reward))
    return out


def select_agents(transitions: Sequence[Transition], patterns: Sequence[str] | None) -> list[Transition]:
    """Keep transitions whose agent name matches any glob in ``patterns`` (all when ``patterns`` is empty)."""
    if not patterns:
        return list(transitions)
    return [
        t for t in transitions if t.agent_name and any(fnmatch.fnmatchcase(t.agent_name, p) for p in patterns)
    ]


# --- intermediate rewards -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RewardWeights:
    """How much each kind of intermediate reward adds to a call.

    ``explicit``: whether explicit per-call rewards (``agl.reward`` spans not named ``episode``) count.
    The others are added once per occurrence: usually ``<= 0`` (penalties), any finite number is allowed;
    0 turns a kind off.
    """

    explicit: bool = True
    tool_error: float = 0.0
    malformed_tool_call: float = 0.0
    timeout: float = 0.0
    tool_success: float = 0.0

    def __post_init__(self) -> None:
        for kind in REWARD_KINDS[1:]:
            value = getattr(self, kind)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"reward weight {kind!r} must be a finite number, got {value!r}")

    def weight(self, kind: str) -> float:
        """Multiplier of an event of ``kind`` (1 or 0 for ``explicit``)."""
        if kind == EXPLICIT:
            return 1.0 if self.explicit else 0.0
        if kind not in REWARD_KINDS:
            raise ValueError(f"unknown reward kind {kind!r}; choose one of {', '.join(REWARD_KINDS)}")
        return float(getattr(self, kind))

    @property
    def active(self) -> bool:
        """Whether any intermediate reward is on."""
        return any(self.weight(kind) != 0.0 for kind in REWARD_KINDS)


@dataclasses.dataclass(frozen=True)
class RewardEvent:
    """One intermediate reward found in a rollout's spans, attached to the call ``call_index``."""

    rollout_id: str
    call_index: int
    #: One of :data:`REWARD_KINDS`.
    kind: str
    #: The span it comes from (the reward, tool or error span; the gateway span of a malformed call).
    span_id: str
    #: ``explicit``: the value emitted; automatic kinds: 1 (one occurrence, multiplied by its weight).
    value: float = 1.0
    #: The reward's name, the tool's name, the malformed call's reason, or the error type.
    label: str = ""


class _Call:
    """What the attachment rules need to know of one transition's LLM call."""

    def __init__(self, transition: Transition, spans: list[Span], tree: SpanTree) -> None:
        self.transition = transition
        self.span_ids = {s.span_id for s in spans}
        #: Ids of the call's own spans and of every span they are nested in.
        self.lineage = set(self.span_ids)
        for span in spans:
            self.lineage.update(a.span_id for a in tree.ancestors(span))
        # Framework spans are written on the agent's clock, like the spans attached to calls: prefer them.
        framework = spans[1:] or spans[:1]
        self.end_ns = min(s.end_ns for s in framework)
        self.tool_call_ids = {i for s in spans for i in _tool_call_ids(s)}

    @property
    def index(self) -> int:
        return self.transition.call_index


def _tool_call_ids(span: Span) -> list[str]:
    """Tool call ids in the output messages an LLM span recorded (GenAI JSON or OpenInference keys)."""
    ids: list[str] = []
    raw = span.attributes.get(semconv.GEN_AI_OUTPUT_MESSAGES)
    if isinstance(raw, str) and "tool_calls" in raw:
        try:
            messages = json.loads(raw)
        except ValueError:
            messages = []
        for message in messages if isinstance(messages, list) else []:
            for call in (message.get("tool_calls") if isinstance(message, Mapping) else None) or []:
                if isinstance(call, Mapping) and isinstance(call.get("id"), str):
                    ids.append(call["id"])
    for key, value in span.attributes.items():
        if (
            key.startswith("llm.output_messages.")
            and key.endswith(".tool_call.id")
            and isinstance(value, str)
        ):
            ids.append(value)
    return ids


class _Rollout:
    """One rollout's calls and span tree, with the attachment rules of the module docstring."""

    def __init__(
        self, spans: Sequence[Span], transitions: Sequence[Transition], partners: Mapping[str, list[str]]
    ) -> None:
        self.tree = SpanTree(spans)
        by_id = self.tree.by_id
        self.calls: list[_Call] = []
        for t in sorted(transitions, key=lambda t: t.call_index):
            gateway = by_id.get(t.span_id or "")
            if gateway is None:
                continue
            own = [gateway, *(by_id[f] for f in partners.get(gateway.span_id, ()) if f in by_id)]
            self.calls.append(_Call(t, own, self.tree))
        self.by_tool_call_id = {i: c for c in self.calls for i in c.tool_call_ids}

    def attach(self, span: Span) -> _Call:
        """The call ``span`` belongs to by where and when it happened (``self.calls`` is not empty)."""
        ancestors = list(self.tree.ancestors(span))
        for ancestor in ancestors:
            inside = next((c for c in self.calls if ancestor.span_id in c.span_ids), None)
            if inside is not None:
                return inside
        moment = span.start_ns
        if ancestors and span.name == semconv.SPAN_REWARD:
            # a reward attached after its parent span ended (a late reward) counts as given at its end
            moment = min(moment, ancestors[0].end_ns)
        before = [c for c in self.calls if c.end_ns <= moment]
        if not before:
            return self.calls[0]
        for ancestor in ancestors:
            scoped = [c for c in before if ancestor.span_id in c.lineage]
            if scoped:
                return max(scoped, key=lambda c: (c.end_ns, c.index))
        return max(before, key=lambda c: (c.end_ns, c.index))

    def last_call(self, attempt_id: str | None) -> _Call:
        same = [c for c in self.calls if attempt_id and c.transition.attempt_id == attempt_id]
        return (same or self.calls)[-1]


def _tool_spans(tree: SpanTree) -> list[Span]:
    """The rollout's tool calls, one span each (see the module docstring on duplicates).

    Of several spans for one tool call id, a failed one is kept when there is one (an adapter may see the
    exception that a framework's own span did not), otherwise the first.
    """
    tools = [s for s in tree.spans if kind_of(s) == TOOL]
    if any(source_of(s) != semconv.SOURCE_OPENINFERENCE for s in tools):
        tools = [s for s in tools if source_of(s) != semconv.SOURCE_OPENINFERENCE]
    tools = [s for s in tools if not any(kind_of(a) == TOOL for a in tree.ancestors(s))]
    chosen: dict[str, Span] = {}
    out: list[Span | str] = []
    for span in tools:
        call_id = span.attributes.get(semconv.GEN_AI_TOOL_CALL_ID)
        if not (isinstance(call_id, str) and call_id):
            out.append(span)
        elif call_id not in chosen:
            chosen[call_id] = span
            out.append(call_id)
        elif span.is_error and not chosen[call_id].is_error:
            chosen[call_id] = span
    return [chosen[item] if isinstance(item, str) else item for item in out]


def _malformed(gateway: Span) -> tuple[list[str], set[str]]:
    """``(reasons, call ids)`` of the malformed tool calls the gateway flagged on its span."""
    if gateway.attributes.get(semconv.TOOL_CALL_MALFORMED) is not True:
        return [], set()
    reasons = [str(r) for r in gateway.attributes.get(semconv.TOOL_CALL_MALFORMED_REASONS) or ()]
    ids = {str(i) for i in gateway.attributes.get(semconv.TOOL_CALL_MALFORMED_IDS) or ()}
    return reasons or [semconv.TOOL_CALL_UNPARSEABLE], ids


def _explicit_value(span: Span) -> float | None:
    if span.name != semconv.SPAN_REWARD or span.attributes.get(semconv.REWARD_NAME, _EPISODE) == _EPISODE:
        return None
    value = span.attributes.get(semconv.REWARD_VALUE)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def reward_events(spans: Iterable[Span], result: TransitionResult) -> list[RewardEvent]:
    """Every intermediate reward in ``spans``, attached to one of ``result``'s transitions.

    ``result`` is what :func:`~agl_core.pipeline.transitions.spans_to_transitions` made of the same spans;
    rollouts without transitions have no events. Events come per rollout, in span order; weights are not
    applied.
    """
    by_rollout: dict[str, list[Span]] = defaultdict(list)
    for span in spans:
        if span.rollout_id is not None:
            by_rollout[span.rollout_id].append(span)
    transitions: dict[str, list[Transition]] = defaultdict(list)
    for t in result.transitions:
        transitions[t.rollout_id].append(t)
    partners: dict[str, list[str]] = defaultdict(list)
    for framework_id, gateway_id in result.joins.items():
        partners[gateway_id].append(framework_id)
    events: list[RewardEvent] = []
    for rollout_id, group in by_rollout.items():
        if not transitions.get(rollout_id):
            continue
        rollout = _Rollout(group, transitions[rollout_id], partners)
        if rollout.calls:
            events.extend(_rollout_events(rollout_id, rollout))
    return events


def _rollout_events(rollout_id: str, rollout: _Rollout) -> list[RewardEvent]:
    events: list[RewardEvent] = []
    malformed_ids: set[str] = set()
    for call in rollout.calls:
        gateway = rollout.tree.by_id[call.transition.span_id or ""]
        reasons, ids = _malformed(gateway)
        malformed_ids |= ids
        events.extend(
            RewardEvent(rollout_id, call.index, MALFORMED_TOOL_CALL, gateway.span_id, 1.0, r) for r in reasons
        )
    for span in _tool_spans(rollout.tree):
        call_id = span.attributes.get(semconv.GEN_AI_TOOL_CALL_ID)
        if call_id in malformed_ids:
            continue  # counted as a malformed tool call already
        known = rollout.by_tool_call_id.get(call_id) if isinstance(call_id, str) else None
        call = known or rollout.attach(span)
        kind = TOOL_ERROR if span.is_error else TOOL_SUCCESS
        events.append(
            RewardEvent(rollout_id, call.index, kind, span.span_id, 1.0, tool_name(span) or span.name)
        )
    for span in rollout.tree.spans:
        value = _explicit_value(span)
        if value is not None:
            name = str(span.attributes.get(semconv.REWARD_NAME))
            events.append(
                RewardEvent(rollout_id, rollout.attach(span).index, EXPLICIT, span.span_id, value, name)
            )
        elif is_timeout_error(span):
            call = rollout.last_call(span.attempt_id)
            label = str(span.attributes.get(semconv.ERROR_TYPE))
            events.append(RewardEvent(rollout_id, call.index, TIMEOUT, span.span_id, 1.0, label))
    return events


# --- both layers together -----------------------------------------------------------------------------------
_NOUNS = {
    EXPLICIT: ("explicit reward", "explicit rewards"),
    TOOL_ERROR: ("tool error", "tool errors"),
    TOOL_SUCCESS: ("successful tool call", "successful tool calls"),
    MALFORMED_TOOL_CALL: ("malformed tool call", "malformed tool calls"),
    TIMEOUT: ("timeout", "timeouts"),
}


@dataclasses.dataclass(frozen=True)
class CreditResult:
    """Transitions with their final rewards, and the intermediate rewards that went into them."""

    transitions: tuple[Transition, ...]
    #: Intermediate rewards added to ``transitions`` (kinds whose weight is not 0).
    applied: tuple[RewardEvent, ...]
    #: Intermediate rewards found on calls that are not trained (agent selection), so not added.
    dropped: tuple[RewardEvent, ...]
    weights: RewardWeights
    #: Rollouts trained with a timeout episode reward (``TransitionResult.timeout_rewarded``).
    timeout_rewarded: tuple[str, ...] = ()
    #: Score of each rollout for the group baseline of the advantages: the reward the base strategy gives
    #: its last trained call, plus the mean intermediate reward per trained call. On the scale of one
    #: call's reward; without intermediate rewards it is the last call's reward (the episode reward).
    scores: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def counts(self) -> dict[str, int]:
        """How many intermediate rewards of each kind were added."""
        counts = Counter(e.kind for e in self.applied)
        return {kind: counts[kind] for kind in REWARD_KINDS if counts[kind]}

    def added(self) -> dict[str, float]:
        """Total reward added by each kind (weights applied)."""
        totals: dict[str, float] = defaultdict(float)
        for e in self.applied:
            totals[e.kind] += self.weights.weight(e.kind) * e.value
        return {kind: totals[kind] for kind in REWARD_KINDS if kind in totals}

    def summary(self) -> list[str]:
        """One line per kind added, e.g. ``3 tool errors (-0.5 each)``; timeout-rewarded rollouts last."""
        lines = []
        added = self.added()
        for kind, count in self.counts().items():
            noun = _NOUNS[kind][count != 1]
            if kind == EXPLICIT:
                lines.append(f"{count} {noun} ({added[kind]:+.4g} in all)")
            else:
                lines.append(f"{count} {noun} ({self.weights.weight(kind):+.4g} each)")
        if self.dropped:
            lines.append(
                f"{len(self.dropped)} intermediate rewards on calls of agents not trained, not added"
            )
        if self.timeout_rewarded:
            lines.append(
                f"{len(self.timeout_rewarded)} timed-out rollouts trained with the timeout episode reward"
            )
        return lines


def assign_rewards(
    result: TransitionResult,
    spans: Iterable[Span],
    *,
    strategy: str = "episode",
    gamma: float = 1.0,
    weights: RewardWeights | None = None,
    agents: Sequence[str] | None = None,
) -> CreditResult:
    """Final per-call rewards: the base strategy, then intermediate rewards.

    1. Keep the calls of the selected ``agents`` (:func:`select_agents`; all when empty).
    2. Share each rollout's episode reward among the kept calls with ``strategy`` (:func:`assign_credit`:
       ``last`` rewards the last *kept* call).
    3. Add to each kept call ``value`` of its explicit rewards (when ``weights.explicit``) and
       ``weight * count`` of its automatic events. An event on a call that is not kept is dropped, except a
       timeout, which moves to the rollout's last kept call (the rollout ended, whoever made the last call).

    The result's ``scores`` are the rollouts' scores for group baselines (pass them to the advantage
    estimator): without them a group whose episode rewards tie would carry no signal, whatever its
    intermediate rewards, and under ``per_call`` the last call's reward is no score of the rollout.

    ``spans`` are the spans ``result`` was made from. With all weights 0 (and ``explicit`` off, or no
    explicit rewards) the rewards are exactly :func:`assign_credit`'s.
    """
    weights = weights or RewardWeights()
    kept = select_agents(result.transitions, agents)
    base = assign_credit(kept, strategy, gamma=gamma)
    last_kept: dict[str, int] = {}
    last_reward: dict[str, float] = {}
    calls: Counter[str] = Counter()
    for t in base:
        calls[t.rollout_id] += 1
        if t.call_index >= last_kept.get(t.rollout_id, -1):
            last_kept[t.rollout_id], last_reward[t.rollout_id] = t.call_index, t.reward
    if not weights.active:
        return CreditResult(tuple(base), (), (), weights, result.timeout_rewarded, last_reward)
    kept_keys = {(t.rollout_id, t.call_index) for t in base}
    applied: list[RewardEvent] = []
    dropped: list[RewardEvent] = []
    extra: dict[tuple[str, int], float] = defaultdict(float)
    for event in reward_events(spans, result):
        weight = weights.weight(event.kind)
        if weight == 0.0:
            continue
        if (event.rollout_id, event.call_index) not in kept_keys:
            if event.kind != TIMEOUT or event.rollout_id not in last_kept:
                dropped.append(event)
                continue
            event = dataclasses.replace(event, call_index=last_kept[event.rollout_id])
        applied.append(event)
        extra[(event.rollout_id, event.call_index)] += weight * event.value
    out = [
        dataclasses.replace(t, reward=t.reward + extra[key])
        if (key := (t.rollout_id, t.call_index)) in extra
        else t
        for t in base
    ]
    per_rollout: dict[str, float] = defaultdict(float)
    for (rollout_id, _), value in extra.items():
        per_rollout[rollout_id] += value
    scores = {r: last_reward[r] + per_rollout[r] / calls[r] for r in last_reward}
    return CreditResult(tuple(out), tuple(applied), tuple(dropped), weights, result.timeout_rewarded, scores)
