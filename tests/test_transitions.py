from agl_core import semconv
from agl_core.pipeline.credit import assign_credit, select_agents
from agl_core.pipeline.transitions import (
    COUNT_MISMATCH,
    FILTERED_AGENT,
    NO_LLM_CALL,
    NO_REWARD,
    NO_TOKENS,
    NOT_JOINED,
    NOT_TRAINABLE,
    USAGE_MISMATCH,
    explain_untrained,
    spans_to_transitions,
)

from .conftest import make_span

R = semconv


def _ids(rollout):
    return {R.ROLLOUT_ID: rollout, R.ATTEMPT_ID: f"{rollout}-a1"}


def _gateway(rollout, parent, response_id, prompt, response, logprobs=None, **extra):
    attrs = {
        **_ids(rollout),
        R.SOURCE: R.SOURCE_GATEWAY,
        R.GEN_AI_OPERATION_NAME: R.OP_CHAT,
        R.GEN_AI_RESPONSE_ID: response_id,
        R.PROMPT_TOKEN_IDS: prompt,
        R.RESPONSE_TOKEN_IDS: response,
        R.POLICY_VERSION: 3,
        **extra,
    }
    if logprobs is not None:
        attrs[R.RESPONSE_LOGPROBS] = logprobs
    return make_span("chat m", attrs, parent=parent)


def _reward(rollout, parent, value, name="episode"):
    return make_span(
        R.SPAN_REWARD, {**_ids(rollout), R.REWARD_VALUE: value, R.REWARD_NAME: name}, parent=parent
    )


def _two_agent_rollout(rollout="ro-1", reward=1.0):
    """rollout span > [writer step > llm call] + [checker step > llm call > tool] ; gateway spans; reward."""
    root = make_span(R.SPAN_ROLLOUT, {**_ids(rollout), R.TASK_ID: "task-7"})
    writer = make_span("writer", {**_ids(rollout), R.GEN_AI_AGENT_NAME: "writer"}, parent=root)
    w_llm = make_span(
        "chat m",
        {**_ids(rollout), R.GEN_AI_OPERATION_NAME: R.OP_CHAT, R.GEN_AI_RESPONSE_ID: "c1"},
        parent=writer,
    )
    checker = make_span("checker", {**_ids(rollout), R.GEN_AI_AGENT_NAME: "checker"}, parent=root)
    c_llm = make_span(
        "chat m",
        {**_ids(rollout), R.GEN_AI_OPERATION_NAME: R.OP_CHAT, R.GEN_AI_RESPONSE_ID: "c2"},
        parent=checker,
    )
    tool = make_span(
        "execute_tool sql", {**_ids(rollout), R.GEN_AI_OPERATION_NAME: R.OP_EXECUTE_TOOL}, parent=checker
    )
    g1 = _gateway(rollout, None, "c1", [1, 2, 3], [4, 5], [-0.5, -0.25])
    g2 = _gateway(rollout, None, "c2", [1, 2, 3, 4, 5, 6], [7], [-1.0])
    spans = [root, writer, w_llm, checker, c_llm, tool, g1, g2]
    if reward is not None:
        spans.append(_reward(rollout, root, reward))
    return spans


def test_one_transition_per_llm_call_with_exact_tokens_agent_names_and_reward():
    result = spans_to_transitions(_two_agent_rollout())
    assert result.problems == ()
    first, second = result.transitions
    assert (first.prompt_ids, first.response_ids, first.response_logprobs) == (
        (1, 2, 3),
        (4, 5),
        (-0.5, -0.25),
    )
    assert (second.prompt_ids, second.response_ids) == ((1, 2, 3, 4, 5, 6), (7,))
    assert [t.agent_name for t in result.transitions] == ["writer", "checker"]
    assert [t.call_index for t in result.transitions] == [0, 1]
    assert {t.reward for t in result.transitions} == {1.0}
    assert {t.task_id for t in result.transitions} == {"task-7"}
    assert {t.attempt_id for t in result.transitions} == {"ro-1-a1"}
    assert first.policy_version == 3


