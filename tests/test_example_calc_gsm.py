"""The calculator agent on GSM-style problems: the tasks reasoning-gym's generator gives for the committed
seeds and template split, its scorer as the reward, and the AutoGen agent through the real gateway."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from agl_core.testing import tool_call

from ._example_modules import import_fresh

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "calc_autogen"


#: This example's modules the GSM ones import; other examples have an ``agent`` module too.
MODULES = ("agent", "calc_tool", "gsm_agent", "gsm_gold", "gsm_tasks")


def _load(name: str):
    return import_fresh(EXAMPLE, name, MODULES)


def _jsonl(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (EXAMPLE / "gsm" / name).read_text().splitlines()]


def test_the_committed_tasks_are_what_the_generator_gives_for_their_seeds(capsys):
    assert _load("gsm_tasks").main(["--check"]) == 0
    assert "are what the generator gives" in capsys.readouterr().out


def test_held_out_problems_come_from_templates_never_trained_on():
    train, val = _jsonl("train.jsonl"), _jsonl("val.jsonl")
    held_out = set(json.loads((EXAMPLE / "gsm" / "split.json").read_text())["held_out_templates"])
    assert (len(train), len(val)) == (600, 200)
    assert {t["template"] for t in val} <= held_out and not {t["template"] for t in train} & held_out
    assert len({t["template"] for t in val}) >= 15 and len({t["template"] for t in train}) >= 60
    assert not {t["question"] for t in train} & {t["question"] for t in val}
    # the worked solution ends with its answer (one template writes it as a float: "#### 51.0")
    assert all(float(t["answer_cot"].rsplit("####", 1)[1]) == float(t["answer"]) for t in train + val)


def test_the_reward_is_the_generator_s_scorer_on_the_tagged_or_last_number():
    agent = _load("gsm_agent")
    assert agent.answer_of("First 3 * 35 = 105, so <answer>288</answer>") == "288"
    assert agent.answer_of("3 times 35 is 105, and 105 + 183 = 288.") == "288"
    assert agent.answer_of("I cannot tell.") is None
    assert agent.answer_of("It is 12.5 cups") == "12.5"
    assert (agent.score("288", "288"), agent.score("289", "288"), agent.score(None, "288")) == (
        1.0,
        0.01,
        0.0,
    )


def test_the_curriculum_problems_are_the_generator_s_with_their_calculator_value():
    """gsm/arith_*.jsonl: basic_arithmetic's problems, none held out that was trained on, each one's stated
    answer what the agent's calculator gives for its expression; the one the generator gets wrong is
    named in split.json, not kept."""
    tool = _load("calc_tool")
    train, val = _jsonl("arith_train.jsonl"), _jsonl("arith_val.jsonl")
    assert (len(train), len(val)) == (400, 200)
    assert {t["generator"] for t in train + val} == {"basic_arithmetic"}
    expressions = [t["question"].removeprefix("Calculate ").removesuffix(".") for t in train + val]
    assert all(t["question"].startswith("Calculate ") for t in train + val)
    assert not set(expressions[:400]) & set(expressions[400:])
    assert [tool.calculator(e) for e in expressions] == [t["answer"] for t in train + val]
    excluded = json.loads((EXAMPLE / "gsm" / "split.json").read_text())["curriculum"]["excluded"]
    assert [(p["index"], p["answer"]) for p in excluded] == [(535, "0")]
    assert tool.calculator(excluded[0]["question"].removeprefix("Calculate ").removesuffix(".")) != "0"
    assert 535 not in {t["index"] for t in train + val}


def test_a_task_s_generator_chooses_the_scorer():
    agent = _load("gsm_agent")
    # basic_arithmetic's scorer: the exact answer string; partial credit for an answer containing it
    assert agent.score("-1312", "-1312", "basic_arithmetic") == 1.0
    assert agent.score("-1312.0", "-1312", "basic_arithmetic") == pytest.approx(5 / 7)
    assert agent.score("-1311", "-1312", "basic_arithmetic") == 0.0
    # gsm_symbolic's compares numbers: "1312.0" is right there
    assert agent.score("1312.0", "1312") == 1.0
    with pytest.raises(ValueError, match="unknown generator 'chain_sum'.*gsm_symbolic, basic_arithmetic"):
        agent.solve({"question": "1 + 1", "answer": "2", "generator": "chain_sum"}, None)


@pytest.mark.parametrize(
    ("replies", "evaluating", "expected", "calls"),
    [
        # a calculator call, its result back to the model, then the answer in tags
        (
            [
                tool_call("calculator", {"expression": "3 * 35 + 93 + 55"}),
                "<answer>253</answer>",
            ],
            False,
            1.0,
            2,
        ),
        (["The total is 250."], False, 0.01, 1),  # another number: the scorer's 0.01 while training
        (["The total is 250."], True, 0.0, 1),  # ... and a miss when evaluated
        (["I do not know."], False, 0.0, 1),
    ],
)
def test_the_agent_calls_the_calculator_then_answers_and_is_scored(replies, evaluating, expected, calls):
    from agl_core.testing import AglTestStack

    agent = _load("gsm_agent")
    task = {
        "question": "John has 35 apples, 3 times as much kiwi, buys 93 apples and 55 kiwi. Total?",
        "answer": "253",
    }
    seen: list[list[dict]] = []
    queue = list(replies)

    def script(messages, tools):
        seen.append(list(messages))
        return queue.pop(0)

    with AglTestStack(script=script) as stack:
        llm = SimpleNamespace(
            base_url=stack.base_url("ro-1"), api_key="x", model="scripted", evaluating=evaluating
        )
        assert agent.solve(task, llm) == expected
    assert len(seen) == calls
    # the calculator agent's worked examples come as earlier turns, between the system prompt and the problem
    examples = [(m["role"], m["content"]) for m in seen[0][1:-1]]
    assert examples == [(m["role"], m["content"]) for m in _load("gsm_gold").example_turns()]
    assert len(examples) == 8 and all("<tool_call>" in c for r, c in examples if r == "assistant")
    if calls == 2:  # the calculator's result went back to the model
        assert seen[1][-1]["role"] == "tool" and seen[1][-1]["content"] == "253"


def test_the_worked_solutions_become_the_agent_s_first_call_answered_as_it_should(tmp_path):
    """gsm_gold.py: the same system prompt, worked examples, question and calculator tool (JSON-identical)
    the AutoGen agent sends, answered with the worked solution whose last line is the answer in tags,
    which the agent reads as the right answer; held-out templates are refused."""
    from agl_core.pipeline.sft import spans_to_sft_examples
    from agl_core.testing import AglTestStack
    from agl_trainer.run.traces import read_store

    agent, gold = _load("gsm_agent"), _load("gsm_gold")
    tasks = _jsonl("train.jsonl")[:2]
    (tmp_path / "two.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    assert gold.main(["--out", str(tmp_path / "gold"), "--tasks", str(tmp_path / "two.jsonl")]) == 0
    assert gold.main(["--out", str(tmp_path / "gold"), "--tasks", str(EXAMPLE / "gsm" / "val.jsonl")]) == 1
    spans, _ = read_store(str(tmp_path / "gold" / "store.sqlite"))
    examples = sorted(spans_to_sft_examples(spans).examples, key=lambda e: e.messages[-1]["content"])
    sent: list = []

    def script(messages, tools):
        sent.append((messages, tools))
        return "<answer>0</answer>"

    for example, task in zip(examples, sorted(tasks, key=lambda t: t["question"]), strict=True):
        with AglTestStack(script=script) as stack:
            llm = SimpleNamespace(
                base_url=stack.base_url("ro-1"), api_key="x", model="scripted", evaluating=True
            )
            agent.solve(task, llm)
        messages, tools = sent.pop()
        assert json.dumps(list(example.tools)) == json.dumps(tools)
        assert [(m["role"], m["content"]) for m in messages] == [
            (m["role"], m["content"]) for m in example.messages
        ]
        reply = example.response["content"]
        assert reply.endswith(f"<answer>{task['answer']}</answer>") and "####" not in reply
        assert agent.score(agent.answer_of(reply), task["answer"]) == 1.0
