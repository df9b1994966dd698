"""Known-good calls written with ``write_demonstrations``, imported by ``agl import``'s own code, are read
back by the stored-traces SFT path as one example each, with their prompt, tools, reply and agent."""

from __future__ import annotations

import json

import pytest

from agl_core.importer import Demonstration, import_traces, write_demonstrations
from agl_core.pipeline.sft import spans_to_sft_examples

TOOL = {
    "type": "function",
    "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}},
}
DEMOS = [
    Demonstration(
        id="sql-1",
        messages=[{"role": "system", "content": "Write SQL."}, {"role": "user", "content": "How many?"}],
        response="SELECT count(*) FROM t",
        agent="writer",
        attributes={"example.id": "q1"},
    ),
    Demonstration(
        id="call-1",
        messages=[{"role": "user", "content": "Add 2 and 3, then 4 and 5."}],
        tool_calls=[("add", {"a": 2, "b": 3}), ("add", {"a": 4, "b": 5})],
        tools=[TOOL],
    ),
]


def test_demonstrations_import_as_one_rollout_each_and_become_sft_examples(tmp_path):
    from agl_trainer.run.traces import read_store

    path = tmp_path / "demos.jsonl"
    assert write_demonstrations(path, DEMOS, service="unit") == 2
    summary = import_traces([path], str(tmp_path / "store.sqlite"))
    assert (summary.rollouts, summary.new_spans, summary.problems) == (2, 2, [])
    again = import_traces([path], str(tmp_path / "store.sqlite"))  # the same ids: nothing new
    assert again.new_spans == 0
    spans, rollouts = read_store(str(tmp_path / "store.sqlite"))
    assert len(rollouts) == 2
    result = spans_to_sft_examples(spans)
    assert result.problems == ()
    sql, calls = sorted(result.examples, key=lambda e: "tool_calls" in e.response)
    assert sql.messages == tuple(DEMOS[0].messages) and sql.response["content"] == "SELECT count(*) FROM t"
    assert sql.agent_name == "writer" and sql.tools is None
    assert [json.loads(c["function"]["arguments"]) for c in calls.response["tool_calls"]] == [
        {"a": 2, "b": 3},
        {"a": 4, "b": 5},
    ]
    assert calls.tools is not None and list(calls.tools) == [TOOL]
    only_writer = spans_to_sft_examples(spans, agents=["writer"]).examples
    assert [e.agent_name for e in only_writer] == ["writer"]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"messages": []}, "has no prompt messages"),
        ({"messages": [{"role": "user", "content": "q"}]}, "neither a response text nor tool calls"),
        ({"messages": [{"role": "user", "content": None}], "response": "a"}, "string role and text content"),
    ],
)
def test_a_demonstration_without_a_prompt_or_an_answer_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        Demonstration(id="bad", **fields)


def test_two_demonstrations_with_one_id_are_refused_before_anything_is_written(tmp_path):
    path = tmp_path / "demos.jsonl"
    with pytest.raises(ValueError, match="two demonstrations have the id 'sql-1'"):
        write_demonstrations(path, [DEMOS[0], DEMOS[0]], service="unit")
    assert not path.exists()
