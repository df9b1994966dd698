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


def test_the_committed_split_holds_out_whole_groups_and_no_held_out_question_or_call_is_trained_on():
    """BFCL reuses questions across categories (``multiple`` repeats ``simple_python`` questions, often
    with the same expected call): 53 held-out entries of the first split had a training entry's question,
    31 of them its call too. Entries sharing a question or an expected call now go to one side."""
    bfcl_data = _module("bfcl_data")
    train, val = _tasks("train.jsonl"), _tasks("val.jsonl")
    split = json.loads((EXAMPLE / "split.json").read_text())
    assert split["rule"] == bfcl_data.RULE
    held_out = split["held_out_ids"]
    assert [t["id"] for t in val] == held_out and not {t["id"] for t in train} & set(held_out)
    assert len(val) == 291 and len(train) == 709
    assert Counter(t["category"] for t in val) == {
        "simple": 102,
        "multiple": 85,
        "parallel": 48,
        "parallel_multiple": 56,
    }
    assert bfcl_data.overlap(train, val) == []
    questions = {" ".join(m["content"].lower().split()) for t in train for m in t["messages"]}
    assert not any(" ".join(m["content"].lower().split()) in questions for t in val for m in t["messages"])
    calls = {json.dumps(c, sort_keys=True) for t in train for c in t["ground_truth"]}
    assert not any(json.dumps(c, sort_keys=True) in calls for t in val for c in t["ground_truth"])
    # the example of the report: the GCD of 12 and 18 is asked in simple and in multiple, now on one side
    sides = {t["id"]: side for side, tasks in (("train", train), ("val", val)) for t in tasks}
    assert sides["simple_python_24"] == sides["multiple_101"] == "val"
    # the grouping: entries sharing a key are one group, whatever category they are in
    a = {
        "id": "a",
        "number": 1,
        "messages": [{"role": "user", "content": "Q"}],
        "ground_truth": [{"f.g": {"x": [1]}}],
    }
    b = {
        "id": "b",
        "number": 4,
        "messages": [{"role": "user", "content": "other"}],
        "ground_truth": [{"f_g": {"x": [1, 2]}}],
    }
    c = {
        "id": "c",
        "number": 8,
        "messages": [{"role": "user", "content": "  q "}],
        "ground_truth": [{"h": {}}],
    }
    assert (
        bfcl_data.held_out_ids([a, b, c]) == []
    )  # one group (a~b by the call, a~c by the question), led by a
    assert bfcl_data.held_out_ids([b, a, c]) == ["b", "a", "c"]


