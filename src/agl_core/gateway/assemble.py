"""Turning sampled token ids into the text (and tool calls) a client sees, incrementally.

Used by backends that sample tokens themselves. The rules are the same streamed or not, so a streamed
answer concatenates to exactly the non-streamed one: text is released once it can no longer turn into a
stop string, a tool-call opener or half a UTF-8 character; a stop string ends the choice and is cut from
the text (its tokens stay in the recorded response ids, as the model produced them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .tools import ToolFormat, held_back, parse_tool_calls, tool_call_start

__all__ = ["TextAssembler"]


class TextAssembler:
    """Accumulates one choice's tokens; :meth:`push` returns text that is safe to stream.

    Use one per choice: :meth:`push` every sampled token (stop sampling once :attr:`stopped`), then call
    :meth:`finish` once. ``decode`` turns the whole id list so far into text (it is called with all ids
    on each push, so multi-token characters come out whole). ``stop`` strings end the choice and are cut
    from the text; with ``tool_format`` set, text from the format's tool-call opener on is held back and
    parsed into tool calls by :meth:`finish` (``forced_name`` names the function when the request forced
    one). The streamed deltas plus :meth:`finish`'s last delta concatenate to its ``content``.
    :attr:`ids` holds every pushed id, stop strings included; :attr:`text` the decoded text so far.
    """

    def __init__(
        self,
        decode: Callable[[Sequence[int]], str],
        *,
        stop: Sequence[str] = (),
        tool_format: ToolFormat | None = None,
        forced_name: str | None = None,
    ) -> None:
        self._decode = decode
        self._stop = [s for s in stop if s]
        self._tool_format = tool_format
        self._forced_name = forced_name
        self._markers = list(self._stop) + ([tool_call_start(tool_format)] if tool_format else [])
        self.ids: list[int] = []
        self.text = ""
        self.stopped = False
        self._sent = 0
        self._pending: list[Mapping[str, Any]] = []
        #: After :meth:`finish`: the text opened a tool call that could not be parsed.
        self.tool_call_unparseable = False

    def push(
        self, token_id: int, logprob_entry: Mapping[str, Any] | None = None
    ) -> tuple[str, list[Mapping[str, Any]]]:
        """Add a token; returns ``(new text to stream, logprob entries released with it)``.
        After a stop string :attr:`stopped` is true and the choice must end."""
        self.ids.append(token_id)
        if logprob_entry is not None:
            self._pending.append(logprob_entry)
        text = self._decode(self.ids)
        if self._stop:
            cuts = [at for at in (text.find(s) for s in self._stop) if at >= 0]
            if cuts:
                text = text[: min(cuts)]
                self.stopped = True
        self.text = text
        if text.endswith("\ufffd") and not self.stopped:
            return "", []
        return self._release(text, final=self.stopped)

    def _release(self, text: str, *, final: bool) -> tuple[str, list[Mapping[str, Any]]]:
        visible = text
        if self._tool_format:
            at = text.find(tool_call_start(self._tool_format))
            if at >= 0:
                visible = text[:at]
        hold = (
            0
            if final and not self._tool_format
            else held_back(visible, self._markers, whitespace=bool(self._tool_format))
        )
        releasable = visible[: len(visible) - hold]
        if len(releasable) <= self._sent:
            return "", []
        new = releasable[self._sent :]
        self._sent = len(releasable)
        released, self._pending = self._pending, []
        return new, released

    def finish(self) -> tuple[str | None, list[dict[str, Any]], str, list[Mapping[str, Any]]]:
        """``(content, tool_calls, last text delta, last logprob entries)`` once the choice has ended."""
        text = self.text if self.stopped else self._decode(self.ids)
        calls: list[dict[str, Any]] = []
        content: str | None = text
        if self._tool_format:
            content, calls = parse_tool_calls(text, self._tool_format, forced_name=self._forced_name)
            if calls:
                content = content.rstrip() or None
            else:
                self.tool_call_unparseable = tool_call_start(self._tool_format) in text
        shown = content or ""
        delta = shown[self._sent :] if len(shown) > self._sent else ""
        self._sent = max(self._sent, len(shown))
        released, self._pending = self._pending, []
        return content, calls, delta, released