def test_span_order_in_input_does_not_matter():
    spans = _two_agent_rollout()
    assert spans_to_transitions(list(reversed(spans))).transitions == spans_to_transitions(spans).transitions


def test_rollouts_are_kept_apart():
    spans = _two_agent_rollout("ro-a", 1.0) + _two_agent_rollout("ro-b", 0.0)
    result = spans_to_transitions(spans)
    by_rollout = {}
    for t in result.transitions:
        by_rollout.setdefault(t.rollout_id, []).append(t.reward)
    assert by_rollout == {"ro-a": [1.0, 1.0], "ro-b": [0.0, 0.0]}


def test_last_episode_reward_wins_and_named_rewards_are_not_episode_rewards():
    spans = _two_agent_rollout(reward=0.2)
    spans.append(_reward("ro-1", None, 0.9))
    spans.append(_reward("ro-1", None, 5.0, name="format"))
    assert {t.reward for t in spans_to_transitions(spans).transitions} == {0.9}


def test_join_by_parentage_when_trace_context_was_propagated():
    root = make_span(R.SPAN_ROLLOUT, _ids("ro-p"))
    agent = make_span("solver", {**_ids("ro-p"), R.GEN_AI_AGENT_NAME: "solver"}, parent=root)
    llm = make_span("chat m", {**_ids("ro-p"), R.GEN_AI_OPERATION_NAME: R.OP_CHAT}, parent=agent)
    gateway = _gateway("ro-p", llm, "no-such-id-on-framework-side", [1], [2], [-0.1])
    result = spans_to_transitions([root, agent, llm, gateway, _reward("ro-p", root, 1.0)])
    assert result.problems == ()
    assert result.transitions[0].agent_name == "solver"


def test_problems_are_reported_not_trained_on():
    # framework call that never reached the gateway
    root = make_span(R.SPAN_ROLLOUT, _ids("ro-x"))
    lost = make_span(
        "chat m",
        {**_ids("ro-x"), R.GEN_AI_OPERATION_NAME: R.OP_CHAT, R.GEN_AI_RESPONSE_ID: "zz"},
        parent=root,
    )
    ok = _gateway("ro-x", None, "c9", [1], [2], [-0.1])
    result = spans_to_transitions([root, lost, ok, _reward("ro-x", root, 1.0)])
    assert len(result.transitions) == 1
    assert result.reasons() == {NOT_JOINED: 1}

    no_reward = spans_to_transitions(_two_agent_rollout(reward=None))
    assert no_reward.transitions == () and no_reward.reasons() == {NO_REWARD: 1}

    only_reward = spans_to_transitions([_reward("ro-y", None, 1.0)])
    assert only_reward.reasons() == {NO_LLM_CALL: 1}

    external = _gateway("ro-z", None, "c1", [1], [2], None, **{R.TRAINABLE: False})
    result = spans_to_transitions([external, _reward("ro-z", None, 1.0)])
    assert result.transitions == () and result.reasons() == {NOT_TRAINABLE: 1}


def test_openinference_llm_spans_are_joined_too():
    root = make_span(R.SPAN_ROLLOUT, _ids("ro-oi"))
    llm = make_span(
        "ChatOpenAI",
        {**_ids("ro-oi"), R.OPENINFERENCE_SPAN_KIND: "LLM", R.GEN_AI_RESPONSE_ID: "c1"},
        parent=root,
    )
    result = spans_to_transitions(
        [root, llm, _gateway("ro-oi", None, "c1", [1], [2], [-0.3]), _reward("ro-oi", root, 0.5)]
    )
    assert result.problems == () and len(result.transitions) == 1


def test_credit_strategies_and_agent_selection():
    transitions = spans_to_transitions(_two_agent_rollout(reward=1.0)).transitions
    assert [t.reward for t in assign_credit(transitions, "episode")] == [1.0, 1.0]
    assert [t.reward for t in assign_credit(transitions, "last")] == [0.0, 1.0]
    assert [t.reward for t in assign_credit(transitions, "discounted", gamma=0.5)] == [0.5, 1.0]
    assert [t.agent_name for t in select_agents(transitions, ["wri*"])] == ["writer"]
    assert len(select_agents(transitions, [])) == 2
    import pytest

    with pytest.raises(ValueError, match="unknown credit strategy"):
        assign_credit(transitions, "bogus")


