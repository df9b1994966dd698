"""Production capture: calls that name no rollout become rollouts of the session they belong to.

With capture on (``agl gateway serve --capture``), a call that names no rollout (no rollout-scoped URL, no
``x-agl-rollout-id`` header) is attributed to its session, found in this order:

1. the ``x-agl-session-id`` header;
2. the body's ``metadata.session_id`` (Chat Completions, Completions, Responses, Messages);
3. the trace id of the W3C ``traceparent`` header: every call of one agent trace joins one rollout;
4. the body's user, the last resort: OpenAI's ``user`` or Anthropic's ``metadata.user_id``. It names a user,
   not a session: all the sessions of one user merge into one rollout.

A session named by 1, 2 or 4 is the rollout ``agl import`` gives the traces carrying that ``session.id``
(:func:`~agl_core.importer.session_rollout_id`), and the call's span carries ``session.id`` and
``agl.rollout.id``; a trace (3) is the rollout ``agl import`` gives a trace without a session
(:func:`~agl_core.importer.trace_rollout_id`). A session captured live and the same session imported from
files therefore land in one rollout. A call that names none of these is recorded without a rollout, as
without capture; a call that names a rollout keeps it.

The value chosen is checked: a string of 1 to :data:`SESSION_ID_MAX_LENGTH` characters without control
characters or lone surrogates; otherwise the call is refused with a 400 naming the field.

Each session's rollout is recorded in the store once (``POST /api/rollouts/observed``, metadata
``{"source": "gateway", "named_by": <field>, "session.id" | "trace_id": ...}``) by a background thread:
new sessions are batched for a moment, registered sessions are remembered in a bounded LRU, and a store
that is down is logged once and retried with backoff. The call never waits for the store.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from .. import semconv
from ..rollout_ids import session_rollout_id, trace_rollout_id
from ..store import StoreClient
from ..store.base import RolloutRequest
from ._door import SessionHint
from ._schema import RequestError

__all__ = ["SESSION_ID_MAX_LENGTH", "Capture", "CapturedSession", "captured_session", "check_session_id"]

logger = logging.getLogger(__name__)

#: Longest session id, in characters (OpenAI's limit on a metadata value).
SESSION_ID_MAX_LENGTH = 512
#: Value of ``source`` in the metadata of the rollouts capture records.
SOURCE = "gateway"
_propagator = TraceContextTextMapPropagator()
#: Most rollouts registered in one store call.
_BATCH = 1000


@dataclasses.dataclass(frozen=True)
class CapturedSession:
    """The rollout a call without one is attributed to, and what named it."""

    rollout_id: str
    #: ``session.id`` for the call's span; ``None`` for a trace's rollout (the span is in that trace).
    session_id: str | None
    #: The rollout's metadata in the store.
    metadata: Mapping[str, str]


#: Unicode categories a session id may not hold: format characters (bidirectional overrides, zero-width
#: characters) and line / paragraph separators.
_INVISIBLE = frozenset({"Cf", "Zl", "Zp"})


def check_session_id(value: object, field: str) -> str:
    """``value`` when it can name a session, else :class:`RequestError` naming ``field``: a string of 1 to
    :data:`SESSION_ID_MAX_LENGTH` characters without control characters (C0, DEL, C1), lone surrogates
    (which no span can carry), format characters (U+202E, zero-width ones) or line separators (U+2028)."""
    if not isinstance(value, str):
        raise RequestError(f"{field} must be a string naming the session, got {type(value).__name__}", field)
    problem = None
    if not value:
        problem = "it is empty"
    elif len(value) > SESSION_ID_MAX_LENGTH:
        problem = f"it is {len(value)} characters long, more than {SESSION_ID_MAX_LENGTH}"
    elif any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in value):
        problem = "it contains a control character"
    elif any(0xD800 <= ord(c) < 0xE000 for c in value):
        problem = "it contains a lone surrogate (not valid Unicode text)"
    elif (odd := next((c for c in value if unicodedata.category(c) in _INVISIBLE), None)) is not None:
        problem = (
            f"it contains U+{ord(odd):04X}, an invisible, line-breaking or direction-changing character"
            " (a session id shown in logs and the dashboard must read as what it is)"
        )
    if problem is not None:
        raise RequestError(f"{field} cannot name a session: {problem}", field)
    return value


def _header(raw: str | None) -> str | None:
    """A header value as the UTF-8 text the client sent (servers decode header bytes as latin-1)."""
    if raw is None:
        return None
    try:
        return raw.encode("latin-1").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        raise RequestError(
            f"{semconv.HEADER_SESSION_ID} cannot name a session: it is not UTF-8 text",
            semconv.HEADER_SESSION_ID,
        ) from None


def traceparent_trace_id(headers: Mapping[str, str]) -> bytes | None:
    """The trace id of a valid W3C ``traceparent`` header, or ``None``."""
    if semconv.HEADER_TRACEPARENT not in headers:
        return None
    context = _propagator.extract({semconv.HEADER_TRACEPARENT: headers[semconv.HEADER_TRACEPARENT]})
    span_context = trace.get_current_span(context).get_span_context()
    return span_context.trace_id.to_bytes(16, "big") if span_context.is_valid else None


def captured_session(header: str | None, hint: SessionHint, trace_id: bytes | None) -> CapturedSession | None:
    """The session of a call that names no rollout (see the module docstring for the order), from the
    ``x-agl-session-id`` header value (as received), the body's :class:`SessionHint` and the trace id of
    its ``traceparent``; ``None`` when nothing names one. Raises :class:`RequestError` for a bad value."""
    named: tuple[str, Any] | None = None
    if header is not None:
        named = (semconv.HEADER_SESSION_ID, _header(header))
    elif hint.session is not None:
        named = hint.session
    elif trace_id is not None:
        hex_id = trace_id.hex()
        metadata = {"source": SOURCE, "named_by": semconv.HEADER_TRACEPARENT, "trace_id": hex_id}
        return CapturedSession(trace_rollout_id(trace_id), None, metadata)
    elif hint.user is not None:
        named = hint.user
    if named is None:
        return None
    field, value = named
    session = check_session_id(value, field)
    metadata = {"source": SOURCE, "named_by": field, semconv.SESSION_ID: session}
    return CapturedSession(session_rollout_id(session), session, metadata)


class Capture:
    """Production capture for a gateway (``create_gateway_app(..., capture=Capture(store_url))``).

    ``store_url`` and ``token`` reach the store's API (default: ``AGL_STORE_URL`` / ``AGL_STORE_TOKEN``),
    where each session's rollout is registered; the gateway's spans reach the store through its tracer
    provider, as without capture. ``register`` replaces the store call (a function taking a list of
    rollout requests), for embedding. At most ``capacity`` registered sessions are remembered (the least
    recently seen are forgotten, and registered again, harmlessly, when they come back) and at most
    ``capacity`` wait while the store is down (the oldest are dropped then, with a warning). New sessions
    wait ``debounce_s`` seconds to be registered together; a failed registration is retried after
    ``retry_s`` seconds, doubling up to ``max_retry_s``. Thread-safe; :meth:`close` when done.
    """

    def __init__(
        self,
        store_url: str | None = None,
        *,
        token: str | None = None,
        register: Callable[[list[RolloutRequest]], object] | None = None,
        capacity: int = 65_536,
        debounce_s: float = 0.2,
        retry_s: float = 1.0,
        max_retry_s: float = 30.0,
        timeout_s: float = 5.0,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._client: StoreClient | None = None
        if register is None:
            self._client = StoreClient(store_url, token=token, timeout_s=timeout_s)
            register = self._client.add_observed_rollouts
        #: Where rollouts are registered (the store's URL), for messages.
        self.target = self._client.url if self._client is not None else "the registrar"
        self._register = register
        self.capacity = capacity
        self.debounce_s = debounce_s
        self.retry_s = retry_s
        self.max_retry_s = max_retry_s
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._done: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._pending: collections.OrderedDict[str, RolloutRequest] = collections.OrderedDict()
        self._thread: threading.Thread | None = None
        self._closing = False
        self._failing = False
        self._busy = False
        #: Rollouts registered (or found registered) in the store so far.
        self.registered = 0
        #: Sessions dropped unregistered because too many waited while the store was down.
        self.dropped = 0

    # -- the request path -------------------------------------------------------------------------------

    def session_of(self, headers: Mapping[str, str], hint: SessionHint) -> CapturedSession | None:
        """The session of a call that names no rollout, from its headers and its body's hint; raises
        :class:`RequestError` for a bad value."""
        return captured_session(headers.get(semconv.HEADER_SESSION_ID), hint, traceparent_trace_id(headers))

    def note(self, session: CapturedSession) -> None:
        """Make sure ``session``'s rollout is registered in the store, soon; never blocks on the store."""
        rollout_id = session.rollout_id
        with self._lock:
            if rollout_id in self._done:
                self._done.move_to_end(rollout_id)
                return
            if rollout_id in self._pending or self._closing:
                return
            self._pending[rollout_id] = {
                "rollout_id": rollout_id,
                "task_id": rollout_id,
                "metadata": dict(session.metadata),
            }
            if len(self._pending) > self.capacity:
                self._pending.popitem(last=False)
                self.dropped += 1
                if self.dropped == 1:
                    logger.warning(
                        "agl gateway capture: more than %d new sessions wait for the store; the oldest are"
                        " dropped unregistered (their spans keep their rollout ids)",
                        self.capacity,
                    )
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="agl-capture", daemon=True)
                self._thread.start()
            self._wake.notify_all()

    # -- the background thread --------------------------------------------------------------------------

    def _sleep(self, seconds: float) -> None:
        """Wait ``seconds``, or less when :meth:`close` is called; the lock is held."""
        if not self._closing:
            self._wake.wait_for(lambda: self._closing, timeout=seconds)

    def _run(self) -> None:
        delay = self.retry_s
        while True:
            with self._lock:
                self._wake.wait_for(lambda: bool(self._pending) or self._closing)
                if not self._pending:
                    return
                self._sleep(self.debounce_s)  # let the other new sessions of a burst arrive
                closing = self._closing
                batch = list(self._pending.values())[:_BATCH]
                self._busy = True
            try:
                self._register(batch)
            except Exception as exc:  # the store is down or refuses: the calls go on, retried later
                with self._lock:
                    self._busy = False
                    self._wake.notify_all()
                    if not self._failing:
                        self._failing = True
                        logger.warning(
                            "agl gateway capture: cannot register %d session rollout(s) at %s (%s); retrying"
                            " every %g s at most, the calls are served meanwhile",
                            len(batch),
                            self.target,
                            exc,
                            self.max_retry_s,
                        )
                    if closing:
                        return
                    self._sleep(delay)
                delay = min(delay * 2, self.max_retry_s)
                continue
            delay = self.retry_s
            with self._lock:
                self._busy = False
                for request in batch:
                    rollout_id = request["rollout_id"]
                    self._pending.pop(rollout_id, None)
                    self._done[rollout_id] = None
                    self._done.move_to_end(rollout_id)
                while len(self._done) > self.capacity:
                    self._done.popitem(last=False)
                self.registered += len(batch)
                if self._failing:
                    self._failing = False
                    logger.warning("agl gateway capture: the store at %s answers again", self.target)
                self._wake.notify_all()

    # -- life cycle -----------------------------------------------------------------------------------

    def pending(self) -> Sequence[str]:
        """The rollout ids waiting to be registered."""
        with self._lock:
            return list(self._pending)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until no session waits to be registered (or ``timeout_s``); whether none waits."""
        with self._lock:
            return self._wake.wait_for(lambda: not self._pending and not self._busy, timeout=timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Register what waits (one try, within ``timeout_s``), stop the thread, close the store client."""
        with self._lock:
            self._closing = True
            thread = self._thread
            self._wake.notify_all()
        if thread is not None:
            thread.join(timeout_s)
        if self._client is not None:
            self._client.close()
