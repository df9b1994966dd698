"""``AglCallbackHandler``, the LangChain / LangGraph callback that records runs as OpenTelemetry spans,
and ``instrument()`` / ``uninstrument()``, which put it into every run through LangChain's own hook."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from contextvars import ContextVar, Token
from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from agl_core import semconv
from agl_core.capture import agent_header
from agl_core.instrumentation import (
    HookErrors,
    Instrumentor,
    OpenSpan,
    adapter_tracer,
    mark_span_failed,
    start_span,
)
from agl_core.pipeline.spantree import langgraph_role
from agl_core.tracing import mark_span_error, rollout_identity

from . import _convert

__all__ = ["AglCallbackHandler", "instrument", "is_instrumented", "uninstrument"]

#: Chain runs that are not steps of an agent: they get no span, and what runs inside them nests under
#: their parent. Keeps the span count (and the cost per call) down.
_FOLDED_RUN_TYPES = frozenset({"prompt", "parser"})


@dataclasses.dataclass(slots=True)
class _Run(OpenSpan):
    #: The handler recording the run (the only one that ends it).
    owner: AglCallbackHandler | None = None


#: The open runs of every agl handler in the process, by LangChain run id as its 128-bit number (a UUID
#: hashes in Python code, an int does not; an LLM call's ~8 events look runs up a dozen times). One
#: table, so that a run reaching two agl handlers (one given in ``callbacks`` and the one ``instrument()``
#: adds) is recorded once, and each finds the other's runs as parents.
_RUNS: dict[int, _Run] = {}

#: The calling agent each open LLM run set (:mod:`agl_core.capture.agent_header`), by run id (number): put
#: back when the run ends. Only the handler recording a run sets it, so each is put back once.
_AGENT_TOKENS: dict[int, Token[str | None]] = {}

#: Who holds :mod:`agl_core.capture.agent_header`'s httpx hook: :func:`instrument`, or a handler in
#: ``callbacks``.
_HOOK_USER = "langchain"


class AglCallbackHandler(BaseCallbackHandler):
    """Records chat-model / LLM calls, tool calls and chain or graph steps as OpenTelemetry spans.

    Add it to ``callbacks`` (of a model, a runnable, or the run config of a LangGraph graph), or call
    :func:`instrument` to have one in every run. Spans carry the current rollout's identity, follow the
    GenAI conventions, and nest like the LangChain runs do. A run that reaches several agl handlers is
    recorded once: by a handler given in ``callbacks`` rather than by :func:`instrument`'s (of several
    given, by the first one LangChain calls).

    Agent names: ``agent_name``, when given, names everything the handler sees. Otherwise, in a LangGraph
    graph, the outermost of these is an agent step (``invoke_agent``) and names the calls under it: a
    graph compiled with a name of its own (``create_react_agent(..., name="solver")``), else a graph node.
    The nodes of a subgraph run by a node belong to that node's agent.

    The model's requests to an agl gateway (the runner's, or one in ``AGL_GATEWAY_URLS``) carry the
    agent's name in ``x-agl-agent-name`` (:mod:`agl_core.capture.agent_header`): ``on_chat_model_start`` /
    ``on_llm_start`` make it the calling agent, ``on_llm_end`` / ``on_llm_error`` put the previous one
    back. That reaches the request because the handler runs inline (below): LangChain calls it in the
    thread or task that then runs the model, before the model starts the request.
    """

    # Run in the caller's context even for async runnables, so the rollout context is always visible, and
    # the calling agent set at the start of an LLM run is in effect where the model sends its request. (A
    # handler that is not inline is run by async runs on an executor thread, in a copy of the context.)
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
        self._tracer: trace.Tracer | None = None
        self.hook_errors = HookErrors("LangChain")
        #: Whether the handler records runs that start (runs it already records end normally).
        self.recording = True

    # Events the handler has no use for: LangChain skips the call.
    @property
    def ignore_retry(self) -> bool:
        return True

    @property
    def ignore_retriever(self) -> bool:
        return True

    @property
    def ignore_custom_event(self) -> bool:
        return True

    # --- span bookkeeping ----------------------------------------------------------------------------
    # The hooks take a run's key (``run_id.int``) and its parent's record once, and pass them on.
    def _start(
        self,
        key: int,
        parent: _Run | None,
        name: str,
        attributes: dict[str, Any],
        kind: SpanKind = SpanKind.INTERNAL,
        agent: str | None = None,
    ) -> None:
        tracer = self._tracer
        if tracer is None:
            tracer = self._tracer = adapter_tracer(self._tracer_provider)
        rollout = rollout_identity() or (parent.rollout if parent is not None else {})
        span = start_span(
            tracer,
            name,
            source=semconv.SOURCE_LANGCHAIN,
            attributes=attributes,
            rollout=rollout,
            parent=parent,
            kind=kind,
        )
        _RUNS[key] = _Run(span, rollout, agent, False, self)

    def _claims(self, key: int, parent: _Run | None) -> bool:
        """Whether a starting run (``parent``: its parent's record, if open) is this handler's to record:
        it is recording and no agl handler has the run yet."""
        return self.recording and key not in _RUNS

    def _pop(self, key: int) -> trace.Span | None:
        """The run's span to end, when this handler records the run and the span is the run's own."""
        run = _RUNS.get(key)
        if run is None or run.owner is not self:
            return None
        del _RUNS[key]
        return run.span if not run.folded else None

    def _enclosing_agent(self, parent: _Run | None) -> str | None:
        """The agent the parent run belongs to (``agent_name`` when the handler was given one)."""
        if self.agent_name:
            return self.agent_name
        return parent.agent if parent is not None else None

    def _succeed(self, run_id: UUID) -> None:
        # Success leaves the status UNSET, as OpenTelemetry asks of instrumentation libraries.
        span = self._pop(run_id.int)
        if span is not None:
            span.end()

    def _fail(self, run_id: UUID, error: BaseException) -> None:
        span = self._pop(run_id.int)
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
        content: Callable[[], str] | None,
        kwargs: dict[str, Any],
    ) -> None:
        key = run_id.int
        parent = _RUNS.get(parent_run_id.int) if parent_run_id is not None else None
        if not self._claims(key, parent):
            return
        model = _convert.model_name(serialized, kwargs)
        attrs: dict[str, Any] = {semconv.GEN_AI_OPERATION_NAME: operation}
        if model:
            attrs[semconv.GEN_AI_REQUEST_MODEL] = model
        params = kwargs.get("invocation_params") or {}
        if isinstance(params.get("temperature"), (int, float)):
            attrs[semconv.GEN_AI_REQUEST_TEMPERATURE] = float(params["temperature"])
        agent = self._enclosing_agent(parent)
        if agent:
            attrs[semconv.GEN_AI_AGENT_NAME] = agent
            self._name_calling_agent(key, agent)
        if self.capture_content and content is not None:
            attrs[semconv.GEN_AI_INPUT_MESSAGES] = content()
        name = f"{operation} {model}" if model else operation
        self._start(key, parent, name, attrs, SpanKind.CLIENT, agent)

    @staticmethod
    def _name_calling_agent(key: int, agent: str) -> None:
        """Make ``agent`` the calling agent until the run ends. Left alone when it is already (a batch
        starts one run per prompt in a row and ends them in the same order: only the first one's token
        may put the value back, or the last reset would bring the agent back)."""
        agent_header.install_httpx_hook(_HOOK_USER)  # a handler given in callbacks, without instrument()
        if agent_header.current_agent() != agent:
            _AGENT_TOKENS[key] = agent_header.set_agent(agent)

    @staticmethod
    def _release_calling_agent(key: int) -> None:
        token = _AGENT_TOKENS.pop(key, None)
        if token is not None:
            agent_header.reset_agent(token)

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
            content = (lambda: _convert.messages_json(messages)) if self.capture_content else None
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
            content = (lambda: json.dumps(prompts[:1])) if self.capture_content else None
            self._llm_start(semconv.OP_TEXT_COMPLETION, serialized, run_id, parent_run_id, content, kwargs)
        except Exception:
            self.hook_errors.report("on_llm_start")

    def on_llm_end(self, response: Any, *, run_id: UUID, **kwargs: Any) -> None:
        try:
            key = run_id.int
            if _AGENT_TOKENS:
                self._release_calling_agent(key)
            span = self._pop(key)
            if span is None:
                return
            span.set_attributes(_convert.end_attributes(response, capture_content=self.capture_content))
            span.end()
        except Exception:
            self.hook_errors.report("on_llm_end")

    def on_llm_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        try:
            self._release_calling_agent(run_id.int)
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
            key = run_id.int
            parent = _RUNS.get(parent_run_id.int) if parent_run_id is not None else None
            if not self._claims(key, parent):
                return
            if parent is not None and kwargs.get("run_type") in _FOLDED_RUN_TYPES:
                _RUNS[key] = _Run(parent.span, parent.rollout, parent.agent, True, self)
                return
            name = _convert.run_name(serialized, kwargs, "chain")
            attrs: dict[str, Any] = {semconv.GEN_AI_OPERATION_NAME: semconv.OP_STEP}
            agent = self._enclosing_agent(parent)
            starts_agent = parent_run_id is None and agent is not None
            if agent is None and langgraph_role(name, kwargs.get("metadata")):
                agent, starts_agent = name, True
            if starts_agent:
                attrs[semconv.GEN_AI_OPERATION_NAME] = semconv.OP_INVOKE_AGENT
                attrs[semconv.GEN_AI_AGENT_NAME] = agent
            self._start(key, parent, name, attrs, agent=agent)
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
            key = run_id.int
            parent = _RUNS.get(parent_run_id.int) if parent_run_id is not None else None
            if not self._claims(key, parent):
                return
            name = _convert.run_name(serialized, kwargs, "tool")
            attrs: dict[str, Any] = {
                semconv.GEN_AI_OPERATION_NAME: semconv.OP_EXECUTE_TOOL,
                semconv.GEN_AI_TOOL_NAME: name,
            }
            call_id = kwargs.get("tool_call_id") or (kwargs.get("metadata") or {}).get("tool_call_id")
            if isinstance(call_id, str):
                attrs[semconv.GEN_AI_TOOL_CALL_ID] = call_id
            agent = self._enclosing_agent(parent)
            if agent:
                attrs[semconv.GEN_AI_AGENT_NAME] = agent
            self._start(key, parent, f"{semconv.OP_EXECUTE_TOOL} {name}", attrs, agent=agent)
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
            span = self._pop(run_id.int)
            if span is not None:
                mark_span_failed(span, semconv.ERROR_TYPE_TOOL_RESULT, error)
                span.end()
        except Exception:
            self.hook_errors.report("on_tool_end")

    def on_tool_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        try:
            self._fail(run_id, error)
        except Exception:
            self.hook_errors.report("on_tool_error")


# --- instrument / uninstrument -----------------------------------------------------------------------
class _RegisteredHandler(AglCallbackHandler):
    """The handler :func:`instrument` puts into every run. There is one per process, registered once:
    LangChain has no public way to take a configure hook out again, so :func:`uninstrument` switches it
    off instead. Switched off, with no run of any agl handler open, LangChain skips it on every event."""

    def __init__(self) -> None:
        super().__init__()
        self.recording = False

    def configure(
        self, agent_name: str | None, tracer_provider: trace.TracerProvider | None, capture_content: bool
    ) -> None:
        self.agent_name = agent_name
        self.capture_content = capture_content
        self._tracer_provider = tracer_provider
        self._tracer = None
        self.hook_errors = HookErrors("LangChain")

    def _claims(self, key: int, parent: _Run | None) -> bool:
        # LangChain does not keep the order of a run's handlers from parent to child (LangGraph merges
        # callback managers), so a child run may reach this handler before the handler that records its
        # parent: it leaves the run to that one, which gets the run too (inherited from the parent).
        if not self.recording or key in _RUNS:
            return False
        return parent is None or parent.owner is self

    def _idle(self) -> bool:
        return not self.recording and not _RUNS

    @property
    def ignore_llm(self) -> bool:
        return self._idle()

    @property
    def ignore_chat_model(self) -> bool:
        return self._idle()

    @property
    def ignore_chain(self) -> bool:
        return self._idle()

    @property
    def ignore_agent(self) -> bool:  # tool events
        return self._idle()


#: The registered handler, once :func:`instrument` has run.
_registered: _RegisteredHandler | None = None


def _registered_handler() -> _RegisteredHandler:
    global _registered
    if _registered is None:
        from langchain_core.tracers.context import register_configure_hook

        handler = _RegisteredHandler()
        # LangChain adds the value of each registered context variable to the handlers of every run it
        # configures (how its own tracers join runs without a ``callbacks`` argument). The handler is the
        # variable's default, not a value set in a context, so every thread and task sees it.
        hook: ContextVar[AglCallbackHandler | None] = ContextVar("agl_langchain_handler", default=handler)
        register_configure_hook(hook, inheritable=True)
        _registered = handler
    return _registered


def _install(
    agent_name: str | None, tracer_provider: trace.TracerProvider | None, capture_content: bool
) -> AglCallbackHandler:
    handler = _registered_handler()
    handler.configure(agent_name, tracer_provider, capture_content)
    handler.recording = True
    agent_header.install_httpx_hook(_HOOK_USER)
    return handler


def _uninstall(handler: AglCallbackHandler) -> None:
    handler.recording = False  # runs already open end normally
    agent_header.uninstall_httpx_hook(_HOOK_USER)


_instrumentor: Instrumentor[AglCallbackHandler] = Instrumentor(_uninstall)


def instrument(
    *,
    agent_name: str | None = None,
    tracer_provider: trace.TracerProvider | None = None,
    capture_content: bool = False,
) -> AglCallbackHandler:
    """Record every LangChain / LangGraph run of the process, with no ``callbacks`` argument; returns the
    handler that records them (options as :class:`AglCallbackHandler`'s).

    The handler joins each run through LangChain's configure hook, the way LangChain's own tracers do.
    A handler also given in ``callbacks`` records the runs it sees instead (nothing is recorded twice).
    Calling it again while instrumented returns the same handler and changes nothing. Model requests to
    an agl gateway carry the calling agent's name (``x-agl-agent-name``, see :class:`AglCallbackHandler`).
    """
    return _instrumentor.instrument(lambda: _install(agent_name, tracer_provider, capture_content))


def uninstrument() -> None:
    """Stop recording runs that start from now on; runs already recorded end normally. Takes agl's header
    hook off httpx unless another adapter still uses it (a handler given in ``callbacks`` puts it back at
    its next model call)."""
    _instrumentor.uninstrument()


def is_instrumented() -> bool:
    return _instrumentor.is_instrumented()