# --- joins without a completion id, and two sources describing the same calls --------------------------
def _framework_llm(rollout, parent, source, usage=None, **extra):
    attrs = {**_ids(rollout), R.GEN_AI_OPERATION_NAME: R.OP_CHAT, **extra}
    if source == "openinference":
        attrs = {**_ids(rollout), R.OPENINFERENCE_SPAN_KIND: "LLM", **extra}
    else:
        attrs[R.SOURCE] = source
    if usage is not None:
        key_in, key_out = (
            (R.LLM_TOKEN_COUNT_PROMPT, R.LLM_TOKEN_COUNT_COMPLETION)
            if source == "openinference"
            else (R.GEN_AI_USAGE_INPUT_TOKENS, R.GEN_AI_USAGE_OUTPUT_TOKENS)
        )
        attrs.update({key_in: usage[0], key_out: usage[1]})
    return make_span("chat m", attrs, parent=parent)


def _gateway_call(rollout, response_id, n_prompt, n_response):
    return _gateway(
        rollout,
        None,
        response_id,
        list(range(n_prompt)),
        list(range(n_response)),
        [-0.1] * n_response,
        **{R.GEN_AI_USAGE_INPUT_TOKENS: n_prompt, R.GEN_AI_USAGE_OUTPUT_TOKENS: n_response},
    )


def _order_rollout(rollout, source, usages, gateway_sizes):
    root = make_span(R.SPAN_ROLLOUT, _ids(rollout))
    agents = [
        make_span(f"invoke_agent a{i}", {**_ids(rollout), R.GEN_AI_AGENT_NAME: f"a{i}"}, parent=root)
        for i in range(len(usages))
    ]
    calls = [_framework_llm(rollout, agents[i], source, usage) for i, usage in enumerate(usages)]
    gateway = [_gateway_call(rollout, f"c{i}", *size) for i, size in enumerate(gateway_sizes)]
    return [root, *agents, *calls, *gateway, _reward(rollout, root, 1.0)], calls


def test_calls_without_completion_id_are_joined_by_order_when_token_counts_agree():
    spans, _ = _order_rollout("ro-ord", "autogen", [(3, 2), (5, 1), (9, 4)], [(3, 2), (5, 1), (9, 4)])
    result = spans_to_transitions(spans)
    assert result.problems == ()
    assert [t.agent_name for t in result.transitions] == ["a0", "a1", "a2"]


def test_order_join_refuses_when_counts_or_token_counts_disagree():
    spans, calls = _order_rollout("ro-cnt", "autogen", [(3, 2), (5, 1)], [(3, 2), (5, 1), (9, 4)])
    result = spans_to_transitions(spans)
    assert result.reasons() == {COUNT_MISMATCH: 2}
    assert {p.span_id for p in result.problems} == {c.span_id for c in calls}
    assert "2 unmatched framework calls, 3 unmatched gateway calls" in result.problems[0].detail
    # the gateway calls are still trained on, only without an agent name
    assert len(result.transitions) == 3 and {t.agent_name for t in result.transitions} == {None}

    spans, calls = _order_rollout("ro-use", "openinference", [(3, 2), (5, 7)], [(3, 2), (5, 1)])
    result = spans_to_transitions(spans)
    assert result.reasons() == {USAGE_MISMATCH: 1}
    assert (
        result.problems[0].span_id == calls[1].span_id and "output tokens 7 vs 1" in result.problems[0].detail
    )
    assert [t.agent_name for t in result.transitions] == ["a0", None]


