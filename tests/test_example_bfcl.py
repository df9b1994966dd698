"""The BFCL function-calling example: BFCL's AST matching rules against known right and wrong calls, the
data and its split read from the registry's wheel, the agent through the real gateway, the gold traces."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from ._example_modules import import_fresh

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "bfcl_openai"


#: The example's modules; other examples have modules of the same names (agent, gold_traces).
MODULES = ("agent", "bfcl_check", "bfcl_data", "gold_traces")


def _module(name: str):
    return import_fresh(EXAMPLE, name, MODULES)


def _tasks(name: str) -> list[dict]:
    return [json.loads(line) for line in (EXAMPLE / name).read_text().splitlines()]


def _task(entry_id: str) -> dict:
    return next(t for t in _tasks("train.jsonl") + _tasks("val.jsonl") if t["id"] == entry_id)


# -- BFCL's matching rules ------------------------------------------------------------------------------

TRIANGLE = _task("simple_python_0")  # calculate_triangle_area(base=[10], height=[5], unit=["units", ""])


def test_a_simple_call_matches_by_name_required_values_and_optional_parameters():
    check = _module("bfcl_check").check
    functions, truth = TRIANGLE["functions"], TRIANGLE["ground_truth"]

    def verdict(*calls):
        return check("simple", functions, list(calls), truth)

    name = "calculate_triangle_area"
    assert verdict((name, {"base": 10, "height": 5})) == (True, "")  # optional unit left out
    assert verdict((name, {"base": 10, "height": 5, "unit": "Units"}))[0]  # strings: case-insensitive
    assert verdict((name, {"base": 10, "height": 5, "unit": "cm"})) == (
        False,
        "unit: 'cm' is not one of ['units', '']",
    )
    assert verdict((name, {"base": 5, "height": 10}))[1] == "base: 5 is not one of [10]"
    assert verdict((name, {"base": 10}))[1] == "missing required parameter 'height'"
    assert verdict((name, {"base": 10, "height": 5, "colour": "red"}))[1] == "unexpected parameter 'colour'"
    assert verdict((name, {"base": "10", "height": 5}))[1] == "base: '10' is str, expected integer"
    assert verdict((name, {"base": True, "height": 5}))[1] == "base: True is bool, expected integer"
    assert (
        verdict(("area", {"base": 10, "height": 5}))[1] == "called 'area', expected 'calculate_triangle_area'"
    )
    assert verdict()[1] == "0 call(s), expected 1"
    two = verdict((name, {"base": 10, "height": 5}), (name, {"base": 10, "height": 5}))
    assert two == (False, "2 call(s), expected 1")
    with pytest.raises(ValueError, match="unknown BFCL category"):
        check("multi_turn", functions, [], truth)


def test_floats_take_integers_and_strings_compare_without_spaces_punctuation_or_case():
    bfcl_check = _module("bfcl_check")
    function = {
        "name": "f",
        "parameters": {
            "type": "dict",
            "properties": {
                "x": {"type": "float"},
                "city": {"type": "string"},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["x"],
        },
    }
    expected = {"x": [2.0], "city": ["San Diego, CA", ""], "tags": [["new-york", "LA"], ""]}
    assert bfcl_check.check_call(function, {"x": 2}, expected) == ""
    assert bfcl_check.check_call(function, {"x": 2.0, "city": "san diego ca"}, expected) == ""
    assert bfcl_check.check_call(function, {"x": 2.5}, expected) == "x: 2.5 is not one of [2.0]"
    assert bfcl_check.check_call(function, {"x": 2, "tags": ["New York", "la"]}, expected) == ""
    assert bfcl_check.check_call(function, {"x": 2, "tags": ["la", "New York"]}, expected).startswith("tags:")
    assert bfcl_check.standardize("April 1, 2024") == bfcl_check.standardize("april 1 2024") == "april12024"


def test_dict_and_list_of_dict_parameters_match_key_by_key():
    task = _task("multiple_119")  # conditions: a list of dicts
    check = _module("bfcl_check").check
    ((name, expected),) = task["ground_truth"][0].items()
    right = [
        {"field": "age", "operation": ">", "value": "25"},
        {"field": "job", "operation": "=", "value": "Engineer"},
    ]
    other = {k: v[0] for k, v in expected.items() if k != "conditions" and v[0] != ""}
    assert check(
        "multiple", task["functions"], [(name, {**other, "conditions": right})], task["ground_truth"]
    )[0]
    wrong = [right[0], {**right[1], "value": "doctor"}]
    assert not check(
        "multiple", task["functions"], [(name, {**other, "conditions": wrong})], task["ground_truth"]
    )[0]
    assert not check(
        "multiple", task["functions"], [(name, {**other, "conditions": right[:1]})], task["ground_truth"]
    )[0]


def test_parallel_calls_match_in_any_order_each_expected_call_once():
    task = _task("parallel_0")  # spotify.play twice: Taylor Swift 20, Maroon 5 15
    bfcl_check = _module("bfcl_check")
    gold = bfcl_check.gold_calls(task["functions"], task["ground_truth"])
    assert len(gold) == 2 and {args["artist"] for _, args in gold} == {"Taylor Swift", "Maroon 5"}
    assert bfcl_check.check("parallel", task["functions"], gold, task["ground_truth"]) == (True, "")
    assert bfcl_check.check("parallel", task["functions"], gold[::-1], task["ground_truth"]) == (True, "")
    assert not bfcl_check.check("parallel", task["functions"], [gold[0], gold[0]], task["ground_truth"])[0]
    assert not bfcl_check.check("parallel", task["functions"], gold[:1], task["ground_truth"])[0]


def test_every_entry_s_own_ground_truth_passes_and_nothing_else_of_it_does():
    """The checker against the whole data: each entry's first accepted values pass; the same calls with
    one required argument dropped, or in an entry of another category's count, fail."""
    bfcl_check = _module("bfcl_check")
    failed, dropped = [], 0
    for task in _tasks("train.jsonl") + _tasks("val.jsonl"):
        gold = bfcl_check.gold_calls(task["functions"], task["ground_truth"])
        if not bfcl_check.check(task["category"], task["functions"], gold, task["ground_truth"])[0]:
            failed.append(task["id"])
        name, arguments = gold[0]
        function = next(f for f in task["functions"] if f["name"] == name)
        required = [p for p in function["parameters"].get("required", []) if p in arguments]
        if required:
            broken = [(name, {k: v for k, v in arguments.items() if k != required[0]}), *gold[1:]]
            assert not bfcl_check.check(task["category"], task["functions"], broken, task["ground_truth"])[0]
            dropped += 1
    assert failed == [] and dropped > 900


