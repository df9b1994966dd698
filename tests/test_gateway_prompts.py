"""Prompt policies served by the gateway (/agl/v1/prompt): a versioned system instruction and few-shot
turns per agent, applied to that agent's calls with no change to the agent, recorded on every span (and
in its token ids), published, replaced and withdrawn with the admin token."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from agl_core import semconv
from agl_core.gateway.prompts import PromptPolicy, parse_prompt_policy
from agl_core.testing import GatewayServer, ScriptedBackend

ADMIN = {"authorization": "Bearer admin"}
SOLVER = {
    "version": 2,
    "agent": "solver",
    "system": "Answer with the number only.",
    "demonstrations": [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}],
}


class _Recording(ScriptedBackend):
    """Replies "ok" and keeps the messages of every call, as the model got them."""

    def __init__(self) -> None:
        self.seen: list[list[dict[str, Any]]] = []
        super().__init__(lambda messages, tools: self.seen.append([dict(m) for m in messages]) or "ok")


def _chat(gateway: GatewayServer, agent: str | None, system: str | None = "Be kind.") -> httpx.Response:
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": "3 + 5?"}
    ]
    prefix = f"/agents/{agent}" if agent else ""
    body = {"model": "scripted", "messages": messages}
    return httpx.post(f"{gateway.url}{prefix}/v1/chat/completions", json=body, timeout=30)


def test_a_prompt_is_applied_to_its_agent_recorded_and_withdrawn():
    backend = _Recording()
    with GatewayServer(backend, admin_token="admin") as gateway, httpx.Client() as http:
        url = gateway.url + "/agl/v1/prompt"
        assert http.post(url, json=SOLVER).status_code == 401  # no admin token
        assert http.post(url, json=SOLVER, headers=ADMIN).status_code == 200
        assert _chat(gateway, "solver").status_code == 200
        assert backend.seen[-1] == [
            {"role": "system", "content": "Answer with the number only."},  # replaced
            {"role": "user", "content": "2 + 2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "3 + 5?"},
        ]
        assert _chat(gateway, "writer").status_code == 200  # another agent: untouched
        assert backend.seen[-1][0] == {"role": "system", "content": "Be kind."} and len(backend.seen[-1]) == 2
        spans = [s for s in gateway.spans() if semconv.POLICY_VERSION in (s.attributes or {})]
        solver, writer = spans[-2], spans[-1]
        assert (
            solver.attributes[semconv.PROMPT_VERSION] == 2
            and solver.attributes[semconv.PROMPT_SCOPE] == "solver"
        )
        assert semconv.PROMPT_VERSION not in writer.attributes
        # the token ids the span records are those of the prompt the model saw
        prompt_ids = list(solver.attributes[semconv.PROMPT_TOKEN_IDS])
        assert "Answer with the number only." in backend.tokenizer.decode(prompt_ids)
        # one for every other agent, prepended to the agent's own instruction
        every = {"version": 7, "agent": None, "system": "Be brief.", "mode": "prepend"}
        assert http.post(url, json=every, headers=ADMIN).status_code == 200
        _chat(gateway, "writer")
        assert backend.seen[-1][0]["content"] == "Be brief.\n\nBe kind."
        _chat(gateway, None, system=None)  # no agent, no system message of its own: one is inserted
        assert backend.seen[-1][0] == {"role": "system", "content": "Be brief."}
        listed = http.get(url).json()["prompts"]
        assert [(p["agent"], p["version"]) for p in listed] == [(None, 7), ("solver", 2)]
        assert http.delete(url, params={"agent": "solver"}, headers=ADMIN).status_code == 200
        assert http.delete(url, params={"agent": "solver"}, headers=ADMIN).status_code == 404
        _chat(gateway, "solver")
        assert backend.seen[-1][0]["content"] == "Be brief.\n\nBe kind."  # now the one for every agent
        metrics = http.get(gateway.url + "/metrics").text
        assert "agl_gateway_prompts 1" in metrics and "agl_gateway_prompt_changes_total 3" in metrics


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ([1], "not an object"),
        ({"version": -1, "system": "x"}, "version must be an integer"),
        ({"version": True, "system": "x"}, "version must be an integer"),
        ({"version": 1}, "needs a system instruction, demonstrations, or both"),
        ({"version": 1, "system": 5}, "system must be a string"),
        ({"version": 1, "system": "x", "mode": "append"}, "mode must be"),
        ({"version": 1, "demonstrations": [{"role": "assistant", "content": "4"}]}, "alternate"),
        ({"version": 1, "demonstrations": [{"role": "user", "content": "2 + 2?"}]}, "end with an assistant"),
        ({"version": 1, "demonstrations": [{"role": "user", "content": 4}]}, "demonstrations\\[0\\]"),
        ({"version": 1, "system": "x", "agent": ""}, "agent must be"),
        ({"version": 1, "system": "x" * 300_000}, "more than 256,000"),
        ({"version": 1, "system": "x", "extra": 1}, "unknown field 'extra'"),
    ],
)
def test_a_bad_prompt_is_refused_with_what_was_wrong(body, message):
    with pytest.raises(ValueError, match=message):
        parse_prompt_policy(body)


def test_a_bad_prompt_over_http_is_a_400_and_changes_nothing():
    with GatewayServer(_Recording(), admin_token="admin") as gateway, httpx.Client() as http:
        url = gateway.url + "/agl/v1/prompt"
        for raw in (b"{", b"[]", b'{"version": 1}'):
            answer = http.post(url, content=raw, headers=ADMIN)
            assert answer.status_code == 400 and "expected" in answer.json()["error"]["message"]
        assert http.get(url).json() == {"prompts": []}


def test_demonstrations_go_after_every_leading_instruction():
    policy = PromptPolicy(1, None, None, "replace", (("user", "q"), ("assistant", "a")))
    messages = [
        {"role": "system", "content": "s"},
        {"role": "developer", "content": "d"},
        {"role": "user", "content": "u"},
    ]
    assert [m["content"] for m in policy.apply(messages)] == ["s", "d", "q", "a", "u"]