def test_the_task_files_are_what_the_registry_s_wheel_gives(tmp_path, capsys):
    """Downloads bfcl-eval's wheel (about 1 MB, not installed), checks its digest, reads the four
    categories and compares them with the committed files; a wheel with another digest is refused."""
    bfcl_data = _module("bfcl_data")
    assert bfcl_data.main(["--check", "--wheels", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "1000 entries (0 excluded): 709 train, 291 held out; no held-out question or expected call" in out
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


# -- agreement with BFCL's own AST checker -------------------------------------------------------------


@pytest.fixture(scope="module")
def official(tmp_path_factory):
    """BFCL's own ``ast_checker`` (bfcl-eval's code, from the registry's wheel, not installed: its package
    pulls litellm and every provider's SDK). Its one import that needs those, the model registry, is
    replaced by what it says of an OpenAI function-calling model: dotted names are offered with
    underscores (``underscore_to_dot``)."""
    import importlib
    import sys
    import types
    import zipfile

    bfcl_data = _module("bfcl_data")
    where = tmp_path_factory.mktemp("bfcl")
    try:
        wheel = bfcl_data.fetch_wheel(where)
    except bfcl_data.DataError as exc:  # no registry here: the agreement cannot be checked
        pytest.skip(f"bfcl-eval's wheel is not available: {exc}")
    with zipfile.ZipFile(wheel) as archive:
        wanted = [
            n
            for n in archive.namelist()
            if n.startswith(("bfcl_eval/eval_checker/ast_eval/", "bfcl_eval/constants/"))
            or n in ("bfcl_eval/__init__.py", "bfcl_eval/eval_checker/__init__.py")
        ]
        archive.extractall(where / "src", members=wanted)
    registry = types.ModuleType("bfcl_eval.constants.model_config")
    registry.MODEL_CONFIG_MAPPING = {"agl/policy": types.SimpleNamespace(underscore_to_dot=True)}  # type: ignore[attr-defined]
    saved = {k: v for k, v in sys.modules.items() if k == "bfcl_eval" or k.startswith("bfcl_eval.")}
    sys.path.insert(0, str(where / "src"))
    sys.modules["bfcl_eval.constants.model_config"] = registry
    try:
        checker = importlib.import_module("bfcl_eval.eval_checker.ast_eval.ast_checker")
        language = importlib.import_module("bfcl_eval.constants.enums").Language.PYTHON
        yield lambda category, functions, calls, truth: checker.ast_checker(
            functions, [{n: a} for n, a in calls], truth, language, category, "agl_policy"
        )["valid"]
    finally:
        sys.path.remove(str(where / "src"))
        for name in [k for k in sys.modules if k == "bfcl_eval" or k.startswith("bfcl_eval.")]:
            del sys.modules[name]
        sys.modules.update(saved)


def _perturbed(task: dict, check_module) -> list[tuple[str, list[tuple[str, object]]]]:
    """Outputs a model could give for ``task`` (calls under the names the agent offers): the right answer
    and fixed perturbations of it, each class named."""
    gold = [
        (check_module.tool_name(n), a)
        for n, a in check_module.gold_calls(task["functions"], task["ground_truth"])
    ]
    out = [("gold", gold)]
    # the same calls under BFCL's own names (dotted ones were offered with underscores)
    dotted = [
        (name, args)
        for name, (_, args) in zip((next(iter(c)) for c in task["ground_truth"]), gold, strict=True)
    ]
    if dotted != gold:
        out.append(("BFCL's dotted name", dotted))
    for i, (name, args) in enumerate(gold):
        for key, value in args.items():

            def with_value(new, i=i, name=name, args=args, key=key):
                return [*gold[:i], (name, {**args, key: new}), *gold[i + 1 :]]

            if isinstance(value, list) and value and all(type(v) is int for v in value):
                out.append(("floats in a list of integers", with_value([float(v) for v in value])))
            if isinstance(value, list) and value and all(type(v) is float for v in value):
                out.append(("integers in a list of floats", with_value([int(v) for v in value])))
                out.append(("rounded floats in a list", with_value([float(int(v)) for v in value])))
            if type(value) is int:
                out.append(("float for an integer", with_value(float(value))))
                out.append(("another integer", with_value(value + 1)))
                out.append(("integer as a string", with_value(str(value))))
            if type(value) is float:
                out.append(("integer for a float", with_value(int(value))))
            if isinstance(value, str):
                out.append(("string, case and spacing", with_value(" " + value.upper() + " ")))
                out.append(("another string", with_value(value + "x")))
            if type(value) is bool:
                out.append(("bool as an integer", with_value(int(value))))
            without = {k: v for k, v in args.items() if k != key}
            out.append(("a parameter left out", [*gold[:i], (name, without), *gold[i + 1 :]]))
        out.append(
            ("an undeclared parameter", [*gold[:i], (name, {**args, "extra_param": 1}), *gold[i + 1 :]])
        )
    out.append(("one call too many", [*gold, gold[0]]))
    if len(gold) > 1:
        out.append(("calls in reverse order", gold[::-1]))
        out.append(("one call too few", gold[:-1]))
    return out


def test_the_checker_agrees_with_bfcls_own_on_perturbed_outputs_of_every_entry(official):
    """Every entry's right answer and its perturbations, scored by this example's checker (through the
    agent's own mapping of offered names) and by bfcl-eval's ``ast_checker``: the verdicts agree on all,
    including the two classes where this checker was once more lenient (a call to BFCL's dotted name where
    the underscored one was offered, integers in a list of floats and floats in a list of integers)."""
    bfcl_check = _module("bfcl_check")
    tried, disagree = Counter(), []
    for task in _tasks("train.jsonl") + _tasks("val.jsonl"):
        for kind, calls in _perturbed(task, bfcl_check):
            ours = bfcl_check.check(
                task["category"],
                task["functions"],
                bfcl_check.offered_calls(calls, task["functions"]),
                task["ground_truth"],
            )[0]
            theirs = official(task["category"], task["functions"], calls, task["ground_truth"])
            tried[kind] += 1
            if ours != theirs:
                disagree.append(f"{task['id']} {kind}: ours {ours}, BFCL {theirs}")
    assert sum(tried.values()) > 5_000 and tried["BFCL's dotted name"] > 50
    assert tried["integers in a list of floats"] > 0 and tried["floats in a list of integers"] > 0
    assert not disagree, f"{len(disagree)} of {sum(tried.values())} disagree:\n" + "\n".join(disagree[:30])