# -- data and split -------------------------------------------------------------------------------------


def test_the_committed_split_holds_out_a_quarter_of_each_category_by_entry_id():
    train, val = _tasks("train.jsonl"), _tasks("val.jsonl")
    held_out = json.loads((EXAMPLE / "split.json").read_text())["held_out_ids"]
    assert [t["id"] for t in val] == held_out and not {t["id"] for t in train} & set(held_out)
    assert Counter(t["category"] for t in val) == {
        "simple": 100,
        "multiple": 50,
        "parallel": 50,
        "parallel_multiple": 50,
    }
    assert Counter(t["category"] for t in train) == {
        "simple": 300,
        "multiple": 150,
        "parallel": 150,
        "parallel_multiple": 150,
    }
    assert all(t["number"] % 4 == 0 for t in val)


def test_the_task_files_are_what_the_registry_s_wheel_gives(tmp_path, capsys):
    """Downloads bfcl-eval's wheel (about 1 MB, not installed), checks its digest, reads the four
    categories and compares them with the committed files; a wheel with another digest is refused."""
    bfcl_data = _module("bfcl_data")
    assert bfcl_data.main(["--check", "--wheels", str(tmp_path)]) == 0
    assert "1000 entries (0 excluded): 750 train, 250 held out" in capsys.readouterr().out
    wheel = tmp_path / bfcl_data.WHEEL
    wheel.write_bytes(wheel.read_bytes() + b"\0")
    assert bfcl_data.main(["--check", "--wheels", str(tmp_path)]) == 1
    assert "SHA-256" in capsys.readouterr().err


