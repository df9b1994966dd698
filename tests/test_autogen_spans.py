"""AutoGen as a real run traces it: ``setup_tracing`` sets the global tracer provider, which AutoGen's
own telemetry also uses. With ``agl_autogen.instrument()`` each agent turn and tool call must appear once
(agl's span), and none of the agent runtime's publish / process / create spans; the LLM calls still join
the gateway's. Run in a fresh interpreter: the global provider can be set once per process."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("autogen_agentchat")

ROOT = Path(__file__).resolve().parent.parent

RUN = """
import asyncio
import json
import sys

sys.path.insert(0, sys.argv[2])

import agl_autogen
from agl_core import setup_tracing
from agl_core.pipeline.spantree import source_of
from agl_core.testing import AglTestStack
from agl_core.tracing import emit_reward, rollout_scope
from agl_core.pipeline.transitions import spans_to_transitions
from agl_trainer.model import load_tokenizer
from tests import _agents

with AglTestStack(
    script=_agents.scenario_script, tokenizer=load_tokenizer("tiny"), model_name="tiny", path=sys.argv[1]
) as stack:
    provider = setup_tracing(stack.collector.url)
    agl_autogen.instrument()
    with rollout_scope("ro-ag", tracer_provider=provider):
        team = _agents.autogen_team("round_robin", stack.base_url("ro-ag"))
        output = asyncio.run(team.run(task="What is 2 + 3?")).messages[-1].content
        emit_reward(1.0, tracer_provider=provider)
    provider.force_flush()
    spans = stack.spans("ro-ag")
    result = spans_to_transitions(spans)
    print(json.dumps({
        "output": output,
        "spans": [[s.name, source_of(s)] for s in spans],
        "transitions": [t.agent_name for t in result.transitions],
        "problems": [p.reason for p in result.problems],
    }))
"""


def test_each_autogen_step_is_one_span_and_runtime_spans_are_gone(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(RUN)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "store.sqlite"), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    names = collections.Counter(name for name, _ in found["spans"])
    steps = [
        (name, source) for name, source in found["spans"] if name.startswith(("invoke_agent", "execute_tool"))
    ]
    # one span per step, all agl's; the round-robin team: triage's turn, solver's turn with two tools
    assert sorted(name for name, _ in steps) == [
        "execute_tool add",
        "execute_tool divide",
        "invoke_agent RoundRobinGroupChat",
        "invoke_agent solver",
        "invoke_agent triage",
    ], steps
    assert all(source == "autogen" for _, source in steps)
    assert not [n for n in names if n.startswith(("autogen ", "create_agent"))], names
    llm_calls = len(found["transitions"])
    assert llm_calls == 4 and found["problems"] == []
    # the rollout span, the steps, and each LLM call twice (framework and gateway), nothing else
    assert len(found["spans"]) == 1 + len(steps) + 2 * llm_calls + 1  # + the reward span
