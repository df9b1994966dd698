"""Whether a model's function calls answer a BFCL entry, by the rules of BFCL's AST checker.

BFCL (the Berkeley Function Calling Leaderboard) scores its single-turn categories by comparing the calls a
model made with the entry's ground truth: for every parameter, the list of values it accepts (``""`` in
that list: the parameter may be left out). The rules, as BFCL v4 applies them to Python entries and as
this module implements them:

- the call names a function of the entry; every ``required`` parameter is given; no parameter is given
  that the function does not declare or that the ground truth does not list; every parameter the ground
  truth lists and does not mark optional is given;
- the call names the function as it was offered: BFCL's dotted names (``math.factorial``) are offered
  as ``math_factorial`` (OpenAI's names hold no dots), and a call to the dotted name is a call to a
  function that was not offered (:func:`offered_calls`);
- a value has the declared type (``string``, ``integer``, ``float``, ``boolean``, ``array``/``tuple``,
  ``dict``, ``any`` as a string); an integer is accepted for a float, but not inside a list (nor a float
  for an integer); ``True`` is not an integer. A value of the type the accepted values have (a variable's
  name written as a string) is compared as it is;
- strings compare after removing spaces and ``,./-_*^``, lower-cased, ``'`` read as ``"``; so do the
  strings inside lists and dicts; other values compare with ``==``;
- ``simple`` and ``multiple``: exactly one call, checked against the one expected function;
  ``parallel`` and ``parallel_multiple``: as many calls as expected, each expected call matched to a
  different call in any order (the first call that matches it, expected calls taken in order).

:func:`check` returns ``(True, "")`` or ``(False, reason)``; the reason says what failed, for the
example's error analysis.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

#: BFCL's declared types as the Python types a JSON-decoded value has.
TYPES: dict[str, type] = {
    "string": str,
    "integer": int,
    "float": float,
    "boolean": bool,
    "array": list,
    "tuple": list,
    "dict": dict,
    "any": str,
}
CATEGORIES = ("simple", "multiple", "parallel", "parallel_multiple")
_STRIP = re.compile(r"[ ,./\-_*^]")


def standardize(text: str) -> str:
    """A string as BFCL compares it: no spaces or ``,./-_*^``, lower case, ``'`` as ``"``."""
    return _STRIP.sub("", text).lower().replace("'", '"')


def _standard(value: Any) -> Any:
    return standardize(value) if isinstance(value, str) else value


def _accepted_type(accepted: Sequence[Any]) -> type | None:
    """The type of the first accepted value that is not the ``""`` marking an optional parameter."""
    for item in accepted:
        if item != "":
            return type(item)
    return None


def _typed(name: str, value: Any, spec: Mapping[str, Any], accepted: Sequence[Any]) -> tuple[str, bool]:
    """``(problem, variable)``: why ``value`` has the wrong type for ``spec`` (``""`` if it has not), and
    whether it is compared as it is, as a variable's value, rather than by the declared type's rules."""
    declared = str(spec.get("type", "string"))
    expected = TYPES.get(declared, str)
    kind = _accepted_type(accepted)
    # accepted values of another type than the declared one name variables
    variable = kind is not None and kind is not expected
    if type(value) is expected:
        if expected is not list or "items" not in spec:
            return "", variable
        declared_items = str(spec["items"].get("type", "string"))
        inner = TYPES.get(declared_items, str)
        # the items are checked only against accepted values that are lists (an accepted "" passes), each
        # of the declared type or of the type that accepted list's values have (variables); no int for a
        # float inside a list, nor a float for an int
        for a in accepted:
            if not isinstance(a, list):
                return "", variable
            item_kind = _accepted_type(a)
            if all(type(i) is inner or (item_kind is not None and type(i) is item_kind) for i in value):
                return "", variable
        return f"{name}: {value!r} holds items that are not {declared_items}", False
    if kind is type(value):
        return "", True
    return f"{name}: {value!r} is {type(value).__name__}, expected {declared}", False


def _dict_matches(value: Mapping[str, Any], accepted: Mapping[str, Any]) -> bool:
    for key, item in value.items():
        if key not in accepted or _standard(item) not in [_standard(a) for a in accepted[key]]:
            return False
    return all(key in value or "" in options for key, options in accepted.items())


def _value_matches(value: Any, spec: Mapping[str, Any], accepted: Sequence[Any]) -> bool:
    expected = TYPES.get(str(spec.get("type", "string")), str)
    if expected is dict:
        return any(isinstance(a, Mapping) and _dict_matches(value, a) for a in accepted)
    if expected is list:
        inner = spec.get("items", {}).get("type")
        if inner == "dict":
            return any(
                isinstance(a, list)
                and len(a) == len(value)
                and all(isinstance(v, Mapping) and _dict_matches(v, d) for v, d in zip(value, a, strict=True))
                for a in accepted
            )
        ours = [_standard(item) for item in value]
        return any(isinstance(a, list) and ours == [_standard(item) for item in a] for a in accepted)
    if expected is str:
        return standardize(value) in [standardize(a) for a in accepted if isinstance(a, str)]
    return value in accepted


