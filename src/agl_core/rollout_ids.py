"""The rollout ids agl gives calls and spans that name no rollout of their own.

A session (``x-agl-session-id``, ``session.id``, ``gen_ai.conversation.id``, a request's ``user``...)
is the rollout ``imp-s-<hash of the session id>``, and a trace with neither a rollout nor a session is
the rollout ``imp-t-<trace id in hex>``: the same ids whether the calls were captured by the gateway,
imported from trace files or sent live to ``agl store serve``. Compute them here to inspect or reward
a session's rollout (``agl inspect``, ``agl reward``); the gateway also returns the id on each captured
answer (``x-agl-rollout-id``).
"""

from __future__ import annotations

import hashlib

__all__ = ["session_rollout_id", "trace_rollout_id"]


def session_rollout_id(session: str) -> str:
    """The rollout id of the calls and traces of one session: ``imp-s-<hash of the session id>``. It
    depends only on the session id, so the same session names the same rollout whenever and however it
    is recorded."""
    digest = hashlib.blake2b(session.encode("utf-8", "surrogatepass"), digest_size=12).hexdigest()
    return f"imp-s-{digest}"


def trace_rollout_id(trace_id: bytes | str) -> str:
    """The rollout id of a trace that names no session and no rollout: ``imp-t-<trace id in hex>``
    (``trace_id``: its 16 bytes, or its 32 hex digits)."""
    return f"imp-t-{trace_id.hex() if isinstance(trace_id, bytes) else trace_id.lower()}"