# -- the agent ------------------------------------------------------------------------------------------


def test_tools_are_offered_under_openai_names_and_json_schema_types():
    agent = _module("agent")
    (tool,) = agent.tools_of(_task("simple_python_1")["functions"])  # math.factorial
    assert tool["function"]["name"] == "math_factorial"
    assert tool["function"]["parameters"]["type"] == "object"
    floats = agent.tools_of(
        [
            {
                "name": "a.b",
                "parameters": {
                    "type": "dict",
                    "properties": {"x": {"type": "float"}, "t": {"type": "tuple", "items": {"type": "any"}}},
                },
            }
        ]
    )
    properties = floats[0]["function"]["parameters"]["properties"]
    assert properties == {"x": {"type": "number"}, "t": {"type": "array", "items": {"type": "string"}}}


def test_the_agent_calls_through_the_gateway_and_is_scored_by_bfcl_s_rules():
    """The plain OpenAI client through the real gateway (a scripted policy): the reply's calls come back
    under BFCL's names; a right call scores 1, the right function with a wrong argument 0.1 while training
    and 0 when evaluated, prose 0."""
    from types import SimpleNamespace

    from agl_core.testing import AglTestStack, tool_call

    agent = _module("agent")
    task = _task("simple_python_1")
    offered: list = []

    def script(reply: str):
        def answer(messages, tools):
            offered.append([t["function"]["name"] for t in tools or ()])
            return reply

        return answer

    cases = [
        (tool_call("math_factorial", {"number": 5}), False, 1.0),
        (tool_call("math_factorial", {"number": 5}), True, 1.0),
        (tool_call("math_factorial", {"number": 6}), False, 0.1),
        (tool_call("math_factorial", {"number": 6}), True, 0.0),
        ("The factorial of 5 is 120.", False, 0.0),
    ]
    for reply, evaluating, expected in cases:
        with AglTestStack(script=script(reply)) as stack:
            llm = SimpleNamespace(
                base_url=stack.base_url("ro-1"), api_key="x", model="scripted", evaluating=evaluating
            )
            assert agent.solve(task, llm) == expected, reply
    assert offered[0] == ["math_factorial"]
    outcome = agent.score(task, [("math.factorial", {"number": 6})], training=False)
    assert outcome.reason == "number: 6 is not one of [5]" and outcome.reward == 0.0


def test_gold_traces_become_one_sft_example_per_training_entry_with_its_calls(tmp_path):
    """gold_traces.py writes each entry's call answered with its ground truth and imports it; the
    stored-traces SFT path reads one example per entry, with the tools offered and the calls made, and
    renders the calls in the Hermes format the gateway parses."""
    from agl_core.pipeline.sft import spans_to_sft_examples
    from agl_trainer.run.traces import read_store

    gold_traces = _module("gold_traces")
    tasks = [_task("simple_python_1"), _task("parallel_1")]
    (tmp_path / "two.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    assert gold_traces.main(["--out", str(tmp_path / "gold"), "--tasks", str(tmp_path / "two.jsonl")]) == 0
    assert gold_traces.main(["--out", str(tmp_path / "gold"), "--tasks", str(EXAMPLE / "val.jsonl")]) == 1
    spans, rollouts = read_store(str(tmp_path / "gold" / "store.sqlite"))
    assert len(rollouts) == 2
    examples = sorted(spans_to_sft_examples(spans).examples, key=lambda e: len(e.response["tool_calls"]))
    factorial, em_force = examples
    assert factorial.messages == ({"role": "user", "content": tasks[0]["messages"][0]["content"]},)
    assert [t["function"]["name"] for t in factorial.tools] == ["math_factorial"]
    (call,) = factorial.response["tool_calls"]
    assert call["function"]["name"] == "math_factorial" and json.loads(call["function"]["arguments"]) == {
        "number": 5
    }
    assert sorted(
        json.loads(c["function"]["arguments"])["d_time"] for c in em_force.response["tool_calls"]
    ) == [4, 10]