def check_call(function: Mapping[str, Any], arguments: Mapping[str, Any], expected: Mapping[str, Any]) -> str:
    """Why one call with ``arguments`` to ``function`` does not match ``expected`` (parameter -> accepted
    values); ``""`` when it does."""
    parameters = function.get("parameters", {})
    properties = parameters.get("properties", {})
    for name in parameters.get("required", []):
        if name not in arguments:
            return f"missing required parameter {name!r}"
    for name, value in arguments.items():
        if name not in properties or name not in expected:
            return f"unexpected parameter {name!r}"
        spec, accepted = properties[name], expected[name]
        if spec.get("type") == "float" and type(value) is int:
            value = float(value)
        problem, variable = _typed(name, value, spec, accepted)
        if problem:
            return problem
        if not (value in accepted if variable else _value_matches(value, spec, accepted)):
            return f"{name}: {value!r} is not one of {accepted!r}"
    for name, accepted in expected.items():
        if name not in arguments and "" not in accepted:
            return f"missing parameter {name!r}"
    return ""


def tool_name(name: str) -> str:
    """The name a BFCL function is offered under: OpenAI's names hold no dots."""
    return name.replace(".", "_")


def offered_calls(
    calls: Sequence[tuple[str, Any]], functions: Sequence[Mapping[str, Any]]
) -> list[tuple[str, Any]]:
    """Calls as the model made them (the offered tool names) as calls to BFCL's functions: a name that was
    not offered (BFCL's own dotted name among them) stays what it was, marked so that it matches none."""
    names = {tool_name(str(f["name"])): str(f["name"]) for f in functions}
    return [(names.get(called, f"{called} (not offered)"), arguments) for called, arguments in calls]


def _function(functions: Sequence[Mapping[str, Any]], name: str) -> Mapping[str, Any] | None:
    return next((f for f in functions if f.get("name") == name), None)


def check(
    category: str,
    functions: Sequence[Mapping[str, Any]],
    calls: Sequence[tuple[str, Mapping[str, Any]]],
    ground_truth: Sequence[Mapping[str, Mapping[str, Any]]],
) -> tuple[bool, str]:
    """Whether ``calls`` (function name, decoded arguments), in the order made, answer an entry of
    ``category`` whose ``functions`` were offered and whose ``ground_truth`` is BFCL's possible answer."""
    if category not in CATEGORIES:
        raise ValueError(f"unknown BFCL category {category!r}; one of {', '.join(CATEGORIES)}")
    if len(calls) != len(ground_truth):
        return False, f"{len(calls)} call(s), expected {len(ground_truth)}"
    used: set[int] = set()
    for wanted in ground_truth:
        ((name, expected),) = wanted.items()
        function = _function(functions, name)
        if function is None:
            raise ValueError(f"the ground truth names {name!r}, which the entry does not offer")
        reasons = []
        for index, (called, arguments) in enumerate(calls):
            if index in used:
                continue
            reason = (
                check_call(function, arguments, expected)
                if called == name
                else f"called {called!r}, expected {name!r}"
            )
            if not reason:
                used.add(index)
                break
            reasons.append(reason)
        else:
            return False, "; ".join(reasons)
    return True, ""


def _gold_value(accepted: Sequence[Any]) -> Any:
    value = next(a for a in accepted if a != "")
    if isinstance(value, Mapping):
        return {k: _gold_value(v) for k, v in value.items() if any(a != "" for a in v)}
    if isinstance(value, list) and value and all(isinstance(item, Mapping) for item in value):
        return [{k: _gold_value(v) for k, v in item.items() if any(a != "" for a in v)} for item in value]
    return value


def gold_calls(
    functions: Sequence[Mapping[str, Any]], ground_truth: Sequence[Mapping[str, Mapping[str, Any]]]
) -> list[tuple[str, dict[str, Any]]]:
    """One right answer to an entry: each expected call with the first accepted value of every parameter
    the function declares and the ground truth does not leave optional-only."""
    calls = []
    for wanted in ground_truth:
        ((name, expected),) = wanted.items()
        declared = (_function(functions, name) or {}).get("parameters", {}).get("properties", {})
        arguments = {
            key: _gold_value(accepted)
            for key, accepted in expected.items()
            if key in declared and any(a != "" for a in accepted)
        }
        calls.append((name, arguments))
    return calls