def test_an_agl_span_and_an_openinference_span_of_one_call_make_one_transition():
    root = make_span(R.SPAN_ROLLOUT, _ids("ro-both"))
    agent = make_span("invoke_agent solver", {**_ids("ro-both"), R.GEN_AI_AGENT_NAME: "solver"}, parent=root)
    oi_agent = make_span(
        "solver",
        {**_ids("ro-both"), R.OPENINFERENCE_SPAN_KIND: "AGENT", R.OI_AGENT_NAME: "solver-oi"},
        parent=root,
    )
    spans = [root, agent, oi_agent]
    for i in range(2):
        agl = _framework_llm("ro-both", agent, R.SOURCE_OPENAI_AGENTS, (4, 2))
        oi = _framework_llm("ro-both", oi_agent, "openinference", (4, 2))
        gateway = _gateway(
            "ro-both", agl, f"c{i}", [1, 2, 3, 4], [5, 6], [-0.1, -0.2]
        )  # child of the agl span
        spans += [agl, oi, gateway]
    result = spans_to_transitions([*spans, _reward("ro-both", root, 1.0)])
    assert result.problems == ()
    assert [t.agent_name for t in result.transitions] == ["solver", "solver"]  # the agl span names the agent
    assert sorted(result.joins.values()) == sorted(
        [t.span_id for t in result.transitions] * 2
    )  # both sources joined


def test_openinference_langgraph_nodes_name_agents():
    import json

    def chain(name, metadata, parent):
        return make_span(
            name,
            {**_ids("ro-lg"), R.OPENINFERENCE_SPAN_KIND: "CHAIN", R.OI_METADATA: json.dumps(metadata)},
            parent=parent,
        )

    root = make_span(R.SPAN_ROLLOUT, _ids("ro-lg"))
    graph = chain("LangGraph", {"ls_integration": "langgraph"}, root)
    node = chain("solver", {"ls_integration": "langgraph", "langgraph_node": "solver"}, graph)
    inner = chain("agent", {"ls_integration": "langgraph", "langgraph_node": "agent"}, node)
    llm = _framework_llm("ro-lg", inner, "openinference", None, **{R.GEN_AI_RESPONSE_ID: "c1"})
    named = chain("planner", {"ls_integration": "langgraph"}, root)  # a graph compiled with a name
    named_node = chain("agent", {"ls_integration": "langgraph", "langgraph_node": "agent"}, named)
    llm2 = _framework_llm("ro-lg", named_node, "openinference", None, **{R.GEN_AI_RESPONSE_ID: "c2"})
    spans = [
        root,
        graph,
        node,
        inner,
        llm,
        named,
        named_node,
        llm2,
        _gateway_call("ro-lg", "c1", 2, 1),
        _gateway_call("ro-lg", "c2", 2, 1),
        _reward("ro-lg", root, 1.0),
    ]
    result = spans_to_transitions(spans)
    assert result.problems == () and [t.agent_name for t in result.transitions] == ["solver", "planner"]


def test_rollouts_that_train_nothing_are_explained():
    ok = _two_agent_rollout("ro-ok", 1.0)
    no_reward = _two_agent_rollout("ro-nr", None)
    no_call = [_reward("ro-nc", None, 1.0)]
    root = make_span(R.SPAN_ROLLOUT, _ids("ro-nj"))
    not_joined = [
        root,
        make_span(
            "chat m",
            {**_ids("ro-nj"), R.GEN_AI_OPERATION_NAME: R.OP_CHAT, R.GEN_AI_RESPONSE_ID: "zz"},
            parent=root,
        ),
        _reward("ro-nj", root, 1.0),
    ]
    empty = [_gateway("ro-empty", None, "c1", [1, 2], [], []), _reward("ro-empty", None, 1.0)]
    result = spans_to_transitions(ok + no_reward + no_call + not_joined + empty)
    ids = ["ro-ok", "ro-nr", "ro-nc", "ro-nj", "ro-empty", "ro-nospans"]

    kept = [t for t in select_agents(result.transitions, ["writer"]) if t.prompt_ids and t.response_ids]
    assert explain_untrained(ids, result, kept) == {
        "ro-nr": NO_REWARD,
        "ro-nc": NO_LLM_CALL,
        "ro-nj": NO_LLM_CALL,
        "ro-empty": NO_TOKENS,
        "ro-nospans": NO_LLM_CALL,
    }
    only_checker = select_agents(result.transitions, ["nobody"])
    assert explain_untrained(["ro-ok"], result, only_checker) == {"ro-ok": FILTERED_AGENT}
