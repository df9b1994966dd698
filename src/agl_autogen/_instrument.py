"""``instrument()`` / ``uninstrument()`` for AutoGen AgentChat.

AgentChat has no callback API. What it does have is its own telemetry: every agent invocation runs
inside ``trace_invoke_agent_span`` and every tool call inside ``trace_tool_span`` (autogen-core's GenAI
span helpers). Those are the hook points used here: agl wraps them where AgentChat calls them, so the
step is recorded as agl's span (with the rollout identity, through agl's tracer provider); AutoGen's own
span of the same step, and the agent runtime's publish / process / create spans, record nothing while
agl instruments (each step appears once in the span tree; ``uninstrument()`` turns them back on). Two
places have no such helper and are wrapped directly: a team's ``run_stream`` (the team as an agent step)
and the model clients' ``create`` / ``create_stream`` (the LLM calls of the OpenAI-compatible client and
of the Anthropic one).
``uninstrument()`` puts every original back.

The model clients do not expose the completion id, and AgentChat has no per-call option to add a header
to their requests, so their LLM spans are joined to gateway spans by order within the rollout, checked
against the token counts the client reports (see :mod:`agl_core.pipeline.transitions`).

Each model-client call runs with the agent whose turn it is (the team's, for a selector's own calls) as
the calling agent of :mod:`agl_core.capture.agent_header`: the client's HTTP requests to an agl gateway carry
it in ``x-agl-agent-name``. The client sends them from this task (or from tasks it starts here, which copy its
context), so the name is in effect where each request is sent.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import logging
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextvars import ContextVar
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from agl_core import semconv
from agl_core.capture import agent_header
from agl_core.instrumentation import HookErrors, Instrumentor, Patches, adapter_tracer, start_span
from agl_core.tracing import context_rollout_attributes, mark_span_error

from . import _convert

__all__ = ["instrument", "is_instrumented", "uninstrument"]

logger = logging.getLogger(__name__)

#: The agent whose turn is running in this context (for LLM and tool spans).
_current_agent: ContextVar[str | None] = ContextVar("agl_autogen_agent", default=None)

# Call sites of autogen-core's telemetry helpers that get agl's wrapper (modules under these prefixes).
_CALL_SITE_PREFIXES = ("autogen_agentchat.", "autogen_core.tools.")
_CALL_SITE_MODULES = (
    "autogen_agentchat.agents._base_chat_agent",
    "autogen_agentchat.teams._group_chat._chat_agent_container",
    "autogen_core.tools._base",
)


class _Silent:
    """A tracer whose spans record nothing and change nothing: each is a non-recording view of the span
    current where it starts, so what runs inside still nests under agl's span. AutoGen's own spans go
    through it while agl instruments, so each agent turn and tool call appears once (as agl's span), and
    the runtime's publish / process / create spans not at all."""

    def start_span(self, name: str, *args: Any, context: Any = None, **kwargs: Any) -> trace.Span:
        return trace.NonRecordingSpan(trace.get_current_span(context).get_span_context())

    def start_as_current_span(
        self, name: str, *args: Any, context: Any = None, **kwargs: Any
    ) -> contextlib.AbstractContextManager[trace.Span]:
        # nullcontext, not a generator-based context manager: AgentChat enters one per agent turn
        return contextlib.nullcontext(self.start_span(name, context=context))


_SILENT = _Silent()


def _bound(method: Any, instance: Any) -> Any:
    """``method`` bound to ``instance`` the way attribute access would (another instrumentor's wrapper,
    such as OpenInference's, needs to see the instance)."""
    return method.__get__(instance, type(instance))


@dataclasses.dataclass
class _Tracing:
    tracer: trace.Tracer
    capture_content: bool
    hooks: HookErrors
    #: False after ``uninstrument()`` when a wrapper could not be taken out (see :func:`uninstrument`).
    active: bool = True

    def start(self, name: str, attrs: dict[str, Any], kind: SpanKind = SpanKind.INTERNAL) -> trace.Span:
        # No run table: AgentChat's calls nest as Python calls do, so the current span is the parent.
        return start_span(
            self.tracer,
            name,
            source=semconv.SOURCE_AUTOGEN,
            attributes=attrs,
            rollout=context_rollout_attributes(),
            kind=kind,
        )

    @contextlib.contextmanager
    def step(
        self,
        hook: str,
        name: str,
        attrs: Callable[[], dict[str, Any]],
        *,
        agent: str | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
    ) -> Iterator[trace.Span | None]:
        """Run the block under a new span (current for the block), as ``agent``'s turn when given.

        Errors of the block are recorded on the span (ERROR status) and re-raised untouched; agl's own
        errors are reported (once) and the block runs on without the span.
        """
        if not self.active:
            yield None
            return
        span = self.hooks.call(hook, lambda: self.start(name, attrs(), kind))
        token = otel_context.attach(trace.set_span_in_context(span)) if span is not None else None
        agent_token = _current_agent.set(agent) if agent else None
        try:
            yield span
        except Exception as exc:
            if span is not None:
                self.hooks.call(hook, mark_span_error, span, exc)
            raise
        finally:  # success leaves the status UNSET, as OpenTelemetry asks of instrumentation libraries
            if agent_token is not None:
                try:
                    _current_agent.reset(agent_token)
                except ValueError:  # ended in another context (an abandoned generator)
                    pass
            if token is not None:
                otel_context.detach(token)
            if span is not None:
                span.end()

    # --- agent invocations and tool calls (wrapping autogen-core's span helpers) --------------------
    def wrap_helper(
        self,
        original: Callable[..., Any],
        *,
        operation: str,
        name_key: str,
        attributes: Callable[[str, dict[str, Any]], dict[str, Any]],
        is_agent: bool,
    ) -> Callable[..., Any]:
        """A replacement for ``trace_invoke_agent_span`` / ``trace_tool_span``: agl's span around the
        original's (called with the same arguments)."""

        @contextlib.contextmanager
        @functools.wraps(original)
        def helper(*args: Any, **kwargs: Any) -> Iterator[Any]:
            name = str(kwargs.get(name_key, args[0] if args else operation))
            with self.step(
                operation,
                f"{operation} {name}",
                lambda: attributes(name, kwargs),
                agent=name if is_agent else None,
            ):
                # AutoGen's own span of the same step would be a second copy of agl's: silenced
                with original(
                    *args, **{**kwargs, "tracer": _SILENT if self.active else kwargs.get("tracer")}
                ) as inner:
                    yield inner

        return helper

    def wrap_agent_helper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        return self.wrap_helper(
            original,
            operation=semconv.OP_INVOKE_AGENT,
            name_key="agent_name",
            is_agent=True,
            attributes=lambda name, kw: _convert.agent_attributes(
                name, kw.get("agent_id"), kw.get("agent_description")
            ),
        )

    def wrap_tool_helper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        return self.wrap_helper(
            original,
            operation=semconv.OP_EXECUTE_TOOL,
            name_key="tool_name",
            is_agent=False,
            attributes=lambda name, kw: _convert.tool_attributes(
                name, kw.get("tool_call_id"), _current_agent.get()
            ),
        )

    def silence(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """One of autogen-core's span helpers, recording nothing while agl instruments."""

        @functools.wraps(original)
        def helper(*args: Any, **kwargs: Any) -> Any:
            return original(*args, **{**kwargs, "tracer": _SILENT if self.active else kwargs.get("tracer")})

        return helper

    def wrap_trace_block(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """The agent runtime's message spans (publish, send, process, create): silent while agl
        instruments; they carry no step of the agent, only the runtime's plumbing."""

        @contextlib.contextmanager
        @functools.wraps(original)
        def trace_block(helper: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
            if not self.active:
                with original(helper, *args, **kwargs) as span:
                    yield span
                return
            yield _SILENT.start_span("autogen runtime")

        return trace_block

    # --- teams ---------------------------------------------------------------------------------------
    def wrap_run_stream(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        async def run_stream(team: Any, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
            name = str(getattr(team, "name", None) or type(team).__name__)

            def attrs() -> dict[str, Any]:
                return _convert.agent_attributes(name, None, None)

            # The team's runtime starts inside the first step of the stream, so it inherits this span
            # and the rollout context; its members' turns nest under it.
            with self.step("run_stream", f"{semconv.OP_INVOKE_AGENT} {name}", attrs, agent=name):
                async for item in _bound(original, team)(*args, **kwargs):
                    yield item

        return run_stream

    # --- model client calls --------------------------------------------------------------------------
    def _llm_step(self, hook: str, client: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # The model name is only kept in the client's create arguments (a private attribute).
        model = (getattr(client, "_create_args", None) or {}).get("model")
        messages = kwargs.get("messages", args[0] if args else None)

        def attrs() -> dict[str, Any]:
            return _convert.llm_start_attributes(
                model, messages, _current_agent.get(), capture_content=self.capture_content
            )

        name = f"{semconv.OP_CHAT} {model}" if model else semconv.OP_CHAT
        return self.step(hook, name, attrs, kind=SpanKind.CLIENT)

    def _end_llm(self, hook: str, span: trace.Span | None, result: Any) -> None:
        if span is not None:
            self.hooks.call(
                hook,
                lambda: span.set_attributes(
                    _convert.llm_end_attributes(result, capture_content=self.capture_content)
                ),
            )

    def _calling_agent(self) -> contextlib.AbstractContextManager[None]:
        """The agent whose turn it is, named on the call's HTTP requests (to a known agl gateway)."""
        return agent_header.agent_scope(_current_agent.get() if self.active else None)

    def wrap_create(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        async def create(client: Any, *args: Any, **kwargs: Any) -> Any:
            with self._llm_step("create", client, args, kwargs) as span, self._calling_agent():
                result = await _bound(original, client)(*args, **kwargs)
                self._end_llm("create", span, result)
            return result

        return create

    def wrap_create_stream(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        async def create_stream(client: Any, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
            with self._llm_step("create_stream", client, args, kwargs) as span, self._calling_agent():
                async for item in _bound(original, client)(*args, **kwargs):
                    if not isinstance(item, str):  # the CreateResult that ends the stream
                        self._end_llm("create_stream", span, item)
                    yield item

        return create_stream


# --- instrument / uninstrument -----------------------------------------------------------------------
@dataclasses.dataclass
class _Installed:
    tracing: _Tracing
    patches: Patches


def _helper_call_sites(helper: Any) -> list[tuple[Any, str]]:
    """Every module that AgentChat calls ``helper`` from (each holds its own reference to it)."""
    for name in _CALL_SITE_MODULES:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    sites = []
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(_CALL_SITE_PREFIXES):
            continue
        for attribute, value in list(vars(module).items()):
            if value is helper:
                sites.append((module, attribute))
    return sites


#: Who holds :mod:`agl_core.capture.agent_header`'s httpx hook while AutoGen is instrumented.
_HOOK_USER = "autogen"

#: The model clients whose ``create`` / ``create_stream`` are traced: ``(module, class)``, each where its
#: autogen-ext extra (``openai``, ``anthropic``) is installed.
_MODEL_CLIENTS = (
    ("autogen_ext.models.openai", "BaseOpenAIChatCompletionClient"),
    ("autogen_ext.models.anthropic", "BaseAnthropicChatCompletionClient"),
)


def _model_clients() -> list[type[Any]]:
    found = []
    for module_name, class_name in _MODEL_CLIENTS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # that extra is not installed: no such model client to trace
            continue
        found.append(getattr(module, class_name))
    return found


def _install(tracer_provider: trace.TracerProvider | None, capture_content: bool) -> _Installed:
    # AgentChat has no callback API: agl replaces the bindings listed in the module docstring, and
    # uninstrument() puts the originals back.
    from autogen_agentchat.teams import BaseGroupChat
    from autogen_core._telemetry import (
        TraceHelper,
        trace_create_agent_span,
        trace_invoke_agent_span,
        trace_tool_span,
    )

    tracing = _Tracing(adapter_tracer(tracer_provider), capture_content, HookErrors("AutoGen"))
    patches = Patches()
    try:
        for helper, wrap in (
            (trace_invoke_agent_span, tracing.wrap_agent_helper),
            (trace_tool_span, tracing.wrap_tool_helper),
        ):
            wrapper = wrap(helper)
            for module, attribute in _helper_call_sites(helper):
                patches.replace(module, attribute, wrapper)
        silenced = tracing.silence(trace_create_agent_span)  # an agent's construction is not a step
        for module, attribute in _helper_call_sites(trace_create_agent_span):
            patches.replace(module, attribute, silenced)
        patches.replace(
            BaseGroupChat, "run_stream", tracing.wrap_run_stream(BaseGroupChat.__dict__["run_stream"])
        )
        patches.replace(
            TraceHelper, "trace_block", tracing.wrap_trace_block(TraceHelper.__dict__["trace_block"])
        )
        for Client in _model_clients():
            patches.replace(Client, "create", tracing.wrap_create(Client.__dict__["create"]))
            patches.replace(
                Client, "create_stream", tracing.wrap_create_stream(Client.__dict__["create_stream"])
            )
        agent_header.install_httpx_hook(_HOOK_USER)
    except BaseException:
        patches.restore()
        raise
    return _Installed(tracing, patches)


def _uninstall(installed: _Installed) -> None:
    agent_header.uninstall_httpx_hook(_HOOK_USER)
    if not installed.patches.restore():
        installed.tracing.active = False
        logger.info("agl: AutoGen was instrumented again after agl; agl's wrappers stay, switched off")


_instrumentor: Instrumentor[_Installed] = Instrumentor(_uninstall)


def instrument(*, tracer_provider: trace.TracerProvider | None = None, capture_content: bool = False) -> None:
    """Record AutoGen AgentChat agents, teams, tool calls and model-client calls as OpenTelemetry spans.

    Agent turns (alone or in a round-robin, selector or swarm team) become ``invoke_agent`` spans named
    after the agent, a team's run an ``invoke_agent`` span named after the team (the selector's model
    calls belong to it), tool calls ``execute_tool`` spans with the call id and error status, and the
    calls of the OpenAI-compatible and Anthropic model clients ``chat`` spans with usage and, with
    ``capture_content=True``, the messages. Calling it again while instrumented changes nothing.

    The model clients' requests to an agl gateway (the runner's, or one in ``AGL_GATEWAY_URLS``) carry
    the name of the agent whose turn it is in ``x-agl-agent-name`` (see :mod:`agl_core.capture.agent_header`).
    """
    _instrumentor.instrument(lambda: _install(tracer_provider, capture_content))


def uninstrument() -> None:
    """Put back every original agl replaced (and take agl's header hook off httpx, unless another adapter
    still uses it); spans already open finish normally.

    Where another instrumentor wrapped a method after agl did, taking agl's wrapper out would take
    theirs out too: agl's wrapper stays there, switched off. Uninstrument in the reverse order of
    instrumenting to get the exact originals back.
    """
    _instrumentor.uninstrument()


def is_instrumented() -> bool:
    return _instrumentor.is_instrumented()
