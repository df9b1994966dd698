"""``AglCallbackHandler``: the one line a LangChain / LangGraph user adds to make an agent trainable."""

from __future__ import annotations

import json
from typing import Any, NamedTuple
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from agl_core import semconv
from agl_core._hooks import HookErrors
from agl_core.spantree import langgraph_role
from agl_core.tracing import get_tracer, mark_span_error, rollout_attributes

from . import _convert

__all__ = ["AglCallbackHandler"]

#: Chain runs that are not steps of an agent: they get no span, and what runs inside them nests under
#: their parent. Keeps the span count (and the cost per call) down.
_FOLDED_RUN_TYPES = frozenset({"prompt", "parser"})


class _Run(NamedTuple):
    span: trace.Span
    rollout: dict[str, str]
    agent: str | None
    #: False for a folded run, which shares its parent's span.
    owns_span: bool


class AglCallbackHandler(BaseCallbackHandler):
    """Records chat-model / LLM calls, tool calls and chain or graph steps as OpenTelemetry spans.

    Add it to ``callbacks`` (of a model, a runnable, or the run config of a LangGraph graph). Spans carry
    the current rollout's identity, follow the GenAI conventions, and nest like the LangChain runs do.

    Agent names: ``agent_name``, when given, names everything the handler sees. Otherwise, in a LangGraph
    graph, the outermost of these is an agent step (``invoke_agent``) and names the calls under it: a
    graph compiled with a name of its own (``create_react_agent(..., name="solver")``), else a graph node.
    The nodes of a subgraph run by a node belong to that node's agent.
    """

    # Run in the caller's context even for async runnables, so the rollout context is always visible.
    run_inline = True
    raise_error = False

    def __init__(
        self,
        *,
        agent_name: str | None = None,
        tracer_provider: trace.TracerProvider | None = None,
        capture_content: bool = False,
    ) -> None:
        super().__init__()
        self.agent_name = agent_name
        self.capture_content = capture_content
        self._tracer_provider = tracer_provider
        # One entry per open run. Each operation on it is a single dict operation (atomic under the GIL), and
        # a run's start and end never race, so no lock is needed across threads.
        self._runs: dict[UUID, _Run] = {}
        self._tracer: trace.Tracer | None = None
        self.hook_errors = HookErrors("LangChain")

    # --- span bookkeeping ----------------------------------------------------------------------------
    def _start(
        self,
        run_id: UUID,
        parent_run_id: UUID | None,
        name: str,
        attributes: dict[str, Any],
        kind: SpanKind = SpanKind.INTERNAL,
        agent: str | None = None,
    ) -> trace.Span:
        if self._tracer is None:
            self._tracer = get_tracer(self._tracer_provider)
        parent = self._runs.get(parent_run_id) if parent_run_id else None
        if parent is not None:
            ctx = trace.set_span_in_context(parent.span)
            rollout = rollout_attributes() or parent.rollout
        else:
            ctx = otel_context.get_current()
            rollout = rollout_attributes()
        # identity first: the store finds it fastest there
        attrs = {**rollout, semconv.SOURCE: semconv.SOURCE_LANGCHAIN, **attributes}
        span = self._tracer.start_span(name, context=ctx, kind=kind, attributes=attrs)
        self._runs[run_id] = _Run(span, rollout, agent, True)
        return span

    def _pop(self, run_id: UUID) -> trace.Span | None:
        run = self._runs.pop(run_id, None)
        return run.span if run is not None and run.owns_span else None

    def _enclosing_agent(self, parent_run_id: UUID | None) -> str | None:
        """The agent the parent run belongs to (``agent_name`` when the handler was given one)."""
        if self.agent_name:
            return self.agent_name
        parent = self._runs.get(parent_run_id) if parent_run_id else None
        return parent.agent if parent is not None else None

    def _succeed(self, run_id: UUID) -> None:
        # Success leaves the status UNSET, as OpenTelemetry asks of instrumentation libraries.
        span = self._pop(run_id)
        if span is not None:
            span.end()

    def _fail(self, run_id: UUID, error: BaseException) -> None:
        span = self._pop(run_id)
        if span is not None:
            mark_span_error(span, error)
            span.end()

    # --- LLM calls -----------------------------------------------------------------------------------
    # Every hook catches its own errors inline (a decorator would re-pack LangChain's many keyword
    # arguments on each of the ~8 events of an LLM call; this is the hot path).
    def _llm_start(
        self,
        operation: str,
        serialized: dict[str, Any] | None,
        run_id: UUID,
        parent_run_id: UUID | None,
        content: str | None,
        kwargs: dict[str, Any],
    ) -> None:
        model = _convert.model_name(serialized, kwargs)
        attrs: dict[str, Any] = {semconv.GEN_AI_OPERATION_NAME: operation}
        if model:
            attrs[semconv.GEN_AI_REQUEST_MODEL] = model
        params = kwargs.get("invocation_params") or {}
        if isinstance(params.get("temperature"), (int, float)):
            attrs[semconv.GEN_AI_REQUEST_TEMPERATURE] = float(params["temperature"])
        agent = self._enclosing_agent(parent_run_id)
        if agent:
            attrs[semconv.GEN_AI_AGENT_NAME] = agent
        if self.capture_content and content is not None:
            attrs[semconv.GEN_AI_INPUT_MESSAGES] = content
        name = f"{operation} {model}" if model else operation
        self._start(run_id, parent_run_id, name, attrs, SpanKind.CLIENT, agent)

    def on_chat_model_start(
        self,
        serialized: dict[str, Any],
        messages: list[list[Any]],
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        **kwargs: Any,
    ) -> None:
        try:
            content = _convert.messages_json(messages) if self.capture_content else None
            self._llm_start(semconv.OP_CHAT, serialized, run_id, parent_run_id, content, kwargs)
        except Exception:
            self.hook_errors.report("on_chat_model_start")

    def on_llm_start(
        self,
        serialized: dict[str, Any],
        prompts: list[str],
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        **kwargs: Any,
    ) -> None:
        try:
            content = json.dumps(prompts[:1]) if self.capture_content else None
            self._llm_start(semconv.OP_TEXT_COMPLETION, serialized, run_id, parent_run_id, content, kwargs)
        except Exception:
            self.hook_errors.report("on_llm_start")

    def on_llm_end(self, response: Any, *, run_id: UUID, **kwargs: Any) -> None:
        try:
            span = self._pop(run_id)
            if span is None:
                return
            span.set_attributes(_convert.end_attributes(response, capture_content=self.capture_content))
            span.end()
        except Exception:
            self.hook_errors.report("on_llm_end")

    def on_llm_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        try:
            self._fail(run_id, error)
        except Exception:
            self.hook_errors.report("on_llm_error")

    # --- chains / graph nodes ------------------------------------------------------------------------
    def on_chain_start(
        self,
        serialized: dict[str, Any] | None,
        inputs: Any,
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        **kwargs: Any,
    ) -> None:
        try:
            if kwargs.get("run_type") in _FOLDED_RUN_TYPES and parent_run_id in self._runs:
                parent = self._runs[parent_run_id]
                self._runs[run_id] = _Run(parent.span, parent.rollout, parent.agent, False)
                return
            name = _convert.run_name(serialized, kwargs, "chain")
            attrs: dict[str, Any] = {semconv.GEN_AI_OPERATION_NAME: semconv.OP_STEP}
            agent = self._enclosing_agent(parent_run_id)
            starts_agent = parent_run_id is None and agent is not None
            if agent is None and langgraph_role(name, kwargs.get("metadata")):
                agent, starts_agent = name, True
            if starts_agent:
                attrs[semconv.GEN_AI_OPERATION_NAME] = semconv.OP_INVOKE_AGENT
                attrs[semconv.GEN_AI_AGENT_NAME] = agent
            self._start(run_id, parent_run_id, name, attrs, agent=agent)
        except Exception:
            self.hook_errors.report("on_chain_start")

    def on_chain_end(self, outputs: Any, *, run_id: UUID, **kwargs: Any) -> None:
        try:
            self._succeed(run_id)
        except Exception:
            self.hook_errors.report("on_chain_end")

    def on_chain_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        try:
            self._fail(run_id, error)
        except Exception:
            self.hook_errors.report("on_chain_error")

    # --- tools ---------------------------------------------------------------------------------------
    def on_tool_start(
        self,
        serialized: dict[str, Any] | None,
        input_str: str,
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        **kwargs: Any,
    ) -> None:
        try:
            name = _convert.run_name(serialized, kwargs, "tool")
            attrs: dict[str, Any] = {
                semconv.GEN_AI_OPERATION_NAME: semconv.OP_EXECUTE_TOOL,
                semconv.GEN_AI_TOOL_NAME: name,
            }
            call_id = kwargs.get("tool_call_id") or (kwargs.get("metadata") or {}).get("tool_call_id")
            if isinstance(call_id, str):
                attrs[semconv.GEN_AI_TOOL_CALL_ID] = call_id
            agent = self._enclosing_agent(parent_run_id)
            if agent:
                attrs[semconv.GEN_AI_AGENT_NAME] = agent
            self._start(run_id, parent_run_id, f"{semconv.OP_EXECUTE_TOOL} {name}", attrs, agent=agent)
        except Exception:
            self.hook_errors.report("on_tool_start")

    def on_tool_end(self, output: Any, *, run_id: UUID, **kwargs: Any) -> None:
        try:
            # A tool with ``handle_tool_error`` / ``handle_validation_error`` turns its failure into a
            # ToolMessage with status "error" and ends normally: still a failed tool call.
            error = _convert.tool_result_error(output)
            if error is None:
                self._succeed(run_id)
                return
            span = self._pop(run_id)
            if span is not None:
                span.set_attribute(semconv.ERROR_TYPE, semconv.ERROR_TYPE_TOOL_RESULT)
                span.set_status(Status(StatusCode.ERROR, error))
                span.end()
        except Exception:
            self.hook_errors.report("on_tool_end")

    def on_tool_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        try:
            self._fail(run_id, error)
        except Exception:
            self.hook_errors.report("on_tool_error")
