"""A test kit for code instrumented with agl: the real collector-store, the real gateway in front of a
scripted policy, and tracer providers wired to them, all on ``127.0.0.1`` with free ports.

* :class:`Collector`: the store (SQLite in a temporary file) behind its OTLP/HTTP receiver; read spans
  back with :meth:`Collector.spans` / :meth:`Collector.wait_for_spans`.
* :class:`GatewayServer`: the gateway app in front of any backend, its spans kept in memory and exported
  to a collector; :class:`ScriptedBackend` is a backend whose replies (tool calls included) come from a
  :data:`Script`, with real token ids and logprobs.
* :func:`otlp_tracer_provider` and :class:`InMemoryTracing`: tracer providers for the code under test.
* :class:`AglTestStack`: all three, started and stopped together.

Example, a user's own test::

    from openai import OpenAI

    from agl_core import rollout_scope
    from agl_core.testing import AglTestStack, tool_call


    def test_my_agent_records_its_calls():
        with AglTestStack(script=[tool_call("search", {"q": "agl"}), "Found it."]) as stack:
            with rollout_scope("ro-1", tracer_provider=stack.provider):
                my_agent(OpenAI(base_url=stack.base_url("ro-1"), api_key="x"), model="scripted")
            spans = stack.spans("ro-1")
        assert [s.name for s in spans if s.name.startswith("chat")] == ["chat scripted"] * 2

With pytest, opt in to the fixtures (``agl_stack``, ``agl_collector``, ``agl_memory``; override
``agl_script`` to script the replies) in a ``conftest.py``::

    pytest_plugins = ["agl_core.testing.pytest_plugin"]

``import agl_core`` never imports this package.
"""

from __future__ import annotations

from ._collector import Collector
from ._gateway import GatewayServer
from ._scripted import ByteTokenizer, ChatTokenizer, Script, ScriptedBackend, echo, replies, tool_call
from ._stack import AglTestStack
from ._tracing import InMemoryTracing, otlp_tracer_provider

__all__ = [
    "AglTestStack",
    "ByteTokenizer",
    "ChatTokenizer",
    "Collector",
    "GatewayServer",
    "InMemoryTracing",
    "Script",
    "ScriptedBackend",
    "echo",
    "otlp_tracer_provider",
    "replies",
    "tool_call",
]
