"""Redaction at ingest: applied to every span before anything is written.

Rules, as given to ``agl store serve --redact RULE`` (repeatable):

=================  ===========================================================================
``key:GLOB``       drop span, event and resource attributes whose key matches GLOB
                   (``key:gen_ai.input.messages``, ``key:http.request.header.*``)
``regex:PATTERN``  replace every match of PATTERN in string values with ``[REDACTED]``
``email``          mask e-mail addresses
``api-key``        mask common API key and token shapes (``sk-...``, ``Bearer ...``, AWS, GitHub)
=================  ===========================================================================

Rules reach every string an OTLP request can carry to disk: resource, scope, span, event and link
attributes (key rules also inside key-value lists, at any depth), span, event and scope names, the scope
version, trace states and status messages, and bytes values read as UTF-8. A value nested deeper than
:data:`MAX_DEPTH` levels cannot be checked and is replaced by the mask. Through the coordination API, a
rollout's input and metadata, a resource's value and an attempt's error text get the same rules
(:meth:`Redactor.redact_json`). Ids (rollout, attempt, task, worker, trace and span ids) and numbers are
never touched: do not put secrets in them.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["MASK", "MAX_DEPTH", "Redactor", "parse_rules"]

MASK = "[REDACTED]"
#: Deepest nesting of arrays / key-value lists checked; anything deeper is masked whole.
MAX_DEPTH = 16
_PRESETS = {
    "email": [r"[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}"],
    "api-key": [
        r"\bsk-[A-Za-z0-9_-]{16,}",
        r"\b(?i:bearer)\s+[A-Za-z0-9._~+/=-]{16,}",
        r"\bAKIA[0-9A-Z]{16}\b",
        r"\bgh[pousr]_[A-Za-z0-9]{30,}\b",
        r"\bxox[abprs]-[A-Za-z0-9-]{10,}",
    ],
}


class Redactor:
    """Drops attributes by key and masks patterns in string values of OTLP protobuf messages, in place."""

    def __init__(self, drop_keys: Sequence[str] = (), patterns: Sequence[str] = ()) -> None:
        self.drop_keys = tuple(drop_keys)
        self._exact = {k for k in self.drop_keys if not any(c in k for c in "*?[")}
        self._globs = [k for k in self.drop_keys if k not in self._exact]
        # Applied one after another: each pattern keeps its own flags.
        self._patterns = [re.compile(p) for p in patterns]

    def __bool__(self) -> bool:
        return bool(self.drop_keys or self._patterns)

    def _dropped(self, key: str) -> bool:
        return key in self._exact or any(fnmatch.fnmatchcase(key, g) for g in self._globs)

    def mask(self, text: str) -> str:
        for pattern in self._patterns:
            text = pattern.sub(MASK, text)
        return text

    def _mask_bytes(self, data: bytes) -> bytes:
        text = data.decode("utf-8", "surrogateescape")
        masked = self.mask(text)
        return data if masked == text else masked.encode("utf-8", "surrogateescape")

    def _clean(self, key_values: Any, depth: int = 0) -> None:
        if self.drop_keys:
            keep = [kv for kv in key_values if not self._dropped(kv.key)]
            if len(keep) != len(key_values):
                copies = [type(kv)() for kv in keep]
                for copy, kv in zip(copies, keep, strict=True):  # one fresh copy per kept pair
                    copy.CopyFrom(kv)
                del key_values[:]
                key_values.extend(copies)
        for kv in key_values:
            self._mask_value(kv.value, depth)

    def _mask_value(self, value: Any, depth: int = 0) -> None:
        kind = value.WhichOneof("value")
        if kind in ("array_value", "kvlist_value") and depth >= MAX_DEPTH:
            value.string_value = MASK  # too deep to check: replaced whole (clears the nested value)
        elif kind == "string_value":
            if self._patterns:
                masked = self.mask(value.string_value)
                if masked != value.string_value:
                    value.string_value = masked
        elif kind == "bytes_value":
            if self._patterns:
                masked_bytes = self._mask_bytes(value.bytes_value)
                if masked_bytes != value.bytes_value:
                    value.bytes_value = masked_bytes
        elif kind == "array_value":
            for item in value.array_value.values:
                self._mask_value(item, depth + 1)
        elif kind == "kvlist_value":
            self._clean(value.kvlist_value.values, depth + 1)

    def _mask_field(self, message: Any, field: str) -> None:
        text = getattr(message, field)
        if text and self._patterns:
            masked = self.mask(text)
            if masked != text:
                setattr(message, field, masked)

    def __call__(self, message: Any) -> None:
        """Redact a ``Resource``, ``InstrumentationScope`` or ``Span`` protobuf message in place."""
        self._clean(message.attributes)
        for field in ("name", "version", "trace_state"):  # whichever the message has
            if field in message.DESCRIPTOR.fields_by_name:
                self._mask_field(message, field)
        if "events" in message.DESCRIPTOR.fields_by_name:
            for event in message.events:
                self._clean(event.attributes)
                self._mask_field(event, "name")
            for link in message.links:
                self._clean(link.attributes)
                self._mask_field(link, "trace_state")
            self._mask_field(message.status, "message")

    def redact_json(self, value: Any, depth: int = 0) -> Any:
        """A copy of a JSON value (a rollout's input or metadata, a resource's value) with the rules
        applied: object keys matching a key rule dropped, patterns masked in strings (keys included),
        anything nested deeper than :data:`MAX_DEPTH` replaced by the mask."""
        if isinstance(value, str):
            return self.mask(value)
        if isinstance(value, dict | list) and depth >= MAX_DEPTH:
            return MASK
        if isinstance(value, list):
            return [self.redact_json(v, depth + 1) for v in value]
        if isinstance(value, dict):
            return {
                self.mask(str(k)): self.redact_json(v, depth + 1)
                for k, v in value.items()
                if not self._dropped(str(k))
            }
        return value


def parse_rules(rules: Iterable[str]) -> Redactor:
    """Build a :class:`Redactor` from rule strings; raises ``ValueError`` naming a bad rule."""
    drop: list[str] = []
    patterns: list[str] = []
    for rule in rules:
        kind, sep, arg = rule.partition(":")
        if not sep and rule in _PRESETS:
            patterns.extend(_PRESETS[rule])
        elif sep and kind == "key" and arg:
            drop.append(arg)
        elif sep and kind == "regex" and arg:
            try:
                re.compile(arg)
            except re.error as exc:
                raise ValueError(f"redaction rule {rule!r}: invalid regular expression: {exc}") from None
            patterns.append(arg)
        else:
            raise ValueError(
                f"redaction rule {rule!r} is not one of key:GLOB, regex:PATTERN, "
                f"{', '.join(sorted(_PRESETS))}"
            )
    return Redactor(drop, patterns)
